"""Lowering: give every dzc op node of a graph a generated kernel for the target, and make the graph runnable.

For each dzc op node: take the op's kernel family, read its spec from the node's fake values, choose the codegen,
render the source into the cache directory (named by a hash of source and profile, so identical kernels are
shared across models and processes), load it, and write the kernel id into the node's `kernel_id` argument.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes

from dzc import config as dzc_config
from dzc import runtime
from dzc.autotune import open_database
from dzc.ops import LOWERED_AS_PARTS
from dzc.options import CompileOptions
from dzc.report import CompileTimer
from dzc.targets import KERNEL_FAMILIES, Target, tilelang_codegen, triton_codegen
from dzc.targets.device_runtime import DeviceRuntime
from dzc.targets.launch import GeneratedKernel, KernelRecord, legal_configs

# The codegen each op prefers when options.codegen is "auto", best first. Memory-bound ops go to Triton, whose
# kernels also run on CPU tensors (interpreter); GEMM-heavy ops will prefer TileLang.
PREFERRED_CODEGENS = {"add_rms_norm": ("triton", "tilelang"),
                      "add_layer_norm": ("triton", "tilelang"),
                      # Attention is matmul-bound: TileLang's T.gemm takes 80-wide tiles (Triton pads to 64 + 16).
                      "varlen_attention": ("tilelang", "triton"),
                      # Triton first: only its kernels have the workspace path (prefill) besides online dequant.
                      "mxfp4_moe": ("triton", "tilelang"),
                      "mxfp4_moe_w4a8": ("triton",),  # W4A8 has Triton kernels only
                      # DSA on the H200: the indexer's TileLang kernel (FP8 wgmma) is 2.9x its Triton one in
                      # prefill and 3.2x in decode at 64 sequences (docs/results/dsa_indexer_tilelang_h200.md);
                      # the top-k's is 3.9-11.9x (dsa_topk_tilelang_h200.md); sparse attention is MMA-bound.
                      "dsa_indexer": ("tilelang", "triton"), "dsa_topk": ("tilelang", "triton"),
                      "sparse_attention": ("tilelang", "triton")}


@dataclass(frozen=True)
class Execution:
    """Where the compiled graph's kernels run: a device runtime, or nowhere (with the reason)."""

    runtime: DeviceRuntime | None
    not_runnable_reason: str = ""

    def describe(self) -> str:
        if self.runtime is None:
            return "not runnable here"
        return "triton interpreter (cpu)" if self.runtime.interpreted else self.runtime.device_type


def dzc_op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "dzc":
        return target._opname
    return None


def _takes_kernel_id(node: torch.fx.Node) -> bool:
    """dzc ops without a kernel_id argument (dzc.mxfp4_dequantize, which MXFP4 model code calls) run as
    themselves: they have no kernel family; a pass fuses them where they matter."""
    return any(argument.name == "kernel_id" for argument in node.target._schema.arguments)


def choose_codegen(op: str, options: CompileOptions, execution: Execution, spec=None, profile=None) -> str:
    """options.codegen, or for "auto" the op's first preferred codegen that has a kernel for `spec` with a legal
    config on `profile` and can run here (TileLang needs a GPU and an installed TileLang; without a runtime, as in
    dzc-dump, nothing runs and the preference stands)."""
    if options.codegen != "auto":
        return options.codegen
    # The first usable one only: asking whether a later one can run here imports TileLang (over a second of a warm
    # start on the H200 machine, where an op whose first choice is Triton never needs it).
    return next(_usable_codegens(op, execution, spec, profile), "triton")


def _usable_codegens(op: str, execution: Execution, spec, profile) -> Iterator[str]:
    """The op's preferred codegens, best first, that have a kernel for `spec` with a legal config on `profile` and
    can run here (all of them where nothing runs), each worked out when it is asked for."""
    family = KERNEL_FAMILIES[op]
    for name in PREFERRED_CODEGENS[op]:
        # A family may have no kernel of a codegen for some specs (`<codegen>_supports(spec)` says so).
        supports = getattr(family, f"{name}_supports", None)
        if spec is not None and supports is not None and not supports(spec):
            continue
        if spec is not None and profile is not None and not legal_configs(family, name, spec, profile)[0]:
            continue
        if name == "triton" or execution.runtime is None or (
                execution.runtime.runs_tilelang and tilelang_codegen.import_problem() is None):
            yield name


