"""Capture: dzc as a torch.compile backend. Dynamo hands over each graph, AOTAutograd turns it into an ATen-level
inference graph with symbolic token sizes, and dzc runs its pipeline, lowers, and hands the rest to the fallback.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters as dynamo_counters
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dzc import (compile_cache, config, distributed, inductor_entry, ir, pinned_selections, regions, runtime,
                 torch_fixes)
from dzc.coverage import GraphCoverage, graph_coverage
from dzc.lowering import Execution, KernelTable, dzc_op_name, kernel_uses, lower_graph, precompile_triton_kernels
from dzc.ops import LOWERED_AS_PARTS
from dzc.options import CompileOptions
from dzc.outline_regions import outline_repeated_calls, values_read
from dzc.passes.graph_pass import PassResult, copy_graph, written_inputs
from dzc.pipeline import Stage, build_pipeline, pass_results, run_pipeline
from dzc.report import CompileReport, CompileTimer, GraphRecord
from dzc.targets import INTERPRETER, Target, triton_codegen
from dzc.targets.launch import KernelRecord

# Capture applies Inductor's decomposition table, whichever fallback runs the graph: Inductor requires it, and the
# passes then see one graph form on every device (torch.rms_norm, for one, traces to aten._fused_rms_norm on
# CUDA and to pow/mean/rsqrt on CPU; decomposed, both are pow/mean/rsqrt).
_DECOMPOSITIONS = select_decomp_table()


def _input_device(example_inputs) -> torch.device | None:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _execution_for(target: Target, device: torch.device | None) -> Execution:
    """Where this graph's kernels can run, decided from its inputs' device."""
    if device is None or device.type == target.profile.torch_device_type:
        try:
            target.runtime.check_available()
        except RuntimeError as missing:
            return Execution(None, str(missing))
        return Execution(target.runtime)
    if device.type == "cpu":
        if target.interpret_on_cpu:
            if not triton_codegen.interpreting():
                return Execution(None, "CPU tensors run Triton kernels through Triton's interpreter, which must "
                                       "be on before Triton is imported: set TRITON_INTERPRET=1 (dzc does so "
                                       "itself when imported first on a machine without a GPU)")
            return Execution(INTERPRETER)
        try:
            target.runtime.check_available()
        except RuntimeError as missing:
            return Execution(None, str(missing))
        return Execution(None, f"the inputs are CPU tensors; target {target.name} runs on "
                               f"{target.profile.torch_device_type} tensors")
    raise ValueError(f"dzc target {target.name} cannot run on {device.type} tensors: it runs on "
                     f"{target.profile.torch_device_type} tensors"
                     + (" (or CPU tensors, through Triton's interpreter)" if target.interpret_on_cpu else ""))


def _unfused_ops(graph: torch.fx.Graph) -> dict[str, int]:
    counts = collections.Counter(
        str(node.target) for node in graph.nodes
        if node.op == "call_function" and dzc_op_name(node) is None
        and isinstance(node.target, torch._ops.OpOverload))
    return dict(counts)


# Ops that only reinterpret or unpack values: a graph of dzc ops and these has nothing for Inductor to do.
_METADATA_OPS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten.sym_size.int}


def _unfused_compute(graph: torch.fx.Graph) -> bool:
    return any(node.op == "call_function" and dzc_op_name(node) is None and node.target is not operator.getitem
               and node.target not in _METADATA_OPS and isinstance(node.target, torch._ops.OpOverload)
               for node in graph.nodes)


def _dump(stages, compile_id: str) -> None:
    directory = config.DUMP_DIR.get()
    if not directory:
        return
    path = Path(directory) / distributed.rank_tag() / compile_id.replace("/", "_")
    path.mkdir(parents=True, exist_ok=True)
    for index, stage in enumerate(stages):
        (path / f"{index:03d}_{stage.name}.txt").write_text(stage.text)


def _direct_launches(graph: torch.fx.Graph) -> None:
    """Eager fallback: call the kernels' launchers straight from the graph, skipping the dispatcher hop that the
    op would make to find the same launcher (the graph text still shows the dzc op)."""
    for node in graph.nodes:
        kernel_id = node.kwargs.get("kernel_id") if dzc_op_name(node) else None
        if kernel_id:
            node.target = runtime.direct_launcher(kernel_id)
            node.kwargs = {}


def _dynamo_seconds() -> float:
    """Seconds Dynamo has spent so far on the frame it is compiling (it calls the backend when its trace ends),
    from the metrics context it enters when it starts a frame; 0 where torch has no such context."""
    context = torch._dynamo.utils.get_metrics_context()
    start = getattr(context, "_start_time_ns", 0)
    if not start or not context.in_progress():
        return 0.0
    return max(0.0, (time.time_ns() - start) / 1e9)


# Dynamo's graph-break type when a frame's cache is full: the frame runs eagerly from then on.
_RECOMPILE_LIMIT_BREAK = "Dynamo recompile limit exceeded"

_BACKEND_SERIAL = itertools.count(1)


def _graph_break(gm) -> str | None:
    """Why Dynamo ended the graph `gm` at a graph break (None when it ended at the frame's return): Dynamo's
    GraphCompileReason on the graph module, what torch._dynamo.explain counts. Dynamo's process-wide counters
    no longer record graph breaks (torch 2.13 counts them nowhere), and would mix in other models' breaks."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return None
    text = str(reason.reason).strip().splitlines()[0] if str(reason.reason).strip() else "graph break"
    if reason.user_stack:
        frame = reason.user_stack[-1]
        text += f" (at {Path(frame.filename).name}:{frame.lineno}, in {frame.name})"
    return text


@dataclass
class _Build:
    """One run of the pipeline and lowering over a captured graph, with a given set of passes disabled."""

    graph: torch.fx.Graph  # lowered
    stages: list  # pipeline Stages, "lowered" last
    results: list[PassResult]  # of the passes that ran, in order
    uses: collections.Counter  # kernel id -> dzc op nodes running it
    references: list[KernelRecord]  # op instances left to their reference (no kernel takes them)
    fallback: str
    run: Callable  # what the compiled graph runs per call
    checkable: torch.fx.GraphModule | None  # the lowered graph run op by op (no Inductor), for the rewrite check
    coverage: GraphCoverage  # of the lowered graph, costed before the fallback compiles it (dzc/coverage.py)
    host_syncs: list[str]  # _host_syncs of the graph the fallback runs
    compile_cache: str = ""  # the warm-compile cache: "hit", "miss", "off", or what went wrong
    cache_key: str | None = None  # of the compile cache entry holding this build's rewritten graph, if any
    inductor_outlined: str = ""  # outline_repeated_calls' outcome where Inductor compiled the fallback
    inductor_by_key: bool = False  # a hit loaded Inductor's compile by the key its entry kept (inductor_entry)
    inductor_key_unused: str = ""  # why a hit did not load Inductor's compile by the key its entry kept, if it had one
    triton_precompile: triton_codegen.Precompile | None = None  # its Triton kernels compiling ahead, if any

    def fired(self) -> list[str]:
        return [result.name for result in self.results if result.rewrites]

    def rewrites(self, name: str) -> list[str]:
        return next(result.rewrites for result in self.results if result.name == name)


class DzcBackend:
    """A torch.compile backend bound to a target and options; `report` accumulates over every compile."""

    def __init__(self, target: Target, options: CompileOptions):
        self.target = target
        self.options = options
        self.check_rewrites = options.resolved_check_rewrites()
        self.report = CompileReport(target.name, repr(options))
        # The layers dzc.compile marked as nested compile regions (dzc/regions.py); none for a plain backend.
        self.marking = regions.Marking()
        # This model's kernels: they carry its tuning options, database and report (one table per backend).
        self.kernels = KernelTable(f"m{next(_BACKEND_SERIAL)}")
        # The exception dzc's own stages (passes, lowering, fallback compile) raised last: dzc.compile re-raises
        # it as itself, not wrapped in Dynamo's BackendCompilerFailed, and never retries the capture for it.
        self.failure: BaseException | None = None
        self._graph_break: str | None = None
        self._unsupported_seen = collections.Counter(dynamo_counters["unimplemented"])
        self._unsupported_total = self._unsupported_seen.total()
        self._frames_compiled: set = set()
        self._timer = CompileTimer()  # the graph being compiled: its stages' seconds
        self._aot_start = time.perf_counter()
        self._call_start = time.perf_counter()  # of the call start_call was last called for
        self._graphs_before = 0
        # keep_inference_input_mutations: an input the model writes in place (a KV cache) is copied back by a
        # `copy_` at the end of the graph, not by AOTAutograd's runtime wrapper after it, so that the pass
        # reinplace_cache_writes can see the write and make it in place again (and the wrapper still bumps the
        # input's version counter, which CudaGraphRunner reads).
        self._aot = aot_autograd(fw_compiler=self._refuse_training, inference_compiler=self._compile_graph,
                                 decompositions=_DECOMPOSITIONS, keep_inference_input_mutations=True)
        # Dynamo's graph names (gm._backend_id, set where dzc keeps a frame entry: dzc/frame_cache.py) -> the
        # capture-entry lookup of the graph, whose key the frame entry records.
        self._frame_graphs: dict[str, _CaptureCache] = {}
        # The report as it was before the current call's first compile (CompileReport.checkpoint), or None.
        self.checkpoint: tuple | None = None

    def enabled_passes(self) -> list:
        return _enabled_passes(self.target, self.options)

    def capture_entry_of(self, backend_id: str) -> tuple[str | None, str]:
        """(the key of the capture entry of Dynamo's graph `backend_id`, "") once it is stored, else (None, why)."""
        capture = self._frame_graphs.get(backend_id)
        if capture is None:
            return None, "not compiled by this backend"
        if capture.key is None or capture.why:
            return None, capture.why or "no key"
        if not capture.cache.capture_path(capture.key).exists():
            return None, capture.stored or "not stored"
        return capture.key, ""

    def compile_capture_entry(self, key: str, compile_id: str):
        """The runnable graph of capture entry `key`, built without Dynamo and AOTAutograd (a frame entry's graph:
        dzc/frame_cache.py; its record and dumps named `compile_id`), or why it cannot be."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

        cache = compile_cache.CompileCache(self.options.resolved_cache_dir())
        self._timer = CompileTimer()
        with self._timer.stage("compile cache"):
            entry, why = cache.load_capture(key)
            if entry is None:
                return f"capture entry {key}: {why or 'not found'}"
            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            cached, why = cache.load(entry.entry, fake_mode, warn=False)
            if cached is None:
                return f"graph entry {entry.entry}: {why or 'not found'}"
        self._graph_break = None
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            try:
                hit = _CaptureHit(entry, cached)
                compiled = self._compile_captured(*hit.root_and_inputs(), hit=hit, compile_id=compile_id)
            except Exception as error:  # noqa: BLE001  (the frame entry is not used; Dynamo compiles as usual)
                return f"building it failed ({type(error).__name__}: {str(error)[:160]})"
        self.report.graphs[-1].compile_cache = "hit (frame entry: Dynamo and AOTAutograd skipped)"
        return compiled

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.checkpoint is None:  # the call's first compile
            self.checkpoint = self.report.checkpoint()
        if self.marking:
            misplaced = regions.misplaced_parameters(gm, example_inputs, self.marking)
            if misplaced:  # dzc.compile restores the layers' classes and captures again
                raise regions.RegionRefusal(misplaced)
            fake_mode = torch._guards.detect_fake_mode(example_inputs)
            relating = regions.relating_guards(fake_mode.shape_env if fake_mode is not None else None)
            if relating:  # dzc.compile marks fewer layers, or none, and captures again
                why = (f"region calls compare inputs of other dynamic sizes, which guards their relation "
                       f"({', '.join(str(guard.expr) for guard in relating)}): a plain capture would not recompile "
                       "where it flips")
                narrowed = regions.narrowing(gm, example_inputs, self.marking, relating)
                if narrowed:
                    raise regions.RegionNarrowing(why, narrowed)
                raise regions.RegionRefusal(why)
        self._graph_break = _graph_break(gm)  # read by _compile_graph, which AOTAutograd calls from here
        self._timer = CompileTimer()
        self._timer.add("dynamo", _dynamo_seconds())
        self._capture = _CaptureCache(self.target, self.options, gm, example_inputs, self._timer)
        backend_id = getattr(gm, "_backend_id", None)  # Dynamo's name for the graph, where a frame entry is kept
        if backend_id is not None:
            self._frame_graphs[backend_id] = self._capture
        if self._capture.hit is not None:  # the whole compile is cached: AOTAutograd's trace is skipped too
            try:
                return self._compile_captured(*self._capture.hit.root_and_inputs(), hit=self._capture.hit)
            except Exception as error:
                self.failure = error
                raise
        self._aot_start = time.perf_counter()
        try:
            return self._aot(gm, example_inputs)
        except regions.WritingRegions as found:  # nothing compiled yet: inline those calls, trace again
            regions.inline_calls(gm, found.identifiers)
            self.report.region_retries.append(f"{found}: inlined in Dynamo's graph, AOTAutograd traced again")
            self._aot_start = time.perf_counter()
            return self._aot(gm, example_inputs)

    @staticmethod
    def _refuse_training(gm, example_inputs):
        raise RuntimeError("dzc compiles inference graphs: call the model under torch.no_grad() or "
                           "torch.inference_mode() (dzc.compile's wrapper does this for you)")

    def start_call(self) -> int:
        """Call before running the model, and pass the result to eager_runs_since after: how many frames Dynamo
        has tried to compile in this process. Brings the baseline of Dynamo's unsupported-feature counts up to
        date (other models may have met some since), so that eager_runs_since sees only the call's."""
        unsupported = dynamo_counters["unimplemented"]
        if unsupported.total() != self._unsupported_total:
            self._unsupported_seen = collections.Counter(unsupported)
            self._unsupported_total = self._unsupported_seen.total()
        self._call_start = time.perf_counter()
        self._graphs_before = len(self.report.graphs)
        self.checkpoint = None
        return dynamo_counters["frames"]["total"]

    @staticmethod
    def frames_tried_since(frames_tried: int) -> bool:
        """Whether Dynamo tried to compile a frame since start_call returned `frames_tried`."""
        return dynamo_counters["frames"]["total"] != frames_tried

    def eager_runs_since(self, frames_tried: int) -> list[str]:
        """Record in the report, and return, each frame Dynamo gave up compiling during the call because it
        reached a recompile limit: it then runs that frame eagerly, without dzc, on every later call that misses
        its cached graphs, and only logs a warning."""
        if dynamo_counters["frames"]["total"] == frames_tried:
            return []  # Dynamo tried no frame: the call ran graphs compiled before
        new_graphs = self.report.graphs[self._graphs_before:]
        if new_graphs:  # the call's own time, less the compile stages of its graphs: their first run
            compiling = sum(sum(g.compile_seconds.values()) for g in new_graphs)
            self.report.first_run_seconds.append(max(0.0, time.perf_counter() - self._call_start - compiling))
        unsupported = dynamo_counters["unimplemented"]
        new = [reason for reason, n in unsupported.items()
               if reason.startswith(_RECOMPILE_LIMIT_BREAK) and n > self._unsupported_seen[reason]]
        self._unsupported_seen = collections.Counter(unsupported)
        self._unsupported_total = self._unsupported_seen.total()
        runs = []
        for reason in new:
            limit = re.search(r"Limit type: (\w+)", reason)
            name = limit.group(1) if limit else "recompile_limit"
            runs.append(f"Dynamo reached torch._dynamo.config.{name} ({getattr(torch._dynamo.config, name, '?')}) "
                        "for the model's code and runs it eagerly, without dzc, where no compiled graph fits")
        self.report.eager_runs.extend(runs)
        return runs

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs):
        self._timer.add("aot_autograd", time.perf_counter() - self._aot_start)
        self._capture.convention = _direct_convention(gm, example_inputs, self._capture.inputs)
        functionalized = regions.functionalized_calls(gm.graph) if self.marking else set()
        if functionalized:
            raise regions.WritingRegions(functionalized)
        try:
            return self._compile_captured(gm, example_inputs)
        except regions.RegionRefusal:  # (inlining the bodies found them unsound) dzc.compile captures again
            raise
        except Exception as error:
            self.failure = error
            raise

    def _compile_captured(self, gm: torch.fx.GraphModule | torch.nn.Module, example_inputs,
                          hit: _CaptureHit | None = None, compile_id: str | None = None):
        """Compile AOTAutograd's graph `gm` (or, on a capture-level cache hit, the cached graph of `hit`, whose
        rewrite check ran when its entry was built; `gm` is then the module holding its constants). compile_id: the
        record's, where Dynamo did not compile it."""
        # as captured, region bodies inlined, for the rewrite check (lowering binds kernels in place)
        captured = regions.inlined(gm) if hit is None else None
        written = hit.entry.written if hit else written_inputs(captured)  # before passes touch the graph
        dynamo_id = torch._guards.CompileContext.current_compile_id()
        compile_id = compile_id or (str(dynamo_id) if dynamo_id is not None else "0/0")
        # A recompile is a second graph for a frame this backend already compiled (Dynamo's own compile counter
        # is per code object and process, so it also counts other models sharing the same forward).
        frame = dynamo_id.frame_id if dynamo_id is not None else None
        recompile = frame in self._frames_compiled
        self._frames_compiled.add(frame)
        device = _input_device(example_inputs)
        execution = _execution_for(self.target, device)
        skip_check = ("done when the compile cache entry was built" if hit is not None
                      else "" if self.check_rewrites else "off (CompileOptions.check_rewrites)")
        if not skip_check and execution.runtime is None:
            skip_check = f"the kernels cannot run here ({execution.not_runnable_reason})"
        if not skip_check:
            skip_check = _nondeterminism(captured)
        any_rank = None
        if not skip_check:  # collectives: every rank of the graph's group must run the check's same steps
            any_rank, skip_check = distributed.rank_agreement(captured, device)
        timer = self._timer
        build = self._build(gm, example_inputs, execution, device, self.options.disable_passes,
                            checkable=not skip_check, timer=timer,
                            found=(hit.entry.entry, hit.cached) if hit else None)
        for result in build.results:
            self.report.record_pass(result.name, result.rewrites, result.refusals)
        self._commit(build)
        dynamic = sorted({str(v) for v in example_inputs if isinstance(v, torch.SymInt)})
        record = GraphRecord(compile_id, recompile, 0, dynamic,
                             [self._graph_break] if self._graph_break else [], "", execution.describe(),
                             execution.not_runnable_reason, {})
        _describe(record, build)
        record.compile_seconds = timer.seconds
        if build.fired():
            record.rewrite_check = f"skipped: {skip_check}" if skip_check else ""
        if hit is not None:
            record.rewrite_check = hit.entry.check + (" (when the compile cache entry was built)"
                                                      if hit.entry.check else "")
        self.report.graphs.append(record)
        _dump(build.stages, compile_id)
        if config.debug_level() >= 1:
            print(self.report)
        if config.debug_level() >= 2:
            for stage in build.stages:
                print(stage.text)
        if hit is not None:
            # The CUDA-graph runner learns from `written` which arguments a call writes.
            return runtime.recording_writes(_bumping_versions(build.run, hit.entry.bumped), written)
        pending, no_entry = self._capture.prepare(gm, build, example_inputs, written)
        if build.compile_cache == "hit" and no_entry:
            record.compile_cache = f"hit after AOTAutograd (no capture entry: {no_entry})"
        if skip_check or not build.fired():
            pending(record.rewrite_check)
            return runtime.recording_writes(build.run, written)
        check = _RewriteCheck(self, gm, example_inputs, captured, build, record, execution, device, any_rank,
                              pending)
        return runtime.recording_writes(check.call, written)

    def _build(self, gm, example_inputs, execution: Execution, device, disabled, checkable: bool,
               inductor_context=None, timer: CompileTimer | None = None,
               found: tuple[str, compile_cache.Entry] | None = None) -> _Build:
        timer = timer or CompileTimer()
        options = dataclasses.replace(self.options, disable_passes=tuple(disabled))
        cached = _CachedPasses(self.target, options, gm, example_inputs, timer, found)
        graph, stages = cached.passes()
        entry = cached.entry  # a hit: values its graph's analyses read are not rebuilt where the entry holds those
        specs = entry.specs if entry is not None and entry.specs is not None else {}
        if entry is not None:
            with timer.stage("compile cache"):
                entry.values(_lowering_reads(graph, specs))
        created = lower_graph(graph, self.target, self.options, execution, device, self.kernels, timer=timer,
                              specs=specs)
        # Started before Inductor's compile of the rest, which it then overlaps.
        precompile = precompile_triton_kernels(graph, execution, device)
        uses = kernel_uses(graph)
        results = pass_results(stages)
        references = [record for record in created if record.codegen == "reference"]
        with timer.stage("ir text"):
            stages.append(Stage("lowered", ir.print_graph(graph, f"lowered for {self.target.name}",
                                                          entry.types if entry is not None else None), None))
        with timer.stage("coverage"):
            outcome = compile_cache.lowering_outcome(graph) if cached.state != "off" else None
            stored = entry.analyses if entry is not None and entry.analyses is not None \
                and entry.analyses.outcome == outcome else None
            if stored is None and entry is not None:
                entry.values()
            coverage = stored.coverage if stored is not None else graph_coverage(
                graph, [(r.name, where, why) for r in results for where, why in r.refusals])
        fallback = self.options.fallback
        if fallback == "auto":
            fallback = "inductor" if device is not None and device.type != "cpu" else "eager"
            device_runtime = execution.runtime
            if fallback == "inductor" and device_runtime is not None and not device_runtime.inductor_available():
                # MUSA without torch_musa's Inductor backend registered: torch_musa's ATen ops run the rest.
                fallback = f"eager (no inductor backend for {device.type})"
        if fallback == "inductor" and not _unfused_compute(graph):
            # Nothing left for Inductor to fuse: running the graph directly skips the dispatcher hop that an
            # Inductor-compiled graph makes into each dzc op (tens of microseconds a call).
            fallback = "eager (nothing left for inductor)"
        with timer.stage("fallback compile"):
            cached.before_fallback()
            values = None  # a hit's rebuild of its remaining values, for Inductor where it compiles
            if entry is not None and checkable:
                entry.values()  # the rewrite check reads every value
            elif entry is not None and not fallback.startswith("eager"):
                # Inductor reads every value only where its FX graph cache misses (the cold compile's artifacts,
                # loaded by before_fallback, hit): its inputs' and outputs' (their devices) now, the rest then.
                entry.values(_inputs_and_outputs(graph))
                values = entry.values
            if found is not None and (checkable or values is not None):  # the capture hit's inputs, left unbuilt
                example_inputs = [node.meta["val"] for node in graph.nodes if node.op == "placeholder"]
            compiled, checked, outlined, inductor, key_unused = self._fallback(
                gm, graph, example_inputs, fallback, checkable, inductor_context, values,
                entry.inductor if entry is not None and not checkable else None, tuple(uses))
        host_syncs = stored.host_syncs if stored is not None else _host_syncs(graph)
        if cached.state != "off":
            with timer.stage("compile cache"):
                cached.store(fallback == "inductor", specs, compile_cache.Analyses(outcome, coverage, host_syncs),
                             inductor)
        return _Build(graph, stages, results, uses, references, fallback, compiled, checked, coverage, host_syncs,
                      cached.state, cached.key if cached.state in ("hit", "miss") else None, outlined,
                      inductor is not None and entry is not None and inductor is entry.inductor, key_unused,
                      precompile)

    def _fallback(self, gm, graph, example_inputs, fallback: str, checkable: bool, inductor_context,
                  values: Callable[[], None] | None = None, stored: inductor_entry.InductorRecord | None = None,
                  kernel_ids: tuple[str, ...] = ()):
        """(what the lowered graph runs per call, the op-by-op module the rewrite check runs or None, what
        outline_repeated_calls did for Inductor or "", the inductor_entry.InductorRecord a compile cache entry
        keeps of Inductor's compile or None, why `stored` was not loaded or ""). values: puts back the nodes' fake
        values a cache hit left unbuilt, before Inductor compiles or outline_repeated_calls reads them. stored: a
        hit's record of the cold compile's Inductor result, loaded by its key where it still can be (no outlining,
        no hash of the graph). kernel_ids: the dzc kernel ids `graph` calls (inductor_entry.InductorRecord's)."""
        checked = torch.fx.GraphModule(gm, copy_graph(graph)) if checkable else None
        record, key_unused = None, ""
        if fallback == "inductor":
            torch_fixes.apply()  # the installed torch's bugs that code handed to Inductor would meet

            # MUSA Triton builds fail when Inductor compiles in several processes (torch_musa sets one thread).
            serial = {} if self.target.profile.compile_in_parallel else {"compile_threads": 1}
            tracing = (torch._guards.tracing(inductor_context) if inductor_context is not None
                       else contextlib.nullcontext())
            with torch._inductor.config.patch(serial), tracing:
                boxed = None
                if stored is not None:
                    boxed, key_unused = inductor_entry.load(stored, example_inputs, kernel_ids)
                if boxed is not None:
                    outlined, record = stored.outlined, stored
                else:
                    boxed, outlined, record = _inductor_compile(gm, graph, example_inputs, values, kernel_ids)

            def compiled(*args):
                return boxed(list(args))  # Inductor's callable takes its arguments as one list
        else:
            outlined = ""
            _direct_launches(graph)  # before the module's code is generated (once: it grows with the graph)
            # the generated function (no nn.Module call per call), its bytecode kept in the cache directory
            compiled = compile_cache.graph_function(
                gm, graph, self.options.resolved_cache_dir() if compile_cache.enabled() else None)
        return compiled, checked, outlined, record, key_unused

    def _commit(self, build: _Build) -> None:
        """Put the kernels `build` runs into the report (those not there yet)."""
        in_use = [record for record in self.kernels.records.values() if record.kernel_id in build.uses]
        for record in in_use + build.references:
            if not any(record is known for known in self.report.kernels):
                self.report.kernels.append(record)

    def _discard(self, build: _Build) -> None:
        """Give back the kernels of a build that will not run; those no other graph runs leave the report."""
        gone = self.kernels.release(build.uses) + build.references
        self.report.kernels = [k for k in self.report.kernels if not any(k is g for g in gone)]


