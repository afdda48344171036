"""dzc.add_rms_norm: the residual add of one layer fused with the RMSNorm that opens the next."""

from __future__ import annotations

import torch

from dzc import runtime


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; y = rms_norm(h) * weight, with the rounding points model code uses.

    sum_in_fp32: the norm reads the fp32 sum (DeepSeek: `x.float() + residual.float()`) instead of the sum
        rounded to `sum_dtype` (HF: the add runs in the activations' dtype, the norm upcasts its result).
    cast_before_weight: the normalised value is rounded to sum_dtype (the norm's input dtype) before the weight
        multiply (HF Llama: `weight * hidden.to(input_dtype)`), instead of multiplying in fp32 (torch.nn.RMSNorm,
        DeepSeek).
    Returns (y in out_dtype, h in sum_dtype).
    """
    total = x.float() + residual.float()
    h = total.to(sum_dtype)
    normed_input = total if sum_in_fp32 else h.float()
    normed = normed_input * torch.rsqrt(normed_input.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        normed = normed.to(sum_dtype).float()
    y = (normed * weight.float()).to(out_dtype)
    return y, h


@torch.library.custom_op("dzc::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    kernel_id: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_id:
        return runtime.launch(kernel_id, x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype,
                              sum_dtype)
    return add_rms_norm_reference(x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype, kernel_id=""):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(shape, dtype=sum_dtype)
