"""One-shot all-reduce + residual add + RMSNorm over symmetric memory (dzc.all_reduce_add_rms_norm's second
lowering): one kernel that reads every rank's x rows from the peers' buffers and applies add + norm in its
epilogue. NOT the default lowering: no op is lowered to it (it is not in targets.KERNEL_FAMILIES, so
`lower_as_parts` stays the default everywhere); tools/bench_distributed.py times it beside the parts.

Protocol, per call, on every rank of the group (the same calls in the same order: TP ranks do):
  1. The launcher copies this rank's x rows (dense, x's dtype) into its symmetric buffer (a torch copy on the
     current stream; the kernel starts after it).
  2. Barrier 1 (channel 0): program p of rank r raises flag [p * WORLD + r] in every rank's signal pad
     (atomic CAS 0 -> 1, release, system scope, retried while the flag is still 1 from an earlier barrier), then
     lowers the flags [p * WORLD + q] of every peer q in its own pad (CAS 1 -> 0, acquire, system scope, retried
     until the peer's flag is up). When it passes, program p of every rank has started, so every rank's copy (an
     earlier kernel on its stream) is complete and visible.
  3. Program p sums its row blocks over the ranks' buffers (a table of WORLD buffer addresses), in rank order in
     fp32, rounded once to x's dtype; then h = reduced + residual and the RMSNorm exactly as add_rms_norm's
     Triton kernel computes it (the same template lines: every option of add_rms_norm_reference).
  4. Barrier 2 (channel 1, flags [(n_programs + p) * WORLD + r]): after it, program p of every rank has read
     its rows of every buffer; once the whole kernel has ended on a rank, no peer reads that rank's buffer any
     more, so its next copy (step 1 of the next call) may overwrite it.
  Every flag is raised once and lowered once per barrier: the pads are all zero again after each call (torch
  zeroes a signal pad when it allocates it). 2 * n_programs * WORLD flags must fit in the pad
  (symm_mem.get_signal_pad_size(), 9216 bytes by default: 2304 flags): the grid is capped by `max_programs`
  and programs loop over row blocks. Program p pairs with program p of every peer, so every rank must launch
  the same grid (same token count and config: the runner uses the untuned default config for that reason).
  Only loads, stores and atomics on peer memory: no multimem/multicast.

Numerics. The op's reference sums in x's dtype through the backend's all-reduce, in an order the backend
chooses. The kernel sums in fp32 in rank order and rounds once to x's dtype. For 2 ranks that is bit-identical to
the backend's sum (a + b of two bf16/fp16 values is exact in fp32 unless their exponents differ by more than 15
(bf16) / 12 (fp16), and then the smaller is below half an ulp of the larger either way; fp32: one rounding
both ways), so y and h match dzc's add_rms_norm kernel run on the backend's reduced x. For more ranks the
backend's own result depends on its ring/tree order (several roundings in x's dtype); the kernel's single rounding
differs from it by at most (WORLD - 2) ulps of x's dtype per element of the reduced x (relative 2^-8 per rank for
bf16, 2^-11 fp16, 2^-24 fp32) before add + norm. Every rank gets bit-identical results from the kernel (same
order, same code). Where an exact match with the backend is required for WORLD > 2, use the parts.

Refused (`problems` names why; the caller then lowers as parts): dtypes other than fp32/fp16/bf16, a residual
or weight whose shape is not x's rows / [hidden], more ranks than the signal pad holds flags for, a profile
without `symmetric_memory`, torch without torch.distributed._symmetric_memory, and tensors not on a GPU.
"""

from __future__ import annotations

import hashlib
import textwrap
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc.targets import add_rms_norm
from dzc.targets.add_rms_norm import TL_DTYPES, AddRmsNormSpec
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

TRITON_KERNEL_NAME = "all_reduce_add_rms_norm_kernel"

# torch's default signal pad (c10d symmetric_memory: 32 channels x 72 ranks x 4 bytes).
DEFAULT_SIGNAL_PAD_BYTES = 9216
# Barriers per call (before reading the peers' rows, after): each takes WORLD flags per program.
BARRIER_CHANNELS = 2


@dataclass(frozen=True)
class AllReduceAddRmsNormSpec:
    """add_rms_norm's spec (the epilogue) + the number of ranks."""

    norm: AddRmsNormSpec
    world: int

    def describe(self) -> str:
        return f"world={self.world} {self.norm.describe()}"


def spec_from_args(world: int, x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype,
                   compute_dtype=torch.float32, divide_by_rms=False) -> AllReduceAddRmsNormSpec:
    """The spec for the op's arguments (x is this rank's partial sum) on `world` ranks."""
    norm = AddRmsNormSpec(int(x.shape[-1]), x.dtype, residual.dtype, weight.dtype if weight is not None else None,
                          out_dtype, sum_dtype, sum_in_fp32, cast_before_weight, compute_dtype, divide_by_rms)
    return AllReduceAddRmsNormSpec(norm, world)


def max_programs(world: int, signal_pad_bytes: int = DEFAULT_SIGNAL_PAD_BYTES) -> int:
    """The most programs a launch may have: each owns BARRIER_CHANNELS * world 32-bit flags of the signal pad."""
    return signal_pad_bytes // (4 * BARRIER_CHANNELS * world)


