"""Inductor's compile of a graph's leftover ops, found again on a warm start by the key its FX graph cache gave it.

Inductor's FX graph cache finds a compiled graph by hashing the graph it is given: on a warm start at 32 + 16 layers
of the reference multimodal model that was most of the "fallback compile" stage, with what comes before it (the
stored fake values rebuilt for outline_repeated_calls, the outlining, the copy of the graph for Inductor), all to
find again what the cold compile found. dzc's compile cache entry already stands for that graph (its key covers
the captured graph, its inputs, the passes, options and versions; outlining is a function of those), so the cold
compile keeps Inductor's key in the entry (`record`), and a warm hit loads Inductor's compiled graph by it
(`load`), as torch's own AOTAutograd cache does (aot_autograd_result.FxGraphCacheLoadable): the compile's shape
guards matched exactly, the rest of Inductor's post-compile as compile_fx_inner runs it on a hit.

What else goes into Inductor's key besides the graph (its config and custom passes, matmul and determinism
settings, the system: GPU, CUDA, Triton, torch's sources) is checked through `fingerprint`: Inductor's own key of
an empty graph, computed the same way. What the graph names that the entry's key does not cover is checked too: the
kernel ids its dzc ops call, which name the compiling model's place among the process's dzc.compile calls
(lowering.KernelTable); the code Inductor generated calls those ids, so a model that got other ids (one compiled
after others in its process) cannot run it. Where anything differs, or Inductor's cache is off, or the entry is gone
from it, the fallback compiles as before (outlining, Inductor's lookup by hash or its compile).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch


@dataclasses.dataclass(frozen=True)
class InductorRecord:
    """A cold compile's Inductor result, as the compile cache entry keeps it: `key` (Inductor's FX graph cache key),
    `guards` (the compiled graph's shape guards expression, or None), `fingerprint` (`fingerprint()` then),
    `outlined` (outline_repeated_calls' outcome, for the report) and `kernel_ids` (the dzc kernel ids the compiled
    code calls, sorted)."""

    key: str
    guards: str | None
    fingerprint: str
    outlined: str
    kernel_ids: tuple[str, ...]


def _graph_kwargs() -> dict:
    """compile_fx_inner's keyword arguments as dzc calls it (its defaults), with its cudagraphs box as
    _compile_fx_inner fills it in."""
    from torch._inductor import config  # noqa: PLC0415 (heavy; only when Inductor runs)
    from torch._inductor.utils import BoxedBool  # noqa: PLC0415

    return {"cudagraphs": BoxedBool(config.triton.cudagraphs), "static_input_idxs": (), "is_backward": False,
            "graph_id": None, "cpp_wrapper": False, "fx_wrapper": False, "is_inference": False,
            "boxed_forward_device_index": None, "layout_opt": None, "extern_node_serializer": None}


def cache_on() -> bool:
    """Whether compile_fx_inner would look the graph up in Inductor's local FX graph cache."""
    from torch._inductor import config  # noqa: PLC0415
    from torch._inductor.virtualized import V  # noqa: PLC0415

    return (bool(config.fx_graph_cache) and not config.force_disable_caches and not V.aot_compilation
            and not torch._functorch.config.bundled_autograd_cache)


def fingerprint() -> str | None:
    """Inductor's FX graph cache key of an empty graph: everything its key of a graph hashes but the graph, in the
    installed torch's own terms. None where it cannot be computed (then nothing is recorded or loaded)."""
    from torch._inductor.codecache import compiled_fx_graph_hash  # noqa: PLC0415

    graph = torch.fx.Graph()
    graph.output(())
    try:
        key, _ = compiled_fx_graph_hash(torch.fx.GraphModule(torch.nn.Module(), graph), [], _graph_kwargs(), [])
    except Exception:  # noqa: BLE001  (an optional speed-up: without it a warm start looks the graph up by hash)
        return None
    return key


def record(compiled, outlined: str, fingerprint_then: str | None, kernel_ids) -> InductorRecord | None:
    """What a compile cache entry keeps of compile_fx_inner's result `compiled`, whose graph calls `kernel_ids`
    (dzc kernel ids): None where it has no FX graph cache key (the cache was off or bypassed), froze parameters
    (its constants would come from the graph module), or the fingerprint could not be taken."""
    from torch._inductor.output_code import CompiledFxGraph  # noqa: PLC0415

    key = getattr(compiled, "_fx_graph_cache_key", None)
    if (not isinstance(compiled, CompiledFxGraph) or key is None or fingerprint_then is None
            or getattr(compiled, "frozen_param_names", None)):
        return None
    return InductorRecord(key, compiled.guards_expr, fingerprint_then, outlined, tuple(sorted(kernel_ids)))


def load(stored: InductorRecord, example_inputs, kernel_ids) -> tuple[object | None, str]:
    """(Inductor's compiled graph for `stored`, ready to call: compile_fx_inner's result on a hit, "") or, where it
    is not to be had that way, (None, why not): the graph now calls other dzc kernel ids than `stored`'s
    (`kernel_ids`), Inductor's cache off, another fingerprint, no shape environment to check guards in, or no entry
    under the key with exactly the stored guards. Call with torch's cache artifacts of the entry loaded
    (CompileCache.before_fallback), inside the compile's tracing context."""
    from torch._inductor import config  # noqa: PLC0415
    from torch._inductor.async_compile import CompiledTritonKernels  # noqa: PLC0415
    from torch._inductor.codecache import FxGraphCache  # noqa: PLC0415
    from torch._inductor.output_code import CompiledFxGraphConstants  # noqa: PLC0415

    if tuple(sorted(kernel_ids)) != stored.kernel_ids:
        return None, ("the graph calls other kernel ids than the cold compile's (its model was not compiled in the "
                      "same order among its process's dzc.compile calls)")
    if not cache_on():
        return None, "Inductor's FX graph cache is off"
    if FxGraphCache._get_shape_env() is None:
        return None, "no shape environment to check its guards in"
    if fingerprint() != stored.fingerprint:
        return None, "Inductor's configuration or system differs from the cold compile's"
    constants = CompiledFxGraphConstants()  # no frozen parameters (record): the constants the entry holds
    try:
        with torch.utils._python_dispatch._disable_current_modes():
            CompiledTritonKernels.cache_clear()  # as compile_fx_inner does before each compile
            compiled, _ = FxGraphCache.load_with_key(stored.key, [], example_inputs, local=True, remote_cache=None,
                                                     is_backward=False, constants=constants,
                                                     evaluate_guards=lambda expression, _: expression == stored.guards)
            if compiled is None:
                return None, "Inductor's cache has no entry under the key with the cold compile's guards"
            compiled._fx_graph_cache_key = stored.key
            compiled.post_compile(example_inputs, constants, _graph_kwargs())
    except Exception as error:  # noqa: BLE001  (internals of another torch: the compile goes the usual way)
        why = f"loading it failed ({type(error).__name__}: {error})"
        warnings.warn(f"dzc: {why}; Inductor looks the graph up by hashing it instead", RuntimeWarning, stacklevel=3)
        return None, why
    policy = getattr(config, "cudagraph_policy", None)  # torch 2.13: wraps what compile_fx_inner returns
    return (policy.wrap_output(compiled) if policy is not None else compiled), ""
