"""Leave NaN in every SM's shared memory, for GPU checks that a kernel reads only the shared memory it wrote.

Shared memory is not cleared between kernels: a kernel whose MMAs read outside their tiles (Triton 3.6's Hopper
wgmma over a V tile with 32-byte rows, session 15) reads whatever the kernels before it left there, and passes
by luck on clean memory. Launched right before the kernel under test on the same stream, poison_shared_memory
makes such a read come out NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _nan_matmul(a_ptr, b_ptr, out_ptr, K, M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A pipelined matmul of NaN tiles: its stages fill the SM's shared memory with NaN."""
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    acc = tl.zeros((M, N), tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
        acc = tl.dot(a, tl.load(b_ptr + ks[:, None] * N + cols[None, :]), acc)
    tl.store(out_ptr + tl.program_id(0) * M * N + rows[:, None] * N + cols[None, :], acc)


def poison_shared_memory(device: torch.device | str = "cuda") -> None:
    """NaN across (nearly) all of every SM's shared memory: 4 pipeline stages of 128x64 + 64x256 bf16 tiles (192
    KiB, under the H200's 227 KiB a block), two programs per SM."""
    m, n, k, block_k = 128, 256, 1024, 64
    a = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=device)
    b = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device=device)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(programs, m, n, device=device)
    _nan_matmul[(programs,)](a, b, out, k, M=m, N=n, BLOCK_K=block_k, num_warps=8, num_stages=4)
