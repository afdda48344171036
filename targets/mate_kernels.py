"""Moore Threads' MATE (MUSA AI Tensor Engine) kernels as external tuning candidates for the dzc ops they cover.

Where MATE is installed on a device it supports, the autotuner times MATE's kernel for an op next to dzc's
configs; MATE runs only where it is faster (dzc/autotune.py), so dzc is never slower than the vendor library.

Which dzc op maps to which MATE function (signatures read from MooreThreads/mate, commits 99bbf1f..3f58cc3, and
from vLLM-MUSA's calls into it; docs/musa.md "MATE as external candidates" has the table and what was verified):
  varlen_attention  -> mate.flash_attn_varlen_func (FlashAttention-3 compatible varlen forward, non-causal)
  sparse_attention  -> mate.flashmla.flash_mla_sparse_fwd (DeepSeek-V3.2 sparse MLA prefill kernel; it serves
                       every row count: dzc's decode rows too)
  dsa_indexer       -> mate.deep_gemm.get_paged_mqa_logits_metadata + fp8_paged_mqa_logits (FP8 cache only)
Not covered: dsa_topk (MATE's hash_topk is hash routing, another op), mxfp4_moe (MATE has FP8/BF16 grouped
GEMMs and a fused gate, nothing that reads MXFP4), add_rms_norm / add_layer_norm (no MATE norm kernels).

Each adapter is three plain functions: `refusal(spec)` (why MATE cannot run this spec, or None), `arguments(op
arguments)` (the MATE call's keyword arguments: tensors reshaped and indices translated, pure torch), and
`result(MATE's output, op arguments)` (back to the op's exact result: shape, dtype, masked positions). Only
`call` touches MATE, so everything else is testable without it. Run-time facts MATE constrains but a spec does
not fix (the indexer's page size) are checked in `arguments`, with an error the tuner logs and skips.

Where MATE applies is data: REQUIREMENTS, keyed by the profile's arch (MATE ships MP31 kernels only), holds the
toolkit and torch_musa versions its README requires. Nothing here tests the vendor.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from dzc.autotune import ExternalCandidate
from dzc.ops.varlen_attention import apply_vision_rotary
from dzc.targets.profiles import DeviceProfile

log = logging.getLogger("dzc.mate")


@dataclass(frozen=True)
class MateRequirements:
    """What MATE's README requires next to the arch (MooreThreads/mate README.md, "Requirements")."""

    toolkit: tuple[int, ...]  # MUSA toolkit (torch.version.musa)
    torch_musa: tuple[int, ...]


# profile.arch -> requirements; an arch missing here gets no MATE candidates.
REQUIREMENTS: dict[str, MateRequirements] = {
    "mp_31": MateRequirements(toolkit=(4, 3, 6), torch_musa=(2, 7)),
}


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'4.3.6' / '2.7.1+git1a2b' -> (4, 3, 6) / (2, 7, 1); None when there is no leading number."""
    numbers = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else None


def installation_problem(arch: str, mate_version: str | None, toolkit: str | None,
                         torch_musa: str | None) -> str | None:
    """Why MATE's kernels cannot be offered on a device of `arch` (a profile's arch) with these installed
    versions (None: they can). mate_version None means `import mate` failed."""
    required = REQUIREMENTS.get(arch)
    if required is None:
        return f"MATE has no kernels for {arch} (only {', '.join(sorted(REQUIREMENTS))})"
    if mate_version is None:
        return "MATE is not installed (import mate failed)"
    for what, installed, minimum in (("MUSA toolkit", toolkit, required.toolkit),
                                     ("torch_musa", torch_musa, required.torch_musa)):
        version = parse_version(installed)
        if version is None or version < minimum:
            return (f"MATE needs {what} >= {'.'.join(map(str, minimum))}, found {installed or 'none'}")
    return None


@functools.cache
def _installed_mate(arch: str) -> ModuleType | None:
    """The mate module if it is installed and usable for `arch`; the reason it is not is logged once."""
    try:
        import mate
    except ImportError:
        mate = None
    try:
        torch_musa = importlib.metadata.version("torch_musa")
    except importlib.metadata.PackageNotFoundError:
        torch_musa = None
    problem = installation_problem(arch, getattr(mate, "__version__", "unknown") if mate else None,
                                   getattr(torch.version, "musa", None), torch_musa)
    if problem:
        log.info("dzc: no MATE candidates on %s: %s", arch, problem)
        return None
    return mate


# ---------------------------------------------------------------------------------------------------------
# varlen_attention -> mate.flash_attn_varlen_func

# MATE's FMHA forward: bf16/fp16 (fp8 not supported), any head dim <= 512 (MATE docs/flash_attention.md).
_FMHA_DTYPES = (torch.bfloat16, torch.float16)
_FMHA_MAX_HEAD_DIM = 512


def varlen_attention_refusal(spec) -> str | None:
    if spec.dtype not in _FMHA_DTYPES:
        return f"MATE's flash_attn_varlen_func takes bf16/fp16 only, not {spec.dtype}"
    if spec.head_dim > _FMHA_MAX_HEAD_DIM:
        return f"MATE's flash_attn_varlen_func supports head dims <= {_FMHA_MAX_HEAD_DIM}, not {spec.head_dim}"
    if spec.extras:  # its causal mask is implicit (bottom-right), not against given query positions
        return f"the adapter passes MATE's flash_attn_varlen_func non-causal packs only ({spec.extras} asked)"
    return None


def varlen_attention_arguments(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, *_absent_extras) -> dict:
    """One pack is both the query and the key side (self-attention inside each segment), non-causal. MATE's
    varlen forward has no rotary input (its rotary applies to appended KV only), so the op's rotary embedding is
    applied first with the op's own definition."""
    if cos is not None:
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    max_seqlen = int(max_seqlen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                max_seqlen_k=max_seqlen, softmax_scale=float(sm_scale), causal=False)