class NoLegalConfig(RuntimeError):
    """The op has no kernel config legal on the target's profile (W4A8 on a profile without FP8, say)."""


class NotRunnable:
    """Stands in for a kernel that was generated but cannot execute in this process; calling it says why."""

    def __init__(self, kernel_id: str, reason: str):
        self.kernel_id, self.reason = kernel_id, reason

    def __call__(self, *args):
        raise runtime.NotRunnableError(f"dzc kernel {self.kernel_id} cannot run here: {self.reason}")


class KernelTable:
    """One compiled model's kernels, by generated source and where they run. A kernel carries its model's tuning
    switch, tuning database and report record, so each dzc.compile keeps its own table: two models with
    different options never share a kernel, and each report records its own tuning. The table's scope goes into
    the kernel ids, which keeps the models' kernels apart in the process-wide launch table (runtime)."""

    def __init__(self, scope: str = ""):
        self.scope = scope
        self.records: dict[tuple[str, str], KernelRecord] = {}  # (source name, execution) -> record

    def kernel_id(self, name: str, execution: str) -> str:
        taken = sum(1 for (other, _) in self.records if other == name)  # the same source run elsewhere
        return ".".join(part for part in (name, self.scope, str(taken) if taken else "") if part)

    def release(self, uses: collections.Counter) -> list[KernelRecord]:
        """Take back `uses` (kernel id -> dzc op nodes) of a graph that was dropped; returns the records no graph
        uses any more, which leave the table."""
        gone = []
        for key, record in list(self.records.items()):
            record.uses -= uses.get(record.kernel_id, 0)
            if record.uses <= 0:
                del self.records[key]
                gone.append(record)
        return gone


def kernel_uses(graph: torch.fx.Graph) -> collections.Counter:
    """Kernel id -> dzc op nodes of a lowered graph that run it."""
    return collections.Counter(node.kwargs["kernel_id"] for node in graph.nodes
                               if dzc_op_name(node) and node.kwargs.get("kernel_id"))


def _reference_record(op: str, profile: str, spec: str, why: str) -> KernelRecord:
    return KernelRecord(f"{op}.reference", op, "reference", profile, spec, "", f"plain-torch reference ({why})", 0, 0,
                        uses=0)


_FALLBACK_KERNEL_DIR: list[Path] = []  # this process's own, made when a cache directory cannot be written


def write_kernel_source(kernel_dir: Path, name: str, source: str) -> tuple[Path, str]:
    """Write `source` as kernel_dir/name unless it is there already; returns its path and, when the cache
    directory could not be written (read-only, disk full), a note saying so: the source then goes to a directory
    of this process's own, so the compile still succeeds (it is only not cached for other processes)."""
    path = kernel_dir / name
    try:
        if path.exists() and path.read_text() == source:
            return path, ""
        kernel_dir.mkdir(parents=True, exist_ok=True)
        # Write then rename: a process compiling the same kernel at once never imports a half-written file.
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            partial.write_text(source)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path, ""
    except OSError as err:
        if not _FALLBACK_KERNEL_DIR:
            _FALLBACK_KERNEL_DIR.append(Path(tempfile.mkdtemp(prefix="dzc-kernels-")))
        fallback = _FALLBACK_KERNEL_DIR[0] / name
        fallback.write_text(source)
        note = f"cache directory {kernel_dir} not writable ({type(err).__name__}: {err}); source in {fallback}"
        warnings.warn(f"dzc: {note}", RuntimeWarning, stacklevel=3)
        return fallback, note