def _enabled_passes(target: Target, options: CompileOptions) -> list:
    """The pipeline's passes that run under `options` (the cache keys name them)."""
    return [p for p in build_pipeline(target, options) if p.__name__ not in options.disable_passes]


def _direct_convention(gm: torch.fx.GraphModule, example_inputs,
                       dynamo_inputs: int) -> tuple[tuple[int, ...] | None, str]:
    """((inputs whose version counters AOTAutograd's runtime wrapper bumps), "") where that wrapper does nothing
    else around AOTAutograd's inference graph `gm` of a capture with `dynamo_inputs` inputs (called from
    _compile_graph, inside AOTAutograd): no input mutation or output alias for it to replay, no deduplicated or
    synthetic-base inputs, no effect tokens, no autocast to turn off, no tensor subclass, random numbers not
    functionalized; else (None, why not). Such a graph can later run without AOTAutograd (capture entries)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    reasons = {
        "AOTAutograd's metadata is not available": meta is None,
        "the inputs are not plain tensors and sizes": not all(
            type(v) in (torch.Tensor, torch.nn.Parameter, FakeTensor, torch.SymInt, int, float, bool)
            for v in example_inputs),
        "AOTAutograd's wrapper replays input mutations or output aliases": meta is not None and (
            meta.num_mutated_inp_runtime_indices or meta.num_outputs_aliased or meta.num_intermediate_bases),
        "the graph uses effect tokens": meta is not None and bool(meta.tokens),
        "autocast is on": any(torch.is_autocast_enabled(d) for d in torch._C._autocast_supported_devices()),
        "random numbers are functionalized": torch._functorch.config.functionalize_rng_ops,
        "AOTAutograd merged, split or added inputs": len(placeholders) != dynamo_inputs,
    }
    why = next((reason for reason, applies in reasons.items() if applies), "")
    if why:
        return None, why
    return tuple(meta.mutated_graph_handled_indices_seen_by_autograd), ""


def _inputs_and_outputs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The placeholders and the values the graph returns: what Inductor reads before its FX graph cache lookup
    (the example inputs; the devices, torch._inductor.utils.get_all_devices)."""
    output = graph.output_node()
    return [node for node in graph.nodes if node.op == "placeholder"] + output.all_input_nodes


