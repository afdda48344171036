"""Benchmark dzc's add_rms_norm against eager PyTorch and torch.compile, in one run, on a CUDA GPU.

    python tools/bench_add_rms_norm.py [--hidden 2880 7168] [--tokens 1 64 4096 32768] [--out results.md]

The model is the HF transformers spelling: h = x + residual; y = LlamaRMSNorm(h) (bf16 activations and weight).
Bytes per call = 8·T·H (read x and residual, write y and h, bf16) + the weight. Times are medians of
triton.testing.do_bench (L2 flushed before each call) of the whole compiled call, as a user calls it: for
small T that is launch overhead, which dzc's CUDA-graph path (T <= 256) removes.

Every variant is checked against eager on the same inputs before it is timed (bf16: within 2 ulps).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from dzc.models.decoder import HFRMSNorm

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet; measured copy bandwidth is ~4.3e12


class AddNorm(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


def _check(name, actual, expected):
    for a, e in zip(actual, expected):
        ulp = 2.0 ** (torch.floor(torch.log2(e.float().abs().clamp_min(1e-30))) - 7)
        worst = ((a.float() - e.float()).abs() / ulp).max().item()
        if worst > 2.0:
            raise AssertionError(f"{name}: {worst:.1f} bf16 ulps from eager")


def _time(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2880, 7168])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096, 32768])
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"])
    parser.add_argument("--cache-dir", default="/tmp/dzc-bench-cache")
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args()
    device = torch.device("cuda")
    # Every variant compiles the same forward; keep Dynamo from running out of cache entries for it.
    torch._dynamo.config.recompile_limit = 64
    rows = []
    for hidden in args.hidden:
        model = AddNorm(hidden).to(device, torch.bfloat16).eval()
        compiled = {cg: dzc.compile(model, "cuda", dzc.CompileOptions(codegen=cg, cache_dir=args.cache_dir))
                    for cg in args.codegens}
        for tokens in args.tokens:
            torch.manual_seed(tokens * 7 + hidden)
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            residual = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                expected = model(x, residual)
            inductor = torch.compile(model, dynamic=False)  # specialised on this shape: its best case
            with torch.no_grad():
                _check("torch.compile", inductor(x, residual), expected)
            times = {"eager": _time(lambda: model(x, residual)),
                     "torch.compile": _time(lambda: inductor(x, residual))}
            for codegen, fn in compiled.items():
                _check(f"dzc[{codegen}]", fn(x, residual), expected)
                times[f"dzc[{codegen}]"] = _time(lambda: fn(x, residual))
            moved = 8 * tokens * hidden + 2 * hidden
            rows.append((hidden, tokens, moved, times))
            print(hidden, tokens, {k: f"{v * 1e6:.1f}us" for k, v in times.items()}, flush=True)
        for codegen, fn in compiled.items():
            print(fn.report)

    variants = list(rows[0][3])
    header = ["H", "T"] + [f"{v} µs" for v in variants] + [f"{v} TB/s" for v in variants if v.startswith("dzc")]
    header += [f"{v} / torch.compile" for v in variants if v.startswith("dzc")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for hidden, tokens, moved, times in rows:
        cells = [str(hidden), str(tokens)] + [f"{times[v] * 1e6:.1f}" for v in variants]
        cells += [f"{moved / times[v] / 1e12:.2f} ({100 * moved / times[v] / PEAK_BYTES_PER_S:.0f}%)"
                  for v in variants if v.startswith("dzc")]
        cells += [f"{times['torch.compile'] / times[v]:.2f}x" for v in variants if v.startswith("dzc")]
        lines.append("| " + " | ".join(cells) + " |")
    props = torch.cuda.get_device_properties(device)
    meta = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"python {platform.python_version()}, {datetime.date.today().isoformat()}. "
            f"'x / torch.compile' is torch.compile's time over dzc's (above 1 = dzc faster); "
            f"TB/s counts 8·T·H bytes, % of the 4.8 TB/s datasheet peak.")
    table = "\n".join(lines)
    print(meta)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(meta + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
