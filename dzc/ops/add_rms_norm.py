"""dzc.add_rms_norm: the residual add of one layer fused with the RMSNorm that opens the next."""

from __future__ import annotations

import torch

from dzc import runtime


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    compute_dtype: torch.dtype = torch.float32,
    divide_by_rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; y = rms_norm(h) * weight, with the rounding points model code uses.

    sum_in_fp32: the norm reads the fp32 sum (DeepSeek: `x.float() + residual.float()`) instead of the sum
        rounded to `sum_dtype` (HF: the add runs in the activations' dtype, the norm upcasts its result).
    cast_before_weight: the normalised value is rounded to sum_dtype (the norm's input dtype) before the weight
        multiply (HF Llama: `weight * hidden.to(input_dtype)`), instead of multiplying in fp32 (torch.nn.RMSNorm,
        DeepSeek, Gemma's `x * (1 + w)`).
    weight: None for a norm without one (y is the normalised value, rounded once to out_dtype). Whatever the
        graph computes as the weight (Gemma's `1 + w` in fp32) is passed as computed.
    compute_dtype: the dtype every step of the norm (square, mean, + eps, rsqrt, the multiply) rounds to: fp32
        where the model upcasts, the activations' dtype where it computes the norm in bf16/fp16 without upcasting.
    divide_by_rms: `v / sqrt(mean + eps)` instead of `v * rsqrt(mean + eps)` (the same value, rounded elsewhere).
    The product with the weight is rounded once, to out_dtype (the operands' product in fp32, as eager computes a
    bf16 or mixed-dtype multiply). Returns (y in out_dtype, h in sum_dtype).
    """
    total = x.float() + residual.float()
    h = total.to(sum_dtype)
    v = (total if sum_in_fp32 else h).to(compute_dtype)
    mean_square = v.pow(2).mean(-1, keepdim=True) + eps
    normed = v / torch.sqrt(mean_square) if divide_by_rms else v * torch.rsqrt(mean_square)
    if cast_before_weight:
        normed = normed.to(sum_dtype)
    y = normed.float() if weight is None else normed.float() * weight.float()
    return y.to(out_dtype), h


@torch.library.custom_op("dzc::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    compute_dtype: torch.dtype = torch.float32,
    divide_by_rms: bool = False,
    kernel_id: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype, compute_dtype,
            divide_by_rms)
    if kernel_id:
        return runtime.launch(kernel_id, *args)
    return add_rms_norm_reference(*args)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype,
                       compute_dtype=torch.float32, divide_by_rms=False, kernel_id=""):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(shape, dtype=sum_dtype)
