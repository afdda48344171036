"""Benchmark the multimodal reference model end to end on a CUDA GPU: dzc against eager PyTorch and
torch.compile (mode max-autotune, or reduce-overhead), in one run — a prefill of images + text, and a batched
decode step.

    python tools/bench_multimodal.py [--quick] [--out results.md] [--batch 32] [--context 4096]
                                     [--compile-mode max-autotune|reduce-overhead] [--no-torch-compile] [--no-warm]

The model is dzc.models.multimodal's "h200" config (see its docstring: Qwen2.5-VL vision dims, gpt-oss-20b MoE
with MXFP4 experts, DeepSeek-V3.2 DSA dims, gpt-oss vocabulary), bf16, BF16 indexer key cache; --quick cuts it to
2 vision blocks, 2 decoder layers of 8 experts, and turns dzc's autotuning off (untuned default configs): the
captures of the unrolled per-expert loops (every variant's, and the warm-compile process's) dominate the run.

Each variant runs as a serving engine would: the vision encoder and a decoder step (embeddings in, last-position
logits out, over its own paged KV cache) compiled separately, the embedding merge in between.
- prefill: one request of 3 images (--grids, patches) and text runs around them; vision + merge + decoder.
- decode: one step of --batch sequences at --context tokens each (caches filled with random rows), the same
  inputs every call (the step rewrites the same slots). dzc replays it from a CUDA graph (CompileOptions'
  CudaGraphRunner; the cache is module state, so every argument is a tensor); torch.compile (either mode)
  uses CUDA graph trees (the caches are marked static addresses; the report says when it skipped graphs).
--compile-mode reduce-overhead takes torch.compile's CUDA graphs without its GEMM autotuning: on the H200 machine
max-autotune's compile of the quick model alone outran 400 s twice, more than a device call holds next to the rest.
Times: back-to-back calls, host and device together (tools/bench_add_rms_norm.loop_time), the way a serving
loop sees them. Ratios: baseline time ÷ dzc time (goals: ≥ 1.5× torch.compile, ≥ 3× eager).
GPU busy (decode): over 20 back-to-back steps under torch.profiler, the share of the time from the first kernel's
start to the last one's end in which a kernel, copy or memset runs: below 100% where the host does not keep the GPU
fed (goal ≥ 90% for dzc).
--no-torch-compile and --no-warm skip the torch.compile baseline and the warm-compile process (a shorter run).
Numerics: before timing, each variant's logits are compared with eager's (max |Δ| ÷ max |eager|, and how often
the greedy next token agrees); a gross mismatch, a failed torch.compile baseline or a dzc decode that was not
replayed from a CUDA graph is written into the table, and the run then exits non-zero.
Compile time: cold = the first calls in this process with an empty dzc cache directory (code generation and, unless
--quick, autotuning); warm = the same first calls in a second process with the same cache directory (tuning
database hit). torch.compile's first-call time is listed too.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import replace

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton

from bench_add_rms_norm import loop_time  # tools/ is on sys.path when run as a script
from dzc.kv_cache import write_index_keys
from dzc.models.dsa import DSASession
from dzc.models.multimodal import CONFIGS, DecoderStep, build_multimodal, new_cache, request_ids
from dzc.models.vision import pack_images
from dzc.targets import tilelang_codegen

# Logits further than this from eager's (relative to eager's largest) mean a broken variant, not rounding: bf16
# end to end and top-k / router near-ties give a few percent (tests/test_multimodal_model.py measures it).
GROSS_ERROR = 0.25
COMPILE_TIMES_TAG = "COMPILE_TIMES "


def model_config(args):
    cfg = CONFIGS["h200"]
    if args.quick:  # capturing the per-expert loop (layers × experts iterations) dominates the compile time
        cfg = replace(cfg, layers=2, moe=replace(cfg.moe, experts=8),
                      vision=replace(cfg.vision, layers=2, full_attention_layers=(1,)))
    return cfg


class Setup:
    """The model, one request's prefill inputs and a decode batch's inputs, over caches laid out identically for
    every variant (deep copies of one cache: the same pages, so the same slots and block tables)."""

    def __init__(self, args, device):
        self.cfg = cfg = model_config(args)
        self.model = build_multimodal(cfg, torch.bfloat16, seed=0, device=device)
        generator = torch.Generator().manual_seed(0)
        grids = [tuple(grid) for grid in args.grids]
        images = pack_images(grids, cfg.vision, torch.bfloat16, generator)
        self.images = [t.to(device) for t in images.inputs()]
        self.input_ids = request_ids(cfg, grids, args.text, generator).to(device)
        self.prefill_tokens = self.input_ids.shape[1]
        self.image_patches = images.patches.shape[0]
        batch, context = args.batch, args.context
        page = 64
        pages = batch * -(-(context + 1) // page) + -(-self.prefill_tokens // page)
        # BF16 indexer keys: with the FP8 layout, fuse_sparse_attention hands the indexer kernel a bf16 q, which
        # the kernel refuses (it multiplies in e4m3): switch to fp8_index=True once the pass quantizes q.
        base = new_cache(cfg, pages, batch + 1, fp8_index=False, dtype=torch.bfloat16, device=device)
        # The decode batch's contexts: random latent rows and indexer keys (what earlier steps would have written).
        slots = base.reserve([context] * batch + [0])
        with torch.no_grad():
            for layer in range(cfg.layers):
                base.latent[layer].normal_()
                keys = torch.randn(len(slots), cfg.attention.index_head_dim, device=device, dtype=torch.bfloat16)
                write_index_keys(base.index_keys[layer], slots, keys)
        session = DSASession(base)
        embed_shape = (cfg.hidden,)
        _, *self.prefill_args = session.inputs(torch.empty(1, self.prefill_tokens, *embed_shape, device=device),
                                               [batch])
        _, *self.decode_args = session.inputs(torch.empty(batch, 1, *embed_shape, device=device), list(range(batch)))
        self.prefill_args, self.decode_args = self.prefill_args[:3], self.decode_args[:3]  # positions, table, slots
        self.base_cache = base
        self.decode_tokens = torch.randint(0, cfg.image_token_id, (batch, 1), generator=generator).to(device)

    def cache(self):
        return copy.deepcopy(self.base_cache)

    def prefill(self, vision, decoder):
        features = vision(*self.images)
        return decoder(self.model.embed(self.input_ids, features), *self.prefill_args)

    def decode(self, decoder):
        return decoder(self.model.embed(self.decode_tokens, None), *self.decode_args)


def dzc_variant(setup: Setup, args):
    """(vision, decoder) compiled by dzc; the decoder's CUDA graphs cover the decode call (--batch tokens, which
    may exceed the default limit)."""
    options = dzc.CompileOptions(cache_dir=args.cache_dir, autotune=not args.quick)
    decoder_options = replace(options, cuda_graph_max_tokens=max(options.cuda_graph_max_tokens, args.batch))
    return (dzc.compile(setup.model.vision, "cuda", options),
            dzc.compile(DecoderStep(setup.model.language, setup.cache()), "cuda", decoder_options))


def first_calls(setup: Setup, vision, decoder) -> dict[str, float]:
    """Seconds of the first prefill and decode calls (compiles, code generation, tuning, CUDA-graph capture)."""
    times = {}
    with torch.no_grad():
        start = time.perf_counter()
        setup.prefill(vision, decoder)
        torch.cuda.synchronize()
        times["prefill"] = time.perf_counter() - start
        start = time.perf_counter()
        setup.decode(decoder)
        setup.decode(decoder)  # a CUDA-graph runner captures on the first call of a signature, replays after
        torch.cuda.synchronize()
        times["decode"] = time.perf_counter() - start
    return times


def busy_fraction(spans: Iterable[tuple[float, float]]) -> float:
    """The share of [first start, last end] that the union of the (start, end) spans covers."""
    spans = sorted(spans)
    if not spans:
        raise ValueError("no GPU activity was recorded")
    covered, (start, end) = 0.0, spans[0]
    first = start
    for begin, finish in spans[1:]:
        if begin > end:  # a gap: close the current run of overlapping spans
            covered += end - start
            start = begin
        end = max(end, finish)
    covered += end - start
    return covered / (end - first) if end > first else 1.0


def gpu_busy(fn: Callable[[], object], calls: int = 20) -> float:
    """busy_fraction of the GPU activity (kernels, copies, memsets) of `calls` back-to-back calls of fn, from the
    profiler's trace."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        profile.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = json.load(f)["traceEvents"]
    return busy_fraction((e["ts"], e["ts"] + e["dur"]) for e in events
                         if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)


def compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[str, bool]:
    """(max |Δ| ÷ max |eager| and the share of equal greedy next tokens, as text; whether it is within rounding)."""
    error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    return f"{error:.3g} ({100 * agree:.0f}% same next token)", error <= GROSS_ERROR


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 vision blocks, 2 decoder layers of 8 experts, dzc untuned")
    parser.add_argument("--batch", type=int, default=32, help="decode: sequences per step")
    parser.add_argument("--context", type=int, default=4096, help="decode: tokens already in each sequence")
    parser.add_argument("--grids", type=int, nargs=2, action="append", metavar=("ROWS", "COLS"),
                        help="prefill: an image of ROWS x COLS patches (repeatable; default 3 images)")
    parser.add_argument("--text", type=int, nargs="+", default=[256, 384, 128, 256],
                        help="prefill: text tokens before, between and after the images")
    parser.add_argument("--cache-dir", help="dzc cache (kernels, tuning database); default: a fresh temp dir")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the warm-compile child
    parser.add_argument("--compile-mode", default="max-autotune", choices=["max-autotune", "reduce-overhead"],
                        help="torch.compile baseline's mode (both use CUDA graphs; see the doc)")
    parser.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-compile process")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    args.grids = args.grids or [[32, 32], [64, 48], [16, 24]]  # 1024, 3072 and 384 patches
    if len(args.text) != len(args.grids) + 1:
        parser.error(f"--text needs {len(args.grids) + 1} numbers for {len(args.grids)} images")
    if args.dry_run:  # the model's config and the requests' token counts; the model itself is built on the GPU
        cfg = model_config(args)
        images = pack_images([tuple(g) for g in args.grids], cfg.vision, torch.bfloat16, torch.Generator())
        ids = request_ids(cfg, [tuple(g) for g in args.grids], args.text, torch.Generator())
        print(f"dry run: {cfg.layers} decoder layers; prefill of {images.patches.shape[0]} patches and "
              f"{ids.shape[1]} tokens; decode batch {args.batch} at context {args.context}")
        return
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="dzc-bench-multimodal-")
    device = torch.device("cuda")
    torch._dynamo.config.recompile_limit = 64
    # The per-expert MoE loop (torch.where) and packed vision attention capture whole with these (dzc sets them
    # for its own calls); torch.compile gets the same, else it breaks the graph in every expert iteration.
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    setup = Setup(args, device)

    if args.compile_only:  # the warm run: same cache directory, a fresh process
        times = first_calls(setup, *dzc_variant(setup, args))
        print(COMPILE_TIMES_TAG + json.dumps(times), flush=True)
        return

    variants = {"dzc": dzc_variant(setup, args)}
    cold = first_calls(setup, *variants["dzc"])
    print("dzc first calls (cold):", {k: f"{v:.1f} s" for k, v in cold.items()}, flush=True)
    variants["eager"] = (setup.model.vision, DecoderStep(setup.model.language, setup.cache()))
    broken, errors, times, busy = [], {}, {}, {}
    with torch.no_grad():
        expected = {"prefill": setup.prefill(*variants["eager"]), "decode": setup.decode(variants["eager"][1])}

    def check_and_time(name):
        """Logits against eager's, then the timings, printed at once: torch.compile's max-autotune compile can
        take many minutes, and a run cut short still shows what came before it."""
        vision, decoder = variants[name]
        if name != "eager":
            with torch.no_grad():
                actual = {"prefill": setup.prefill(vision, decoder), "decode": setup.decode(decoder)}
            errors[name] = {}
            for step in actual:
                errors[name][step], ok = compare(actual[step], expected[step])
                if not ok:
                    broken.append(f"{name} {step}: logits {errors[name][step]} from eager")
        times[name] = {"prefill": loop_time(lambda: setup.prefill(vision, decoder), calls=10),
                       "decode": loop_time(lambda: setup.decode(decoder), calls=50)}
        with torch.no_grad():
            busy[name] = gpu_busy(lambda: setup.decode(decoder))
        print(name, {k: f"{v * 1e6:.0f} µs" for k, v in times[name].items()}, f"decode GPU busy {busy[name]:.0%}",
              errors.get(name, ""), flush=True)

    check_and_time("dzc")
    check_and_time("eager")
    skips_before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    if args.no_torch_compile:
        inductor_first = "not run (--no-torch-compile)"
    else:
        # A mode with CUDA graphs that fails (session 25: reduce-overhead's capture failed on the H200) is
        # followed by mode "default", so that the table still has a torch.compile column, labelled with its mode.
        for mode in dict.fromkeys((args.compile_mode, "default")):
            try:
                inductor = torch_compile_variant(setup, mode)
                inductor_first = first_calls(setup, *inductor)
                variants["torch.compile"] = inductor
                args.compile_mode = mode  # the table's label (a failed mode is among the problems already)
                break
            except Exception as error:  # noqa: BLE001  (a baseline that fails is reported in the table, not fatal)
                traceback.print_exc()
                inductor_first = f"failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
                print(f"torch.compile mode={mode} baseline {inductor_first}", flush=True)
                broken.append(f"torch.compile mode={mode} baseline {inductor_first}")
    inductor_skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips_before
    if "torch.compile" in variants:
        check_and_time("torch.compile")

    warm = "not run (--no-warm)" if args.no_warm else warm_compile_times(args)
    for compiled in variants["dzc"]:
        print(compiled.report)
    replayed = any(graph is not None for graph in variants["dzc"][1]._cuda_graphs.graphs.values())
    if not replayed:
        broken.append("dzc decode: no CUDA graph was captured (it ran through the compiled graph instead)")
    text = table(args, setup, times, busy, errors, cold, warm, inductor_first, inductor_skips, broken)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if broken:
        sys.exit("problems: " + "; ".join(broken))


