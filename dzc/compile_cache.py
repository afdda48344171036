"""The warm-compile cache: what the passes made of a captured graph, kept across processes in the cache directory.

A second process that captures the same graph (the same ATen graph, the same input metadata and symbolic sizes)
for the same target, options, pass list and versions skips the passes: it loads the rewritten graph and its
stages (the dumps, where each pass fired and refused), and lowering binds it to the kernel sources already in
`<cache>/kernels` (written by the first process; lowering rewrites a source only when it differs). What Inductor
compiled for the graph's leftover ops travels beside it as torch's own cache artifacts
(`torch.compiler.save_cache_artifacts`, loaded with `load_cache_artifacts` before the fallback compiles, so
Inductor's FX graph cache hits), with the key that cache gave it: a hit loads it by that key, without hashing the
graph again (dzc/inductor_entry.py).

Layout: `<cache>/compile/<key>.pkl`, one entry per graph (a pickled dict, the rewritten graph in torch's
GraphPickler form, which keeps the fake values and symbolic sizes; beside it each node's value type for the graph's
text, lowering's specs, and the coverage and host syncs of the build that stored it), written atomically (temporary
file + rename). A hit whose fallback runs the graph as Python rebuilds almost none of the fake values (Entry.values):
what reads them on a warm start reads what is stored beside the graph instead; the rewrite check has every value
rebuilt, and Inductor's fallback its inputs' and outputs' only, the rest where its FX graph cache misses.
The key (`entry_key`) hashes everything that changes the result: the captured graph's text and its inputs'
metadata (sizes symbolic or not, strides, dtypes, devices), the values of its tensor constants, the target and
its profile's fingerprint, the options that reach the passes and lowering, the pass list, and the versions of
dzc (a hash of its sources), torch, Triton and TileLang. A stale entry is therefore just not found. An entry that
cannot be read (a truncated write, a hand edit, another format) is rebuilt with a warning.

Capture entries skip AOTAutograd too (its trace is half of a warm compile): `<cache>/compile/capture/<key>.pkl`,
keyed by the graph as Dynamo captured it (capture_key: its code, its inputs' fake metadata with symbolic sizes and
which of them share storage, the code of Python functions it calls, its tensor constants, the global state
AOTAutograd traces under, and everything entry_key hashes but the ATen graph), point to the entry of the graph
AOTAutograd made of it, and hold what running that graph directly needs: the constants it reads, the inputs it
writes (their version counters), and the shape guards the first compile relied on (re-evaluated on the new
capture's symbolic sizes, as torch's own FX graph cache does: where they do not hold, it is a miss). One is
written only where AOTAutograd's runtime wrapper has nothing to do but call the graph (direct_convention), the
graph has no collectives (every rank must take the same path), and the rewrite check passed or did not apply;
its hit reports the check as done when the entry was built.

Frame entries (dzc/frame_cache.py, `<cache>/compile/frames/`) go one step further: Dynamo's bytecode and guards for
a compiled model, pointing at capture entries, so that a warm start skips Dynamo's trace as well. The eager
fallback's compiled Python code is kept too (`<cache>/compile/code/`, graph_function).

The cache directory (DZC_CACHE_DIR or CompileOptions.cache_dir) is one self-contained directory: kernels/, the
tuning database, compile/ entries; copy it to another machine of the same kind (same GPU, same versions) and the
first compile there is warm. Set TRITON_CACHE_DIR and TILELANG_CACHE_DIR inside it too to carry Triton's and
TileLang's compiled binaries.
Entries are pickles: load only cache directories you trust, as with torch's own caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import linecache
import marshal
import os
import pickle
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._functorch.config
import torch.fx
import torch.fx.experimental.symbolic_shapes as symbolic_shapes
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx._graph_pickler import (GraphPickler, Options, _GraphModulePickleData, _GraphPickleData,
                                     _GraphUnpickler, _NodePickleData, _OpPickleData, _TensorPickleData,
                                     _UnpickleState)
from torch.fx._lazy_graph_module import _LazyGraphModule

from dzc import config
from dzc.outline_regions import CALL

FORMAT_VERSION = 6  # 2: the value types and the build's analyses stored beside the graph; 3: lowering's specs;
# 4: the region call each inlined node came from (outline_regions.CALL); 5: Inductor's key (inductor_entry);
# 6: the kernel ids Inductor's compiled code calls, beside its key
# Options that do not change what the passes and lowering make of a graph: where the cache lives (a copied
# directory must still hit) and the shipped tuning database (read by tuning, at the first call).
# nested_regions changes what the captured graph is made of (region calls or not), which the key hashes itself.
_KEY_EXCLUDED_OPTIONS = ("cache_dir", "tuning_db", "nested_regions")


@functools.cache
def dzc_source_hash() -> str:
    """A hash of dzc's sources (dzc/, passes/, targets/ with its templates): any edit there is a new dzc version."""
    import dzc.passes  # noqa: PLC0415 (packages whose directories are hashed)
    import dzc.targets  # noqa: PLC0415

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(dzc.passes.__file__).parent, Path(dzc.targets.__file__).parent):
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".tmpl") and p.is_file()):
            digest.update(f"\0{path.relative_to(package.parent)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    """The versions an entry was made with (any difference misses)."""
    try:
        tilelang = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        tilelang = "not installed"
    import triton  # noqa: PLC0415 (dzc imports it already; here only its version)

    return {"dzc": dzc_source_hash(), "torch": torch.__version__, "triton": triton.__version__,
            "tilelang": tilelang, "format": str(FORMAT_VERSION)}


def _describe_input(value) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor({tuple(str(s) for s in value.shape)}, stride={tuple(str(s) for s in value.stride())}, "
                f"offset={value.storage_offset()}, {value.dtype}, {value.device.type}, "
                f"grad={value.requires_grad})")
    return f"{type(value).__name__}({value})"


def _constants(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's tensor constants (get_attr), by value: a pass may read them."""
    described = []
    # AOTAutograd calls the backend with its fake mode active: reading a real constant's bytes must leave it.
    with unset_fake_temporarily():
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.fx.GraphModule):  # a region body (invoke_subgraph): its own constants
                described += [f"{node.target}.{constant}" for constant in _constants(value)]
                continue
            if isinstance(value, torch.Tensor) and not value.is_meta and not isinstance(value, FakeTensor):
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                described.append(f"{node.target}: {_describe_input(value)} {hashlib.sha256(data).hexdigest()[:16]}")
            else:
                described.append(f"{node.target}: {type(value).__name__}")
    return described


