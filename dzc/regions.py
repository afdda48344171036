"""Nested compile regions: repeated layers captured once (torch.compiler.nested_compile_region), rewritten once.

Capture (Dynamo + AOTAutograd) is most of a cold compile and grows with depth. Dynamo traces a function marked as
a nested compile region once and stamps out the traced body for every later call with the same input metadata:
the captured graph then holds `invoke_subgraph(body, identifier, *args)` calls, one per layer, sharing one body (a
GraphModule attribute). Two halves here:

- Before capture (`mark_repeated_layers`): the children of an nn.ModuleList that share a class defined outside
  torch and appear at least twice are marked, without changing the model's code: each such instance's class is
  swapped for a subclass of the same name whose forward is the original one wrapped in nested_compile_region.
  Outside Dynamo the wrapper calls the original forward (eager results are unchanged), isinstance still holds, and
  hooks stay outside the region (they run in nn.Module.__call__). The swap is per instance, not on the class:
  other models of the class are untouched. The marks stay while the compiled model lives, because Dynamo guards
  the layers' classes (put back after the first call, the next call would capture again, without regions);
  `Marking.restore` puts the classes back (dzc.compile does it when the CompiledModel is garbage-collected, or
  when a capture with regions is refused).
  Wrapping the *bound* forward of each instance instead (an instance attribute) is wrong in torch 2.13: Dynamo's
  stamped-out calls then all read the first layer's parameters (tests/test_regions.py keeps the check below that
  catches it).
- After capture (`body_calls`, `flatten`): dzc's passes run on each distinct body once (pipeline.run_pipeline),
  then every call is replaced by a copy of its rewritten body and the passes run over the flat graph, where they
  find the sites that cross a layer boundary (layer i's last residual add feeding layer i+1's first norm) and
  nothing else to do inside the bodies. Inlining loses nothing at run time: the fallback would run each body as
  a graph anyway, and the flat graph is what lowering, coverage, the dumps and the compile cache already take.

Regions are opt-in (CompileOptions.nested_regions, DZC_NESTED_REGIONS=1), and must never cost a graph or a
recompile a plain capture does not (torch 2.13):
- a dim marked dynamic (dzc's hint) that a layer body specialises makes Dynamo's stamp-out fail (`KeyError: 2`):
  the hint is taken off and the capture retried with the same marks (`unmark_specialized_dims`);
- where two calls of a region pass inputs of other dynamic sizes (window and full-attention vision blocks),
  Dynamo's reuse check guards the sizes' relation: only the most common kind of call stays marked (`narrowing`);
- a body that writes its inputs (a KV cache) AOTAutograd wraps in auto_functionalized_v2, with clones dzc's
  passes do not rewrite: those calls are inlined in Dynamo's graph and AOTAutograd traces again;
- Dynamo guards pytree's registry for region calls taking kwargs or objects: dzc's compile cache pickles graphs
  without touching it (compile_cache._slice_as_pytree_node).
A capture with regions is refused, and the model captured again without them, where the region capture raises
(a graph break inside a region: Dynamo cannot split a region) or where a call of a region reads the parameters
of several marked layers or of a layer another call read (`misplaced_parameters`): a wrong answer is the worst
outcome, a second capture only costs time.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from dzc import ir
from dzc.passes.graph_pass import copy_graph

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph

# Subclasses made by the marking, per original class: one per class, shared by every marked model.
_REGION_CLASSES: dict[type, type] = {}


class RegionRefusal(Exception):
    """A capture with nested compile regions cannot be trusted; the message says why. Raised by dzc's backend, caught
    by dzc.compile, which restores the model's classes and captures again without regions."""


class RegionNarrowing(RegionRefusal):
    """A capture with nested compile regions that would recompile where a plain capture does not, fixed by marking
    fewer layers: dzc.compile puts back the classes of `layers` only and captures again (`relating_guards`)."""

    def __init__(self, message: str, layers: list[torch.nn.Module]):
        super().__init__(message)
        self.layers = layers


def _region_class(cls: type) -> type:
    if cls not in _REGION_CLASSES:
        region = torch.compiler.nested_compile_region(cls.forward)
        _REGION_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": region, "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__,
                                                           "_dzc_region_of": cls})
    return _REGION_CLASSES[cls]


def _markable(module: torch.nn.Module) -> str:
    """Why `module` is not marked, or "": a torch class (containers, nn.Linear experts: their calls are no layers),
    a class marked already (by another dzc.compile of the model), or a forward already a compile region."""
    cls = type(module)
    if cls.__module__.split(".")[0] == "torch":
        return "a torch class"
    if "_dzc_region_of" in vars(cls):
        return "marked already"
    if hasattr(cls.forward, "__marked_compile_region_fn__"):
        return "its forward is a nested compile region already"
    return ""


