"""Kernels for dzc.dsa_topk: exact top-k positions per row, by sampled bounds and radix select (no sort of the row).

Each fp32 logit maps to a uint32 key with the same order. A sorted sample of SAMPLE evenly spaced keys gives two
keys that bracket the k-th largest with high probability; one sweep counts the keys above the upper one and keeps
the positions between the two (at most CANDIDATES, in a per-row scratch); when the counts prove the bracket holds,
radix select (histogram passes of RADIX_BITS-bit digits) runs over those candidates only, else over the whole row
(read once per pass). A last sweep writes every key above the k-th largest and the first equal ones (smaller
position first) in position order, so the output is ascending and deterministic, −1-padded when fewer than k exist.
One program per row, reading it in BLOCK-position chunks.

Why (H200, session 16, docs/results/dsa_topk_parts_h200.md): on a 32K row a 256-bin histogram costs ~10 µs and a
whole-row prefix sum more when the row is kept in registers (spills), so the earlier form, four histogram passes
over the whole row and a two-sum write, took ~100 µs where one read of the row takes 4. The sampled form makes
two sweeps of the row plus passes over ~1.5K candidates.

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


# Sample size and candidate capacity of the tuned configs. With k = 2048 the bracket holds ~1.5K candidates of a
# 32K row and ~3K of a 128K row (4 standard deviations of the sample rank each side); a row whose candidates
# overflow (very long rows, heavy ties) takes the whole-row radix select, and is still exact.
SAMPLE = 2048
CANDIDATES = 4096


def triton_configs(spec: DsaTopkSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Chunk size × warps (4..16 positions a thread: whole-row temporaries stay in registers) with the sampled
    bounds, and the whole-row radix select alone (SAMPLE = 0) in the default chunking, timed beside them."""
    configs = []
    for block in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8, 16, 32):
            per_thread = block // (num_warps * profile.warp_size)
            if 4 <= per_thread <= 16:
                configs.append(KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block, RADIX_BITS=8,
                                                 SAMPLE=SAMPLE, CANDIDATES=CANDIDATES))
    return [*configs, radix_config(profile)]


def _with_chunk(profile: DeviceProfile, block: int, sample: int = SAMPLE) -> KernelConfig:
    """8 positions a thread (as many warps as the profile has, 4 at least)."""
    num_warps = min(profile.max_num_warps, max(4, block // (8 * profile.warp_size)))
    return KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block, RADIX_BITS=8, SAMPLE=sample,
                             CANDIDATES=CANDIDATES if sample else 0)


def triton_default_config(spec: DsaTopkSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice without a width: 4096-position chunks, sampled bounds."""
    return _with_chunk(profile, 4096)


def radix_config(profile: DeviceProfile) -> KernelConfig:
    """The whole-row radix select alone (no sample): the form before the sampled bounds, for benchmarks."""
    return _with_chunk(profile, 4096, sample=0)


def configs_for_bucket(spec: DsaTopkSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """Chunks no wider than the row (a wider one only masks lanes), or the narrowest the profile takes: the untuned
    choice is the row's width up to 4096 positions at 8 a thread where that is legal, else the narrowest legal
    chunk; tuning times those chunks and the whole-row radix select."""
    sampled = [c for c in configs if c["SAMPLE"]]
    if not sampled:
        return configs, default
    widest = max(bucket, min(c["BLOCK"] for c in sampled))
    candidates = [c for c in configs if c["BLOCK"] <= widest or not c["SAMPLE"]]
    chosen = _with_chunk(profile, min(widest, 4096))
    if chosen not in candidates:  # e.g. 1024 positions at 8 a thread need fewer threads than a MUSA warp group
        chosen = min((c for c in candidates if c["SAMPLE"]), key=lambda c: (c["BLOCK"], c.num_warps))
    return candidates, chosen


def triton_shared_memory_bytes(spec: DsaTopkSpec, config: KernelConfig) -> int:
    """The histogram's bins, and the largest of the phases' cross-warp scratch (reused between them): the chunk's
    prefix sums, the sample's sort, the candidates' keys; one int32 each."""
    return 4 * (1 << config["RADIX_BITS"]) + 4 * max(config["BLOCK"], config["SAMPLE"], config["CANDIDATES"])


def triton_launch(kernel, config: KernelConfig, logits, lengths, k, indices, scratch):
    rows, width = logits.shape
    kernel[(rows,)](logits, lengths, indices, scratch, width, k,
                    logits.stride(0), logits.stride(1), indices.stride(0), indices.stride(1), scratch.stride(0),
                    BLOCK=config["BLOCK"], RADIX_BITS=config["RADIX_BITS"], SAMPLE=config["SAMPLE"],
                    CANDIDATES=config["CANDIDATES"], num_warps=config.num_warps, num_stages=config.num_stages)


def triton_signature(spec: DsaTopkSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed)."""
    signature = {"logits_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*i32", "scratch_ptr": "*i32",
                 "n_cols": "i32", "k": "i32", "stride_lt": "i32", "stride_ls": "i32", "stride_ot": "i32",
                 "stride_ok": "i32", "stride_st": "i32", "BLOCK": "constexpr", "RADIX_BITS": "constexpr",
                 "SAMPLE": "constexpr", "CANDIDATES": "constexpr"}
    return signature, {name: config[name] for name in ("BLOCK", "RADIX_BITS", "SAMPLE", "CANDIDATES")}


def prepare(spec: DsaTopkSpec, logits, lengths, k, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated: the indices and the candidates' scratch), the
    row width (0 without rows), the op's result)."""
    dsa_ops.check_dsa_topk_args(logits, lengths, k)
    k = int(k)
    indices = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    scratch = torch.empty(logits.shape[0], CANDIDATES, dtype=torch.int32, device=logits.device)
    # The kernel indexes lengths as a dense vector (a strided one was read at the wrong elements).
    work = max(logits.shape[1], 1) if logits.shape[0] else 0  # the row width picks the config (token_bucket)
    return (logits, lengths.contiguous(), k), (indices, scratch), work, indices


def selftest_cases(profile: DeviceProfile):
    """Named small cases for dzc-selftest: rows longer and shorter than k (and empty), distinct and tied logits."""
    build = functools.partial(dsa_cases.topk_args, 4, 256, [256, 10, 100, 0], 16)
    return [("distinct", build), ("ties", functools.partial(build, ties=True))]
