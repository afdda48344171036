"""Time every legal Triton sparse_attention config of the prefill and the decode variant on bench_dsa's MLA shapes
(128 heads, Dqk 576, Dv 512, top-k 2048, BF16 latent cache in 64-token pages), on a CUDA GPU.

    python tools/diagnose_sparse_attention_configs.py [--variants prefill decode] [--limit-s 120]

Prefill: 4096 query rows at the end of an 8K context; decode: 64 sequences x 2 query rows at 32K. Each config is
checked against the op's reference on the first two query rows, then timed (do_bench median; its TFLOP/s count
2·H·topk·(Dqk + Dv) per query row). What tools/bench_dsa.py reports for the untuned default is the row marked
"default"; this table says which tile shapes the tuner should find, and what the default leaves on the table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

from bench_dsa import D_QK, D_V, HEADS, PEAK_BF16_FLOPS, TOPK, Problem, _check, _time  # tools/ is on sys.path
from dzc.ops.dsa import sparse_attention_reference
from dzc.targets import sparse_attention as family
from dzc.targets import triton_codegen
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

SHAPES = {"prefill": dict(batch=1, queries=4096, context=8192), "decode": dict(batch=64, queries=2, context=32768)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--limit-s", type=float, default=120.0, help="stop timing a variant's configs after this")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    device = torch.device("meta" if args.dry_run else "cuda")
    torch.manual_seed(0)
    where = "dry run (meta tensors)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, triton {__import__('triton').__version__}\n")
    print("| variant | config | µs | TFLOP/s | % of 790 |\n|---|---|---|---|---|")
    for variant in args.variants:
        problem = Problem(fp8_index=False, device=device, **SHAPES[variant])
        op_args = problem.attention_args()
        q, latent = op_args[0], op_args[1]
        spec = family.spec_for(q, latent, None, op_args[6], D_V)
        path = Path(tempfile.mkdtemp()) / "sparse_attention.py"
        path.write_text(family.triton_source(spec, SM_90))
        kernels = triton_codegen.load(family, path, spec, SM_90)
        legal, _ = legal_configs(family, "triton", spec, SM_90)
        bucket = family.token_bucket(problem.rows)
        tier, default = family.configs_for_bucket(spec, SM_90, bucket, legal, family.triton_default_config(spec,
                                                                                                          SM_90))
        if args.dry_run:  # the source generated and loaded, the tier chosen: everything before the first launch
            print(f"| {variant} | dry run: {len(tier)} configs in the tier, default {default} | | | |")
            continue
        expected = sparse_attention_reference(*problem.first_sequence(op_args, (0, 5, 6)))
        flops = 2 * HEADS * TOPK * (D_QK + D_V) * problem.rows
        started = time.monotonic()
        for config in [default] + [c for c in tier if c != default]:
            if time.monotonic() - started > args.limit_s:
                print(f"| {variant} | (time limit: {len(tier)} configs in the tier) | | | |", flush=True)
                break
            inputs, (out,), _, result = family.prepare(spec, *op_args)

            def run(config=config, inputs=inputs, out=out):
                family.triton_launch(kernels, config, *inputs, out)

            out.fill_(float("nan"))  # unwritten outputs show as NaN in the check
            try:
                run()
                _check(f"{variant} {config}", result[:problem.check_rows], expected)
            except Exception as err:  # noqa: BLE001 (a config that fails is reported, the others still run)
                print(f"| {variant} | {config} | failed: {type(err).__name__}: {str(err)[:120]} | | |", flush=True)
                continue
            seconds = _time(run)
            mark = " (default)" if config == default else ""
            print(f"| {variant} | {config}{mark} | {seconds * 1e6:.1f} | {flops / seconds / 1e12:.0f} | "
                  f"{flops / seconds / PEAK_BF16_FLOPS:.0%} |", flush=True)


if __name__ == "__main__":
    main()
