"""Kernels for dzc.dsa_topk: exact top-k positions per row by radix select (no sort).

Each fp32 logit maps to a uint32 key with the same order. Histogram passes over RADIX_BITS-bit digits, each
restricted to the keys that start with the threshold prefix found so far, find the k-th largest key among
positions [0, lengths[t]); a last pass writes every key above it and the first equal ones (smaller position
first) in position order, so the output is ascending and deterministic, −1-padded when fewer than k exist.
A pass stops early once every key with the prefix is a winner. One program per row: a row of at most BLOCK
positions is read once and kept in registers through every pass; a longer one is read 1 + (passes run) times, at
most 32 / RADIX_BITS + 1 (H200, session 15: the streamed form, 4096-position chunks, took 102 µs for 2 rows of
32K where the public TileLang tl_topk took 25; the resident form is what the next measurement compares).

Tuning bucket: the row width rounded up to a power of two (the config is a per-row choice; rows only fill the
grid).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc.ops import dsa as dsa_ops
from dzc.targets import dsa_cases
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class DsaTopkSpec:
    """The kernel is the same for every k, width and row count (run-time values); only the dtype is fixed."""

    logits_dtype: torch.dtype = torch.float32

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.logits_dtype,)  # legality checks float dtypes (indices are int32 everywhere)

    def describe(self) -> str:
        return "logits=float32 indices=int32"


def spec_from_node(node) -> DsaTopkSpec:
    logits, lengths = (node.args[i].meta["val"] for i in range(2))
    dsa_ops.check_dsa_topk_args(logits, lengths, node.args[2])
    return DsaTopkSpec()


def token_bucket(tokens: int) -> int:
    """`tokens` is the row width (prepare's work); tuning results are kept per power of two of it."""
    return 1 << max(tokens - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAME = "dsa_topk_kernel"


def triton_source(spec: DsaTopkSpec, profile: DeviceProfile) -> str:
    return Template((TEMPLATES / "dsa_topk.triton.py.tmpl").read_text()).substitute(profile=profile.name)


# Widest row kept in registers by the untuned choice: 32 positions per thread at 32 warps (Triton 3.6, sm_90:
# 64 registers a thread, 1.9 KB of spills; 16 warps x 64 positions spill 3.3 KB).
RESIDENT_ROWS = 32768


def triton_configs(spec: DsaTopkSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Elements per chunk × digit width (8 bits: 4 histogram passes of 256 bins; 4 bits: 8 passes of 16) ×
    warps. A chunk gives each thread 4..64 elements; rows up to the chunk stay in registers."""
    configs = []
    for block in (1024, 2048, 4096, 8192, 16384, 32768):
        for radix_bits in (4, 8):
            for num_warps in (4, 8, 16, 32):
                per_thread = block // (num_warps * profile.warp_size)
                if 4 <= per_thread <= 64:
                    configs.append(KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block,
                                                     RADIX_BITS=radix_bits))
    return configs


def triton_default_config(spec: DsaTopkSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice without a width: 4096-element chunks, 8-bit digits, 8 elements per thread."""
    num_warps = min(profile.max_num_warps, 4096 // (8 * profile.warp_size))
    return KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=4096, RADIX_BITS=8)


def configs_for_bucket(spec: DsaTopkSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """Rows of up to RESIDENT_ROWS positions: the untuned choice keeps the row in registers (one read instead of
    one per pass) with 8..32 positions per thread, where that config is legal on the profile (its shared memory),
    else the streamed default. Tuning then times only the resident configs (chunk = the bucket: digit widths,
    warps) and the streamed default: a wider chunk only masks lanes, a narrower one re-reads the row each pass, and
    compiling all ~40 configs took the H200 over two minutes for one 32K bucket. Wider rows time every config."""
    if bucket > RESIDENT_ROWS:
        return configs, default
    block = max(bucket, 1024)
    num_warps = min(profile.max_num_warps, max(4, block // (16 * profile.warp_size)))
    resident = KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block, RADIX_BITS=8)
    candidates = [c for c in configs if c["BLOCK"] == block or c == default]
    return candidates, resident if resident in candidates else default


def triton_shared_memory_bytes(spec: DsaTopkSpec, config: KernelConfig) -> int:
    """The histogram's bins, and the chunk-wide prefix sums' (cumsum) cross-warp scratch: one int32 per element."""
    return 4 * (1 << config["RADIX_BITS"]) + 4 * config["BLOCK"]


def triton_launch(kernel, config: KernelConfig, logits, lengths, k, indices):
    rows, width = logits.shape
    kernel[(rows,)](logits, lengths, indices, width, k,
                    logits.stride(0), logits.stride(1), indices.stride(0), indices.stride(1),
                    BLOCK=config["BLOCK"], RADIX_BITS=config["RADIX_BITS"],
                    num_warps=config.num_warps, num_stages=config.num_stages)


def triton_signature(spec: DsaTopkSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed)."""
    signature = {"logits_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*i32", "n_cols": "i32", "k": "i32",
                 "stride_lt": "i32", "stride_ls": "i32", "stride_ot": "i32", "stride_ok": "i32",
                 "BLOCK": "constexpr", "RADIX_BITS": "constexpr"}
    return signature, {"BLOCK": config["BLOCK"], "RADIX_BITS": config["RADIX_BITS"]}


def prepare(spec: DsaTopkSpec, logits, lengths, k, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), the row width (0 without rows), the op's
    result)."""
    dsa_ops.check_dsa_topk_args(logits, lengths, k)
    k = int(k)
    indices = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    # The kernel indexes lengths as a dense vector (a strided one was read at the wrong elements).
    work = max(logits.shape[1], 1) if logits.shape[0] else 0  # the row width picks the config (token_bucket)
    return (logits, lengths.contiguous(), k), (indices,), work, indices


def selftest_cases(profile: DeviceProfile):
    """Named small cases for dzc-selftest: rows longer and shorter than k (and empty), distinct and tied logits."""
    build = functools.partial(dsa_cases.topk_args, 4, 256, [256, 10, 100, 0], 16)
    return [("distinct", build), ("ties", functools.partial(build, ties=True))]
