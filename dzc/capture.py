"""Capture: dzc as a torch.compile backend. Dynamo hands over each graph, AOTAutograd turns it into an ATen-level
inference graph with symbolic token sizes, and dzc runs its pipeline, lowers, and hands the rest to the fallback.
"""

from __future__ import annotations

import collections
import operator
import re
from pathlib import Path

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters as dynamo_counters
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dzc import config, ir, runtime
from dzc.lowering import Execution, dzc_op_name, lower_graph
from dzc.options import CompileOptions
from dzc.pipeline import run_pipeline
from dzc.report import CompileReport, GraphRecord
from dzc.targets import INTERPRETER, Target, triton_codegen

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
    path = Path(directory) / compile_id.replace("/", "_")
    path.mkdir(parents=True, exist_ok=True)
    for index, stage in enumerate(stages):
        (path / f"{index:03d}_{stage.name}.txt").write_text(stage.text)


def _direct_launches(gm: torch.fx.GraphModule) -> None:
    """Eager fallback: call the kernels' launchers straight from the graph, skipping the dispatcher hop that the
    op would make to find the same launcher (the graph text still shows the dzc op)."""
    for node in gm.graph.nodes:
        kernel_id = node.kwargs.get("kernel_id") if dzc_op_name(node) else None
        if kernel_id:
            node.target = runtime.direct_launcher(kernel_id)
            node.kwargs = {}
    gm.recompile()


# Dynamo's graph-break type when a frame's cache is full: the frame runs eagerly from then on.
_RECOMPILE_LIMIT_BREAK = "Dynamo recompile limit exceeded"


class DzcBackend:
    """A torch.compile backend bound to a target and options; `report` accumulates over every compile."""

    def __init__(self, target: Target, options: CompileOptions):
        self.target = target
        self.options = options
        self.report = CompileReport(target.name, repr(options))
        # Dynamo counts graph breaks per process: start from what was counted before this backend existed, so
        # breaks in models compiled earlier are not reported as this model's.
        self._graph_breaks_seen = collections.Counter(dynamo_counters["graph_break"])
        self._unsupported_seen = collections.Counter(dynamo_counters["unimplemented"])
        self._unsupported_total = self._unsupported_seen.total()
        self._frames_compiled: set = set()
        # keep_inference_input_mutations: an input the model writes in place (a KV cache) is copied back by a
        # `copy_` at the end of the graph, not by AOTAutograd's runtime wrapper after it, so that the pass
        # reinplace_cache_writes can see the write and make it in place again (and the wrapper still bumps the
        # input's version counter, which CudaGraphRunner reads).
        self._aot = aot_autograd(fw_compiler=self._refuse_training, inference_compiler=self._compile_graph,
                                 decompositions=_DECOMPOSITIONS, keep_inference_input_mutations=True)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
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
        return dynamo_counters["frames"]["total"]

    def eager_runs_since(self, frames_tried: int) -> list[str]:
        """Record in the report, and return, each frame Dynamo gave up compiling during the call because it
        reached a recompile limit: it then runs that frame eagerly, without dzc, on every later call that misses
        its cached graphs, and only logs a warning."""
        if dynamo_counters["frames"]["total"] == frames_tried:
            return []  # Dynamo tried no frame: the call ran graphs compiled before
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

    def _new_break_reasons(self) -> list[str]:
        counts = dynamo_counters["graph_break"]
        new = [reason for reason, n in counts.items() if n > self._graph_breaks_seen[reason]]
        self._graph_breaks_seen = collections.Counter(counts)
        return new

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs):
        dynamo_id = torch._guards.CompileContext.current_compile_id()
        compile_id = str(dynamo_id) if dynamo_id is not None else "0/0"
        # A recompile is a second graph for a frame this backend already compiled (Dynamo's own compile counter
        # is per code object and process, so it also counts other models sharing the same forward).
        frame = dynamo_id.frame_id if dynamo_id is not None else None
        recompile = frame in self._frames_compiled
        self._frames_compiled.add(frame)
        device = _input_device(example_inputs)
        execution = _execution_for(self.target, device)
        graph, stages = run_pipeline(gm.graph, self.target, self.options)
        for stage in stages:
            if stage.result is not None:
                self.report.record_pass(stage.name, stage.result.rewrites, stage.result.refusals)
        kernels = lower_graph(graph, self.target, self.options, execution, device)
        self.report.kernels.extend(kernels)
        stages.append(type(stages[0])("lowered", ir.print_graph(graph, f"lowered for {self.target.name}"), None))
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
        dynamic = sorted({str(v) for v in example_inputs if isinstance(v, torch.SymInt)})
        record = GraphRecord(compile_id, recompile, len(graph.nodes), dynamic, self._new_break_reasons(), fallback,
                             execution.describe(), execution.not_runnable_reason, _unfused_ops(graph),
                             host_syncs=_host_syncs(graph), stages=[(s.name, s.text) for s in stages])
        self.report.graphs.append(record)
        _dump(stages, compile_id)
        if config.debug_level() >= 1:
            print(self.report)
        if config.debug_level() >= 2:
            for stage in stages:
                print(stage.text)

        lowered = torch.fx.GraphModule(gm, graph)
        if fallback == "inductor":
            from torch._inductor.compile_fx import compile_fx_inner  # noqa: PLC0415 (heavy; only when used)

            # MUSA Triton builds fail when Inductor compiles in several processes (torch_musa sets one thread).
            serial = {} if self.target.profile.compile_in_parallel else {"compile_threads": 1}
            with torch._inductor.config.patch(serial):
                boxed = compile_fx_inner(lowered, example_inputs)

            def compiled(*args):
                return boxed(list(args))  # Inductor's callable takes its arguments as one list
        else:
            _direct_launches(lowered)
            compiled = lowered.forward  # the generated function itself: no nn.Module call machinery per call
        return compiled


def _host_syncs(graph: torch.fx.Graph) -> list[str]:
    """The ops of `graph` that introduce data-dependent (unbacked) sizes or values: the host waits for each
    (nonzero's count, a value read back), which no CUDA graph can capture."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        made = free_unbacked_symbols(node.meta.get("val"))
        consumed = set().union(*(free_unbacked_symbols(n.meta.get("val")) for n in node.all_input_nodes))
        if made - consumed:
            found.add(str(node.target))
    return sorted(found)
