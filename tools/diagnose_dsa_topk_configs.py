"""Where a dsa_topk kernel's time goes: each config timed over rows of several lengths, on a CUDA GPU.

    python tools/diagnose_dsa_topk_configs.py [--codegen tilelang|triton] [--rows 128] [--width 32768]
        [--lengths 4096 8192 16384 32768] [--k 2048] [--match TEXT ...] [--only-default] [--launches N]

The same fp32 logits (rows × width, seeded normal) with every row's length set to each of --lengths in turn: a
kernel's sweeps over a row scale with its length, its fixed work (block-wide scans and barriers, the radix rounds
over the threshold bin's candidates, writing k positions) does not. A least-squares line through the times gives
both: the intercept is the fixed part, the slope × width the sweeps' part at the full width. Each run is checked
exactly against the op's reference, then timed from CUDA graph replays (median). "× one read": time ÷ the logits'
bytes at 4.8 TB/s (issue 14's goal: ≤ 3× at 64-128 rows of 32K-128K). Configs: the untuned default (the choice
for a row of --width), then every legal config whose text contains one of --match (all with no --match).
--launches N: launch each config N more times at the full length instead of timing (for ncu).
"""

from __future__ import annotations

import argparse

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

import bench_dsa  # tools/ is on sys.path
from bench_dsa import PEAK_BYTES_PER_S, _time, family_kernels
from dzc.ops.dsa import dsa_topk_reference
from dzc.targets import dsa_topk as family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codegen", choices=["triton", "tilelang"], default="tilelang")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--width", type=int, default=32768)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--match", nargs="+", help="only configs whose text contains one of these (and the default)")
    parser.add_argument("--only-default", action="store_true", help="only the untuned default config")
    parser.add_argument("--launches", type=int, default=0, help="launch N more times instead of timing")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    if any(not args.k < length <= args.width for length in args.lengths):
        parser.error(f"--lengths must lie in (k, width] = ({args.k}, {args.width}]: shorter rows take every position")
    bench_dsa.CUDA_GRAPHS = True  # a top-k call's GPU work is tens of µs: time replays, not the host's launches
    device = torch.device("meta" if args.dry_run else "cuda")
    where = "dry run (meta tensors)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, triton {__import__('triton').__version__}, {args.codegen}\n")
    spec = family.DsaTopkSpec()
    kernels, launch, default, configs, tier = family_kernels(family, args.codegen, spec, args.match,
                                                             args.only_default, family.token_bucket(args.width))
    if args.dry_run:  # the source generated and loaded, the configs chosen: everything before the first launch
        print(f"dry run: {len(configs)} of {tier} configs for rows of {args.width}, lengths {args.lengths}; "
              f"default {default}")
        return
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.rows, args.width, device=device, generator=generator)
    one_read = logits.numel() * 4 / PEAK_BYTES_PER_S
    cases = []
    for length in args.lengths:
        lengths = torch.full((args.rows,), length, dtype=torch.int32, device=device)
        cases.append((length, family.prepare(spec, logits, lengths, args.k),
                      dsa_topk_reference(logits, lengths, args.k)))
    print("| config | " + " | ".join(f"length {length} µs" for length in args.lengths)
          + " | fixed µs (intercept) | sweeps µs at the width | × one read at the width |")
    print("|---|" + "---|" * (len(args.lengths) + 3))
    for config in configs:
        times, failed = [], ""
        for length, (inputs, outputs, _, result), expected in cases:
            def run(inputs=inputs, outputs=outputs):
                launch(kernels, config, *inputs, *outputs)

            outputs[0].fill_(-7)  # unwritten positions show in the check
            try:
                run()
                wrong = int((result != expected).any(dim=-1).sum())
                if wrong:
                    raise AssertionError(f"length {length}: {wrong} of {args.rows} rows differ from the reference")
            except Exception as err:  # noqa: BLE001 (a config that fails is reported, the others still run)
                failed = f"failed: {type(err).__name__}: {str(err)[:120]}"
                break
            if args.launches and length == args.lengths[-1]:
                for _ in range(args.launches):
                    run()
                torch.cuda.synchronize()
            times.append(_time(run) if not args.launches else 0.0)
        name = f"{config}{' (default)' if config == default else ''}"
        if failed or args.launches:
            print(f"| {name} | {failed or f'launched {args.launches}x'} |" + " |" * (len(args.lengths) + 2),
                  flush=True)
            continue
        cells = " | ".join(f"{t * 1e6:.1f}" for t in times)
        if len(set(args.lengths)) < 2:  # no line through one length
            print(f"| {name} | {cells} | | | {times[-1] / one_read:.1f} |", flush=True)
            continue
        x = torch.tensor(args.lengths, dtype=torch.float64)
        y = torch.tensor(times, dtype=torch.float64)
        slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
        intercept = y.mean() - slope * x.mean()
        full = intercept + slope * args.width
        print(f"| {name} | {cells} | {intercept * 1e6:.1f} | {slope * args.width * 1e6:.1f} | {full / one_read:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
