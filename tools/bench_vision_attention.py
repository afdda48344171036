"""Benchmark dzc's varlen_attention kernels (Triton, TileLang) against per-image baselines, in one run, on a GPU.

    python tools/bench_vision_attention.py [--quick] [--musa-legal] [--match KEY=VALUE ...] [--out results.md]

Vision-encoder attention over packed images: 16 heads, head dims 72 (MoonViT), 80 (Qwen2.5-VL) and 128
(InternViT-6B), bf16.
Packs (patch counts per image): "mixed" {1024, 4096, 256, 2304, 9216}; "64x256" (64 images of 256); "large"
{4096, 9216} (the >= 4096-patch goal); window layers: "windows" = the mixed pack cut into 64-token windows.
With --rope, a variant that applies HF's vision rotary embedding to q and k (in-kernel for dzc; as separate ops
before the baselines).

Baselines, timed in the same process on the same inputs:
  eager         the per-image loop HF's eager path runs: softmax(q kᵀ·scale) v per image, then cat
  cudnn         F.scaled_dot_product_attention per image under SDPBackend.CUDNN_ATTENTION (falls back to the
                flash, then the memory-efficient backend, with a note, when cuDNN refuses the head dim)
  compile       torch.compile of the per-image attention (dynamic shapes), called in the same loop
dzc kernels are tuned here over their configs (--musa-legal: only configs legal on mp_22 — 128-lane warps,
<= 8 warps, 72 KiB shared memory — to validate the MUSA algorithm on the H200); the best config is reported.
`--codegens auto` adds what a user of dzc.compile gets: the op lowered as a compiled graph lowers it (codegen
"auto", dzc's autotuner choosing across Triton's configs and the TileLang kernel, its tuning database under
--work-dir), called through the dzc op; the chosen codegen and config are reported. --match KEY=VALUE ...: of the
configs, only the untuned default and those with every such parameter (an A/B of a candidate against the default,
e.g. --match LONGEST_FIRST=1). A codegen's TileLang kernels build in child processes, all at once, before timing.
TFLOP/s counts the useful FLOPs Σ 4·L²·D·H (non-causal); window layers are also judged by bandwidth (q, k, v,
out bytes, + cos/sin with --rope). Every variant's output is checked against dzc's plain-torch reference once
before timing. Times: triton.testing.do_bench medians (L2 flushed between calls).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
from collections.abc import Callable
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from dzc.lowering import Execution
from dzc.ops.varlen_attention import apply_vision_rotary, varlen_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import TARGETS, tilelang_codegen, triton_codegen
from dzc.targets import varlen_attention as family
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, SM_90

PEAK_FLOPS = 989e12  # H200 dense bf16 (datasheet; measured GEMM 693-798 TFLOP/s)
PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet; measured copy ~4.3e12
HEADS = 16
PACKS = {
    "mixed": (1024, 4096, 256, 2304, 9216),
    "64x256": (256,) * 64,
    "large": (4096, 9216),
    "windows": (64,) * (sum((1024, 4096, 256, 2304, 9216)) // 64),
}
QUICK_PACKS = ("mixed", "windows")
# Configs tried per codegen without --full-tune: the default plus these, where legal (compiling every config of
# every spec would take most of a GPU session; --full-tune does it).
TRITON_SHORTLIST = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2))]
# 384 threads: the warp-specialized kernel, with and without ping-pong.
TILELANG_SHORTLIST = [dict(BLOCK_M=m, BLOCK_N=n, THREADS=t, NUM_STAGES=s) for m, n, t, s in (
    (128, 64, 256, 2), (128, 128, 256, 2), (64, 64, 128, 2), (128, 64, 384, 2), (128, 128, 384, 2),
    (128, 176, 384, 2))]
# Allowed error of any variant, in bf16 epsilons (2^-7) of the segment's largest |v| (see the kernel tests).
MAX_EPSILONS = 4.0


def make_inputs(lengths, head_dim: int, rope: bool, seed: int, device):
    generator = torch.Generator(device=device).manual_seed(seed)
    return family.random_pack(lengths, HEADS, head_dim, torch.bfloat16, rope, device, generator)


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, v: torch.Tensor, lengths) -> float:
    """Worst error in bf16 epsilons of the largest |v| of the element's image and head; raises past the bound."""
    worst = 0.0
    start = 0
    for length in lengths:
        end = start + length
        scale = v[start:end].float().abs().amax(dim=(0, 2))[None, :, None]
        error = (actual[start:end].float() - expected[start:end].float()).abs() / (2.0**-7 * scale)
        worst = max(worst, error.max().item())
        start = end
    if not worst <= MAX_EPSILONS:
        raise AssertionError(f"{name}: {worst:.2f} bf16 epsilons of max|v| from the reference")
    return worst


