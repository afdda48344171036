"""Kernels for dzc.add_layer_norm: the spec a node lowers to, and per codegen its source, config space and launch.

The op is add_rms_norm's twin for LayerNorm (vision encoders): memory-bound (8·T·H bytes for bf16), one program
holds ROWS whole rows of HIDDEN elements in fp32 registers, so the statistics take two passes over registers and
one over memory: the mean, then the variance of the centred values (no E[x²] - E[x]² cancellation). The row
layout is add_rms_norm's, so the config spaces, defaults and shared-memory estimates are imported from there
(each program's cross-warp reductions reuse one scratch buffer: two reductions need no more than one).
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template

import torch

# The family's config spaces, defaults, shared-memory estimates and token buckets are add_rms_norm's (same rows
# in registers, same reductions); importing them here makes them this family's too.
from dzc.targets.add_rms_norm import (
    TEMPLATES,
    TILELANG_DTYPES,
    TL_DTYPES,
    residual_rows,
    tilelang_configs,
    tilelang_default_config,
    tilelang_shared_memory_bytes,
    tilelang_vector,
    token_bucket,
    triton_configs,
    triton_default_config,
    triton_shared_memory_bytes,
)
from dzc.targets import tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.profiles import DeviceProfile

__all__ = [
    "AddLayerNormSpec", "spec_from_node", "bytes_moved", "token_bucket", "prepare",
    "TRITON_KERNEL_NAME", "triton_source", "triton_configs", "triton_default_config", "triton_shared_memory_bytes",
    "triton_launch", "triton_signature",
    "TILELANG_FACTORY_NAME", "tilelang_source", "tilelang_configs", "tilelang_default_config",
    "tilelang_shared_memory_bytes", "tilelang_launch", "selftest_cases",
]


@dataclass(frozen=True)
class AddLayerNormSpec:
    """Everything a kernel is specialised on; the token count and eps are run-time arguments.

    weight_dtype / bias_dtype None: the LayerNorm has no weight (elementwise_affine=False) / no bias (bias=False),
    and the kernel neither takes nor reads one.
    """

    hidden: int
    x_dtype: torch.dtype
    residual_dtype: torch.dtype
    weight_dtype: torch.dtype | None
    bias_dtype: torch.dtype | None
    out_dtype: torch.dtype
    sum_dtype: torch.dtype
    sum_in_fp32: bool

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of every tensor the kernel reads or writes."""
        return tuple(d for d in (self.x_dtype, self.residual_dtype, self.weight_dtype, self.bias_dtype,
                                 self.out_dtype, self.sum_dtype) if d is not None)

    @property
    def block(self) -> int:
        return 1 << (self.hidden - 1).bit_length()

    def describe(self) -> str:
        names = "/".join(str(d).removeprefix("torch.") for d in (self.x_dtype, self.residual_dtype,
                                                                 self.weight_dtype, self.bias_dtype,
                                                                 self.out_dtype, self.sum_dtype))
        return f"hidden={self.hidden} x/res/w/b/y/h={names} sum_in_fp32={self.sum_in_fp32}"


def spec_from_node(node) -> AddLayerNormSpec:
    x, residual = (node.args[i].meta["val"] for i in range(2))
    weight, bias = (node.args[i].meta["val"] if node.args[i] is not None else None for i in (2, 3))
    _eps, sum_in_fp32, out_dtype, sum_dtype = node.args[4:8]
    return AddLayerNormSpec(int(x.shape[-1]), x.dtype, residual.dtype,
                            weight.dtype if weight is not None else None, bias.dtype if bias is not None else None,
                            out_dtype, sum_dtype, sum_in_fp32)


def bytes_moved(spec: AddLayerNormSpec, tokens: int) -> int:
    """Fewest bytes one call must move: read x, residual, weight and bias once, write y and h once."""
    per_row = sum(d.itemsize for d in (spec.x_dtype, spec.residual_dtype, spec.out_dtype, spec.sum_dtype))
    affine = sum(d.itemsize for d in (spec.weight_dtype, spec.bias_dtype) if d is not None)
    return tokens * spec.hidden * per_row + spec.hidden * affine