def torch_compile_variant(setup: Setup, mode: str):
    """(vision, decoder) under torch.compile(mode=mode), specialised on each shape (its best case), with its own
    cache marked as static addresses so that CUDA graph trees may write it in place."""
    decoder = DecoderStep(setup.model.language, setup.cache())
    for tensor in decoder.cache.latent + decoder.cache.index_keys:
        torch._dynamo.mark_static_address(tensor)
    return (torch.compile(setup.model.vision, mode=mode, dynamic=False),
            torch.compile(decoder, mode=mode, dynamic=False))


def warm_compile_times(args) -> dict[str, float] | str:
    """The dzc first-call times in a second process over the same cache directory."""
    command = [sys.executable, __file__, "--compile-only", "--cache-dir", args.cache_dir,
               "--batch", str(args.batch), "--context", str(args.context), "--text", *map(str, args.text)]
    for rows, cols in args.grids:
        command += ["--grids", str(rows), str(cols)]
    if args.quick:
        command.append("--quick")
    result = subprocess.run(command, capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith(COMPILE_TIMES_TAG):
            return json.loads(line[len(COMPILE_TIMES_TAG):])
    return f"failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}"


def table(args, setup, times, busy, errors, cold, warm, inductor_first, inductor_skips, broken) -> str:
    cfg = setup.cfg
    props = torch.cuda.get_device_properties(0)
    meta = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, tilelang "
            f"{tilelang_codegen.VERSION}, python {platform.python_version()}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Model: dzc.models.multimodal "
            f"'h200'{' cut for --quick' if args.quick else ''}: vision {cfg.vision.layers} blocks (hidden "
            f"{cfg.vision.hidden}, {cfg.vision.heads}×{cfg.vision.head_dim}), decoder {cfg.layers} layers (hidden "
            f"{cfg.hidden}, DSA {cfg.attention.heads} heads top-k {cfg.attention.index_topk}, MoE "
            f"{cfg.moe.experts} MXFP4 experts top-{cfg.moe.top_k}, vocab {cfg.vocab}), bf16, BF16 indexer cache. "
            f"dzc {'untuned default configs (--quick)' if args.quick else 'autotuned'}; torch.compile "
            f"mode={args.compile_mode}{f' (skipped CUDA graphs {inductor_skips}×)' if inductor_skips else ''}.")
    shapes = {"prefill": f"1 request: {len(args.grids)} images ({setup.image_patches} patches), "
                         f"{setup.prefill_tokens} tokens",
              "decode": f"{args.batch} sequences × 1 token, context {args.context}"}
    lines = ["| step | shape | eager µs | torch.compile µs | dzc µs | dzc vs eager | dzc vs torch.compile "
             "| dzc error vs eager | torch.compile error vs eager | GPU busy: eager / torch.compile / dzc |",
             "|" + "---|" * 10]
    for step in ("prefill", "decode"):
        t = {name: times[name][step] for name in times}
        inductor = t.get("torch.compile")
        shares = (f"{busy[name]:.0%}" if name in busy else "n/a" for name in ("eager", "torch.compile", "dzc"))
        missing = "not run" if args.no_torch_compile else "failed"
        cells = [step, shapes[step], f"{t['eager'] * 1e6:.0f}",
                 missing if inductor is None else f"{inductor * 1e6:.0f}", f"{t['dzc'] * 1e6:.0f}",
                 f"{t['eager'] / t['dzc']:.2f}×", "n/a" if inductor is None else f"{inductor / t['dzc']:.2f}×",
                 errors["dzc"][step], errors.get("torch.compile", {}).get(step, "n/a"),
                 " / ".join(shares) if step == "decode" else "not measured"]
        lines.append("| " + " | ".join(cells) + " |")

    def seconds(entry):
        return entry if isinstance(entry, str) else " / ".join(f"{entry[s]:.1f}" for s in ("prefill", "decode"))

    compile_lines = ["| compile (first calls: prefill / decode, s) | time |", "|---|---|",
                     f"| dzc cold (empty cache dir: codegen{'' if args.quick else ' + autotuning'}) | "
                     f"{seconds(cold)} |",
                     f"| dzc warm (second process, same cache dir: tuning database hit) | {seconds(warm)} |",
                     f"| torch.compile {args.compile_mode} (this process) | {seconds(inductor_first)} |"]
    notes = ("Times: back-to-back calls, host and device together (loop_time). Ratios: baseline time ÷ dzc time "
             "(goal ≥ 1.5× torch.compile, ≥ 3× eager). Errors: max |Δ logits| ÷ max |eager logits|, and the share "
             "of greedy next tokens equal to eager's. Decode: dzc replays a CUDA graph; the merge (embedding + "
             "image rows) runs eagerly in every variant. GPU busy: see the module's docstring (goal ≥ 90% for dzc).")
    problems = [f"PROBLEM: {line}" for line in broken]
    return "\n".join([meta, "", *lines, "", *compile_lines, "", notes, *problems]) + "\n"


if __name__ == "__main__":
    main()
