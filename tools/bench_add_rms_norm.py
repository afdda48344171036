"""Benchmark dzc's residual add + norm against eager PyTorch and torch.compile, in one run, on a CUDA GPU.

    python tools/bench_add_rms_norm.py [--hidden 2880 7168] [--tokens 1 64 4096 32768] [--out results.md]
    python tools/bench_add_rms_norm.py --op add_layer_norm [--out results.md]   # vision widths 1152, 1280
    python tools/bench_add_rms_norm.py [--op ...] --quick                         # a subset, about 2 minutes
    python tools/bench_add_rms_norm.py --back-to-back [--hidden 2880] [--out results.md]  # host path, T 1..4096

--op add_rms_norm (default): the HF transformers spelling, h = x + residual; y = LlamaRMSNorm(h) (bf16
activations and weight). --op add_layer_norm: h = x + residual; y = nn.LayerNorm(h) with weight and bias (vision
encoders: MoonViT, SigLIP), hidden {1152, 1280} and tokens {1024, 16384} by default.
Bytes per call = 8·T·H (read x and residual, write y and h, bf16) + the weight (and bias). Two timings of the whole
compiled call, as a user calls it: the median of triton.testing.do_bench (L2 flushed before each call, so host
time hides behind the flush while it is shorter), and back-to-back calls (host and device together). For small
T both are host time, which dzc's CUDA-graph path (T <= 256) cuts; `dzc[...,reuse]` is that path returning the
graph's own output buffers (no copy out), as a decode loop would run it. A third timing is GPU time alone: each
variant's call captured into a CUDA graph, its replays timed; it compares the kernels (bandwidth) where host time
swamps the other two (T = 4096 on a slow host).

Every variant is checked against eager on the same inputs before it is timed (bf16: within 2 ulps).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import time
import types

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from dzc.models.decoder import AddRMSNorm
from dzc.models.vision import AddLayerNorm
from dzc.targets.device_runtime import dsl_versions

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet; measured copy bandwidth is ~4.3e12

# Per op: the module (h = x + residual; y = norm(h); returns (y, h)), the parameter bytes per hidden element
# (bf16 weight, and bias), and the default and --quick (hidden sizes, token counts).
OPS = {
    "add_rms_norm": dict(module=AddRMSNorm, parameter_bytes=2, hidden=[2880, 7168], tokens=[1, 64, 4096, 32768],
                         quick=([2880], [1, 4096]), check_per_row=False),
    "add_layer_norm": dict(module=AddLayerNorm, parameter_bytes=4, hidden=[1152, 1280], tokens=[1024, 16384],
                           quick=([1152], [1024, 16384]), check_per_row=True),
}


def _private_copy(model):
    """The same module (shared parameters) with its own copy of forward's code object.

    Dynamo keeps compiled entries per code object and checks their guards in turn on every call: variants that
    shared one forward would each pay for the others' entries, which no deployment (one compiled model) does."""
    forward = type(model).forward
    fresh = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                               forward.__defaults__, forward.__closure__)
    clone = copy.copy(model)
    clone.forward = types.MethodType(fresh, clone)
    return clone


def _check(name, actual, expected, per_row: bool = False):
    """At most 2 bf16 ulps from eager, at each value's magnitude, or (per_row: LayerNorm, whose centred outputs
    near zero carry the rounding of terms as large as the row's) at the magnitude of the row's largest value."""
    for a, e in zip(actual, expected):
        magnitude = e.float().abs()
        if per_row:
            magnitude = magnitude.amax(-1, keepdim=True)
        ulp = 2.0 ** (torch.floor(torch.log2(magnitude.clamp_min(1e-30))) - 7)
        worst = ((a.float() - e.float()).abs() / ulp).max().item()
        if worst > 2.0:
            raise AssertionError(f"{name}: {worst:.1f} bf16 ulps from eager")


