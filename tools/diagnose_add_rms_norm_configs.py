"""Time every legal Triton add_rms_norm config, beside torch.compile's kernel and a plain copy, on a CUDA GPU.

    python tools/diagnose_add_rms_norm_configs.py [--hidden 2880 7168] [--tokens 1024 4096 32768]

Issue 18 found dzc's add+RMSNorm at 4096 tokens 0.69x torch.compile back to back (72 vs 50 µs at hidden 2880),
while at 32768 tokens both reach 85% of HBM: this table says whether a config would close that gap or whether
every config (and torch.compile) is held by something else at that size. Each variant is one launch captured
into a CUDA graph of 20 launches on the same buffers (no host work: what calls back to back see on the
device), its replays timed by do_bench. TB/s counts 8·T·H bytes (bf16 x, residual in; y, h out). `copy`
is torch's copy of two [T, H] bf16 tensors (the same 8·T·H bytes): the bandwidth this size can reach at all.
Every config is checked against the op's reference before it is timed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton.testing

from dzc.ops.add_rms_norm import add_rms_norm_reference
from dzc.targets import add_rms_norm as family
from dzc.targets import triton_codegen
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

from bench_add_rms_norm import captured  # tools/ is on sys.path

LAUNCHES_PER_GRAPH = 20
EPS = 1e-6


def _per_launch_seconds(fn) -> float:
    """Seconds per launch of fn replayed from a CUDA graph of LAUNCHES_PER_GRAPH launches (do_bench flushes L2
    before each replay: the first launch of a replay reads from HBM, the rest as calls back to back do)."""
    graph = captured(fn, LAUNCHES_PER_GRAPH)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median") * 1e-3 / LAUNCHES_PER_GRAPH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2880, 7168])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build the kernels' source and list each size's legal configs")
    args = parser.parse_args()
    print(f"{'dry run' if args.dry_run else torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n")
    print("| H | T | variant | µs | TB/s |\n|---|---|---|---|---|")
    bf16 = torch.bfloat16
    for hidden in args.hidden:
        spec = family.AddRmsNormSpec(hidden, bf16, bf16, bf16, bf16, bf16, sum_in_fp32=False, cast_before_weight=True)
        path = Path(tempfile.mkdtemp()) / "add_rms_norm.py"
        path.write_text(family.triton_source(spec, SM_90))
        legal, _ = legal_configs(family, "triton", spec, SM_90)
        default = family.triton_default_config(spec, SM_90)
        if args.dry_run:
            print(f"| {hidden} | all | dry run: {len(legal)} legal configs, default {default} | | |")
            continue
        kernel = triton_codegen.load(family, path, spec, SM_90)
        compiled = torch.compile(lambda x, r, w: add_rms_norm_reference(x, r, w, EPS, False, True, bf16, bf16))
        for tokens in args.tokens:
            torch.manual_seed(tokens)
            x, residual = (torch.randn(tokens, hidden, device="cuda", dtype=bf16) for _ in range(2))
            weight = torch.randn(hidden, device="cuda", dtype=bf16)
            expected_y, expected_h = add_rms_norm_reference(x, residual, weight, EPS, False, True, bf16, bf16)
            gbytes = 8 * tokens * hidden

            def row(name, seconds):
                print(f"| {hidden} | {tokens} | {name} | {seconds * 1e6:.1f} | {gbytes / seconds / 1e12:.2f} |",
                      flush=True)

            a, b = torch.empty_like(x), torch.empty_like(x)
            row("copy", _per_launch_seconds(lambda: (a.copy_(x), b.copy_(residual))))
            row("torch.compile", _per_launch_seconds(lambda: compiled(x, residual, weight)))
            for config in [default] + [c for c in legal if c != default]:
                y, h = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))

                def run(config=config, y=y, h=h):
                    family.triton_launch(kernel, config, x, residual, weight, EPS, y, h)

                run()
                torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
                torch.testing.assert_close(y, expected_y, rtol=1.6e-2, atol=1e-2)
                row(f"{config}{' (default)' if config == default else ''}", _per_launch_seconds(run))


if __name__ == "__main__":
    main()
