"""Repeated layers handed to Inductor once: the inlined copies of a region body, outlined again as invoke_subgraph.

dzc's passes run over the flat graph, where each nested compile region's calls are copies of its rewritten body
(regions.flatten), so that they find the sites that cross a layer's boundary. Inductor, which compiles the ops no
pass fused (the fallback), then lowers, schedules and generates code for every layer's copy of them: at the
multimodal model's full depth (61 decoder + 32 vision layers) 133 of a 226 s cold compile on an H100 host
(docs/results/compile_time_h200.md, session 40). Inductor lowers an invoke_subgraph body once for all its calls
(ir.InvokeSubgraph.create lowers a Subgraph on its first call) and emits it as one function.

    %a = ...                                         %a = ...
    %1 = aten.mul(%a, %w0)    # call L0 of body B    %b = get_attr[dzc_outlined_0]
    %2 = aten.add(%1, %a)     # call L0 of body B    %c0 = invoke_subgraph(%b, "dzc_outlined_0", %a, %w0)
    %3 = aten.mul(%2, %w1)    # call L1 of body B  ⇒ %2 = getitem(%c0, 0)
    %4 = aten.add(%3, %2)     # call L1 of body B    %c1 = invoke_subgraph(%b, "dzc_outlined_0", %2, %w1)
    output(%4)                                       %4 = getitem(%c1, 0); output(%4)

The nodes of one call are those regions.flatten tagged with it (`CALL`) that the passes and the lowering kept; the
graph around them is left as it is. A call is outlined only where that equals the flat graph:
- its nodes are pure (no side effects, no mutated input, no data-dependent size: Inductor's subgraphs are
  functional and lowered once for the sizes of its first call);
- it reads no memory the graph writes in place (a KV cache): such a read stays in the graph and cuts the call,
  like a write. Inductor orders an invoke_subgraph call against the writes into its operands' memory wrongly on
  the GPU (session 43, H100: every outlined decode step 33-86% off its fp32 oracle, with or without CUDA graphs,
  and within eager's error where the cache writes stay functional, reinplace_cache_writes left out);
- it reads a tensor (Inductor places an invoke_subgraph call on its operands' device: a body of sizes only fails
  to lower);
- it can be put in one place: after the last value it reads from outside, before the first use of a value it
  gives (its nodes' span holds no side effect or write, so moving them within it changes no value read). Where
  the caller computes a value the call reads after using one the call gives (the multimodal model's DSA layers:
  the caller's views of the call's values, and the fused attention reading them, lie between its nodes), the call
  is split there in two parts, each outlined (or refused) on its own;
- views of a value the graph writes in place stay outside, where they are (a body's outputs are its own buffers,
  which would not see the write), and so does every view the call gives: a body's outputs may alias neither its
  inputs nor each other (Inductor's C++ code crashed on bodies returning their input's view, and on a body
  returning q, k, v unbound from one projection, or computed NaN: session 43-44); the body gives their base;
- another call has the same nodes in the same order, reading its inputs in the same places, with the same
  constants and the same dtypes, sizes and strides everywhere (the body is built from the first such call and
  lowered once for all of them);
- calls are placed in graph order, and a call whose output a call placed before it reads stays inlined (where
  two calls' nodes interleave).
Calls a pass rewrote across their boundary (a fused residual norm) lose tagged nodes or gain new ones and no longer
match their siblings; they stay inlined. Nothing here runs for the eager fallback, which has no per-node cost to
save; where Inductor fails on the outlined graph, dzc/capture.py compiles the flat one.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dzc.passes.graph_pass import view_base, written_values

# node.meta key regions.flatten sets on each node it copies from a body: (body attribute, call node's name).
CALL = "dzc_region_call"
# The reason a call is split in two (Outlined.cuts): the caller computes a value the call reads after it used one the
# call gives.
SPLIT = "a value of the caller's that it reads after giving one"
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


@dataclasses.dataclass
class Outlined:
    """What outline_repeated_calls did: bodies made and calls outlined, and why other calls were not."""

    bodies: int = 0
    calls: int = 0
    nodes: int = 0  # flat-graph nodes now inside bodies (each body's nodes counted once per call)
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> calls (or parts of calls)
    cuts: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> nodes that cut a call in two

    def describe(self) -> str:
        text = f"{self.bodies} bodies for {self.calls} calls ({self.nodes} nodes)"
        if self.refused:
            text += "; left inlined: " + ", ".join(f"{n} ({why})" for why, n in sorted(self.refused.items()))
        if self.cuts:
            text += "; calls cut at: " + ", ".join(f"{n} x {why}" for why, n in sorted(self.cuts.items()))
        return text


def _value_key(value) -> object:
    """A hashable description of a node's value: dtype, sizes, strides (symbolic sizes by expression)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
                str(value.device))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_value_key(v) for v in value))
    return ("value", type(value).__name__, str(value))


