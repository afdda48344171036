"""Where does an mxfp4_moe call spend its time? Per-kernel GPU time of the whole op (routing, activation reorder,
gate/up GEMM, split-K activation, down GEMM, combine) for a few configs, beside OpenAI's triton_kernels layer, from
torch.profiler's CUDA activity (H200; the same random layers and routing as tools/bench_mxfp4_moe.py).

    python tools/diagnose_mxfp4_moe_kernels.py [--models gpt-oss-120b] [--tokens 1 8 64] \
        [--configs "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,num_stages=3" ...] [--once]
    python tools/diagnose_mxfp4_moe_kernels.py --dry-run   # CPU: the configs checked for legality, no launches
    python tools/diagnose_mxfp4_moe_kernels.py --sass --configs ...   # CPU: the GEMMs' sm_90 SASS, statically
    python tools/diagnose_mxfp4_moe_kernels.py --sass-triton-kernels --tokens 8   # CPU: triton_kernels' SASS

A config is KEY=VALUE pairs (num_warps and num_stages among them; WORKSPACE=0 unless given; FP8=1 configs are
the W4A8 op's). Each config is checked against the op's reference first. Prints, per (model, tokens, variant), each
kernel's mean µs per call and the sum, and, for the GEMMs, the packed weight bytes of the experts touched ÷ the
kernel's time.

--sass (no GPU): compiles each config's two GEMMs for sm_90 at the model's shape (Triton's ptxas and nvdisasm) and
prints per kernel its registers, spill bytes, shared memory and, for its K loop (the loop with the most MMA
instructions), the instructions of one step: MMAs (HGMMA bf16, QGMMA FP8) and their shapes, the wgmma waits
(`WARPGROUP.DEPBAR.LE gsb0, N`: N groups left in flight; 0 waits for every MMA issued), loads and stores by kind,
local-memory (spill) accesses, and the ALU the weight decode and the FP8 scale promotion cost.

--sass-triton-kernels (no GPU): the same for OpenAI's triton_kernels (.triton-kernels; bench_mxfp4_moe.py's
baseline) at each token count: its own matmul_ogs host code runs on CPU tensors (random packed weights in its
HOPPER_VALUE / HOPPER_SCALE layouts for 8 experts, the routing over all of the model's: its opt flags depend on the
expert count, the compiled kernel not on how many experts the weights hold) under a stand-in driver that reports
sm_90 and an H200's 132 SMs and 227 KB of shared memory, with Triton's launches turned into compiles
(JITFunction.run's warmup); its opt flags, then each GEMM kernel's profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

if any(a.startswith("--sass") for a in sys.argv):  # compiling for a GPU needs Triton's interpreter off (dzc turns
    # it on without a GPU)
    os.environ.setdefault("TRITON_INTERPRET", "0")
import dzc  # noqa: E402, F401  (first: it decides Triton's mode)
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mxfp4_moe as bench  # noqa: E402

from dzc.ops.mxfp4_moe import mxfp4_moe_reference, mxfp4_moe_w4a8_reference  # noqa: E402
from dzc.targets import mxfp4_moe as family  # noqa: E402
from dzc.targets import triton_codegen  # noqa: E402
from dzc.targets.kernel_config import KernelConfig  # noqa: E402
from dzc.targets.launch import legal_configs  # noqa: E402
from dzc.targets.profiles import SM_90  # noqa: E402

DEFAULT_CONFIGS = (
    "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,num_warps=4,num_stages=3",
    "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3",
    "BLOCK_M=16,BLOCK_N=128,BLOCK_K=128,SPLIT_K=1,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3",
)
CALLS = 20


def parse_config(text: str) -> KernelConfig:
    fields = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    warps, stages = fields.pop("num_warps", 4), fields.pop("num_stages", 3)
    fields.setdefault("WORKSPACE", 0)
    return KernelConfig.make(num_warps=warps, num_stages=stages, **fields)


def is_w4a8(config: KernelConfig) -> bool:
    return dict(config.params).get("FP8", 0) == 1


def kernel_times(fn) -> dict[str, float]:
    """Mean GPU µs per call of each kernel `fn` launches (CALLS calls after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / CALLS
    return dict(totals)


def touched_weight_bytes(spec, topk_ids) -> tuple[int, int]:
    """Packed bytes + scales of the touched experts, (gate/up weight, down weight)."""
    experts = int(torch.unique(topk_ids).numel())
    gate_up = 2 * spec.inter * spec.hidden * experts * (1 / 2 + 1 / 32)
    down = spec.hidden * spec.inter * experts * (1 / 2 + 1 / 32)
    return int(gate_up), int(down)


def report(label: str, times: dict[str, float], weight_bytes: tuple[int, int]) -> None:
    print(f"{label}: total {sum(times.values()):.1f} µs")
    for name, us in sorted(times.items(), key=lambda item: -item[1]):
        gemm = ("gate_up" in name and weight_bytes[0]) or ("down" in name and weight_bytes[1]) or 0
        bandwidth = f"  ({gemm / us / 1e6:.2f} TB/s of its weights)" if gemm and us > 0 else ""
        print(f"    {us:8.1f} µs  {name[:100]}{bandwidth}")


# ---------------------------------------------------------------------------------------------------------
# --sass: the GEMMs' K loops compiled for sm_90, statically (CPU host)

# (label, SASS opcode pattern), first match wins; what is left counts as "other ALU".
SASS_CLASSES = (
    ("MMA", r"[HQ]GMMA|HMMA"), ("wgmma wait", r"WARPGROUP\.DEPBAR"), ("wgmma arrive", r"WARPGROUP\.ARRIVE"),
    ("UTMALDG", r"UTMALDG"), ("LDGSTS", r"LDGSTS"), ("LDGDEPBAR/DEPBAR", r"LDGDEPBAR|DEPBAR"), ("LDG", r"LDG"),
    ("LDSM", r"LDSM"), ("LDS", r"LDS"), ("STS", r"STS"), ("LDL/STL (spill)", r"LDL|STL"), ("BAR", r"BAR"),
    ("PRMT", r"PRMT"), ("LOP3", r"LOP3"), ("SHF", r"SHF|SHL|SHR"), ("HFMA2/HMUL2", r"HFMA2|HMUL2|HADD2"),
    ("F2F/F2FP", r"F2F|I2F|F2I"), ("FFMA/FMUL/FADD", r"FFMA|FMUL|FADD"), ("IMAD/IADD/LEA", r"IMAD|IADD|LEA"),
    ("ISETP/SEL", r"ISETP|SEL|FSETP|FSEL"), ("MOV", r"MOV|UMOV"), ("uniform/R2UR", r"R2UR|U"),
)


def sass_instructions(sass: str) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """nvdisasm text -> [(opcode, instruction)], {label: index of the instruction it labels}."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_\w+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        code = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if code:
            text = re.sub(r"^@!?U?P[T0-9]+\s+", "", code.group(1))  # the predicate
            instructions.append((text.split()[0], text))
    return instructions, labels


def main_loop(instructions, labels) -> tuple[int, int] | None:
    """(first, last) instruction of the loop (a backward branch's range) with the most MMA instructions."""
    loops = []
    for index, (opcode, text) in enumerate(instructions):
        target = re.search(r"(\.L_\w+)", text) if opcode.startswith("BRA") else None
        if target and labels.get(target.group(1), index + 1) <= index:
            loops.append((labels[target.group(1)], index))

    def mmas(loop):
        return sum(re.match(SASS_CLASSES[0][1], op) is not None for op, _ in instructions[loop[0]:loop[1] + 1])

    # the shortest of those with the most MMAs: a spin loop placed after the kernel's exit (an mbarrier wait of a
    # TMA load: `@!P BRA` back to itself, then `BRA` into the K loop's body) branches backward over the whole
    # loop too, so the longest backward range would count the epilogue and prologue as part of a K step
    return max(loops, key=lambda loop: (mmas(loop), loop[0] - loop[1]), default=None)


def loop_profile(sass: str) -> dict:
    """One K step of the main loop: instruction counts by class, MMA shapes, the wgmma waits' depths, and
    local-memory (spill) accesses outside the loop."""
    instructions, labels = sass_instructions(sass)
    loop = main_loop(instructions, labels)
    if loop is None:
        return {}
    body = instructions[loop[0]:loop[1] + 1]
    counts = Counter(next((label for label, pattern in SASS_CLASSES if re.match(pattern, op)), "other ALU")
                     for op, _ in body)
    local = sum(op.startswith(("LDL", "STL")) for op, _ in instructions)
    return dict(instructions=len(body), counts=dict(counts),
                mma_shapes=dict(Counter(text.split()[0] for op, text in body if re.match(r"[HQ]GMMA|HMMA", op))),
                waits=[int(re.search(r"gsb0, (0x[0-9a-f]+)", text).group(1), 16)
                       for op, text in body if op.startswith("WARPGROUP.DEPBAR")],
                spill_accesses_in_loop=counts.get("LDL/STL (spill)", 0),
                spill_accesses_elsewhere=local - counts.get("LDL/STL (spill)", 0))


def triton_tool(name: str) -> str:
    """The path of a CUDA tool as Triton finds it: ptxas through Triton (TRITON_PTXAS_PATH first), the others
    from Triton's own bin/ where it has them, else beside that ptxas. Inductor points TRITON_PTXAS_PATH at torch's
    bundled ptxas, whose folder has no nvdisasm (the H100 host, session 41)."""
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415 (CUDA Tritons only)

    try:
        ptxas = get_ptxas(90).path
    except TypeError:  # Tritons whose get_ptxas takes no architecture
        ptxas = get_ptxas().path
    if name == "ptxas":
        return ptxas
    own = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(own) if os.access(own, os.X_OK) else str(Path(ptxas).with_name(name))


def compiled_profile(kernel) -> dict:
    """Registers, spill bytes (ptxas -v on the kernel's PTX, sm_90a), shared memory and the K loop's profile."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        ptx.write_text(kernel.asm["ptx"])
        verbose = subprocess.run([triton_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                                 capture_output=True, text=True)
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([triton_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    log = verbose.stdout + verbose.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=int(registers.group(1)) if registers else None,
                spill_bytes=tuple(int(n) for n in spills.groups()) if spills else None,
                wgmma_serialized="C7515" in log or "C7513" in log, shared=kernel.metadata.shared,
                loop=loop_profile(sass))


def static_profiles(spec, config: KernelConfig, workdir: Path) -> dict[str, dict]:
    """The config's gate/up and down GEMMs compiled for sm_90 (pointers 16-byte aligned, as the JIT specialises
    torch's allocations), each kernel's compiled_profile."""
    spec = dataclasses.replace(spec, fp8_activations=is_w4a8(config))
    path = workdir / f"mxfp4_moe_{abs(hash(spec))}.py"
    path.write_text(family.triton_source(spec, SM_90))
    profiles = {}
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        signature, constexprs, *_ = family.triton_signatures(spec, config)[name]
        kernel = triton_codegen.compile_ahead_of_time(
            path, name, signature, constexprs, config.num_warps, SM_90, config.num_stages,
            divisible_by_16=tuple(n for n in signature if n.endswith("_ptr")))
        profiles[name] = compiled_profile(kernel)
    return profiles


def triton_kernels_static_profiles(model: str, tokens: int, experts: int = 8) -> tuple[list[str], dict[str, dict]]:
    """triton_kernels' gate/up (gather, fused SwiGLU) and down (scatter, gammas) matmul_ogs calls at the model's shape
    and `tokens` compiled for sm_90 on this CPU host (module docstring): ([its opt flags per call], {kernel: its
    compiled_profile}). Changes this process's Triton driver and torch.cuda queries for good: run it last."""
    import types  # noqa: PLC0415

    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.runtime import jit  # noqa: PLC0415

    class CompileOnlyDriver:  # what matmul_ogs and JITFunction.run ask of the active driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(CompileOnlyDriver())
    torch.cuda.get_device_capability = lambda *args: (9, 0)
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(multi_processor_count=132,
                                                                         shared_memory_per_block_optin=232448)
    compiled = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    tk, origin = bench.load_triton_kernels(None)
    if tk is None:
        sys.exit(f"triton_kernels: {origin}")
    from triton_kernels.matmul_ogs_details import opt_flags  # noqa: PLC0415
    from triton_kernels.tensor_details.ragged_tensor import make_ragged_tensor_metadata_torch  # noqa: PLC0415

    flags, make = [], opt_flags.make_opt_flags

    def recorded(*args, **kwargs):
        flags.append(make(*args, **kwargs))
        return flags[-1]

    sys.modules[tk.matmul_ogs.__module__].make_opt_flags = recorded
    spec = bench.model_spec(model)
    h, i, k = spec.hidden, spec.inter, spec.top_k
    warps = bench.TritonKernelsMoE.num_warps(tokens)
    generator = torch.Generator().manual_seed(0)

    def weight(n, columns):  # [E, K/2, N] packed bytes (K contiguous) and [E, K/32, N] scales, in its layouts
        values = torch.randint(0, 256, (experts, n, columns // 2), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 130, (experts, n, columns // 32), dtype=torch.uint8, generator=generator)
        return (tk.convert_layout(tk.wrap_torch_tensor(values.transpose(-2, -1), dtype=tk.FP4),
                                  tk.layout.HopperMXValueLayout, mx_axis=1),
                tk.PrecisionConfig(weight_scale=tk.convert_layout(tk.wrap_torch_tensor(scales.transpose(-2, -1)),
                                                                  tk.layout.HopperMXScaleLayout, mx_axis=1,
                                                                  num_warps=warps)))

    ids = torch.stack([torch.randperm(spec.experts, generator=generator)[:k] for _ in range(tokens)]).flatten()
    combine = torch.argsort(ids, stable=True)
    dispatch = torch.empty_like(combine)
    dispatch[combine] = torch.arange(ids.numel())
    ragged = make_ragged_tensor_metadata_torch(torch.bincount(ids, minlength=spec.experts).int(), ids.numel())
    routing = tk.RoutingData(None, ragged.slice_sizes, spec.experts, k, ragged)
    combine, dispatch = combine.int(), dispatch.int()
    activation = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                    (1.702, 7.0))
    profiles = {}
    for name, (w, precision), x, extra in (
            ("gate/up", weight(2 * i, h), torch.randn(tokens, h).bfloat16(),
             dict(gather_indx=tk.GatherIndx(combine, dispatch), fused_activation=activation)),
            ("down", weight(h, i), torch.randn(tokens * k, i).bfloat16(),
             dict(scatter_indx=tk.ScatterIndx(dispatch, combine), gammas=torch.rand(tokens * k)))):
        first = len(compiled)
        tk.matmul_ogs(x, w, torch.zeros(experts, w.shape[-1]), routing, precision_config=precision, **extra)
        for fn, kernel in compiled[first:]:
            if "matmul_ogs" in fn:
                profiles[f"{name} {fn}"] = compiled_profile(kernel)
    return [str(f) for f in flags], profiles


def print_static(label: str, profiles: dict[str, dict]) -> None:
    print(label)
    for name, p in profiles.items():
        loop = p["loop"]
        print(f"    {name}: {p['registers']} registers, spill stores/loads {p['spill_bytes']} B, shared "
              f"{p['shared']} B{', wgmma serialized (ptxas C7513/C7515)' if p['wgmma_serialized'] else ''}")
        if not loop:
            print("        no loop found")
            continue
        counts = ", ".join(f"{k} {v}" for k, v in sorted(loop["counts"].items(), key=lambda kv: -kv[1]))
        print(f"        K step: {loop['instructions']} instructions; MMA {loop['mma_shapes']}; wgmma waits "
              f"(groups left in flight) {loop['waits']}; spill accesses {loop['spill_accesses_in_loop']} in the "
              f"loop, {loop['spill_accesses_elsewhere']} outside")
        print(f"        {counts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b"], choices=sorted(bench.MODEL_LAYERS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--once", action="store_true",
                        help="run each variant once, no profiler (for a run under Nsight Compute's ncu)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: parse the configs and check each is a legal Triton config of the models' layers "
                             "on sm_90; nothing launched")
    parser.add_argument("--sass", action="store_true",
                        help="CPU: compile each config's two GEMMs for sm_90 at the models' shapes and print their "
                             "K loops' SASS (registers, spills, MMAs, wgmma waits, loads, decode ALU); no launches")
    parser.add_argument("--sass-triton-kernels", action="store_true",
                        help="CPU: compile triton_kernels' matmul_ogs GEMMs (.triton-kernels) for sm_90 at the models' "
                             "shapes and each token count and print their K loops' SASS as --sass does; no launches")
    args = parser.parse_args()
    if args.sass_triton_kernels:
        if triton_codegen.interpreting():
            sys.exit("--sass-triton-kernels compiles for sm_90: run it without TRITON_INTERPRET=1")
        for model in args.models:
            for tokens in args.tokens:
                flags, profiles = triton_kernels_static_profiles(model, tokens)
                print_static(f"{model} T={tokens} triton_kernels (sm_90 SASS, Triton {triton.__version__}, static: "
                             f"no GPU run); opt flags: {'; '.join(flags)}", profiles)
        return
    configs = [parse_config(text) for text in args.configs]
    if args.sass:
        if triton_codegen.interpreting():
            sys.exit("--sass compiles for sm_90: run it without TRITON_INTERPRET=1")
        workdir = Path(tempfile.mkdtemp(prefix="dzc-diagnose-sass-"))
        for model in args.models:
            for config in configs:
                print_static(f"{model} {config} (sm_90 SASS, Triton {triton.__version__}, static: no GPU run)",
                             static_profiles(bench.model_spec(model), config, workdir))
        return
    if args.dry_run:
        for model in args.models:
            spec = bench.model_spec(model)
            legal = {fp8: legal_configs(bench.family, "triton", dataclasses.replace(spec, fp8_activations=fp8),
                                        SM_90)[0] for fp8 in (False, True)}
            for config in configs:
                if config not in legal[is_w4a8(config)]:
                    sys.exit(f"{config} is not a legal Triton config of {model} on {SM_90.name}")
                print(f"dry run: {model} T={args.tokens} {config}")
        return
    if not torch.cuda.is_available():
        sys.exit("diagnose_mxfp4_moe_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    tk, tk_origin = bench.load_triton_kernels(None)
    print(f"GPU: {torch.cuda.get_device_name()}; triton_kernels: {tk_origin}")
    workdir = Path(tempfile.mkdtemp(prefix="dzc-diagnose-moe-"))
    for model in args.models:
        layer = bench.random_layer(model, device, generator)
        kernels = bench.DzcKernels(layer.spec, "triton", workdir)
        # FP8=1 configs run the W4A8 op (its own kernels, checked against its reference)
        w4a8 = (bench.DzcKernels(dataclasses.replace(layer.spec, fp8_activations=True), "triton", workdir)
                if any(is_w4a8(c) for c in configs) else None)
        tk_moe = bench.TritonKernelsMoE(tk, layer) if tk is not None else None
        for tokens in args.tokens:
            hidden, ids, weights = bench.random_routing(layer.spec, tokens, False, device, generator)
            op_args = layer.args(hidden, ids, weights)
            expected = mxfp4_moe_reference(*op_args)
            expected_w4a8 = mxfp4_moe_w4a8_reference(*op_args) if w4a8 is not None else None
            weight_bytes = touched_weight_bytes(layer.spec, ids)
            for config in configs:
                runner, reference, tolerance, op = ((w4a8, expected_w4a8, bench.W4A8_TOLERANCE, "W4A8 ")
                                                    if is_w4a8(config) else (kernels, expected,
                                                                             bench.W4A16_TOLERANCE, ""))
                bench.check(f"dzc {op}{config}", runner.run(config, op_args), reference, tolerance)
                if args.once:
                    continue
                report(f"{model} T={tokens} dzc {op}{config}",
                       kernel_times(lambda c=config, r=runner: r.run(c, op_args)), weight_bytes)
            if tk_moe is not None:
                routed = tk_moe.routed(ids, weights)
                if args.once:
                    routed(hidden)
                    continue
                report(f"{model} T={tokens} triton_kernels {tk_moe.describe(tokens)}",
                       kernel_times(lambda: routed(hidden)), weight_bytes)


if __name__ == "__main__":
    main()