def _inductor_compile(gm, graph: torch.fx.Graph, example_inputs, values: Callable[[], None] | None,
                      kernel_ids: tuple[str, ...]):
    """Inductor's compile of `graph` (outlined where DZC_OUTLINE_FOR_INDUCTOR is on and Inductor takes it, else
    flat): (its callable, what outline_repeated_calls did, inductor_entry's record of it or None). values and
    kernel_ids: as DzcBackend._fallback's."""
    from torch._inductor.compile_fx import compile_fx_inner  # noqa: PLC0415 (heavy: a load by key does without)

    boxed, outlined = None, "off (DZC_OUTLINE_FOR_INDUCTOR=0)"
    copies = []  # copies of `graph` made while some of its values were unbuilt

    def every_value():
        values()
        for copy in copies:
            _copy_values(graph, copy)

    fingerprint = inductor_entry.fingerprint() if inductor_entry.cache_on() else None
    with _before_inductor_compiles(every_value if values is not None else None):
        if config.OUTLINE_FOR_INDUCTOR.get() == "1":
            if values is not None:
                values(values_read(graph))  # outline_repeated_calls compares the calls' values
            try:
                # Each repeated layer's leftover ops lowered by Inductor once, not once a layer.
                lowered = _for_inductor(gm, copy_graph(graph))
                copies.append(lowered.graph)
                outlined = outline_repeated_calls(lowered).describe()
                boxed = compile_fx_inner(lowered, example_inputs)
            except Exception as error:  # a slower compile, not a failed one: the flat graph as before
                outlined = (f"failed ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}); "
                            "Inductor compiled the flat graph instead")
                warnings.warn(f"dzc: outlining the repeated layers for Inductor {outlined}", RuntimeWarning,
                              stacklevel=3)
        if boxed is None:
            boxed = compile_fx_inner(_for_inductor(gm, graph), example_inputs)
    return boxed, outlined, inductor_entry.record(boxed, outlined, fingerprint, kernel_ids)


