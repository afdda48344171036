"""Where a compiled add_rms_norm call spends host time: each layer of the call path timed on its own.

    python tools/diagnose_overhead.py [--hidden 2880] [--tokens 4096]

Prints microseconds per call (host loop of N calls, then one synchronize) for eager, torch.compile, dzc with
each fallback, the generated kernel's launcher, and the bare Triton launch; then a profiler table of one call.
"""

from __future__ import annotations

import argparse

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

from dzc import runtime
from dzc.models.decoder import AddRMSNorm
from bench_add_rms_norm import loop_time  # tools/ is on sys.path when run as a script


def per_call_us(fn, calls=300) -> float:
    return loop_time(fn, calls) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    if args.dry_run:  # the model and the dzc variants, uncalled
        model = AddRMSNorm(args.hidden).bfloat16()
        for fallback in ("inductor", "eager"):
            for graphs in (0, 256):
                dzc.compile(model, "cuda", dzc.CompileOptions(fallback=fallback, cuda_graph_max_tokens=graphs,
                                                              cache_dir="/tmp/dzc-diag"))
        print(f"dry run: H={args.hidden}, tokens {args.tokens}")
        return
    torch._dynamo.config.recompile_limit = 64
    model = AddRMSNorm(args.hidden).cuda().bfloat16()
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        results = {}
        with torch.no_grad():
            results["eager"] = per_call_us(lambda: model(x, r))
            inductor = torch.compile(model, dynamic=False)
            results["torch.compile"] = per_call_us(lambda: inductor(x, r))
        for fallback in ("inductor", "eager"):
            for graphs in (0, 256):
                fn = dzc.compile(model, "cuda", dzc.CompileOptions(fallback=fallback, cuda_graph_max_tokens=graphs,
                                                                   cache_dir="/tmp/dzc-diag"))
                results[f"dzc fallback={fallback} graphs<={graphs}"] = per_call_us(lambda: fn(x, r))
        kernel_id = fn.report.kernels[0].kernel_id
        kernel = runtime._KERNELS[kernel_id]
        w = model.norm.weight
        statics = (False, True, torch.bfloat16, torch.bfloat16)
        results["GeneratedKernel call"] = per_call_us(lambda: kernel(x, r, w, 1e-6, *statics))
        results["dzc op via dispatcher"] = per_call_us(
            lambda: torch.ops.dzc.add_rms_norm.default(x, r, w, 1e-6, *statics, kernel_id=kernel_id))
        config = next(iter(kernel._config_by_bucket.values()))
        y, h = torch.empty_like(x), torch.empty_like(x)
        results["cached triton launch"] = per_call_us(
            lambda: kernel._launch(kernel.compiled, config, x, r, w, 1e-6, y, h))
        results["triton JIT launch"] = per_call_us(
            lambda: kernel._launch(kernel.compiled.fn, config, x, r, w, 1e-6, y, h))
        with torch.no_grad():
            graphed = torch.compile(model, mode="reduce-overhead", dynamic=False)
            results["torch.compile reduce-overhead"] = per_call_us(lambda: graphed(x, r))
            backend_only = torch.compile(model, backend=dzc.backend("cuda", dzc.CompileOptions(
                cuda_graph_max_tokens=0, cache_dir="/tmp/dzc-diag")))
            results["torch.compile(backend=dzc), no wrapper"] = per_call_us(lambda: backend_only(x, r))
        print(f"H={args.hidden} T={tokens}")
        for name, us in results.items():
            print(f"  {name:40s} {us:8.1f} us/call")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                fn(x, r)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
