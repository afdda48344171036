"""Nested compile regions: repeated layers captured once (torch.compiler.nested_compile_region), rewritten once.

Capture (Dynamo + AOTAutograd) is most of a cold compile and grows with depth. Dynamo traces a function marked as
a nested compile region once and stamps out the traced body for every later call with the same input metadata:
the captured graph then holds `invoke_subgraph(body, identifier, *args)` calls, one per layer, sharing one body (a
GraphModule attribute). Two halves here:

- Before capture (`mark_repeated_layers`): the children of an nn.ModuleList that share a class defined outside
  torch and appear at least twice are marked, without changing the model's code. Where those instances differ
  in an int attribute somewhere in their trees (same relative path and name, other values: a layer index picking
  the layer's cache slot), Dynamo guards the value wherever a forward reads it and refuses to reuse one layer's
  body for another (right: the stamped-out layer would use layer 0's cache), so every layer would be traced: the
  layers are left unmarked and their children marked instead, each group formed by the child of one name (of one
  class, one module per layer) across the layers, by the same rule (descending further where they differ too, or
  where the child is a torch class: a Linear, a ModuleList); `Marking.refused` names the layers and the attribute.
  Where a group of the layers' children holds a differing int attribute of its own (the attention holding the
  layer index it reads its cache with; its own children may hold it too, as an indexer reading its key cache), the
  descent stops there and they are marked whole, their children left alone: Dynamo traces every call of them (its
  reuse check refuses, as above), finds the traced bodies equal (each layer's cache tensors are inputs of its body,
  not constants in it) and installs one body, which AOTAutograd, most of a capture, traces once instead of once a
  layer; `Marking.traced_per_call` names them. The layers themselves are always descended into, so that their other
  children (an MoE block) stay stamped out. The children of a group so marked stay unmarked because a region inside
  a body that writes its inputs fails AOTAutograd in torch 2.13. Multimodal model, CPU, 8 + 8 to 16 + 16 layers:
  whole layers marked, 1.4 s of Dynamo and 0.4 s of AOTAutograd a decoder + vision layer pair; their children, 0.5 s
  and 0.9 s; children and the attention marked whole, 0.3 s and none (AOTAutograd 7.8 s at both depths;
  docs/results/compile_time_cpu.md, session 36).
  A group is named by its ModuleList's path (`layers`), a group of children by that path with `*` for the layer
  (`layers.*.mlp`, `layers.*.attn.indexer`). Each marked instance's class is swapped for a subclass of the same
  name whose forward is the original one wrapped in nested_compile_region. Outside Dynamo the wrapper calls the
  original forward (eager results are unchanged), isinstance still holds, and hooks stay outside the region (they
  run in nn.Module.__call__). The swap is per instance, not on the class:
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
  Each copy after a body's first binds its data-dependent sizes (a MoE loop's rows per expert) to symbols of
  its own, as a plain capture's layers do (`_fresh_unbacked_symbols`); a body giving such a size to its caller
  is refused.

Regions are on by default (CompileOptions.nested_regions, DZC_NESTED_REGIONS=0 turns them off), and must never
cost a graph or a recompile a plain capture does not (torch 2.13):
- where two calls of a region pass inputs of other dynamic sizes (window and full-attention vision blocks),
  Dynamo's reuse check would guard the sizes' relation: the calls of marked layers are compared by their sizes'
  expressions first, so each kind of call gets a body of its own (`_reuse_only_calls_of_the_same_sizes`); where
  such a guard is made all the same, only the most common kind of call stays marked (`narrowing`);
- a dim marked dynamic (dzc's hint) that a layer body specialises, yet takes as an input, would make Dynamo's
  stamp-out of that body fail (`KeyError: 2`) and its whole trace be thrown away: the stamp-out passes the body
  the symbol its first call passed, or, where that symbol is gone, the call is traced anew
  (`_lifts_a_specialized_symbol`); where the stamp-out fails all the same (torch's internals moved), the hint is
  taken off and the capture retried with the same marks (`unmark_specialized_dims`);
- a body that writes its inputs (a layer writing its KV cache) AOTAutograd keeps as
  auto_functionalized_v2(invoke_subgraph, ...), traced once per body: `flatten` inlines those calls with their
  writes as a plain capture has them (the new values, copied into the graph's inputs at its end), so the passes
  see the same graph; a call it cannot inline so (a written input that is a view of another tensor) is inlined
  in Dynamo's graph instead and AOTAutograd traces again (`WritingRegions`). Marking such layers pays: where they
  take an object (a paged cache) torch 2.13's Dynamo reuses no body and traces every call, but AOTAutograd, most
  of a capture, traces each distinct body once;
- Dynamo guards pytree's registry for region calls taking kwargs or objects: dzc's compile cache pickles graphs
  without touching it (compile_cache._slice_as_pytree_node).
A capture with regions is refused, and the model captured again without them, where the region capture raises
(a graph break inside a region: Dynamo cannot split a region) or where a call of a region reads the parameters
of several marked layers or of a layer another call read (`misplaced_parameters`): a wrong answer is the worst
outcome, a second capture only costs time.
"""