def prepare(spec: AddLayerNormSpec, x, residual, weight, bias, eps, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), token count, the op's results).

    The kernel writes 2-D views of the results, so nothing is copied after the launch. An absent weight or bias
    stays None: the kernel was generated without it. The op's static arguments (_static: flags and dtypes) are
    already in the spec the kernel was built for."""
    shape = x.shape
    for name, tensor, dtype in (("weight", weight, spec.weight_dtype), ("bias", bias, spec.bias_dtype)):
        if (tensor is None) != (dtype is None) or (tensor is not None and tensor.shape != (spec.hidden,)):
            raise ValueError(f"add_layer_norm kernel for {spec.describe()} got {name} "
                             f"{None if tensor is None else tuple(tensor.shape)}")
    if residual.shape != shape or shape[-1] != spec.hidden:
        raise ValueError(f"add_layer_norm kernel for hidden={spec.hidden} got x {tuple(shape)}, residual "
                         f"{tuple(residual.shape)}")
    x2d, residual2d, y, h, y2d, h2d = residual_rows(spec.hidden, spec.out_dtype, spec.sum_dtype, x, residual)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return (x2d, residual2d, weight, bias, eps), (y2d, h2d), x2d.shape[0], (y, h)


# ---------------------------------------------------------------------------------------------------------
# Triton


TRITON_KERNEL_NAME = "add_layer_norm_kernel"


def _triton_affine(spec: AddLayerNormSpec) -> str:
    """The weight multiply and bias add of the generated kernel (absent parameters are not read at all)."""
    lines = []
    if spec.weight_dtype is not None:
        lines.append("    y = y * tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)")
    if spec.bias_dtype is not None:
        lines.append("    y = y + tl.load(bias_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)")
    if not lines:
        lines.append("    # No weight, no bias (elementwise_affine=False): weight_ptr and bias_ptr are None.")
    elif len(lines) == 1:
        lines.append(f"    # No {'bias' if spec.bias_dtype is None else 'weight'}: its pointer is None.")
    return "\n".join(lines)


def triton_source(spec: AddLayerNormSpec, profile: DeviceProfile) -> str:
    fields = dict(
        profile=profile.name, hidden=spec.hidden,
        x_dtype=spec.x_dtype, residual_dtype=spec.residual_dtype, weight_dtype=spec.weight_dtype,
        bias_dtype=spec.bias_dtype, out_dtype=spec.out_dtype, sum_dtype=spec.sum_dtype, sum_in_fp32=spec.sum_in_fp32,
        sum_tl_dtype=TL_DTYPES[spec.sum_dtype], out_tl_dtype=TL_DTYPES[spec.out_dtype],
        # The norm reads the fp32 sum, or the sum as rounded into h (what the model code computes).
        normed_input="total" if spec.sum_in_fp32 else "h.to(tl.float32)",
        affine=_triton_affine(spec),
    )
    return Template((TEMPLATES / "add_layer_norm.triton.py.tmpl").read_text()).substitute(fields)


def triton_launch(kernel, config: KernelConfig, x, residual, weight, bias, eps, y, h):
    """Launch on 2-D views [tokens, hidden]; y and h are preallocated outputs; weight / bias may be None."""
    rows = config["ROWS"]
    n_rows = x.shape[0]
    grid = (-(-n_rows // rows),)
    kernel[grid](x, residual, weight, bias, y, h, n_rows, eps,
                 x.stride(0), residual.stride(0), y.stride(0), h.stride(0),
                 ROWS=rows, BLOCK=config["BLOCK"], num_warps=config.num_warps, num_stages=config.num_stages)


def triton_signature(spec: AddLayerNormSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed).

    An absent weight or bias is a None argument, which Triton specialises as a constexpr."""
    tl_name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    signature = {
        "x_ptr": "*" + tl_name[spec.x_dtype], "residual_ptr": "*" + tl_name[spec.residual_dtype],
        "weight_ptr": "*" + tl_name[spec.weight_dtype] if spec.weight_dtype is not None else "constexpr",
        "bias_ptr": "*" + tl_name[spec.bias_dtype] if spec.bias_dtype is not None else "constexpr",
        "y_ptr": "*" + tl_name[spec.out_dtype], "h_ptr": "*" + tl_name[spec.sum_dtype],
        "n_rows": "i32", "eps": "fp32",
        "stride_x": "i32", "stride_residual": "i32", "stride_y": "i32", "stride_h": "i32",
        "ROWS": "constexpr", "BLOCK": "constexpr",
    }
    constexprs = {"ROWS": config["ROWS"], "BLOCK": config["BLOCK"]}
    constexprs.update({name: None for name in ("weight_ptr", "bias_ptr") if signature[name] == "constexpr"})
    return signature, constexprs


# ---------------------------------------------------------------------------------------------------------
# TileLang
#
# add_rms_norm's block shape: THREADS threads hold ROWS whole rows in fp32 fragments, the row padded to whole
# 16-byte vectors per thread; the prim_func takes the weight and bias only where the LayerNorm has them.


TILELANG_FACTORY_NAME = "build"


