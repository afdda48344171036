"""Where a compiled add_rms_norm call spends host time: each layer of the real call path timed in place.

    python tools/diagnose_overhead.py [--hidden 2880] [--tokens 1 64 4096]           # CUDA GPU
    python tools/diagnose_overhead.py --device cpu [--hidden 64] [--tokens 1 4]        # no GPU: Triton's interpreter

Each layer of a compiled model's call (dzc.compile's wrapper, the CUDA-graph runner, Dynamo's frame and guards,
AOTAutograd's runtime wrappers, the dzc graph's code, the generated kernel's preparation, the family's launch
function, the Triton launch) is wrapped where it sits in the compiled model, and its own time (its time less that
of the layers it calls) is summed over the calls; what the wrapping itself costs (measured on empty calls) is taken
off. On the CPU the Triton launch is the interpreter running the kernel: reported, but it is not host overhead.
Then each variant's calls back to back without the wrappers (host and device together), and on the GPU eager,
torch.compile, the Triton JIT launch and dzc's cached launch alone, and a profiler table of one variant.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before dzc and Triton are imported

import dzc  # noqa: E402  (first: it decides Triton's mode)
import torch  # noqa: E402

from dzc import capture, runtime  # noqa: E402
from dzc.models.decoder import AddRMSNorm  # noqa: E402
from dzc.targets.launch import GeneratedKernel  # noqa: E402

LAYERS = ["dzc.compile wrapper", "CUDA-graph runner", "Dynamo (frame, guards)", "AOTAutograd runtime wrappers",
          "dzc graph code", "GeneratedKernel (prepare, config)", "family launch (grid, arguments)", "Triton launch"]


class Probes:
    """Self time per layer: each wrapped call's time less that of the wrapped calls inside it and of the wrappers;
    `per_call` holds each outermost call's times by layer (medians leave out the calls a GC pause or another
    process interrupted)."""

    def __init__(self):
        self.self_ns = collections.Counter()
        self.calls = collections.Counter()
        self.per_call: list[collections.Counter] = []
        self._children: list[list[int]] = []  # per open call: [time in wrapped calls, wrapped calls]
        self.overhead_ns = 0.0

    def wrap(self, layer: str, fn):
        clock, children = time.perf_counter_ns, self._children

        def timed(*args, **kwargs):
            start = clock()
            children.append([0, 0])
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                inside, count = children.pop()
                self.self_ns[layer] += elapsed - inside - count * self.overhead_ns
                self.calls[layer] += 1
                if children:
                    children[-1][0] += elapsed
                    children[-1][1] += 1
                else:  # an outermost call ended
                    self.per_call.append(self.self_ns.copy())

        return timed

    def calibrate(self) -> None:
        """What a wrapper costs its caller: an empty wrapped call inside an empty wrapped call, many times."""
        inner = self.wrap("calibration inner", lambda: None)
        outer = self.wrap("calibration outer", lambda: inner())
        for _ in range(20000):
            outer()
        self.overhead_ns = self.self_ns["calibration outer"] / self.calls["calibration outer"]
        self.reset()

    def reset(self) -> None:
        self.self_ns.clear()
        self.calls.clear()
        self.per_call.clear()

    def medians_us(self) -> dict[str, float]:
        """Median microseconds per outermost call, by layer."""
        steps = [after - before for before, after in zip([collections.Counter()] + self.per_call, self.per_call)]
        layers = {layer for step in steps for layer in step}
        return {layer: statistics.median(step[layer] for step in steps) / 1e3 for layer in layers}


class _Indexed:
    """A launchable kernel (`kernel[grid](...)`) whose launches are timed as one layer."""

    def __init__(self, kernel, probes: Probes, layer: str):
        self.kernel, self.probes, self.layer = kernel, probes, layer

    def __getitem__(self, grid):
        return self.probes.wrap(self.layer, self.kernel[grid])

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def instrument(probes: Probes, interpreted: bool):
    """Wrap the layers every dzc.compile made after this call builds (backend and runtime hooks), and return
    instrument_model(compiled) for the layers held by a compiled model and its kernels."""
    aot_call, recording_writes, kernel_call = capture.DzcBackend.__call__, runtime.recording_writes, \
        GeneratedKernel.__call__
    capture.DzcBackend.__call__ = lambda self, gm, inputs: probes.wrap(LAYERS[3], aot_call(self, gm, inputs))
    runtime.recording_writes = lambda compiled, written: probes.wrap(LAYERS[4], recording_writes(compiled, written))
    GeneratedKernel.__call__ = lambda self, *args: probes.wrap(LAYERS[5], kernel_call)(self, *args)
    launch_layer = "Triton interpreter (runs the kernel: not host time)" if interpreted else LAYERS[7]

    def instrument_model(compiled):
        compiled._compiled = probes.wrap(LAYERS[2], compiled._compiled)
        compiled._run_compiled = probes.wrap(LAYERS[0], compiled._run_compiled)
        if compiled._cuda_graphs is not None:
            compiled._cuda_graphs.fn = compiled._run_compiled
            compiled._cuda_graphs = probes.wrap(LAYERS[1], compiled._cuda_graphs)
        for record in compiled.report.kernels:
            kernel = runtime._KERNELS.get(record.kernel_id)
            if isinstance(kernel, GeneratedKernel) and not isinstance(kernel.compiled, _Indexed):
                kernel._launch = probes.wrap(LAYERS[6], kernel._launch)
                kernel.compiled = _Indexed(kernel.compiled, probes, launch_layer)
        return probes.wrap(LAYERS[0], compiled)

    return instrument_model


def per_call_us(fn, calls: int, synchronize) -> float:
    """Microseconds per call of `calls` calls back to back (after a warm-up), synchronized at both ends."""
    with torch.no_grad():
        for _ in range(5):
            fn()
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def breakdown(name: str, fn, calls: int, probes: Probes, synchronize) -> list[str]:
    """Rows of the per-layer table for `calls` instrumented calls of fn."""
    with torch.no_grad():
        for _ in range(5):
            fn()
    gc.collect()
    gc.disable()  # a collection would land in whichever layer allocates (the interpreter, mostly)
    try:
        probes.reset()
        per_call_us(fn, calls, synchronize)
    finally:
        gc.enable()
    medians = probes.medians_us()
    rows = [f"  {name} (median of {len(probes.per_call)} calls)"]
    host = 0.0
    for layer in LAYERS + sorted(set(medians) - set(LAYERS)):
        if layer not in medians:  # (no CUDA graphs on the CPU; no AOTAutograd wrapper on a compile cache hit)
            rows.append(f"    {layer:52s} {'-':>8s} (not on this call's path)")
            continue
        us = medians[layer]
        if "not host time" not in layer:
            host += us
        rows.append(f"    {layer:52s} {us:8.2f} us/call")
    rows.append(f"    {'host overhead, all layers':52s} {host:8.2f} us/call")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hidden", type=int, help="default 2880 (cuda), 64 (cpu)")
    parser.add_argument("--tokens", type=int, nargs="+", help="default 1 64 4096 (cuda), 1 4 (cpu)")
    parser.add_argument("--calls", type=int, help="default 300 (cuda), 20 (cpu)")
    parser.add_argument("--cache-dir", default="/tmp/dzc-diag")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    hidden = args.hidden or (64 if cpu else 2880)
    token_counts = args.tokens or ([1, 4] if cpu else [1, 64, 4096])
    calls = args.calls or (20 if cpu else 300)
    variants = {"dzc": dict(), "dzc, no CUDA graphs": dict(cuda_graph_max_tokens=0)}
    if cpu:
        variants = {"dzc (Triton interpreter)": dict()}
    if args.dry_run:  # the model and the dzc variants, uncalled
        model = AddRMSNorm(hidden).bfloat16()
        for options in variants.values():
            dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, **options))
        print(f"dry run: H={hidden}, tokens {token_counts}")
        return
    device = torch.device(args.device)
    synchronize = (lambda: None) if cpu else torch.cuda.synchronize
    torch._dynamo.config.recompile_limit = 64
    model = AddRMSNorm(hidden).to(device, torch.bfloat16)
    inputs = {}
    for tokens in token_counts:
        torch.manual_seed(tokens)
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        inputs[tokens] = (x, torch.randn_like(x))
    print(f"H={hidden}, {args.device}, torch {torch.__version__}")
    # Back to back first, before any wrapper exists.
    for tokens, (x, r) in inputs.items():
        plain = {}
        for name, options in variants.items():
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, **options))
            plain[name] = per_call_us(lambda c=compiled: c(x, r), calls, synchronize)
        if not cpu:
            with torch.no_grad():
                inductor = torch.compile(model, dynamic=False)
                plain["torch.compile"] = per_call_us(lambda: inductor(x, r), calls, synchronize)
                plain["eager"] = per_call_us(lambda: model(x, r), calls, synchronize)
            plain.update(launch_rows(model, x, r, calls, args.cache_dir))
        print(f"T={tokens}: back to back, uninstrumented (host and device together)")
        for name, us in plain.items():
            print(f"    {name:52s} {us:8.2f} us/call")
    probes = Probes()
    probes.calibrate()
    instrument_model = instrument(probes, interpreted=cpu)
    print(f"own time of each layer, instrumented (wrapper cost taken off: {probes.overhead_ns / 1e3:.2f} us per "
          "wrapped call)")
    for tokens, (x, r) in inputs.items():
        print(f"T={tokens}:")
        for name, options in variants.items():
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, **options))
            with torch.no_grad():
                compiled(x, r)  # compiles, so that the model's kernels exist to be wrapped
            runner = compiled._cuda_graphs
            timed = instrument_model(compiled)
            print("\n".join(breakdown(name, lambda t=timed: t(x, r), calls, probes, synchronize)))
            if runner is not None and not cpu:
                print("      runner: " + runner.describe().replace("\n", "\n      "))
    if not cpu:
        x, r = inputs[token_counts[-1]]
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=args.cache_dir, cuda_graph_max_tokens=0))
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                compiled(x, r)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def launch_rows(model, x, r, calls: int, cache_dir: str) -> dict[str, float]:
    """The generated kernel alone: through GeneratedKernel, the family's launch with Triton's JIT, and with dzc's
    cached launcher (all on the model's own kernel and tuned config)."""
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=cache_dir, cuda_graph_max_tokens=0))
    with torch.no_grad():
        compiled(x, r)
    kernel = runtime._KERNELS[compiled.report.kernels[0].kernel_id]
    launcher = kernel.compiled  # targets.triton_codegen.CachedLaunchKernel; its .fn is the @triton.jit function
    w = model.norm.weight
    statics = (False, True, torch.bfloat16, torch.bfloat16)
    config = kernel._by_tokens[x.shape[0]][0]
    y, h = torch.empty_like(x), torch.empty_like(x)
    sync = torch.cuda.synchronize
    return {
        "GeneratedKernel call": per_call_us(lambda: kernel(x, r, w, 1e-6, *statics), calls, sync),
        "family launch, dzc's cached launcher": per_call_us(
            lambda: kernel._launch(launcher, config, x, r, w, 1e-6, y, h), calls, sync),
        "family launch, Triton JIT (JITFunction.run)": per_call_us(
            lambda: kernel._launch(launcher.fn, config, x, r, w, 1e-6, y, h), calls, sync),
    }


if __name__ == "__main__":
    main()
