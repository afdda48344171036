"""dzc.compile: the public entry point, built on torch.compile with a dzc backend."""

from __future__ import annotations

import contextlib
import gc
import inspect
import warnings
import weakref

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

from dzc import autotune, config, frame_cache, hf_attention, regions, runtime
from dzc.capture import DzcBackend
from dzc.options import CompileOptions
from dzc.targets import resolve_target


def backend(target: str = "cuda", options: CompileOptions | None = None) -> DzcBackend:
    """A torch.compile backend: `torch.compile(model, backend=dzc.backend("musa"))`; its `.report` is the
    compile report. `backend="dzc"` is the same with target "cuda" and default options."""
    return DzcBackend(resolve_target(target), options or CompileOptions())


def _process_wide_dynamo_settings(options: CompileOptions):
    """Make Dynamo's capture settings what `options` asks where that means turning a capture on, and its fake
    tensors' cache off (process-wide, once); returns the context to enter around each call: a no-op, or a
    config.patch when the options turn off a capture the process has on."""
    wanted = {"capture_dynamic_output_shape_ops": options.capture_dynamic_output_shapes,
              "capture_scalar_outputs": options.capture_scalar_outputs}
    config = torch._dynamo.config
    # Fake tensors' dispatch cache off too (process-wide): where sizes are data-dependent (an MoE's per-expert loop,
    # each expert's nonzero a fresh unbacked size) rebuilding a cached output's symbolic sizes costs more than the
    # op's meta function. 32 experts captured in 9.2 s (Dynamo and AOTAutograd) with it off against 14.9 s with it
    # on, 128 in 29 s against 41 s; other graphs within noise (docs/results/compile_time_cpu.md, session 26). A cache
    # of what the meta functions compute: no captured graph changes.
    config.fake_tensor_cache_enabled = False
    _pause_gc_while_compiling()
    for name, value in wanted.items():
        if value and not getattr(config, name):
            setattr(config, name, True)
    if all(getattr(config, name) == value for name, value in wanted.items()):
        return contextlib.nullcontext()
    return config.patch(**wanted)


def _pause_gc_while_compiling() -> None:
    """Pause Python's cyclic garbage collector while Dynamo compiles a frame (its trace, dzc's backend: AOTAutograd,
    the passes, lowering), process-wide, installed once; DZC_COMPILE_GC=on leaves it running. A full collection
    rescans every object alive, and a compile builds hundreds of thousands (fake tensors, symbolic sizes, graph
    nodes): at 8 + 8 layers of the multimodal reference model 7 full collections took 4.7 s of its compile
    (docs/results/compile_time_cpu.md, session 33). Cycles a compile drops are collected after it, as usual."""
    from torch._dynamo.callback import callback_handler

    if _resume_gc in callback_handler.end_callbacks:
        return
    callback_handler.register_start_callback(_pause_gc)
    callback_handler.register_end_callback(_resume_gc)


_gc_paused = False  # whether dzc paused the collector (one left off by the user stays off)


def _pause_gc(_) -> None:
    global _gc_paused
    # Dynamo runs start and end callbacks once around the outermost compile only (nested ones count).
    if gc.isenabled() and config.COMPILE_GC.get() == "paused":
        gc.disable()
        _gc_paused = True


def _resume_gc(_) -> None:
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.enable()


# What a capture that failed raises: Dynamo's own errors (BackendCompilerFailed where AOTAutograd's tracing inside
# dzc's backend failed), and the data-dependent errors of symbolic shapes, which Dynamo lets through as they are.
_CAPTURE_FAILURES = (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode,
                     PendingUnbackedSymbolNotFound, DataDependentOutputException, DynamicOutputShapeException)


# Dynamo keeps a code object's compiled graphs in one cache of torch._dynamo.config.recompile_limit (8) entries,
# and a new backend fails the backend guard: without isolation every dzc.compile of the same forward (one per
# decoder layer, say) takes an entry, and past eight Dynamo runs the model eagerly. torch.compile's
# isolate_recompiles (newer torch; 2.13 has it) gives each dzc.compile its own cache and budget. Where torch lacks
# it, CompiledModel notices the eager runs, records them in the report and warns.
_OWN_RECOMPILE_BUDGET = ({"isolate_recompiles": True}
                         if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {})


