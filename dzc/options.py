"""CompileOptions: the explicit semantics of one dzc.compile call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dzc import config

Codegen = Literal["auto", "triton", "tilelang"]
Fallback = Literal["auto", "inductor", "eager"]
HfAttention = Literal["compiled", "calls", "off"]


@dataclass(frozen=True)
class CompileOptions:
    # Which code generator emits dzc's kernels. "auto" takes each op's preferred generator that can run on the
    # inputs' device (TileLang kernels need a GPU; Triton also runs on CPU tensors through its interpreter).
    codegen: Codegen = "auto"
    # Time the legal configs of every kernel on first use (per token bucket) and remember the winner on disk.
    # Off: every kernel runs its family's default config. None: on where kernels run on a device, off under
    # Triton's CPU interpreter (its timings say nothing of a GPU, and tuning one MoE kernel there takes minutes).
    autotune: bool | None = None
    # Who runs the ops no dzc pass fused: "inductor" (torch.compile's own compiler), "eager" (the ATen graph as
    # captured), or "auto" = inductor when the inputs are on a GPU, eager on CPU tensors.
    fallback: Fallback = "auto"
    # Generated sources and the tuning database; None = $DZC_CACHE_DIR or ~/.cache/dzc.
    cache_dir: str | None = None
    # Mark the leading (token) dimensions of tensor inputs dynamic so that a new batch or sequence length does
    # not recompile. False: specialise on every shape.
    dynamic_tokens: bool = True
    # On CUDA, replay a CUDA graph per input signature when the call has at most this many tokens (rows of its
    # largest input): host overhead dominates there. The replay skips Dynamo's guards, so parameters and module
    # attributes count as frozen once a shape was captured (see dzc.runtime.CudaGraphRunner). 0 turns it off.
    cuda_graph_max_tokens: int = 256
    # Return the CUDA graph's own output buffers instead of copies: saves a copy per output, but the next replay
    # of the same shape overwrites what the previous call returned (a decode loop that consumes each step first).
    cuda_graph_reuse_outputs: bool = False
    # Passes to skip, by name (see dzc.pipeline); for bisecting a numerics problem.
    disable_passes: tuple[str, ...] = ()
    # Capture ops whose output shape depends on data (aten.nonzero: `torch.where(topk_ids == e)` in a per-expert MoE
    # loop) into the graph with unbacked sizes, instead of breaking the graph there (Dynamo's
    # capture_dynamic_output_shape_ops). Off: such code graph-breaks, and fuse_mxfp4_experts sees no whole loop.
    capture_dynamic_output_shapes: bool = True
    # Capture `.item()` / `.tolist()` into the graph as unbacked symbolic ints instead of breaking the graph there
    # (Dynamo's capture_scalar_outputs): packed vision attention reads its segment lengths (`cu_seqlens`) this way.
    # Both captures are Dynamo config, read whenever a call traces: dzc.compile turns the ones asked for on
    # process-wide (a config patch around every call costs ~25 µs of host time), so other torch.compile users in
    # the process capture those ops too; turning one off that the process has on costs that patch per call.
    capture_scalar_outputs: bool = True
    # A shipped tuning database (written by dzc-tune) consulted read-only before the local cache when tuning;
    # None = $DZC_TUNING_DB if set. A database tuned on another device (arch, multiprocessors, versions) is
    # refused with an error, never partly used.
    tuning_db: str | None = None
    # MXFP4 MoE layers multiply FP8 (E4M3) activations (W4A8: dzc.mxfp4_moe_w4a8, whose rounding dzc/ops/
    # mxfp4_moe.py defines) instead of the activations' own dtype (W4A16). It changes the numerics, so it is opt-in;
    # on profiles without native FP8 (sm_80, mp_22) the rewrite refuses and the report says so. Triton, on the
    # workspace path, from 128 rows per expert on (prefill); decode-sized calls run W4A16 online, which moves a
    # quarter of the bytes (dzc.ops.mxfp4_moe.fp8_applies).
    moe_fp8_activations: bool = False
    # Check the rewrites on each graph's first call: run the graph as captured (before any pass) beside the
    # rewritten one on the same inputs (inputs the graph writes, such as a KV cache, are copied for the rewritten
    # run, so the caller's are written once), compare the outputs, and where they differ beyond rounding, drop
    # the pass responsible for that graph (warned, recorded in the report with the error found). The first call
    # returns the captured graph's results. Costs one extra run per graph, once, and for that call two copies of
    # the inputs the graph writes (a KV cache); where those would take over a quarter of the memory free on their
    # device, the graph runs unchecked and the report says so. None = $DZC_CHECK_REWRITES (on unless set to 0).
    check_rewrites: bool | None = None
    # transformers models (a PreTrainedModel, or a module holding one): dzc selects its attention implementation
    # (dzc/hf_attention.py: packed vision attention as dzc.varlen_attention, everything else as the model's own
    # 'sdpa' or 'eager') on every config of the model set to one of those. "compiled": selected while the
    # CompiledModel lives (the model called directly runs it too), the user's setting put back when the
    # CompiledModel is garbage-collected; "calls": selected during each compiled call only, the user's setting put
    # back after it (a few attribute writes per call); "off": the model's attention as configured.
    hf_attention: HfAttention = "compiled"
    # Capture repeated layers once: the children of an nn.ModuleList that share a class (defined outside torch)
    # and appear at least twice are marked as nested compile regions (torch.compiler.nested_compile_region) while
    # the CompiledModel lives, without changing the model's code (dzc/regions.py: each instance's class is swapped
    # for a same-named subclass; eager results are unchanged). Dynamo and AOTAutograd then trace one layer body
    # instead of every layer, dzc's passes rewrite each body once, and the bodies are inlined at their calls
    # before the passes run over the whole graph (layer-crossing fusions), so the fusions are those of a plain
    # capture. On by default: cold compiles of the llama-style decoder and of the multimodal reference model are
    # faster with them (docs/results/compile_time_cpu.md, session 17). Where regions would cost a graph or a
    # recompile a plain capture does not, dzc works around it: calls of one layer class given inputs of other
    # dynamic sizes (window and full-attention vision blocks) get a body each, a dim specialised inside a layer is
    # no longer marked dynamic, and fewer layers are marked where Dynamo relates two calls' sizes all the same; a
    # capture with regions that fails or cannot be trusted is retried without them; the report's nested_regions
    # and region_retries say which. None = $DZC_NESTED_REGIONS (on unless set to 0).
    nested_regions: bool | None = None
    # Expert parallelism: the most rows (tokens x top_k) any rank sends in one MoE dispatch, DeepEP low-latency
    # mode's num_max_dispatch_tokens_per_rank x top_k. Given, pad_all_to_all_to_capacity sends every peer a chunk
    # of this many rows (zero padding, masked), so the dispatch and combine need no split sizes on the host: no
    # host sync, and small calls replay a CUDA graph. Every rank of the group must compile with the same value; a
    # call with more rows raises an error. None: the split sizes are read back each call (the pass refuses).
    ep_max_dispatch_rows: int | None = None

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or config.CACHE_DIR.get()

    def resolved_check_rewrites(self) -> bool:
        if self.check_rewrites is not None:
            return self.check_rewrites
        return config.CHECK_REWRITES.get() == "1"

    def resolved_nested_regions(self) -> bool:
        if self.nested_regions is not None:
            return self.nested_regions
        return config.NESTED_REGIONS.get() == "1"

    def __post_init__(self):
        if self.codegen not in ("auto", "triton", "tilelang"):
            raise ValueError(f"codegen must be 'auto', 'triton' or 'tilelang', not {self.codegen!r}")
        if self.fallback not in ("auto", "inductor", "eager"):
            raise ValueError(f"fallback must be 'auto', 'inductor' or 'eager', not {self.fallback!r}")
        if self.hf_attention not in ("compiled", "calls", "off"):
            raise ValueError(f"hf_attention must be 'compiled', 'calls' or 'off', not {self.hf_attention!r}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be >= 0")
        if self.ep_max_dispatch_rows is not None and self.ep_max_dispatch_rows < 1:
            raise ValueError("ep_max_dispatch_rows must be >= 1 or None")