def lower_graph(graph: torch.fx.Graph, target: Target, options: CompileOptions, execution: Execution,
                device: torch.device | None, table: KernelTable | None = None,
                timer: CompileTimer | None = None, specs: dict[str, object] | None = None) -> list[KernelRecord]:
    """Bind every dzc op node in `graph` (in place) to a generated kernel; returns the report entries of the
    kernels this call added to `table` (a compiled model's own; kernels already in it are reused). `timer` gets
    the seconds of "codegen" (rendering and writing sources), "kernel load" (importing them) and "lowering" (the
    rest: specs, codegen choice, legality).

    With a table (dzc.compile), an op instance that no kernel takes (the family rejects its spec: head dim,
    dtype, size; or no config is legal on the profile) runs the op's plain-torch reference, and its record says
    why. Without one (dzc-selftest, kernel tests, which ask for that kernel), it raises.

    specs: node name -> the spec its family made of it, or why the family rejected it (text); read there instead of
    the node's fake value, filled in for the others (a compile cache entry keeps them: a warm hit then rebuilds no
    value for lowering, dzc/compile_cache.py).
    """
    timer = timer or CompileTimer()
    start = time.perf_counter()
    inner = sum(timer.seconds.get(name, 0.0) for name in ("codegen", "kernel load"))
    try:
        return _lower_graph(graph, target, options, execution, table, timer, {} if specs is None else specs)
    finally:
        inner = sum(timer.seconds.get(name, 0.0) for name in ("codegen", "kernel load")) - inner
        timer.add("lowering", time.perf_counter() - start - inner)


def _lower_graph(graph: torch.fx.Graph, target: Target, options: CompileOptions, execution: Execution,
                 table: KernelTable | None, timer: CompileTimer, specs: dict[str, object]) -> list[KernelRecord]:
    fall_back = table is not None
    table = table if table is not None else KernelTable()
    cache = Path(options.resolved_cache_dir())
    kernel_dir = cache / "kernels"
    database = open_database(cache, options.tuning_db)
    added: dict[str, KernelRecord] = {}
    # An op no kernel family takes but that has a lowering into parts (all_reduce_add_rms_norm: the backend's
    # all-reduce, then the add_rms_norm kernel) becomes those parts here; a family for it would take precedence.
    for node in list(graph.nodes):
        if dzc_op_name(node) in LOWERED_AS_PARTS and dzc_op_name(node) not in KERNEL_FAMILIES:
            LOWERED_AS_PARTS[dzc_op_name(node)](node)

    @functools.cache
    def kernel_choice(op: str, spec) -> tuple[str, list, int, str, str, str]:
        """(codegen, legal configs, how many were illegal, source, its digest, kernel name) of `op`'s kernel for
        `spec`: the same for every instance of the spec (each layer's), so worked out once a lowering."""
        codegen_name = choose_codegen(op, options, execution, spec, target.profile)
        # Legality first: a codegen with no kernel for the spec has no configs either (NoLegalConfig).
        legal, illegal = legal_configs(KERNEL_FAMILIES[op], codegen_name, spec, target.profile)
        if not legal:
            raise NoLegalConfig(f"dzc: no legal {codegen_name} config for {op} ({spec.describe()}) on "
                                f"{target.profile.name}")
        return (codegen_name, legal, illegal, *_kernel_source(op, spec, codegen_name, target.profile, timer))
    for node in graph.nodes:
        op = dzc_op_name(node)
        if op is None or not _takes_kernel_id(node):
            continue
        if op not in KERNEL_FAMILIES:
            # An op whose kernels are not written yet runs its plain-torch reference (empty kernel_id); the report
            # lists it with codegen "reference" so that nobody mistakes it for a generated kernel.
            key = f"{op}.reference"
            if key not in added:
                added[key] = _reference_record(op, target.profile.name, "", "no kernel family yet")
            added[key].uses += 1
            continue
        family = KERNEL_FAMILIES[op]
        spec = None
        try:
            known = specs.get(node.name)
            if isinstance(known, str):
                raise ValueError(known)
            try:
                spec = known if known is not None else family.spec_from_node(node)
            except ValueError as rejected:
                specs[node.name] = str(rejected)
                raise
            specs[node.name] = spec
            codegen_name, legal, illegal, source, digest, name = kernel_choice(op, spec)
            codegen = target.codegens[codegen_name]
        except (ValueError, NoLegalConfig) as rejected:
            if not fall_back:
                raise
            # Slow is better than failing the compile: the op's reference computes the same thing.
            node.update_kwarg("kernel_id", "")
            why = f"no kernel takes this instance: {rejected}".replace("dzc: ", "")
            key = f"{op}.reference: {why}"
            if key not in added:
                added[key] = _reference_record(op, target.profile.name, spec.describe() if spec else "", why)
            added[key].uses += 1
            continue
        where = f"{execution.describe()}: {execution.not_runnable_reason}"
        existing = table.records.get((name, where))
        if existing is not None:  # the same spec elsewhere in the model (every layer's norm, usually)
            existing.uses += 1
            node.update_kwarg("kernel_id", existing.kernel_id)
            continue
        kernel_id = table.kernel_id(name, where)
        node.update_kwarg("kernel_id", kernel_id)
        with timer.stage("codegen"):
            path, cache_note = write_kernel_source(kernel_dir, f"{name.replace('.', '_')}.py", source)
        reason = execution.not_runnable_reason
        if not reason and codegen_name == "tilelang" and not execution.runtime.runs_tilelang:
            reason = "TileLang kernels need a GPU (TileLang has no CPU interpreter); use codegen='triton' here"
        record = KernelRecord(kernel_id, op, codegen_name, target.profile.name, spec.describe(), str(path),
                              execution.describe() if not reason or execution.runtime is None
                              else f"not runnable here: {reason}", len(legal) + illegal, illegal,
                              notes=[cache_note] if cache_note else [])
        autotune = (not reason and (options.autotune if options.autotune is not None
                                    else not execution.runtime.interpreted))
        if reason:
            kernel = NotRunnable(kernel_id, reason)
        else:
            alternatives = []
            if autotune and options.codegen == "auto":
                # The autotuner picks across codegens: the op's other usable codegens' kernels are candidates too.
                for other in _usable_codegens(op, execution, spec, target.profile):
                    if other == codegen_name:
                        continue
                    try:
                        alternatives.append(alternative_kernel(op, spec, other, target, execution, table, where,
                                                               kernel_dir, database, timer))
                    except Exception as err:  # only slower without it: the compile goes on
                        record.notes.append(f"{other} kernel not offered to the tuner: {type(err).__name__}: "
                                            f"{str(err).splitlines()[0][:200]}")
            with timer.stage("kernel load"):
                kernel = GeneratedKernel(family=family, spec=spec, codegen=codegen, profile=target.profile,
                                         runtime=execution.runtime,
                                         compiled=codegen.load(family, path, spec, target.profile), source_path=path,
                                         source_hash=digest, record=record, autotune=autotune, database=database,
                                         alternatives=alternatives)
            if getattr(kernel.compiled, "prebuilding", 0):
                record.notes.append(f"its untuned configs' {kernel.compiled.prebuilding} TileLang kernel(s) building "
                                    "in child processes (DZC_TILELANG_PREBUILD)")
        runtime.register_kernel(kernel_id, kernel)
        table.records[(name, where)] = record
        added[kernel_id] = record
    return list(added.values())