@contextlib.contextmanager
def _before_inductor_compiles(values: Callable[[], None] | None):
    """Within it, `values` runs before Inductor generates code for a graph (fx_codegen_and_compile: its FX graph
    cache missed, or is off), which reads every node's value; a cache hit never calls it. (Inductor has no hook
    between its cache lookup and its compile: compile_fx_inner calls that module function by name, in torch 2.11
    and 2.13 alike.)"""
    if values is None:
        yield
        return
    from torch._inductor import compile_fx  # noqa: PLC0415 (heavy; only when used)

    compiles = getattr(compile_fx, "fx_codegen_and_compile", None)
    if compiles is None:  # another torch: every value now
        values()
        yield
        return

    def with_values(*args, **kwargs):
        values()
        return compiles(*args, **kwargs)

    compile_fx.fx_codegen_and_compile = with_values
    try:
        yield
    finally:
        compile_fx.fx_codegen_and_compile = compiles


def _copy_values(source: torch.fx.Graph, copy: torch.fx.Graph) -> None:
    """Give the nodes of `copy` (copy_graph of `source`, since rewritten) that lack a fake value the value of
    `source`'s node of the same name: copy_graph copies each node's metadata, so values rebuilt in `source` after
    the copy are not in it."""
    named = {node.name: node for node in source.nodes}
    for node in copy.nodes:
        original = named.get(node.name)
        if "val" not in node.meta and original is not None and "val" in original.meta:
            node.meta["val"] = original.meta["val"]