from __future__ import annotations

import collections
import functools
import importlib
import operator
import sys
import types
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._sympy.symbol import SymT, symbol_is_type

from dzc import ir
from dzc.outline_regions import CALL
from dzc.passes.graph_pass import copy_graph

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
# AOTAutograd's form of a region call whose body writes its inputs: auto_functionalized_v2(invoke_subgraph, ...)
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2

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
        # Named like the original (modules' reprs, messages, Dynamo's guards on the layers' type), in a module of
        # its own that every process marking the class makes: pickle finds it there (frame entries save those
        # guards: dzc/frame_cache.py).
        module = _marked_module(cls.__module__)
        marked = type(cls.__name__, (cls,), {"forward": region, "__module__": module.__name__,
                                             "__qualname__": cls.__qualname__, "_dzc_region_of": cls})
        if cls.__qualname__ == cls.__name__:  # (a nested class is not found by name; it is left unpicklable)
            setattr(module, cls.__name__, marked)
        _REGION_CLASSES[cls] = marked
    return _REGION_CLASSES[cls]


def _marked_module(original: str) -> types.ModuleType:
    """dzc.regions.marked.<original>: the module of the marked subclasses of `original`'s classes, with every
    package above it, in sys.modules."""
    parts = f"marked.{original}".split(".")
    parent = sys.modules[__name__]
    for depth, part in enumerate(parts):
        prefix = ".".join([__name__, *parts[:depth + 1]])
        if prefix not in sys.modules:
            sys.modules[prefix] = types.ModuleType(prefix, "dzc: subclasses of marked layers (dzc/regions.py)")
            setattr(parent, part, sys.modules[prefix])
        parent = sys.modules[prefix]
    return parent