@dataclass
class Marking:
    """The layers marked on one model: (path of the ModuleList, class name, instances), and how to put them back."""

    groups: list[tuple[str, str, list[torch.nn.Module]]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # classes left unmarked, with why

    def __bool__(self) -> bool:
        return bool(self.groups)

    def describe(self) -> str:
        return ", ".join(f"{path}: {len(layers)} x {name}" for path, name, layers in self.groups)

    def owners(self) -> dict[int, str]:
        """id of each parameter and buffer of a marked layer -> the layer's path."""
        return {id(tensor): f"{path}.{index}" for path, _, layers in self.groups
                for index, layer in enumerate(layers)
                for tensor in [*layer.parameters(), *layer.buffers()]}

    def unmark(self, unmarked: list[torch.nn.Module]) -> None:
        """Put back the classes of the layers `unmarked`, and of every layer left alone in its group."""
        ids = {id(layer) for layer in unmarked}
        groups, self.groups = self.groups, []
        for path, name, layers in groups:
            kept = [layer for layer in layers if id(layer) not in ids]
            self.groups.append((path, name, kept if len(kept) > 1 else []))
            for layer in layers if len(kept) < 2 else [layer for layer in layers if id(layer) in ids]:
                layer.__class__ = vars(type(layer)).get("_dzc_region_of", type(layer))
        self.groups = [group for group in self.groups if group[2]]

    def restore(self) -> None:
        """Put the marked layers' classes back (those still marked by this marking)."""
        for _, _, layers in self.groups:
            for layer in layers:
                original = vars(type(layer)).get("_dzc_region_of")
                if original is not None:
                    layer.__class__ = original
        self.groups = []


def mark_repeated_layers(model) -> Marking:
    """Mark the repeated layers of `model` (module docstring); nested ones inside a marked layer are left alone
    (one region per layer: Dynamo does not nest them either)."""
    marking = Marking()
    if not isinstance(model, torch.nn.Module):
        return marking
    inside: set[int] = set()  # modules within a marked layer
    for path, container in model.named_modules():
        if not isinstance(container, torch.nn.ModuleList) or id(container) in inside:
            continue
        by_class: dict[type, list[torch.nn.Module]] = collections.defaultdict(list)
        for child in container:
            by_class[type(child)].append(child)
        for cls, layers in by_class.items():
            if len(layers) < 2:
                continue
            why = _markable(layers[0])
            if why:
                if why != "a torch class":
                    marking.refused.append(f"{path}: {cls.__name__} ({why})")
                continue
            region = _region_class(cls)
            try:
                for layer in layers:
                    layer.__class__ = region
            except TypeError as error:  # __slots__ or a layout the subclass cannot take
                for layer in layers:
                    layer.__class__ = cls
                marking.refused.append(f"{path}: {cls.__name__} (its class cannot be swapped: {error})")
                continue
            marking.groups.append((path, cls.__name__, layers))
            inside.update(id(m) for layer in layers for m in layer.modules())
    return marking


def misplaced_parameters(gm: torch.fx.GraphModule, example_inputs, marking: Marking) -> str:
    """Why Dynamo's graph `gm` cannot be trusted with its region calls, or "": each call must read the parameters
    of at most one marked layer, and no two calls those of the same layer (a model that calls one layer twice is
    refused too: refusing only costs a second capture)."""
    owners = marking.owners()
    values = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))
    read_by: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
            continue
        layers = sorted({owners[id(values[a])] for a in node.args[2:]
                         if isinstance(a, torch.fx.Node) and a in values and id(values[a]) in owners})
        if len(layers) > 1:
            return f"the region call {node.name} reads the parameters of {', '.join(layers)}"
        for layer in layers:
            if layer in read_by:
                return f"the region calls {read_by[layer]} and {node.name} both read the parameters of {layer}"
            read_by[layer] = node.name
    return ""


class WritingRegions(Exception):
    """AOTAutograd kept region calls whose bodies write their inputs (a layer writing its KV cache, where Dynamo
    stamped out one body for several calls) as auto_functionalized_v2(invoke_subgraph, ...): clones of the written
    inputs, which dzc's passes do not rewrite. Raised by dzc's backend on AOTAutograd's graph; the backend inlines
    those calls in Dynamo's graph (`inline_calls`) and runs AOTAutograd again, which then traces the layers as a
    plain capture does (Dynamo still traced one body)."""

    def __init__(self, identifiers: set[str]):
        super().__init__("AOTAutograd functionalized region calls that write their inputs "
                         f"({', '.join(sorted(identifiers))})")
        self.identifiers = identifiers