def _for_inductor(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """`graph` as the module Inductor compiles, which carries dzc's source hash: Inductor's FX-graph cache key
    hashes a module's code and attributes but not its nodes' metadata, which dzc decides too (the symbols of
    data-dependent sizes: session 43 found a wrong artifact of an older dzc served for the same code)."""
    module = torch.fx.GraphModule(root, graph)
    module.dzc_source = compile_cache.dzc_source_hash()
    return module


def _bumping_versions(run: Callable, bumped: tuple[int, ...]) -> Callable:
    """`run`, then the version counters of the inputs at `bumped` go up, as AOTAutograd's wrapper does for the
    inputs its graph writes (autograd and CudaGraphRunner read them)."""
    if not bumped:
        return run

    def bump_after(*args):
        outputs = run(*args)
        torch.autograd.graph.increment_version([args[i] for i in bumped])
        return outputs

    return bump_after


@dataclass
class _CaptureHit:
    """A capture entry found for the graph Dynamo handed over, with the cached rewritten graph it points to."""

    entry: compile_cache.CaptureEntry
    cached: compile_cache.Entry  # the rewritten graph's entry, which entry.entry names

    def root_and_inputs(self) -> tuple[torch.nn.Module, list]:
        """What _compile_captured takes in place of AOTAutograd's graph and inputs: the module holding the cached
        graph's constants (the fallback's root; the graph itself comes from the entry, and no GraphModule is made
        of it here: generating its code, never run, took as long as the fallback's own), and its inputs' fake
        values."""
        root = torch.nn.Module()
        for name, (tensor, device) in self.entry.constants.items():
            setattr(root, name, tensor.to(device))
        placeholders = [node for node in self.cached.graph.nodes if node.op == "placeholder"]
        # Of the inputs' fake values, only the first tensor's is rebuilt here (its device: where the kernels run);
        # the others are None until something reads them (lowering, Inductor's fallback: DzcBackend._build).
        types = self.cached.types or {}
        self.cached.values([node for node in placeholders if types.get(node.name, ("tensor",))[0] == "tensor"][:1])
        return root, [node.meta.get("val") for node in placeholders]


class _CaptureCache:
    """The capture-level warm-compile entry (compile_cache.CaptureEntry) of the graph Dynamo handed over: looked
    up before AOTAutograd runs (`hit`), written once the graph's compile, and its rewrite check, are done."""

    def __init__(self, target: Target, options: CompileOptions, gm, example_inputs, timer: CompileTimer):
        self.hit: _CaptureHit | None = None
        self.key: str | None = None
        self.why = "off"  # why there is no capture entry to write (where there is none)
        self.stored = "not stored yet (the first call's rewrite check stores it)"
        self.convention: tuple[tuple[int, ...] | None, str] = (None, "not compiled through AOTAutograd")
        self.inputs = len(example_inputs)
        if not compile_cache.enabled():
            return
        with timer.stage("compile cache"):
            self.cache = compile_cache.CompileCache(options.resolved_cache_dir())
            try:
                key, parts = compile_cache.capture_key(gm, example_inputs, target, options,
                                                       _enabled_passes(target, options))
            except Exception as err:  # noqa: BLE001  (a graph the key cannot describe only has no capture entry)
                key, parts = None, f"its key could not be made ({type(err).__name__}: {str(err)[:200]})"
            if key is None:
                self.why = parts
                return
            self.key, self.parts, self.why = key, parts, ""
            context = torch._guards.TracingContext.try_get()  # Dynamo's, whose fake mode the graph is loaded in
            entry, _ = self.cache.load_capture(key)
            if (entry is None or context is None or context.fake_mode is None
                    or not compile_cache.guards_hold(entry.guards, example_inputs)):
                return
            fake_mode = context.fake_mode
            # An unreadable graph entry is left to the compile through AOTAutograd, which warns and rebuilds it.
            cached, _ = self.cache.load(entry.entry, fake_mode, warn=False)
            if cached is not None:
                self.hit = _CaptureHit(entry, cached)

    def prepare(self, gm: torch.fx.GraphModule, build: _Build, example_inputs,
                written: set[int]) -> tuple[Callable[[str], None], str]:
        """(what writes this graph's capture entry once the rewrite check's outcome is known: a function of that
        outcome, "") or, where the graph cannot have one, (a function that writes nothing, why)."""
        bumped, why = self.convention
        names = [node.target for node in build.graph.nodes if node.op == "get_attr"]
        if any("." in name for name in names):  # a submodule's attribute: the hit's root module holds flat names
            return (lambda outcome: None), "it reads attributes of submodules"
        constants = {name: getattr(gm, name) for name in names}
        size = sum(t.numel() * t.element_size() for t in constants.values() if isinstance(t, torch.Tensor))
        why = (self.why or (why and f"AOTAutograd's wrapper is needed: {why}")
               or ("" if build.cache_key else "the rewritten graph is not in the cache")
               or ("the graph runs collectives" if distributed.collective_groups(build.graph) else "")
               or ("its constants are not all tensors" if not all(isinstance(t, torch.Tensor)
                                                                   for t in constants.values()) else "")
               or (f"its constants take {size / 2**20:.1f} MiB" if size > compile_cache.MAX_CAPTURE_CONSTANT_BYTES
                   else ""))
        if why:
            self.why = why
            return (lambda outcome: None), why
        guards = compile_cache.guards_expression(example_inputs)
        with unset_fake_temporarily():
            constants = {name: (t.detach().cpu(), str(t.device)) for name, t in constants.items()}

        def store(outcome: str) -> None:
            entry = compile_cache.CaptureEntry(build.cache_key, constants, frozenset(written), bumped, guards,
                                               outcome)
            self.stored = self.cache.store_capture(self.key, self.parts, entry) or "stored"

        return store, ""


class _CachedPasses:
    """The passes of one build, through the warm-compile cache (dzc/compile_cache.py): on a hit, the rewritten
    graph and its stages come from the cache directory; on a miss the passes run, and their result is stored
    once the fallback has compiled (with torch's cache artifacts, where Inductor made some)."""

    def __init__(self, target: Target, options: CompileOptions, gm, example_inputs, timer: CompileTimer,
                 found: tuple[str, compile_cache.Entry] | None = None):
        """found: (key, entry) a capture entry led to (_CaptureCache): a hit without looking."""
        self.target, self.options, self.gm, self.timer = target, options, gm, timer
        self.example_inputs = example_inputs
        self.state = "off"
        self.key: str | None = None
        self.entry: compile_cache.Entry | None = None
        self._pending: tuple | None = None  # (key, parts, pickled graph, stages, types) to store after the fallback
        self.captured_text: str | None = None  # the capture stage's dump, printed for the key
        if found is not None:
            (self.key, self.entry), self.state = found, "hit"
            return
        if not compile_cache.enabled():
            return
        with timer.stage("compile cache"):
            self.cache = compile_cache.CompileCache(options.resolved_cache_dir())
            self.captured_text = regions.captured_text(gm, "captured by Dynamo + AOTAutograd")
            self.key, self.parts = compile_cache.entry_key(self.captured_text, gm, example_inputs, target, options,
                                                           _enabled_passes(target, options))
            fake_mode = torch._guards.detect_fake_mode(example_inputs)
            self.entry, why = (self.cache.load(self.key, fake_mode) if fake_mode is not None
                               else (None, "off (no fake inputs)"))
            self.state = "hit" if self.entry is not None else (why or "miss")
            if self.entry is not None:  # after AOTAutograd (the rewrite check may run): every value, as before
                self.entry.values()

    def passes(self) -> tuple[torch.fx.Graph, list[Stage]]:
        if self.entry is not None:
            graph = self.entry.graph
            stages = [Stage(name, text, None if rewrites is None else PassResult(name.rpartition(".")[2], graph,
                                                                                 rewrites, refusals), region)
                      for name, text, rewrites, refusals, region in self.entry.stages]
            return graph, stages
        graph, stages = run_pipeline(self.gm.graph, self.target, self.options, timer=self.timer,
                                     captured_text=self.captured_text, root=self.gm)
        if self.state != "off":
            with self.timer.stage("compile cache"):
                pickled = compile_cache.pickle_graph(graph, self.gm)  # before lowering binds kernels into it
                saved = [(s.name, s.text, None if s.result is None else s.result.rewrites,
                          None if s.result is None else s.result.refusals, s.region) for s in stages]
                if isinstance(pickled, str):
                    self.state = pickled
                else:
                    self._pending = (self.key, self.parts, pickled, saved, ir.value_types(graph))
        return graph, stages

    def before_fallback(self) -> None:
        """On a hit, give torch's caches what Inductor compiled for this graph before (its FX graph cache hits)."""
        if self.entry is not None:
            compile_cache.load_torch_artifacts(self.entry.torch_artifacts)

    def store(self, inductor: bool, specs: dict, analyses: compile_cache.Analyses,
              record: inductor_entry.InductorRecord | None = None) -> None:
        if self._pending is None:
            return
        artifacts = compile_cache.save_torch_artifacts() if inductor else None
        problem = self.cache.store(*self._pending, artifacts, specs, analyses, record if artifacts else None)
        if problem:
            self.state = f"miss ({problem})"
        elif not self.state.startswith("corrupted"):
            self.state = "miss"


def _describe(record: GraphRecord, build: _Build) -> None:
    """Fill in what the graph record says about the build that runs."""
    record.nodes = len(build.graph.nodes)
    record.fallback = build.fallback
    record.inductor_outlined = build.inductor_outlined
    record.inductor_by_key = build.inductor_by_key
    record.inductor_key_unused = build.inductor_key_unused
    record.triton_precompile = "running" if build.triton_precompile is not None else ""
    if build.triton_precompile is not None:
        build.triton_precompile.when_done(lambda outcome: setattr(record, "triton_precompile", outcome))
    record.unfused_ops = _unfused_ops(build.graph)
    record.host_syncs = build.host_syncs
    record.stages = [(s.name, s.text) for s in build.stages]
    record.coverage = dataclasses.replace(build.coverage, compile_id=record.compile_id)
    record.compile_cache = build.compile_cache
    record.regions = _regions(build.stages)


def _regions(stages: list[Stage]) -> list[str]:
    """One line per region body the passes rewrote: its calls, and the sites each pass rewrote in it."""
    bodies: dict[str, tuple[int, list[str]]] = {}
    for stage in stages:
        if stage.region is None:
            continue
        attribute, calls = stage.region
        fired = bodies.setdefault(attribute, (calls, []))[1]
        if stage.result is not None and stage.result.rewrites:
            sites = len(stage.result.rewrites)
            fired.append(f"{stage.result.name} {sites} site{'s' if sites > 1 else ''}")
    return [f"body {attribute} called {calls} time{'s' if calls > 1 else ''}: {', '.join(fired) or 'nothing fused'}"
            for attribute, (calls, fired) in bodies.items()]


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """An op that draws random numbers in this call: ATen tags them; attention's dropout only with dropout_p > 0."""
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    names = [argument.name for argument in node.target._schema.arguments]
    if "dropout_p" in names:
        position = names.index("dropout_p")
        p = node.args[position] if position < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        return p != 0
    return True


# Ops that choose among values (which of them, or in which order): a value rounded an ulp differently can change
# the choice at a near-tie, and everything computed from the choice with it.
_SELECTING_OPS = {torch.ops.aten.topk.default, torch.ops.aten.sort.default, torch.ops.aten.sort.stable,
                  torch.ops.aten.argsort.default, torch.ops.aten.argsort.stable, torch.ops.aten.argmax.default,
                  torch.ops.aten.argmin.default, torch.ops.aten.max.dim, torch.ops.aten.min.dim,
                  torch.ops.aten.kthvalue.default}
_LOW_PRECISION = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}


