"""Where an mxfp4_moe kernel's result departs from the op's reference: each GEMM checked on its own.

The layer tests compare only the final output. When a kernel is wrong on a device (TileLang's W4A16 kernels and
Triton's W4A8 kernels on the H200, 2026-12-01: TileLang's with fp32 activations, W4A8's were right within FP8
rounding flips) this tool splits the layer at its one intermediate, the activation
`act` (one row per routed pair, in routing order), and reports per GEMM:
  gate/up: the kernel's act against the reference's act for the same rows (max error, in units of the
           hidden dtype's ulp, how many elements differ, which rows/columns);
  down:    the kernel's down GEMM fed the *reference's* act (TileLang) or its own act (W4A8: re-quantized by the
           reference), against the reference's down GEMM of that act.
So a wrong GEMM shows as itself, and rounding flips (an act one ulp off that re-quantizes to another E4M3 value)
show as what they are.

    python tools/diagnose_mxfp4_moe_numerics.py --codegen tilelang      # every self-test case, several configs
    python tools/diagnose_mxfp4_moe_numerics.py --codegen w4a8          # the W4A8 test cases and a gpt-oss layer
    python tools/diagnose_mxfp4_moe_numerics.py --dry-run               # CPU: build the cases and references only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from dzc.ops.mxfp4_moe import (_dequantized_matmul, _fp8_weight_matmul, glu_activation, mxfp4_moe_reference,
                               mxfp4_moe_w4a8_reference, quantize_e4m3_groups)
from dzc.targets import mxfp4_moe as family
from dzc.targets.profiles import SM_90


def _gemm(w4a8: bool):
    """The op reference's GEMM (rows [R, K] times one MXFP4 weight): W4A8's or W4A16's."""
    return _fp8_weight_matmul if w4a8 else _dequantized_matmul


