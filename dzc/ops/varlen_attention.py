"""dzc.varlen_attention: non-causal attention over a pack of variable-length segments (the images of a request, or
the windows inside them, in a vision encoder), with the vision encoders' 2D rotary embedding optionally applied
to q and k first."""

from __future__ import annotations

import torch

from dzc import runtime

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_varlen_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_seqlen, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of dzc.varlen_attention's arguments (works on fake tensors: reads no data).

    Raises ValueError naming the argument that is wrong. The values of cu_seqlens are checked by
    `check_cu_seqlens_values`, which has to read them.
    """
    if q.dim() != 3:
        raise ValueError(f"varlen_attention: q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.shape != q.shape:
            raise ValueError(f"varlen_attention: {name} has shape {tuple(tensor.shape)}, q has {tuple(q.shape)} "
                             f"(k and v must match q: no grouped heads)")
        if tensor.dtype != q.dtype:
            raise ValueError(f"varlen_attention: {name} is {tensor.dtype}, q is {q.dtype}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"varlen_attention: q is {q.dtype}; supported: float32, float16, bfloat16")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"varlen_attention: cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} of "
                         f"shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("varlen_attention: cu_seqlens needs at least 2 entries (one segment)")
    for name, tensor in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if tensor.device != q.device:
            raise ValueError(f"varlen_attention: {name} is on {tensor.device}, q on {q.device}")
    if not isinstance(max_seqlen, (int, torch.SymInt)):
        raise ValueError(f"varlen_attention: max_seqlen must be an int, got {type(max_seqlen).__name__}")
    if (cos is None) != (sin is None):
        raise ValueError("varlen_attention: cos and sin must be given together")
    if cos is not None:
        if q.shape[-1] % 2:
            raise ValueError(f"varlen_attention: the rotary embedding needs an even head_dim, got {q.shape[-1]}")
        for name, tensor in (("cos", cos), ("sin", sin)):
            if tensor.dim() != 2 or tensor.shape[0] != q.shape[0] or tensor.shape[1] != q.shape[2]:
                raise ValueError(f"varlen_attention: {name} must be [tokens, head_dim] = "
                                 f"[{q.shape[0]}, {q.shape[2]}], got {tuple(tensor.shape)}")
            if tensor.dtype not in _FLOAT_DTYPES or tensor.device != q.device:
                raise ValueError(f"varlen_attention: {name} must be a floating tensor on {q.device}, got "
                                 f"{tensor.dtype} on {tensor.device}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, tokens: int, max_seqlen: int) -> None:
    """cu_seqlens starts at 0, never decreases, ends at `tokens`, and no segment is longer than max_seqlen.

    Reads cu_seqlens (a device sync on a GPU): the reference always checks; kernels may skip it.
    """
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"varlen_attention: cu_seqlens must run from 0 to the token count {tokens}, "
                         f"got {bounds[0]} .. {bounds[-1]}")
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if min(lengths) < 0:
        raise ValueError(f"varlen_attention: cu_seqlens decreases: {bounds}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"varlen_attention: a segment has {max(lengths)} tokens, more than max_seqlen={max_seqlen}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (HF's vision rotary convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]. Computed in fp32, rounded back to x's dtype."""
    x32 = x.float()
    cos32, sin32 = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
    return (x32 * cos32 + rotate_half(x32) * sin32).to(x.dtype)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, sm_scale: float, cos: torch.Tensor | None = None,
                               sin: torch.Tensor | None = None) -> torch.Tensor:
    """out[s:e] = softmax(q[s:e] k[s:e]^T * sm_scale) v[s:e] per segment [s, e) of cu_seqlens, per head.

    The rotary embedding (if cos/sin are given) is applied to q and k first and rounded to q's dtype, as HF's
    `apply_rotary_pos_emb_vision` does; the attention itself is computed in fp32 and rounded once to q's dtype.
    Tokens of one segment never see another segment's tokens (non-causal inside a segment).
    """
    check_varlen_attention_args(q, k, v, cu_seqlens, max_seqlen, cos, sin)
    check_cu_seqlens_values(cu_seqlens, q.shape[0], max_seqlen)
    if cos is not None:
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))  # [heads, len, head_dim]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * sm_scale, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


@torch.library.custom_op("dzc::varlen_attention", mutates_args=())
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    sm_scale: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    kernel_id: str = "",
) -> torch.Tensor:
    if kernel_id:
        return runtime.launch(kernel_id, q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin)
    return varlen_attention_reference(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin)


@varlen_attention.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, kernel_id=""):
    check_varlen_attention_args(q, k, v, cu_seqlens, max_seqlen, cos, sin)
    return q.new_empty(q.shape)
