"""Where does an MXFP4 decode GEMM lose bandwidth? Times one expert GEMM y[p] = W[e_p] @ x[p] (W packed MXFP4
[E, N, K], one row per expert, as at decode) in variants that add one cost at a time, on the present GPU:

    load        stream the packed bytes and scales only (sum them): the tiling's attainable bandwidth
    arith+*     decode with dzc's arithmetic decoder (integer ops per element; the MUSA-legal one)
    lut+*       decode with the CUDA byte-permute lookup (inline PTX, four values per few instructions)
    *+fma       no tensor cores: fp32 multiply-adds, one reduction after the K loop (GEMV)
    *+dot_x     tl.dot with the activation rows as M (rows padded to 16): the layout dzc's kernel has used
    *+dot_w     tl.dot with the weight rows as M (swap AB) and the rows as N
    --tma 1     the packed bytes by TMA (a host tensor descriptor over [E, N, K/2]; Hopper). With the K loop's
                stages given explicitly (tl.range num_stages), Triton 3.6 pipelines descriptor loads into
                `stages - 1` shared-memory buffers whatever consumes them (AOT for sm_90: 3 buffers at 4 stages);
                plain loads that feed register arithmetic it leaves unpipelined either way

    python tools/diagnose_mxfp4_decode.py [--hidden 2880 --out-features 5760 --experts 128] [--rows 4 32]

Prints a table: µs and bandwidth (packed bytes + scales of the touched experts ÷ time, vs 4.8 TB/s) per variant
and tiling, and checks each GEMM variant against a dequantize-then-matmul reference first.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from dataclasses import replace
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.language as tl
import triton.testing

from dzc import mxfp4
from dzc.targets import mxfp4_moe as family
from dzc.targets.generated_module import import_generated
from dzc.targets.profiles import SM_90

# The generated module's decoders (set in main before any launch): the lookup one and the arithmetic one.
LUT = None
ARITHMETIC = None

PEAK_BYTES_PER_S = 4.8e12


@triton.jit
def _tile(blocks_ptr, scales_ptr, expert, n0, k0, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    rows = n0 + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    base = expert.to(tl.int64) * N
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    mask = row_mask[:, None] & (groups < K // 32)[None, :]
    if TMA:  # blocks_ptr is a descriptor over [E, N, K/2] with block [1, BLOCK_N, BLOCK_K/2]; past N or K: zeros
        packed = tl.reshape(blocks_ptr.load([expert, n0, k0 // 2]), [BLOCK_N, BLOCK_K // 32, 16])
    else:
        packed = tl.load(blocks_ptr + (base + rows)[:, None, None] * (K // 2) + groups[None, :, None] * 16
                         + tl.arange(0, 16)[None, None, :], mask=mask[:, :, None], other=0)
    scales = tl.load(scales_ptr + (base + rows)[:, None] * (K // 32) + groups[None, :], mask=mask, other=127)
    return packed, scales


@triton.jit
def gemv_kernel(x_ptr, ids_ptr, blocks_ptr, scales_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODER: tl.constexpr, PRODUCT: tl.constexpr,
                PREFETCH: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr):
    p = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(ids_ptr + p)
    HALF: tl.constexpr = BLOCK_K // 2
    if PRODUCT == "fma" or PRODUCT == "load":
        acc2 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    # Tiles are loaded PREFETCH steps ahead of their use (by hand: Triton does not pipeline loads whose values
    # feed register arithmetic), so that many loads per program are in flight.
    packed, scales = _tile(blocks_ptr, scales_ptr, expert, n0, 0, N, K, BLOCK_N, BLOCK_K, TMA)
    if PREFETCH >= 1:
        packed1, scales1 = _tile(blocks_ptr, scales_ptr, expert, n0, BLOCK_K, N, K, BLOCK_N, BLOCK_K, TMA)
    if PREFETCH >= 2:
        packed2, scales2 = _tile(blocks_ptr, scales_ptr, expert, n0, 2 * BLOCK_K, N, K, BLOCK_N, BLOCK_K, TMA)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if PREFETCH == 0:
            packed, scales = _tile(blocks_ptr, scales_ptr, expert, n0, k0, N, K, BLOCK_N, BLOCK_K, TMA)
        if PREFETCH == 1:
            ahead, ahead_scales = _tile(blocks_ptr, scales_ptr, expert, n0, k0 + BLOCK_K, N, K, BLOCK_N, BLOCK_K,
                                        TMA)
        if PREFETCH == 2:
            ahead, ahead_scales = _tile(blocks_ptr, scales_ptr, expert, n0, k0 + 3 * BLOCK_K, N, K, BLOCK_N,
                                        BLOCK_K, TMA)
        if PRODUCT == "load":
            acc2 = acc2 + tl.reshape(packed.to(tl.float32) + scales.to(tl.float32)[:, :, None], [BLOCK_N, HALF])
        else:
            if DECODER == "lut":
                even, odd = LUT._decode_mxfp4(packed, scales, BLOCK_N, BLOCK_K, False)
            else:
                even, odd = ARITHMETIC._decode_mxfp4(packed, scales, BLOCK_N, BLOCK_K, False)
            columns = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + p * K + columns, mask=columns < K, other=0.0).to(tl.float32)
            x_even, x_odd = tl.split(tl.reshape(x, [HALF, 2]))
            if PRODUCT == "fma":
                acc2 += even.to(tl.float32) * x_even[None, :] + odd.to(tl.float32) * x_odd[None, :]
            elif PRODUCT == "dot_w":
                xe = tl.broadcast_to(x_even[:, None], [HALF, 16]).to(tl.bfloat16)
                xo = tl.broadcast_to(x_odd[:, None], [HALF, 16]).to(tl.bfloat16)
                acc = tl.dot(odd, xo, tl.dot(even, xe, acc))
            else:  # dot_x: [16, HALF] @ [HALF, BLOCK_N], result transposed into acc
                xe = tl.broadcast_to(x_even[None, :], [16, HALF]).to(tl.bfloat16)
                xo = tl.broadcast_to(x_odd[None, :], [16, HALF]).to(tl.bfloat16)
                acc += tl.trans(tl.dot(xo, tl.trans(odd), tl.dot(xe, tl.trans(even))))
        if PREFETCH == 1:
            packed, scales = ahead, ahead_scales
        if PREFETCH == 2:
            packed, scales, packed1, scales1, packed2, scales2 = packed1, scales1, packed2, scales2, ahead, ahead_scales
    if PRODUCT == "fma" or PRODUCT == "load":
        y = tl.sum(acc2, axis=1)
    else:
        y = tl.max(acc, axis=1)  # every column of acc holds the same row product
    rows = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + p * N + rows, y, mask=rows < N)


def generated_module(profile):
    """dzc's generated mxfp4_moe module for gpt-oss shapes on `profile` (its decoder is what we call)."""
    spec = family.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, None, None, "silu_glu", True)
    path = Path(tempfile.mkdtemp()) / f"mxfp4_decode_{'lut' if profile.triton_inline_asm else 'arith'}.py"
    path.write_text(family.triton_source(spec, profile))
    return import_generated(path)