def _size_expressions(value):
    """`value` (a tensor's metadata as Dynamo compares it: sizes, strides, flags) with each symbolic size as its
    expression: comparable without the shape env."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    if isinstance(value, (tuple, list)):
        return tuple(_size_expressions(item) for item in value)
    return value


def _reuse_only_calls_of_the_same_sizes() -> None:
    """torch 2.13's Dynamo reuses a region body for a later call whose inputs' metadata compare equal
    (invoke_subgraph.is_reusable). Where the sizes are other symbols (a window block's cu_window_seqlens, a
    full-attention block's cu_seqlens), that comparison guards their relation (Eq(s40, s11)): a recompile where it
    flips, which a plain capture does not have. For the calls of layers dzc marked, the sizes are compared as
    expressions first, which guards nothing: a call of other sizes traces a body of its own (`narrowing` stays for
    guards this does not prevent). This only refuses reuses torch would allow, never allows one it refuses.
    Installed once per process, by the first marking; other regions' calls are checked as torch checks them."""
    try:
        from torch._dynamo.variables import invoke_subgraph as dynamo_regions

        torch_is_reusable, metadata = dynamo_regions.is_reusable, dynamo_regions.extract_tensor_metadata
        module_tag, tensor_tag = dynamo_regions.InputTag.MODULE, dynamo_regions.InputTag.TENSOR
        bound_symbol = dynamo_regions.LiftedBoundSymbol
    except (ImportError, AttributeError):  # torch's internals moved: `narrowing` alone keeps such guards off
        return
    if getattr(torch_is_reusable, "dzc_checks_sizes_first", False):
        return

    @functools.wraps(torch_is_reusable)
    def is_reusable(tx, condition, fingerprint, cached_entry) -> bool:
        if any(tag is module_tag and "_dzc_region_of" in vars(type(vt.value)) for tag, vt in fingerprint.flat_vts):
            if _lifts_a_specialized_symbol(tx, cached_entry, bound_symbol):
                return False
            for (cached_tag, cached), (tag, vt) in zip(condition.input_checks, fingerprint.flat_vts):
                if cached_tag is not tensor_tag or tag is not tensor_tag:
                    continue
                example = vt.proxy.node.meta.get("example_value")
                if example is not None and _size_expressions(metadata(example)) != _size_expressions(cached):
                    return False
        return torch_is_reusable(tx, condition, fingerprint, cached_entry)

    is_reusable.dzc_checks_sizes_first = True
    dynamo_regions.is_reusable = is_reusable


def _cache_region_calls_fake_outputs() -> None:
    """Keep fake tensors' dispatch cache for region calls alone. dzc.compile turns that cache off process-wide
    (dzc/api.py: an MoE's per-expert loop costs more with it), and with it torch's cache of a region call's fake
    outputs, keyed by the body (the id of its graph module) and the inputs' metadata: without it AOTAutograd runs
    every call's body through fake tensors, several times (its metadata pass, its trace, a functionalized call's
    clone), where the cache runs each distinct body once per kind of inputs (at 8 + 8 multimodal layers, 35 runs
    against 6). The entries are torch's own, with its own refusals (an output of an unbacked size is not cached):
    what torch does with the cache on, for this one operator. Installed once per process, by the first marking."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch = FakeTensorMode._dispatch_impl
    if getattr(dispatch, "dzc_caches_region_calls", False) or not hasattr(FakeTensorMode, "_cached_dispatch_impl"):
        return
    caching = set()  # ids of the modes inside a cached dispatch of a region call (a miss dispatches again)

    @functools.wraps(dispatch)
    def _dispatch_impl(self, func, types, args, kwargs):
        if func is INVOKE_SUBGRAPH and not self.cache_enabled and id(self) not in caching:
            caching.add(id(self))
            try:
                return self._cached_dispatch_impl(func, types, args, kwargs)
            finally:
                caching.discard(id(self))
        return dispatch(self, func, types, args, kwargs)

    _dispatch_impl.dzc_caches_region_calls = True
    FakeTensorMode._dispatch_impl = _dispatch_impl


def _cache_region_calls_schemas() -> None:
    """torch 2.13's cache of a region call's schema under functionalization, for the torch versions without it
    (2.11 on the H200 machine). AOTAutograd functionalizes every region call, and torch before 2.13 worked out the
    call's schema (what it mutates and aliases) each time by tracing the body again (invoke_subgraph.gen_schema ->
    materialize_as_graph -> make_fx): at 4 + 2 multimodal layers on the CPU host 36 re-traces, 33 of its 58 s of
    AOTAutograd under cProfile, and the full-depth cold compile ran past 560 s on the H100 host (session 38). torch
    2.13 keys the schema by the body (its id), the call's identifier and the operands' types, for the tracing
    context's life, which keeps the bodies alive (torch/_higher_order_ops/invoke_subgraph.py's functionalize impl);
    so does this. Installed once per process, by the first marking; where torch has its own cache, nothing."""
    from torch._guards import InvokeSubgraphCache

    # (the module: torch._higher_order_ops exports the operator under the module's name)
    region_ops = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
    if hasattr(InvokeSubgraphCache, "get_functionalize_schema_entry"):
        return
    hop_instance = getattr(region_ops, "HopInstance", None)
    if hop_instance is None or getattr(hop_instance, "dzc_caches_schemas", False):
        return  # torch's internals moved: each call's schema is worked out as torch does

    class CachedSchemas(hop_instance):
        dzc_caches_schemas = True

        @staticmethod
        def create(hop, *args, **kwargs):
            cache = region_ops.get_invoke_subgraph_cache()
            if hop is not INVOKE_SUBGRAPH or cache is None or kwargs:
                return hop_instance.create(hop, *args, **kwargs)
            subgraph, identifier, *operands = args
            schemas = vars(cache).setdefault("dzc_functionalize_schemas", {})
            key = (id(subgraph), identifier, tuple(type(operand) for operand in operands))
            if key not in schemas:
                schemas[key] = hop_instance.create(hop, *args)._schema
            return hop_instance(hop, schemas[key])

    region_ops.HopInstance = CachedSchemas


def _lifts_a_specialized_symbol(tx, cached_entry, bound_symbol: type) -> bool:
    """Whether the reuse entry `cached_entry` passes its body a size symbol the graph binds under no name it kept.
    torch 2.13 records a size symbol lifted into a body (LiftedBoundSymbol) as its expression after the trace, and
    where the body specialised it (a (row, column) pair's dim of 2, marked dynamic by dzc's hint), that expression
    is the number: the stamp-out looks the number up among the graph's bound symbols and fails (`KeyError: 2` in
    stamp_out_subgraph), throwing the whole frame's trace away. The body's own placeholder still holds the symbol
    it was traced with, the one the first call passed: the entry is pointed back at it, so every call passes the
    body what the first call passed (the same symbol, its value guarded to the constant). Where that symbol is not
    bound either, the reuse is refused: Dynamo traces the call anew (one more body trace, no second capture)."""
    mapping = getattr(cached_entry, "subgraph_input_mapping", ())
    bound = tx.output.current_tracer.bound_symbols
    placeholders = None
    for index, lifted in enumerate(mapping):
        if not isinstance(lifted, bound_symbol) or lifted.expr in bound:
            continue
        if placeholders is None:
            placeholders = [node for node in cached_entry.body_gmod.graph.nodes if node.op == "placeholder"]
        value = placeholders[index].meta.get("example_value") if len(placeholders) == len(mapping) else None
        symbol = value.node._expr if isinstance(value, torch.SymInt) else None
        if symbol is None or symbol not in bound:
            return True
        mapping[index] = bound_symbol(symbol)
    return False


def instance_path(path: str, index: int) -> str:
    """The path of the `index`-th instance of the group marked at `path`: `layers.2` of `layers`, `layers.2.mlp`
    of `layers.*.mlp`."""
    return path.replace("*", str(index), 1) if "*" in path else f"{path}.{index}"


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
    """The layers marked on one model: (path of the group, class name, instances), and how to put them back. A
    group's path is its ModuleList's (`layers`) or, for the children of layers marked in their place, the ModuleList's
    with `*` for the layer's index, then the child's path in the layer (`layers.*.mlp`)."""

    groups: list[tuple[str, str, list[torch.nn.Module]]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # classes left unmarked, with why
    # path of a group marked whole though its instances differ in int attributes of their own -> those attributes:
    # Dynamo traces each of its calls (module docstring)
    traced_per_call: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def describe(self) -> str:
        return ", ".join(f"{path}: {len(layers)} x {name}" + (
            f" (each call traced: instances differ in int attribute {self.traced_per_call[path]})"
            if path in self.traced_per_call else "") for path, name, layers in self.groups)

    def owners(self) -> dict[int, str]:
        """id of each parameter and buffer of a marked layer -> the layer's path."""
        return {id(tensor): instance_path(path, index) for path, _, layers in self.groups
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
    inside: set[int] = set()  # modules within a marked layer, or within layers whose children were marked instead
    for path, container in model.named_modules():
        if not isinstance(container, torch.nn.ModuleList) or id(container) in inside:
            continue
        by_class: dict[type, list[torch.nn.Module]] = collections.defaultdict(list)
        for child in container:
            by_class[type(child)].append(child)
        for layers in by_class.values():
            # (a torch class is no layer: its instances are left alone, as the ModuleLists inside them)
            if len(layers) > 1 and _markable(layers[0]) != "a torch class" and _mark_group(marking, path, layers):
                inside.update(id(m) for layer in layers for m in layer.modules())
    return marking


def _mark_group(marking: Marking, path: str, instances: list[torch.nn.Module]) -> bool:
    """Mark `instances` (modules of one class at `path`: a ModuleList's layers, or one child of each) or, where
    they differ in an int attribute or their class is torch's, the groups their children form; whether the
    instances' subtrees were handled so (False: refused, in `marking.refused` where it is no torch class)."""
    cls = type(instances[0])
    why = _markable(instances[0])
    differing = [] if why else _differing_ints(instances)
    # A child group holding a differing int of its own (module docstring); the layers themselves are descended into,
    # so that their other children (an MoE block) stay stamped out rather than traced per call.
    own = "*" in path and any("." not in key for key in differing)
    if why == "a torch class" or (differing and not own):
        at = len(marking.refused)  # (the layers' line before their children's)
        marked = _mark_children(marking, path if "*" in path else f"{path}.*", instances)
        if differing:
            marking.refused.insert(at, f"{path}: {cls.__name__} (instances differ in int attribute {differing[0]}: "
                                   + ("marked its repeated children instead)" if marked else "no child marked)"))
        return True
    if why:
        marking.refused.append(f"{path}: {cls.__name__} ({why})")
        return False
    _reuse_only_calls_of_the_same_sizes()
    _cache_region_calls_fake_outputs()
    _cache_region_calls_schemas()
    region = _region_class(cls)
    try:
        for instance in instances:
            instance.__class__ = region
    except TypeError as error:  # __slots__ or a layout the subclass cannot take
        for instance in instances:
            instance.__class__ = cls
        marking.refused.append(f"{path}: {cls.__name__} (its class cannot be swapped: {error})")
        return False
    marking.groups.append((path, cls.__name__, instances))
    if own:
        marking.traced_per_call[path] = ", ".join(differing)
    return True


def _mark_children(marking: Marking, path: str, instances: list[torch.nn.Module]) -> bool:
    """`_mark_group` for each child every instance has, of one class, under the same name: the group of those
    children at `path`.<name>; whether any was marked."""
    children = [dict(instance.named_children()) for instance in instances]
    before = len(marking.groups)
    for name, child in children[0].items():
        group = [of.get(name) for of in children]
        if any(type(other) is not type(child) for other in group):
            continue
        if len({id(other) for other in group}) < len(group):  # one module shared by the instances: no layer
            if not _markable(child):
                marking.refused.append(f"{path}.{name}: {type(child).__name__} (shared by the instances)")
            continue
        _mark_group(marking, f"{path}.{name}", group)
    return len(marking.groups) > before


def _differing_ints(instances: list[torch.nn.Module]) -> list[str]:
    """The int attributes (bools are none here) that every instance's subtree holds at the same relative path with
    other values, as `path.name` (`name` for the instances' own), in the order of the first instance's modules.
    Dynamo guards such a value where a forward reads it (a layer index picking the layer's cache): the reuse of
    one instance's body for another is refused, every call traced."""
    held = [{(where, name): value for where, module in instance.named_modules()
             for name, value in vars(module).items() if type(value) is int} for instance in instances]
    differing = []
    for key in held[0]:
        values = [of.get(key) for of in held]
        if None not in values and len(set(values)) > 1:
            differing.append(".".join(part for part in key if part))
    return differing


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
    """AOTAutograd kept region calls whose bodies write their inputs (a layer writing its KV cache) as
    auto_functionalized_v2(invoke_subgraph, ...), and `flatten` cannot inline some of them as a plain capture's
    writes (`functionalized_calls` says which). Raised by dzc's backend on AOTAutograd's graph; the backend inlines
    those calls in Dynamo's graph (`inline_calls`) and runs AOTAutograd again, which then traces those layers as a
    plain capture does."""

    def __init__(self, identifiers: set[str]):
        super().__init__("AOTAutograd functionalized region calls that write their inputs "
                         f"({', '.join(sorted(identifiers))})")
        self.identifiers = identifiers


def functionalized_calls(graph: torch.fx.Graph) -> set[str]:
    """The identifiers (as Dynamo named them) of the region calls AOTAutograd wrapped in auto_functionalized_v2
    (their bodies write their inputs) that `flatten` cannot inline (`_functionalized` says why)."""
    root = graph.owning_module
    return {str(node.kwargs["identifier"]).removeprefix("auto_functionalized_") for node in graph.nodes
            if _is_functionalized(node)
            and isinstance(_functionalized(node, getattr(root, node.kwargs["subgraph"].target).graph), str)}


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
        kinds = [kind.get(instance_path(path, index)) for index in range(len(layers))]
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


def _is_functionalized(node: torch.fx.Node) -> bool:
    """Whether `node` is a region call as AOTAutograd keeps one whose body writes its inputs."""
    return (node.op == "call_function" and node.target is AUTO_FUNCTIONALIZED and bool(node.args)
            and node.args[0] is INVOKE_SUBGRAPH)


def _region_call(node: torch.fx.Node) -> tuple[str, str] | None:
    """(body attribute, identifier) of a region call, plain or functionalized; None for any other node."""
    if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
        return node.args[0].target, node.args[1]
    if _is_functionalized(node):
        return node.kwargs["subgraph"].target, node.kwargs["identifier"]
    return None


@dataclass
class _Functionalized:
    """How `flatten` inlines a functionalized region call: the body's inputs as the call passes them (a written
    input as its base, which the call's own semantics would clone) and, per base (the call's results after the
    body's outputs), the body's copy into it. The copies are left out: the values they copy are the bases' new
    values, which the graph copies into its inputs at its end, as in a plain capture; nothing writes the bases
    before that, so the body's and the graph's other reads of them read what the clones would hold."""

    inputs: list
    copies: list[torch.fx.Node]


def _functionalized(node: torch.fx.Node, body: torch.fx.Graph) -> _Functionalized | str:
    """How to inline the functionalized region call `node` running `body`, or why it cannot be inlined so."""
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    bases = list(node.kwargs.get("_all_bases", ()))
    inputs, copies = [], [None] * len(bases)
    for position, placeholder in enumerate(placeholders):
        name = f"arg{position}"
        if name in node.kwargs:
            inputs.append(node.kwargs[name])
            continue
        base = node.kwargs.get(f"_{name}_base_index")
        # a view of its base carries more keys (_argN_alias, _argN_size, _argN_slice_dim, ...): it would be
        # regenerated from the base's clone, which inlining does not do
        if base is None or any(key.startswith(f"_{name}_") and key != f"_{name}_base_index" for key in node.kwargs):
            return f"its written input {name} is {'missing' if base is None else 'a view of another tensor'}"
        writes = [user for user in placeholder.users if user.target is torch.ops.aten.copy_.default
                  and user.args[0] is placeholder and not user.users]
        if len(writes) != 1 or copies[base] is not None:
            return f"its body does not write its input {name} with one copy of its own"
        copies[base] = writes[0]
        inputs.append(bases[base])
    if None in copies:
        return "one of its bases is no input of its body"
    # Leaving the copies out is only sound where nothing runs after them (every read of an input sees its old
    # value) and nothing else writes.
    nodes = list(body.nodes)
    if set(nodes[len(nodes) - 1 - len(copies):-1]) != set(copies):
        return "its body does not end with its copies into its inputs"
    if any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable and n not in copies
           for n in nodes):
        return "its body writes otherwise than by its closing copies"
    for copy in copies:
        source, target = copy.args[1].meta.get("val"), copy.args[0].meta.get("val")
        if source is None or target is None or source.shape != target.shape or source.dtype != target.dtype:
            return "its body's copy into an input changes its shape or dtype"
    return _Functionalized(inputs, copies)


