"""Device profiles: the plain facts about a GPU architecture that code generation and tuning depend on.

Every CUDA-vs-MUSA difference that a pass, a template or the autotuner needs is a field here; nothing else in
dzc tests the vendor. Sources for the MUSA figures: ../shared/reference/musa.md §1 and §8.1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # "cuda:sm_90", the string users pass as target=
    vendor: str  # "nvidia" | "mthreads"; informational only, never branched on
    arch: str  # "sm_90", "mp_31"
    compute_capability: int  # 90, 31: what Triton's GPUTarget takes
    warp_size: int  # lanes per warp; one Triton num_warps unit is this many threads
    max_threads_per_block: int
    max_num_warps: int  # largest Triton num_warps the backend accepts
    shared_memory_per_block: int  # bytes a kernel may use (opt-in maximum)
    native_dtypes: tuple[str, ...]  # storage/compute dtypes with hardware support, torch names
    matrix_instruction: str  # "wgmma" | "mma_sync" | "mma_qy2" | "sqmma": what tl.dot / T.gemm lower to
    torch_device_type: str  # "cuda" | "musa": device type of tensors this target runs on
    triton_backend: str  # GPUTarget backend name: "cuda" | "musa"
    tilelang_target: str  # TileLang/TVM target string
    nvcc_gencode: str | None  # -gencode flags to compile TileLang's CUDA source here; None where nvcc cannot
    triton_tensor_descriptors: bool  # tl.make_tensor_descriptor is available on this target's Triton
    # tl.dot_scaled with an E2M1 operand compiles on this target's Triton (CUDA: decoded into the MMA operand's
    # registers by the compiler; unverified on the MUSA builds)
    triton_dot_scaled: bool
    compile_in_parallel: bool  # MUSA Triton builds fail when compiling in several processes at once
    triton_inline_asm: bool  # tl.inline_asm_elementwise (PTX) is available: CUDA only, no MUSA build has it
    peak_bandwidth_bytes_per_s: float  # datasheet figure; only used to print roofline fractions
    notes: str = ""
    # TileLang pass configs (tilelang.PassConfigKey member names) for this target's kernels; names the installed
    # TileLang lacks are skipped (upstream has only some of tilelang_musa's).
    tilelang_pass_configs: tuple[tuple[str, bool], ...] = ()
    # Extra device-compiler flags for TileLang kernels (mcc's on MUSA).
    tilelang_compile_flags: tuple[str, ...] = ()
    # Multi-device: the torch.distributed backend this target's collectives run on (dzc has no communication layer
    # of its own; "" where none is known), and whether peers' buffers can be mapped for a one-shot all-reduce kernel
    # (torch.distributed._symmetric_memory): dzc.distributed picks the backend by it, a one-shot all-reduce lowering
    # would read symmetric_memory; passes never read either.
    collective_backend: str = ""  # "nccl" | "mccl" (torch_musa's)
    symmetric_memory: bool = False
    # Tensor-descriptor loads are asynchronous bulk copies by a copy engine (Hopper's TMA); where False and
    # triton_tensor_descriptors is True, Triton emulates them with plain loads (sm_80).
    bulk_tensor_copies: bool = False
    # Thread block clusters: CTAs launched together on neighbouring SMs that read and write each other's shared
    # memory (DSMEM) and arrive on each other's mbarriers (Hopper+). False on MUSA: not known to exist there.
    thread_block_clusters: bool = False

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in self.native_dtypes

    @property
    def fingerprint(self) -> str:
        """Short hash of every field: part of every tuning-database key."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_FP32_FP16 = ("float32", "float16")

# What Moore Threads compiles its own TileLang kernels with (sglang hardware_backend/musa/jit_kernel/tilelang/
# utils.py; MATE gdn/sparse-MLA kernels; musa.md §4): no warp specialisation or TMA lowering, no fast math, MUSA
# burst loads and reductions. Left out on purpose: TL_DISABLE_SAFE_MEMORY_ACCESS, TL_DISABLE_THREAD_STORAGE_SYNC
# and TL_DISABLE_INDEX_TYPE_PROMOTION remove the bounds guards, automatic barriers and 64-bit indices that MT's
# hand-written kernels do without but dzc's generated templates rely on (padded rows, shared-memory reductions).
_MUSA_TILELANG_PASS_CONFIGS = (
    ("TL_DISABLE_WARP_SPECIALIZED", True), ("TL_DISABLE_TMA_LOWER", True), ("TL_ENABLE_FAST_MATH", False),
    ("TL_ENABLE_MUSA_BURST", True), ("TL_ENABLE_REDUCE_BURST", True),
)
# mcc flags of the same kernels; denormals flush to zero, as on MT's own kernels.
_MUSA_TILELANG_COMPILE_FLAGS = (
    "-Od3", "-fno-signed-zeros", "-fmusa-flush-denormals-to-zero", "-mllvm", "-misched=mtgpu-max-ilp",
    "-mllvm", "-mtgpu-if-convert=1", "-mllvm", "-mtgpu-tiny-offset-hint=1", "-mllvm", "-mtgpu-combine-fop-instr=1",
)

