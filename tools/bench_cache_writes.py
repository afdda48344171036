"""Benchmark what reinplace_cache_writes saves: one compiled DSA decode step over a paged KV cache with the cache
writes in place (dzc) and left functional (the pass disabled: AOTAutograd's out-of-place write plus the copy of
the cache back into the input, minus whatever Inductor's own reinplacing recovers), against eager, in one run, on
a CUDA GPU.

    python tools/bench_cache_writes.py [--batch 1 8 64] [--context 32768 131072] [--out results.md]
    python tools/bench_cache_writes.py --quick        # batch {1, 8} x context 32K, untuned kernels, ~2 minutes

The layer is DeepSeek-V3.2's attention (dzc.models.dsa: MLA 128 heads, latent 512 + RoPE 64, lightning indexer
64 x 128, top-k 2048, random weights) over dzc.kv_cache.PagedKVCache with BF16 caches (latent 1152 B/token,
indexer keys 256 B/token) holding `context` random tokens per sequence; the timed call is one decode step (one
new token per sequence), repeated on the same slots. Reported per (batch, context): the layer's cache bytes and
what one copy of them costs at 4.8 TB/s (read + write), each variant's step time (median of
triton.testing.do_bench), the memory a step allocates beyond what it starts with (a functional write
materialises a whole new cache), and ratios.

Each compiled variant is checked against eager once before it is timed: the caches after the step equal eager's
to bf16 rounding, and the output's relative error is below 5% (a few query rows may select other tokens than
eager at near-ties of the indexer scores; a broken write or attention is far off). Variants run one after the
other with Dynamo reset in between: each is a deployment of its own.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import platform

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from dzc.kv_cache import PAGE_SIZE, PagedKVCache
from dzc.models.dsa import DEEPSEEK_V32, TINY_DSA, DSAConfig, DSASession, build_dsa_attention
from dzc.targets.device_runtime import dsl_versions

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet; measured copy bandwidth is ~4.3e12
VARIANTS = ("eager", "dzc, writes functional", "dzc")


def _time(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def _step_inputs(cfg: DSAConfig, batch: int, context: int, device: str = "cuda", seed: int = 0):
    """A cache with `context - 1` random tokens per sequence and the decode step's arguments (its token reserved)."""
    cache = PagedKVCache(cfg.cache_config(), batch * (context // PAGE_SIZE + 1), batch, fp8_index=False,
                         device=device)
    cache.reserve([context - 1] * batch)
    generator = torch.Generator(device=device).manual_seed(seed)
    for tensor in (*cache.latent, *cache.index_keys):
        tensor.normal_(generator=generator)
    x = torch.randn(batch, 1, cfg.hidden, generator=generator, device=device).bfloat16()
    return DSASession(cache).inputs(x)


def _with_cache_copy(args):
    """The same step's arguments over a copy of the cache (eager and compiled each write their own)."""
    return (*args[:-1], copy.deepcopy(args[-1]))


def _caches(args) -> list:
    cache = args[-1]
    return [*cache.latent, *cache.index_keys]


def _check(name: str, output, expected, caches, expected_caches) -> None:
    for cache, reference in zip(caches, expected_caches):
        torch.testing.assert_close(cache.float(), reference.float(), atol=4e-2, rtol=4e-2,
                                   msg=lambda m: f"{name}: cache after the step differs from eager's: {m}")
    error = ((output.float() - expected.float()).norm() / expected.float().norm()).item()
    if error > 0.05:
        raise AssertionError(f"{name}: output relative error {error:.3f} against eager")


def _extra_memory(fn) -> int:
    """Bytes a call allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _variant(name: str, model, options: dzc.CompileOptions):
    if name == "eager":
        return model
    disabled = ("reinplace_cache_writes",) if name == "dzc, writes functional" else ()
    return dzc.compile(model, "cuda", dzc.CompileOptions(autotune=options.autotune, cache_dir=options.cache_dir,
                                                         disable_passes=disabled))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--quick", action="store_true", help="batch {1, 8} x context 32K, untuned kernels")
    parser.add_argument("--cache-dir", default=None, help="dzc cache (tuning database); default $DZC_CACHE_DIR")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    shapes = [(1, 32768), (8, 32768)] if args.quick else [(b, c) for b in args.batch for c in args.context]
    if any(b < 1 or c < 1 for b, c in shapes):
        parser.error("--batch and --context must be positive")
    options = dzc.CompileOptions(autotune=not args.quick, cache_dir=args.cache_dir)
    if args.dry_run:  # the variants, on the tiny config's layer (DeepSeek-V3.2's is built on the GPU only)
        tiny = build_dsa_attention(TINY_DSA)
        for name in VARIANTS:
            _variant(name, tiny, options)
            print(f"dry run: {name}: (batch, context) {shapes}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_cache_writes needs a CUDA GPU (--dry-run checks the arguments without one)")
    model = build_dsa_attention(DEEPSEEK_V32).cuda()

    times: dict = {}
    extra: dict = {}
    cache_bytes: dict = {}
    for name in VARIANTS:
        torch._dynamo.reset()
        runner = _variant(name, model, options)
        for batch, context in shapes:
            step = _step_inputs(DEEPSEEK_V32, batch, context)
            cache_bytes[batch, context] = sum(t.numel() * t.element_size() for t in _caches(step))
            if name != "eager":
                reference = _with_cache_copy(step)
                with torch.no_grad():
                    expected = model(*reference)
                    output = runner(*step)
                _check(name, output, expected, _caches(step), _caches(reference))
                del reference
            call = functools.partial(runner, *step)
            extra[name, batch, context] = _extra_memory(call)
            times[name, batch, context] = _time(call)
            print(f"{name:24s} batch {batch:3d} context {context:6d}: {times[name, batch, context] * 1e3:8.3f} ms, "
                  f"step allocates {extra[name, batch, context] / 2**20:8.1f} MiB", flush=True)
            del step
        if name != "eager":
            print(f"  {name}: reinplace_cache_writes {runner.report.passes.get('reinplace_cache_writes', 0)} "
                  f"rewrite(s), fuse_sparse_attention {runner.report.passes['fuse_sparse_attention']}", flush=True)

    versions = dsl_versions()
    lines = [
        f"# reinplace_cache_writes: DSA decode step over a paged cache ({torch.cuda.get_device_name()})",
        "",
        f"torch {torch.__version__}, Triton {triton.__version__}, TileLang {versions.get('tilelang')}, "
        f"Python {platform.python_version()}, {datetime.date.today()}; DeepSeek-V3.2 attention, BF16 caches "
        f"(1408 B/token per layer), one token per sequence per step; copy = read + write of the layer's caches at "
        f"{PEAK_BYTES_PER_S / 1e12:.1f} TB/s{'; untuned kernels (--quick)' if args.quick else ''}.",
        "",
        "| batch | context | caches (MiB) | one copy (µs) | eager (ms) | dzc, writes functional (ms) | dzc (ms) | "
        "functional / dzc | eager / dzc | step allocates: functional (MiB) | dzc (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, context in shapes:
        size = cache_bytes[batch, context]
        t = {name: times[name, batch, context] for name in VARIANTS}
        functional, in_place = extra["dzc, writes functional", batch, context], extra["dzc", batch, context]
        lines.append(
            f"| {batch} | {context} | {size / 2**20:.0f} | {2 * size / PEAK_BYTES_PER_S * 1e6:.0f} | "
            f"{t['eager'] * 1e3:.3f} | {t['dzc, writes functional'] * 1e3:.3f} | {t['dzc'] * 1e3:.3f} | "
            f"{t['dzc, writes functional'] / t['dzc']:.2f} | {t['eager'] / t['dzc']:.2f} | "
            f"{functional / 2**20:.1f} | {in_place / 2**20:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(table)


if __name__ == "__main__":
    main()