def varlen_attention_result(out, q, *_rest) -> torch.Tensor:
    """flash_attn_varlen_func returns out [total_q, heads, head_dim_v] in q's dtype (without the lse unless
    asked): the op's result as it is."""
    _require_result(out, tuple(q.shape), q.dtype, "flash_attn_varlen_func")
    return out


def _call_varlen_attention(mate, *op_args):
    return varlen_attention_result(mate.flash_attn_varlen_func(**varlen_attention_arguments(*op_args)), *op_args)


# ---------------------------------------------------------------------------------------------------------
# sparse_attention -> mate.flashmla.flash_mla_sparse_fwd

# MATE's V3.2 sparse prefill kernel (mate/sparse_mla/tilelang/sparse_mla_v32_fwd_pipelined.py): bf16, one latent
# KV head, d_v = 512 plus a 64-wide rope tail, topk a multiple of its 64-row block, heads <= 64 (padded) or a
# multiple of 64.
_SPARSE_D_V, _SPARSE_D_QK, _SPARSE_TOPK_BLOCK, _SPARSE_HEAD_BLOCK = 512, 576, 64, 64


def sparse_attention_refusal(spec) -> str | None:
    if spec.dtype != torch.bfloat16:
        return f"MATE's flash_mla_sparse_fwd takes bf16 only, not {spec.dtype}"
    if not spec.shared_kv or spec.separate_v:
        return "MATE's flash_mla_sparse_fwd reads one latent KV head with V = K[..., :512] (MLA), not MHA or a v_cache"
    if spec.fp8_cache:
        return "MATE's flash_mla_sparse_fwd reads a bf16 latent cache, not the FP8 latent layout"
    if spec.extras:
        return f"MATE's flash_mla_sparse_fwd attends the selected positions only ({spec.extras} asked)"
    if (spec.d_qk, spec.d_v) != (_SPARSE_D_QK, _SPARSE_D_V):
        return (f"MATE's sparse MLA kernel is built for d_qk = {_SPARSE_D_QK} (512 + rope 64), d_v = {_SPARSE_D_V}; "
                f"got d_qk = {spec.d_qk}, d_v = {spec.d_v}")
    if spec.heads > _SPARSE_HEAD_BLOCK and spec.heads % _SPARSE_HEAD_BLOCK:
        return f"MATE's sparse MLA kernel needs <= 64 heads or a multiple of 64, got {spec.heads}"
    return None