def problems(spec: AllReduceAddRmsNormSpec, profile: DeviceProfile | None = None,
             signal_pad_bytes: int = DEFAULT_SIGNAL_PAD_BYTES) -> list[str]:
    """Why this kernel cannot compute the op for `spec` (on `profile`, if given); empty if it can."""
    found = []
    if profile is not None and not profile_supports(profile):
        found.append(f"profile {profile.name} has no symmetric_memory (peers' buffers cannot be mapped)")
    if any(d not in TL_DTYPES for d in spec.norm.dtypes):
        found.append(f"dtypes {spec.norm.describe()}: only fp32/fp16/bf16")
    if spec.world < 1 or max_programs(spec.world, signal_pad_bytes) < 1:
        found.append(f"{spec.world} ranks: the signal pad ({signal_pad_bytes} bytes) has no flags for them")
    return found


def profile_supports(profile: DeviceProfile | None) -> bool:
    """The gate: the profile's `symmetric_memory` field (never the vendor)."""
    return bool(profile is not None and profile.symmetric_memory)


def runtime_problems(device: torch.device) -> list[str]:
    """Why this process cannot run the kernel on `device` (symmetric memory unavailable); empty if it can."""
    found = []
    if device.type != "cuda":
        found.append(f"tensors on {device.type}: symmetric memory needs GPU tensors")
    try:
        import torch.distributed._symmetric_memory  # noqa: F401, PLC0415
    except ImportError as error:
        found.append(f"torch.distributed._symmetric_memory is unavailable ({error})")
    return found


# ---------------------------------------------------------------------------------------------------------
# Triton


def triton_source(spec: AllReduceAddRmsNormSpec, profile: DeviceProfile) -> str:
    """The template with add_rms_norm's epilogue lines (the same code for every norm option), one level deeper
    (inside the loop over row blocks)."""
    norm = spec.norm
    if norm.x_dtype not in TL_DTYPES:
        raise ValueError(f"no one-shot all-reduce kernel for {spec.describe()}: only fp32/fp16/bf16")

    def deeper(lines: str) -> str:
        return textwrap.indent(lines, "    ")

    fields = dict(
        profile=profile.name, hidden=norm.hidden,
        x_dtype=norm.x_dtype, residual_dtype=norm.residual_dtype, weight_dtype=norm.weight_dtype,
        out_dtype=norm.out_dtype, sum_dtype=norm.sum_dtype,
        sum_in_fp32=norm.sum_in_fp32, cast_before_weight=norm.cast_before_weight,
        x_tl_dtype=TL_DTYPES[norm.x_dtype], sum_tl_dtype=TL_DTYPES[norm.sum_dtype],
        normed_input="total" if norm.sum_in_fp32 else "h.to(tl.float32)",
        normalise=deeper(add_rms_norm._triton_normalise(norm)),
        weight_operand=(f"normed.to({TL_DTYPES[norm.sum_dtype]}).to(tl.float32)" if norm.cast_before_weight
                        else "normed"),
        output=deeper(add_rms_norm._triton_output(norm)),
    )
    return Template((TEMPLATES / "all_reduce_add_rms_norm.triton.py.tmpl").read_text()).substitute(fields)