def precompile_triton_kernels(graph: torch.fx.Graph, execution: Execution,
                              device: torch.device | None) -> triton_codegen.Precompile | None:
    """Start compiling the Triton kernels the lowered `graph`'s first call launches (triton_codegen.Precompile).
    None where nothing is compiled ahead: DZC_TRITON_PRECOMPILE=0, no device or Triton's interpreter, a Triton
    without asynchronous compiles, or no Triton kernel in the graph."""
    if (dzc_config.TRITON_PRECOMPILE.get() != "1" or device is None or execution.runtime is None
            or execution.runtime.interpreted or not triton_codegen.Precompile.available()):
        return None
    jobs = precompile_jobs(graph)
    if not jobs:
        return None
    module = getattr(torch, device.type)  # torch.cuda / torch.musa: their device(...) makes it current
    return triton_codegen.Precompile(jobs, lambda: module.device(device), max(1, min(8, (os.cpu_count() or 2) - 1)))


def precompile_jobs(graph: torch.fx.Graph) -> list[tuple[str, Callable[[], object]]]:
    """(kernel id, job) per distinct Triton kernel and argument layout of the lowered `graph`: the op's own function
    (which launches the kernel) called on meta tensors in the sizes, strides and storage offsets the graph was
    traced with (the first call's); sizes without a value until the call (data-dependent) leave the node out."""
    from torch._library.custom_ops import OPDEFS

    jobs, seen = [], set()
    for node in graph.nodes:
        kernel_id = node.kwargs.get("kernel_id") if dzc_op_name(node) is not None else None
        kernel = runtime._KERNELS.get(kernel_id) if kernel_id else None
        opdef = OPDEFS.get(node.target._schema.name) if kernel is not None else None
        if not isinstance(kernel, GeneratedKernel) or kernel.codegen is not triton_codegen or opdef is None:
            continue
        layout = (kernel_id, repr(torch.fx.node.map_aggregate((node.args, node.kwargs), _layout)))
        if layout in seen:
            continue
        seen.add(layout)
        try:
            # Plain meta tensors, also where the compile runs under a fake mode (Dynamo's backend call does): a fake
            # tensor has no address for Triton's specializer to read.
            with _disable_current_modes():
                args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _meta_argument)
        except (LookupError, RuntimeError):  # a size known at the call only; a value meta tensors cannot stand for
            continue
        function = opdef._init_fn  # the op's Python body: it calls runtime.launch
        jobs.append((kernel_id, lambda function=function, args=args, kwargs=kwargs: function(*args, **kwargs)))
    return jobs


