"""dzc.mxfp4_moe: a routed MoE layer's experts with MXFP4 weights, from routing to the weighted combine.

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])
    expert_e(x) = act(x @ W13[e]^T + b13[e]) @ W2[e]^T + b2[e]

W13 [E, 2I, H] and W2 [E, H, I] are MXFP4 (dzc.mxfp4 layout: blocks [E, N, K/32, 16], scales [E, N, K/32]).
Rounding points, which every kernel reproduces: the GEMMs, biases, the activation and the combine are fp32; the
activation's output is rounded to hidden's dtype before the down GEMM (kernels feed that GEMM in the activation
dtype); the sum over the k slots is fp32, cast to hidden's dtype once.

Activations (gate, up = the two halves of x @ W13^T + b13: rows 0::2 / 1::2 if gate_up_interleaved, else the
first / last I rows):
    "silu_glu":            silu(gate) * up                                  (alpha, limit unused)
    "gptoss_clamped_glu":  g = min(gate, limit); u = clamp(up, -limit, limit); g * sigmoid(alpha * g) * (u + 1)
"""

from __future__ import annotations

import torch

from dzc import mxfp4, runtime

ACTIVATIONS = ("silu_glu", "gptoss_clamped_glu")
HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                         w2_bias, activation: str) -> None:
    """Raise a ValueError naming the argument unless the arguments fit the op (shapes, dtypes, K % 32); works on
    fake tensors with symbolic token counts too."""
    if hidden.dim() != 2 or hidden.dtype not in HIDDEN_DTYPES:
        raise ValueError(f"mxfp4_moe: hidden must be [T, H] bf16/fp16/fp32, got {hidden.dtype} {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mxfp4_moe: topk_ids must be [T, k] int32/int64, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.dim() != 2 or not topk_weights.is_floating_point():
        raise ValueError(f"mxfp4_moe: topk_weights must be [T, k] floating, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    torch._check(topk_ids.shape[0] == hidden.shape[0], lambda: "mxfp4_moe: topk_ids and hidden differ in tokens")
    torch._check(topk_weights.shape[0] == topk_ids.shape[0] and topk_weights.shape[1] == topk_ids.shape[1],
                 lambda: "mxfp4_moe: topk_weights and topk_ids differ in shape")
    mxfp4.check_packed(w13_blocks, w13_scales, "mxfp4_moe: w13")
    mxfp4.check_packed(w2_blocks, w2_scales, "mxfp4_moe: w2")
    if w13_blocks.dim() != 4 or w2_blocks.dim() != 4:
        raise ValueError("mxfp4_moe: w13_blocks and w2_blocks must be [E, N, K/32, 16]")
    experts, two_i, h_blocks = w13_scales.shape
    hidden_size = hidden.shape[1]
    if h_blocks * mxfp4.BLOCK != hidden_size:
        raise ValueError(f"mxfp4_moe: w13 reduces over K = {h_blocks * mxfp4.BLOCK} but hidden has H = {hidden_size} "
                         f"(H must be a multiple of {mxfp4.BLOCK})")
    if two_i % 2:
        raise ValueError(f"mxfp4_moe: w13 has {two_i} rows, not gate + up halves")
    inter = two_i // 2
    if tuple(w2_scales.shape) != (experts, hidden_size, inter // mxfp4.BLOCK) or inter % mxfp4.BLOCK:
        raise ValueError(f"mxfp4_moe: w2 scales {tuple(w2_scales.shape)} do not fit E = {experts}, H = {hidden_size}, "
                         f"I = {inter} (expected [{experts}, {hidden_size}, {inter // mxfp4.BLOCK}], I a multiple "
                         f"of {mxfp4.BLOCK})")
    for name, bias, rows in (("w13_bias", w13_bias, two_i), ("w2_bias", w2_bias, hidden_size)):
        if bias is not None and (tuple(bias.shape) != (experts, rows) or not bias.is_floating_point()):
            raise ValueError(f"mxfp4_moe: {name} must be [{experts}, {rows}] floating, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"mxfp4_moe: activation {activation!r} is not one of {ACTIVATIONS}")


def glu_activation(gate_up: torch.Tensor, activation: str, gate_up_interleaved: bool, alpha: float,
                   limit: float) -> torch.Tensor:
    """The op's activation on fp32 [*, 2I] -> fp32 [*, I] (see the module docstring)."""
    if gate_up_interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu_glu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def mxfp4_moe_reference(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                        w2_bias, activation: str, gate_up_interleaved: bool, alpha: float,
                        limit: float) -> torch.Tensor:
    """The meaning of dzc.mxfp4_moe, in plain torch (one expert at a time, weights dequantized to fp32)."""
    check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                         w2_bias, activation)
    experts = w13_blocks.shape[0]
    ids = topk_ids.long()
    outside = (ids < 0) | (ids >= experts)
    if outside.any():
        raise ValueError(f"mxfp4_moe: topk_ids has expert ids outside [0, {experts}): "
                         f"{sorted(set(ids[outside].tolist()))[:8]}")
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in ids.unique().tolist():
        tokens, slots = torch.where(ids == e)
        gate_up = x[tokens] @ mxfp4.dequantize(w13_blocks[e], w13_scales[e], torch.float32).T
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        act = glu_activation(gate_up, activation, gate_up_interleaved, alpha, limit).to(hidden.dtype).float()
        y = act @ mxfp4.dequantize(w2_blocks[e], w2_scales[e], torch.float32).T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


@torch.library.custom_op("dzc::mxfp4_moe", mutates_args=())
def mxfp4_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    activation: str,
    gate_up_interleaved: bool,
    alpha: float,
    limit: float,
    kernel_id: str = "",
) -> torch.Tensor:
    if kernel_id:
        return runtime.launch(kernel_id, hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
                              w2_scales, w2_bias, activation, gate_up_interleaved, alpha, limit)
    return mxfp4_moe_reference(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
                               w2_scales, w2_bias, activation, gate_up_interleaved, alpha, limit)


@mxfp4_moe.register_fake
def _mxfp4_moe_fake(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
                    activation, gate_up_interleaved, alpha, limit, kernel_id=""):
    check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                         w2_bias, activation)
    return torch.empty_like(hidden)
