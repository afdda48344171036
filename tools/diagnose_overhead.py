"""Where a compiled add_rms_norm (or MXFP4 MoE) call spends host time: each layer of the real call path timed in place.

    python tools/diagnose_overhead.py [--hidden 2880] [--tokens 1 64 4096]           # CUDA GPU
    python tools/diagnose_overhead.py --device cpu [--hidden 64] [--tokens 1 4]        # no GPU: Triton's interpreter
    python tools/diagnose_overhead.py --op mxfp4_moe [--hidden 2880] [--experts 32] [--tokens 1 64]
    python tools/diagnose_overhead.py --op mxfp4_moe --device cpu [--hidden 64] [--experts 4] [--tokens 1 4]

The MoE model is dzc.models.moe's gpt-oss block (intermediate = hidden; top-4 on CUDA, top-2 on the CPU) with
`--experts` experts: the router runs through the fallback, the experts as one dzc.mxfp4_moe, whose routing and
combine kernels are timed as a layer of their own.

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
from dataclasses import replace

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before dzc and Triton are imported

import dzc  # noqa: E402  (first: it decides Triton's mode)
import torch  # noqa: E402

from dzc import capture, runtime  # noqa: E402
from dzc.models import moe  # noqa: E402
from dzc.models.decoder import AddRMSNorm  # noqa: E402
from dzc.targets import mxfp4_moe_routing as routing  # noqa: E402
from dzc.targets.launch import GeneratedKernel  # noqa: E402

LAYERS = ["dzc.compile wrapper", "CUDA-graph runner", "Dynamo (frame, guards)", "AOTAutograd runtime wrappers",
          "dzc graph code", "GeneratedKernel (prepare, config)", "family launch (grid, arguments)", "Triton launch",
          "Triton launch: MoE routing, combine"]
INTERPRETER = "Triton interpreter (runs the kernel: not host time)"


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


class _IndexedByName(dict):
    """A family's kernels by name (what its triton_launch takes), each an _Indexed."""


def _indexed(compiled, probes: Probes, layer: str):
    if isinstance(compiled, dict):
        return _IndexedByName({name: _Indexed(kernel, probes, layer) for name, kernel in compiled.items()})
    return _Indexed(compiled, probes, layer)


def instrument(probes: Probes, interpreted: bool):
    """Wrap the layers every dzc.compile made after this call builds (backend and runtime hooks), and return
    instrument_model(compiled) for the layers held by a compiled model and its kernels."""
    aot_call, recording_writes, kernel_call = capture.DzcBackend.__call__, runtime.recording_writes, \
        GeneratedKernel.__call__
    capture.DzcBackend.__call__ = lambda self, gm, inputs: probes.wrap(LAYERS[3], aot_call(self, gm, inputs))
    runtime.recording_writes = lambda compiled, written: probes.wrap(LAYERS[4], recording_writes(compiled, written))
    GeneratedKernel.__call__ = lambda self, *args: probes.wrap(LAYERS[5], kernel_call)(self, *args)
    launch_layer = INTERPRETER if interpreted else LAYERS[7]
    routing_kernels, routing_kernel = {}, routing.launchable  # the routing kernels, each wrapped once

    def timed_routing_kernel(name):
        if name not in routing_kernels:
            routing_kernels[name] = _Indexed(routing_kernel(name), probes, INTERPRETER if interpreted else LAYERS[8])
        return routing_kernels[name]

    routing.launchable = timed_routing_kernel

    def instrument_model(compiled):
        compiled._compiled = probes.wrap(LAYERS[2], compiled._compiled)
        compiled._run_compiled = probes.wrap(LAYERS[0], compiled._run_compiled)
        if compiled._cuda_graphs is not None:
            compiled._cuda_graphs.fn = compiled._run_compiled
            compiled._cuda_graphs = probes.wrap(LAYERS[1], compiled._cuda_graphs)
        for record in compiled.report.kernels:
            kernel = runtime._KERNELS.get(record.kernel_id)
            if isinstance(kernel, GeneratedKernel) and not isinstance(kernel.compiled, (_Indexed, _IndexedByName)):
                kernel._launch = probes.wrap(LAYERS[6], kernel._launch)
                kernel.compiled = _indexed(kernel.compiled, probes, launch_layer)
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