def _nondeterminism(graph: torch.fx.Graph) -> str:
    """Why two runs of `graph` on the same inputs may differ by more than rounding although both are right, or
    "": the check cannot compare such runs. Random numbers differ by design. A selection (argmax, sort) in a graph
    that computes in bf16 or fp16 flips at near-ties when a fused kernel rounds differently (measured: a quarter of
    the logits on a bf16 model with both), so its outputs are not comparable; in fp32 near-ties are too rare to
    matter. Top-k is the exception: the check pins its near-ties (dzc/pinned_selections.py)."""
    random_ops = sorted({str(node.target) for node in graph.nodes if _draws_random_numbers(node)})
    if random_ops:
        return f"the graph draws random numbers ({', '.join(random_ops)})"
    selections = sorted({str(node.target) for node in graph.nodes
                         if node.target in _SELECTING_OPS and node.target is not pinned_selections.TOPK})
    low = sorted({str(value.dtype).removeprefix("torch.") for node in graph.nodes
                  for value in pytree.tree_leaves(node.meta.get("val"))
                  if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION})
    if selections and low:
        return (f"the graph selects among values ({', '.join(selections)}) and computes in {', '.join(low)}: a "
                "near-tie that rounds the other way changes the selection, so its runs are not comparable")
    return ""


