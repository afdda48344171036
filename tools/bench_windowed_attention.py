"""Benchmark dzc.varlen_attention on text decoders' windowed and sink attention, against what the fallback runs, in
one process on a GPU.

    python tools/bench_windowed_attention.py [--quick] [--out results.md] [--cache-dir DIR] [--dry-run]

Shapes (gpt-oss-120b's attention: 64 query heads, 8 KV heads, head dim 64, sliding window 128 on every other
layer, per-head sinks on every layer; bf16):
  prefill: one sequence of {4096, 16384} tokens, window 128 and sinks; and the full-attention layers' form
      (sinks, no window);
  decode: {8, 64} sequences x 1 query at {8K, 32K} context, window 128 and sinks.
What a sliding-window / sink layer runs without dzc (the baselines, same inputs, same process):
  eager         transformers' eager attention: repeat_kv, scores, the [S, T] mask added, a sink column, softmax,
                its first T columns times V (gpt-oss's only implementation with sinks)
  sdpa-mask     F.scaled_dot_product_attention with the window as a float mask (what a sliding-window model
                without sinks runs on SDPA; sinks cannot be expressed)
  sdpa-causal   F.scaled_dot_product_attention(is_causal=True) with no window and no sinks: not the same
                attention, the cost of the full causal attention flash kernels run (for scale)
dzc's Triton kernel is lowered as a compiled graph lowers it (autotuned unless --quick) and checked against the
op's reference (the first sequence, or the first 256 query rows) before it is timed. TFLOP/s counts the useful
work: 4·H·D per visible (query, key) pair. Times: medians of CUDA graph replays (triton.testing.do_bench_cudagraph).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import torch.nn.functional as F
import triton
import triton.testing

from dzc.lowering import Execution
from dzc.ops.varlen_attention import varlen_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import resolve_target
from dzc.targets import varlen_attention as family

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128
PEAK_BF16_FLOPS = 989e12  # H200 datasheet dense bf16 (measured GEMMs: 690-790)
CHECK_ROWS = 256


def _visible_pairs(q_len: int, k_len: int, window: int) -> int:
    """(query, key) pairs a causal query block at the end of k_len keys sees, with a window (0: none)."""
    total = 0
    for row in range(q_len):
        position = k_len - q_len + row
        total += min(position + 1, window) if window else position + 1
    return total


def _problem(batch: int, q_len: int, k_len: int, window: int, device, seed: int = 0):
    generator = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=device, generator=generator).bfloat16()
    k, v = (torch.randn(batch * k_len, KV_HEADS, HEAD_DIM, device=device, generator=generator).bfloat16()
            for _ in range(2))
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len
    cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * k_len
    query_pos = (torch.arange(q_len, device=device, dtype=torch.int32) + k_len - q_len).repeat(batch)
    sinks = torch.randn(HEADS, device=device, generator=generator)
    return (q, k, v, cu_q, q_len, HEAD_DIM ** -0.5, None, None, cu_k, query_pos, window, sinks)


def _dense(args):
    """The [B, H, S, D] / [B, Hkv, T, D] tensors and the [S, T] keep mask the baselines take."""
    q, k, v, cu_q, q_len, _, _, _, cu_k, query_pos, window, _ = args
    batch = cu_q.shape[0] - 1
    k_len = k.shape[0] // batch
    q4 = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    k4, v4 = (t.view(batch, k_len, KV_HEADS, HEAD_DIM).transpose(1, 2) for t in (k, v))
    keys = torch.arange(k_len, device=q.device)
    positions = query_pos[:q_len].long()[:, None]
    keep = (keys <= positions) & ((keys > positions - window) if window else True)
    return q4, k4, v4, keep


def eager_attention(q4, k4, v4, keep, sinks, scale):
    """transformers' gpt-oss eager attention (repeat_kv, additive mask, sink column)."""
    group = HEADS // KV_HEADS
    k4, v4 = (t.repeat_interleave(group, dim=1) for t in (k4, v4))
    mask = torch.where(keep, 0.0, torch.finfo(q4.dtype).min).to(q4.dtype)
    scores = torch.matmul(q4, k4.transpose(2, 3)) * scale + mask
    column = sinks.to(q4.dtype).reshape(1, -1, 1, 1).expand(q4.shape[0], -1, q4.shape[2], -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.matmul(F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1], v4)