def build(op: str, cpu: bool, hidden: int, experts: int):
    """(model, its call arguments for a token count on a device, a description of the shape)."""
    if op == "add_rms_norm":
        def arguments(tokens, device):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            return x, torch.randn_like(x)

        return AddRMSNorm(hidden).bfloat16(), arguments, f"H={hidden}"
    cfg = replace(moe.CONFIGS["tiny-gptoss" if cpu else "gpt-oss-120b"], hidden=hidden, intermediate=hidden,
                  experts=experts)
    model = moe.build_moe(cfg)
    return model, lambda tokens, device: (torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16),), \
        f"mxfp4_moe H=I={hidden}, {experts} experts, top-{cfg.top_k}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=["add_rms_norm", "mxfp4_moe"], default="add_rms_norm")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hidden", type=int, help="default 2880 (cuda), 64 (cpu)")
    parser.add_argument("--experts", type=int, help="mxfp4_moe: default 32 (cuda), 4 (cpu)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="default 1 64 4096 (cuda; mxfp4_moe: 1 64), 1 4 (cpu)")
    parser.add_argument("--calls", type=int, help="default 300 (cuda), 20 (cpu)")
    parser.add_argument("--cache-dir", default="/tmp/dzc-diag")
    # Host costs do not depend on the config; tuning every MoE candidate took longer than a campaign part (s32).
    parser.add_argument("--tune", action="store_true", help="autotune the kernels (default: untuned defaults)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    hidden = args.hidden or (64 if cpu else 2880)
    token_counts = args.tokens or ([1, 4] if cpu else [1, 64] if args.op == "mxfp4_moe" else [1, 64, 4096])
    calls = args.calls or (20 if cpu else 300)
    base = dict(cache_dir=args.cache_dir, autotune=args.tune)
    variants = {"dzc": dict(), "dzc, no CUDA graphs": dict(cuda_graph_max_tokens=0)}
    if cpu:
        variants = {"dzc (Triton interpreter)": dict()}
    model, arguments, shape = build(args.op, cpu, hidden, args.experts or (4 if cpu else 32))
    if args.dry_run:  # the model and the dzc variants, uncalled
        for options in variants.values():
            dzc.compile(model, "cuda", dzc.CompileOptions(**base, **options))
        print(f"dry run: {shape}, tokens {token_counts}")
        return
    device = torch.device(args.device)
    synchronize = (lambda: None) if cpu else torch.cuda.synchronize
    torch._dynamo.config.recompile_limit = 64
    model = model.to(device)
    inputs = {}
    for tokens in token_counts:
        torch.manual_seed(tokens)
        inputs[tokens] = arguments(tokens, device)
    print(f"{shape}, {args.device}, torch {torch.__version__}")
    # Back to back first, before any wrapper exists.
    for tokens, call_args in inputs.items():
        plain = {}
        for name, options in variants.items():
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(**base, **options))
            plain[name] = per_call_us(lambda c=compiled: c(*call_args), calls, synchronize)
        if not cpu:
            with torch.no_grad():
                inductor = torch.compile(model, dynamic=False)
                plain["torch.compile"] = per_call_us(lambda: inductor(*call_args), calls, synchronize)
                plain["eager"] = per_call_us(lambda: model(*call_args), calls, synchronize)
            plain.update(launch_rows(model, call_args, calls, base))
        print(f"T={tokens}: back to back, uninstrumented (host and device together)")
        for name, us in plain.items():
            print(f"    {name:52s} {us:8.2f} us/call")
    probes = Probes()
    probes.calibrate()
    instrument_model = instrument(probes, interpreted=cpu)
    print(f"own time of each layer, instrumented (wrapper cost taken off: {probes.overhead_ns / 1e3:.2f} us per "
          "wrapped call)")
    for tokens, call_args in inputs.items():
        print(f"T={tokens}:")
        for name, options in variants.items():
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(**base, **options))
            with torch.no_grad():
                compiled(*call_args)  # compiles, so that the model's kernels exist to be wrapped
            runner = compiled._cuda_graphs
            timed = instrument_model(compiled)
            print("\n".join(breakdown(name, lambda t=timed: t(*call_args), calls, probes, synchronize)))
            if runner is not None and not cpu:
                print("      runner: " + runner.describe().replace("\n", "\n      "))
    if not cpu:
        call_args = inputs[token_counts[-1]]
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(**base, cuda_graph_max_tokens=0))
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                compiled(*call_args)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def launch_rows(model, call_args: tuple, calls: int, base: dict) -> dict[str, float]:
    """The model's generated kernel alone, on the op arguments and config of a model call: through
    GeneratedKernel, the family's launch with dzc's cached launchers, and with Triton's JIT for the generated
    kernels (MoE routing and combine stay on dzc's launcher)."""
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(**base, cuda_graph_max_tokens=0))
    calls_seen, kernel_call = [], GeneratedKernel.__call__
    GeneratedKernel.__call__ = lambda self, *op_args: calls_seen.append((self, op_args)) or kernel_call(self, *op_args)
    try:
        with torch.no_grad():
            for _ in range(2):  # (a graph's first call runs the rewrite check)
                compiled(*call_args)
    finally:
        GeneratedKernel.__call__ = kernel_call
    kernel, op_args = calls_seen[-1]
    inputs, outputs, tokens, _ = kernel.family.prepare(kernel.spec, *op_args)
    config = kernel._by_tokens[tokens][0]
    cached = kernel.compiled  # CachedLaunchKernel(s); their .fn is the @triton.jit function
    jit = {name: k.fn for name, k in cached.items()} if isinstance(cached, dict) else cached.fn
    sync = torch.cuda.synchronize
    return {
        "GeneratedKernel call": per_call_us(lambda: kernel(*op_args), calls, sync),
        "family launch, dzc's cached launcher": per_call_us(
            lambda: kernel._launch(cached, config, *inputs, *outputs), calls, sync),
        "family launch, Triton JIT (JITFunction.run)": per_call_us(
            lambda: kernel._launch(jit, config, *inputs, *outputs), calls, sync),
    }


if __name__ == "__main__":
    main()
