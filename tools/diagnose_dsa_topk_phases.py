"""Where a TileLang dsa_topk launch's time goes, phase by phase, from clocks the kernel reads itself, on a CUDA GPU.

    python tools/diagnose_dsa_topk_phases.py [--rows 128] [--lengths 4096 32768 131072] [--k 2048]
        [--match TEXT ...] [--launches 10] [--seed 0]

For each of --lengths: rows × length seeded normal fp32 logits, every row that long, run by the untuned choice for
a row of that width (and the bucket's other legal configs whose text contains one of --match), each built twice:
plain, and with the template's phase stamps (targets/dsa_topk.tilelang_phase_stamped: thread 0 of each block reads
%globaltimer and clock64() after each phase's closing barrier). Both kernels' positions are checked exactly
against the op's reference first. Then --launches stamped launches; per phase, the median over their rows of the
phase's duration: ns by %globaltimer (whose step may be coarse: printed), cycles by clock64 (exact within a block:
thread 0's SM), and the cycles in µs at the clock the rows' totals give. A phase a row skips (the template's
phases()) has its stamp unwritten and lasts 0 there; "skipped" counts those rows. Below each table: the block's
whole run (start to "write"), all blocks' span (the first start to the last "write" of a launch), and both
kernels' times from CUDA events (graph replays, median, as diagnose_dsa_topk_configs.py times them). The stamps
add one barrier before the last stamp and their reads and stores: the phases' times are upper bounds, and the
stamped kernel's time against the plain one's says by how much.
"""

from __future__ import annotations

import argparse

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

import bench_dsa  # tools/ is on sys.path
from bench_dsa import _time, family_kernels
from dzc.ops.dsa import dsa_topk_reference
from dzc.targets import dsa_topk as family
from dzc.targets import tilelang_codegen
from dzc.targets.generated_module import import_generated
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

UNWRITTEN = -1  # what the stamps hold before a launch: a stamp a row's path skips stays so


def configs_for_length(spec, length: int, legal, default, match) -> list:
    """The untuned choice for rows of `length`, then the bucket's other configs that match."""
    candidates, chosen = family.configs_for_bucket(spec, SM_90, family.token_bucket(length), legal, default)
    return [chosen] + [c for c in candidates if c != chosen and match and any(text in str(c) for text in match)]


