"""Time every legal sparse_attention config of the prefill and the decode variant on bench_dsa's MLA shapes
(128 heads, Dqk 576, Dv 512, top-k 2048, BF16 latent cache in 64-token pages), on a CUDA GPU.

    python tools/diagnose_sparse_attention_configs.py [--variants prefill decode] [--limit-s 120]
        [--codegen triton|tilelang] [--fp8-cache] [--only-default] [--match KEY=VALUE ...] [--launches N]
        [--public DIR]

Prefill: 4096 query rows at the end of an 8K context; decode: 64 sequences x 2 query rows at 32K (--fp8-cache: over
the 656 B/token FP8 latent cache). Each config is checked against the op's reference on the first two query rows,
then timed (do_bench median; its TFLOP/s count 2·H·topk·(Dqk + Dv) per query row). What tools/bench_dsa.py reports
for the untuned default is the row marked "default"; this table says which tile shapes the tuner should find, and
what the default leaves on the table. --match KEY=VALUE ...: of the tier, only the configs with every such
parameter (the default runs first all the same), e.g. --match ROW_ADDRESS=1 for an A/B of that candidate against
the default. --launches N: launch each config N more times after its check instead of timing it, for a profiler
(`ncu --launch-skip 1 --launch-count 1` then sees a checked kernel's second launch).
--public DIR: also run the public `sparse_mla_fwd_pipelined` (tools/fetch_public_kernels.sh's folder) on the same
inputs, checked and then timed or launched the same way (bf16 cache only).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

from bench_dsa import (D_QK, D_V, HEADS, PEAK_BF16_FLOPS, TOPK, Problem, PublicBaselines,  # tools/ is on sys.path
                       _check, _time, pipelined_attention, public_attention_inputs)
from dzc.ops.dsa import sparse_attention_reference
from dzc.targets import sparse_attention as family
from dzc.targets import tilelang_codegen, triton_codegen
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

SHAPES = {"prefill": dict(batch=1, queries=4096, context=8192), "decode": dict(batch=64, queries=2, context=32768)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--limit-s", type=float, default=120.0, help="stop timing a variant's configs after this")
    parser.add_argument("--codegen", choices=["triton", "tilelang"], default="triton")
    parser.add_argument("--fp8-cache", action="store_true", help="decode reads the FP8 latent cache")
    parser.add_argument("--only-default", action="store_true", help="only the untuned default config")
    parser.add_argument("--match", nargs="+", default=[], metavar="KEY=VALUE",
                        help="besides the default, only the tier's configs with all these parameters")
    parser.add_argument("--launches", type=int, default=0, help="launch N more times instead of timing")
    parser.add_argument("--public", metavar="DIR", help="also run the public sparse_mla_fwd_pipelined from DIR")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    try:
        match = {key: int(value) for key, value in (item.split("=", 1) for item in args.match)}
    except ValueError:
        parser.error(f"--match takes KEY=INTEGER pairs, got {args.match}")
    device = torch.device("meta" if args.dry_run else "cuda")
    torch.manual_seed(0)
    where = "dry run (meta tensors)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, triton {__import__('triton').__version__}, {args.codegen}\n")
    print("| variant | config | µs | TFLOP/s | % of 790 |\n|---|---|---|---|---|")
    for variant in args.variants:
        problem = Problem(fp8_index=False, device=device, fp8_latent=args.fp8_cache and variant == "decode",
                          **SHAPES[variant])
        op_args = problem.attention_args()
        q, latent = op_args[0], op_args[1]
        spec = family.spec_for(q, latent, None, op_args[6], D_V)
        path = Path(tempfile.mkdtemp()) / "sparse_attention.py"
        if args.codegen == "triton":
            path.write_text(family.triton_source(spec, SM_90))
            kernels, launch = triton_codegen.load(family, path, spec, SM_90), family.triton_launch
            untuned = family.triton_default_config(spec, SM_90)
        else:
            path.write_text(family.tilelang_source(spec, SM_90))
            kernels, launch = tilelang_codegen.load(family, path, spec, SM_90), family.tilelang_launch
            untuned = family.tilelang_default_config(spec, SM_90)
        legal, _ = legal_configs(family, args.codegen, spec, SM_90)
        bucket = family.token_bucket(problem.rows)
        tier, default = family.configs_for_bucket(spec, SM_90, bucket, legal, untuned)
        configs = [default] if args.only_default else [default] + [
            c for c in tier if c != default and all(dict(c.params).get(k) == v for k, v in match.items())]
        if args.dry_run:  # the source generated and loaded, the tier chosen: everything before the first launch
            print(f"| {variant} | dry run: {len(configs)} of {len(tier)} configs in the tier, default {default} "
                  "| | | |")
            continue
        expected = sparse_attention_reference(*problem.first_sequence(op_args, (0, 5, 6)))
        flops = 2 * HEADS * TOPK * (D_QK + D_V) * problem.rows
        started = time.monotonic()
        for config in configs:
            if time.monotonic() - started > args.limit_s:
                print(f"| {variant} | (time limit: {len(tier)} configs in the tier) | | | |", flush=True)
                break
            inputs, (out,), _, result = family.prepare(spec, *op_args)

            def run(config=config, inputs=inputs, out=out):
                launch(kernels, config, *inputs, out)

            out.fill_(float("nan"))  # unwritten outputs show as NaN in the check
            try:
                run()
                _check(f"{variant} {config}", result[:problem.check_rows], expected)
            except Exception as err:  # noqa: BLE001 (a config that fails is reported, the others still run)
                print(f"| {variant} | {config} | failed: {type(err).__name__}: {str(err)[:120]} | | |", flush=True)
                continue
            _report(variant, f"{config}{' (default)' if config == default else ''}", run, flops, args.launches)
        if args.public and not problem.fp8_latent:
            _public(args, problem, expected, flops)


def _report(variant: str, name: str, run, flops: int, launches: int) -> None:
    """Time `run` and print its row, or launch it `launches` more times (for a profiler)."""
    if launches:
        for _ in range(launches):
            run()
        torch.cuda.synchronize()
        print(f"| {variant} | {name} | launched {launches}x | | |", flush=True)
        return
    seconds = _time(run)
    print(f"| {variant} | {name} | {seconds * 1e6:.1f} | {flops / seconds / 1e12:.0f} | "
          f"{flops / seconds / PEAK_BF16_FLOPS:.0%} |", flush=True)


def _public(args, problem: Problem, expected: torch.Tensor, flops: int) -> None:
    """The public pipelined kernel on the same rows (its dense [B, S_kv, 1, 576] KV gathered through the block
    table, its causal start at context − queries), checked against dzc's reference."""
    module = PublicBaselines(None, args.public).module("sparse_mla_fwd_pipelined")
    run = pipelined_attention(module, problem, *public_attention_inputs(problem))
    _check("public sparse_mla_fwd_pipelined", run()[0].view(-1, HEADS, D_V)[:problem.check_rows], expected)
    _report("prefill" if problem.queries > 2 else "decode", "public sparse_mla_fwd_pipelined", run, flops,
            args.launches)


if __name__ == "__main__":
    main()
