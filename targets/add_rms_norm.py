"""Kernels for dzc.add_rms_norm: the spec a node lowers to, and per codegen its source, config space and launch.

The op is memory-bound (8·T·H bytes for bf16: read x and residual, write y and h). One program normalises ROWS
rows of HIDDEN elements held in registers; ROWS > 1 keeps small hidden sizes from leaving lanes idle.
targets/add_layer_norm.py imports this row layout's config spaces, defaults and shared-memory estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc.targets import tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import tilelang_config_legal
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}
# The same dtypes as triton.compile's signature strings (ahead-of-time compiles).
SIGNATURE_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class AddRmsNormSpec:
    """Everything a kernel is specialised on; the token count is a run-time argument.

    weight_dtype None: the norm has no weight. compute_dtype and divide_by_rms: the op's arguments of those
    names (the dtype each step of the norm rounds to; `v / sqrt(.)` instead of `v * rsqrt(.)`)."""

    hidden: int
    x_dtype: torch.dtype
    residual_dtype: torch.dtype
    weight_dtype: torch.dtype | None
    out_dtype: torch.dtype
    sum_dtype: torch.dtype
    sum_in_fp32: bool
    cast_before_weight: bool
    compute_dtype: torch.dtype = torch.float32
    divide_by_rms: bool = False

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(d for d in (self.x_dtype, self.residual_dtype, self.weight_dtype, self.out_dtype,
                                 self.sum_dtype, self.compute_dtype) if d is not None)

    @property
    def block(self) -> int:
        return 1 << (self.hidden - 1).bit_length()

    def describe(self) -> str:
        names = "/".join(str(d).removeprefix("torch.") for d in (self.x_dtype, self.residual_dtype,
                                                                  self.weight_dtype, self.out_dtype, self.sum_dtype))
        text = f"hidden={self.hidden} x/res/w/y/h={names} sum_in_fp32={self.sum_in_fp32} " \
               f"cast_before_weight={self.cast_before_weight}"
        # Only where they differ from the usual spelling, so that existing descriptions (and keys) stay as they were.
        if self.compute_dtype != torch.float32:
            text += f" compute_dtype={str(self.compute_dtype).removeprefix('torch.')}"
        if self.divide_by_rms:
            text += " divide_by_rms=True"
        return text


def spec_from_node(node) -> AddRmsNormSpec:
    x, residual = (node.args[i].meta["val"] for i in range(2))
    weight = node.args[2].meta["val"] if node.args[2] is not None else None
    _eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype = node.args[3:8]
    compute_dtype = node.args[8] if len(node.args) > 8 else node.kwargs.get("compute_dtype", torch.float32)
    divide_by_rms = node.args[9] if len(node.args) > 9 else node.kwargs.get("divide_by_rms", False)
    return AddRmsNormSpec(int(x.shape[-1]), x.dtype, residual.dtype, weight.dtype if weight is not None else None,
                          out_dtype, sum_dtype, sum_in_fp32, cast_before_weight, compute_dtype, divide_by_rms)


def bytes_moved(spec: AddRmsNormSpec, tokens: int) -> int:
    """Fewest bytes one call must move: read x, residual and weight once, write y and h once."""
    per_row = sum(d.itemsize for d in (spec.x_dtype, spec.residual_dtype, spec.out_dtype, spec.sum_dtype))
    return tokens * spec.hidden * per_row + (spec.hidden * spec.weight_dtype.itemsize if spec.weight_dtype else 0)


def token_bucket(tokens: int) -> int:
    """Tuning results are kept per power-of-two bucket of the token count."""
    return 1 << max(tokens - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------------------
# Triton


def _triton_normalise(spec: AddRmsNormSpec) -> str:
    """The template's lines from the norm's input to `normed`: in fp32, or rounded to compute_dtype after every
    step (each step's fp32 result rounded once, as eager computes a bf16/fp16 op)."""
    if spec.compute_dtype == torch.float32 and not spec.divide_by_rms:
        return ("    inv_rms = tl.math.rsqrt(tl.sum(normed_input * normed_input, axis=1) / HIDDEN + eps)\n"
                "    normed = normed_input * inv_rms[:, None]")
    lines = []
    if spec.compute_dtype == torch.float32:
        def rounded(expr):
            return expr
    else:
        def rounded(expr):
            return f"({expr}).to({TL_DTYPES[spec.compute_dtype]}).to(tl.float32)"
        lines += [f"    # The model computes the norm in {str(spec.compute_dtype).removeprefix('torch.')}: every step "
                  "rounds to it.",
                  f"    normed_input = {rounded('normed_input')}"]
    lines += [f"    square = {rounded('normed_input * normed_input')}",
              f"    mean_square = {rounded('tl.sum(square, axis=1) / HIDDEN')}",
              f"    mean_square = {rounded('mean_square + eps')}"]
    if spec.divide_by_rms:
        # Correctly rounded root and quotient, as torch.sqrt and `/` compute them.
        lines += [f"    rms = {rounded('tl.sqrt_rn(mean_square)')}",
                  f"    normed = {rounded('tl.div_rn(normed_input, rms[:, None])')}"]
    else:
        lines += [f"    inv_rms = {rounded('tl.math.rsqrt(mean_square)')}",
                  f"    normed = {rounded('normed_input * inv_rms[:, None]')}"]
    return "\n".join(lines)


def _triton_output(spec: AddRmsNormSpec) -> str:
    """The template's lines from `normed` to the store of y: times the weight (read in fp32) unless there is none."""
    store = "    tl.store(y_ptr + rows * stride_y + cols, {}.to(" + TL_DTYPES[spec.out_dtype] + "), mask=mask)"
    if spec.weight_dtype is None:
        return "    # No weight: weight_ptr is None.\n" + store.format("normed")
    return ("    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)\n"
            + store.format("(normed * weight)"))


def triton_source(spec: AddRmsNormSpec, profile: DeviceProfile) -> str:
    fields = dict(
        profile=profile.name, hidden=spec.hidden,
        x_dtype=spec.x_dtype, residual_dtype=spec.residual_dtype, weight_dtype=spec.weight_dtype,
        out_dtype=spec.out_dtype, sum_dtype=spec.sum_dtype,
        sum_in_fp32=spec.sum_in_fp32, cast_before_weight=spec.cast_before_weight,
        sum_tl_dtype=TL_DTYPES[spec.sum_dtype],
        # The norm reads the fp32 sum, or the sum as rounded into h (what the model code computes).
        normed_input="total" if spec.sum_in_fp32 else "h.to(tl.float32)",
        normalise=_triton_normalise(spec),
        weight_operand=(f"normed.to({TL_DTYPES[spec.sum_dtype]}).to(tl.float32)" if spec.cast_before_weight
                        else "normed"),
        output=_triton_output(spec),
    )
    return Template((TEMPLATES / "add_rms_norm.triton.py.tmpl").read_text()).substitute(fields)


TRITON_KERNEL_NAME = "add_rms_norm_kernel"


def triton_configs(spec: AddRmsNormSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """The tuning space before legality pruning: rows per program × warps.

    Rows are kept to about 4K..16K elements per program so that registers hold the row block.
    """
    configs = []
    for rows in (1, 2, 4, 8, 16):
        elements = rows * spec.block
        if rows > 1 and elements > 16384:
            continue
        for num_warps in (1, 2, 4, 8, 16, 32):
            threads = num_warps * profile.warp_size
            # Fewer than ~4 elements per thread wastes lanes; more than ~64 spills registers.
            if elements < 4 * threads and num_warps > 1:
                continue
            if elements > 64 * threads:
                continue
            configs.append(KernelConfig.make(num_warps=num_warps, num_stages=1, ROWS=rows, BLOCK=spec.block))
    return configs


def triton_default_config(spec: AddRmsNormSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: one row per program, about 8 elements per thread."""
    num_warps = max(1, min(profile.max_num_warps, spec.block // (8 * profile.warp_size)))
    return KernelConfig.make(num_warps=num_warps, num_stages=1, ROWS=1, BLOCK=spec.block)


def triton_shared_memory_bytes(spec: AddRmsNormSpec, config: KernelConfig) -> int:
    """Cross-warp reduction scratch: one fp32 partial per warp and row."""
    return 4 * config.num_warps * config["ROWS"]


def triton_launch(kernel, config: KernelConfig, x, residual, weight, eps, y, h):
    """Launch on 2-D views [tokens, hidden]; y and h are preallocated outputs; weight may be None."""
    rows = config["ROWS"]
    n_rows = x.shape[0]
    grid = (-(-n_rows // rows),)
    kernel[grid](x, residual, weight, y, h, n_rows, eps,
                 x.stride(0), residual.stride(0), y.stride(0), h.stride(0),
                 ROWS=rows, BLOCK=config["BLOCK"], num_warps=config.num_warps, num_stages=config.num_stages)


def triton_signature(spec: AddRmsNormSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed).

    An absent weight is a None argument, which Triton specialises as a constexpr."""
    tl_name = SIGNATURE_TYPES
    signature = {
        "x_ptr": "*" + tl_name[spec.x_dtype], "residual_ptr": "*" + tl_name[spec.residual_dtype],
        "weight_ptr": "*" + tl_name[spec.weight_dtype] if spec.weight_dtype is not None else "constexpr",
        "y_ptr": "*" + tl_name[spec.out_dtype],
        "h_ptr": "*" + tl_name[spec.sum_dtype], "n_rows": "i32", "eps": "fp32",
        "stride_x": "i32", "stride_residual": "i32", "stride_y": "i32", "stride_h": "i32",
        "ROWS": "constexpr", "BLOCK": "constexpr",
    }
    constexprs = {"ROWS": config["ROWS"], "BLOCK": config["BLOCK"]}
    if spec.weight_dtype is None:
        constexprs["weight_ptr"] = None
    return signature, constexprs


def prepare(spec: AddRmsNormSpec, x, residual, weight, eps, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), token count, the op's results).

    The kernel writes 2-D views of the results, so nothing is copied after the launch.

    The op's static arguments (_static: flags and dtypes) are already in the spec the kernel was built for."""
    shape = x.shape
    weight_shape = tuple(weight.shape) if weight is not None else None
    if residual.shape != shape or weight_shape != ((spec.hidden,) if spec.weight_dtype is not None else None):
        raise ValueError(f"add_rms_norm kernel for hidden={spec.hidden} got x {tuple(shape)}, residual "
                         f"{tuple(residual.shape)}, weight {weight_shape}")
    x2d, residual2d, y, h, y2d, h2d = residual_rows(spec.hidden, spec.out_dtype, spec.sum_dtype, x, residual)
    weight = weight.contiguous() if weight is not None else None
    return (x2d, residual2d, weight, eps), (y2d, h2d), x2d.shape[0], (y, h)


def residual_rows(hidden: int, out_dtype: torch.dtype, sum_dtype: torch.dtype, x, residual):
    """For the residual-norm kernels (add_rms_norm, add_layer_norm): (x and residual as [tokens, hidden] rows, the
    outputs y and h allocated dense in x's shape, and their [tokens, hidden] views). Kernels index rows by stride
    and columns contiguously and write the 2-D views, so nothing is copied after the launch."""
    shape = x.shape
    # Outputs are dense. empty_like of a dense x (no keyword arguments to parse) costs half of torch.empty.
    dense = x.is_contiguous()
    y = torch.empty_like(x) if dense and out_dtype == x.dtype else torch.empty(shape, dtype=out_dtype, device=x.device)
    h = torch.empty_like(x) if dense and sum_dtype == x.dtype else torch.empty(shape, dtype=sum_dtype, device=x.device)
    if len(shape) == 2 and x.stride(1) == 1 and residual.stride(1) == 1:
        # Already [tokens, hidden] with dense rows: no view or copy at all (each costs host time per call).
        return x, residual, y, h, y, h
    # Dense inputs (the usual case) pass as views.
    x2d = x.view(-1, hidden) if x.is_contiguous() else x.reshape(-1, hidden).contiguous()
    residual2d = residual.view(-1, hidden) if residual.is_contiguous() else residual.reshape(-1, hidden).contiguous()
    return x2d, residual2d, y, h, y.view(x2d.shape), h.view(x2d.shape)


# ---------------------------------------------------------------------------------------------------------
# TileLang
#
# One block of THREADS threads normalises ROWS whole rows held in fp32 fragments; the row is padded to whole
# 16-byte vectors per thread (TileLang's layout inference and vectoriser need the fragment to split evenly).


TILELANG_FACTORY_NAME = "build"

TILELANG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# The fp32 row block lives in registers: at most 64 elements per thread, and 16K per block (at 1024 threads
# that is 16 per thread, since a thread of a full-size block has only 64 registers in all).
_TILELANG_MAX_ELEMENTS_PER_THREAD = 64
_TILELANG_MAX_ELEMENTS_PER_BLOCK = 16384
# Padding columns are idle lanes: a thread count is kept only if its padded row is at most this much wider than
# the narrowest padded row any thread count gets.
_TILELANG_MAX_PADDING_GROWTH = 1.25


def tilelang_vector(spec: AddRmsNormSpec) -> int:
    """Elements in one 16-byte access of the narrowest tensor (the template's VECTOR)."""
    return 16 // min(d.itemsize for d in spec.dtypes)


def _tilelang_padded_width(spec: AddRmsNormSpec, threads: int) -> int:
    """The template's padded_width(threads): hidden rounded up to whole vectors for every thread."""
    step = threads * tilelang_vector(spec)
    return -(-spec.hidden // step) * step


def tilelang_source(spec: AddRmsNormSpec, profile: DeviceProfile) -> str:
    if spec.compute_dtype == torch.float32:
        def rounded(expr):
            return expr
    else:
        # Every step of the norm rounds to compute_dtype, as the model's bf16/fp16 arithmetic does.
        def rounded(expr):
            return f'T.cast(T.cast({expr}, "{TILELANG_DTYPES[spec.compute_dtype]}"), "float32")'
    # The norm reads the fp32 sum, or the sum as rounded into h (what the model code computes).
    normed_input = rounded("total[r, c]" if spec.sum_in_fp32 else 'T.cast(T.cast(total[r, c], SUM_DTYPE), "float32")')
    mean_square = rounded(rounded("sum_of_squares[r] / HIDDEN") + " + eps")
    if spec.divide_by_rms:
        # Correctly rounded root and quotient, as torch.sqrt and `/` compute them.
        scale, row_scale = "rms", f"rms[r] = {rounded(f'T.ieee_fsqrt({mean_square})')}"
        normed = rounded("T.ieee_fdiv(normed_input, rms[r])")
    else:
        scale, row_scale = "inv_rms", f"inv_rms[r] = {rounded(f'T.rsqrt({mean_square})')}"
        normed = rounded("normed_input * inv_rms[r]")
    if spec.cast_before_weight:
        normed = f'T.cast(T.cast({normed}, SUM_DTYPE), "float32")'
    has_weight = spec.weight_dtype is not None
    fields = dict(
        profile=profile.name, hidden=spec.hidden,
        x_dtype=spec.x_dtype, residual_dtype=spec.residual_dtype, weight_dtype=spec.weight_dtype,
        out_dtype=spec.out_dtype, sum_dtype=spec.sum_dtype,
        sum_in_fp32=spec.sum_in_fp32, cast_before_weight=spec.cast_before_weight,
        x_tl_dtype=TILELANG_DTYPES[spec.x_dtype], residual_tl_dtype=TILELANG_DTYPES[spec.residual_dtype],
        weight_tl_dtype=TILELANG_DTYPES[spec.weight_dtype] if has_weight else "none",
        out_tl_dtype=TILELANG_DTYPES[spec.out_dtype], sum_tl_dtype=TILELANG_DTYPES[spec.sum_dtype],
        vector=tilelang_vector(spec),
        weight_parameter=("        weight: T.Tensor((HIDDEN,), WEIGHT_DTYPE)," if has_weight
                          else "        # No weight: y is the normalised value."),
        normed_input=normed_input, square=rounded("normed_input * normed_input"),
        scale=scale, row_scale=" " * 16 + row_scale, normed=normed,
        output='normed * T.cast(weight[c], "float32")' if has_weight else "normed",
    )
    return Template((TEMPLATES / "add_rms_norm.tilelang.py.tmpl").read_text()).substitute(fields)


def tilelang_configs(spec: AddRmsNormSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Threads per block × rows per block, already pruned to what is legal on `profile`.

    Threads are powers of two (TileLang's cross-thread AllReduce needs that) and whole warps of the profile.
    """
    thread_counts = []
    threads = profile.warp_size
    while threads <= profile.max_threads_per_block:
        thread_counts.append(threads)
        threads *= 2
    narrowest = min(_tilelang_padded_width(spec, t) for t in thread_counts)
    configs = []
    for threads in thread_counts:
        width = _tilelang_padded_width(spec, threads)
        if width > _TILELANG_MAX_PADDING_GROWTH * narrowest:
            continue
        for rows in (1, 2, 4, 8, 16):
            elements = rows * width
            if elements > _TILELANG_MAX_ELEMENTS_PER_BLOCK or elements // threads > _TILELANG_MAX_ELEMENTS_PER_THREAD:
                break
            config = KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=1,
                                       THREADS=threads, ROWS=rows)
            if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                configs.append(config)
    return configs


def tilelang_default_config(spec: AddRmsNormSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: one row per block, the thread count closest to 16 elements per thread."""
    single_row = [c for c in tilelang_configs(spec, profile) if c["ROWS"] == 1]
    if not single_row:
        raise ValueError(f"no legal TileLang add+norm config for {spec.describe()} on {profile.name}")
    return min(single_row,
               key=lambda c: abs(_tilelang_padded_width(spec, c["THREADS"]) // c["THREADS"] - 16))


def tilelang_shared_memory_bytes(spec: AddRmsNormSpec, config: KernelConfig) -> int:
    """T.reduce_sum's AllReduce workspace: one fp32 per thread, reused row after row."""
    return 4 * config["THREADS"]


def tilelang_launch_arguments(x, residual, weight, eps, y, h) -> tilelang_codegen.LaunchArguments:
    """What tilelang_launch calls the kernel with: x, residual, the weight where the kernel was generated with one,
    y, h, eps. The kernel is compiled for dense rows (row stride = hidden) at 16-byte-aligned bases and vectorises
    on both, so other inputs (strided or offset views) are copied, and such outputs are computed into temporaries
    that are copied back after the launch."""
    return tilelang_codegen.launch_arguments((x, residual, weight), (y, h), (float(eps),))


def tilelang_launch(compiled, config: KernelConfig, x, residual, weight, eps, y, h):
    """Launch on 2-D views [tokens, hidden]; y and h are preallocated outputs.

    `compiled` is what tilelang_codegen.load returns (one compiled kernel per config)."""
    arguments = tilelang_launch_arguments(x, residual, weight, eps, y, h)
    arguments.launch(compiled.kernel_for(config))


# ---------------------------------------------------------------------------------------------------------
# Self-test (dzc-selftest)

# (case name, hidden, tokens, activation dtype, residual/sum dtype, sum_in_fp32, cast_before_weight, weight dtype
# (None: no weight), compute dtype, divide_by_rms): the HF Llama spelling at a hidden size that needs padding,
# DeepSeek's fp32 residual stream, fp16/fp32 rows, Gemma's fp32 `1 + w` weight, and a weightless norm computed in
# bf16 as `v / sqrt(mean + eps)`.
_SELFTEST_CASES = (
    ("bf16 hidden=2880 hf", 2880, 7, torch.bfloat16, torch.bfloat16, False, True, torch.bfloat16, torch.float32,
     False),
    ("bf16+fp32 residual hidden=7168 deepseek", 7168, 5, torch.bfloat16, torch.float32, True, False, torch.bfloat16,
     torch.float32, False),
    ("fp16 hidden=64 hf", 64, 33, torch.float16, torch.float16, False, True, torch.float16, torch.float32, False),
    ("fp32 hidden=1024 deepseek", 1024, 3, torch.float32, torch.float32, True, False, torch.float32, torch.float32,
     False),
    ("bf16 hidden=1152 fp32 weight gemma", 1152, 6, torch.bfloat16, torch.bfloat16, False, False, torch.float32,
     torch.float32, False),
    ("bf16 hidden=96 no weight bf16 math divide", 96, 9, torch.bfloat16, torch.bfloat16, False, False, None,
     torch.bfloat16, True),
)


def selftest_cases(profile: DeviceProfile):
    """Named small cases whose dtypes `profile` supports; each builds the op's arguments (without kernel_id) on a
    device from a generator, with random activations and a weight around 1 (ones would hide the multiply)."""
    cases = []
    for name, hidden, tokens, dtype, sum_dtype, sum_in_fp32, cast_before_weight, weight_dtype, compute_dtype, \
            divide_by_rms in _SELFTEST_CASES:
        if not all(profile.supports_dtype(d) for d in (dtype, sum_dtype, weight_dtype, compute_dtype) if d):
            continue

        def make_args(device, generator, hidden=hidden, tokens=tokens, dtype=dtype, sum_dtype=sum_dtype,
                      sum_in_fp32=sum_in_fp32, cast_before_weight=cast_before_weight, weight_dtype=weight_dtype,
                      compute_dtype=compute_dtype, divide_by_rms=divide_by_rms):
            def randn(*shape):
                return torch.randn(*shape, generator=generator, device=device)

            x = randn(tokens, hidden).to(dtype)
            residual = randn(tokens, hidden).to(sum_dtype)
            weight = (1.0 + 0.1 * randn(hidden)).to(weight_dtype) if weight_dtype is not None else None
            return (x, residual, weight, 1e-6, sum_in_fp32, cast_before_weight, dtype, sum_dtype, compute_dtype,
                    divide_by_rms)

        cases.append((name, make_args))
    return cases
