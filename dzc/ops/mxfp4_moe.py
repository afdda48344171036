"""dzc.mxfp4_moe: a routed MoE layer's experts with MXFP4 weights, from routing to the weighted combine.

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])
    expert_e(x) = act(x @ W13[e]^T + b13[e]) @ W2[e]^T + b2[e]

W13 [E, 2I, H] and W2 [E, H, I] are MXFP4 (dzc.mxfp4 layout: blocks [E, N, K/32, 16], scales [E, N, K/32]).
Rounding points, which every kernel reproduces: the GEMMs, biases, the activation and the combine are fp32; the
activation's output is rounded to hidden's dtype before the down GEMM (kernels feed that GEMM in the activation
dtype); the sum over the k slots is fp32, cast to hidden's dtype once.

dzc.mxfp4_moe_w4a8 is the same layer with both GEMMs multiplying FP8 (E4M3) operands (W4A8), for profiles with
native FP8, on calls with at least FP8_MIN_ROWS_PER_EXPERT (token, slot) rows per expert on average (prefill);
below that (decode) it is dzc.mxfp4_moe itself: there the weights are the bytes, converting them per call made W4A8
6.7x slower than W4A16 at 64 tokens of gpt-oss-120b on the H200 (2026-12-01), and W4A16 is the closer of the two
to the model. Its rounding points where FP8 applies, on top of the above:
    activations (hidden, and the activation output after its rounding to hidden's dtype) are quantized in groups
        of FP8_GROUP consecutive columns per row (the last group of a row may be shorter): one power-of-two scale
        2^k per group, the smallest with amax <= 448 * 2^k and k >= -126 (1 for an all-zero group, NaN if amax
        is not finite), values rounded to E4M3 to nearest even;
    weights: each E2M1 element times 2^(s - s_ref), rounded to E4M3 to nearest even, where s is its 32-element
        group's E8M0 exponent and s_ref the largest exponent among the groups of its FP8_GROUP-column block (so
        the block's largest groups convert exactly and only elements over 2^8 below the block's largest lose
        bits); the block scale 2^(s_ref - 127) multiplies the block's product. Scale byte 0 counts as 1 (2^-126),
        as the W4A16 kernels read it; a NaN scale (0xFF) makes its block scale NaN.
    Each GEMM is then a sum over FP8_GROUP-column blocks of exact fp8 products times the two scales, in fp32.

Activations (gate, up = the two halves of x @ W13^T + b13: rows 0::2 / 1::2 if gate_up_interleaved, else the
first / last I rows):
    "silu_glu":            silu(gate) * up                                  (alpha, limit unused)
    "clamped_swiglu":  g = min(gate, limit); u = clamp(up, -limit, limit); g * sigmoid(alpha * g) * (u + 1)
"""

from __future__ import annotations

import torch

from dzc import mxfp4, runtime

ACTIVATIONS = ("silu_glu", "clamped_swiglu")
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
    return _reference_layer(_dequantized_matmul, hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias,
                            w2_blocks, w2_scales, w2_bias, activation, gate_up_interleaved, alpha, limit)


def _dequantized_matmul(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W4A16's GEMM: fp32 rows a [R, K] times one MXFP4 weight [N, K] dequantized to fp32, transposed."""
    return a @ mxfp4.dequantize(blocks, scales, torch.float32).T


def _reference_layer(matmul, hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                     w2_bias, activation: str, gate_up_interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """The MoE layer both ops share, one expert at a time, with `matmul(fp32 rows, blocks, scales)` as its two
    GEMMs: the ops differ only there."""
    check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                         w2_bias, activation)
    ids = topk_ids.long()
    _check_expert_ids(ids, w13_blocks.shape[0])
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in ids.unique().tolist():
        tokens, slots = torch.where(ids == e)
        gate_up = matmul(x[tokens], w13_blocks[e], w13_scales[e])
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        act = glu_activation(gate_up, activation, gate_up_interleaved, alpha, limit).to(hidden.dtype).float()
        y = matmul(act, w2_blocks[e], w2_scales[e])
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


# ---------------------------------------------------------------------------------------------------------
# W4A8

FP8_GROUP = 128  # columns per activation scale and per weight block scale (the reduction step of the FP8 GEMMs)
# Average rows per expert from which dzc.mxfp4_moe_w4a8 multiplies FP8 operands: where W4A16's kernels switch from
# decoding weights in the GEMM to converting them once per call (targets/mxfp4_moe.py), as W4A8 always must.
FP8_MIN_ROWS_PER_EXPERT = 128


def fp8_applies(tokens: int, top_k: int, experts: int) -> bool:
    """Whether dzc.mxfp4_moe_w4a8 quantizes a call of `tokens` tokens (module docstring)."""
    return tokens * top_k >= FP8_MIN_ROWS_PER_EXPERT * experts


def _columns_in_groups(x: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, ceil(K / FP8_GROUP), FP8_GROUP], zero-padded at the end of each row."""
    pad = -x.shape[-1] % FP8_GROUP
    return torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, FP8_GROUP)


def quantize_e4m3_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, K] -> (E4M3 values as fp32 [R, K], power-of-two scales fp32 [R, ceil(K / FP8_GROUP)]), as
    dzc.mxfp4_moe_w4a8 quantizes its activations (module docstring); x ~ values * scales per group."""
    groups = _columns_in_groups(x.float())
    amax = groups.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # 448 = 1.75 * 2^8: the smallest k with amax <= 448 * 2^k, at least -126 (scales stay normal fp32 numbers).
    k = (exponent - 9 + (mantissa > 0.875).int()).clamp(min=-126)
    scales = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), k), torch.ones_like(amax))
    scales = torch.where(amax.isfinite(), scales, float("nan"))
    values = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).float()
    return values.reshape(*x.shape[:-1], -1)[..., :x.shape[-1]], scales