def _hint(value) -> int | float | bool:
    """A size's value in the call the graph was traced for."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint
        if hint is None:
            raise LookupError(f"no hint for {value}")
        return hint
    return value


def _meta_argument(value):
    """A node argument as a precompile job passes it: tensors as meta tensors of their sizes, strides and storage
    offset (so the same alignment), sizes as their values."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            sizes = [_hint(n) for n in value.shape]
            strides = [_hint(n) for n in value.stride()]
            offset = _hint(value.storage_offset())
            extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides)) if all(sizes) else 0
            base = torch.empty(offset + extent, dtype=value.dtype, device="meta")
            return base.as_strided(sizes, strides, offset)
        return torch.fx.node.map_aggregate(value, _hint)
    return value


def _layout(value):
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                    str(value.storage_offset()))
        return str(value)
    return value


def _kernel_source(op: str, spec, codegen_name: str, profile, timer: CompileTimer) -> tuple[str, str, str]:
    """(source, its digest with the profile's, kernel name) of `op`'s `codegen_name` kernel for `spec`."""
    with timer.stage("codegen"):
        source = getattr(KERNEL_FAMILIES[op], f"{codegen_name}_source")(spec, profile)
    digest = hashlib.sha256(f"{profile.fingerprint}\n{source}".encode()).hexdigest()
    return source, digest, f"{op}.{codegen_name}.{digest[:10]}"


def alternative_kernel(op: str, spec, codegen_name: str, target: Target, execution: Execution, table: KernelTable,
                       where: str, kernel_dir: Path, database, timer: CompileTimer,
                       alternatives: tuple[GeneratedKernel, ...] = ()) -> GeneratedKernel:
    """The op's kernel from `codegen_name`, offered to another kernel's tuner as the candidate "dzc.<codegen>" (it
    runs only if it wins): tuned over its own configs first where its codegen builds them fast
    (TUNED_AS_ALTERNATIVE), else its untuned default. It may have `alternatives` of its own (tests chain them)."""
    family = KERNEL_FAMILIES[op]
    source, digest, name = _kernel_source(op, spec, codegen_name, target.profile, timer)
    with timer.stage("codegen"):
        path, cache_note = write_kernel_source(kernel_dir, f"{name.replace('.', '_')}.py", source)
    legal, illegal = legal_configs(family, codegen_name, spec, target.profile)
    record = KernelRecord(table.kernel_id(name, where), op, codegen_name, target.profile.name,
                          spec.describe(), str(path), execution.describe(), len(legal) + illegal, illegal, uses=0,
                          notes=[cache_note] if cache_note else [])
    codegen = target.codegens[codegen_name]
    with timer.stage("kernel load"):
        return GeneratedKernel(family=family, spec=spec, codegen=codegen, profile=target.profile,
                               runtime=execution.runtime, compiled=codegen.load(family, path, spec, target.profile),
                               source_path=path, source_hash=digest, record=record,
                               autotune=codegen.TUNED_AS_ALTERNATIVE, database=database, alternatives=alternatives)