def functionalized_calls(graph: torch.fx.Graph) -> set[str]:
    """The identifiers (as Dynamo named them) of the region calls AOTAutograd wrapped in auto_functionalized_v2."""
    found = set()
    for node in graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.higher_order.auto_functionalized_v2
                and node.args and node.args[0] is INVOKE_SUBGRAPH):
            found.add(str(node.kwargs.get("identifier", "")).removeprefix("auto_functionalized_"))
    return found


def inline_calls(gm: torch.fx.GraphModule, identifiers: set[str]) -> None:
    """Replace the region calls of Dynamo's graph `gm` with `identifiers` (all, where none of them matches) by
    their bodies."""
    from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph_nodes

    calls = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is INVOKE_SUBGRAPH]
    chosen = [node for node in calls if node.args[1] in identifiers] or calls
    inline_invoke_subgraph_nodes(gm, chosen)
    gm.graph.lint()
    gm.recompile()


def relating_guards(shape_env) -> list:
    """The shape guards Dynamo's reuse check of region calls added (torch 2.13, invoke_subgraph.is_reusable): it
    compares a call's input metadata with the traced call's, and where two calls pass inputs of different dynamic
    sizes (a window layer's cu_seqlens and a full-attention layer's), the comparison guards their relation
    (Eq(s32, s33), or Ne where they differ). A plain capture guards no such thing: the next call where the
    relation flips would recompile."""
    def from_reuse_check(guard) -> bool:
        where = guard.sloc.framework_loc
        return (getattr(where, "name", None) if not isinstance(where, str) else where.rsplit(" ", 1)[-1]) \
            == "is_reusable"
    return [guard for guard in getattr(shape_env, "guards", ()) if from_reuse_check(guard)]


def _symbols(value) -> set:
    """The size symbols (as first created, before replacements) of a fake tensor's or SymInt's sizes."""
    sizes = value.shape if isinstance(value, torch.Tensor) else [value] if isinstance(value, torch.SymInt) else []
    found = set()
    for size in sizes:
        if isinstance(size, torch.SymInt):
            found |= size.node._expr.free_symbols
    return found


def narrowing(gm: torch.fx.GraphModule, example_inputs, marking: Marking, guards: list) -> list[torch.nn.Module]:
    """The layers to unmark so that no region call compares inputs whose sizes `guards` relate: per group of
    marked layers, the calls are told apart by which of the guards' symbols their inputs' sizes hold; the layers
    of the most common kind stay marked, the others are put back (captured as a plain capture does). Empty where
    no group of two calls or more could stay apart from the others: then refuse the regions."""
    related = set().union(*(guard.expr.free_symbols for guard in guards))
    owners = marking.owners()
    values = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))
    kind: dict[str, frozenset] = {}  # layer path -> the related symbols its call's inputs hold
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
            continue
        layers = {owners[id(values[a])] for a in node.args[2:] if a in values and id(values[a]) in owners}
        symbols = frozenset(set().union(*(_symbols(a.meta.get("example_value")) for a in node.args[2:]
                                          if isinstance(a, torch.fx.Node))) & related)
        for layer in layers:
            kind[layer] = symbols
    unmarked: list[torch.nn.Module] = []
    for path, _, layers in marking.groups:
        kinds = [kind.get(f"{path}.{index}") for index in range(len(layers))]
        counts = collections.Counter(k for k in kinds if k is not None)
        if len(counts) < 2:
            continue  # one kind of call: marking fewer of these layers changes nothing
        common, count = counts.most_common(1)[0]
        unmarked += [layer for layer, k in zip(layers, kinds) if k != common] if count > 1 else list(layers)
    still_marked = sum(len(layers) for _, _, layers in marking.groups) - len(unmarked)
    return unmarked if unmarked and still_marked > 1 else []


def unmark_specialized_dims(error: BaseException) -> list[str]:
    """After a capture with regions failed in Dynamo's stamp-out of a region call (torch 2.13: `KeyError: 2` in
    invoke_subgraph.stamp_out_subgraph): an input dim marked dynamic (maybe_mark_dynamic, dzc's hint for every dim
    of an integer input) that the first layer's body specialised to a constant (a (row, column) pair's 2), and that
    the body reads as a size, leaves the stamp-out looking up a symbol that has become a number. A plain capture
    specialises such a dim silently. Here the hints of the dims the failed trace specialised to a constant are
    taken off the inputs (the same tensors the call is retried with); returns their names, empty where the error
    is another one or nothing could be taken off."""
    stamp_out = None  # the locals of the stamp-out that raised
    seen: set[int] = set()
    while error is not None and id(error) not in seen and stamp_out is None:
        seen.add(id(error))
        trace = error.__traceback__
        while trace is not None:
            if trace.tb_frame.f_code.co_name == "stamp_out_subgraph" and isinstance(error, KeyError):
                stamp_out = trace.tb_frame.f_locals
            trace = trace.tb_next
        error = error.__cause__ or error.__context__
    if stamp_out is None:
        return []
    from torch._dynamo.source import TensorProperty, TensorPropertySource
    try:
        # the traced frame's globals and locals as the stamp-out resolves sources ({"G": ..., "L": ...})
        shape_env, scope = stamp_out["tx"].output.shape_env, stamp_out["resolve_globals"]
        names = []
        for symbol, value in list(shape_env.replacements.items()):
            if not value.is_number:
                continue
            for source in shape_env.var_to_sources.get(symbol, ()):
                if not (isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE):
                    continue
                tensor = source.base.get_value(scope, {}, {})
                hints = getattr(tensor, "_dynamo_weak_dynamic_indices", None)
                if hints and source.idx in hints:
                    hints.discard(source.idx)
                    names.append(source.name)
        return names
    except Exception:  # noqa: BLE001  (torch's internals moved: refuse the regions instead)
        return []