def reference(x, ids, blocks, scales):
    return torch.stack([x[p].float() @ mxfp4.dequantize(blocks[e], scales[e], torch.float32).T
                        for p, e in enumerate(ids.tolist())])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2880)  # K
    parser.add_argument("--out-features", type=int, default=5760)  # N (gpt-oss gate/up: 2 * 2880)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--variants", nargs="+",
                        default=["load", "arith+fma", "lut+fma", "arith+dot_x", "lut+dot_x", "lut+dot_w"])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    parser.add_argument("--tma", type=int, nargs="+", default=[0], choices=[0, 1],
                        help="1: the packed bytes by TMA descriptor loads (CUDA sm_90+)")
    parser.add_argument("--check-only", action="store_true",
                        help="numerics only (runs on the CPU through Triton's interpreter with small shapes)")
    args = parser.parse_args()
    global LUT, ARITHMETIC
    LUT, ARITHMETIC = (generated_module(profile) for profile in (SM_90, replace(SM_90, triton_inline_asm=False)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device).manual_seed(0)
    k, n, e = args.hidden, args.out_features, args.experts
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, device=device, generator=gen)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{device_name}; torch {torch.__version__}; triton {triton.__version__}; N={n} K={k} E={e}")
    print("| rows | variant | BLOCK_N | BLOCK_K | warps | stages | prefetch | µs | TB/s | % of 4.8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if 1 in args.tma:
        # TMA requires 16-byte aligned strides: K/2 bytes per weight row.
        from triton.tools.tensor_descriptor import TensorDescriptor
        if device.type == "cuda":  # descriptors need device memory from an allocator where built in-kernel
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    for rows in args.rows:
        ids = torch.randperm(e, device=device, generator=gen)[:rows].to(torch.int32)
        x = torch.randn(rows, k, device=device, generator=gen).bfloat16()
        expected = reference(x, ids, blocks, scales)
        touched = rows * (n * k // 2 + n * k // 32)
        if not args.check_only:
            copy_us = triton.testing.do_bench(lambda: blocks[ids.long()].sum(dtype=torch.int32), rep=50) * 1e3
            print(f"| {rows} | torch gather+sum of the touched blocks | | | | | | {copy_us:.1f} | | |")
        for variant, bn, bk, warps, stages, prefetch, tma in itertools.product(
                args.variants, args.block_n, args.block_k, args.warps, args.stages, args.prefetch, args.tma):
            decoder, _, product = variant.partition("+")
            product = product or "load"
            row = f"| {rows} | {variant}{' tma' if tma else ''} | {bn} | {bk} | {warps} | {stages} | {prefetch} |"
            source = (TensorDescriptor.from_tensor(blocks.view(e, n, k // 2), [1, bn, bk // 2]) if tma
                      else blocks)
            y = torch.full((rows, n), float("nan"), device=device)

            def call():
                gemv_kernel[(rows, triton.cdiv(n, bn))](x, ids, source, scales, y, N=n, K=k, BLOCK_N=bn, BLOCK_K=bk,
                                                        DECODER=decoder, PRODUCT=product, PREFETCH=prefetch,
                                                        TMA=tma, STAGES=stages, num_warps=warps, num_stages=stages)

            try:
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as err:  # a tiling the compiler rejects: report it and go on
                print(f"{row} failed: {' '.join(str(err).split())[:300]} | | |")
                continue
            if product != "load":
                error = (y - expected).abs().max().item()
                scale = expected.abs().max().item()
                if not error <= 1e-2 * scale:
                    print(f"{row} WRONG: max error {error:.3g} vs {scale:.3g} | | |")
                    continue
            if args.check_only:
                print(f"{row} correct | | |")
                continue
            us = triton.testing.do_bench(call, rep=50) * 1e3
            rate = touched / (us * 1e-6)
            print(f"{row} {us:.1f} | {rate / 1e12:.2f} | {100 * rate / PEAK_BYTES_PER_S:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
