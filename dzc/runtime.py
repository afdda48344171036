"""Run-time side of compiled models: the table of loaded kernels, and CUDA-graph replay for small token counts.

Lowered dzc op nodes name their kernel by id (`kernel_id='add_rms_norm.triton.3f2a9c01'`); the op looks the id up
here. Ids are hashes of the generated source and profile, so a graph printed in one process names the same
kernels as in another.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import time
import traceback
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._prims_common
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters as dynamo_counters

_KERNELS: dict[str, Callable] = {}


class NotRunnableError(RuntimeError):
    """A compiled graph reached a kernel that was generated but cannot execute in this process (no device for
    the target, or a codegen that cannot run on these tensors)."""


def register_kernel(kernel_id: str, kernel: Callable) -> None:
    _KERNELS[kernel_id] = kernel


def launch(kernel_id: str, *args):
    try:
        kernel = _KERNELS[kernel_id]
    except KeyError:
        raise RuntimeError(f"dzc kernel {kernel_id!r} is not loaded in this process; compile the model with "
                           f"dzc.compile here (graphs name kernels, they do not carry them)") from None
    return kernel(*args)


def direct_launcher(kernel_id: str) -> Callable:
    """A plain function calling the kernel, for graphs that call kernels without going through the op."""
    kernel = _KERNELS[kernel_id]

    def launch_kernel(*args):
        return kernel(*args)

    launch_kernel.__name__ = launch_kernel.__qualname__ = "dzc_" + kernel_id.replace(".", "_")
    return launch_kernel


# ---------------------------------------------------------------------------------------------------------
# CUDA-graph replay. The decisions (argument flattening, tokens, graph keys, block-table buckets, which arguments
# a call writes) are plain functions of tensors, run on any device; only capture and replay need CUDA.

# Leaves that are values, not state: part of the graph key by value (Dynamo specialises on them too).
_VALUES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_NUMBERS = (int, float, bool)
# How deep argument objects are searched for tensors (an HF cache: cache -> layers -> layer -> keys is 3).
_OBJECT_DEPTH = 4
# Tensor arguments without a version counter (inference tensors) up to this size are compared before and after
# the first call of a signature, to see writes made outside compiled graphs; larger ones are treated as state.
_COMPARED_BYTES = 64 << 20
BLOCK_TABLE = "block_table"  # the parameter whose width runs are bucketed (see pad_block_table)


class Unkeyable(Exception):
    """An argument the runner cannot key (a callable, an object without __dict__, a structure too deep)."""


@dataclass
class FlatCall:
    """One call's arguments as the runner sees them.

    inputs: the tensors passed directly (positional, keyword, inside lists, tuples, dicts or pytree nodes): a
    step's inputs, copied into the graph's own buffers unless the call writes them. state: the tensors reached
    through argument objects (a KV cache object's attributes), always read and written in place, at the address
    they had at capture. structure: everything else, hashable (containers, keyword names, values, object types).
    """

    structure: tuple
    inputs: list
    state: list
    objects: list

    def rebuild(self, args: tuple, kwargs: dict, inputs: list) -> tuple[tuple, dict]:
        """(args, kwargs) with the direct tensors replaced by `inputs`, in flattening order."""
        replacements = iter(inputs)
        return _replace(args, replacements), _replace(kwargs, replacements)


def flatten_call(args: tuple, kwargs: dict) -> FlatCall:
    """Flatten a call's arguments (raises Unkeyable). Builtin containers by hand (pytree's generic flatten costs
    ~20 µs a call, as much as the replay saves), other registered pytree nodes (named tuples, model outputs)
    through torch.utils._pytree, objects (caches) by their attributes."""
    if not kwargs:
        for value in args:
            if not isinstance(value, torch.Tensor):
                break
        else:  # tensors only, the usual call: the structure _flatten gives, without walking it
            structure = _TENSORS_ONLY.get(len(args))
            if structure is None:
                structure = _TENSORS_ONLY[len(args)] = ((tuple, len(args)), *[_TENSOR] * len(args), (dict, ()))
            return FlatCall(structure, list(args), [], [])
    call = FlatCall([], [], [], [])
    _flatten(args, call)
    _flatten(kwargs, call)
    call.structure = tuple(call.structure)
    return call


def _flatten(value, call: FlatCall) -> None:
    if isinstance(value, torch.Tensor):
        call.structure.append(_TENSOR)
        call.inputs.append(value)
    elif isinstance(value, _VALUES):
        call.structure.append((type(value), value))
    elif type(value) in (tuple, list):
        call.structure.append((type(value), len(value)))
        for item in value:
            _flatten(item, call)
    elif type(value) is dict:
        call.structure.append((dict, tuple(value)))
        for item in value.values():
            _flatten(item, call)
    elif _pytree_node(value):
        children, spec = pytree.tree_flatten(value)
        call.structure.append(spec)
        for item in children:
            _flatten(item, call)
    else:
        call.structure.append((object, type(value), len(call.state)))
        call.objects.append(value)
        _collect_state(value, call.state, _OBJECT_DEPTH, set())
        call.structure.append(len(call.state))


_TENSOR = "tensor"
_TENSORS_ONLY: dict[int, tuple] = {}  # argument count -> structure of a call passing only tensors, positionally


def _pytree_node(value) -> bool:
    """A container registered with torch.utils._pytree (named tuples, transformers' model outputs)."""
    return type(value) in pytree.SUPPORTED_NODES or pytree.is_namedtuple_instance(value)


def _replace(value, replacements):
    if isinstance(value, torch.Tensor):
        return next(replacements)
    if type(value) in (tuple, list):
        return type(value)(_replace(item, replacements) for item in value)
    if type(value) is dict:
        return {key: _replace(item, replacements) for key, item in value.items()}
    if isinstance(value, _VALUES) or not _pytree_node(value):
        return value  # values, and objects (their tensors are used in place)
    children, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten([_replace(item, replacements) for item in children], spec)


def _collect_state(value, out: list, depth: int, seen: set) -> None:
    """The tensors an argument object holds, in attribute order."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return
    if isinstance(value, _VALUES) or id(value) in seen:
        return
    if type(value) in (tuple, list):
        # Lists of plain numbers (a sequence's lengths, a free-page list) hold no state: not walked element-wise.
        if not value or (isinstance(value[0], _NUMBERS) and isinstance(value[-1], _NUMBERS)):
            return
        items = value
    elif type(value) is dict:
        items = value.values()
    elif hasattr(value, "__dict__") and not callable(value) and not isinstance(value, type):
        items = vars(value).values()
    else:
        raise Unkeyable(f"an argument holds a {type(value).__name__}, which the CUDA-graph runner cannot key "
                        f"(callables and objects without __dict__)")
    if depth == 0:
        raise Unkeyable(f"an argument object nests deeper than {_OBJECT_DEPTH} levels")
    seen.add(id(value))
    for item in items:
        _collect_state(item, out, depth - 1, seen)


def _snapshot(value, depth: int = _OBJECT_DEPTH + 1):
    """An argument object's observable Python state: which tensors (identity and metadata) and values it holds,
    to see whether a call changed it (a replay would not repeat a change made on the host)."""
    if isinstance(value, torch.Tensor):
        return (id(value), value.shape, value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, _VALUES) or depth == 0:
        return value if isinstance(value, _VALUES) else id(value)
    if type(value) in (tuple, list):
        return (type(value), tuple(_snapshot(item, depth - 1) for item in value))
    if type(value) is dict:
        return (dict, tuple((key, _snapshot(item, depth - 1)) for key, item in value.items()))
    if hasattr(value, "__dict__") and not callable(value):
        return (type(value), tuple((key, _snapshot(item, depth - 1)) for key, item in vars(value).items()))
    return id(value)


def call_tokens(inputs: list) -> int:
    """Tokens of a call, from its direct tensor inputs (state such as a cache's tensors never counts): the rows
    (all dims but the last) of the largest floating input, the activations. Without one, token ids: the element
    count shared by the most integer tensors (ids, positions and cache slots have one element per token; a
    block table or an attention mask over the context has another), ties to the first in argument order."""
    rows, counts = 0, {}
    for a in inputs:
        if a.dim() == 0:
            continue
        if a.is_floating_point():
            rows = max(rows, a.numel() // max(a.shape[-1], 1))
        elif not rows:
            counts[a.numel()] = counts.get(a.numel(), 0) + 1
    if rows or not counts:
        return rows
    return max(counts, key=counts.get)  # dicts keep insertion order and max keeps the first of equal counts


def _meta(a: torch.Tensor) -> tuple:
    return (a.shape, a.stride(), a.dtype, a.device, a.is_inference(), a.requires_grad)


def graph_key(call: FlatCall) -> tuple:
    """What a captured graph is specialised on: the structure and values, each direct input's shape, strides,
    dtype, device and inference flag, each state tensor's too and its address (a graph reads and writes state in
    place), which tensors share storage (Dynamo compiles aliased inputs apart), and inference mode."""
    # Built on every call that may replay: _meta inlined (a function call per tensor costs as much as its fields).
    tensors = call.inputs + call.state
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    aliasing = tuple(storages.index(s) for s in storages) if len(set(storages)) < len(storages) else ()
    inputs = tuple([(a.shape, a.stride(), a.dtype, a.device, a.is_inference(), a.requires_grad) for a in call.inputs])
    return (call.structure, inputs, tuple((_meta(s), s.data_ptr()) for s in call.state), aliasing,
            torch.is_inference_mode_enabled())


def page_bucket(width: int) -> int:
    """Block-table widths are bucketed to a power-of-two page count: a table that widens by one page every
    page_size tokens is captured log2(pages) times, not once per page."""
    return 1 << max(width - 1, 0).bit_length()


def pad_block_table(table):
    """A block table [sequences, pages] padded with page 0 to page_bucket(pages) columns, or `table` itself when
    it is already that wide or is not a 2-D integer tensor.

    Harmless by the paged-cache contract (dzc.kv_cache.PagedKVCache.block_table): entries past a sequence's pages
    are never read, the sequence lengths mark those positions invalid; shorter sequences in a batch are padded
    with page 0 the same way."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.is_floating_point():
        return table
    width = table.shape[1]
    wanted = page_bucket(width)
    return table if wanted == width else torch.nn.functional.pad(table, (0, wanted - width))


def block_table_position(model) -> int | None:
    """Where `block_table` sits among the model's positional parameters (it may also come by keyword)."""
    forward = getattr(model, "forward", model)
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(BLOCK_TABLE) if BLOCK_TABLE in positional else None


_writes: list | None = None  # while a CudaGraphRunner observes a call: the tensors compiled graphs write


def recording_writes(compiled: Callable, written) -> Callable:
    """`compiled` (a graph's compiled function), noting its arguments at positions `written` (the inputs the
    graph writes in place: AOTAutograd's input mutations) while a CudaGraphRunner observes a call."""
    if not written:
        return compiled
    written = tuple(sorted(written))

    def run(*args):
        if _writes is not None:
            _writes.extend(args[i] for i in written)
        return compiled(*args)

    return run


@contextlib.contextmanager
def _observing_writes():
    global _writes
    outer, _writes = _writes, []
    try:
        yield _writes
    finally:
        if outer is not None:
            outer.extend(_writes)  # a compiled model called inside another one: the outer call wrote these too
        _writes = outer


@dataclass
class Signature:
    """What the calls of a graph key run as they are showed: `refused` (why such calls never replay), `in_place`
    (the direct inputs used at their own address: written by the call, sharing storage, or not dense), `written`
    (indices into inputs + state of the tensors with version counters the call writes: a replay bumps them, as
    the call itself does), `warm` (the last call ran without compiling anything: every compiled graph it reached
    had run its own code; the next call may be captured if nothing compiled since `warm_at`, a _compiles() count),
    `host_s` (host seconds of the last warm call run as it is), `tokens` (call_tokens of the key's calls)."""

    refused: str | None = None
    in_place: frozenset = frozenset()
    written: tuple = ()
    warm: bool = False
    warm_at: int = -1
    graphs: int = 0  # captured so far (one per address of the in-place inputs)
    host_s: float | None = None
    tokens: int = 0
    # Keys above the runner's max_tokens replay only where it pays: GPU seconds of timed replays (copies included)
    # until `pays` is decided against host_s (CudaGraphRunner._judge).
    replay_s: tuple = ()
    pays: bool | None = None
    copy_outputs: bool = False  # a replay found the outputs it lent still held: later replays copy them out
    pending: tuple | None = None  # CUDA events around a timed replay not read yet
    # Keys above max_tokens: the direct inputs' addresses at the key's last call before its first capture, and
    # the inputs its graphs read at their own address because those repeated (CudaGraphRunner._read_in_place;
    # None: not decided yet, empty: copied).
    addresses: tuple = ()
    reads: frozenset | None = None

    def merge(self, later: "Signature") -> "Signature":
        """This key's signature after another call run as it is showed `later`."""
        return dataclasses.replace(self, refused=self.refused or later.refused,
                                   in_place=self.in_place | later.in_place,
                                   written=tuple(sorted(set(self.written) | set(later.written))),
                                   warm=later.warm, warm_at=later.warm_at,
                                   host_s=later.host_s if later.host_s is not None else self.host_s)

    def capturable(self) -> bool:
        """Warm, and no graph compiled since (one compiled by another call may be what this key's calls reach next,
        its own code not yet run)."""
        return self.warm and self.warm_at == _compiles()


def _compiles() -> int:
    """Frames Dynamo has tried to compile in this process: a call during which it moves compiled something."""
    return dynamo_counters["frames"]["total"]


def observe(fn: Callable, args: tuple, kwargs: dict, call: FlatCall):
    """Run the call as it is (a key's calls until one is warm: they compile and tune what they meet, their side
    effects happen once) and work out its Signature: which direct inputs it writes, from the compiled graphs'
    input mutations (AOTAutograd), version counters where tensors have them, and a comparison of the small
    inference tensors (writes by eager code between graph breaks); whether it changed its argument objects'
    Python state; whether it compiled anything.

    Warm matters because a compiled graph's first call is not its steady state: dzc's rewrite check runs the
    graph as captured instead of the compiled code, and Inductor's first run picks among its kernel configs by
    timing them (a host sync). Either inside a capture invalidates it."""
    inputs, tensors = call.inputs, call.inputs + call.state
    versions = [None if a.is_inference() else a._version for a in tensors]
    compared = {i: a.clone() for i, a in enumerate(inputs)
                if versions[i] is None and a.numel() * a.element_size() <= _COMPARED_BYTES}
    metadata = [(a.shape, a.stride(), a.storage_offset()) for a in inputs]
    before = [_snapshot(obj) for obj in call.objects]
    compiles = _compiles()
    with _observing_writes() as written:
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        host_s = time.perf_counter() - started
    warm = _compiles() == compiles
    warm_at = compiles if warm else -1
    written_storages = {t.untyped_storage().data_ptr() for t in written if isinstance(t, torch.Tensor)}
    storages = [a.untyped_storage().data_ptr() for a in tensors]
    moved = [versions[i] is not None and a._version != versions[i] for i, a in enumerate(tensors)]
    in_place = set()
    for i, a in enumerate(inputs):
        if (storages[i] in written_storages or storages.count(storages[i]) > 1 or not _dense(a) or moved[i]
                or (versions[i] is None and (i not in compared or not _same(compared[i], a)))):
            in_place.add(i)
    bumped = tuple(i for i, a in enumerate(tensors)
                   if versions[i] is not None and (moved[i] or storages[i] in written_storages))
    if metadata != [(a.shape, a.stride(), a.storage_offset()) for a in inputs]:
        return result, Signature("the call changes an argument's shape or strides (a replay would not)")
    if before != [_snapshot(obj) for obj in call.objects]:
        return result, Signature("the call changes its argument objects' Python state, e.g. replaces a cache's "
                                 "tensors (a replay would not)")
    return result, Signature(None, frozenset(in_place), bumped, warm, warm_at, host_s=host_s if warm else None)


def _dense(a: torch.Tensor) -> bool:
    return torch._prims_common.is_non_overlapping_and_dense_or_false(a)


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    return torch.equal(before, after) if not before.is_floating_point() else bool(
        ((before == after) | (before.isnan() & after.isnan())).all())


class CudaGraphRunner:
    """Replays one CUDA graph per graph key, above Dynamo (dzc.compile's wrapper): always for calls with at most
    `max_tokens` tokens, and for repeated keys with more tokens where a replay measurably pays.

    Small calls are bound by host time: Dynamo's guards, AOTAutograd's wrappers and one launch per kernel cost far
    more than the GPU work. A replay costs one graph launch. It skips the guards, so the contract (the one serving
    engines' CUDA graphs have) is: parameters, module attributes and the non-tensor attributes of argument objects
    are frozen once a key has been captured (in-place updates of their tensors are seen; reassigned parameters are
    not: call `reset()` or compile again).

    Per graph key (flatten_call, graph_key): calls run as they are (observe: they compile, tune, and show what the
    call writes; their side effects, buffer updates included, happen once) until one compiled nothing (warm: see
    observe); the next is captured (the capture runs no kernel) and replayed, unless a graph was compiled since
    (then it runs as it is again); later ones replay. Each call's work runs exactly once. Direct tensor inputs
    are copied into the graph's own buffers at every replay, unless the call writes them (or they share storage,
    or are not dense): those are used at their own address, which becomes part of the key (at most
    MAX_GRAPHS_PER_SIGNATURE addresses). Tensors held by argument objects (caches) are always used at their own
    address. A replay bumps the version counters of the tensors the call writes, as the call does.

    Outputs: with `reuse_outputs`, every call that replays (the captured call and later ones) returns the graph's
    buffers, which the next replay of that key overwrites (a decode loop that consumes each step's output first);
    calls run as they are return their own tensors. Otherwise the caller owns what it gets: a replay lends aliases
    of the graph's buffers (no copy), and replays again only once nothing holds them (the buffers' storage use
    counts are back to the graph's own: no alias, view or storage of them is left); a loop that holds one step's
    output while making the next call gets the key a second graph (`twin`), and if both are held the call runs as
    it is and the key's later replays copy their outputs out (one copy kernel for all outputs).

    Calls with more than `max_tokens` tokens: a key is observed from its second call on (prefill of ever new
    lengths costs only the key), captured as above, and its first replays are timed on the GPU (copies included);
    the key keeps replaying only if that GPU time is below the host time of its warm call run as it is (the call
    was host-bound), otherwise its graphs are dropped and it runs as it is (`describe()` says so). Where its calls
    bring their inputs at the same addresses, its graphs read them there instead of copying them
    (_read_in_place). At most MAX_LARGE_GRAPHS such keys hold graphs (their buffers are large); the least
    recently used is dropped. A `block_table` argument is padded to a power-of-two page count (pad_block_table).
    Calls that cannot be keyed (`bypassed` says why) or that change their argument objects' Python state run `fn`.

    A capture that fails (the call waits on the GPU, uses a stream or generator the capture does not follow, or
    Dynamo compiles during it) leaves CUDA as it was (capture ended, allocator and stream restored, the CUDA RNG
    out of capture mode: see _abandon_capture); the key is refused with the error, and such calls run `fn`.
    `describe()` lists the keys, their state and the refusals.
    """

    MAX_GRAPHS = 32  # graphs kept; the least recently used is dropped beyond that
    MAX_GRAPHS_PER_SIGNATURE = 4
    MAX_LARGE_GRAPHS = 4  # keys above max_tokens holding graphs (each with at most two)
    TIMED_REPLAYS = 2  # of a key above max_tokens, before deciding whether replaying pays (the fastest counts)

    def __init__(self, fn: Callable, max_tokens: int, reuse_outputs: bool, model=None):
        self.fn = fn
        self.max_tokens = max_tokens
        self.reuse_outputs = reuse_outputs
        self.block_table_position = block_table_position(model) if model is not None else None
        self.signatures: OrderedDict[tuple, Signature] = OrderedDict()
        self.graphs: OrderedDict[tuple, _CapturedGraph] = OrderedDict()
        self.bypassed: collections.Counter[str] = collections.Counter()
        self.pool = None
        self.pool_graphs: weakref.WeakSet = weakref.WeakSet()  # the live graphs captured into self.pool
        self.capture_streams: dict = {}  # per device: one stream for every capture into the shared pool

    def reset(self) -> None:
        self.signatures.clear()
        self.graphs.clear()

    def describe(self) -> str:
        """One line per key: warm or not, its graphs, in-place inputs, and why it is refused; then the bypasses."""
        held = sum(graph.bytes() for graph in self.graphs.values())
        lines = [f"{len(self.graphs)} graphs" + (f" ({held / 2**20:.1f} MiB of buffers)" if held else "")
                 + f", {len(self.signatures)} keys"]
        for n, signature in enumerate(self.signatures.values()):
            warmth = ("warm" if signature.capturable() else "warm before the last compile" if signature.warm
                      else "not warm yet (its last call compiled)")
            state = f"refused: {signature.refused}" if signature.refused else f"{signature.graphs} graphs, {warmth}"
            if signature.tokens > self.max_tokens and not signature.refused:
                state += (f"; {signature.tokens} tokens: " + ("replays pay" if signature.pays else
                                                                "replays being timed"))
            if signature.reads:
                state += f"; inputs {sorted(signature.reads)} read in place (they came at the same addresses)"
            if signature.copy_outputs:
                state += "; outputs copied out (a caller held a replay's outputs)"
            lines.append(f"  key {n}: {state}; in place: {sorted(signature.in_place)}")
        lines += [f"  bypassed {count}x: {reason}" for reason, count in self.bypassed.items()]
        return "\n".join(lines)

    def __call__(self, *args, **kwargs):
        padded_args, padded_kwargs = self._pad_block_table(args, kwargs)
        try:
            call = flatten_call(padded_args, padded_kwargs)
        except Unkeyable as reason:
            return self._bypass(str(reason), args, kwargs)
        # On another device the runner has nothing to do; checked before asking CUDA about capture, which a
        # CPU-only torch cannot answer. Inside another capture (a compiled model called by one being captured)
        # the call is part of that capture.
        tensors = call.inputs + call.state
        if not tensors or not all(t.is_cuda for t in tensors) or torch.cuda.is_current_stream_capturing():
            return self.fn(*args, **kwargs)
        key = graph_key(call)
        signature = self.signatures.get(key)
        if signature is None:
            signature = Signature(tokens=call_tokens(call.inputs))
            if signature.tokens > self.max_tokens:  # observed from the key's second call on
                self._remember(key, signature)
                return self.fn(*args, **kwargs)
            return self._observe(key, signature, padded_args, padded_kwargs, call)
        if signature.refused:
            self.signatures.move_to_end(key)
            return self.fn(*args, **kwargs)
        if signature.tokens > self.max_tokens:
            self._read_in_place(key, signature, call)
        if not signature.warm:
            return self._observe(key, signature, padded_args, padded_kwargs, call)
        self.signatures.move_to_end(key)
        full_key = (key, tuple(call.inputs[i].data_ptr() for i in sorted(signature.in_place))
                    if signature.in_place else ())
        graph = self.graphs.get(full_key)
        if graph is None:
            if not signature.capturable():  # a graph compiled since: this call may be its first
                return self._observe(key, signature, padded_args, padded_kwargs, call)
            if signature.graphs >= self.MAX_GRAPHS_PER_SIGNATURE:
                signature.refused = (f"the arguments it writes came at {signature.graphs} addresses: each would "
                                     "need its own graph")
                return self.fn(*args, **kwargs)
            graph = self._capture(call, padded_args, padded_kwargs, signature)
            if graph is None:
                return self.fn(*args, **kwargs)
            signature.graphs += 1
            self._keep(full_key, graph, signature)
            return graph.replay(tensors, self._outputs(signature))  # not timed: a first replay uploads the graph
        self.graphs.move_to_end(full_key)
        if signature.pays is None and signature.tokens > self.max_tokens and not self._judge(key, signature):
            return self.fn(*args, **kwargs)
        if not graph.idle():  # the outputs it lent last time are still held: a replay would overwrite them
            twin = graph.twin
            if twin is None and not signature.copy_outputs and signature.capturable():
                twin = graph.twin = self._capture(call, padded_args, padded_kwargs, signature)
                if twin is None:
                    return self.fn(*args, **kwargs)
                return twin.replay(tensors, self._outputs(signature))
            if twin is None or not twin.idle():
                signature.copy_outputs = True  # the caller keeps more than one call's outputs
                return self.fn(*args, **kwargs)
            graph = twin
        if signature.pays is None and signature.tokens > self.max_tokens and signature.pending is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = graph.replay(tensors, self._outputs(signature))
            end.record()
            signature.pending = (start, end)
            return result
        return graph.replay(tensors, self._outputs(signature))

    def _outputs(self, signature: Signature) -> str:
        return "reuse" if self.reuse_outputs else "copy" if signature.copy_outputs else "lend"

    def _judge(self, key, signature: Signature) -> bool:
        """For a key above max_tokens: take a timed replay's GPU time once it is done, and after TIMED_REPLAYS
        decide whether replaying pays (the fastest replay's GPU time, copies included, below the host time of
        the warm call run as it is). False when it does not: the key is refused and its graphs dropped."""
        if signature.pending is not None and signature.pending[1].query():
            start, end = signature.pending
            signature.pending = None
            signature.replay_s += (start.elapsed_time(end) * 1e-3,)
        if len(signature.replay_s) < self.TIMED_REPLAYS:
            return True
        replay_s, host_s = min(signature.replay_s), signature.host_s
        signature.pays = host_s is not None and replay_s < host_s
        if not signature.pays:
            signature.refused = (f"{signature.tokens} tokens (above {self.max_tokens}): a replay takes "
                                 f"{replay_s * 1e6:.0f} us of GPU time, "
                                 f"{'inputs read in place' if signature.reads else 'copies included'}, the call "
                                 f"as it is {(host_s or 0) * 1e6:.0f} us of host time: not host-bound, it runs as it "
                                 "is")
            self._drop_graphs(key)
        return signature.pays

    def _drop_graphs(self, key) -> None:
        """Forget the graphs captured for `key` (every address of its in-place inputs)."""
        for full_key in [k for k in self.graphs if k[0] == key]:
            del self.graphs[full_key]

    def _read_in_place(self, key, signature: Signature, call: FlatCall) -> None:
        """A key above max_tokens whose calls bring their inputs at the same addresses (a serving engine's static
        input buffers, a benchmark loop) is captured reading them there: a replay then copies nothing (at 4096
        tokens of hidden 2880 the two inputs' copies cost as much GPU time as the kernel). Decided when the key is
        first captured: from the addresses of its last two calls. Reading in place is safe for any tensor at those
        addresses with the key's metadata: the graph never writes them, and an input at its own address is alive
        during the call. The first call at other addresses turns it off for good: the key's graphs are dropped,
        and it is captured again copying its inputs (replays timed again), as other keys are."""
        addresses = tuple(a.data_ptr() for a in call.inputs)
        if signature.reads is None:
            if signature.graphs == 0 and not (signature.warm and signature.capturable()):
                signature.addresses = addresses  # not capturable yet: the next call is compared with this one
                return
            signature.reads = frozenset(i for i, a in enumerate(call.inputs) if i not in signature.in_place
                                        and _dense(a)) if addresses == signature.addresses else frozenset()
            signature.in_place |= signature.reads
        elif signature.reads and addresses != signature.addresses:
            signature.in_place -= signature.reads
            signature.reads = frozenset()
            signature.graphs, signature.replay_s, signature.pays, signature.pending = 0, (), None, None
            self._drop_graphs(key)
            return
        signature.addresses = addresses

    def _keep(self, full_key, graph: "_CapturedGraph", signature: Signature) -> None:
        """Keep a captured graph: MAX_GRAPHS in all, MAX_LARGE_GRAPHS of keys above max_tokens."""
        graph.large = signature.tokens > self.max_tokens
        self.graphs[full_key] = graph
        if graph.large:
            large = [k for k, g in self.graphs.items() if g.large]
            if len(large) > self.MAX_LARGE_GRAPHS:
                del self.graphs[large[0]]
        if len(self.graphs) > self.MAX_GRAPHS:
            self.graphs.popitem(last=False)

    def _remember(self, key, signature: Signature) -> None:
        self.signatures[key] = signature
        self.signatures.move_to_end(key)
        if len(self.signatures) > 4 * self.MAX_GRAPHS:
            self.signatures.popitem(last=False)

    def _observe(self, key, signature: Signature, args, kwargs, call: FlatCall):
        """Run the call as it is and record what it showed under its key."""
        result, observed = observe(self.fn, args, kwargs, call)
        self._remember(key, signature.merge(observed))
        return result

    def _pad_block_table(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        position = self.block_table_position
        if position is not None and position < len(args):
            return (*args[:position], pad_block_table(args[position]), *args[position + 1:]), kwargs
        if BLOCK_TABLE in kwargs:
            return args, {**kwargs, BLOCK_TABLE: pad_block_table(kwargs[BLOCK_TABLE])}
        return args, kwargs

    def _bypass(self, reason: str, args, kwargs):
        if not self.bypassed[reason]:
            warnings.warn(f"dzc: calls like this one run without CUDA graphs: {reason}", stacklevel=3)
        self.bypassed[reason] += 1
        return self.fn(*args, **kwargs)

    def _capture(self, call: FlatCall, args, kwargs, signature: Signature) -> "_CapturedGraph | None":
        """Capture the call on the graph's own copies of its copied inputs; None (the key refused, the reason
        recorded and warned once) when it cannot be captured, so that such calls run `fn`."""
        device = call.inputs[0].device if call.inputs else call.state[0].device
        if not self.pool_graphs:
            # A fresh pool once no captured graph lives: the allocator marks a pool whose graphs are all gone (its
            # blocks possibly still held by returned outputs) as being freed, and asserts when a capture joins it
            # (H200: "it->second->use_count > 0 INTERNAL ASSERT FAILED" after a key's graphs were dropped).
            self.pool = torch.cuda.graph_pool_handle()
        static = [a if i in signature.in_place else _own_copy(a) for i, a in enumerate(call.inputs)]
        static_args, static_kwargs = call.rebuild(args, kwargs, static)
        graph = torch.cuda.CUDAGraph()
        compiles = _compiles()
        failure = None
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream()
            if device not in self.capture_streams:
                self.capture_streams[device] = torch.cuda.Stream(device)
            capture_stream = self.capture_streams[device]
            try:
                # thread_local, as Inductor's CUDA-graph trees capture: CUDA calls other threads make (a compile
                # worker, a data loader) do not invalidate this capture; this thread's unsafe calls still do.
                with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream,
                                      capture_error_mode="thread_local"):
                    outputs = self.fn(*static_args, **static_kwargs)
            except BaseException as error:  # any failure: CUDA is left as it was, the call runs as it is
                failure = _capture_error(error)
                rng_lost = _abandon_capture(graph, self.pool, capture_stream, stream, device)
                if not isinstance(error, Exception):
                    raise
                if rng_lost:
                    failure += "; the CUDA RNG could not be taken out of capture mode (random ops on it will fail)"
        if failure is None and _compiles() != compiles:
            # Compiled while capturing: the new graph's first call ran inside the capture (see observe).
            failure = ("Dynamo compiled during the capture (a guard the graph key does not cover failed): "
                       "calls of this key do not run the same graphs")
        if failure is not None:
            signature.refused = f"capture failed: {failure}"
            warnings.warn(f"dzc: calls of this signature run without a CUDA graph: {signature.refused}",
                          stacklevel=3)
            return None
        self.pool_graphs.add(graph)
        copied = [(i, s) for i, s in enumerate(static) if i not in signature.in_place]
        return _CapturedGraph(graph, copied, outputs, signature.written)


# Graphs whose capture failed. Kept alive: the allocators may still hold a filter that points at the graph (torch
# ends a capture's allocation routing only after a successful cudaStreamEndCapture).
_ABANDONED: list = []


def _capture_error(error: BaseException) -> str:
    """What went wrong in a capture: the error raised inside it (torch.cuda.graph's exit, ending the invalidated
    capture, raises its own error over it), with the innermost frame where it was raised."""
    errors = [error]
    while errors[-1].__context__ is not None and len(errors) < 4:
        errors.append(errors[-1].__context__)
    first = errors[-1]  # the one raised first
    text = (str(first).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(first.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    described = f"{type(first).__name__}: {text}{where}"
    if first is not error:
        described += f"; ending the capture: {(str(error).strip().splitlines() or [''])[0]}"
    return described


def _abandon_capture(graph, pool, capture_stream, stream, device) -> bool:
    """Leave CUDA as it was before a capture that failed at any point; True if the CUDA RNG is still unusable.

    torch.cuda.graph's exit raises when cudaStreamEndCapture fails (an invalidated capture) before it undoes the
    rest: the allocator keeps routing to the graph's pool, the current stream stays the capture stream, and the
    CUDA generator stays in capture mode (every later random op raises "Offset increment outside graph capture
    encountered unexpectedly", seen on the H200). Each step is undone here, those already undone are skipped."""
    with torch.cuda.stream(capture_stream):
        if torch.cuda.is_current_stream_capturing():  # failed before the capture's end was reached
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
    try:
        graph.pool()  # raises unless the capture ended successfully (then torch has undone its own state)
    except RuntimeError:
        _ABANDONED.append(graph)
    torch.cuda.set_stream(stream)
    with contextlib.suppress(RuntimeError):  # raises where capture_end got that far
        torch._C._cuda_endAllocateToPool(device.index, pool)
    if _rng_usable(device):
        return False
    # The generator leaves capture mode at the end of a successful capture: one that captures nothing.
    with warnings.catch_warnings(), contextlib.suppress(RuntimeError):
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            pass
    if _rng_usable(device):
        return False
    # Failing that, a copy of the generator's state (seed and offset), not in capture mode, replaces it.
    generator = torch.cuda.default_generators[device.index]
    generator.graphsafe_set_state(generator.clone_state())
    return not _rng_usable(device)


def _rng_usable(device) -> bool:
    """Whether the device's default generator can draw outside a capture (its state restored after the probe)."""
    generator = torch.cuda.default_generators[device.index]
    state = generator.get_state()
    try:
        torch.empty(1, device=device).uniform_()
    except RuntimeError:
        return False
    finally:
        generator.set_state(state)
    return True


def _own_copy(a: torch.Tensor) -> torch.Tensor:
    """A buffer holding a's values with a's strides, inference flag (Dynamo's guards check both) and address modulo
    16 bytes (Triton specialises kernels on 16-byte alignment: another one would compile inside the capture)."""
    skew = a.storage_offset() * a.element_size() % 16 // a.element_size()
    with torch.inference_mode(a.is_inference()):
        storage = torch.empty(skew + torch._prims_common.compute_required_storage_length(a.shape, a.stride(), 0),
                              dtype=a.dtype, device=a.device)
        return storage.as_strided(a.shape, a.stride(), skew).copy_(a)


# Storage use counts tell whether anything outside a graph still holds its buffers (Inductor's CUDA-graph trees
# read them the same way). A tensor's storage counts each TensorImpl on it, plus a constant for its Python storage
# object once one was made: measured here on one tensor.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _own_count() -> int:
    probe = torch.empty(1)  # held while its storage is read
    return _USE_COUNT(_storage_of(probe)) - 1


_OWN_COUNT = _own_count() if _USE_COUNT is not None else None


def _lendable(outputs: list, owned: list) -> list | None:
    """(storage, use count) of each storage the tensors in `outputs` are on, the count being what the graph's own
    tensors (`owned`: outputs and input buffers) account for; None where anything else holds one of them (an output
    that is an argument, or a tensor the model keeps): such outputs are never lent."""
    if _USE_COUNT is None:
        return None
    own = collections.Counter(_storage_of(t) for t in {id(t): t for t in owned}.values())
    watched = []
    for storage in dict.fromkeys(_storage_of(t) for t in outputs):
        count = own[storage] + _OWN_COUNT
        if _USE_COUNT(storage) != count:
            return None
        watched.append((storage, count))
    return watched


class _CapturedGraph:
    def __init__(self, graph, copied: list, outputs, written: tuple):
        self.graph = graph
        self.positions = [i for i, _ in copied]
        self.buffers = [buffer for _, buffer in copied]
        self.written = written
        self.flat_outputs, self.output_spec = pytree.tree_flatten(outputs)
        self.tensor_outputs = [i for i, o in enumerate(self.flat_outputs) if isinstance(o, torch.Tensor)]
        outs = [self.flat_outputs[i] for i in self.tensor_outputs]
        self.watched = _lendable(outs, outs + self.buffers)
        self.lent = False  # whether a replay returned aliases of the outputs
        self.twin: _CapturedGraph | None = None  # the key's second graph (CudaGraphRunner.__call__)
        self.large = False  # of a key above the runner's max_tokens

    def bytes(self) -> int:
        """Bytes of the input copies and outputs this graph (and its twin) hold."""
        own = {id(t): t for t in self.buffers + [self.flat_outputs[i] for i in self.tensor_outputs]}
        held = sum(t.untyped_storage().nbytes() for t in own.values())
        return held + (self.twin.bytes() if self.twin is not None else 0)

    def idle(self) -> bool:
        """Whether nothing holds the outputs this graph lent (their aliases, views or storages), so that a replay
        may overwrite them."""
        return not self.lent or all(_USE_COUNT(storage) == count for storage, count in self.watched)

    def replay(self, tensors: list, outputs: str):
        """tensors: the call's direct inputs, then its state (FlatCall's order). outputs: "reuse" (the graph's
        buffers), "lend" (aliases of them: the runner replays again only once they are gone) or "copy"."""
        # Copied at every replay: a same tensor may hold new values without a version counter telling
        # (inference tensors, or a buffer another graph's replay wrote).
        if self.buffers:
            torch._foreach_copy_(self.buffers, [tensors[i] for i in self.positions])
        self.graph.replay()
        for i in self.written:  # one at a time: older torch takes no list
            torch.autograd.graph.increment_version(tensors[i])
        if outputs == "reuse" or not self.tensor_outputs:
            return pytree.tree_unflatten(self.flat_outputs, self.output_spec)
        flat = list(self.flat_outputs)
        if outputs == "lend" and self.watched is not None:
            for i in self.tensor_outputs:
                flat[i] = flat[i].detach()
            self.lent = True
        else:  # one copy kernel for every output, into tensors the caller owns
            sources = [flat[i] for i in self.tensor_outputs]
            copies = [torch.empty_like(o) for o in sources]
            torch._foreach_copy_(copies, sources)
            for i, copy in zip(self.tensor_outputs, copies):
                flat[i] = copy
        return pytree.tree_unflatten(flat, self.output_spec)