# The captured graph's top-k picks the check keeps to pin the rewritten graph's near-ties: a long prefill's key
# selections over every layer can be gigabytes, and then the graph is not checked.
_PICKS_BUDGET = 1 << 30

# Ops whose integer results may legitimately differ between implementations: which of tied values comes first.
_TIE_BREAKING_OPS = {torch.ops.aten.topk.default, torch.ops.aten.sort.default, torch.ops.aten.sort.stable,
                     torch.ops.aten.argsort.default, torch.ops.aten.argsort.stable}

# (relative L2 error, largest error relative to the largest |value|) beyond which two runs of a graph compute
# different things, not the same thing rounded differently: a fused kernel rounds at other points and sums in
# another order, which moves elements by an ulp or two of their dtype, and the ops after it carry that further.
# Gross by design, like the autotuner's agreement check: the kernel tests hold each kernel to its op's reference
# tightly; this catches a rewrite that computes something else (a wrong mask, a dropped term).
# Measured on the bf16 reference models (two layers, every fusion correct): relative L2 errors up to 0.014.
_TOLERANCES = {torch.float64: (1e-9, 1e-7), torch.float32: (1e-5, 1e-4), torch.float16: (2.0 ** -7, 2.0 ** -4),
               torch.bfloat16: (2.0 ** -4, 2.0 ** -2)}
_LOW_PRECISION_TOLERANCE = (2.0 ** -3, 2.0 ** -1)  # FP8 outputs


def _lowest_precision(graph: torch.fx.Graph) -> torch.dtype | None:
    """The floating dtype with the fewest mantissa bits among the graph's values (None: no floating value)."""
    dtypes = {value.dtype for node in graph.nodes
              for value in pytree.tree_leaves(node.meta.get("val"))
              if isinstance(value, torch.Tensor) and value.dtype.is_floating_point}
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps, default=None)


# Results wider than the graph's lowest precision (fp32 logits of a bf16 model) carry that precision's roundings,
# which a fused kernel makes elsewhere than the model: half the bounds of results in that dtype (those also hold
# the final rounding). A correct bf16 add + RMSNorm upcast after measured 0.002-0.0035 relative L2; the same with
# a wrong eps behind a sigmoid, 0.058.
_COMPUTED_IN_TOLERANCES = {dtype: (l2 / 2, largest / 2) for dtype, (l2, largest) in _TOLERANCES.items()}


def _bounds(dtype: torch.dtype, computed_in: torch.dtype | None) -> tuple[float, float]:
    """(relative L2, largest relative error) allowed for results of `dtype` of a graph whose values go down to
    `computed_in`."""
    own = _TOLERANCES.get(dtype, _LOW_PRECISION_TOLERANCE)
    if computed_in is None or torch.finfo(computed_in).eps <= torch.finfo(dtype).eps:
        return own
    below = _COMPUTED_IN_TOLERANCES.get(computed_in, _LOW_PRECISION_TOLERANCE)
    return max(own[0], below[0]), max(own[1], below[1])


def _difference(expected, actual, compare_integers: bool,
                computed_in: torch.dtype | None = None) -> tuple[str | None, str]:
    """Compare two runs' flattened results: (why they differ, or None; the largest relative errors found).
    computed_in: the lowest floating precision the graph computes in (_lowest_precision), which bounds the
    rounding a rewrite may change even in wider outputs."""
    expected, actual = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    if len(expected) != len(actual):
        return f"{len(actual)} results, the captured graph has {len(expected)}", ""
    worst_l2 = worst_max = 0.0
    for index, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) and a != e:
                return f"result {index}: {a!r}, the captured graph gives {e!r}", ""
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)
            return f"result {index}: {got}, the captured graph gives {e.dtype} {tuple(e.shape)}", ""
        if e.is_complex():
            e, a = torch.view_as_real(e), torch.view_as_real(a)
        if not e.is_floating_point():
            if compare_integers and not torch.equal(e, a):
                return f"result {index} ({e.dtype}): {int((e != a).sum())} of {e.numel()} elements differ", ""
            continue
        wide = torch.float64 if e.dtype == torch.float64 else torch.float32
        e, a, dtype, shape = e.to(wide), a.to(wide), e.dtype, tuple(e.shape)
        for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
            if not torch.equal(test(e), test(a)):
                return f"result {index} ({dtype}): {name} at other positions than the captured graph's", ""
        finite = torch.isfinite(e)
        if not finite.any():
            continue
        e, a = e[finite], a[finite]
        tiny = torch.finfo(wide).tiny
        error = (a - e).abs()
        relative_l2 = (error.norm() / e.norm().clamp_min(tiny)).item()
        relative_max = (error.max() / e.abs().max().clamp_min(tiny)).item()
        worst_l2, worst_max = max(worst_l2, relative_l2), max(worst_max, relative_max)
        l2_bound, max_bound = _bounds(dtype, computed_in)
        if relative_l2 > l2_bound or relative_max > max_bound:
            within = (f"{str(dtype).removeprefix('torch.')}" if computed_in in (None, dtype)
                      else f"{str(dtype).removeprefix('torch.')} computed in {str(computed_in).removeprefix('torch.')}")
            return (f"result {index} ({str(dtype).removeprefix('torch.')} {list(shape)}): relative L2 error "
                    f"{relative_l2:.3g}, largest error {relative_max:.3g} of the largest |value| (bounds for "
                    f"{within}: {l2_bound:.3g}, {max_bound:.3g})"), ""
    return None, f"relative L2 error {worst_l2:.3g}, largest error {worst_max:.3g} of the largest |value|"


def _copy_inputs(args, written, sources=None) -> list:
    """args with fresh copies (strides kept) of the written positions, taken from `sources` where given."""
    sources = sources or {}
    return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(sources.get(i, a))
            if i in written else a for i, a in enumerate(args)]


