"""Benchmark dzc's DeepSeek Sparse Attention kernels (indexer, top-k, sparse attention) on a CUDA GPU, with the
eager dense-masked attention, torch.compile of it and torch.topk as baselines in the same run.

    python tools/bench_dsa.py [--quick] [--musa-legal] [--out results.md] [--codegens triton tilelang]
                              [--fp8-cache] [--long-context [--only long]] [--public-kernels DIR | --no-public-kernels]
                              [--extras] [--topk-codegens triton tilelang] [--only topk]
                              [--indexer-codegens triton tilelang]

Shapes (DeepSeek-V3.2: indexer 64 heads × 128, FP8 key cache of 132 B/token; MLA 128 heads, Dqk 576, Dv 512, one
latent KV head; top-k 2048; 64-token pages with a shuffled block table):
  decode: batch {1, 8, 64, 128} × queries per step {1, 2} × context {32K, 128K};
  prefill: one 4096-query chunk at the end of a context of {8K, 32K, 128K}; the indexer logits are produced in
      chunks of --prefill-chunk query rows (the peak memory is printed), top-k per chunk.
Reported: indexer TB/s (132 B per cached token per query row for FP8, 256 B for bf16, against 4.8 TB/s), top-k
time ÷ the time of one read of the fp32 logits at 4.8 TB/s, sparse attention TFLOP/s of useful work
(2·H·topk·(Dqk + Dv) per query row, against ~790 dense bf16), and each baseline's time ÷ dzc's.
--musa-legal runs the same kernels restricted to configs legal on MUSA mp_22 (≤ 8 warps, 72 KiB shared memory,
BF16 indexer): it validates on the H200 the algorithm MUSA will run. --quick: a subset with untuned defaults.
--fp8-cache: the decode rows read the FP8 latent cache (656 B/token: e4m3 + fp32 scale per 128 + bf16 rope,
dzc.kv_cache's layout; TileLang through its warp-specialized kernel, asked for by --codegens even though "auto"
keeps Triton for that cache until it has run on a GPU); the dense baselines run on its
dequantized bf16 rows. --long-context: one decode step at 1M tokens of context (batch --long-context-batch, 2 query
rows each): each kernel, then the whole step (indexer -> top-k -> sparse attention on its indices) timed, with
its peak memory above the caches and in total.

--extras: after each Triton sparse attention row, the same problem with the op's optional parts: a local window of
128 positions beside the selection plus per-head sinks, and the selection as 32 index blocks of 64 positions (the
same number of keys); each against the plain kernel's time.

Top-k: each of --topk-codegens (dzc's Triton and TileLang kernels) on the same logits, checked exactly against the
op reference on every row before it is timed (a codegen that fails or differs gets a "not run" row and the run goes
on), beside torch.topk and the public tl_topk. --only topk: the decode shapes' indexer (untuned: it only makes the
logits) and top-k rows, nothing else.

Indexer: each of --indexer-codegens (dzc's Triton and TileLang kernels) gets its own decode rows, and in prefill a
row of the indexer alone over all 4096 query rows (chunks of --prefill-chunk) with its causal TFLOP/s; a codegen
with no kernel for the problem or that fails gets a "not run" row.

Every other kernel is checked against its dzc op reference (rows of the first sequence) before it is timed. Kernels run
through dzc's lowering (lower_op: the path a compiled graph takes) with autotuning (tuning database in
--cache-dir; --quick uses the untuned defaults). Times: medians of triton.testing.do_bench (--cuda-graphs: of CUDA
graph replays, do_bench_cudagraph, which leaves the host's launch work out).

--public-kernels DIR (default .public-kernels/deepseek_v32 when it exists; made by tools/fetch_public_kernels.sh,
git-ignored, never committed): the public TileLang DeepSeek-V3.2 example kernels run in the same process on the same
inputs (dzc's paged caches copied once, outside the timing, into the contiguous layouts they take), timed with the
same helper, each checked once against dzc's op reference: rows "public TileLang <kernel>" with their time, their
rate and dzc's time ÷ theirs. A kernel that cannot be imported or raises gives a row "not run: <reason>".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import os
import platform
import sys
import tempfile
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from dzc import kv_cache
from dzc.lowering import Execution
from dzc.ops.dsa import dsa_indexer_reference, dsa_topk_reference, sparse_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import TARGETS, Target, dsa_topk, tilelang_codegen, triton_codegen
from dzc.targets import sparse_attention as attention_family
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, SM_90

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet (measured copy: ~4.3e12)
PEAK_BF16_FLOPS = 790e12  # H200 dense bf16, the best measured GEMM (989e12 datasheet)
PAGE_SIZE = 64
INDEX_HEADS, INDEX_DIM = 64, 128
HEADS, D_QK, D_V = 128, 576, 512
TOPK = 2048
# --extras: a local window beside the selection (NSA's window branch is 512; a shorter one here), and index blocks
# of NSA's selection block size.
EXTRAS_WINDOW, EXTRAS_BLOCK = 128, 64
# Query rows of the first sequence whose outputs are checked against the op references before timing.
CHECK_ROWS = 2
LONG_CONTEXT = 1 << 20  # --long-context: a decode step at 1M tokens
# Baselines materialise fp32 scores [queries, heads, context]: skipped above this many bytes of scores.
BASELINE_SCORE_BYTES = 20 << 30


# --cuda-graphs: every timed call replayed from a CUDA graph (a decode step's GPU work can be less than its host work).
CUDA_GRAPHS = False


def _time(fn) -> float:
    with torch.no_grad():
        if CUDA_GRAPHS:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


@dataclasses.dataclass
class Problem:
    """One batch of sequences in paged caches, every sequence `context` tokens, the last `queries` positions of
    each are the query rows."""

    batch: int
    queries: int
    context: int
    fp8_index: bool
    device: torch.device
    fp8_latent: bool = False  # the latent cache in dzc.kv_cache's FP8 layout (656 B/token)

    def __post_init__(self):
        pages_per_seq = -(-self.context // PAGE_SIZE)
        pages = self.batch * pages_per_seq
        order = torch.randperm(pages, device=self.device).to(torch.int32)
        self.block_table = order.view(self.batch, pages_per_seq)
        self.seq_lens = torch.full((self.batch,), self.context, dtype=torch.int32, device=self.device)
        rows = self.batch * self.queries
        self.query_seq = torch.arange(self.batch, device=self.device, dtype=torch.int32).repeat_interleave(
            self.queries)
        self.query_pos = (self.context - self.queries
                          + torch.arange(self.queries, device=self.device, dtype=torch.int32).repeat(self.batch))
        self.weights = torch.randn(rows, INDEX_HEADS, device=self.device) * INDEX_HEADS ** -0.5
        if self.fp8_index:
            values = torch.randn(pages, PAGE_SIZE * INDEX_DIM, device=self.device).to(torch.float8_e4m3fn)
            scales = torch.full((pages, PAGE_SIZE), 2.0 ** -4, device=self.device)
            self.index_cache = torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=1)
            self.index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, device=self.device).to(torch.float8_e4m3fn)
        else:
            self.index_cache = torch.randn(pages, PAGE_SIZE, INDEX_DIM, device=self.device, dtype=torch.bfloat16)
            self.index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, device=self.device, dtype=torch.bfloat16)
        self.latent = torch.randn(pages, PAGE_SIZE, 1, D_QK, device=self.device, dtype=torch.bfloat16)
        if self.fp8_latent:  # quantized through dzc.kv_cache (the model's write path), in place of the bf16 rows
            self.latent = kv_cache.quantize_latent(self.latent, D_V)
        self.q = torch.randn(rows, HEADS, D_QK, device=self.device, dtype=torch.bfloat16)
        # Selected positions: random causal positions (all valid; duplicates are rare and count like any index).
        visible = (self.query_pos + 1).to(torch.float32)[:, None]
        self.indices = (torch.rand(rows, TOPK, device=self.device) * visible).to(torch.int32)

    @property
    def rows(self) -> int:
        return self.batch * self.queries

    @property
    def check_rows(self) -> int:
        """Query rows checked against the references: at most CHECK_ROWS, all of the first sequence."""
        return min(CHECK_ROWS, self.queries)

    def indexer_args(self, rows: slice = slice(None)):
        return (self.index_q[rows], self.weights[rows], self.index_cache, self.block_table, self.seq_lens,
                self.query_seq[rows], self.query_pos[rows], self.context)

    def attention_args(self):
        return (self.q, self.latent, None, self.block_table, self.seq_lens, self.query_seq, self.indices,
                D_QK ** -0.5, D_V)

    def first_sequence(self, args: tuple, row_arg_positions: tuple[int, ...]) -> tuple:
        """`args` restricted to the first check_rows query rows (all of the first sequence) and that sequence's
        block-table row: what the reference checks (a reference of the whole batch would not fit)."""
        args = list(args)
        for i in row_arg_positions:
            args[i] = args[i][:self.check_rows]
        args[3] = self.block_table[:1]
        args[4] = self.seq_lens[:1]
        return tuple(args)


def dense_masked_attention(q, keys, indices, query_pos, sm_scale):
    """The upstream spelling: full scores, a −inf mask scattered from the top-k indices (and causal), softmax,
    × V. q [B, Q, H, Dqk], keys [B, S, Dqk] (V = keys[..., :Dv]), indices [B, Q, topk], query_pos [B, Q]."""
    scores = torch.einsum("bqhd,bsd->bqhs", q, keys).float() * sm_scale
    mask = torch.full(scores.shape[:2] + scores.shape[3:], float("-inf"), device=q.device)
    mask.scatter_(-1, indices.long(), 0.0)
    causal = torch.arange(keys.shape[1], device=q.device) > query_pos[..., None]
    mask = mask.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores + mask[:, :, None, :], dim=-1)
    return torch.einsum("bqhs,bsd->bqhd", probs.to(q.dtype), keys[..., :D_V])


def _check(name, actual, expected, exact=False):
    if exact:
        if not torch.equal(actual, expected):
            raise AssertionError(f"{name}: differs from the reference")
        return
    finite = expected.isfinite()
    if not torch.equal(actual.isfinite(), finite):
        raise AssertionError(f"{name}: masked (−inf) entries differ from the reference")
    scale = expected[finite].abs().max().clamp_min(1e-6)
    error = (actual[finite].float() - expected[finite].float()).abs().max() / scale
    if error > 2e-2:
        raise AssertionError(f"{name}: max error {error:.3g} (relative to the largest value)")


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda")
        target = TARGETS["cuda:sm_90"]
        if args.musa_legal:
            # The H200 with mp_22's limits: configs mp_22 accepts (num_warps <= 8, 72 KiB), no fp8.
            profile = dataclasses.replace(target.profile, name="cuda:sm_90+mp_22-rules",
                                          max_num_warps=MP_22.max_num_warps,
                                          shared_memory_per_block=MP_22.shared_memory_per_block,
                                          native_dtypes=MP_22.native_dtypes)
            target = Target(profile, target.codegens, target.runtime, target.interpret_on_cpu)
        self.target = target
        self.fp8 = target.profile.supports_dtype(torch.float8_e4m3fn)
        self.rows: list[dict] = []
        # One torch.compile of the baseline for every shape (dynamic: one recompile at most, not one per shape).
        self.compiled_baseline = torch.compile(dense_masked_attention, dynamic=True)
        folder = _public_kernels_folder(args)
        self.public = PublicBaselines(self, folder) if folder else None

    def options(self, codegen="auto"):
        return CompileOptions(cache_dir=self.args.cache_dir, autotune=not self.args.quick, codegen=codegen)

    def kernel(self, op, args, codegen="auto", autotune=None):
        options = self.options(codegen)
        if autotune is not None:
            options = dataclasses.replace(options, autotune=autotune and options.autotune)
        record, _ = lower_op(op, args, self.target, options, Execution(self.target.runtime))
        overload = getattr(torch.ops.dzc, op)
        return (lambda: overload(*args, kernel_id=record.kernel_id)), record

    def indexer_and_topk(self, problem: Problem, label: str):
        args = problem.indexer_args()
        token_bytes = INDEX_DIM + 4 if problem.fp8_index else 2 * INDEX_DIM
        read = problem.rows * problem.context * token_bytes
        logits, indexer_seconds = None, None
        # Each of --indexer-codegens (a codegen that fails or has no kernel for the spec gets a "not run" row);
        # the top-k rows run on the logits of the first that ran.
        for codegen in self.args.indexer_codegens:
            name = f"dsa_indexer[{codegen}]"
            try:
                # --only topk: the indexer only makes the logits, untuned (its tuning would take the time)
                run, record = self.kernel("dsa_indexer", args, codegen, autotune=self.args.only != "topk")
                out = run()
                _check(f"{name} {label}", out[:problem.check_rows],
                       dsa_indexer_reference(*problem.first_sequence(args, (0, 1, 5, 6))))
                seconds = _time(run)
            except Exception as error:  # noqa: BLE001 (a codegen that cannot run here: the row says why)
                print(f"{name} {label}: not run: {_reason(error)}", flush=True)
                self.add(dict(kernel=name, shape=label, us=None, metric=f"not run: {_reason(error)}", baseline="",
                              config=""))
                torch.cuda.empty_cache()
                continue
            bandwidth = read / seconds
            self.add(dict(kernel=name, shape=label, us=seconds * 1e6,
                          metric=f"{bandwidth / 1e12:.2f} TB/s ({100 * bandwidth / PEAK_BYTES_PER_S:.0f}%)",
                          baseline="", config=_tuned(record)))
            if logits is None:
                logits, indexer_seconds = out, seconds
            else:
                del out
        if logits is None:
            return
        lengths = (problem.query_pos + 1).to(torch.int32)
        topk_times = self.topk(logits, lengths, label)
        if self.public is not None:
            self.public.indexer_and_topk(problem, label, indexer_seconds, logits, lengths, topk_times,
                                         topk_only=self.args.only == "topk")

    def topk(self, logits, lengths, label) -> dict[str, float]:
        """Each of --topk-codegens on the logits, checked on every row (exact), then timed; returns their times."""
        topk_args = (logits, lengths, TOPK)
        expected = dsa_topk_reference(logits, lengths, TOPK)
        baseline = _time(lambda: torch.topk(logits, TOPK, dim=-1))
        floor = logits.numel() * 4 / PEAK_BYTES_PER_S
        times = {}
        for codegen in self.args.topk_codegens:
            name = f"dsa_topk[{codegen}]"
            try:
                run, record = self.kernel("dsa_topk", topk_args, codegen)
                wrong = int((run() != expected).any(dim=-1).sum())
            except Exception as error:  # noqa: BLE001 (a codegen that cannot run here: the row says why)
                self.add(dict(kernel=name, shape=label, us=None, metric=f"not run: {_reason(error)}", baseline="",
                              config=""))
                continue
            if wrong:
                self.add(dict(kernel=name, shape=label, us=None, baseline="", config=_tuned(record),
                              metric=f"not run: differs from dzc's reference on {wrong} of {logits.shape[0]} rows"))
                continue
            seconds = times[codegen] = _time(run)
            radix = self.topk_radix(record, logits, lengths, f"topk {label}") if codegen == "triton" else None
            self.add(dict(kernel=name, shape=label, us=seconds * 1e6,
                          metric=f"{seconds / floor:.1f}× one read",
                          baseline=f"torch.topk {baseline * 1e6:.0f} µs = {baseline / floor:.1f}× one read "
                                   f"(dzc {baseline / seconds:.1f}× faster)"
                                   + (f"; whole-row radix form {radix * 1e6:.0f} µs ({radix / seconds:.1f}×)"
                                      if radix else ""), config=_tuned(record)))
        return times

    def topk_radix(self, record, logits, lengths, name) -> float:
        """dsa_topk's time in its whole-row radix form (no sampled bounds; 4096-position chunks, the row re-read
        each pass): the kernel before session 16, beside whatever the run chose."""
        spec = dsa_topk.DsaTopkSpec()
        kernel = triton_codegen.load(dsa_topk, Path(record.source_path), spec, self.target.profile)
        config = dsa_topk.radix_config(self.target.profile)
        inputs, outputs, _, out = dsa_topk.prepare(spec, logits, lengths, TOPK)
        run = lambda: dsa_topk.triton_launch(kernel, config, *inputs, *outputs)  # noqa: E731
        run()
        rows = min(CHECK_ROWS, logits.shape[0])
        _check(f"{name} (radix form)", out[:rows], dsa_topk_reference(logits[:rows], lengths[:rows], TOPK),
               exact=True)
        return _time(run)

    def sparse_attention(self, problem: Problem, label: str):
        args = problem.attention_args()
        flops = 2 * HEADS * TOPK * (D_QK + D_V) * problem.rows
        baseline = self.dense_baselines(problem)
        dzc_times: dict[str, float] = {}
        for codegen in self.args.codegens:  # TileLang over the FP8 latent cache: its warp-specialized kernel
            run, record = self.kernel("sparse_attention", args, codegen)
            out = run()
            _check(f"sparse_attention[{codegen}] {label}", out[:problem.check_rows],
                   sparse_attention_reference(*problem.first_sequence(args, (0, 5, 6))))
            seconds = _time(run)
            dzc_times[codegen] = seconds
            versus = ", ".join(f"{name} {t * 1e6:.0f} µs ({t / seconds:.1f}×)" for name, t in baseline.items())
            self.add(dict(kernel=f"sparse_attention[{codegen}]", shape=label, us=seconds * 1e6,
                                  metric=f"{flops / seconds / 1e12:.0f} TFLOP/s "
                                         f"({100 * flops / seconds / PEAK_BF16_FLOPS:.0f}%)",
                                  baseline=versus, config=_tuned(record)))
        if self.args.extras and "triton" in dzc_times:
            self.sparse_attention_extras(problem, label, args, dzc_times["triton"])
        if self.public is not None:
            self.public.sparse_attention(problem, label, dzc_times)

    def sparse_attention_extras(self, problem: Problem, label: str, args: tuple, plain_seconds: float):
        """The op's optional parts on the same problem, Triton: a local window of EXTRAS_WINDOW positions beside
        the selection and per-head sinks, then index blocks of EXTRAS_BLOCK positions (topk / EXTRAS_BLOCK
        indices: the same number of attended keys); each row's cost against the plain kernel's."""
        generator = torch.Generator().manual_seed(1)
        sinks = torch.randn(HEADS, generator=generator).to(problem.q.device)
        query_pos = problem.query_pos.to(torch.int32)
        blocks = (problem.indices[:, ::EXTRAS_BLOCK] // EXTRAS_BLOCK).contiguous()
        variants = (("window+sinks", args[:6] + args[6:9] + (query_pos, sinks, EXTRAS_WINDOW), EXTRAS_WINDOW),
                    (f"blocks of {EXTRAS_BLOCK}", args[:6] + (blocks,) + args[7:9] + (query_pos, None, 0,
                                                                                         EXTRAS_BLOCK), 0))
        for name, variant, window in variants:
            run, record = self.kernel("sparse_attention", variant, "triton")
            out = run()
            _check(f"sparse_attention[triton, {name}] {label}", out[:problem.check_rows],
                   sparse_attention_reference(*problem.first_sequence(variant, (0, 5, 6, 9))))
            seconds = _time(run)
            flops = 2 * HEADS * (TOPK + window) * (D_QK + D_V) * problem.rows
            rate = flops / seconds
            self.add(dict(kernel=f"sparse_attention[triton, {name}]", shape=label, us=seconds * 1e6,
                          metric=f"{rate / 1e12:.0f} TFLOP/s ({100 * rate / PEAK_BF16_FLOPS:.0f}%)",
                          baseline=f"plain top-k {plain_seconds * 1e6:.0f} µs ({seconds / plain_seconds:.2f}× "
                                   f"its time)", config=_tuned(record)))

    def dense_baselines(self, problem: Problem) -> dict[str, float]:
        """Eager dense-masked attention and torch.compile of it, on dense per-sequence KV, where memory allows."""
        score_bytes = problem.rows * HEADS * problem.context * 4
        if self.args.no_baselines or score_bytes > BASELINE_SCORE_BYTES:
            return {}
        table = problem.block_table.long()
        latent = kv_cache.dequantize_latent(problem.latent, D_V, torch.bfloat16) if problem.fp8_latent \
            else problem.latent
        keys = latent[table].reshape(problem.batch, -1, D_QK)[:, :problem.context]
        q = problem.q.view(problem.batch, problem.queries, HEADS, D_QK)
        indices = problem.indices.view(problem.batch, problem.queries, TOPK)
        positions = problem.query_pos.view(problem.batch, problem.queries)
        times = {}
        try:
            times["eager"] = _time(lambda: dense_masked_attention(q, keys, indices, positions, D_QK ** -0.5))
            compiled = self.compiled_baseline
            times["torch.compile"] = _time(lambda: compiled(q, keys, indices, positions, D_QK ** -0.5))
        except torch.OutOfMemoryError:
            pass
        torch.cuda.empty_cache()
        return times

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """(batch, queries, context) of every decode problem."""
        batches = self.args.batches or ((1, 64) if self.args.quick else (1, 8, 64, 128))
        contexts = self.args.contexts or ((32768,) if self.args.quick else (32768, 131072))
        queries_per_step = self.args.queries or ((2,) if self.args.quick else (1, 2))
        return [(batch, queries, context) for context in contexts for batch in batches
                for queries in queries_per_step]

    def prefill_contexts(self) -> tuple[int, ...]:
        return tuple(self.args.prefill_contexts or ((8192,) if self.args.quick else (8192, 32768, 131072)))

    def plan(self):
        """--dry-run: every problem built on the meta device (shapes, no memory), its sparse-attention spec and
        legal configs on the profile: everything up to the first launch."""
        meta = torch.device("meta")
        shapes = self.decode_shapes() if self.args.only in (None, "decode", "topk") else []
        shapes += [(1, 4096, c) for c in self.prefill_contexts()] if self.args.only in (None, "prefill") else []
        if self.args.long_context or self.args.only == "long":
            shapes.append((self.args.long_context_batch, 2, LONG_CONTEXT))
        for batch, queries, context in shapes:
            problem = Problem(batch, queries, context, self.fp8, meta, self.args.fp8_cache and queries <= 2)
            args = problem.attention_args()
            spec = attention_family.spec_for(args[0], args[1], None, args[6], D_V)
            legal, _ = legal_configs(attention_family, "triton", spec, self.target.profile)
            print(f"dry run: B={batch} q={queries} ctx={context}: {spec.describe()}, {len(legal)} legal Triton configs "
                  f"on {self.target.profile.name}")
        for codegen in self.args.topk_codegens:
            legal, _ = legal_configs(dsa_topk, codegen, dsa_topk.DsaTopkSpec(), self.target.profile)
            print(f"dry run: dsa_topk[{codegen}]: {len(legal)} legal configs on {self.target.profile.name}")
        print(self.public.describe() if self.public is not None else "public TileLang kernels: off")

    def decode(self):
        for batch, queries, context in self.decode_shapes():
            torch.manual_seed(batch * 1000 + queries + context)
            problem = Problem(batch, queries, context, self.fp8, self.device, self.args.fp8_cache)
            label = f"decode B={batch} q={queries} ctx={context // 1024}K{' fp8-latent' if self.args.fp8_cache else ''}"
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            self.indexer_and_topk(problem, label)
            if self.args.only != "topk":
                self.sparse_attention(problem, label)
            logits_mib = problem.rows * context * 4 / 2**20
            print(f"{label}: peak {(torch.cuda.max_memory_allocated() - before) / 2**20:.0f} MiB above the "
                  f"caches, of which the indexer logits are {logits_mib:.0f} MiB (and the dense baselines' "
                  f"tensors when they ran)", flush=True)
            del problem
            torch.cuda.empty_cache()

    def long_context(self):
        """One decode step at LONG_CONTEXT tokens: each kernel's row, then the chained step and its peak memory."""
        batch = self.args.long_context_batch
        torch.manual_seed(LONG_CONTEXT)
        problem = Problem(batch, 2, LONG_CONTEXT, self.fp8, self.device, self.args.fp8_cache)
        label = f"decode B={batch} q=2 ctx=1M{' fp8-latent' if self.args.fp8_cache else ''}"
        caches = torch.cuda.memory_allocated()
        self.indexer_and_topk(problem, label)
        self.sparse_attention(problem, label)
        lengths = (problem.query_pos + 1).to(torch.int32)
        run_indexer, indexer = self.kernel("dsa_indexer", problem.indexer_args())
        topk = self.kernel("dsa_topk", (run_indexer(), lengths, TOPK))[1]
        attention = self.kernel("sparse_attention", problem.attention_args())[1]  # auto: the FP8 cache is Triton's
        del run_indexer

        def step(problem=problem):
            logits = torch.ops.dzc.dsa_indexer(*problem.indexer_args(), kernel_id=indexer.kernel_id)
            indices = torch.ops.dzc.dsa_topk(logits, lengths, TOPK, kernel_id=topk.kernel_id)
            args = list(problem.attention_args())
            args[6] = indices
            return torch.ops.dzc.sparse_attention(*args, kernel_id=attention.kernel_id)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        seconds = _time(step)
        print(f"{label}: whole step {seconds * 1e6:.0f} µs; peak {(peak - before) / 2**20:.0f} MiB above the "
              f"caches ({caches / 2**20:.0f} MiB of caches and inputs), {peak / 2**30:.2f} GiB allocated in all",
              flush=True)
        self.add(dict(kernel="indexer -> top-k -> sparse_attention", shape=label, us=seconds * 1e6,
                              metric=f"peak {(peak - before) / 2**20:.0f} MiB above the caches",
                              baseline=f"caches {caches / 2**20:.0f} MiB", config=""))
        del problem
        torch.cuda.empty_cache()

    def prefill(self):
        chunk = self.args.prefill_chunk
        for context in self.prefill_contexts():
            torch.manual_seed(context)
            problem = Problem(1, 4096, context, self.fp8, self.device)
            label = f"prefill 4096 q ctx={context // 1024}K"
            # Indexer + top-k in chunks of query rows: the logits never exceed chunk × context fp32.
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            lengths = (problem.query_pos + 1).to(torch.int32)
            first_chunk = problem.indexer_args(slice(0, chunk))
            indexer_run, indexer = self.kernel("dsa_indexer", first_chunk)
            logits = indexer_run()
            _check(f"indexer {label}", logits[:CHECK_ROWS], dsa_indexer_reference(
                *problem.indexer_args(slice(0, CHECK_ROWS))))
            topk_run, topk = self.kernel("dsa_topk", (logits, lengths[:chunk], TOPK))
            _check(f"topk {label}", topk_run()[:CHECK_ROWS],
                   dsa_topk_reference(logits[:CHECK_ROWS], lengths[:CHECK_ROWS], TOPK), exact=True)
            del logits, indexer_run, topk_run

            def chunked(problem=problem):
                for start in range(0, problem.rows, chunk):
                    rows = slice(start, start + chunk)
                    logits = torch.ops.dzc.dsa_indexer(*problem.indexer_args(rows), kernel_id=indexer.kernel_id)
                    torch.ops.dzc.dsa_topk(logits, lengths[rows], TOPK, kernel_id=topk.kernel_id)

            seconds = _time(chunked)
            peak = torch.cuda.max_memory_allocated() - before
            self.indexer_and_topk_prefill_row(problem, label, seconds, peak, chunk)
            self.prefill_indexer(problem, label, chunk)
            if self.public is not None:
                self.public.prefill_indexer_topk(problem, label, seconds)
            self.sparse_attention(problem, label)
            del problem
            torch.cuda.empty_cache()

    def prefill_indexer(self, problem, label, chunk):
        """The indexer alone over every query row (in chunks of `chunk` rows), per --indexer-codegens: FP8 (or bf16)
        logits TFLOP/s of the causal work, 2·heads·Di per visible (row, key) pair."""
        causal_pairs = sum(int(p) + 1 for p in problem.query_pos.tolist())
        flops = 2 * INDEX_HEADS * INDEX_DIM * causal_pairs
        for codegen in self.args.indexer_codegens:
            name = f"dsa_indexer[{codegen}] (prefill, alone)"
            try:
                run, record = self.kernel("dsa_indexer", problem.indexer_args(slice(0, chunk)), codegen)
                _check(f"{name} {label}", run()[:CHECK_ROWS],
                       dsa_indexer_reference(*problem.indexer_args(slice(0, CHECK_ROWS))))

                def indexer_only(problem=problem, record=record):
                    for start in range(0, problem.rows, chunk):
                        torch.ops.dzc.dsa_indexer(*problem.indexer_args(slice(start, start + chunk)),
                                                  kernel_id=record.kernel_id)

                seconds = _time(indexer_only)
            except Exception as error:  # noqa: BLE001
                print(f"{name} {label}: not run: {_reason(error)}", flush=True)
                self.add(dict(kernel=name, shape=label, us=None, metric=f"not run: {_reason(error)}", baseline="",
                              config=""))
                continue
            finally:
                torch.cuda.empty_cache()
            self.add(dict(kernel=name, shape=label, us=seconds * 1e6,
                          metric=f"{flops / seconds / 1e12:.0f} indexer TFLOP/s (causal)",
                          baseline=f"chunks of {chunk} rows", config=_tuned(record)))

    def indexer_and_topk_prefill_row(self, problem, label, seconds, peak, chunk):
        causal_pairs = sum(int(p) + 1 for p in problem.query_pos.tolist())
        flops = 2 * INDEX_HEADS * INDEX_DIM * causal_pairs
        self.add(dict(kernel="dsa_indexer+dsa_topk (chunked)", shape=label, us=seconds * 1e6,
                              metric=f"{flops / seconds / 1e12:.0f} indexer TFLOP/s (causal)",
                              baseline=f"logits peak {peak / 2**20:.0f} MiB (chunks of {chunk} rows)", config=""))

    def add(self, row: dict) -> None:
        """Keep a measured row for the table, and print it now: a run stopped by a time limit still shows what it
        measured (the table is written at the end)."""
        self.rows.append(row)
        print(" | ".join(str(row.get(key, "")) for key in ("kernel", "shape", "us", "metric", "baseline")),
              flush=True)

    def table(self) -> str:
        lines = ["| kernel | shape | µs | achieved | baselines | config |", "|---|---|---|---|---|---|"]
        for row in self.rows:
            us = "—" if row['us'] is None else f"{row['us']:.1f}"
            lines.append(f"| {row['kernel']} | {row['shape']} | {us} | {row['metric']} | "
                         f"{row['baseline']} | {row['config']} |")
        return "\n".join(lines)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PUBLIC_KERNELS = os.path.join(REPO_ROOT, ".public-kernels", "deepseek_v32")
