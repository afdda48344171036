"""dzc.varlen_attention: attention over a pack of variable-length segments: non-causal (the images of a request,
or the windows inside them, in a vision encoder, with the vision encoders' 2D rotary embedding optionally applied
to q and k first), or causal against given query positions with an optional local window and per-head attention
sinks (text decoders' sliding-window and sink attention), with grouped KV heads and key segments of their own
(a KV cache longer than the queries)."""

from __future__ import annotations

import torch

from dzc import runtime

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_varlen_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_seqlen, cos: torch.Tensor | None, sin: torch.Tensor | None,
                                cu_seqlens_k: torch.Tensor | None = None, query_pos: torch.Tensor | None = None,
                                window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """Shapes, dtypes and devices of dzc.varlen_attention's arguments (works on fake tensors: reads no data).

    Raises ValueError naming the argument that is wrong. The values of cu_seqlens are checked by
    `check_cu_seqlens_values`, which has to read them.
    """
    if q.dim() != 3:
        raise ValueError(f"varlen_attention: q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    own_keys = cu_seqlens_k is not None
    if k.dim() != 3 or (not own_keys and k.shape[0] != q.shape[0]) or k.shape[2] != q.shape[2] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: k has shape {tuple(k.shape)}, q has {tuple(q.shape)} (k: q's tokens "
                         f"unless cu_seqlens_k is given, heads dividing q's, q's head_dim)")
    if v.shape != k.shape:
        raise ValueError(f"varlen_attention: v has shape {tuple(v.shape)}, k has {tuple(k.shape)} (v must match k)")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise ValueError(f"varlen_attention: {name} is {tensor.dtype}, q is {q.dtype}")
    if own_keys and (cu_seqlens_k.dim() != 1 or cu_seqlens_k.dtype != torch.int32
                     or cu_seqlens_k.shape[0] != cu_seqlens.shape[0]):
        raise ValueError(f"varlen_attention: cu_seqlens_k must be int32 like cu_seqlens [{cu_seqlens.shape[0]}], got "
                         f"{cu_seqlens_k.dtype} of shape {tuple(cu_seqlens_k.shape)}")
    if query_pos is not None and (query_pos.dim() != 1 or query_pos.dtype != torch.int32
                                  or query_pos.shape[0] != q.shape[0]):
        raise ValueError(f"varlen_attention: query_pos must be int32 [tokens={q.shape[0]}], got {query_pos.dtype} "
                         f"of shape {tuple(query_pos.shape)}")
    if window < 0 or (window and query_pos is None):
        raise ValueError(f"varlen_attention: window must be >= 0 and needs query_pos (it ends at the query's "
                         f"position), got window={window}")
    if sinks is not None and (sinks.dim() != 1 or sinks.dtype != torch.float32 or sinks.shape[0] != q.shape[1]):
        raise ValueError(f"varlen_attention: sinks must be fp32 [heads={q.shape[1]}], got {sinks.dtype} of shape "
                         f"{tuple(sinks.shape)}")
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
    if cos is not None and (own_keys or k.shape[1] != q.shape[1]):
        raise ValueError("varlen_attention: the rotary embedding takes q and k of the same tokens and heads")
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
                               sin: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                               query_pos: torch.Tensor | None = None, window: int = 0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out[s:e] = softmax(q[s:e] k[sk:ek]^T * sm_scale) v[sk:ek] per segment i: queries [s, e) of cu_seqlens, keys
    [sk, ek) of cu_seqlens_k (cu_seqlens when None), per head; k and v may have fewer heads (grouped: query head
    h reads KV head h // (heads / kv_heads)).

    Without query_pos every query of a segment sees all its keys (non-causal). With query_pos (int32 [tokens], a
    query's position among its segment's keys) key j is visible iff j <= query_pos (causal), and with window > 0
    also j > query_pos - window (a local window of `window` keys). sinks (fp32 [heads]): a per-head logit that
    joins each softmax's denominator and carries no value (compared with the scaled scores). A query that sees no
    key is 0. The rotary embedding (if cos/sin are given) is applied to q and k first and rounded to q's dtype, as
    HF's `apply_rotary_pos_emb_vision` does; the attention itself is computed in fp32 and rounded once to q's
    dtype. Tokens of one segment never see another segment's tokens.
    """
    check_varlen_attention_args(q, k, v, cu_seqlens, max_seqlen, cos, sin, cu_seqlens_k, query_pos, window, sinks)
    check_cu_seqlens_values(cu_seqlens, q.shape[0], max_seqlen)
    if cu_seqlens_k is not None:
        check_cu_seqlens_values(cu_seqlens_k, k.shape[0], k.shape[0])
    if cos is not None:
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bounds = cu_seqlens.tolist()
    key_bounds = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    for (start, end), (key_start, key_end) in zip(zip(bounds[:-1], bounds[1:]), zip(key_bounds[:-1], key_bounds[1:])):
        qs = q[start:end].float().transpose(0, 1)  # [heads, len, head_dim]
        ks, vs = (t[key_start:key_end].float().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        scores = qs @ ks.transpose(1, 2) * sm_scale
        sees_a_key = True
        if query_pos is not None:
            keys = torch.arange(key_end - key_start, device=q.device)
            positions = query_pos[start:end].long()[:, None]
            visible = (keys <= positions) & ((keys > positions - window) if window else True)
            scores = scores.masked_fill(~visible, float("-inf"))
            sees_a_key = visible.any(dim=-1, keepdim=True)
        if sinks is not None:
            column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:  # a query that sees no key is 0 (its softmax over -inf alone is NaN); NaN inputs stay NaN
            probs = torch.softmax(scores, dim=-1)
            probs = probs if sees_a_key is True else torch.where(sees_a_key, probs, 0.0)
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
    cu_seqlens_k: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    kernel_id: str = "",
) -> torch.Tensor:
    args = (q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k, query_pos, window, sinks)
    if kernel_id:
        return runtime.launch(kernel_id, *args)
    return varlen_attention_reference(*args)


@varlen_attention.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k=None, query_pos=None,
                           window=0, sinks=None, kernel_id=""):
    check_varlen_attention_args(q, k, v, cu_seqlens, max_seqlen, cos, sin, cu_seqlens_k, query_pos, window, sinks)
    return q.new_empty(q.shape)