def mxfp4_to_e4m3(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP4 weight (blocks u8 [N, K/32, 16], scales u8 [N, K/32]) -> (E4M3 values as fp32 [N, K], block
    scales fp32 [N, ceil(K / FP8_GROUP)]), as dzc.mxfp4_moe_w4a8 converts its weights (module docstring)."""
    exponents = scales.int().clamp(min=1)
    per_block = FP8_GROUP // mxfp4.BLOCK
    padded = torch.nn.functional.pad(exponents, (0, -exponents.shape[-1] % per_block))
    reference = padded.reshape(*exponents.shape[:-1], -1, per_block).amax(dim=-1)
    relative = exponents - reference.repeat_interleave(per_block, dim=-1)[..., :exponents.shape[-1]]
    # 2^relative as an E8M0 byte (127 + relative, at least 1: anything 2^-126 or smaller rounds to zero in E4M3).
    elements = mxfp4.dequantize(blocks, (127 + relative).clamp(min=1).to(torch.uint8), torch.float32)
    values = elements.to(torch.float8_e4m3fn).float()
    block_scales = torch.ldexp(torch.ones_like(reference, dtype=torch.float32), reference - 127)
    nan_blocks = torch.nn.functional.pad(scales == 0xFF, (0, -scales.shape[-1] % per_block)).reshape(
        *scales.shape[:-1], -1, per_block).any(dim=-1)
    return values, torch.where(nan_blocks, float("nan"), block_scales)


def _fp8_matmul(a_values, a_scales, w_values, w_scales) -> torch.Tensor:
    """sum over FP8_GROUP-column blocks b of (a_values[:, b] @ w_values[:, b]^T) * a_scales[:, b] * w_scales[:, b],
    in fp32 (a product of two E4M3 values is exact in fp32; only the sums round)."""
    a, w = _columns_in_groups(a_values), _columns_in_groups(w_values)  # [R, B, G], [N, B, G]
    partial = torch.einsum("rbg,nbg->brn", a, w)
    return (partial * a_scales.T.unsqueeze(-1) * w_scales.T.unsqueeze(1)).sum(dim=0)


def _fp8_weight_matmul(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W4A8's GEMM: fp32 rows a [R, K] quantized to E4M3 groups (per row, so any subset of rows quantizes alike)
    times one MXFP4 weight converted to E4M3 blocks."""
    return _fp8_matmul(*quantize_e4m3_groups(a), *mxfp4_to_e4m3(blocks, scales))


def mxfp4_moe_w4a8_reference(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
                             w2_scales, w2_bias, activation: str, gate_up_interleaved: bool, alpha: float,
                             limit: float) -> torch.Tensor:
    """The meaning of dzc.mxfp4_moe_w4a8, in plain torch (one expert at a time): W4A8 where fp8_applies, else
    dzc.mxfp4_moe's."""
    fp8 = fp8_applies(hidden.shape[0], topk_ids.shape[1], w13_blocks.shape[0])
    return _reference_layer(_fp8_weight_matmul if fp8 else _dequantized_matmul, hidden, topk_ids, topk_weights,
                            w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, activation,
                            gate_up_interleaved, alpha, limit)


def _check_expert_ids(ids: torch.Tensor, experts: int) -> None:
    outside = (ids < 0) | (ids >= experts)
    if outside.any():
        raise ValueError(f"mxfp4_moe: topk_ids has expert ids outside [0, {experts}): "
                         f"{sorted(set(ids[outside].tolist()))[:8]}")


def _moe_op(name: str, reference):
    """A custom op dzc::`name` with the MoE layer's arguments (+ kernel_id): the bound kernel, else `reference`."""

    def op(
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
        arguments = (hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
                     activation, gate_up_interleaved, alpha, limit)
        if kernel_id:
            return runtime.launch(kernel_id, *arguments)
        return reference(*arguments)

    def fake(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
             activation, gate_up_interleaved, alpha, limit, kernel_id=""):
        check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
                             w2_scales, w2_bias, activation)
        return torch.empty_like(hidden)

    op.__name__ = op.__qualname__ = name
    custom = torch.library.custom_op(f"dzc::{name}", op, mutates_args=())
    custom.register_fake(fake)
    return custom


mxfp4_moe = _moe_op("mxfp4_moe", mxfp4_moe_reference)
mxfp4_moe_w4a8 = _moe_op("mxfp4_moe_w4a8", mxfp4_moe_w4a8_reference)