def flat_kv_rows(block_table, seq_lens, query_seq, indices, page_size: int) -> torch.Tensor:
    """dzc's indices (positions in sequence query_seq[t], invalid: < 0 or >= its length) -> rows of the flattened
    cache [pages * page_size] (physical page * page_size + slot), -1 where invalid. int32 [queries, topk]."""
    sequences = query_seq.long()
    positions = indices.long()
    valid = (positions >= 0) & (positions < seq_lens.long()[sequences][:, None])
    positions = torch.where(valid, positions, 0)
    page_column = (positions // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[sequences[:, None], page_column]
    rows = pages * page_size + positions % page_size
    return torch.where(valid, rows, -1).to(torch.int32)


def sparse_attention_arguments(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale,
                               d_v, *_absent_extras) -> dict:
    """MATE takes the cache as flat rows kv [pages * page_size, 1, d_qk] and indices into those rows [queries, 1,
    topk] (-1 invalid); the top-k width is padded with -1 up to the kernel's 64-row block."""
    pages, page_size = k_cache.shape[:2]
    kv = k_cache.reshape(pages * page_size, 1, k_cache.shape[3]).contiguous()
    rows = flat_kv_rows(block_table, seq_lens, query_seq, indices, page_size)
    padded = -(-rows.shape[1] // _SPARSE_TOPK_BLOCK) * _SPARSE_TOPK_BLOCK
    rows = torch.nn.functional.pad(rows, (0, padded - rows.shape[1]), value=-1)
    return dict(q=q.contiguous(), kv=kv, indices=rows.unsqueeze(1).contiguous(), sm_scale=float(sm_scale),
                d_v=int(d_v))


def sparse_attention_result(outputs, q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale,
                            d_v, *_absent_extras) -> torch.Tensor:
    """flash_mla_sparse_fwd returns (out [queries, heads, d_v] bf16, max_logits, lse); a row with no valid index
    is 0 in MATE's kernel (its 1/sum is set to 0), as in the op."""
    out = outputs[0]
    _require_result(out, (q.shape[0], q.shape[1], int(d_v)), q.dtype, "flash_mla_sparse_fwd")
    return out


def _call_sparse_attention(mate, *op_args):
    from mate.flashmla import flash_mla_sparse_fwd

    return sparse_attention_result(flash_mla_sparse_fwd(**sparse_attention_arguments(*op_args)), *op_args)


# ---------------------------------------------------------------------------------------------------------
# dsa_indexer -> mate.deep_gemm.fp8_paged_mqa_logits

# MATE's paged MQA logits: FP8 q and the FP8 cache with an fp32 scale per token (values, then scales, per page:
# dzc's layout, dzc.kv_cache), index head dim 128, pages of 64 tokens ("block_kv must be 64 now"), 32 heads
# (MATE's test) or 64 (vLLM-MUSA's DeepSeek-V4 path).
_INDEXER_HEAD_DIM, _INDEXER_PAGE_SIZE, _INDEXER_HEADS = 128, 64, (32, 64)


def dsa_indexer_refusal(spec) -> str | None:
    if not spec.fp8 or spec.q_dtype != torch.float8_e4m3fn:
        return "MATE's fp8_paged_mqa_logits reads only FP8 queries and the FP8 key cache"
    if spec.head_dim != _INDEXER_HEAD_DIM:
        return f"MATE's fp8_paged_mqa_logits takes index head dim {_INDEXER_HEAD_DIM}, not {spec.head_dim}"
    if spec.heads not in _INDEXER_HEADS:
        return f"MATE's fp8_paged_mqa_logits is known to run {_INDEXER_HEADS} heads, not {spec.heads}"
    return None


def indexer_context_lens(seq_lens, query_seq, query_pos, max_context: int) -> torch.Tensor:
    """Keys each query row sees, as a count from position 0: min(query_pos + 1, its sequence length), at most
    max_context (the output width). int32 [queries]."""
    visible = torch.minimum(query_pos.long() + 1, seq_lens.long()[query_seq.long()])
    return visible.clamp(0, int(max_context)).to(torch.int32)


def dsa_indexer_arguments(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
                          max_context) -> dict:
    """Every query row is its own MATE batch entry with next_n = 1: q [queries, 1, heads, 128], its sequence's
    block-table row, context_lens = the keys it sees (MATE's 1-D layout: row i sees positions
    [0, context_lens[i] - 1]). The cache's bytes are MATE's fused layout already; only the view changes to
    [pages, 64, 1, 132]. clean_logits=False (vLLM-MUSA's setting): `dsa_indexer_result` writes the mask."""
    rows, heads, head_dim = q.shape
    page_bytes = head_dim + 4  # e4m3 values + one fp32 scale per token
    if index_k_cache.dim() != 2 or index_k_cache.shape[1] != _INDEXER_PAGE_SIZE * page_bytes:
        raise ValueError(f"MATE's fp8_paged_mqa_logits needs pages of {_INDEXER_PAGE_SIZE} tokens "
                         f"([pages, {_INDEXER_PAGE_SIZE * page_bytes}] bytes), got {list(index_k_cache.shape)}")
    return dict(q=q.reshape(rows, 1, heads, head_dim).contiguous(),
                fused_kv_cache=index_k_cache.contiguous().view(-1, _INDEXER_PAGE_SIZE, 1, page_bytes),
                weights=weights.contiguous(),
                context_lens=indexer_context_lens(seq_lens, query_seq, query_pos, max_context),
                block_table=block_table[query_seq.long()].contiguous(),
                max_context_len=int(max_context), clean_logits=False)


def dsa_indexer_result(logits, q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
                       max_context) -> torch.Tensor:
    """MATE's fp32 [queries, max_context_len] logits with the op's mask written: -inf wherever the row may not
    look (past its query position or its sequence), whatever MATE left there."""
    _require_result(logits, (q.shape[0], int(max_context)), torch.float32, "fp8_paged_mqa_logits")
    visible = indexer_context_lens(seq_lens, query_seq, query_pos, max_context)
    hidden = torch.arange(int(max_context), device=logits.device) >= visible[:, None]
    return logits.masked_fill_(hidden, float("-inf"))


def _call_dsa_indexer(mate, *op_args):
    from mate import deep_gemm

    arguments = dsa_indexer_arguments(*op_args)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(arguments["context_lens"], _INDEXER_PAGE_SIZE)
    logits = deep_gemm.fp8_paged_mqa_logits(
        arguments["q"], arguments["fused_kv_cache"], arguments["weights"], arguments["context_lens"],
        arguments["block_table"], schedule, arguments["max_context_len"], arguments["clean_logits"])
    return dsa_indexer_result(logits, *op_args)


# ---------------------------------------------------------------------------------------------------------


def _require_result(tensor, shape: tuple, dtype: torch.dtype, function: str) -> None:
    """MATE's output must be exactly the op's result; anything else is an error (the tuner skips the candidate)."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise RuntimeError(f"mate {function} returned {tensor.dtype} {list(tensor.shape)}; the dzc op's result is "
                           f"{dtype} {list(shape)}")


@dataclass(frozen=True)
class MateAdapter:
    name: str  # recorded in the tuning database
    refusal: Callable[[object], str | None]
    call: Callable[..., object]  # (mate module, *op arguments) -> the op's result


ADAPTERS: dict[str, MateAdapter] = {
    "varlen_attention": MateAdapter("mate.flash_attn_varlen_func", varlen_attention_refusal,
                                    _call_varlen_attention),
    "sparse_attention": MateAdapter("mate.flashmla.flash_mla_sparse_fwd", sparse_attention_refusal,
                                    _call_sparse_attention),
    "dsa_indexer": MateAdapter("mate.deep_gemm.fp8_paged_mqa_logits", dsa_indexer_refusal, _call_dsa_indexer),
}


def candidate_name(op: str, spec) -> str:
    """The recorded name: the MATE function, marked when dzc adds work around it (rotary before attention)."""
    name = ADAPTERS[op].name
    if op == "varlen_attention" and spec.rope:
        name += " (rotary applied by torch first)"
    return name


def candidates(op: str, spec, profile: DeviceProfile) -> list[ExternalCandidate]:
    """MATE's candidate for `op` with `spec` on `profile`: none where MATE has no kernel for the op, the arch or
    the spec, or is not installed (the reason is logged at INFO on logger dzc.mate)."""
    adapter = ADAPTERS.get(op)
    if adapter is None or profile.arch not in REQUIREMENTS:
        return []
    refusal = adapter.refusal(spec)
    if refusal:
        log.info("dzc: no MATE candidate for %s (%s): %s", op, spec.describe(), refusal)
        return []
    mate = _installed_mate(profile.arch)
    if mate is None:
        return []
    return [ExternalCandidate(candidate_name(op, spec), functools.partial(adapter.call, mate))]