def _time(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def captured(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """fn captured `calls` times in a row into one CUDA graph, after a call and one on a side stream (as capture
    requires)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_time(fn, warmup: int = 10, rep: int = 50) -> float:
    """Seconds of GPU time per call: fn captured once into a CUDA graph, then the graph's replays timed with the
    L2 flushed before each (do_bench median). Host work (guards, wrappers, launches) is left out: what remains is
    the kernels' own time."""
    graph = captured(fn)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e-3


def loop_time(fn, calls: int = 200) -> float:
    """Seconds per call of back-to-back calls (no L2 flush between them): host and device time together, what
    a decode loop sees when the host is the bottleneck."""
    with torch.no_grad():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=sorted(OPS), default="add_rms_norm")
    parser.add_argument("--hidden", type=int, nargs="+", help="default: the op's (see above)")
    parser.add_argument("--tokens", type=int, nargs="+", help="default: the op's (see above)")
    parser.add_argument("--quick", action="store_true", help="one hidden size, two token counts (about 2 minutes)")
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"])
    parser.add_argument("--cache-dir", default="/tmp/dzc-bench-cache")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--back-to-back", action="store_true",
                        help="only calls back to back, as a user makes them (hidden 2880, tokens 1..4096 unless "
                             "given): dzc against torch.compile where host time matters")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    op = OPS[args.op]
    quick_hidden, quick_tokens = op["quick"]
    if args.back_to_back:
        quick_hidden, quick_tokens, args.quick = quick_hidden[:1], [1, 8, 64, 256, 512, 1024, 4096], True
    args.hidden = args.hidden or (quick_hidden if args.quick else op["hidden"])
    args.tokens = args.tokens or (quick_tokens if args.quick else op["tokens"])
    if not set(args.codegens) <= {"triton", "tilelang"}:
        parser.error(f"--codegens: {args.codegens} (triton, tilelang)")
    if args.dry_run:  # everything up to the first device launch: the models and their dzc.compile wrappers
        for hidden in args.hidden:
            model = op["module"](hidden).to(torch.bfloat16).eval()
            for codegen in args.codegens:
                dzc.compile(_private_copy(model), "cuda", dzc.CompileOptions(codegen=codegen, cache_dir=args.cache_dir))
            print(f"dry run: {args.op} hidden {hidden}, tokens {args.tokens}, dzc[{', '.join(args.codegens)}] "
                  f"against eager and torch.compile")
        return
    device = torch.device("cuda")
    # Every variant compiles the same forward; keep Dynamo from running out of cache entries for it.
    torch._dynamo.config.recompile_limit = 64
    rows = []
    for hidden in args.hidden:
        model = op["module"](hidden).to(device, torch.bfloat16).eval()
        compiled = {cg: dzc.compile(_private_copy(model), "cuda",
                                    dzc.CompileOptions(codegen=cg, cache_dir=args.cache_dir))
                    for cg in args.codegens}
        # The CUDA-graph path returning its own buffers (cuda_graph_reuse_outputs): what a decode loop would use.
        compiled[f"{args.codegens[0]},reuse"] = dzc.compile(_private_copy(model), "cuda", dzc.CompileOptions(
            codegen=args.codegens[0], cache_dir=args.cache_dir, cuda_graph_reuse_outputs=True))
        for tokens in args.tokens:
            torch.manual_seed(tokens * 7 + hidden)
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            residual = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                expected = model(x, residual)
            inductor = torch.compile(_private_copy(model), dynamic=False)  # specialised on this shape: its best case
            with torch.no_grad():
                _check("torch.compile", inductor(x, residual), expected, op["check_per_row"])
            variants = {"eager": lambda: model(x, residual), "torch.compile": lambda: inductor(x, residual)}
            for codegen, fn in compiled.items():
                _check(f"dzc[{codegen}]", fn(x, residual), expected, op["check_per_row"])
                variants[f"dzc[{codegen}]"] = lambda fn=fn: fn(x, residual)
            loop_times = {name: loop_time(fn) for name, fn in variants.items()}
            if args.back_to_back:
                times = device_times = loop_times
            else:
                times = {name: _time(fn) for name, fn in variants.items()}
                with torch.no_grad():
                    device_times = {name: graph_time(fn, warmup=25, rep=200) for name, fn in variants.items()}
            moved = 8 * tokens * hidden + op["parameter_bytes"] * hidden
            rows.append((hidden, tokens, moved, times, loop_times, device_times))
            print(hidden, tokens, *({k: f"{v * 1e6:.1f}us" for k, v in measured.items()}
                                    for measured in (times, loop_times, device_times)), flush=True)
        for codegen, fn in compiled.items():
            print(fn.report)
            # Every graph (a token count of 1 may get its own) fused the pair and ran the op's own kernel.
            fused = {k.codegen for k in fn.report.kernels if k.op == args.op}
            if fn.report.passes.get("fuse_residual_norm", 0) != fn.report.compiles or fused != {codegen.split(",")[0]}:
                raise AssertionError(f"dzc[{codegen}] did not run {args.op} kernels of its codegen: "
                                     f"{fn.report.passes}, {[(k.op, k.codegen) for k in fn.report.kernels]}")

    variants = list(rows[0][3])
    dzc_variants = [v for v in variants if v.startswith("dzc")]
    header = ["H", "T"] + [f"{v} µs" for v in variants] + [f"{v} TB/s" for v in dzc_variants]
    header += [f"{v} / torch.compile" for v in dzc_variants]
    lines = ["Per call, L2 flushed before each (triton.testing.do_bench median):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for hidden, tokens, moved, times, _, _ in rows:
        cells = [str(hidden), str(tokens)] + [f"{times[v] * 1e6:.1f}" for v in variants]
        cells += [f"{moved / times[v] / 1e12:.2f} ({100 * moved / times[v] / PEAK_BYTES_PER_S:.0f}%)"
                  for v in dzc_variants]
        cells += [f"{times['torch.compile'] / times[v]:.2f}x" for v in dzc_variants]
        lines.append("| " + " | ".join(cells) + " |")
    header = ["H", "T"] + [f"{v} µs" for v in variants] + [f"{v} / torch.compile" for v in dzc_variants]
    lines += ["", "Per call, back to back (host and device together; what a decode loop sees):", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for hidden, tokens, _, _, loop_times, _ in rows:
        cells = [str(hidden), str(tokens)] + [f"{loop_times[v] * 1e6:.1f}" for v in variants]
        cells += [f"{loop_times['torch.compile'] / loop_times[v]:.2f}x" for v in dzc_variants]
        lines.append("| " + " | ".join(cells) + " |")
    header = ["H", "T"] + [f"{v} µs" for v in variants] + [f"{v} TB/s" for v in dzc_variants + ["torch.compile"]]
    header += [f"{v} / torch.compile" for v in dzc_variants]
    lines += ["", "GPU time per call (each variant's call captured once into a CUDA graph, replays timed with the L2 "
              "flushed: host time and launch overhead left out):", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for hidden, tokens, moved, _, _, device_times in rows:
        cells = [str(hidden), str(tokens)] + [f"{device_times[v] * 1e6:.1f}" for v in variants]
        cells += [f"{moved / device_times[v] / 1e12:.2f} ({100 * moved / device_times[v] / PEAK_BYTES_PER_S:.0f}%)"
                  for v in dzc_variants + ["torch.compile"]]
        cells += [f"{device_times['torch.compile'] / device_times[v]:.2f}x" for v in dzc_variants]
        lines.append("| " + " | ".join(cells) + " |")
    props = torch.cuda.get_device_properties(device)
    meta = (f"{'' if args.op == 'add_rms_norm' else args.op + ', bf16 with weight and bias: '}"
            f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"tilelang {dsl_versions()['tilelang']}, "
            f"python {platform.python_version()}, {datetime.date.today().isoformat()}. "
            f"'x / torch.compile' is torch.compile's time over dzc's (above 1 = dzc faster); "
            f"TB/s counts 8·T·H bytes, % of the 4.8 TB/s datasheet peak.")
    if args.back_to_back:  # only the back-to-back table
        lines = lines[lines.index("Per call, back to back (host and device together; what a decode loop sees):"):]
        lines = lines[:lines.index("GPU time per call (each variant's call captured once into a CUDA graph, replays "
                                   "timed with the L2 flushed: host time and launch overhead left out):") - 1]
    table = "\n".join(lines)
    print(meta)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(meta + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