def body_calls(graph: torch.fx.Graph, root: torch.nn.Module) -> list[Body]:
    """The distinct bodies `graph`'s region calls (plain or functionalized) run, in order of first call (shared
    bodies once)."""
    bodies: dict[str, Body] = {}
    for node in graph.nodes:
        call = _region_call(node)
        if call is not None:
            attribute, identifier = call
            if attribute not in bodies:
                bodies[attribute] = Body(attribute, identifier, getattr(root, attribute), [])
            bodies[attribute].calls.append(node)
    return list(bodies.values())


def flatten(graph: torch.fx.Graph, root: torch.nn.Module,
            rewritten: dict[str, torch.fx.Graph] | None = None) -> torch.fx.Graph:
    """A copy of `graph` with every region call replaced by the nodes of its body: `rewritten[attribute]` where
    given, else the body as captured (its own calls flattened first); a functionalized call's writes as a plain
    capture's (`_Functionalized`). A body's get_attr reads its own attribute, through the body's path on `root`.
    Raises RegionRefusal where a body's copies cannot be given data-dependent sizes of their own."""
    rewritten = rewritten or {}
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, object] = {}
    inlined_once: set[str] = set()
    for node in graph.nodes:
        call = _region_call(node)
        if node.op == "output":
            new.output(torch.fx.map_arg(node.args[0], env.__getitem__))
        elif call is not None:
            attribute = call[0]
            body = getattr(root, attribute)
            body_graph = rewritten.get(attribute) or flatten(body.graph, body)
            copied: list[torch.fx.Node] = []
            if node.target is INVOKE_SUBGRAPH:
                env[node] = _inline(new, body_graph, [torch.fx.map_arg(a, env.__getitem__) for a in node.args[2:]],
                                    attribute, call=node.name, copied=copied)
            else:
                functionalized = _functionalized(node, body_graph)
                if isinstance(functionalized, str):
                    raise ValueError(f"the region call {node.name} cannot be inlined: {functionalized}")
                env[node] = _inline(new, body_graph,
                                    [torch.fx.map_arg(a, env.__getitem__) for a in functionalized.inputs],
                                    attribute, functionalized.copies, node.name, copied)
            if attribute in inlined_once:
                _fresh_unbacked_symbols(copied, env[node], attribute)
            inlined_once.add(attribute)
        elif (node.op == "call_function" and node.target is operator.getitem
              and isinstance(node.args[0], torch.fx.Node) and _region_call(node.args[0]) is not None):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "get_attr" and (isinstance(getattr(root, node.target, None), torch.fx.GraphModule) or (
                node.users and all(_is_functionalized(user) and user.kwargs.get("_op_schema") is node
                                   for user in node.users))):
            continue  # a body, or a functionalized call's schema: the calls are inlined
        else:
            env[node] = new.node_copy(node, env.__getitem__)
    return new