def reference_act(args, sorted_pairs: torch.Tensor, w4a8: bool) -> torch.Tensor:
    """act for each routed pair in routing order (rows of sorted_pairs), as the op's reference computes it."""
    (hidden, topk_ids, _, w13_blocks, w13_scales, w13_bias, *_rest) = args
    activation, interleaved, alpha, limit = args[9:13]
    top_k = topk_ids.shape[1]
    pairs = sorted_pairs.long().cpu()
    tokens, experts = pairs // top_k, topk_ids.reshape(-1).long().cpu()[pairs]
    x = hidden.float().cpu()
    act = torch.empty(len(pairs), w13_scales.shape[1] // 2)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().squeeze(1)
        a = x[tokens[rows]]
        gate_up = _gemm(w4a8)(a, w13_blocks[e].cpu(), w13_scales[e].cpu())
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float().cpu()
        act[rows] = glu_activation(gate_up, activation, interleaved, alpha, limit).to(hidden.dtype).float()
    return act


def reference_down(args, sorted_pairs: torch.Tensor, act: torch.Tensor, w4a8: bool) -> torch.Tensor:
    """pair_out [P, H] (fp32, indexed by pair) of the down GEMM on `act` (routing order), weighted, with bias."""
    (hidden, topk_ids, topk_weights, _, _, _, w2_blocks, w2_scales, w2_bias) = args[:9]
    pairs = sorted_pairs.long().cpu()
    experts = topk_ids.reshape(-1).long().cpu()[pairs]
    out = torch.empty(len(pairs), hidden.shape[1])
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().squeeze(1)
        a = act[rows]
        y = _gemm(w4a8)(a, w2_blocks[e].cpu(), w2_scales[e].cpu())
        if w2_bias is not None:
            y = y + w2_bias[e].float().cpu()
        out[pairs[rows]] = y * topk_weights.reshape(-1).float().cpu()[pairs[rows], None]
    return out


def ulps(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|actual - expected| in units of dtype's ulp at |expected| (fp32 values)."""
    mantissa_bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    exponent = torch.frexp(expected.abs().clamp(min=2.0**-120))[1]
    return (actual - expected).abs() / torch.ldexp(torch.ones_like(expected), exponent - mantissa_bits)


def describe(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    scale = expected.abs().max().item()
    diff = (actual - expected).abs()
    nan = int(actual.isnan().sum())
    finite = diff[~diff.isnan()]
    worst = finite.max().item() if finite.numel() else float("nan")
    line = f"  {name:<34} max |err| {worst:.3g} of scale {scale:.3g} ({worst / max(scale, 1e-30):.2e}); nan {nan}"
    if dtype is not None:
        u = ulps(actual, expected, dtype)
        line += f"; >1 ulp: {int((u > 1).sum())}/{u.numel()}, max {u[~u.isnan()].max().item():.3g} ulp"
    bad = (diff > 2**-7 * scale) | diff.isnan()
    if bad.any():
        rows, cols = bad.nonzero(as_tuple=True)
        line += (f"\n    wrong: {int(bad.sum())}/{bad.numel()} elements, rows {sorted(set(rows.tolist()))[:12]}, "
                 f"cols {sorted(set(cols.tolist()))[:12]}")
    return line


class Capture:
    """Wraps one kernel of a loaded module: records the first argument of every launch (grid syntax kept)."""

    def __init__(self, kernel):
        self.kernel, self.first_args = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.first_args.append(args[0])
            return self.kernel[grid](*args, **kwargs)
        return launch


def diagnose_w4a8(device, seed: int, workdir: Path, dry_run: bool) -> None:
    from dzc.targets import triton_codegen
    from dzc.targets.kernel_config import KernelConfig

    # Prefill sizes: the op quantizes from 128 rows per expert on (dzc.ops.mxfp4_moe.fp8_applies).
    cases = [("float32 T128", dict(tokens=128, hidden=160, inter=96, experts=2, top_k=2, dtype=torch.float32),
              KernelConfig.make(4, 2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1)),
             ("float32 T200 skewed", dict(tokens=200, hidden=160, inter=96, experts=3, top_k=2,
                                          dtype=torch.float32, skew=3.0),
              KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1)),
             ("bf16 gpt-oss-like T256", dict(tokens=256, hidden=2880, inter=2880, experts=8, top_k=4),
              KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1))]
    for name, shape, config in cases:
        print(f"W4A8 {name}: {config}")
        if dry_run and shape["hidden"] > 256:
            continue  # the large layer: quantizing its weights takes ~10 s on the CPU, its CPU reference minutes
        args = family.random_moe_args(device, torch.Generator().manual_seed(seed), **shape)
        spec = family.spec_from_args(*args[:11], fp8_activations=True)
        if dry_run:
            reference_act(args, torch.arange(args[1].numel(), dtype=torch.int32), True)
            continue
        path = workdir / f"w4a8_{abs(hash(spec))}.py"
        path.write_text(family.triton_source(spec, SM_90))
        kernels = dict(triton_codegen.load(family, path, spec, SM_90))
        capture = Capture(kernels["moe_quantize_e4m3_kernel"])
        kernels["moe_quantize_e4m3_kernel"] = capture
        inputs, (out,), _, _ = family.prepare(spec, *args)
        out.fill_(float("nan"))
        family.triton_launch(kernels, config, *inputs, out)
        torch.cuda.synchronize()
        act = capture.first_args[1].float().cpu()  # the second quantize launch takes the activation
        columns = torch.arange(act.shape[1])
        act = act[:, columns // 32 * 32 + columns % 2 * 16 + columns % 32 // 2]  # stored in nibble order
        plan = family.route(args[1].reshape(-1), spec.experts, config["BLOCK_M"])
        sorted_pairs = plan.sorted_pairs.cpu()
        expected_act = reference_act(args, sorted_pairs, True)
        print(describe("gate/up act vs reference", act, expected_act, spec.hidden_dtype))
        q_kernel, _ = quantize_e4m3_groups(act)
        q_ref, _ = quantize_e4m3_groups(expected_act)
        print(f"  act E4M3 values differing after quantization: {int((q_kernel != q_ref).sum())}/{q_ref.numel()}")
        own = reference_down(args, sorted_pairs, act, True)
        top_k = args[1].shape[1]
        from_own = own.reshape(-1, top_k, own.shape[1]).sum(1).to(spec.hidden_dtype)
        print(describe("layer vs reference on kernel's act", out, from_own, spec.hidden_dtype))
        print(describe("layer vs W4A8 reference", out, mxfp4_moe_w4a8_reference(*args)))
        print(describe("layer vs W4A16 reference", out, mxfp4_moe_reference(*args)))


def diagnose_tilelang(device, seed: int, workdir: Path, dry_run: bool, cases: list[str], max_configs: int) -> None:
    from dzc.targets import tilelang_codegen

    for name, build in family.selftest_cases(SM_90):
        if cases and not any(c in name for c in cases):
            continue
        args = build(device, torch.Generator(device=device).manual_seed(seed))
        spec = family.spec_from_args(*args[:11])
        if not family.tilelang_supports(spec):
            print(f"TileLang {name}: no TileLang kernel for this spec (see targets.mxfp4_moe.tilelang_supports)")
            continue
        configs = family.tilelang_configs(spec, SM_90)
        default = family.tilelang_default_config(spec, SM_90)
        picks = [default] + [c for c in configs if c != default and (
            (c["BLOCK_M"], c["NUM_STAGES"], c["THREADS"]) in {(64, 2, 128), (16, 2, 128), (16, 1, 256)})]
        picks = picks[:max_configs]
        print(f"TileLang {name}: {len(configs)} configs, trying {len(picks)}")
        if dry_run:
            continue
        path = workdir / f"tl_{abs(hash(spec))}.py"
        path.write_text(family.tilelang_source(spec, SM_90))
        kernels = tilelang_codegen.load(family, path, spec, SM_90)
        inputs, (out,), _, _ = family.prepare(spec, *args)
        hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias = inputs[:9]
        alpha, limit = inputs[9:11]
        shape = family._LaunchShape.of(hidden, topk_ids, w13_scales)
        pairs = hidden.shape[0] * shape.top_k
        for config in picks:
            print(f"  config {config}")
            plan = family.route(topk_ids.reshape(-1), shape.experts, config["BLOCK_M"])
            schedule = (plan.sorted_pairs, plan.block_expert, plan.block_row_start, plan.block_row_end)
            gate_up_config, down_config = family.tilelang_kernel_configs(None, config).values()
            act = torch.full((pairs, shape.inter), float("nan"), dtype=hidden.dtype, device=device)
            kernels.kernel_for(gate_up_config)(
                hidden, *schedule, w13_blocks.flatten(2), w13_scales,
                family._bias_or_zeros(w13_bias, shape.experts, 2 * shape.inter, device), act, alpha, limit)
            torch.cuda.synchronize()
            sorted_pairs = plan.sorted_pairs.cpu()
            expected_act = reference_act(args, sorted_pairs, False)
            print(describe("gate/up act vs reference", act, expected_act, spec.hidden_dtype))
            pair_out = torch.full((pairs, shape.hidden), float("nan"), dtype=torch.float32, device=device)
            kernels.kernel_for(down_config)(
                expected_act.to(hidden.dtype).to(device), *schedule, w2_blocks.flatten(2), w2_scales,
                family._bias_or_zeros(w2_bias, shape.experts, shape.hidden, device), topk_weights.reshape(-1),
                pair_out)
            torch.cuda.synchronize()
            print(describe("down (reference act) vs reference", pair_out,
                           reference_down(args, sorted_pairs, expected_act, False)))
            print("  routing: sorted_pairs", sorted_pairs.tolist()[:16], "block_expert",
                  plan.block_expert.cpu().tolist()[:8], "starts", plan.block_row_start.cpu().tolist()[:8],
                  "ends", plan.block_row_end.cpu().tolist()[:8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codegen", choices=["tilelang", "w4a8"], nargs="+", default=["tilelang", "w4a8"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="*", default=[], help="TileLang: only self-test cases whose name has one")
    parser.add_argument("--configs", type=int, default=4, help="TileLang: at most this many configs per case")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the cases and references on the CPU only (all but the gpt-oss-sized W4A8 layer)")
    parser.add_argument("--workdir", help="where generated sources (and TileLang's CUDA) are written")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("diagnose_mxfp4_moe_numerics needs a CUDA GPU (or --dry-run)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dzc-diag-moe-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if "w4a8" in args.codegen:
        diagnose_w4a8(device, args.seed, workdir, args.dry_run)
    if "tilelang" in args.codegen:
        diagnose_tilelang(device, args.seed, workdir, args.dry_run, args.cases, args.configs)


if __name__ == "__main__":
    main()