def pass_identity(graph_pass) -> str:
    """A pass by name and where its code is (file name and line, not the path: a copied cache must hit): a pass
    swapped for another function under the same name (a test's wrapper) is another pass. Its code's content is
    in the dzc source hash."""
    function = graph_pass.func if isinstance(graph_pass, functools.partial) else graph_pass
    code = getattr(function, "__code__", None)
    where = f"{Path(code.co_filename).name}:{code.co_firstlineno}" if code is not None else type(function).__name__
    return f"{graph_pass.__name__} ({where})"


def chosen_options(options) -> str:
    """The options that change what the passes and lowering make of a graph, as text."""
    chosen = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name not in _KEY_EXCLUDED_OPTIONS}
    chosen["check_rewrites"] = options.resolved_check_rewrites()
    return repr(sorted(chosen.items()))


def entry_key(captured_text: str, gm: torch.fx.GraphModule, example_inputs, target, options,
              passes: list, extra_versions: dict[str, str] | None = None,
              extra_parts: dict | None = None) -> tuple[str, dict]:
    """(the entry's key, the parts it hashes). captured_text: ir.print_graph of the captured graph; passes: the
    pipeline's passes that run (disabled ones left out)."""
    parts = {
        "graph": captured_text,
        "inputs": [_describe_input(value) for value in example_inputs],
        "constants": _constants(gm),
        "target": target.name,
        "profile": target.profile.fingerprint,
        "options": chosen_options(options),
        "passes": [pass_identity(p) for p in passes],
        "versions": {**versions(), **(extra_versions or {})},
        **(extra_parts or {}),
    }
    text = repr(sorted(parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32], parts


@dataclass
class Entry:
    """What a build's passes made of the graph: the rewritten graph (before lowering), the stages ((name, text,
    rewrites, refusals), the last three None for "capture"), torch's cache artifacts for the fallback compile
    (None where there were none), each node's value type as ir.value_type gives it (by node name: the lowered
    graph's text without the fake values), lowering's specs (lower_graph's `specs`, or None where they did not
    pickle), the analyses of the build that stored it (Analyses, or None) and what Inductor's FX graph cache
    keyed its fallback compile by (inductor_entry.InductorRecord, or None).

    Its nodes' fake values are rebuilt when asked for (`values`): rebuilding all of them through torch's
    MetaConverter was most of a warm load (10880 tensors for the multimodal model at full depth), and a warm hit
    whose fallback runs the graph as Python reads what is stored beside them instead."""

    graph: torch.fx.Graph
    stages: list[tuple[str, str, list[str] | None, list[tuple[str, str]] | None]]
    torch_artifacts: bytes | None = None
    types: dict[str, object] | None = None
    specs: dict[str, object] | None = None
    analyses: Analyses | None = None
    inductor: object | None = None
    _deferred: _DeferredValues | None = None

    def values(self, nodes=None) -> None:
        """Put the fake values of `nodes` (every node: None) back in their meta["val"]."""
        if self._deferred is not None:
            self._deferred.rebuild(self.graph.nodes if nodes is None else nodes)


@dataclass
class Analyses:
    """What the build that stored an entry worked out from its lowered graph's fake values, for a hit whose lowered
    graph is the same (`outcome`, lowering_outcome): its coverage and host syncs (dzc/capture.py)."""

    outcome: str
    coverage: object
    host_syncs: list[str]


def lowering_outcome(graph: torch.fx.Graph) -> str:
    """A hash of what a lowered graph's analyses read besides the values lowering leaves as they were: each node's
    op, inputs and whether a kernel runs it."""
    digest = hashlib.sha256()
    for node in graph.nodes:
        inputs = ",".join(n.name for n in node.all_input_nodes)
        digest.update(f"{node.name} {node.op} {node.target} {inputs} {bool(node.kwargs.get('kernel_id'))}\n".encode())
    return digest.hexdigest()[:32]


class _Deferred:
    """A fake tensor of a loaded graph, not rebuilt yet: GraphPickler's description of it and the load's state
    (its MetaConverter: tensors sharing a storage or a view's base are rebuilt as sharing them)."""

    __slots__ = ("data", "state", "index", "value")

    def __init__(self, data: _TensorPickleData, state: _UnpickleState, index: int):
        self.data, self.state, self.index, self.value = data, state, index, None


class _DeferredValues:
    """The fake values of a loaded graph's nodes, rebuilt on demand. Within a storage, tensors are rebuilt in the
    order of the stored graph, as loading them all would: the first to be rebuilt gets a fresh storage, the others
    are set onto it (torch's MetaConverter), so a node read alone gets the value a full load gives it."""

    def __init__(self, pending: dict[torch.fx.Node, object], deferred: list[_Deferred], fake_mode):
        self.pending, self.fake_mode = pending, fake_mode
        self.storages: dict[object, list[_Deferred]] = {}
        for item in deferred:
            storage = item.data.metadata.storage
            self.storages.setdefault(storage.id if storage is not None else ("own", item.index), []).append(item)

    def rebuild(self, nodes) -> None:
        wanted = [node for node in nodes if node in self.pending]
        if not wanted:
            return
        with self.fake_mode:
            for node in wanted:
                if node in self.pending:  # (a node may be asked for twice)
                    node.meta["val"] = self._value(self.pending.pop(node))

    def _value(self, value):
        if isinstance(value, _Deferred):
            if value.value is None:
                storage = value.data.metadata.storage
                for item in self.storages[storage.id if storage is not None else ("own", value.index)]:
                    if item.index > value.index:
                        break
                    if item.value is None:
                        item.value = item.data.unpickle(item.state)
            return value.value
        if isinstance(value, (tuple, list)):
            items = [self._value(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            return type(value)((key, self._value(item)) for key, item in value.items())
        return value


def _deferred_in(value, found: list) -> bool:
    """Whether `value` (a node's stored value) holds deferred tensors, collected into `found` (all of them: no
    short cut)."""
    if isinstance(value, _Deferred):
        found.append(value)
        return True
    if isinstance(value, (tuple, list)):
        return any([_deferred_in(item, found) for item in value])
    if isinstance(value, dict):
        return any([_deferred_in(item, found) for item in value.values()])
    return False


# The node metadata lowering, coverage and Inductor read, and the region call a node was inlined from (the
# fallback outlines the calls again: a warm start must hand Inductor the graph the cold one did, or its cache
# misses); the rest (where a node came from, module stacks) holds objects that do not pickle and nothing a later
# stage needs.
_KEPT_METADATA = frozenset({"val", "tensor_meta", "stack_trace", "unbacked_bindings", "original_aten", CALL})


def _no_mode() -> None:
    return None


@contextlib.contextmanager
def _slice_as_pytree_node():
    """GraphPickler maps over slices with pytree: dumps and loads register `slice` as a pytree node and deregister it
    after, which changes torch.utils._pytree.SUPPORTED_NODES. Dynamo guards that dict's version (PEP 509) wherever
    it traced pytree.tree_flatten, as it does for each call of a nested compile region given a kwarg or an object
    (a cache) in torch 2.13: every graph pickled or loaded would then fail the guards of every graph compiled
    before it, and the frame recompile (dzc/regions.py; repro in docs/results/compile_time_cpu.md). Here
    the module's SUPPORTED_NODES is a copy with `slice` in it while GraphPickler runs (GraphPickler then registers
    nothing), and the dict Dynamo guards is put back untouched."""
    registry = pytree.SUPPORTED_NODES
    if slice in registry:
        yield
        return
    pytree.SUPPORTED_NODES = {**registry, slice: pytree.NodeDef(slice, lambda x: ([x.start, x.stop, x.step], None),
                                                                lambda x, c: slice(*x), None)}
    try:
        yield
    finally:
        pytree.SUPPORTED_NODES = registry


class _GraphPickler(GraphPickler):
    """GraphPickler, where a fake view's base (torch 2.13 clears the fake mode of the view's own description, not of
    its base's) does not pickle the mode either: unpickling puts the loading fake mode on both. A graph module's
    records are made by _graph_module_data: the same objects, so the same bytes, as GraphPickler's.
    compiled: a module whose code is its graph's already (GraphModule's constructor generated it): not generated
    again."""

    def __init__(self, file, options: Options | None = None, compiled: torch.fx.GraphModule | None = None):
        super().__init__(file, options)
        self.compiled = compiled

    def reducer_override(self, obj):
        if isinstance(obj, FakeTensorMode):
            return _no_mode, ()
        if isinstance(obj, torch.fx.GraphModule):
            data = _graph_module_data(obj, self.options, recompile=obj is not self.compiled)
            return _GraphModulePickleData.unpickle, (data, self._unpickle_state)
        return super().reducer_override(obj)


def _graph_module_data(gm: torch.fx.GraphModule, options: Options, recompile: bool) -> _GraphModulePickleData:
    """_GraphModulePickleData(gm, options), its node records made by _node_data; recompile: generate the module's
    code first, as torch does (its code is pickled with it)."""
    data = _GraphModulePickleData.__new__(_GraphModulePickleData)
    if recompile and isinstance(gm, _LazyGraphModule):
        gm._real_recompile()
    elif recompile:
        gm.recompile()
    data.gm_dict = gm.__getstate__() if hasattr(gm, "__getstate__") else gm.__dict__.copy()
    del data.gm_dict["_graph"]
    graph = data.graph = _GraphPickleData.__new__(_GraphPickleData)
    graph.tracer_cls, graph.tracer_extras = gm._graph._tracer_cls, gm._graph._tracer_extras
    records: dict = {}
    for node in gm._graph.nodes:
        records[node] = _node_data(node, records, options)
    graph.nodes = tuple(records.values())
    graph._codegen = gm._graph._codegen
    return data


# The containers FX arguments are made of, rebuilt as torch's pytree rebuilds them (each a new object of its type).
_SEQUENCES = frozenset({tuple, list, torch.fx.immutable_collections.immutable_list})
_MAPPINGS = frozenset({dict, torch.fx.immutable_collections.immutable_dict})


def _node_records(value, records: dict):
    """pytree.tree_map_only(torch.fx.Node, records.__getitem__, value): what GraphPickler makes of a node's
    arguments, for the plain containers without pytree's generic machinery (other pytree nodes go through it)."""
    kind = type(value)
    if kind is torch.fx.Node:
        return records[value]
    if kind in _SEQUENCES:
        return kind([_node_records(item, records) for item in value])
    if kind in _MAPPINGS:
        return kind({key: _node_records(item, records) for key, item in value.items()})
    if kind is slice:
        return slice(*(_node_records(item, records) for item in (value.start, value.stop, value.step)))
    if kind in pytree.SUPPORTED_NODES or pytree.is_namedtuple_instance(value) or isinstance(value, torch.fx.Node):
        return pytree.tree_map_only(torch.fx.Node, records.__getitem__, value)
    return value


def _node_data(node: torch.fx.Node, records: dict, options: Options) -> _NodePickleData:
    """_NodePickleData(node, records, options), its arguments mapped by _node_records instead of torch's pytree
    maps (two per node, most of making a deep graph's records). Attributes in the order torch sets them: the
    pickled dict is the same."""
    data = _NodePickleData.__new__(_NodePickleData)
    data.args = _node_records(node.args, records)
    data.kwargs = _node_records(node.kwargs, records)
    data.name, data.op = node.name, node.op
    data.target = _OpPickleData.pickle(node.target, options)
    data.type = node.type
    keep = options.node_metadata_key_filter
    data.meta = {k: v for k, v in node.meta.items() if not keep or keep(k)}
    return data


class _NodeData(_NodePickleData):
    """A node as GraphPickler pickles it, rebuilt with its arguments' node records replaced by _with_nodes instead of
    torch's pytree maps: those, two per node, were a quarter of loading a graph (the deeper the model, the more
    nodes), and each left a reference cycle (pytree's recursive helper) for the cyclic GC to collect."""

    def unpickle(self, graph: torch.fx.Graph, mapping: dict, unpickle_state: _UnpickleState) -> torch.fx.Node:
        target = self.target.unpickle(unpickle_state)
        node = graph.create_node(self.op, target, _with_nodes(self.args, mapping), _with_nodes(self.kwargs, mapping),
                                 self.name, self.type)
        node.meta = self.meta
        return node


def _with_nodes(value, mapping: dict):
    """A pickled node's arguments, each node record in them replaced by its node in `mapping`: through the
    containers an FX argument can hold (tuples, named or not, lists, dicts and slices)."""
    if isinstance(value, _NodePickleData):
        return mapping[value]
    if isinstance(value, (tuple, list)):
        items = [_with_nodes(item, mapping) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((key, _with_nodes(item, mapping)) for key, item in value.items())
    if isinstance(value, slice):
        return slice(*(_with_nodes(item, mapping) for item in (value.start, value.stop, value.step)))
    return value


class _Unpickler(_GraphUnpickler):
    """GraphPickler's unpickler, whose node records are _NodeData (the pickled form is GraphPickler's own) and, with
    `defer`, whose fake tensors are _Deferred (rebuilt by _DeferredValues)."""

    def __init__(self, stream, state: _UnpickleState, defer: bool):
        super().__init__(stream, state)
        self.deferred: list[_Deferred] | None = [] if defer else None

    def find_class(self, module: str, name: str):
        if module == _NodePickleData.__module__ and name == _NodePickleData.__name__:
            return _NodeData
        if self.deferred is not None and module == _TensorPickleData.__module__ \
                and name == f"{_TensorPickleData.__qualname__}.unpickle":
            return self._defer
        return super().find_class(module, name)

    def _defer(self, data: _TensorPickleData, state: _UnpickleState) -> _Deferred:
        self.deferred.append(_Deferred(data, state, len(self.deferred)))
        return self.deferred[-1]


def _load_graph_module(data: bytes, fake_mode: FakeTensorMode) -> torch.fx.GraphModule:
    """GraphPickler.loads of `data`, its nodes rebuilt as _NodeData (call it as GraphPickler.loads is called here:
    under `fake_mode` and _slice_as_pytree_node)."""
    with io.BytesIO(data) as stream:
        return _Unpickler(stream, _UnpickleState(fake_mode), defer=False).load()


def _load_graph_deferred(data: bytes, fake_mode: FakeTensorMode) -> tuple[torch.fx.Graph, _DeferredValues | None]:
    """_load_graph_module, the nodes' fake values left to rebuild (their meta["val"] taken out until asked for).
    Where a fake tensor is stored elsewhere than in a value (a node's argument), all are rebuilt as they load."""
    with io.BytesIO(data) as stream:
        unpickler = _Unpickler(stream, _UnpickleState(fake_mode), defer=True)
        graph = unpickler.load().graph
    pending, found = {}, []
    for node in graph.nodes:
        if _deferred_in(node.meta.get("val"), found):
            pending[node] = node.meta.pop("val")
    if len({id(item) for item in found}) != len(unpickler.deferred):
        return _load_graph_module(data, fake_mode).graph, None
    return graph, _DeferredValues(pending, unpickler.deferred, fake_mode)


def pickle_graph(graph: torch.fx.Graph, root: torch.nn.Module) -> bytes | str:
    """The graph in GraphPickler form (fake values and symbolic sizes kept), or why it cannot be pickled. `root`
    holds the tensor constants it reads (get_attr): GraphPickler keeps only their metadata (their values are in
    the entry's key; a hit's graph reads those of the module being compiled, or of its capture entry)."""
    options = Options(ops_filter=None, node_metadata_key_filter=_KEPT_METADATA.__contains__)
    try:
        module = torch.fx.GraphModule(root, graph)
        # GraphPickler.dumps, the module's code generated once (GraphPickler would generate it a second time).
        with _slice_as_pytree_node(), io.BytesIO() as stream:
            _GraphPickler(stream, options, compiled=module).dump(module)
            return stream.getvalue()
    except Exception as err:  # noqa: BLE001  (a graph GraphPickler cannot write is only not cached)
        return f"not stored: the graph cannot be pickled ({type(err).__name__}: {str(err)[:200]})"


class CompileCache:
    """The entries of one cache directory."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.directory = Path(cache_dir) / "compile"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.pkl"

    def load(self, key: str, fake_mode, warn: bool = True) -> tuple[Entry | None, str]:
        """(the entry, "") on a hit; (None, "") when there is none; (None, why) when the file is unreadable (it is
        then rebuilt: the caller's store replaces it), with a warning unless `warn` is off."""

        def entry(stored: dict) -> Entry:
            with fake_mode, _slice_as_pytree_node():
                graph, deferred = _load_graph_deferred(stored["graph"], fake_mode)
            return Entry(graph, stored["stages"], stored["torch_artifacts"], stored["types"], stored["specs"],
                         stored["analyses"], stored["inductor"], deferred)

        return self._read(self.path(key), key, entry, warn)

    @staticmethod
    def _warn(path: Path, why: str) -> str:
        message = f"corrupted entry rebuilt ({why})"
        warnings.warn(f"dzc: compile cache entry {path} is unreadable ({why}); compiling the graph again and "
                      "replacing it", RuntimeWarning, stacklevel=4)
        return message

    def store(self, key: str, parts: dict, graph: bytes, stages: list, types: dict, torch_artifacts: bytes | None,
              specs: dict, analyses: Analyses | None, inductor=None) -> str:
        """Write an entry (graph: pickle_graph's bytes; types: ir.value_types of that graph; specs: lowering's;
        inductor: inductor_entry.record's);
        returns "" or, when it could not be written (read-only, full disk), why (the compile stands, it is only not
        cached)."""
        try:
            pickle.dumps(specs)
        except Exception:  # noqa: BLE001  (a spec holding a symbolic size: a hit rebuilds the values lowering reads)
            specs = None
        data = pickle.dumps({"format": FORMAT_VERSION, "key": key, "parts": parts, "graph": graph,
                             "stages": stages, "types": types, "torch_artifacts": torch_artifacts,
                             "specs": specs, "analyses": analyses, "inductor": inductor})
        return write_atomically(self.path(key), data)

    def capture_path(self, key: str) -> Path:
        return self.directory / "capture" / f"{key}.pkl"

    def load_capture(self, key: str) -> tuple[CaptureEntry | None, str]:
        """(the capture entry, "") on a hit; (None, "") when there is none; (None, why) with a warning when the
        file is unreadable (it is rebuilt)."""
        return self._read(self.capture_path(key), key, lambda stored: stored["entry"], warn=True)

    def frame_path(self, key: str) -> Path:
        return self.directory / "frames" / f"{key}.pkl"

    def load_frame(self, key: str) -> tuple[object | None, str]:
        """(the frame entry dzc/frame_cache.py stored, "") on a hit; (None, "") when there is none; (None, why) when
        the file is unreadable (no warning: the report says so, and it is replaced)."""
        return self._read(self.frame_path(key), key, lambda stored: stored["entry"], warn=False)

    def store_frame(self, key: str, parts: dict, entry) -> str:
        """Write a frame entry; "" or why it could not be written."""
        return write_atomically(self.frame_path(key), pickle.dumps(
            {"format": FORMAT_VERSION, "key": key, "parts": parts, "entry": entry}))

    def _read(self, path: Path, key: str, make, warn: bool):
        """(make(the stored dict), "") for a readable format-FORMAT_VERSION file of `key`; (None, "") when there is
        none; (None, why) when it is unreadable, with a warning if `warn`."""
        try:
            stored = pickle.loads(path.read_bytes())
            if not isinstance(stored, dict) or stored.get("format") != FORMAT_VERSION or stored.get("key") != key:
                raise ValueError(f"not a format-{FORMAT_VERSION} entry for this key")
            return make(stored), ""
        except FileNotFoundError:
            return None, ""
        except Exception as err:  # noqa: BLE001  (anything a damaged or unreadable file raises: it is rebuilt)
            why = f"{type(err).__name__}: {str(err)[:200]}"
            return None, self._warn(path, why) if warn else why

    def store_capture(self, key: str, parts: dict, entry: CaptureEntry) -> str:
        """Write a capture entry; "" or why it could not be written."""
        return write_atomically(self.capture_path(key), pickle.dumps(
            {"format": FORMAT_VERSION, "key": key, "parts": parts, "entry": entry}))


def graph_function(root: torch.nn.Module, graph: torch.fx.Graph, cache_dir: str | os.PathLike | None):
    """The forward of torch.fx.GraphModule(root, graph), whose Python code is compiled once per cache directory: its
    bytecode is kept in `<cache>/compile/code/`, named by a hash of the source and the Python version (compile() of
    a deep model's code, ~18K lines for the multimodal model at 61 + 32 layers, was 0.47 s of its warm load). No
    cache directory (the compile cache off): compiled as GraphModule compiles it. A graph whose code is not plain FX
    (a pytree codegen reads the module's specs) is a GraphModule's forward."""
    if type(graph._codegen) is not torch.fx.graph.CodeGen:
        return torch.fx.GraphModule(root, graph).forward
    module = _LazyGraphModule(root, graph)  # the attributes the graph reads; its own code is never generated
    python_code = graph.python_code(root_module="self")
    source = python_code.src
    key = hashlib.sha256(f"{sys.implementation.cache_tag}\n{source}".encode()).hexdigest()[:32]
    filename = f"<dzc graph {key}>"
    path = Path(cache_dir) / "compile" / "code" / f"{key}.marshal" if cache_dir is not None else None
    code = None
    if path is not None and path.exists():
        try:
            code = marshal.loads(path.read_bytes())
        except Exception:  # noqa: BLE001  (a damaged file: compiled again and replaced)
            code = None
    if not isinstance(code, types.CodeType):
        code = compile(source, filename, "exec", dont_inherit=True)
        if path is not None:
            write_atomically(path, marshal.dumps(code))  # (not written: only compiled again next time)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # tracebacks
    scope = dict(python_code.globals)
    exec(code, scope)  # noqa: S102  (the graph's own generated code, as GraphModule runs it)
    return types.MethodType(scope["forward"], module)


def write_atomically(path: Path, data: bytes) -> str:
    """Write `path` as a whole or not at all (temporary file + rename); "" or why it could not be written (the
    compile stands, it is only not cached)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)
    except OSError as err:
        return f"not stored in {path.parent} ({type(err).__name__}: {err})"
    return ""


@dataclass
class CaptureEntry:
    """What running a Dynamo capture's cached graph needs without AOTAutograd: `entry` (the key of the entry of
    the ATen graph AOTAutograd made of it), `constants` (name -> tensor the graph reads with get_attr, stored on
    the CPU, with its device), `written` (indices of the inputs the graph writes in place), `bumped` (those whose
    version counters AOTAutograd's wrapper bumps after a call), `guards` (the shape guards over the capture's
    SymInt inputs, torch's guard-expression form, or None for a static graph) and `check` (the rewrite check's
    outcome when the entry was built)."""

    entry: str
    constants: dict[str, tuple[torch.Tensor, str]]
    written: frozenset[int]
    bumped: tuple[int, ...]
    guards: str | None
    check: str


def _shape_env():
    context = torch._guards.TracingContext.try_get()
    return context.fake_mode.shape_env if context is not None and context.fake_mode is not None else None


# torch 2.13 names them has_guarding_hint and guarding_hint_or_throw; earlier versions has_hint and hint_int
_has_hint = (getattr(symbolic_shapes, "has_guarding_hint", None) or getattr(symbolic_shapes, "has_hint", None)
             or (lambda s: s.node.hint is not None))
_hint = (getattr(symbolic_shapes, "guarding_hint_or_throw", None) or getattr(symbolic_shapes, "hint_int", None)
         or (lambda s: s.node.hint))


def _symints(example_inputs) -> list[torch.SymInt]:
    """The capture's symbolic sizes (Dynamo passes each as an input), those guards can be about."""
    return [s for s in example_inputs if isinstance(s, torch.SymInt) and _has_hint(s)]


def guards_expression(example_inputs) -> str | None:
    """The shape guards of the compile in progress over the capture's SymInt inputs (those AOTAutograd, the
    passes and lowering added included), in torch's guard-expression form; None for a static graph."""
    symints, shape_env = _symints(example_inputs), _shape_env()
    if not symints or shape_env is None:
        return None
    return shape_env.produce_guards_expression(placeholders=symints, guards=shape_env.get_pruned_guards(symints))


def guards_hold(expression: str | None, example_inputs) -> bool:
    """Whether a capture entry's guards hold for this capture's symbolic sizes; evaluated on the SymInts, it
    installs them as guards of the new compile (so that Dynamo re-captures where they stop holding)."""
    symints, shape_env = _symints(example_inputs), _shape_env()
    if expression is None or shape_env is None:
        return expression is None and not symints
    # On the sizes' values first: a guard that fails must not be installed (as its negation) on the new compile.
    if not shape_env.evaluate_guards_expression(expression, [_hint(s) for s in symints]):
        return False
    return bool(shape_env.evaluate_guards_expression(expression, symints))


# Capture entries hold the graph's constants: beyond this, the graph is only cached after AOTAutograd.
MAX_CAPTURE_CONSTANT_BYTES = 16 * 2**20
# Modules of functions whose code is torch's (in the versions) or the language's: other Python functions a
# graph calls (allow_in_graph) are hashed by their code, which AOTAutograd traces.
_VERSIONED_MODULES = ("torch", "_operator", "operator", "math", "builtins", "_functools", "functools")


def global_state() -> str:
    """The process state tracing depends on and the graph does not show (grad mode, autocast, the attention kernels
    SDPA may pick, the GPU), as text."""
    state = {
        "grad": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
        "autocast": {d: str(torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                     if torch.is_autocast_enabled(d)},
        "deterministic": torch.are_deterministic_algorithms_enabled(), "default dtype": str(torch.get_default_dtype()),
        "functorch config": hashlib.sha256(torch._functorch.config.save_config()).hexdigest()[:16],
        # Which attention op SDPA traces to depends on these and on the GPU.
        "sdpa": [f() for f in (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                               torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled)],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return repr(sorted(state.items()))


def capture_key(gm: torch.fx.GraphModule, example_inputs, target, options, passes) -> tuple[str | None, dict | str]:
    """(the key, its parts) of a graph as Dynamo captured it, or (None, why it has no capture entry)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None, "its inputs do not match its placeholders"
    if any(isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, torch.nn.Parameter) for v in example_inputs):
        return None, "its inputs include tensor subclasses (AOTAutograd unwraps them)"
    functions = []
    # Region bodies (invoke_subgraph's GraphModule attributes) are part of the graph: their code goes in the key.
    bodies = sorted((name, module) for name, module in gm.named_modules() if isinstance(module, torch.fx.GraphModule)
                    and module is not gm)
    for node in (node for module in [gm, *(m for _, m in bodies)] for node in module.graph.nodes):
        if node.op == "call_module":
            return None, f"it calls submodule {node.target} (its code is not in the key)"
        if node.op == "call_function" and not isinstance(node.target, (torch._ops.OpOverload,
                                                                       torch._ops.OpOverloadPacket)):
            module = getattr(node.target, "__module__", None) or ""
            if module.split(".")[0] not in _VERSIONED_MODULES:
                code = getattr(node.target, "__code__", None)
                if code is None:
                    return None, f"it calls {node.target!r}, whose code cannot be hashed"
                functions.append(f"{module}.{node.target.__qualname__}: "
                                 + hashlib.sha256(marshal.dumps(code)).hexdigest()[:16])
    # Symbolic sizes (s27), not this call's: the fake values Dynamo traced with.
    values = [node.meta.get("example_value", value) for node, value in zip(placeholders, example_inputs)]
    # Which inputs share storage (AOTAutograd handles aliased inputs its own way): per input, the first with its
    # storage.
    storages: dict[int, int] = {}
    aliasing = [storages.setdefault(v.untyped_storage().data_ptr(), i) if isinstance(v, torch.Tensor) else None
                for i, v in enumerate(example_inputs)]
    code = "".join([gm.code, *(f"\n# body {name}\n{module.code}" for name, module in bodies)])
    return entry_key("captured by Dynamo\n" + code, gm, values, target, options, passes,
                     extra_parts={"kind": "capture", "aliasing": aliasing, "functions": functions,
                                  "global state": global_state()})


def enabled() -> bool:
    return config.COMPILE_CACHE.get() == "1"


def save_torch_artifacts() -> bytes | None:
    """torch's cache artifacts made in this process so far (Inductor's FX graph cache entries, its Triton
    bundles, autotuning results), or None where there are none."""
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception:  # noqa: BLE001  (an optional speed-up: without it the fallback compiles again)
        return None
    return saved[0] if saved else None


def load_torch_artifacts(artifacts: bytes | None) -> None:
    """Put saved artifacts into torch's local caches (the fallback compile then hits Inductor's FX graph cache)."""
    if artifacts:
        try:
            torch.compiler.load_cache_artifacts(artifacts)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"dzc: torch's cache artifacts in the compile cache could not be loaded ({err}); the "
                          "fallback compiles again", RuntimeWarning, stacklevel=3)