def triton_configs(spec: AllReduceAddRmsNormSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """add_rms_norm's row-block x warps space (the epilogue is that kernel's)."""
    return add_rms_norm.triton_configs(spec.norm, profile)


def triton_default_config(spec: AllReduceAddRmsNormSpec, profile: DeviceProfile) -> KernelConfig:
    return add_rms_norm.triton_default_config(spec.norm, profile)


def triton_signature(spec: AllReduceAddRmsNormSpec, config: KernelConfig, barrier: bool = True) -> tuple[dict, dict]:
    """(signature, constexprs) for triton.compile ahead of time (no GPU needed). The address tables are i64
    arguments (the handle's buffer_ptrs_dev / signal_pad_ptrs_dev are plain integers)."""
    tl_name = add_rms_norm.SIGNATURE_TYPES
    norm = spec.norm
    signature = {
        "buffer_ptrs": "i64", "signal_pad_ptrs": "i64", "residual_ptr": "*" + tl_name[norm.residual_dtype],
        "weight_ptr": "*" + tl_name[norm.weight_dtype] if norm.weight_dtype is not None else "constexpr",
        "y_ptr": "*" + tl_name[norm.out_dtype], "h_ptr": "*" + tl_name[norm.sum_dtype],
        "n_rows": "i32", "eps": "fp32", "rank": "i32",
        "stride_residual": "i32", "stride_y": "i32", "stride_h": "i32",
        "WORLD": "constexpr", "ROWS": "constexpr", "BLOCK": "constexpr", "BARRIER": "constexpr",
    }
    constexprs = {"WORLD": spec.world, "ROWS": config["ROWS"], "BLOCK": config["BLOCK"], "BARRIER": barrier}
    if norm.weight_dtype is None:
        constexprs["weight_ptr"] = None
    return signature, constexprs


def triton_launch(kernel, config: KernelConfig, spec: AllReduceAddRmsNormSpec, buffer_ptrs: int,
                  signal_pad_ptrs: int, rank: int, n_rows: int, residual, weight, eps, y, h, programs: int,
                  barrier: bool = True):
    """Launch over 2-D [rows, hidden] residual / y / h; buffer_ptrs and signal_pad_ptrs are device addresses of
    the WORLD-entry address tables; at most `programs` programs (see max_programs)."""
    rows = config["ROWS"]
    grid = (max(1, min(-(-n_rows // rows), programs)),)
    kernel[grid](buffer_ptrs, signal_pad_ptrs, residual, weight, y, h, n_rows, eps, rank,
                 residual.stride(0), y.stride(0), h.stride(0),
                 WORLD=spec.world, ROWS=rows, BLOCK=config["BLOCK"], BARRIER=barrier,
                 num_warps=config.num_warps, num_stages=config.num_stages)


# ---------------------------------------------------------------------------------------------------------
# The runner: symmetric buffers, the kernel, the launch (CUDA)


class OneShotAllReduceAddRmsNorm:
    """Calls the one-shot kernel as dzc.all_reduce_add_rms_norm would: __call__ takes the op's arguments (x is this
    rank's partial sum) and returns (y, h). One symmetric buffer per (dtype, hidden), grown (a new collective
    rendezvous on every rank: all ranks call with the same shapes, as TP ranks do) to the largest token count
    seen. Construct it only where `unavailable()` is empty; the kernel source and compiled kernel live in
    `cache_dir`."""

    def __init__(self, group, profile: DeviceProfile, cache_dir: str | Path, config: KernelConfig | None = None):
        import torch.distributed as dist  # noqa: PLC0415

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.profile = profile
        self.cache_dir = Path(cache_dir)
        self.config = config
        self._buffers: dict[tuple, tuple] = {}  # (dtype, hidden) -> (capacity rows, tensor, handle)
        # spec -> (compiled kernel, its config, the most programs a launch may have): built once, not per call
        self._kernels: dict[AllReduceAddRmsNormSpec, tuple] = {}

    @staticmethod
    def unavailable(profile: DeviceProfile, device: torch.device) -> str:
        """Why the one-shot kernel cannot run here ("" where it can)."""
        if not profile_supports(profile):
            return f"profile {profile.name} has no symmetric_memory"
        return "; ".join(runtime_problems(device))

    def _kernel(self, spec: AllReduceAddRmsNormSpec):
        if spec not in self._kernels:
            from dzc.targets import triton_codegen  # noqa: PLC0415

            found = problems(spec, self.profile, self._signal_pad_bytes())
            if found:
                raise ValueError(f"one-shot all_reduce_add_rms_norm refused for {spec.describe()}: "
                                 + "; ".join(found))
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            source = triton_source(spec, self.profile)
            key = hashlib.sha256(source.encode()).hexdigest()[:16]  # the same file name on every rank
            path = self.cache_dir / f"all_reduce_add_rms_norm_{key}.py"
            if not path.exists():
                path.write_text(source)
            config = self.config or triton_default_config(spec, self.profile)
            self._kernels[spec] = (triton_codegen.load_kernel(path, TRITON_KERNEL_NAME), config,
                                   max_programs(self.world, self._signal_pad_bytes()))
        return self._kernels[spec]

    @staticmethod
    def _signal_pad_bytes() -> int:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        return symm_mem.get_signal_pad_size()

    def _buffer(self, dtype: torch.dtype, hidden: int, rows: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        key = (dtype, hidden)
        if key not in self._buffers or self._buffers[key][0] < rows:
            capacity = 1 << max(rows - 1, 0).bit_length()
            tensor = symm_mem.empty(capacity * hidden, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(tensor, self.group.group_name)  # collective: every rank of the group
            self._buffers[key] = (capacity, tensor, handle)
        return self._buffers[key]

    def __call__(self, x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype,
                 compute_dtype=torch.float32, divide_by_rms=False):
        spec = spec_from_args(self.world, x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype,
                              sum_dtype, compute_dtype, divide_by_rms)
        hidden = spec.norm.hidden
        if residual.shape != x.shape or (weight is not None and tuple(weight.shape) != (hidden,)):
            raise ValueError(f"one-shot all_reduce_add_rms_norm: x {tuple(x.shape)}, residual "
                             f"{tuple(residual.shape)}, weight {None if weight is None else tuple(weight.shape)}")
        kernel, config, programs = self._kernel(spec)
        x2d, residual2d, y, h, y2d, h2d = add_rms_norm.residual_rows(hidden, out_dtype, sum_dtype, x, residual)
        n_rows = x2d.shape[0]
        _capacity, tensor, handle = self._buffer(x.dtype, hidden, n_rows, x.device)
        tensor[:n_rows * hidden].view(n_rows, hidden).copy_(x2d)
        weight = weight.contiguous() if weight is not None else None
        triton_launch(kernel, config, spec, handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, self.rank, n_rows,
                      residual2d, weight, eps, y2d, h2d, programs)
        return y, h
