"""Static legality of a kernel config for a device profile, checked before anything is compiled.

Every config the autotuner may try passes through here; tests run it over every emitted config of every
profile (MUSA included), so a config that a real card would reject never reaches it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dzc.targets.profiles import DeviceProfile


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def config_problems(
    profile: DeviceProfile, *, threads: int, num_warps: int | None, shared_memory_bytes: int,
    dtypes: Iterable[torch.dtype], cluster_size: int = 1,
) -> list[str]:
    """Why a launch shape is illegal on `profile`; empty when it is legal.

    threads: threads per block. num_warps: Triton's warp count (None for TileLang, which states threads).
    cluster_size: CTAs a thread block cluster (1: none).
    """
    problems = []
    if threads > profile.max_threads_per_block:
        problems.append(f"{threads} threads > {profile.max_threads_per_block} per block")
    if threads % profile.warp_size:
        problems.append(f"{threads} threads is not a multiple of the warp size {profile.warp_size}")
    if num_warps is not None:
        if not _is_power_of_two(num_warps):
            problems.append(f"num_warps={num_warps} is not a power of two")
        if num_warps > profile.max_num_warps:
            problems.append(f"num_warps={num_warps} > {profile.max_num_warps} ({profile.warp_size}-lane warps)")
    if shared_memory_bytes > profile.shared_memory_per_block:
        problems.append(f"{shared_memory_bytes} B shared memory > {profile.shared_memory_per_block} B")
    if cluster_size > 1 and not profile.thread_block_clusters:
        problems.append(f"thread block clusters of {cluster_size}: {profile.arch} has none")
    for dtype in dtypes:
        if not profile.supports_dtype(dtype):
            problems.append(f"{dtype} is not native on {profile.arch}")
    return problems


def tilelang_config_legal(profile: DeviceProfile, config, shared_memory_bytes: int,
                          dtypes: Iterable[torch.dtype]) -> bool:
    """Whether a TileLang config, which states its block's THREADS (no warp-count rule) and its cluster's CTAs
    (CLUSTER, 1 if absent), is legal on `profile`: the families' config spaces keep only these."""
    return not config_problems(profile, threads=config["THREADS"], num_warps=None,
                               shared_memory_bytes=shared_memory_bytes, dtypes=dtypes,
                               cluster_size=dict(config.params).get("CLUSTER", 1))


def warp_specialization_problems(profile: DeviceProfile, knob: str) -> list[str]:
    """Why `profile` has no warp-specialized TileLang kernel (a producer warpgroup feeding wgmma consumers through
    mbarrier-completed copies) for the config knob `knob`; empty where it has one."""
    problems = []
    if profile.matrix_instruction != "wgmma":
        problems.append(f"{knob} needs warpgroup MMAs (wgmma): {profile.name} has {profile.matrix_instruction}")
    if not profile.bulk_tensor_copies:
        problems.append(f"{knob} needs Hopper's async proxy (mbarrier-completed copies, setmaxnreg, "
                        f"fence.proxy.async): {profile.name} has no warp-specialized lowering")
    return problems