# The public example files and their Python entry points, as wired below.
PUBLIC_MODULES = ("fp8_lighting_indexer", "topk_selector", "sparse_mla_fwd_pipelined", "sparse_mla_fwd")
# topk_selector's first pass keeps the candidates of the threshold bin in a shared buffer of this many entries.
PUBLIC_TOPK_SMEM_INPUT = 4096


def _public_kernels_folder(args) -> str | None:
    if args.no_public_kernels:
        return None
    if args.public_kernels:
        return args.public_kernels
    return DEFAULT_PUBLIC_KERNELS if os.path.isdir(DEFAULT_PUBLIC_KERNELS) else None


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    line = text[0] if text else type(error).__name__
    # Compiler errors put the useful line further down: the first line that says error.
    for candidate in text[1:]:
        if "error" in candidate.lower() and len(line) < 40:
            line += " … " + candidate.strip()
            break
    return (line[:200] + "…") if len(line) > 200 else line


def _error_text(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """The max error of `actual` against dzc's op reference, relative to the reference's largest value (what _check
    bounds by 2e-2), or how its −inf/NaN pattern differs: reported, never raised (a baseline is not dzc's kernel)."""
    actual, expected = actual.float(), expected.float()
    finite = expected.isfinite()
    if not torch.equal(actual.isfinite(), finite):
        return (f"{int((actual.isfinite() != finite).sum())} of {finite.numel()} entries differ in finiteness "
                f"from dzc's reference (wrong inputs or mask)")
    if not finite.any():
        return "max error 0 (all masked)"
    scale = expected[finite].abs().max().clamp_min(1e-6)
    error = float((actual[finite] - expected[finite]).abs().max() / scale)
    return f"max error {error:.2g} vs dzc's reference{' (too large: check its inputs)' if error > 2e-2 else ''}"


def _topk_match_text(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Top-k positions (any order) against dzc's reference (ascending, -1 padded): exact sets, or the overlap."""
    actual = actual.long().sort(dim=-1).values
    expected = expected.long()
    same = (actual == expected).all(dim=-1)
    if bool(same.all()):
        return f"same positions as dzc's reference on {same.numel()} rows"
    overlap = min(len(set(a.tolist()) & set(e.tolist())) / max(1, int((e >= 0).sum()))
                  for a, e in zip(actual[~same], expected[~same]))
    return (f"same positions on {int(same.sum())}/{same.numel()} rows (ties or wrong inputs), worst overlap "
            f"{100 * overlap:.1f}%")


def _radix_threshold_population(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> int:
    """The most candidates topk_selector's first pass keeps (the threshold bin of the 8-bit fp16-order histogram)
    over all rows: above PUBLIC_TOPK_SMEM_INPUT it would write past its shared buffer, so it is not run."""
    worst = 0
    positions = torch.arange(logits.shape[1], device=logits.device)
    for start in range(0, logits.shape[0], 256):
        rows = logits[start:start + 256]
        half = rows.half().view(torch.int16).int() & 0xFFFF
        bins = torch.where(rows < 0, (~half) & 0xFFFF, half | 0x8000) >> 8
        valid = positions < lengths[start:start + 256, None].long()
        bins = bins.masked_fill(~valid, 256).long()
        counts = torch.zeros(rows.shape[0], 257, device=logits.device, dtype=torch.int64)
        counts.scatter_add_(1, bins, torch.ones_like(bins))
        counts = counts[:, :256]
        suffix = counts.flip(-1).cumsum(-1).flip(-1)  # suffix[b]: values in bins >= b
        threshold = ((suffix >= k).sum(-1) - 1).clamp_min(0)
        worst = max(worst, int(counts.gather(1, threshold[:, None]).max()))
    return worst


def _compiled(jit_function, *args):
    """The compiled kernel of a tilelang.jit function for `args` (called with the tensors only: no per-call
    argument hashing in the timing), or None where this tilelang has no .compile (then the jit call is timed)."""
    try:
        return jit_function.compile(*args)
    except Exception:  # noqa: BLE001
        return None


def public_attention_inputs(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The public sparse-attention kernels' q [B, S, H, 576], dense KV [B, S_kv, 1, 576] (dzc's paged latent cache
    gathered through the block table, an FP8 one dequantized to bf16) and indices [B, S, 1, top-k]."""
    latent = kv_cache.dequantize_latent(problem.latent, D_V, torch.bfloat16) if problem.fp8_latent \
        else problem.latent
    kv = latent[problem.block_table.long()].reshape(problem.batch, -1, 1, D_QK).contiguous()
    q = problem.q.view(problem.batch, problem.queries, HEADS, D_QK).contiguous()
    indices = problem.indices.view(problem.batch, problem.queries, 1, TOPK).contiguous()
    return q, kv, indices


def pipelined_attention(module, problem: Problem, q, kv, indices):
    """A call of the public `sparse_mla_fwd_pipelined` kernel, compiled once, its causal start at context − queries
    (dzc's query rows are the context's last)."""
    start = problem.context - problem.queries
    kernel = module.sparse_mla_fwd_interface(q, kv, indices, start, 1, sm_scale=D_QK ** -0.5, return_kernel=True)
    start_t = torch.tensor([start], dtype=torch.int32, device=q.device)
    return lambda: kernel(q, kv, indices, start_t)


class PublicBaselines:
    """The public TileLang DeepSeek-V3.2 example kernels (tile-ai/tilelang examples/deepseek_v32, copied by
    tools/fetch_public_kernels.sh into a git-ignored folder) run on the inputs of dzc's rows:

      fp8_lighting_indexer.mqa_attn_return_logits(IndexQ [T·64, 128] e4m3, IndexK [N, 128] e4m3, IndexKScale [N]
          fp32, Weights [T, 64] fp32, CuSeqLenKS [T] int32, CuSeqLenKE [T] int32) -> logits [T, N] fp32 (garbage
          outside [KS, KE)); clean_logits_ (in mqa_attn_return_logits_interface) writes −inf there. One flat key
          array: the sequences' keys one after the other (each its block-table capacity), KS/KE per query row.
      topk_selector.tl_topk(logits [T, L] fp32, starts [T] int32, ends [T] int32, topk) -> [T, topk] int32 positions
          in no order (0-padded).
      sparse_mla_fwd_pipelined.sparse_mla_fwd(Q [B, S, 128, 576] bf16, KV [B, S_kv, 1, 576] bf16, Indices [B, S, 1,
          topk] int32, q_start_index_s [1] int32, ...) -> (out [B, S, 128, 512] bf16, lse); causal: index <=
          q_start_index_s + s (kv_stride 1): q_start_index_s = context − queries places dzc's query rows.
      sparse_mla_fwd.sparse_mla_fwd_interface(q [B, S, 128, 576], kv [B, S_kv, 1, 576], indices [B, S, 1, topk]
          int32) -> (out, lse); causal: index <= s (query row s sits at position s, no offset): dzc's rows sit at
          context − queries + s, so its output is checked against the reference of what it computes, and its time
          is that of the same loads and math (every index is gathered, masked ones score −inf).
    """

    def __init__(self, bench: "Bench", folder: str):
        self.bench = bench
        self.folder = os.path.abspath(folder)
        self.modules: dict[str, object] = {}
        self.failures: dict[str, str] = {}
        self.source = self._read_source()

    def _read_source(self) -> str:
        try:
            with open(os.path.join(os.path.dirname(self.folder), "SOURCE")) as f:
                fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
            return f"tilelang@{fields.get('commit', '?')[:10]}"
        except OSError:
            return "tilelang@?"

    def module(self, name: str):
        """The example module `name` from the folder, imported once; raises RuntimeError(reason) when it cannot be."""
        if name in self.modules:
            return self.modules[name]
        if name in self.failures:
            raise RuntimeError(self.failures[name])
        try:
            if not os.path.isfile(os.path.join(self.folder, f"{name}.py")):
                raise FileNotFoundError(f"{name}.py not in {self.folder} (run tools/fetch_public_kernels.sh)")
            importlib.import_module("tilelang")
            # The examples import their own `utils` (import utils): shadow any other module of that name meanwhile.
            saved = sys.modules.pop("utils", None)
            sys.path.insert(0, self.folder)
            try:
                module = importlib.import_module(name)
            finally:
                sys.path.remove(self.folder)
                if saved is not None:
                    sys.modules["utils"] = saved
                else:
                    sys.modules.pop("utils", None)
        except Exception as error:  # noqa: BLE001 (any failure: the row says why)
            self.failures[name] = _reason(error)
            raise RuntimeError(self.failures[name]) from error
        self.modules[name] = module
        return module

    def describe(self) -> str:
        """--dry-run: which example modules import (tilelang imported, nothing compiled or launched)."""
        parts = []
        for name in PUBLIC_MODULES:
            try:
                self.module(name)
                parts.append(f"{name} ok")
            except RuntimeError as error:
                parts.append(f"{name} not importable: {error}")
        return f"public TileLang kernels from {self.folder} ({self.source}): " + "; ".join(parts)

    def _row(self, name: str, label: str, seconds: float | None, metric: str, baseline: str, module: str):
        self.bench.add(dict(kernel=f"public TileLang {name}", shape=label,
                                    us=None if seconds is None else seconds * 1e6, metric=metric, baseline=baseline,
                                    config=f"{module}.py, {self.source}"))

    def _not_run(self, name: str, label: str, reason: str, module: str):
        print(f"public TileLang {name} {label}: not run: {reason}", flush=True)
        self._row(name, label, None, f"not run: {reason}", "", module)

    def _guarded(self, name: str, label: str, module: str, body):
        """Runs body() (which appends its rows); a failure becomes a "not run" row and the benchmark goes on."""
        try:
            body()
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001
            self._not_run(name, label, _reason(error), module)
        torch.cuda.empty_cache()

    @staticmethod
    def _versus(dzc_seconds: float, seconds: float, dzc_name: str = "dzc") -> str:
        return f"{dzc_name} {dzc_seconds * 1e6:.0f} µs: dzc ÷ public = {dzc_seconds / seconds:.2f}"

    # ---- indexer inputs: dzc's paged FP8 index cache -> one flat key array ----

    def _indexer_inputs(self, problem: Problem, rows: slice = slice(None)):
        """(q [T, 64, 128] e4m3, keys [N, 128] e4m3, key scales [N] fp32, weights [T, 64] fp32, KS [T], KE [T]) for
        the query rows `rows`: sequence b's keys at b·capacity .. b·capacity + capacity, KE = its start + pos + 1.
        T is padded to a multiple of the kernel's block_Q (128 // 64 = 2 rows) with copies of the last row."""
        values, scales = kv_cache.split_fp8_index_pages(problem.index_cache, INDEX_DIM)
        table = problem.block_table.long()
        capacity = table.shape[1] * PAGE_SIZE
        keys = values[table].reshape(-1, INDEX_DIM).contiguous()
        key_scales = scales[table].reshape(-1).contiguous()
        q = problem.index_q[rows]
        weights = problem.weights[rows].float()
        start = problem.query_seq[rows].long() * capacity
        ks = start.to(torch.int32)
        ke = (start + problem.query_pos[rows].long() + 1).to(torch.int32)
        block_q = 128 // INDEX_HEADS
        pad = -q.shape[0] % block_q
        if pad:
            q, weights, ks, ke = (torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) for t in (q, weights, ks, ke))
        return (q.contiguous(), keys, key_scales, weights.contiguous(), ks.contiguous(), ke.contiguous()), capacity

    def _indexer_run(self, problem: Problem, rows: slice = slice(None)):
        fp8 = self.module("fp8_lighting_indexer")
        (q, keys, key_scales, weights, ks, ke), capacity = self._indexer_inputs(problem, rows)
        flat_q = q.view(-1, INDEX_DIM)
        compiled = _compiled(fp8.mqa_attn_return_logits, flat_q, keys, key_scales, weights, ks, ke)

        def kernel_only():
            if compiled is not None:
                return compiled(flat_q, keys, key_scales, weights, ks, ke)
            return fp8.mqa_attn_return_logits(flat_q, keys, key_scales, weights, ks, ke)

        def interface():
            return fp8.mqa_attn_return_logits_interface(q=q, kv=keys, kv_scales=key_scales, weights=weights,
                                                        cu_seqlen_ks=ks, cu_seqlen_ke=ke)
        return kernel_only, interface, capacity

    def _indexer_unavailable(self, problem: Problem) -> str | None:
        if not (self.bench.fp8 and problem.fp8_index):
            return "the public indexer is FP8 only (this run's index cache is BF16)"
        logits_bytes = problem.rows * problem.batch * -(-problem.context // PAGE_SIZE) * PAGE_SIZE * 4
        if logits_bytes > BASELINE_SCORE_BYTES:
            return f"its logits over the flat keys of every sequence would be {logits_bytes / 2**30:.0f} GiB"
        return None

    def indexer_and_topk(self, problem: Problem, label: str, dzc_indexer: float, logits: torch.Tensor,
                         lengths: torch.Tensor, dzc_topk: dict[str, float], topk_only: bool = False):
        """Decode rows: the public indexer on the same FP8 cache and queries (not with topk_only), the public top-k
        on dzc's logits (against each dzc top-k codegen's time)."""
        name = "mqa_attn_return_logits (indexer)"
        reason = self._indexer_unavailable(problem)
        if not topk_only and reason:
            self._not_run(name, label, reason, "fp8_lighting_indexer")
        elif not topk_only:
            self._guarded(name, label, "fp8_lighting_indexer",
                          lambda: self._decode_indexer(problem, label, name, dzc_indexer))
        name = "tl_topk (top-k)"
        self._guarded(name, label, "topk_selector", lambda: self._topk(logits, lengths, label, name, dzc_topk))

    def _decode_indexer(self, problem: Problem, label: str, name: str, dzc_seconds: float):
        kernel_only, interface, capacity = self._indexer_run(problem)
        rows = problem.check_rows
        out = interface()
        # The first sequence's rows and columns: its keys come first in the flat array.
        check = _error_text(out[:rows, :problem.context],
                            dsa_indexer_reference(*problem.first_sequence(problem.indexer_args(), (0, 1, 5, 6))))
        del out
        seconds = _time(kernel_only)
        cleaned = _time(interface)
        read = problem.rows * problem.context * (INDEX_DIM + 4)
        note = (" (block_Q = 2 rows span 2 sequences at 1 query each: it reads both sequences' keys)"
                if problem.queries % 2 and problem.batch > 1 else "")
        self._row(name, label, seconds, f"{read / seconds / 1e12:.2f} TB/s ({100 * read / seconds / PEAK_BYTES_PER_S:.0f}%)",
                  f"{self._versus(dzc_seconds, seconds)}; with clean_logits_ over [{problem.rows}, "
                  f"{problem.batch}·{capacity}] {cleaned * 1e6:.0f} µs; {check}{note}", "fp8_lighting_indexer")

    def _topk(self, logits: torch.Tensor, lengths: torch.Tensor, label: str, name: str,
              dzc_seconds: dict[str, float]):
        selector = self.module("topk_selector")
        population = _radix_threshold_population(logits, lengths, TOPK)
        if population > PUBLIC_TOPK_SMEM_INPUT:
            raise RuntimeError(f"its first pass would keep {population} candidates in a shared buffer of "
                               f"{PUBLIC_TOPK_SMEM_INPUT} (SMEM_INPUT_SIZE)")
        logits = logits.contiguous()
        starts = torch.zeros_like(lengths, dtype=torch.int32)
        ends = lengths.to(torch.int32).contiguous()
        out = selector.tl_topk(logits, starts, ends, TOPK)
        rows = min(256, logits.shape[0])
        check = _topk_match_text(out[:rows], dsa_topk_reference(logits[:rows], lengths[:rows], TOPK))
        del out
        index = torch.zeros(logits.shape[0], TOPK, dtype=torch.int32, device=logits.device)
        compiled = _compiled(selector.tl_topk_impl, logits, index, starts, ends) \
            if hasattr(selector, "tl_topk_impl") else None
        if compiled is not None:  # tl_topk without its torch.zeros of the output
            seconds = _time(lambda: compiled(logits, index, starts, ends))
        else:
            seconds = _time(lambda: selector.tl_topk(logits, starts, ends, TOPK))
        floor = logits.numel() * 4 / PEAK_BYTES_PER_S
        versus = "; ".join(self._versus(mine, seconds, f"dzc[{codegen}]") for codegen, mine in dzc_seconds.items())
        self._row(name, label, seconds, f"{seconds / floor:.1f}× one read",
                  f"{versus or 'no dzc time'}; {check}", "topk_selector")

    def prefill_indexer_topk(self, problem: Problem, label: str, dzc_seconds: float):
        """Prefill: the public indexer over all query rows at once (its logits [rows, context], cleaned), then the
        public top-k on them; against dzc's chunked indexer + top-k."""
        name = "mqa_attn_return_logits + tl_topk (unchunked)"
        reason = self._indexer_unavailable(problem)
        if reason:
            self._not_run(name, label, reason, "fp8_lighting_indexer")
            return
        self._guarded(name, label, "fp8_lighting_indexer.py + topk_selector",
                      lambda: self._prefill_indexer_topk(problem, label, name, dzc_seconds))

    def _prefill_indexer_topk(self, problem: Problem, label: str, name: str, dzc_seconds: float):
        selector = self.module("topk_selector")
        kernel_only, interface, _ = self._indexer_run(problem)
        lengths = (problem.query_pos + 1).to(torch.int32)
        starts = torch.zeros_like(lengths)
        logits = interface()[:problem.rows, :problem.context].contiguous()
        check = _error_text(logits[:CHECK_ROWS], dsa_indexer_reference(*problem.indexer_args(slice(0, CHECK_ROWS))))
        population = _radix_threshold_population(logits, lengths, TOPK)
        topk_ok = population <= PUBLIC_TOPK_SMEM_INPUT
        if topk_ok:
            out = selector.tl_topk(logits, starts, lengths, TOPK)
            check += "; top-k " + _topk_match_text(out[:CHECK_ROWS], dsa_topk_reference(
                logits[:CHECK_ROWS], lengths[:CHECK_ROWS], TOPK))
            del out
        del logits
        indexer = _time(kernel_only)
        cleaned = _time(interface)
        causal_pairs = sum(int(p) + 1 for p in problem.query_pos.tolist())
        flops = 2 * INDEX_HEADS * INDEX_DIM * causal_pairs
        detail = f"indexer kernel {indexer * 1e6:.0f} µs ({flops / indexer / 1e12:.0f} TFLOP/s), +clean_logits_ {cleaned * 1e6:.0f} µs"
        if not topk_ok:
            self._row("mqa_attn_return_logits (indexer, unchunked)", label, cleaned,
                      f"{flops / cleaned / 1e12:.0f} indexer TFLOP/s (causal)",
                      f"{detail}; tl_topk not run: its first pass would keep {population} candidates in a shared "
                      f"buffer of {PUBLIC_TOPK_SMEM_INPUT}; {check}", "fp8_lighting_indexer")
            return

        def both():
            selector.tl_topk(interface(), starts, lengths, TOPK)

        seconds = _time(both)
        self._row(name, label, seconds, f"{flops / seconds / 1e12:.0f} indexer TFLOP/s (causal)",
                  f"{self._versus(dzc_seconds, seconds, 'dzc chunked')}; {detail}; {check}",
                  "fp8_lighting_indexer.py + topk_selector")

    # ---- sparse attention: dzc's paged latent cache -> contiguous [B, context, 1, 576] ----

    def sparse_attention(self, problem: Problem, label: str, dzc_times: dict[str, float]):
        names = (("sparse_mla_fwd_pipelined", "sparse_mla_fwd (pipelined)"), ("sparse_mla_fwd", "sparse_mla_fwd"))
        kv_bytes = problem.batch * -(-problem.context // PAGE_SIZE) * PAGE_SIZE * D_QK * 2
        if kv_bytes > BASELINE_SCORE_BYTES:
            for module, name in names:
                self._not_run(name, label, f"its contiguous KV would be {kv_bytes / 2**30:.0f} GiB", module)
            return
        q, kv, indices = public_attention_inputs(problem)
        reference = sparse_attention_reference(*problem.first_sequence(problem.attention_args(), (0, 5, 6)))
        for module, name in names:
            self._guarded(name, label, module, lambda: self._attention(problem, label, module, name, q, kv, indices,
                                                                       reference, dzc_times))

    def _attention(self, problem, label, module_name, name, q, kv, indices, reference, dzc_times):
        module = self.module(module_name)
        note = ""
        if module_name == "sparse_mla_fwd_pipelined":
            run = pipelined_attention(module, problem, q, kv, indices)
            expected = reference
        else:
            sm_scale = D_QK ** -0.5
            start = problem.context - problem.queries
            # sparse_mla_fwd_interface's call, compiled once (its defaults: block_I 64, 2 stages, 256 threads).
            kernel = _compiled(getattr(module, "sparse_mla_fwd", None), q, kv, indices, HEADS, D_V, D_QK - D_V, TOPK,
                               1, sm_scale, True)

            def run():
                if kernel is not None:
                    return kernel(q, kv, indices)
                return module.sparse_mla_fwd_interface(q, kv, indices, sm_scale=sm_scale)
            # Its causal mask: index <= s for query row s. The reference of what it computes (dzc's op on the
            # indices it keeps: the others as -1) shows whether it was fed the inputs as intended.
            kept = problem.indices[:problem.check_rows].clone()
            rows = torch.arange(problem.check_rows, device=kept.device)[:, None]
            kept = torch.where(kept <= rows % problem.queries, kept, -1)
            args = list(problem.first_sequence(problem.attention_args(), (0, 5, 6)))
            args[6] = kept
            expected = sparse_attention_reference(*args)
            note = (f" (its causal mask is index <= row index s: dzc's rows sit at positions {start}+s, so it keeps "
                    f"only the selected positions <= s; checked against that, timed on the same loads and math)")
        if problem.fp8_latent:
            note += " (on the dequantized bf16 latent cache)"
        out = run()[0]
        actual = out.view(-1, HEADS, D_V)[:problem.check_rows]
        if module_name == "sparse_mla_fwd":
            # A row with no kept index: dzc's reference gives 0, the kernel divides by a zero sum.
            empty = ~(expected.float().abs().sum(dim=(1, 2), keepdim=True) > 0)
            actual = torch.where(empty, torch.zeros_like(actual), actual)
        check = _error_text(actual, expected)
        del out
        seconds = _time(run)
        flops = 2 * HEADS * TOPK * (D_QK + D_V) * problem.rows
        if dzc_times:
            best = min(dzc_times, key=dzc_times.get)
            versus = self._versus(dzc_times[best], seconds, f"dzc[{best}]")
        else:
            versus = "no dzc time"
        self._row(name, label, seconds,
                  f"{flops / seconds / 1e12:.0f} TFLOP/s ({100 * flops / seconds / PEAK_BF16_FLOPS:.0f}%)",
                  f"{versus}; {check}{note}", module_name)


def family_kernels(family, codegen: str, spec, match: list[str] | None, only_default: bool, bucket: int | None = None):
    """For the diagnose_* tools: (kernels, launch, default, configs, of how many) of `family`'s `codegen` for `spec`
    on sm_90: its source generated and loaded, the untuned default (the bucket's, where the family narrows by
    bucket and `bucket` is given) first, then the other legal configs whose text contains one of `match` (all
    without it; none with only_default)."""
    path = Path(tempfile.mkdtemp()) / f"{codegen}_kernel.py"
    path.write_text(getattr(family, f"{codegen}_source")(spec, SM_90))
    kernels = (tilelang_codegen if codegen == "tilelang" else triton_codegen).load(family, path, spec, SM_90)
    legal, _ = legal_configs(family, codegen, spec, SM_90)
    default = getattr(family, f"{codegen}_default_config")(spec, SM_90)
    if bucket is not None:
        legal, default = family.configs_for_bucket(spec, SM_90, bucket, legal, default)
    configs = [default] + [c for c in legal if c != default and not only_default
                           and (not match or any(text in str(c) for text in match))]
    return kernels, getattr(family, f"{codegen}_launch"), default, configs, len(legal)


def _tuned(record) -> str:
    return "; ".join(f"≤{bucket}: {entry['config']}" + (f" [{entry['path'].split(' (')[0]}]" if "path" in entry
                                                          else "")
                     for bucket, entry in sorted(record.tuned.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a subset (decode B in {1, 64}, 2 queries, 32K; prefill at 8K, where the size options "
                             "do not say otherwise), untuned defaults")
    parser.add_argument("--musa-legal", action="store_true", help="only configs legal on MUSA mp_22, BF16 indexer")
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"],
                        help="code generators for sparse attention")
    parser.add_argument("--no-baselines", action="store_true", help="skip the dense-masked attention baselines")
    parser.add_argument("--extras", action="store_true",
                        help="also time sparse attention with a local window and sinks, and with index blocks")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="query rows per indexer/top-k chunk")
    parser.add_argument("--only", choices=["decode", "prefill", "long", "topk"],
                        help="run one part (the full run is long); long: only the --long-context row; topk: the "
                             "decode shapes' top-k rows (and the indexer that makes their logits, untuned)")
    parser.add_argument("--indexer-codegens", nargs="+", default=["triton", "tilelang"],
                        help="code generators for dsa_indexer (each checked and timed on the same inputs; the top-k "
                             "runs on the first one's logits)")
    parser.add_argument("--topk-codegens", nargs="+", default=["triton", "tilelang"],
                        help="code generators for dsa_topk (each timed on the same logits)")
    parser.add_argument("--queries", type=int, nargs="+", help="decode query rows per sequence (default 1 2)")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="decode rows over the FP8 latent cache (656 B/token) instead of bf16")
    parser.add_argument("--long-context", action="store_true", help="a decode step at 1M tokens of context")
    parser.add_argument("--long-context-batch", type=int, default=1, help="sequences in the 1M-token decode step")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 8 64 128)")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode contexts (default 32768 131072)")
    parser.add_argument("--prefill-contexts", type=int, nargs="+", help="default 8192 32768 131072")
    parser.add_argument("--cache-dir", default="/tmp/dzc-bench-dsa-cache")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--public-kernels", metavar="DIR",
                        help="folder of the public TileLang DeepSeek-V3.2 example kernels run as baselines (default: "
                             ".public-kernels/deepseek_v32 at the repository root if it exists, made by "
                             "tools/fetch_public_kernels.sh)")
    parser.add_argument("--no-public-kernels", action="store_true", help="do not run the public TileLang kernels")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time CUDA graph replays of each call (GPU time without the host's launch work)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    global CUDA_GRAPHS
    CUDA_GRAPHS = args.cuda_graphs
    torch._dynamo.config.recompile_limit = 64
    bench = Bench(args)
    if args.dry_run:
        bench.plan()
        return
    if args.only in (None, "decode", "topk"):
        bench.decode()
    if args.only in (None, "prefill"):
        bench.prefill()
    if args.long_context or args.only == "long":
        bench.long_context()
    props = torch.cuda.get_device_properties(bench.device)
    meta = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, tilelang "
            f"{tilelang_codegen.VERSION}, python {platform.python_version()}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Profile {bench.target.profile.name}"
            f"{' (MUSA mp_22 rules: <= 8 warps, 72 KiB, BF16 indexer)' if args.musa_legal else ''}; "
            f"{'untuned defaults' if args.quick else 'autotuned'}"
            f"{'; times of CUDA graph replays' if args.cuda_graphs else ''}. Indexer: {'FP8' if bench.fp8 else 'BF16'} cache, "
            f"TB/s = cached-token bytes read per query row ÷ time, % of 4.8 TB/s. Top-k: time ÷ one read of the "
            f"fp32 logits at 4.8 TB/s. Sparse attention: useful FLOPs 2·H·topk·(Dqk+Dv) per query row, % of "
            f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s dense bf16; baselines: time (their time ÷ dzc's).")
    if bench.public is not None:
        meta += (f" Public TileLang example kernels ({bench.public.source}, {bench.public.folder}) on the same "
                 f"inputs: rows 'public TileLang …', with dzc's time ÷ theirs (< 1: dzc faster) and their output "
                 f"against dzc's op reference.")
    table = bench.table()
    print(meta)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(meta + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