def _constant_key(value) -> object:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value if not isinstance(value, float) else repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_constant_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _constant_key(v)) for k, v in sorted(value.items())))
    return ("object", id(value))  # anything else matches only itself


class _Call:
    """One call's nodes in the flat graph, its inputs (values read from outside, in first-use order), its
    outputs (its values read outside), and the key two calls share where one body serves both."""

    def __init__(self, nodes: list[torch.fx.Node], position: dict[torch.fx.Node, int], written: set[torch.fx.Node]):
        # Views of a value the graph writes stay outside, where they are (a cache slot's view that the cache write
        # then fills), and so does every view the call would give: a body's outputs may alias neither its inputs
        # nor each other (module docstring); the views' base is given instead. (Views it only reads stay in: a
        # body's sizes must follow from its inputs'.) So does an item of an outside op's results: the body reads
        # the item, not the op's tuple.
        nodes = [node for node in nodes if not (view_base(node) is not node and view_base(node) in written)]
        while True:
            members = set(nodes)
            aliasing = {node for node in nodes if view_base(node) is not node
                        and any(user not in members for user in node.users)}
            if not aliasing:
                break
            nodes = [node for node in nodes if node not in aliasing]
        nodes = [node for node in nodes if not (node.target is operator.getitem and node.args[0] not in nodes)]
        self.nodes = nodes
        self.members = members = set(nodes)
        index = {node: i for i, node in enumerate(nodes)}
        self.inputs: list[torch.fx.Node] = []
        inputs: dict[torch.fx.Node, int] = {}
        self.why = ""
        shape = []
        for node in nodes:
            def local(arg):
                if isinstance(arg, torch.fx.Node):
                    if arg in members:
                        return ("node", index[arg])
                    if arg not in inputs:
                        inputs[arg] = len(self.inputs)
                        self.inputs.append(arg)
                    return ("input", inputs[arg])
                return _constant_key(arg)

            args = torch.fx.node.map_aggregate(node.args, local)
            kwargs = {k: torch.fx.node.map_aggregate(v, local) for k, v in node.kwargs.items()}
            target = node.target if callable(node.target) else str(node.target)
            shape.append((node.op, target, _freeze(args), _freeze(kwargs), _value_key(node.meta.get("val"))))
        self.outputs = [node for node in nodes if any(user not in members for user in node.users)]
        # The call goes where its last input is ready: before its first node, or later where an input comes after
        # that (a value the caller computes in the call's span), if no value the call gives is used before there.
        ready = max((position[node] for node in self.inputs), default=-1)
        self.before = next((node for node in nodes if position[node] > ready), None)
        # Where a value it reads is computed after a value it gives is used (the caller's node between them), the
        # call has no one place: it is split there (split_at), the nodes before that value and those after.
        first_use = min((position[user] for node in self.outputs for user in node.users if user not in members),
                        default=len(position))
        self.split_at = min((position[node] for node in self.inputs if position[node] >= first_use), default=None)
        if not nodes:
            self.why = "only views of values from outside it"
        elif self.split_at is not None:
            self.why = SPLIT
        if not self.why and any(not isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt, int))
                                for node in self.inputs):
            self.why = "a value it reads is not a tensor or a size"
        if not self.why and not any(isinstance(node.meta.get("val"), torch.Tensor) for node in self.inputs):
            self.why = "it reads no tensor (Inductor's invoke_subgraph takes its device from one)"
        if not self.why and not self.outputs:
            self.why = "no value of it is used"
        self.key = (tuple(shape), tuple(_value_key(node.meta.get("val")) for node in self.inputs),
                    tuple(index[node] for node in self.outputs))


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _impure(node: torch.fx.Node) -> str:
    """Why `node` cannot be part of an Inductor subgraph ("" where it can)."""
    if node.op not in ("call_function", "call_method"):
        return f"a {node.op} node"
    if node.target is operator.getitem:
        return ""
    if node.is_impure():
        return f"a node with side effects ({node.target})"
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return f"an op writing its inputs ({node.target})"
    value = node.meta.get("val")
    if value is None:
        return f"a node without a traced value ({node.target})"
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        if isinstance(v, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(v):
            return f"a data-dependent size ({node.target})"
    return ""


def _reads_written(node: torch.fx.Node, written: set[torch.fx.Node]) -> str:
    """Why `node` stays in the graph as a read of memory written in place ("" where it is no such read). Views
    and items of it only alias that memory: they read nothing."""
    if node.target is operator.getitem or view_base(node) is not node:
        return ""
    if any(view_base(arg) in written for arg in node.all_input_nodes):
        return f"a read of memory the graph writes in place ({node.target})"
    return ""


def values_read(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes whose fake values outline_repeated_calls reads: the calls' nodes and the values they read (a warm
    start rebuilds these, not every node's, where Inductor's FX graph cache then hits)."""
    read = {}
    for node in graph.nodes:
        if CALL in node.meta:
            read[node] = None
            read.update(dict.fromkeys(node.all_input_nodes))
    return list(read)


def outline_repeated_calls(gm: torch.fx.GraphModule) -> Outlined:
    """Outline, in place, the calls of `gm`'s graph that another call matches (module docstring); each distinct
    body becomes a submodule `dzc_outlined_<n>` of `gm`. Returns what it did."""
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    result = Outlined()
    matching: dict[tuple, list[_Call]] = {}
    renamed: dict[torch.fx.Node, torch.fx.Node] = {}  # an outlined call's output -> its getitem of the call
    written = written_values(graph)
    segments = _segments(graph, result, written)
    while segments:
        nodes = segments.pop()
        call = _Call(nodes, position, written)
        if call.why == SPLIT:  # both parts are nonempty: one has the value used first, the other its reader
            segments += [[node for node in nodes if position[node] < call.split_at],
                         [node for node in nodes if position[node] >= call.split_at]]
            result.cuts[SPLIT] = result.cuts.get(SPLIT, 0) + 1
        elif call.why:
            result.refused[call.why] = result.refused.get(call.why, 0) + 1
        else:
            matching.setdefault(call.key, []).append(call)
    classes = []
    for siblings in matching.values():
        if len(siblings) < 2:
            result.refused["no other call like it"] = result.refused.get("no other call like it", 0) + 1
        else:
            classes += [(call, len(classes)) for call in siblings]
    # In graph order, so that an input one call gives another is in place (at the giver's call) before the
    # reader's call: a reader whose call would come first (calls interleaved) reads the giver's output node, which
    # the giver's call then replaces by its item, after the reader.
    bodies: dict[int, torch.fx.Node] = {}
    placed: dict[torch.fx.Node, int] = {}  # an invoke_subgraph node -> the position it took
    for call, kind in sorted(classes, key=lambda item: position[item[0].before]):
        here = position[call.before]
        if any(placed.get(user, position.get(user, -1)) < here for node in call.outputs for user in node.users
               if user not in call.members):
            why = "a value it gives is read by a call placed before it"
            result.refused[why] = result.refused.get(why, 0) + 1
            continue
        call.inputs = [renamed.get(node, node) for node in call.inputs]  # outputs of calls outlined before
        if kind not in bodies:
            name = f"dzc_outlined_{len(bodies)}"
            gm.add_submodule(name, _body(gm, call))
            with graph.inserting_before(call.before):
                bodies[kind] = graph.get_attr(name)
        invoke, outputs = _replace(graph, call, bodies[kind])
        placed[invoke] = here
        renamed.update(outputs)
        result.calls += 1
        result.nodes += len(call.nodes)
    result.bodies = len(bodies)
    graph.lint()
    gm.recompile()
    return result


def _segments(graph: torch.fx.Graph, result: Outlined, written: set[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Each call's nodes, cut where the graph has a node that cannot move into a body (a side effect, a write,
    a data-dependent size: `_impure`; a read of memory the graph writes in place): a call's nodes on either side
    of its cache write and of the attention reading that cache become segments, and no segment spans a node
    whose order against its nodes matters. A node a pass made (untagged) between a
    call's nodes, reading one of them, joins that call's segment: the same pass made the same node in every layer."""
    nodes = [node for node in graph.nodes if node.op == "call_function"]
    last = {node.meta[CALL]: i for i, node in enumerate(nodes) if CALL in node.meta}
    open_segments: dict[tuple, list[torch.fx.Node]] = {}
    members: dict[torch.fx.Node, tuple] = {}  # node -> the call whose open segment holds it
    segments = []
    for i, node in enumerate(nodes):
        why = _impure(node) or _reads_written(node, written)
        tag = node.meta.get(CALL)
        if tag is None and not why:  # a pass's node: in a call's segment where it reads that call only, in its span
            calls = {members[arg] for arg in node.all_input_nodes if arg in members}
            if len(calls) == 1 and last[next(iter(calls))] > i:
                tag = next(iter(calls))
        if why:
            if CALL in node.meta:
                result.cuts[why] = result.cuts.get(why, 0) + 1
            segments += open_segments.values()
            open_segments, members = {}, {}
        elif tag is not None:
            open_segments.setdefault(tag, []).append(node)
            members[node] = tag
    return segments + list(open_segments.values())


def _body(gm: torch.fx.GraphModule, call: _Call) -> torch.fx.GraphModule:
    """The call's nodes as a graph of their own: a placeholder per input, its outputs returned as a tuple."""
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(call.inputs):
        placeholder = body.placeholder(f"arg{i}")
        placeholder.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
        env[node] = placeholder
    for node in call.nodes:
        env[node] = body.node_copy(node, env.__getitem__)
        env[node].meta.pop(CALL, None)
    body.output(tuple(env[node] for node in call.outputs))
    return torch.fx.GraphModule(gm, body)


def _replace(graph: torch.fx.Graph, call: _Call, body: torch.fx.Node,
             ) -> tuple[torch.fx.Node, dict[torch.fx.Node, torch.fx.Node]]:
    """Put the call in place of its nodes (its identifier: the body's attribute name); returns it and {output
    node: its getitem of the call}."""
    with graph.inserting_before(call.before):
        invoke = graph.call_function(INVOKE_SUBGRAPH, (body, body.target, *call.inputs))
        invoke.meta["val"] = tuple(node.meta["val"] for node in call.outputs)
        results = []
        for i, node in enumerate(call.outputs):
            result = graph.call_function(operator.getitem, (invoke, i))
            result.meta = {k: v for k, v in node.meta.items() if k != CALL}
            results.append(result)
    for node, result in zip(call.outputs, results):
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in call.members)
    for node in reversed(call.nodes):
        graph.erase_node(node)
    return invoke, dict(zip(call.outputs, results))
