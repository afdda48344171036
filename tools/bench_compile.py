"""Compile time of the reference models: dzc cold and warm against torch.compile cold and warm, each in a fresh
process, with dzc's compile-time breakdown.

    python tools/bench_compile.py [--quick] [--models llama_decoder multimodal ...] [--no-torch] [--out table.md]

cold = the first call in a fresh process with an empty cache directory (dzc: DZC_CACHE_DIR; torch.compile:
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR); warm = the first call in another fresh process with the same
directories (dzc: compile cache and tuning database hit; torch.compile: its FX graph and AOTAutograd caches). The
first call is what a user waits for: capture, compile, and the first run (kernel builds, dzc's rewrite check).
Models are dzc.models names (their example inputs), on CUDA when there is a GPU, else on the CPU (dzc's kernels
through Triton's interpreter; torch.compile's fallback is Inductor's C++ backend there). dzc tunes nothing
(autotune off): tuning is per device and has its own database. --quick: llama_decoder, dzc only.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

TAG = "BENCH_COMPILE "


def child(args) -> None:
    """One first call in this (fresh) process; prints TAG + JSON."""
    import torch

    import dzc
    from dzc.models import MODELS, build_model
    from dzc.report import format_seconds

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Models whose inputs hold objects (a paged cache) build those on the device themselves.
    wants_device = "device" in inspect.signature(MODELS[args.model][0]).parameters
    model, inputs = build_model(args.model, **({"device": device} if wants_device else {}))
    model = model.to(device)
    inputs = [i.to(device) if isinstance(i, torch.Tensor) else i for i in inputs]
    if args.child == "dzc":
        runnable = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, autotune=False))
    else:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.capture_scalar_outputs = True
        runnable = torch.compile(model)
    start = time.perf_counter()
    with torch.no_grad():
        runnable(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    result = {"seconds": time.perf_counter() - start, "device": device}
    if args.child == "dzc":
        report = runnable.report
        result.update(breakdown=format_seconds(report.compile_seconds()),
                      cache=[g.compile_cache for g in report.graphs], graphs=len(report.graphs))
    print(TAG + json.dumps(result), flush=True)


def run(kind: str, model: str, cache_dir: str) -> dict:
    env = dict(os.environ, DZC_CACHE_DIR=os.path.join(cache_dir, "dzc"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    command = [sys.executable, __file__, "--child", kind, "--model", model, "--cache-dir", env["DZC_CACHE_DIR"]]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line.removeprefix(TAG))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"failed": f"exit {proc.returncode}: {tail}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="llama_decoder, dzc only")
    parser.add_argument("--models", nargs="+", default=["llama_decoder", "moe_mxfp4", "qwen2_5_vl_vision",
                                                         "multimodal"])
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--child", choices=["dzc", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    models = ["llama_decoder"] if args.quick else args.models
    kinds = ["dzc"] if args.quick or args.no_torch else ["dzc", "torch"]
    lines = ["| model | compiler | cold s | warm s | warm/cold | dzc breakdown (cold; warm) | dzc compile cache (warm) |",
             "|---|---|---|---|---|---|---|"]
    device = "?"
    for model in models:
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="dzc-bench-compile-") as cache_dir:
                cold, warm = run(kind, model, cache_dir), run(kind, model, cache_dir)
            device = cold.get("device", device)
            if "failed" in cold or "failed" in warm:
                lines.append(f"| {model} | {kind} | {cold.get('failed', '')} | {warm.get('failed', '')} | | | |")
                continue
            name = "dzc" if kind == "dzc" else "torch.compile"
            breakdown = f"{cold['breakdown']}; {warm['breakdown']}" if kind == "dzc" else ""
            cache = ", ".join(warm.get("cache", []))
            lines.append(f"| {model} | {name} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | "
                         f"{warm['seconds'] / cold['seconds']:.2f} | {breakdown} | {cache} |")
            print(lines[-1], flush=True)
    import torch

    text = "\n".join([f"Compile time, first call, fresh process each; device: {device}, torch {torch.__version__}.",
                      "", *lines]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if any("exit " in line for line in lines[2:]):
        sys.exit("a compile failed (see the table)")


if __name__ == "__main__":
    main()