def inlined(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of `gm`'s graph with its region calls replaced by their bodies as captured (the graph as a capture
    without regions would be, for the rewrite check); a plain copy where it has none."""
    return flatten(gm.graph, gm) if body_calls(gm.graph, gm) else copy_graph(gm.graph)


def _inline(new: torch.fx.Graph, body: torch.fx.Graph, arguments: list, attribute: str,
            copies: tuple[torch.fx.Node, ...] | list[torch.fx.Node] = (), call: str = "",
            copied: list[torch.fx.Node] | None = None) -> tuple:
    """Copy `body`'s nodes into `new`, its placeholders bound to `arguments`; returns its outputs, then the values
    that `copies` (copy_ nodes of `body`, left out) would copy. Each copy is tagged with (attribute, call) in its
    meta (outline_regions.CALL: which call it came from, for outlining the calls again before Inductor) and
    appended to `copied` where given."""
    env: dict[torch.fx.Node, object] = {}
    left_out = set(copies)
    placeholders = [node for node in body.nodes if node.op == "placeholder"]
    if len(placeholders) != len(arguments):
        raise ValueError(f"body {attribute} takes {len(placeholders)} inputs, its call passes {len(arguments)}")
    env.update(zip(placeholders, arguments))
    for node in body.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return (*torch.fx.map_arg(node.args[0], env.__getitem__), *(env[copy.args[1]] for copy in copies))
        if node in left_out:
            continue
        copy = new.node_copy(node, env.__getitem__)
        copy.meta[CALL] = (attribute, call)
        if node.op == "get_attr":
            copy.target = f"{attribute}.{node.target}"
        env[node] = copy
        if copied is not None:
            copied.append(copy)
    raise ValueError(f"body {attribute} has no output")


def _fresh_unbacked_symbols(nodes: list[torch.fx.Node], outputs: tuple, attribute: str) -> None:
    """Give the data-dependent sizes and values (unbacked symbols) that a body's copy `nodes` bind symbols of their
    own, in place. Every copy of a body carries the body's traced values, so each layer's rows per expert (say)
    would be one symbol, and Inductor, taking them for one size, gave a later layer the buffers of an earlier
    layer's rows (session 43: a heap overflow on the CPU, index_add_ given more indices than rows on the GPU).
    Each fresh symbol keeps its original's value range and size-likeness, and a replacement that stays within the
    copy. Where a copy's outputs carry such a symbol to the caller, the graph after the call would still read the
    original's: the capture is refused (RegionRefusal: dzc.compile captures again without regions)."""
    bound = [node for node in nodes if node.meta.get("unbacked_bindings")]
    if not bound:
        return
    escaping = {symbol for value in outputs if isinstance(value, torch.fx.Node)
                for symbol in free_unbacked_symbols(value.meta.get("val"))}
    escaping &= {symbol for node in bound for symbol in node.meta["unbacked_bindings"]}
    if escaping:
        raise RegionRefusal(f"region body {attribute} gives values of data-dependent sizes "
                            f"({', '.join(sorted(map(str, escaping)))}) to its caller; each call's copy would need "
                            "symbols of its own after the call too")
    shape_env = _shape_env_of(bound)
    mapping: dict[sympy.Symbol, sympy.Symbol] = {}
    with shape_env.ignore_fresh_unbacked_symbols():
        for node in bound:
            for symbol in node.meta["unbacked_bindings"]:
                if symbol_is_type(symbol, SymT.UNBACKED_INT):
                    mapping[symbol] = shape_env.create_unbacked_symint().node.expr
                elif symbol_is_type(symbol, SymT.UNBACKED_FLOAT):
                    mapping[symbol] = shape_env.create_unbacked_symfloat().node.expr
                else:
                    raise RegionRefusal(f"region body {attribute} binds a data-dependent {symbol} of a kind dzc "
                                        "cannot copy per call")
    for old, fresh in mapping.items():
        shape_env.var_to_range[fresh] = shape_env.var_to_range[old]
        if old in shape_env.size_like:
            shape_env.size_like.add(fresh)
        target = shape_env.replacements.get(old)
        # (A replacement by another call's symbol, such as the one Dynamo's trace bound, would make the copies one
        # value again: only one in the copy's own symbols and backed sizes carries over.)
        if target is not None and not any(symbol_is_type(symbol, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))
                                          and symbol not in mapping for symbol in target.free_symbols):
            shape_env.replacements[fresh] = target.xreplace(mapping)
    for node in nodes:
        bindings = node.meta.get("unbacked_bindings")
        if bindings:
            node.meta["unbacked_bindings"] = {mapping[symbol]: path for symbol, path in bindings.items()}
        if "val" in node.meta:
            node.meta["val"] = _renamed(node.meta["val"], mapping, shape_env)
            if "tensor_meta" in node.meta and isinstance(node.meta["val"], torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])


