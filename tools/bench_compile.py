"""Compile time of the reference models: dzc cold and warm against torch.compile cold and warm, each in a fresh
process, with dzc's compile-time breakdown.

    python tools/bench_compile.py [--quick] [--models llama_decoder multimodal ...] [--no-torch] [--out table.md]
                                  [--layers N] [--vision-layers N] [--regions on|off|both] [--cold-only]
                                  [--profile-warm DIR] [--profile-cold DIR] [--child-logs DIR]
                                  [--no-bytecode-cache] [--forget-tilelang-records] [--warm-by-hash]

Times are the compile call (dzc.compile / torch.compile) plus the first call: torch.compile() imports Inductor
before it returns, dzc.compile() at the first call (before session 22 only the first call was timed, which left
torch.compile's imports out). cold = a fresh process with empty cache directories (dzc: DZC_CACHE_DIR;
torch.compile: TORCHINDUCTOR_CACHE_DIR; both: TRITON_CACHE_DIR and TILELANG_CACHE_DIR, whose compiled kernels
before session 35 outlived a run in ~/.tilelang/cache, so that a later "cold" dzc compile on the same machine built
no TileLang kernel); warm = another fresh process with the same
directories (dzc: compile cache and tuning database hit; torch.compile: its FX graph and AOTAutograd caches). That
is what a user waits for: capture, compile, and the first run (kernel builds, dzc's rewrite check).
Models are dzc.models names (their example inputs), on CUDA when there is a GPU, else on the CPU (dzc's kernels
through Triton's interpreter; torch.compile's fallback is Inductor's C++ backend there). dzc tunes nothing
(autotune off): tuning is per device and has its own database. --quick: llama_decoder, dzc only. --layers: build
the models with N layers (llama_decoder: decoder layers; multimodal: decoder and vision layers each);
--vision-layers: multimodal's vision layers where they differ (issue 18's full depth: --layers 61 --vision-layers
32). --regions:
dzc with CompileOptions.nested_regions on (the bench's default and dzc's), off, or both (a row each). --cold-only:
skip the warm run. --profile-warm DIR: run each warm compile and first call under cProfile and write its 60
costliest calls (cumulative) and what the fallback compile spends to DIR/<model>-<compiler>-warm.txt (where a
warm compile's seconds go), with the whole profile beside it (.pstats, for pstats or snakeviz); --profile-cold DIR:
the same for each cold compile (<model>-<compiler>-cold.txt). Every child shares one Python bytecode cache
(PYTHONPYCACHEPREFIX), filled before the first timed run by a process that imports torch, Inductor and dzc: an
installed torch has its .pyc files, but the H200 machine's has none, and there each process compiled ~260 modules
from source (1.9 s, session 22), which is not what a user waits for (PYTHONDONTWRITEBYTECODE is dropped for it).
--no-bytecode-cache: each process reads bytecode where its installation keeps it (before session 35 the only way).
--warm-by-hash: one more warm row with Inductor's compile looked up by hashing the graph, not loaded by the key
the compile cache entry keeps (dzc/inductor_entry.py): that change's A/B in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    depth = {"layers": args.layers} if args.layers else {}
    if args.vision_layers:
        depth["vision_layers"] = args.vision_layers
    model, inputs = build_model(args.model, **({"device": device} if wants_device else {}), **depth)
    model = model.to(device)
    inputs = [i.to(device) if isinstance(i, torch.Tensor) else i for i in inputs]
    if args.no_inductor_key:  # --warm-by-hash's run: a hit never loads Inductor's compile by the stored key
        from dzc import inductor_entry

        inductor_entry.load = lambda *args: (None, "turned off by --warm-by-hash")
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    with profile or contextlib.nullcontext():
        # The compile call is timed with the first call: torch.compile() imports Inductor (seconds) where
        # dzc.compile() defers what it needs to the first call.
        if args.child == "dzc":
            runnable = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, autotune=False,
                                                                     nested_regions=args.regions == "on"))
        else:
            torch._dynamo.config.capture_dynamic_output_shape_ops = True
            torch._dynamo.config.capture_scalar_outputs = True
            runnable = torch.compile(model)
        compile_call_s = time.perf_counter() - start
        with torch.no_grad():
            runnable(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
    result = {"seconds": time.perf_counter() - start, "compile_call_s": compile_call_s, "device": device}
    if profile is not None:
        with open(args.profile, "w") as f:
            stats = pstats.Stats(profile, stream=f).sort_stats("cumulative")
            stats.print_stats(60)
            stats.print_callees("compile_fx_inner|_fallback")
        profile.dump_stats(str(Path(args.profile).with_suffix(".pstats")))
    if args.child == "dzc":
        report = runnable.report
        result.update(breakdown=format_seconds(report.compile_seconds()), frame=report.frame_cache,
                      cache=[g.compile_cache for g in report.graphs], graphs=len(report.graphs),
                      regions=report.nested_regions, region_retries=report.region_retries, fired=report.fired(),
                      stages={name: round(seconds, 2) for name, seconds in report.compile_seconds().items()})
    print(TAG + json.dumps(result), flush=True)


# What the bytecode cache is primed with: the modules both compilers import on their first call.
PRIME = ("import torch, torch._dynamo, torch._inductor.compile_fx, torch._inductor.lowering, "
         "torch._inductor.select_algorithm, dzc")


def with_bytecode(env: dict, prefix: str) -> dict:
    """`env` writing and reading bytecode under `prefix`: PYTHONDONTWRITEBYTECODE dropped (a container may set it;
    then no process wrote what the next one reads, and session 52's warm profile on the GPU machine spent 1.9 s
    compiling 1186 modules from source)."""
    env = dict(env, PYTHONPYCACHEPREFIX=prefix)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def prime_bytecode(prefix: str) -> None:
    subprocess.run([sys.executable, "-c", PRIME], check=True, env=with_bytecode(os.environ, prefix))


def run(kind: str, model: str, cache_dir: str, layers: int | None = None, regions: str = "on",
        profile: str | None = None, vision_layers: int | None = None, bytecode: str | None = None,
        log: str | None = None, by_hash: bool = False) -> dict:
    env = dict(os.environ, DZC_CACHE_DIR=os.path.join(cache_dir, "dzc"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TILELANG_CACHE_DIR=os.path.join(cache_dir, "tilelang"))
    if bytecode:
        env = with_bytecode(env, bytecode)
    command = [sys.executable, __file__, "--child", kind, "--model", model, "--cache-dir", env["DZC_CACHE_DIR"],
               "--regions", regions, *(["--layers", str(layers)] if layers else []),
               *(["--vision-layers", str(vision_layers)] if vision_layers else []),
               *(["--profile", profile] if profile else []), *(["--no-inductor-key"] if by_hash else [])]
    # With `log`, the child's output goes there as it is written (what a compile cut off by a time limit got
    # through), its result line included.
    if log:
        with open(log, "w") as out:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        stdout = stderr = Path(log).read_text()
    else:
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        stdout, stderr = proc.stdout, proc.stderr
    for line in stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line.removeprefix(TAG))
    tail = (stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"failed": f"exit {proc.returncode}: {tail}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="llama_decoder, dzc only")
    parser.add_argument("--models", nargs="+", default=["llama_decoder", "moe_mxfp4", "qwen2_5_vl_vision",
                                                         "multimodal"])
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--layers", type=int, help="build the models with this many layers")
    parser.add_argument("--vision-layers", type=int, help="multimodal: this many vision layers (default --layers)")
    parser.add_argument("--regions", choices=["on", "off", "both"], default="on",
                        help="dzc's nested compile regions (CompileOptions.nested_regions)")
    parser.add_argument("--cold-only", action="store_true", help="skip the warm run")
    parser.add_argument("--profile-warm", metavar="DIR", help="cProfile each warm first call into DIR")
    parser.add_argument("--profile-cold", metavar="DIR", help="cProfile each cold first call into DIR")
    parser.add_argument("--child-logs", metavar="DIR", help="write each child's output to DIR/<model>-<compiler>-"
                        "<cold|warm>.log as it runs (with DZC_DEBUG=1: dzc's report when its compile ends)")
    parser.add_argument("--forget-tilelang-records", action="store_true",
                        help="dzc: one more warm run, after removing the TileLang kernels' prim_func records and "
                        "built notes from dzc's cache (a warm start as it was before them: the front end runs again "
                        "and children prebuild kernels that are in TileLang's cache)")
    parser.add_argument("--warm-by-hash", action="store_true",
                        help="dzc: one more warm run in which Inductor looks the graph up by hashing it (the key "
                        "the compile cache entry keeps left unused, as before session 52): the A/B of "
                        "dzc/inductor_entry.py in one run")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="no shared, primed bytecode cache: each process reads its installation's")
    parser.add_argument("--child", choices=["dzc", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--no-inductor-key", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for folder in (args.profile_warm, args.profile_cold, args.child_logs):
        if folder:
            os.makedirs(folder, exist_ok=True)
    models = ["llama_decoder"] if args.quick else args.models
    if args.vision_layers and models != ["multimodal"]:
        parser.error("--vision-layers builds the multimodal model only: pass --models multimodal")
    kinds = ["dzc"] if args.quick or args.no_torch else ["dzc", "torch"]
    settings = ["on", "off"] if args.regions == "both" else [args.regions]
    lines = ["| model | compiler | cold s | warm s | warm/cold | of which the compile call (cold; warm) "
             "| dzc breakdown (cold; warm) | dzc compile cache (warm) |",
             "|---|---|---|---|---|---|---|---|"]
    label = f" ({args.layers} layers)" if args.layers else ""
    if args.vision_layers:  # (without --layers the decoder keeps the model's own depth)
        label = f" ({args.layers or 'default'} decoder + {args.vision_layers} vision layers)"
    bytecode_dir = contextlib.nullcontext() if args.no_bytecode_cache else tempfile.TemporaryDirectory(
        prefix="dzc-bench-pyc-")
    with bytecode_dir as bytecode:
        if bytecode:
            prime_bytecode(bytecode)
        device = measure(args, models, kinds, settings, label, lines, bytecode)
        cached = sum(1 for _ in Path(bytecode).rglob("*.pyc")) if bytecode else 0
    import torch

    text = "\n".join([f"Compile time (compile call + first call), fresh process each; device: {device}, "
                      f"torch {torch.__version__}; "
                      + ("each process's own bytecode." if args.no_bytecode_cache else "a shared, primed bytecode "
                         f"cache ({cached} modules in it after the runs)."), "", *lines]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if any("exit " in line for line in lines[2:]):
        sys.exit("a compile failed (see the table)")


def measure(args, models: list[str], kinds: list[str], settings: list[str], label: str, lines: list[str],
            bytecode: str | None) -> str:
    """Each model's cold and warm rows appended to lines; returns the device the children ran on."""
    device = "?"
    for model in models:
        for kind, regions in [(kind, r) for kind in kinds for r in (settings if kind == "dzc" else ["on"])]:
            with tempfile.TemporaryDirectory(prefix="dzc-bench-compile-") as cache_dir:
                logs = {when: os.path.join(args.child_logs, f"{model}-{kind}-{when}.log") if args.child_logs
                        else None for when in ("cold", "warm")}
                profiles = {when: os.path.join(folder, f"{model}-{kind}-{when}.txt") if folder else None
                            for when, folder in (("cold", args.profile_cold), ("warm", args.profile_warm))}
                cold = run(kind, model, cache_dir, args.layers, regions, profiles["cold"], args.vision_layers,
                           bytecode, logs["cold"])
                warm = cold if args.cold_only else run(kind, model, cache_dir, args.layers, regions,
                                                       profiles["warm"], args.vision_layers, bytecode, logs["warm"])
                by_hash = forgot = None
                if args.warm_by_hash and kind == "dzc" and not args.cold_only:
                    by_hash = run(kind, model, cache_dir, args.layers, regions, None, args.vision_layers, bytecode,
                                  logs["warm"] and logs["warm"].replace("-warm.log", "-warm-by-hash.log"), True)
                if args.forget_tilelang_records and kind == "dzc" and not args.cold_only:
                    records = list(Path(cache_dir, "dzc").rglob("*.prim_func.*"))
                    for record in records:
                        record.unlink()
                    forgot = run(kind, model, cache_dir, args.layers, regions, None, args.vision_layers, bytecode,
                                 logs["warm"] and logs["warm"].replace("-warm.log", "-warm-forgot.log"))
                    forgot["records_removed"] = len(records)
            print(TAG + json.dumps({"model": model, "layers": args.layers, "vision_layers": args.vision_layers,
                                    "kind": kind, "regions": regions,
                                    "cold": cold, "warm": None if args.cold_only else warm}), flush=True)
            device = cold.get("device", device)
            if "failed" in cold or "failed" in warm:
                lines.append(f"| {model}{label} | {kind} | {cold.get('failed', '')} | {warm.get('failed', '')} "
                             "| | | | |")
                continue
            name = f"dzc, regions {regions}" if kind == "dzc" else "torch.compile"
            breakdown = f"{cold['breakdown']}; {warm['breakdown']}" if kind == "dzc" else ""
            cache = ", ".join(warm.get("cache", []))
            lines.append(f"| {model}{label} | {name} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | "
                         f"{warm['seconds'] / cold['seconds']:.2f} | "
                         f"{cold['compile_call_s']:.2f}; {warm['compile_call_s']:.2f} | {breakdown} | {cache} |")
            print(lines[-1], flush=True)
            for extra, what in ((by_hash, "warm, Inductor's graph looked up by hash"),
                                (forgot, "warm without TileLang records "
                                 f"({(forgot or {}).get('records_removed')} removed)")):
                if extra is None:
                    continue
                lines.append(f"| {model}{label} | {name}, {what} | | "
                             + (f"{extra['failed']} | | | | |" if "failed" in extra else
                                f"{extra['seconds']:.1f} | | ; {extra['compile_call_s']:.2f} | "
                                f"; {extra['breakdown']} | {', '.join(extra.get('cache', []))} |"))
                print(lines[-1], flush=True)
    return device


if __name__ == "__main__":
    main()