@dataclass
class Body:
    """A distinct region body of a captured graph: its attribute on the root module, identifier, and calls."""

    attribute: str
    identifier: str
    module: torch.fx.GraphModule
    calls: list[torch.fx.Node]


def body_calls(graph: torch.fx.Graph, root: torch.nn.Module) -> list[Body]:
    """The distinct bodies `graph`'s invoke_subgraph calls run, in order of first call (shared bodies once)."""
    bodies: dict[str, Body] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            attribute = node.args[0].target
            if attribute not in bodies:
                bodies[attribute] = Body(attribute, node.args[1], getattr(root, attribute), [])
            bodies[attribute].calls.append(node)
    return list(bodies.values())


def flatten(graph: torch.fx.Graph, root: torch.nn.Module,
            rewritten: dict[str, torch.fx.Graph] | None = None) -> torch.fx.Graph:
    """A copy of `graph` with every invoke_subgraph call replaced by the nodes of its body: `rewritten[attribute]`
    where given, else the body as captured (its own calls flattened first). A body's get_attr reads its own
    attribute, through the body's path on `root`."""
    rewritten = rewritten or {}
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, object] = {}
    for node in graph.nodes:
        if node.op == "output":
            new.output(torch.fx.map_arg(node.args[0], env.__getitem__))
        elif node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            attribute = node.args[0].target
            body = getattr(root, attribute)
            body_graph = rewritten.get(attribute) or flatten(body.graph, body)
            arguments = [torch.fx.map_arg(a, env.__getitem__) for a in node.args[2:]]
            env[node] = _inline(new, body_graph, arguments, attribute)
        elif (node.op == "call_function" and node.target is operator.getitem
              and isinstance(node.args[0], torch.fx.Node) and node.args[0].target is INVOKE_SUBGRAPH):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "get_attr" and isinstance(getattr(root, node.target, None), torch.fx.GraphModule):
            continue  # a body: its calls are inlined
        else:
            env[node] = new.node_copy(node, env.__getitem__)
    return new


def inlined(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of `gm`'s graph with its region calls replaced by their bodies as captured (the graph as a capture
    without regions would be, for the rewrite check); a plain copy where it has none."""
    return flatten(gm.graph, gm) if body_calls(gm.graph, gm) else copy_graph(gm.graph)


def _inline(new: torch.fx.Graph, body: torch.fx.Graph, arguments: list, attribute: str) -> tuple:
    """Copy `body`'s nodes into `new`, its placeholders bound to `arguments`; returns its outputs."""
    env: dict[torch.fx.Node, object] = {}
    placeholders = [node for node in body.nodes if node.op == "placeholder"]
    if len(placeholders) != len(arguments):
        raise ValueError(f"body {attribute} takes {len(placeholders)} inputs, its call passes {len(arguments)}")
    env.update(zip(placeholders, arguments))
    for node in body.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return tuple(torch.fx.map_arg(node.args[0], env.__getitem__))
        copied = new.node_copy(node, env.__getitem__)
        if node.op == "get_attr":
            copied.target = f"{attribute}.{node.target}"
        env[node] = copied
    raise ValueError(f"body {attribute} has no output")


def captured_text(gm: torch.fx.GraphModule, title: str) -> str:
    """ir.print_graph of `gm`'s graph, then of each distinct body it calls (its identifier and number of calls):
    the capture stage's dump and what the compile cache's key hashes (the bodies are part of the graph)."""
    text = ir.print_graph(gm.graph, title)
    for body in body_calls(gm.graph, gm):
        text += captured_text(body.module, f"body {body.attribute} ({body.identifier}), called "
                                           f"{len(body.calls)} time{'s' if len(body.calls) > 1 else ''}")
    return text