def tilelang_source(spec: AddLayerNormSpec, profile: DeviceProfile) -> str:
    parameters, affine = [], "values[r, c] * rstd[r]"
    if spec.weight_dtype is not None:
        parameters.append(f'        weight: T.Tensor((HIDDEN,), "{TILELANG_DTYPES[spec.weight_dtype]}"),')
        affine = f'{affine} * T.cast(weight[c], "float32")'
    if spec.bias_dtype is not None:
        parameters.append(f'        bias: T.Tensor((HIDDEN,), "{TILELANG_DTYPES[spec.bias_dtype]}"),')
        affine = f'{affine} + T.cast(bias[c], "float32")'
    fields = dict(
        profile=profile.name, hidden=spec.hidden,
        x_dtype=spec.x_dtype, residual_dtype=spec.residual_dtype, weight_dtype=spec.weight_dtype,
        bias_dtype=spec.bias_dtype, out_dtype=spec.out_dtype, sum_dtype=spec.sum_dtype, sum_in_fp32=spec.sum_in_fp32,
        x_tl_dtype=TILELANG_DTYPES[spec.x_dtype], residual_tl_dtype=TILELANG_DTYPES[spec.residual_dtype],
        out_tl_dtype=TILELANG_DTYPES[spec.out_dtype], sum_tl_dtype=TILELANG_DTYPES[spec.sum_dtype],
        vector=tilelang_vector(spec),
        # The norm reads the fp32 sum, or the sum as rounded into h (what the model code computes).
        normed_input="total" if spec.sum_in_fp32 else 'T.cast(T.cast(total, SUM_DTYPE), "float32")',
        affine_parameters="\n".join(parameters) or "        # No weight, no bias (elementwise_affine=False).",
        affine=affine,
    )
    return Template((TEMPLATES / "add_layer_norm.tilelang.py.tmpl").read_text()).substitute(fields)


def tilelang_launch_arguments(x, residual, weight, bias, eps, y, h) -> tilelang_codegen.LaunchArguments:
    """What tilelang_launch calls the kernel with: x, residual, the weight and bias where the kernel was generated
    with them, y, h, eps. The kernel is compiled for dense rows (row stride = hidden) at 16-byte-aligned bases and
    vectorises on both, so other inputs (strided or offset views) are copied, and such outputs are computed into
    temporaries that are copied back after the launch."""
    return tilelang_codegen.launch_arguments((x, residual, weight, bias), (y, h), (float(eps),))


def tilelang_launch(compiled, config: KernelConfig, x, residual, weight, bias, eps, y, h):
    """Launch on 2-D views [tokens, hidden]; y and h are preallocated outputs.

    `compiled` is what tilelang_codegen.load returns (one compiled kernel per config)."""
    arguments = tilelang_launch_arguments(x, residual, weight, bias, eps, y, h)
    arguments.launch(compiled.kernel_for(config))


# ---------------------------------------------------------------------------------------------------------
# Self-test (dzc-selftest)

# (case name, hidden, tokens, activation dtype, sum dtype, sum_in_fp32, weight, bias): MoonViT's and Qwen2.5-VL's
# vision widths in bf16 (1152 needs padding), the fp32 sum some ports compute, and the affine-free variants.
_SELFTEST_CASES = (
    ("bf16 hidden=1152 moonvit", 1152, 7, torch.bfloat16, torch.bfloat16, False, True, True),
    ("bf16 hidden=1280 fp32 sum", 1280, 5, torch.bfloat16, torch.bfloat16, True, True, True),
    ("fp16 hidden=80 no bias", 80, 33, torch.float16, torch.float16, False, True, False),
    ("fp32 hidden=200 no affine", 200, 3, torch.float32, torch.float32, False, False, False),
)


def selftest_cases(profile: DeviceProfile):
    """Named small cases whose dtypes `profile` supports; each builds the op's arguments (without kernel_id) on a
    device from a generator, with random activations, a weight around 1 and a random bias (ones and zeros would
    hide the affine step)."""
    cases = []
    for name, hidden, tokens, dtype, sum_dtype, sum_in_fp32, has_weight, has_bias in _SELFTEST_CASES:
        if not (profile.supports_dtype(dtype) and profile.supports_dtype(sum_dtype)):
            continue

        def make_args(device, generator, hidden=hidden, tokens=tokens, dtype=dtype, sum_dtype=sum_dtype,
                      sum_in_fp32=sum_in_fp32, has_weight=has_weight, has_bias=has_bias):
            def randn(*shape):
                return torch.randn(*shape, generator=generator, device=device)

            x = randn(tokens, hidden).to(dtype)
            residual = randn(tokens, hidden).to(sum_dtype)
            weight = (1.0 + 0.1 * randn(hidden)).to(dtype) if has_weight else None
            bias = (0.1 * randn(hidden)).to(dtype) if has_bias else None
            return x, residual, weight, bias, 1e-6, sum_in_fp32, dtype, sum_dtype

        cases.append((name, make_args))
    return cases