def phase_table(stamps: torch.Tensor, names: list[str]) -> tuple[list[str], dict]:
    """stamps (launches × rows, 2, phases) -> the table's lines and the totals (medians over the rows)."""
    stamps = stamps.clone()
    skipped = stamps[:, 0] == UNWRITTEN
    for i in range(1, len(names)):  # an unwritten stamp: the phase ended where the last written one did
        stamps[:, :, i] = torch.where(skipped[:, None, i], stamps[:, :, i - 1], stamps[:, :, i])
    ns = stamps[:, 0].diff(dim=-1).double()
    cycles = stamps[:, 1].diff(dim=-1).double()
    ns_total, cycles_total = ns.sum(-1), cycles.sum(-1)
    ghz = float((cycles_total / ns_total).median())  # cycles per ns: the SMs' clock over the rows' whole runs
    lines = ["| phase | µs (globaltimer) | cycles (clock64) | µs (cycles at the clock) | skipped |",
             "|---|---|---|---|---|"]
    for i, name in enumerate(names[1:]):
        lines.append(f"| {name} | {ns[:, i].median() / 1e3:.2f} | {cycles[:, i].median():.0f} | "
                     f"{cycles[:, i].median() / ghz / 1e3:.2f} | {int(skipped[:, i + 1].sum())} |")
    lines.append(f"| whole block (start to write) | {ns_total.median() / 1e3:.2f} | {cycles_total.median():.0f} | "
                 f"{cycles_total.median() / ghz / 1e3:.2f} | |")
    steps = stamps[:, 0].diff(dim=-1)
    return lines, {"ghz": ghz, "step_ns": int(steps[steps > 0].min()) if bool((steps > 0).any()) else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--match", nargs="+", help="also the bucket's configs whose text contains one of these")
    parser.add_argument("--launches", type=int, default=10, help="stamped launches whose rows the medians take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build the stamped kernels' TileLang functions, print the "
                             "plan")
    args = parser.parse_args()
    if any(length <= args.k for length in args.lengths):
        parser.error(f"--lengths must exceed k = {args.k}: shorter rows take every position and run no phase")
    bench_dsa.CUDA_GRAPHS = True  # a top-k call's GPU work is tens of µs: time replays, not the host's launches
    where = "dry run" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, tilelang {tilelang_codegen.VERSION}\n")
    spec = family.DsaTopkSpec()
    kernels, launch, default, _, _ = family_kernels(family, "tilelang", spec, None, True)
    legal, _ = legal_configs(family, "tilelang", spec, SM_90)
    module = import_generated(kernels.path)
    plan = [(length, configs_for_length(spec, length, legal, default, args.match)) for length in args.lengths]
    if args.dry_run:  # the stamped prim_funcs built (TileLang's front end, no device): the factory takes the option
        for length, configs in plan:
            for config in configs:
                stamped = family.tilelang_phase_stamped(config)
                tilelang_codegen.build_prim_func(kernels.path, family.TILELANG_FACTORY_NAME, stamped)
                names = module.phases(dict(config.params).get("RADIX_BITS", 8))
                print(f"dry run: {args.rows} rows of {length}, {stamped}: phases {', '.join(names)}")
        return
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    for length, configs in plan:
        logits = torch.randn(args.rows, length, device="cuda", generator=generator)
        lengths = torch.full((args.rows,), length, dtype=torch.int32, device="cuda")
        expected = dsa_topk_reference(logits, lengths, args.k)
        inputs, outputs, _, plain_result = family.prepare(spec, logits, lengths, args.k)
        for config in configs:
            names = module.phases(dict(config.params).get("RADIX_BITS", 8))
            stamped_kernel = kernels.kernel_for(family.tilelang_phase_stamped(config))
            indices = torch.empty(args.rows, args.k, dtype=torch.int32, device="cuda")
            stamps = torch.empty(args.rows, 2, len(names), dtype=torch.int64, device="cuda")

            def plain(inputs=inputs, outputs=outputs, config=config):
                launch(kernels, config, *inputs, *outputs)

            def stamped(logits=logits, lengths=lengths, indices=indices, stamps=stamps, kernel=stamped_kernel):
                tilelang_codegen.launch_arguments((logits, lengths), (indices, stamps)).launch(kernel)

            outputs[0].fill_(-7)  # unwritten positions show in the checks
            indices.fill_(-7)
            plain()
            stamped()
            for name, result in (("plain", plain_result), ("stamped", indices)):
                wrong = int((result != expected).any(dim=-1).sum())
                if wrong:
                    raise SystemExit(f"length {length}, {config}: the {name} kernel's positions differ from the "
                                     f"reference in {wrong} of {args.rows} rows")
            runs = []
            for _ in range(args.launches):
                stamps.fill_(UNWRITTEN)
                stamped()
                runs.append(stamps.clone())
            torch.cuda.synchronize()
            lines, totals = phase_table(torch.cat(runs), names)
            spans = [float(run[:, 0, -1].max() - run[:, 0, 0].min()) / 1e3 for run in runs]
            print(f"### {args.rows} rows of {length}, k = {args.k}: {config}"
                  f"{' (untuned choice)' if config == configs[0] else ''}\n")
            print("\n".join(lines))
            print(f"\nall blocks, first start to last write: {sorted(spans)[len(spans) // 2]:.2f} µs (median of "
                  f"{args.launches} launches); CUDA events: plain {_time(plain) * 1e6:.2f} µs, stamped "
                  f"{_time(stamped) * 1e6:.2f} µs; clock {totals['ghz']:.3f} GHz (cycles / globaltimer ns over "
                  f"the rows), globaltimer's smallest step seen {totals['step_ns']} ns\n", flush=True)


if __name__ == "__main__":
    main()