def _time(fn) -> float:
    """GPU time of one call, replayed from a CUDA graph (as a server runs decode steps): a decode call's GPU work
    is a few µs, less than the host's launch work, which do_bench would time instead."""
    with torch.no_grad():
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3


def measure(kind: str, batch: int, q_len: int, k_len: int, window: int, device, target, options) -> str:
    """One table row: dzc's kernel (checked against the reference first) and the baselines on one problem."""
    problem = _problem(batch, q_len, k_len, window, device)
    label = f"{kind}: {batch} x {q_len} queries over {k_len} keys" + (f", window {window}" if window else "")
    record, _ = lower_op("varlen_attention", problem, target, options, Execution(target.runtime))
    run = (lambda: torch.ops.dzc.varlen_attention(*problem, kernel_id=record.kernel_id))
    out = run()
    # The reference on the first sequence's first CHECK_ROWS queries (a whole-batch reference would not fit).
    rows_checked = min(CHECK_ROWS, q_len)
    first = list(problem)
    first[0], first[3], first[4] = problem[0][:rows_checked], problem[3][:2].clamp(max=rows_checked), rows_checked
    first[1], first[2], first[8], first[9] = problem[1][:k_len], problem[2][:k_len], problem[8][:2], \
        problem[9][:rows_checked]
    expected = varlen_attention_reference(*first)
    error = (out[:rows_checked].float() - expected.float()).abs().max().item()
    assert error <= 2**-6 * max(problem[2].float().abs().max().item(), 1.0), f"{label}: error {error}"
    seconds = _time(run)
    work = 4 * HEADS * HEAD_DIM * batch * _visible_pairs(q_len, k_len, window)
    q4, k4, v4, keep = _dense(problem)
    baselines = {}
    if batch * HEADS * q_len * k_len * 2 < 8 << 30:  # the dense baselines' [B, H, S, T] scores fit
        baselines["eager"] = _time(lambda: eager_attention(q4, k4, v4, keep, problem[11], problem[5]))
        bias = torch.where(keep, 0.0, float("-inf")).to(q4.dtype)
        baselines["sdpa-mask"] = _time(lambda: F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=bias, scale=problem[5], enable_gqa=True))
    if q_len == k_len:
        baselines["sdpa-causal (no window, no sinks)"] = _time(lambda: F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=problem[5], enable_gqa=True))
    versus = ", ".join(f"{name} {t * 1e6:.0f} µs ({t / seconds:.1f}×)" for name, t in baselines.items())
    configs = "; ".join(f"{bucket}: {entry.get('config', entry)}" for bucket, entry in record.tuned.items()) \
        or "untuned default"
    return (f"| {label} | {seconds * 1e6:.0f} | {work / seconds / 1e12:.0f} TFLOP/s "
            f"({100 * work / seconds / PEAK_BF16_FLOPS:.0f}%) | {versus} | {configs} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="untuned default config, the smaller shapes only")
    parser.add_argument("--cache-dir", default="/tmp/dzc-bench-windowed-cache")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: print each shape's kernel spec and untuned config (meta tensors, nothing runs)")
    args = parser.parse_args()
    device = torch.device("meta" if args.dry_run else "cuda")
    target = resolve_target("cuda")
    options = CompileOptions(cache_dir=args.cache_dir, autotune=not args.quick, codegen="triton")
    prefill = [4096] if args.quick else [4096, 16384]
    decode = [(64, 8192)] if args.quick else [(8, 8192), (64, 8192), (64, 32768)]
    shapes = [("prefill", 1, n, n, WINDOW) for n in prefill] + [("prefill, no window", 1, prefill[0], prefill[0], 0)]
    shapes += [("decode", b, 1, ctx, WINDOW) for b, ctx in decode]
    if args.dry_run:
        for kind, batch, q_len, k_len, window in shapes:
            spec = family.spec_from_arguments(*_problem(batch, q_len, k_len, window, device))
            print(f"dry run: {kind} {batch}x{q_len} over {k_len} window {window}: {spec.describe()}; default "
                  f"{family.triton_default_config(spec, target.profile)}")
        return
    rows = []
    for shape in shapes:
        rows.append(measure(*shape, device, target, options))
        print(rows[-1], flush=True)
    props = torch.cuda.get_device_properties(device)
    meta = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, python "
            f"{platform.python_version()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"{'untuned default' if args.quick else 'autotuned'}; baselines: their time (their time ÷ dzc's).")
    table = "\n".join([meta, "", "| shape | dzc µs | useful work | baselines | config |", "|---|---|---|---|---|",
                       *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