class CompiledModel:
    """The result of dzc.compile: call it like the model; `report` says what dzc did."""

    def __init__(self, model, target: str, options: CompileOptions):
        self.model = model
        self.options = options
        self.backend = backend(target, options)
        # Repeated layers captured once (dzc/regions.py): marked while this CompiledModel lives (Dynamo guards the
        # layers' classes), put back when it is garbage-collected or when a capture with regions is refused.
        if options.resolved_nested_regions():
            self.backend.marking = regions.mark_repeated_layers(model)
            weakref.finalize(self, self.backend.marking.restore)
            self.backend.report.nested_regions = self.backend.marking.describe() or "none (no repeated layers)"
            if self.backend.marking.refused:
                self.backend.report.nested_regions += "; not marked: " + "; ".join(self.backend.marking.refused)
        else:
            self.backend.report.nested_regions = "off"
        # Dynamo's bytecode and guards kept across processes (dzc/frame_cache.py): looked up at the first call.
        self.frame_cache = frame_cache.FrameCache(model, self.backend, self.backend.target, options)
        self._compiled = None if self.frame_cache.function is not None else self._torch_compile()
        # Dynamo reads these when it traces, which any call may do (a guard fails). Entering a config.patch around
        # every call costs ~25 µs of host time (measured on the CPU host: as much as a small kernel takes on the
        # GPU), so dzc turns the captures its options ask for on process-wide, once; other torch.compile users in
        # the process then capture those ops too instead of breaking their graphs there. Only options that turn
        # a capture off which the process has on need the patch around every call.
        self._dynamo_settings = _process_wide_dynamo_settings(options)
        # transformers models: dzc's attention implementation, selected for as long as options.hf_attention says
        self.hf_attention = hf_attention.take_over(model, options.hf_attention, self)
        self._attention_scope = (self.hf_attention if self.hf_attention and options.hf_attention == "calls"
                                 else contextlib.nullcontext())
        self._cuda_graphs = None
        self._replayable_at = (0, False)  # (graphs compiled, whether the runner takes calls)
        if options.cuda_graph_max_tokens > 0 and self.backend.target.profile.torch_device_type == "cuda":
            self._cuda_graphs = runtime.CudaGraphRunner(self._run_compiled, options.cuda_graph_max_tokens,
                                                        reuse_outputs=options.cuda_graph_reuse_outputs, model=model)

    def _torch_compile(self, frames: frame_cache.FrameCache | None = None):
        """torch.compile of the model with dzc's backend; with `frames`, of its forward's copy, with the frame
        entry's package (installed or empty) and guard filter."""
        dynamic = None if self.options.dynamic_tokens else False
        if frames is None:
            return torch.compile(self.model, backend=self.backend, dynamic=dynamic, **_OWN_RECOMPILE_BUDGET)
        return torch._dynamo.optimize(self.backend, dynamic=dynamic, package=frames.package,
                                      guard_filter_fn=frames.guard_filter, **_OWN_RECOMPILE_BUDGET)(frames.function)

    @property
    def report(self):
        return self.backend.report

    def reset_cuda_graphs(self) -> None:
        """Drop captured CUDA graphs (after reassigning parameters or changing module attributes)."""
        if self._cuda_graphs is not None:
            self._cuda_graphs.reset()

    def __call__(self, *args, **kwargs):
        try:
            with self._attention_scope:
                if self._cuda_graphs is not None and self._replayable():
                    return self._cuda_graphs(*args, **kwargs)
                return self._run_compiled(*args, **kwargs)
        except runtime.NotRunnableError as err:
            # Raised by the first kernel, ~18 frames deep in Dynamo and AOTAutograd; those frames say nothing
            # about why (no device for the target, or the inputs on another device), the message does.
            raise runtime.NotRunnableError(str(err)) from None

    def _replayable(self) -> bool:
        """Whether calls go through the CUDA-graph runner: graphs were compiled, none with host syncs. Read again
        only when the number of graphs changed (a graph's record settles during the call that compiled it)."""
        graphs = self.backend.report.graphs
        if len(graphs) != self._replayable_at[0]:
            self._replayable_at = (len(graphs), bool(graphs) and not any(g.host_syncs for g in graphs))
        return self._replayable_at[1]

    def _run_compiled(self, *args, _retry: bool = False, **kwargs):
        if self._compiled is None:  # the first call: find the frame entry, in the calls' grad mode
            with torch.no_grad():
                try:
                    self.frame_cache.load()
                except Exception as err:  # noqa: BLE001  (a torch whose internals moved: compile as usual)
                    self.frame_cache.off(f"finding it failed: {type(err).__name__}: {str(err)[:160]}")
            found = self.frame_cache.package is not None
            self._compiled = self._torch_compile(self.frame_cache if found else None)
        if self.options.dynamic_tokens and not self.backend.report.graphs and not _retry:
            # A hint for the first compile, taken off after the call; later compiles of the frame keep what Dynamo
            # learnt was dynamic. (Graphs built from a frame entry were compiled with it.)
            marked = hf_attention.mark_varying_dims((args, kwargs))
            try:
                return self._run_compiled(*args, _retry=True, **kwargs)
            finally:
                hf_attention.forget_marks(marked)
        frames_tried = self.backend.start_call()
        try:
            # dzc compiles inference graphs (AOTAutograd's inference path); serving loops run with grad off
            # already, and skipping the no_grad context saves its host time there.
            if torch.is_grad_enabled():
                with torch.no_grad(), self._dynamo_settings:
                    result = self._compiled(*args, **kwargs)
            else:
                with self._dynamo_settings:
                    result = self._compiled(*args, **kwargs)
        except Exception as error:
            if self._refuse_frame_entry():
                return self._run_compiled(*args, _retry=True, **kwargs)
            inner = error.inner_exception if isinstance(error, BackendCompilerFailed) else error
            if inner is self.backend.failure:
                # dzc's own stage failed: its error as it is, not inside Dynamo's "report a bug to PyTorch" text
                raise inner.with_traceback(inner.__traceback__) from inner.__cause__
            if self._refuse_regions(inner, frames_tried) or self._give_back_attention(error):
                # the same inputs: their dynamic-dim hints stay as marked (or as _refuse_regions took some off)
                return self._run_compiled(*args, _retry=True, **kwargs)
            if not self._retry_capture(inner, frames_tried):
                raise
            return self._run_compiled(*args, **kwargs)
        if self.frame_cache.package is not None:
            self.frame_cache.save()  # after graphs compiled in this call; nothing to do otherwise
        for reason in self.backend.eager_runs_since(frames_tried):
            warnings.warn(f"dzc.compile: {reason}. Raise the limit, or compile one model and reuse it "
                          "(the report's eager_runs says so too)", RuntimeWarning, stacklevel=3)
        return result

    def _refuse_frame_entry(self) -> bool:
        """After a capture failed on a guard torch cannot save (frame_cache.FrameCache.guard_filter): compile the
        model itself from now on, without a frame entry, and say so; the call is then retried. What the failed
        capture compiled leaves the report."""
        refusal = self.frame_cache.refusal() if self.frame_cache.package is not None else ""
        if not refusal:
            return False
        self.frame_cache.off(refusal)
        if self.backend.checkpoint is not None:
            self.backend.report.restore(self.backend.checkpoint)
        self._compiled = self._torch_compile()
        return True

    def _refuse_regions(self, error: Exception, frames_tried: int) -> bool:
        """After a capture with nested compile regions failed (a graph break inside a region, which Dynamo cannot
        split) or was refused by dzc's backend (regions.RegionRefusal), put the layers' classes back and say so:
        the call is then retried, captured without regions. Whether to retry: where layers are marked and the
        capture failed during the call."""
        marking = self.backend.marking
        if not marking or not (isinstance(error, regions.RegionRefusal) or (
                self.backend.frames_tried_since(frames_tried) and isinstance(error, _CAPTURE_FAILURES))):
            return False
        first_line = (str(error).strip().splitlines() or [""])[0]
        why = first_line if isinstance(error, regions.RegionRefusal) else f"{type(error).__name__}: {first_line}"
        report = self.backend.report
        if not isinstance(error, regions.RegionRefusal):
            unmarked = regions.unmark_specialized_dims(error)
            if unmarked:  # the same layers, captured again without those dims' dynamic hints
                report.region_retries.append(f"{why}: dims specialised inside a region no longer marked "
                                             f"dynamic ({', '.join(unmarked)})")
                return True
        if isinstance(error, regions.RegionNarrowing):
            before = marking.describe()
            marking.unmark(error.layers)
            if marking:
                report.region_retries.append(f"{before} narrowed to {marking.describe()} ({why})")
                report.nested_regions = f"{marking.describe()} (narrowed: {why})"
                return True
        message = (f"refused for {marking.describe()} ({why}); captured again without them")
        marking.restore()
        report.nested_regions = message
        if self.options.nested_regions:  # asked for in the options, not dzc's default
            warnings.warn(f"dzc.compile: nested compile regions {message}", RuntimeWarning, stacklevel=4)
        return True

    def _give_back_attention(self, error: Exception) -> bool:
        """After dzc's attention implementation refused a packed call it cannot compute as the model's own
        implementation would (hf_attention.PackedCallRefusal, raised while tracing or running the call), put the
        model's own implementation back for good and say so (report.attention_given_back): the call is then
        retried, and the model computes what it computes uncompiled (its attention left to the fallback)."""
        refusal = error
        while refusal is not None and not isinstance(refusal, hf_attention.PackedCallRefusal):
            refusal = getattr(refusal, "inner_exception", None) or refusal.__cause__ or refusal.__context__
        if refusal is None or not self.hf_attention or not self.hf_attention.configs:
            return False
        self.hf_attention.restore()
        self.hf_attention.configs.clear()  # nothing is selected again: neither per call ("calls") nor at exit
        message = f"{refusal}; the model's own attention implementation was put back and the call retried"
        self.backend.report.attention_given_back = message
        warnings.warn(f"dzc.compile: {message}", RuntimeWarning, stacklevel=4)
        return True

    def _retry_capture(self, error: Exception, frames_tried: int) -> bool:
        """After a capture (Dynamo or AOTAutograd tracing) failed with Dynamo's scalar and dynamic-shape captures
        on, turn them off for this model, as torch.compile has them, and say so: the call is then retried, and
        .item(), .tolist() and ops with data-dependent output shapes break the graph instead of failing it.
        Whether to retry: once, where a capture was tried during the call and failed with its own error."""
        if (self.backend.report.capture_retries or not self.backend.frames_tried_since(frames_tried)
                or not isinstance(error, _CAPTURE_FAILURES)
                or not (self.options.capture_scalar_outputs or self.options.capture_dynamic_output_shapes)):
            return False
        first_line = (str(error).strip().splitlines() or [""])[0]
        message = (f"the capture failed with capture_scalar_outputs and capture_dynamic_output_shape_ops on "
                   f"({type(error).__name__}: {first_line}); retried without them, accepting graph breaks at "
                   ".item(), .tolist() and ops with data-dependent output shapes")
        self.backend.report.capture_retries.append(message)
        warnings.warn(f"dzc.compile: {message}", RuntimeWarning, stacklevel=4)
        self._dynamo_settings = torch._dynamo.config.patch(capture_scalar_outputs=False,
                                                           capture_dynamic_output_shape_ops=False)
        return True


def compile(model, target: str = "cuda", options: CompileOptions | None = None) -> CompiledModel:
    """Compile `model` (an nn.Module or a function) for `target` ("cuda", "musa", or a profile such as
    "cuda:sm_90", "musa:mp_22"). Compilation happens on the first call, as with torch.compile."""
    options = options or CompileOptions()
    if not isinstance(options, CompileOptions):
        raise TypeError(f"options must be a dzc.CompileOptions, not {type(options).__name__}")
    resolve_target(target)  # fail now on a bad target name, not at the first call
    # The same for the environment's knobs and the shipped tuning database: read at the first call, a bad value
    # would surface inside Dynamo, wrapped in its BackendCompilerFailed.
    config.validate()
    autotune.open_shipped(options.tuning_db)
    return CompiledModel(model, target, options)
