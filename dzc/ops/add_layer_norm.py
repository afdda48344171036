"""dzc.add_layer_norm: the residual add of one block fused with the LayerNorm that opens the next (vision encoders:
SigLIP / MoonViT blocks, patch mergers)."""

from __future__ import annotations

import torch

from dzc import runtime


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; y = (h - mean(h)) * rsqrt(var(h) + eps) * weight + bias over the last dim (biased var).

    As torch.nn.LayerNorm computes it once captured: statistics, normalisation, weight and bias in fp32, one
    rounding to out_dtype at the end. sum_in_fp32: the norm reads the fp32 sum instead of the sum rounded to
    sum_dtype (the residual stream's dtype). weight / bias None: elementwise_affine=False / bias=False.
    Returns (y in out_dtype, h in sum_dtype).
    """
    total = x.float() + residual.float()
    h = total.to(sum_dtype)
    normed_input = total if sum_in_fp32 else h.float()
    var, mean = torch.var_mean(normed_input, dim=-1, correction=0, keepdim=True)
    y = (normed_input - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype), h


@torch.library.custom_op("dzc::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    kernel_id: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_id:
        return runtime.launch(kernel_id, x, residual, weight, bias, eps, sum_in_fp32, out_dtype, sum_dtype)
    return add_layer_norm_reference(x, residual, weight, bias, eps, sum_in_fp32, out_dtype, sum_dtype)


@add_layer_norm.register_fake
def _add_layer_norm_fake(x, residual, weight, bias, eps, sum_in_fp32, out_dtype, sum_dtype, kernel_id=""):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(shape, dtype=sum_dtype)
