"""Time dsa_indexer configs on bench_dsa's indexer shapes (64 heads × 128, FP8 cache in 64-token pages), on a CUDA GPU.

    python tools/diagnose_dsa_indexer_configs.py [--shapes decode-64 decode-16 decode-1 prefill]
        [--codegen tilelang|triton] [--match TEXT ...] [--only-default] [--limit-s 300] [--launches N]

Shapes: "decode-64", "decode-16", "decode-1": 64, 16 or one sequence × 2 query rows at 32K (2^22, 2^20 and 2^16
rows × keys: below 2^20 configs_for_bucket's small-launch default applies), "prefill": a 1024-row chunk at the end
of an 8K context (bench_dsa's prefill indexer runs 4096 rows over 8K in chunks of 1024).
Every legal config of the codegen (--match: only those whose text contains one of the given strings, e.g.
MIN_BLOCKS=3), the untuned default first. Each config is launched once on every shape and checked against the op's
reference on the first sequence's rows, then timed on each (CUDA graph replays, median). A TileLang config builds in
30-60 s on the H200's host: the config loop stops after --limit-s. TB/s as bench_dsa counts it: cached-token bytes
(132) read per query row ÷ time, % of 4.8 TB/s. --launches N: launch N more times instead of timing (for ncu:
`ncu --launch-skip 1 --launch-count 1 -k regex:dsa_indexer` sees a checked kernel's second launch).
"""

from __future__ import annotations

import argparse
import time

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

import bench_dsa  # tools/ is on sys.path
from bench_dsa import INDEX_DIM, PEAK_BYTES_PER_S, Problem, _check, _time, family_kernels
from dzc.ops.dsa import dsa_indexer_reference
from dzc.targets import dsa_indexer as family

SHAPES = {"decode-64": dict(batch=64, queries=2, context=32768), "decode-16": dict(batch=16, queries=2, context=32768),
          "decode-1": dict(batch=1, queries=2, context=32768), "prefill": dict(batch=1, queries=1024, context=8192)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--codegen", choices=["triton", "tilelang"], default="tilelang")
    parser.add_argument("--match", nargs="+", help="only configs whose text contains one of these (and the default)")
    parser.add_argument("--only-default", action="store_true", help="only the untuned default config")
    parser.add_argument("--limit-s", type=float, default=300.0, help="start no new config after this")
    parser.add_argument("--launches", type=int, default=0, help="launch N more times instead of timing")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    bench_dsa.CUDA_GRAPHS = True  # a decode call's GPU work is a few µs: time replays, not the host's launches
    device = torch.device("meta" if args.dry_run else "cuda")
    torch.manual_seed(0)
    where = "dry run (meta tensors)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, triton {__import__('triton').__version__}, {args.codegen}\n")
    problems = {name: Problem(fp8_index=True, device=device, **SHAPES[name]) for name in args.shapes}
    spec = family.spec_for(problems[args.shapes[0]].index_q, problems[args.shapes[0]].index_cache)
    kernels, launch, default, configs, legal = family_kernels(family, args.codegen, spec, args.match,
                                                              args.only_default)
    if args.dry_run:  # the source generated and loaded, the configs chosen: everything before the first launch
        print(f"dry run: {spec.describe()}: {len(configs)} of {legal} configs on {', '.join(args.shapes)}; "
              f"default {default}")
        return
    print("| config | " + " | ".join(f"{name} µs (TB/s, %)" for name in args.shapes) + " |")
    print("|---|" + "---|" * len(args.shapes))
    inputs = {}
    for name, problem in problems.items():
        op_args = problem.indexer_args()
        expected = dsa_indexer_reference(*problem.first_sequence(op_args, (0, 1, 5, 6)))
        inputs[name] = (family.prepare(spec, *op_args), expected)
    started = time.monotonic()
    for config in configs:
        if time.monotonic() - started > args.limit_s:
            print(f"| (time limit: {len(configs)} configs listed) |" + " |" * len(args.shapes), flush=True)
            break
        cells = []
        for name, ((kernel_inputs, outputs, _, result), expected) in inputs.items():
            def run(kernel_inputs=kernel_inputs, outputs=outputs):
                launch(kernels, config, *kernel_inputs, *outputs)

            outputs[0].fill_(float("nan"))  # unwritten logits show as NaN in the check
            try:
                run()
                _check(f"{name} {config}", result[:problems[name].check_rows], expected)
            except Exception as err:  # noqa: BLE001 (a config that fails is reported, the others still run)
                cells.append(f"failed: {type(err).__name__}: {str(err)[:100]}")
                continue
            if args.launches:
                for _ in range(args.launches):
                    run()
                torch.cuda.synchronize()
                cells.append(f"launched {args.launches}x")
                continue
            seconds = _time(run)
            read = problems[name].rows * problems[name].context * (INDEX_DIM + 4)
            cells.append(f"{seconds * 1e6:.1f} ({read / seconds / 1e12:.2f}, {read / seconds / PEAK_BYTES_PER_S:.0%})")
        print(f"| {config}{' (default)' if config == default else ''} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