def _too_large_to_copy(tensors) -> str:
    """Why the rewrite check cannot copy `tensors` (the inputs a graph writes) twice, or "": it may take a quarter
    of the memory free on their device (a KV cache at long context can be most of a GPU)."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return ""
    size = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())
    device = tensors[0].device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return ""
    if 2 * size <= free // 4:
        return ""
    return (f"the inputs the graph writes ({size / 2**30:.2f} GiB) are too large to copy twice beside it "
            f"({free / 2**30:.1f} GiB free on {device})")


_TOO_LARGE_ELSEWHERE = "on another rank, the inputs the graph writes are too large to copy twice"
_UNPAIRED_ELSEWHERE = "another rank's top-k calls do not pair with its graph as captured"
_DIFFERS_ELSEWHERE = "the results differ on another rank of the graph's process group"


class _RewriteCheck:
    """A graph's first call under CompileOptions.check_rewrites: the rewritten graph (op by op, so that the
    check judges the rewrites, not Inductor) runs on copies of the inputs the graph writes, the graph as captured
    runs on the caller's inputs (their one update, and the call's results), and the two are compared. Where they
    differ, the pass at fault is found by adding the passes that fired back one at a time, each trial on fresh
    copies, and the graph is rebuilt without the ones that made a difference."""

    def __init__(self, backend: DzcBackend, gm, example_inputs, captured, build: _Build, record: GraphRecord,
                 execution: Execution, device, any_rank: Callable[[bool], bool], checked: Callable[[str], None]):
        self.backend, self.gm, self.example_inputs = backend, gm, example_inputs
        self.checked = checked  # told the outcome where the build stands as it is (its capture entry is written)
        # Whether a flag holds on any rank running this graph (the flag itself without collectives): a graph
        # with collectives runs them at every trial, so every rank must take the same decisions, in step.
        self.any_rank = any_rank
        self.build, self.record, self.execution, self.device = build, record, execution, device
        self.reference = torch.fx.GraphModule(gm, captured)
        self.written = written_inputs(captured) | written_inputs(build.graph)
        self.compare_integers = not any(node.target in _TIE_BREAKING_OPS for node in captured.nodes)
        self.computed_in = _lowest_precision(captured)
        # Top-k in low precision: the captured graph's picks pin the rewritten graph's near-ties, within the
        # rounding bound of the precision (the fp32 scores of a bf16 model: _bounds' relative L2).
        self.captured_topk_calls = pinned_selections.topk_calls(self.reference)
        self.pin_topk = self.computed_in in _LOW_PRECISION and self.captured_topk_calls > 0
        self.tie_tolerance = _bounds(torch.float32, self.computed_in)[0]
        self.picks: list[torch.Tensor | None] = []
        self._unpaired = ""  # why the last trial's top-k calls did not pair with the captured graph's
        # Inductor compiles under the capture's tracing context (its fake inputs carry the symbolic sizes): kept
        # for a rebuild at the first call.
        self.inductor_context = torch._guards.TracingContext.try_get()
        self.run = self._first_call

    def call(self, *args):
        return self.run(*args)

    def _trial(self, build: _Build, args, pristine, expected) -> str | None:
        inputs = _copy_inputs(args, self.written, pristine)
        # An error raised here (a refused tuning database, say) is the call's error, as it would be without the check.
        if not self.pin_topk:
            actual = build.checkable(*inputs)
        else:
            with pinned_selections.Pinned(self.picks, self.tie_tolerance) as pins:
                actual = build.checkable(*inputs)
            self._unpaired = pins.mismatch or (f"{pins.calls} top-k calls, the graph as captured made "
                                               f"{len(self.picks)}" if pins.calls != len(self.picks) else "")
            if self._unpaired:  # not comparable: the build as it is goes unchecked, a trial build is dropped
                self._summary = ""
                return self._unpaired
        why, summary = _difference(expected, [actual, [inputs[i] for i in sorted(self.written)]],
                                   self.compare_integers, self.computed_in)
        if self.pin_topk and pins.pinned:
            summary += f"; {pins.pinned} top-k rows given the captured graph's picks at near-ties"
        self._summary = summary
        return why

    def _settle(self, outcome: str, result):
        """The check's outcome recorded, the build as it is runs from now on; returns `result`."""
        self.record.rewrite_check = outcome
        self.checked(outcome)
        self.run = self.build.run
        return result

    def _skip(self, why: str, args):
        """The call without the check, which is recorded as skipped for `why`."""
        self._settle(f"skipped: {why}", None)
        return self.run(*args)

    def _first_call(self, *args):
        start = time.perf_counter()
        try:
            return self._check(*args)
        finally:
            self.record.compile_seconds["rewrite check"] = time.perf_counter() - start

    def _check(self, *args):
        too_large = _too_large_to_copy([args[i] for i in self.written])
        if self.any_rank(bool(too_large)):  # a long-context KV cache: the check would need two more of it
            return self._skip(too_large or _TOO_LARGE_ELSEWHERE, args)
        if self.pin_topk:  # (the same on every rank: no collective where it is off)
            rewritten, captured = pinned_selections.topk_calls(self.build.checkable), self.captured_topk_calls
            unpaired = (f"the rewritten graph makes {rewritten} top-k calls, the graph as captured {captured}: a "
                        "selection made in a kernel, whose near-ties the check cannot pin"
                        if rewritten != captured else "")
            if self.any_rank(bool(unpaired)):
                return self._skip(unpaired or _UNPAIRED_ELSEWHERE, args)
        pristine = {i: args[i].clone() for i in self.written}  # kept for the trials while looking for a pass
        recording = pinned_selections.Recorded(_PICKS_BUDGET) if self.pin_topk else contextlib.nullcontext()
        with recording:
            expected_outputs = self.reference(*args)  # the caller's written inputs get the captured graph's update
        if self.pin_topk:
            if self.any_rank(recording.over_budget):
                return self._settle(f"skipped: the graph's top-k picks are over {_PICKS_BUDGET >> 20} MiB to keep "
                                    "for the comparison", expected_outputs)
            self.picks = recording.picks
        expected = [expected_outputs, [args[i] for i in sorted(self.written)]]
        why = self._trial(self.build, args, pristine, expected)
        if self.pin_topk and self.any_rank(bool(self._unpaired)):
            return self._settle(f"skipped: {self._unpaired or _UNPAIRED_ELSEWHERE}", expected_outputs)
        if not self.any_rank(why is not None):
            return self._settle(f"passed ({self._summary})", expected_outputs)
        backend, record = self.backend, self.record
        why = why or _DIFFERS_ELSEWHERE
        fired = self.build.fired()
        warnings.warn(f"dzc: graph {record.compile_id}: the rewritten graph's results differ from the graph as "
                      f"captured ({why}); looking for the pass at fault among {', '.join(fired)}", RuntimeWarning,
                      stacklevel=2)
        base = set(backend.options.disable_passes)
        accepted: list[str] = []
        dropped: list[tuple[str, str]] = []
        final = None
        for name in fired:
            trial = backend._build(self.gm, self.example_inputs, self.execution, self.device,
                                   base | (set(fired) - set(accepted) - {name}), checkable=True,
                                   inductor_context=self.inductor_context)
            why = self._trial(trial, args, pristine, expected)
            if not self.any_rank(why is not None):
                accepted.append(name)
                if final is not None:
                    backend._discard(final)
                final = trial
            else:
                dropped.append((name, why or _DIFFERS_ELSEWHERE))
                backend._discard(trial)
        if final is None:  # every pass that fired was at fault: the graph as captured, lowered
            final = backend._build(self.gm, self.example_inputs, self.execution, self.device,
                                   base | set(fired), checkable=False, inductor_context=self.inductor_context)
        backend._discard(self.build)
        backend._commit(final)
        for name, error in dropped:
            backend.report.drop_rewrites(name, record.compile_id, self.build.rewrites(name), error)
            warnings.warn(f"dzc: graph {record.compile_id}: dropped the rewrites of {name} "
                          f"({', '.join(self.build.rewrites(name))}): {error}", RuntimeWarning, stacklevel=2)
        _describe(record, final)
        record.rewrite_check = "dropped " + "; ".join(f"{name} ({error})" for name, error in dropped)
        self.run = final.run
        return expected_outputs


def _lowering_reads(graph: torch.fx.Graph, specs: dict) -> list[torch.fx.Node]:
    """The nodes whose values lowering reads: each dzc op whose spec is not in `specs` (lower_graph's), or that is
    lowered into parts, with its inputs and users (shapes and dtypes)."""
    nodes = []
    for node in graph.nodes:
        op = dzc_op_name(node)
        if op is not None and (node.name not in specs or op in LOWERED_AS_PARTS):
            nodes += [node, *node.all_input_nodes, *node.users]
    return nodes


def _host_syncs(graph: torch.fx.Graph) -> list[str]:
    """The ops of `graph` that introduce data-dependent (unbacked) sizes or values: the host waits for each
    (nonzero's count, a value read back), which no CUDA graph can capture."""
    # Each value's symbols once (not again for each of its users): the walk is per node of a graph that grows with
    # the model's depth.
    made = {node: free_unbacked_symbols(node.meta.get("val")) for node in graph.nodes}
    found = set()
    for node in graph.nodes:
        if node.op == "call_function" and made[node] and made[node] - set().union(
                *(made[n] for n in node.all_input_nodes)):
            found.add(str(node.target))
    return sorted(found)