def _shape_env_of(nodes: list[torch.fx.Node]):
    for node in nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return value.node.shape_env
            if isinstance(value, FakeTensor) and value.fake_mode.shape_env is not None:
                return value.fake_mode.shape_env
    raise RegionRefusal("a region body binds data-dependent symbols that no traced value shows")


def _renamed(value, mapping: dict, shape_env):
    """`value` (a node's traced value) with the unbacked symbols of `mapping` replaced; itself where it has none."""
    if isinstance(value, (list, tuple)):
        items = [_renamed(item, mapping, shape_env) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        expr = value.node.expr
        renamed = expr.xreplace(mapping)
        if renamed == expr:
            return value
        if isinstance(value, torch.SymInt):
            return shape_env.create_symintnode(renamed, hint=None)
        if isinstance(value, torch.SymFloat):
            return shape_env.create_symfloatnode(renamed, hint=None)
        return shape_env.create_symboolnode(renamed)
    if isinstance(value, torch.Tensor) and not free_unbacked_symbols(value) & set(mapping):
        return value
    if isinstance(value, torch.Tensor):
        def size(v):
            return _renamed(v, mapping, shape_env)

        sizes, strides = [size(v) for v in value.shape], [size(v) for v in value.stride()]
        offset = size(value.storage_offset())
        with value.fake_mode:
            fresh = torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)
            return fresh.as_strided(sizes, strides, offset) if not (isinstance(offset, int) and offset == 0) \
                else fresh
    return value


def captured_text(gm: torch.fx.GraphModule, title: str) -> str:
    """ir.print_graph of `gm`'s graph, then of each distinct body it calls (its identifier and number of calls):
    the capture stage's dump and what the compile cache's key hashes (the bodies are part of the graph)."""
    text = ir.print_graph(gm.graph, title)
    for body in body_calls(gm.graph, gm):
        text += captured_text(body.module, f"body {body.attribute} ({body.identifier}), called "
                                           f"{len(body.calls)} time{'s' if len(body.calls) > 1 else ''}")
    return text