def bench(fn: Callable[[], object]) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


# ---------------------------------------------------------------------------------------------------------
# Baselines: one attention call per image, as model code without a varlen kernel does it


def eager_attention(q, k, v, scale):
    """HF's eager_attention_forward for one image: q, k, v [1, H, L, D]."""
    weights = torch.matmul(q, k.transpose(2, 3)) * scale
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def per_image(attention: Callable, lengths, q, k, v, scale, cos, sin):
    """Rotary embedding over the pack (if given), then `attention` per image on [1, H, L, D] views, then cat."""
    if cos is not None:
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    outputs = []
    for q_i, k_i, v_i in zip(*(torch.split(t, lengths) for t in (q, k, v))):
        q_i, k_i, v_i = (t.transpose(0, 1).unsqueeze(0) for t in (q_i, k_i, v_i))
        outputs.append(attention(q_i, k_i, v_i, scale).squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def sdpa_backend_for(head_dim: int, device) -> tuple[list, str]:
    """cuDNN SDPA, or the first backend that takes this head dim, with a note saying which."""
    # The layout per_image hands over: [1, H, L, D] views of a packed [L, H, D] tensor.
    probe = torch.randn(128, HEADS, head_dim, device=device, dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)
    notes = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(probe, probe, probe)
            torch.cuda.synchronize()
        except RuntimeError as err:
            notes.append(f"{backend.name} refused head_dim {head_dim} ({str(err).splitlines()[0][:80]})")
            continue
        return [backend], "; ".join(notes + [f"SDPA backend: {backend.name}"])
    raise RuntimeError(f"no SDPA backend takes head_dim {head_dim}: {notes}")


# ---------------------------------------------------------------------------------------------------------
# dzc kernels


def shortlisted(configs: list[KernelConfig], shortlist: list[dict], default: KernelConfig) -> list[KernelConfig]:
    def matches(config, wanted):
        values = {**dict(config.params), "num_warps": config.num_warps, "num_stages": config.num_stages}
        return all(values.get(key) == value for key, value in wanted.items())

    chosen = [default] if default in configs else []
    chosen += [c for c in configs if c not in chosen and any(matches(c, w) for w in shortlist)]
    return chosen


def dzc_configs(codegen: str, spec, full_tune: bool, musa_legal: bool, match: dict | None = None,
                ) -> list[KernelConfig]:
    """Configs to time on the H200: legal on sm_90, and with --musa-legal also emitted for and legal on mp_22; with
    `match`, the default and those with every such parameter (absent parameters read 0)."""
    legal, _ = legal_configs(family, codegen, spec, SM_90)
    default = getattr(family, f"{codegen}_default_config")(spec, SM_90)
    if musa_legal:
        musa, _ = legal_configs(family, codegen, spec, MP_22)
        if codegen == "tilelang":  # a config's THREADS is what runs; num_warps counts the profile's warps
            musa_params = {c.params for c in musa}
            legal = [c for c in legal if c.params in musa_params]
        else:
            legal = [c for c in legal if c in musa]
        default = getattr(family, f"{codegen}_default_config")(spec, MP_22)
        default = next((c for c in legal if c.params == default.params), default)
    chosen = legal if full_tune else shortlisted(legal, TRITON_SHORTLIST if codegen == "triton"
                                                  else TILELANG_SHORTLIST, default)
    if match:
        chosen = [c for c in chosen if c == default or all(dict(c.params).get(k, 0) == v for k, v in match.items())]
    return chosen


class DzcKernel:
    """A generated kernel of one codegen for one spec, called as dzc's launcher calls it (prepare, launch)."""

    def __init__(self, codegen: str, spec, directory):
        self.codegen, self.spec = codegen, spec
        path = directory / f"varlen_attention_{codegen}_{spec.head_dim}_{int(spec.rope)}.py"
        path.write_text(getattr(family, f"{codegen}_source")(spec, SM_90))
        module = triton_codegen if codegen == "triton" else tilelang_codegen
        self.compiled = module.load(family, path, spec, SM_90)
        self.launch = getattr(family, f"{codegen}_launch")

    def __call__(self, config, args):
        inputs, (out,), _work, result = family.prepare(self.spec, *args)
        self.launch(self.compiled, config, *inputs, out)
        return result


class AutoKernel:
    """The op as dzc.compile runs it with codegen "auto": lowered once per spec, tuned at its first call of a token
    bucket (outside the timing: the check runs first), called through torch.ops.dzc.varlen_attention."""

    codegen = "auto"

    def __init__(self, inputs, directory: Path, autotune: bool):
        target = TARGETS["cuda:sm_90"]
        options = CompileOptions(cache_dir=str(directory / "auto-cache"), autotune=autotune, codegen="auto")
        self.record, self.spec = lower_op("varlen_attention", inputs, target, options, Execution(target.runtime))

    def __call__(self, config, args):
        return torch.ops.dzc.varlen_attention(*args, kernel_id=self.record.kernel_id)

    def chosen(self) -> str:
        """The tuner's choice per token bucket: the winning codegen (an alternative kernel wins as an external
        candidate) and its config."""
        return "; ".join(f"≤{bucket}: {entry.get('external') or self.record.codegen} {entry['config']} "
                         f"({entry['how']})" for bucket, entry in sorted(self.record.tuned.items()))


def tune(kernel: DzcKernel, configs, args, expected, lengths) -> tuple[KernelConfig, float, str]:
    """(best config, its seconds, notes): every config is checked against the reference, then timed."""
    best, notes = None, []
    for config in configs:
        try:
            check(f"dzc[{kernel.codegen}] {config}", kernel(config, args), expected, args[2], lengths)
            seconds = bench(lambda: kernel(config, args))
        except Exception as err:  # a config that fails to compile or run is reported, not fatal
            notes.append(f"{config}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        print(f"  dzc[{kernel.codegen}] d={kernel.spec.head_dim} {config}: {seconds * 1e6:.1f} us", flush=True)
        if best is None or seconds < best[1]:
            best = (config, seconds)
    if best is None:
        raise RuntimeError(f"every {kernel.codegen} config failed: {notes}")
    return best[0], best[1], "; ".join(notes)


# ---------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[72, 80, 128])
    parser.add_argument("--packs", nargs="+", default=list(PACKS), choices=list(PACKS))
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"])
    parser.add_argument("--rope", action="store_true", help="also the variant with the rotary embedding")
    parser.add_argument("--quick", action="store_true", help="head dim 80, mixed and windows packs, no compile "
                                                             "baseline, default configs only: ~2 minutes")
    parser.add_argument("--full-tune", action="store_true", help="time every legal config, not the shortlist")
    parser.add_argument("--no-compile-baseline", action="store_true", help="leave out the torch.compile baseline")
    parser.add_argument("--musa-legal", action="store_true", help="only configs legal on MUSA mp_22")
    parser.add_argument("--work-dir", default="/tmp/dzc-bench-vision-attention")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--match", nargs="+", default=[], metavar="KEY=VALUE",
                        help="only the default and the configs with every such parameter")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    try:
        match = {key: int(value) for key, value in (item.split("=", 1) for item in args.match)}
    except ValueError:
        parser.error(f"--match takes KEY=INTEGER pairs, got {args.match}")
    if args.quick:
        args.head_dims, args.packs = [80], [p for p in args.packs if p in QUICK_PACKS]
    if not set(args.codegens) <= {"triton", "tilelang", "auto"}:
        parser.error(f"--codegens: {args.codegens} (triton, tilelang, auto)")
    if args.dry_run:  # every spec and the configs each codegen would time: all before the first launch
        for head_dim in args.head_dims:
            for rope in ([False, True] if args.rope else [False]):
                spec = family.make_spec(head_dim, torch.bfloat16, torch.float32 if rope else None)
                for codegen in args.codegens:
                    if codegen == "auto":
                        print(f"dry run: d={head_dim} rope={rope} auto: dzc's tuner ("
                              f"{'untuned' if args.quick else 'tuned'}), packs {args.packs}")
                        continue
                    candidates = dzc_configs(codegen, spec, args.full_tune, args.musa_legal, match)
                    print(f"dry run: d={head_dim} rope={rope} {codegen}: "
                          f"{len(candidates[:1] if args.quick else candidates)} configs, packs {args.packs}")
        return
    device = torch.device("cuda")
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    compiled_attention = torch.compile(eager_attention, dynamic=True)
    rows, notes = [], []
    for head_dim in args.head_dims:
        backend, backend_note = sdpa_backend_for(head_dim, device)
        notes.append(f"head_dim {head_dim}: {backend_note}")

        def cudnn_attention(q, k, v, scale):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)

        for rope in ([False, True] if args.rope else [False]):
            spec = family.make_spec(head_dim, torch.bfloat16, torch.float32 if rope else None)
            kernels = {cg: DzcKernel(cg, spec, work_dir) for cg in args.codegens if cg != "auto"}
            for pack in args.packs:
                lengths = PACKS[pack]
                inputs = make_inputs(lengths, head_dim, rope, seed=head_dim + len(lengths), device=device)
                q, k, v, cu_seqlens, max_seqlen, scale, cos, sin = inputs
                with torch.no_grad():
                    expected = varlen_attention_reference(*inputs)
                baselines = {"eager": eager_attention, "cudnn": cudnn_attention}
                if not (args.quick or args.no_compile_baseline):
                    baselines["compile"] = compiled_attention
                times, configs, errors = {}, {}, {}
                for name, attention in baselines.items():
                    def run(attention=attention):
                        return per_image(attention, list(lengths), q, k, v, scale, cos, sin)
                    try:
                        with torch.no_grad():
                            errors[name] = check(name, run(), expected, v, lengths)
                        times[name] = bench(run)
                    except (RuntimeError, AssertionError) as err:  # reported in the notes, the run goes on
                        notes.append(f"{name} d={head_dim} rope={rope} {pack}: {str(err).splitlines()[0][:160]}")
                for codegen, kernel in kernels.items():
                    name = f"dzc[{codegen}]"
                    candidates = dzc_configs(codegen, spec, args.full_tune, args.musa_legal, match)
                    if args.quick:
                        candidates = candidates[:1]
                    if codegen == "tilelang":  # built in parallel (children), not one after another while timing
                        kernel.compiled.prebuild(factory for c in candidates for factory in
                                                 tilelang_codegen.factory_configs(family, spec, c).values())
                    try:
                        config, seconds, failures = tune(kernel, candidates, inputs, expected, lengths)
                    except RuntimeError as err:  # every config failed: say so in the table's notes, go on
                        notes.append(f"{name} d={head_dim} rope={rope} {pack}: {err}")
                        continue
                    times[name], configs[name] = seconds, f"{config} (best of {len(candidates)})"
                    errors[name] = check(name, kernel(config, inputs), expected, v, lengths)
                    if failures:
                        notes.append(f"{name} d={head_dim} rope={rope} {pack}: failed configs: {failures}")
                if "auto" in args.codegens:
                    name = "dzc[auto]"
                    try:
                        auto = AutoKernel(inputs, work_dir, autotune=not args.quick)
                        with torch.no_grad():
                            errors[name] = check(name, auto(None, inputs), expected, v, lengths)
                        times[name] = bench(lambda: auto(None, inputs))
                        configs[name] = auto.chosen()
                    except Exception as err:  # noqa: BLE001 (reported in the notes, the run goes on)
                        notes.append(f"{name} d={head_dim} rope={rope} {pack}: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0][:160]}")
                flops = family.flops(head_dim, HEADS, lengths)
                moved = family.bytes_moved(spec, sum(lengths), HEADS)
                rows.append(dict(head_dim=head_dim, rope=rope, pack=pack, flops=flops, moved=moved, times=times,
                                 configs=configs, errors=errors))
                print(head_dim, "rope" if rope else "", pack,
                      {n: f"{t * 1e6:.0f}us {flops / t / 1e12:.0f}TF" for n, t in times.items()}, configs,
                      flush=True)
    write_table(rows, notes, args)