SM_90 = DeviceProfile(
    name="cuda:sm_90",
    vendor="nvidia",
    arch="sm_90",
    compute_capability=90,
    warp_size=32,
    max_threads_per_block=1024,
    max_num_warps=32,
    shared_memory_per_block=227 * 1024,
    native_dtypes=_FP32_FP16 + ("bfloat16", "float8_e4m3fn", "float8_e5m2"),
    matrix_instruction="wgmma",
    torch_device_type="cuda",
    triton_backend="cuda",
    tilelang_target="cuda -arch=sm_90a",
    nvcc_gencode="-gencode arch=compute_90a,code=sm_90a",
    triton_tensor_descriptors=True,
    triton_dot_scaled=True,
    compile_in_parallel=True,
    triton_inline_asm=True,
    peak_bandwidth_bytes_per_s=4.8e12,  # H200; H100 SXM is 3.35e12
    notes="H100/H200 (Hopper)",
    collective_backend="nccl",
    symmetric_memory=True,  # NVLink peers; multicast (NVLS) is never used
    bulk_tensor_copies=True,
    thread_block_clusters=True,
)

SM_80 = DeviceProfile(
    name="cuda:sm_80",
    vendor="nvidia",
    arch="sm_80",
    compute_capability=80,
    warp_size=32,
    max_threads_per_block=1024,
    max_num_warps=32,
    shared_memory_per_block=163 * 1024,
    native_dtypes=_FP32_FP16 + ("bfloat16",),
    matrix_instruction="mma_sync",
    torch_device_type="cuda",
    triton_backend="cuda",
    tilelang_target="cuda -arch=sm_80",
    nvcc_gencode="-gencode arch=compute_80,code=sm_80",
    triton_tensor_descriptors=True,
    triton_dot_scaled=True,
    compile_in_parallel=True,
    triton_inline_asm=True,
    peak_bandwidth_bytes_per_s=2.0e12,  # A100 80GB SXM
    notes="A100 (Ampere)",
    collective_backend="nccl",
    symmetric_memory=True,  # NVLink peers; multicast (NVLS) is never used
)

MP_22 = DeviceProfile(
    name="musa:mp_22",
    vendor="mthreads",
    arch="mp_22",
    compute_capability=22,
    warp_size=128,  # QY2: one warp is 128 lanes, so num_warps <= 8 (musa.md §1.1)
    max_threads_per_block=1024,
    max_num_warps=8,
    shared_memory_per_block=72 * 1024,
    native_dtypes=_FP32_FP16 + ("bfloat16",),  # no fp8 (musa.md §1.4)
    matrix_instruction="mma_qy2",
    torch_device_type="musa",
    triton_backend="musa",
    tilelang_target="musa -arch=mp_22",
    nvcc_gencode=None,
    triton_tensor_descriptors=False,  # the vendor's Triton 3.2 build lacks them
    triton_dot_scaled=False,  # not verified on a MUSA build: kept off until a card runs it
    compile_in_parallel=False,
    triton_inline_asm=False,
    peak_bandwidth_bytes_per_s=768e9,
    notes="MTT S4000 (QY2)",
    tilelang_pass_configs=_MUSA_TILELANG_PASS_CONFIGS,
    tilelang_compile_flags=_MUSA_TILELANG_COMPILE_FLAGS,
    collective_backend="mccl",
    symmetric_memory=False,  # not assumed on MUSA
)

MP_31 = DeviceProfile(
    name="musa:mp_31",
    vendor="mthreads",
    arch="mp_31",
    compute_capability=31,
    warp_size=32,
    max_threads_per_block=1024,
    max_num_warps=32,
    shared_memory_per_block=192 * 1024,
    native_dtypes=_FP32_FP16 + ("bfloat16", "float8_e4m3fn", "float8_e5m2"),
    matrix_instruction="sqmma",
    torch_device_type="musa",
    triton_backend="musa",
    tilelang_target="musa -arch=mp_31",
    nvcc_gencode=None,
    triton_tensor_descriptors=False,  # only FlagTree >= 3.6 has them; probed at run time on a real card
    triton_dot_scaled=False,  # not verified on a MUSA build: kept off until a card runs it
    compile_in_parallel=False,
    triton_inline_asm=False,
    peak_bandwidth_bytes_per_s=1.6e12,
    notes="MTT S5000 (PH1)",
    tilelang_pass_configs=_MUSA_TILELANG_PASS_CONFIGS,
    tilelang_compile_flags=_MUSA_TILELANG_COMPILE_FLAGS,
    collective_backend="mccl",
    symmetric_memory=False,  # not assumed on MUSA
)
