"""What every pass shares: the result it returns, a copy of the graph to rewrite, and how it names a place.

A pass is a function Graph -> PassResult; it never mutates its input graph. Its result carries the new graph (or
the input itself, uncopied, where the pass found nothing to rewrite or refuse: `calls_any`) and a report: where it
rewrote, and where it matched but refused (with the reason), so that dumps and the compile report can say what
fired where and what was left to the fallback.
"""

from __future__ import annotations

import copy
import operator
import os
from dataclasses import dataclass, field

import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes


@dataclass
class PassResult:
    name: str
    graph: torch.fx.Graph
    rewrites: list[str] = field(default_factory=list)  # locations, in graph order
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)

    def rewrote(self, where: str) -> None:
        self.rewrites.append(where)

    def refused(self, where: str, reason: str) -> None:
        self.refusals.append((where, reason))


def calls_any(graph: torch.fx.Graph, *targets) -> bool:
    """Whether `graph` calls any of `targets`, from FX's index of call sites: a pass whose every site starts at
    such a call returns its input uncopied where there is none (a copy costs ~0.25 s a pass at full model depth)."""
    return any(graph.find_nodes(op="call_function", target=target) for target in targets)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy with the same nodes (meta included), so that a pass can rewrite without touching its input: what
    Graph.graph_copy makes, each node created without arguments and given them by assignment (torch 2.13's
    create_node walks a call's arguments for raw symbolic sizes, ~30% of copying a deep graph; the copy's arguments
    are the original's, which passed that check)."""
    new = torch.fx.Graph()
    values: dict = {}
    output = None
    for node in graph.nodes:
        if node.op == "output":
            output = torch.fx.node.map_arg(node.args[0], values.__getitem__)
            break
        made = values[node] = new.create_node(node.op, node.target, name=node.name, type_expr=node.type)
        made.args = torch.fx.node.map_arg(node.args, values.__getitem__)
        if node.kwargs:
            made.kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
        made.meta = copy.copy(node.meta)
    new.output(output)
    return new


def location_of(node: torch.fx.Node) -> str:
    """'file.py:123 (forward)' of the model source line that produced node, else the node's name."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return node.name
    # 'File "/path/modeling_llama.py", line 76, in forward'
    parts = frames[-1].split(",")
    path = parts[0].removeprefix("File ").strip('"')
    line = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
    function = parts[2].strip().removeprefix("in ") if len(parts) > 2 else "?"
    return f"{os.path.basename(path)}:{line} ({function})"


class Refusal(Exception):
    """Raised inside a matcher: this site matches the pattern's start but cannot be rewritten; the message says
    why, and the pass records it with PassResult.refused."""


# node.meta key of a get_attr node whose module attribute is a 0-d tensor: its value (a Python number). Passes run
# on copies of the captured graph (and regions.flatten's graph), without the module that holds its constants.
CONSTANT = "dzc_constant"


def note_scalar_constants(graph: torch.fx.Graph, module: torch.nn.Module) -> None:
    """Record in each get_attr node of `graph` whose attribute of `module` is a plain 0-d tensor its value
    (CONSTANT): a model's `torch.tensor(0.0, device=d)`, which Dynamo lifts into a constant."""
    for node in graph.find_nodes(op="get_attr"):
        try:
            value = operator.attrgetter(node.target)(module)
        except AttributeError:
            continue
        if type(value) is torch.Tensor and value.dim() == 0 and not value.is_meta:
            with _disable_current_modes():  # passes run under the compile's fake mode; this value is real
                node.meta[CONSTANT] = value.item()


def fake_value(node):
    """The fake tensor (or SymInt) a node carries from capture; None for non-nodes and nodes without one."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def call_with_fake_value(graph: torch.fx.Graph, target, args: tuple, trace: str | None = None,
                         kwargs: dict | None = None, like: torch.fx.Node | None = None) -> torch.fx.Node:
    """A new call of target(*args, **kwargs) at the graph's insertion point, its fake value computed from the
    arguments' in the graph's fake mode (what later passes and lowering read), with `trace` as its stack trace if
    given. A factory (no tensor argument) takes the fake mode of node `like`'s value."""
    kwargs = kwargs or {}
    values = torch.fx.node.map_arg(args, fake_value)
    leaves = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, FakeTensor)]
    mode = (leaves[0] if leaves else fake_value(like)).fake_mode
    node = graph.call_function(target, args, kwargs)
    with mode:
        node.meta["val"] = target(*values, **kwargs)
    if trace:
        node.meta["stack_trace"] = trace
    return node


def read_element(read: torch.fx.Node):
    """(tensor node, index) when `read` (a `.item()`: _local_scalar_dense) reads one element of a 1-D integer tensor
    of fixed length through a select, else None."""
    select = read.args[0]
    if not is_call(select, torch.ops.aten.select.int) or select.args[1] != 0 or not isinstance(select.args[2], int):
        return None
    value = fake_value(select.args[0])
    if (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point
            or not isinstance(value.shape[0], int)):
        return None
    index = select.args[2]
    return select.args[0], index if index >= 0 else index + value.shape[0]


def is_call(node, *targets) -> bool:
    """Whether `node` is a call of one of `targets` (OpOverloads or Python callables)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _aliases_an_input(node: torch.fx.Node) -> bool:
    """Whether `node`'s result is (part of) one of its arguments: a view, or an in-place op's result."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The value `node` aliases, through views, in-place results and the items of list-returning views (split);
    `node` itself where it aliases nothing."""
    while node.op == "call_function" and (
            _aliases_an_input(node) or (node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
                                        and _aliases_an_input(node.args[0]))):
        node = node.args[0]
    return node


def written_values(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The values (bases of views: view_base) that some node of `graph` writes in place."""
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write:
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(item, torch.fx.Node):
                        written.add(view_base(item))
    return written


def written_inputs(graph: torch.fx.Graph) -> set[int]:
    """Positions of the graph's inputs that it writes in place (through views too): a KV cache, say."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    written = written_values(graph)
    return {i for i, node in enumerate(placeholders) if node in written}