def write_table(rows, notes, args):
    variants = list(dict.fromkeys(name for row in rows for name in row["times"]))
    dzc_variants = [v for v in variants if v.startswith("dzc")]

    def cell(times, variant, text):
        return text(times[variant]) if variant in times else "failed"

    header = ["D", "rope", "pack", "GFLOP"] + [f"{v} µs" for v in variants] + [f"{v} TFLOP/s" for v in variants]
    header += [f"{v} / cudnn" for v in dzc_variants] + [f"{v} TB/s" for v in dzc_variants + ["cudnn"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        times = row["times"]
        cells = [str(row["head_dim"]), "yes" if row["rope"] else "no", row["pack"], f"{row['flops'] / 1e9:.1f}"]
        flops, moved = row["flops"], row["moved"]
        cells += [cell(times, v, lambda t: f"{t * 1e6:.1f}") for v in variants]
        cells += [cell(times, v, lambda t: f"{flops / t / 1e12:.0f} ({100 * flops / t / PEAK_FLOPS:.0f}%)")
                  for v in variants]
        cells += [cell(times, v, lambda t: f"{times['cudnn'] / t:.2f}x" if "cudnn" in times else "n/a")
                  for v in dzc_variants]
        cells += [cell(times, v, lambda t: f"{moved / t / 1e12:.2f} ({100 * moved / t / PEAK_BYTES_PER_S:.0f}%)")
                  for v in dzc_variants + ["cudnn"]]
        lines.append("| " + " | ".join(cells) + " |")
    props = torch.cuda.get_device_properties(0)
    try:
        tilelang_version = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        tilelang_version = "not installed"
    meta = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, tilelang {tilelang_version}, "
            f"python {platform.python_version()}, {datetime.date.today().isoformat()}. {HEADS} heads, bf16. "
            f"TFLOP/s = Σ 4·L²·D·H / time (% of {PEAK_FLOPS / 1e12:.0f} dense bf16); TB/s = q, k, v, out "
            f"(+cos/sin) bytes / time (% of {PEAK_BYTES_PER_S / 1e12:.1f}); 'x / cudnn' = cuDNN time over dzc's "
            f"(above 1 = dzc faster). Configs: {'MUSA-legal (mp_22) only' if args.musa_legal else 'sm_90'}"
            f"{', full tuning' if args.full_tune else ', shortlist'}{', quick' if args.quick else ''}.")
    config_lines = [f"- D={r['head_dim']} rope={r['rope']} {r['pack']}: " +
                    "; ".join(f"{n}: {c}" for n, c in r["configs"].items()) +
                    " | worst error (bf16 eps of max|v|): " +
                    ", ".join(f"{n} {e:.2f}" for n, e in r["errors"].items()) for r in rows]
    text = "\n".join([meta, "", *lines, "", "Notes:", *(f"- {n}" for n in notes), "", "Chosen configs:",
                      *config_lines]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
