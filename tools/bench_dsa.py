"""Benchmark dzc's DeepSeek Sparse Attention kernels (indexer, top-k, sparse attention) on a CUDA GPU, with the
eager dense-masked attention, torch.compile of it and torch.topk as baselines in the same run.

    python tools/bench_dsa.py [--quick] [--musa-legal] [--out results.md] [--codegens triton tilelang]
                              [--fp8-cache] [--long-context [--only long]]

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
dzc.kv_cache's layout; Triton only, the TileLang template has no FP8 reader); the dense baselines run on its
dequantized bf16 rows. --long-context: one decode step at 1M tokens of context (batch --long-context-batch, 2 query
rows each): each kernel, then the whole step (indexer -> top-k -> sparse attention on its indices) timed, with
its peak memory above the caches and in total.

Every kernel is checked against its dzc op reference (rows of the first sequence) before it is timed. Kernels run
through dzc's lowering (lower_op: the path a compiled graph takes) with autotuning (tuning database in
--cache-dir; --quick uses the untuned defaults). Times: medians of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from dzc import kv_cache
from dzc.lowering import Execution
from dzc.ops.dsa import dsa_indexer_reference, dsa_topk_reference, sparse_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import TARGETS, Target, tilelang_codegen
from dzc.targets import sparse_attention as attention_family
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet (measured copy: ~4.3e12)
PEAK_BF16_FLOPS = 790e12  # H200 dense bf16, the best measured GEMM (989e12 datasheet)
PAGE_SIZE = 64
INDEX_HEADS, INDEX_DIM = 64, 128
HEADS, D_QK, D_V = 128, 576, 512
TOPK = 2048
# Query rows of the first sequence whose outputs are checked against the op references before timing.
CHECK_ROWS = 2
LONG_CONTEXT = 1 << 20  # --long-context: a decode step at 1M tokens
# Baselines materialise fp32 scores [queries, heads, context]: skipped above this many bytes of scores.
BASELINE_SCORE_BYTES = 20 << 30


def _time(fn) -> float:
    with torch.no_grad():
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

    def options(self, codegen="auto"):
        return CompileOptions(cache_dir=self.args.cache_dir, autotune=not self.args.quick, codegen=codegen)

    def kernel(self, op, args, codegen="auto"):
        record, _ = lower_op(op, args, self.target, self.options(codegen), Execution(self.target.runtime))
        overload = getattr(torch.ops.dzc, op)
        return (lambda: overload(*args, kernel_id=record.kernel_id)), record

    def indexer_and_topk(self, problem: Problem, label: str):
        args = problem.indexer_args()
        run, record = self.kernel("dsa_indexer", args)
        logits = run()
        _check(f"indexer {label}", logits[:problem.check_rows],
               dsa_indexer_reference(*problem.first_sequence(args, (0, 1, 5, 6))))
        seconds = _time(run)
        token_bytes = INDEX_DIM + 4 if problem.fp8_index else 2 * INDEX_DIM
        read = problem.rows * problem.context * token_bytes
        bandwidth = read / seconds
        self.rows.append(dict(kernel="dsa_indexer", shape=label, us=seconds * 1e6,
                              metric=f"{bandwidth / 1e12:.2f} TB/s ({100 * bandwidth / PEAK_BYTES_PER_S:.0f}%)",
                              baseline="", config=_tuned(record)))
        lengths = (problem.query_pos + 1).to(torch.int32)
        topk_args = (logits, lengths, TOPK)
        run, record = self.kernel("dsa_topk", topk_args)
        rows = problem.check_rows
        _check(f"topk {label}", run()[:rows], dsa_topk_reference(logits[:rows], lengths[:rows], TOPK), exact=True)
        seconds = _time(run)
        baseline = _time(lambda: torch.topk(logits, TOPK, dim=-1))
        floor = logits.numel() * 4 / PEAK_BYTES_PER_S
        self.rows.append(dict(kernel="dsa_topk", shape=label, us=seconds * 1e6,
                              metric=f"{seconds / floor:.1f}× one read",
                              baseline=f"torch.topk {baseline * 1e6:.0f} µs = {baseline / floor:.1f}× one read "
                                       f"(dzc {baseline / seconds:.1f}× faster)", config=_tuned(record)))

    def sparse_attention(self, problem: Problem, label: str):
        args = problem.attention_args()
        flops = 2 * HEADS * TOPK * (D_QK + D_V) * problem.rows
        baseline = self.dense_baselines(problem)
        for codegen in self.args.codegens:
            if problem.fp8_latent and codegen == "tilelang":
                continue  # no FP8 latent reader in the TileLang template
            run, record = self.kernel("sparse_attention", args, codegen)
            out = run()
            _check(f"sparse_attention[{codegen}] {label}", out[:problem.check_rows],
                   sparse_attention_reference(*problem.first_sequence(args, (0, 5, 6))))
            seconds = _time(run)
            versus = ", ".join(f"{name} {t * 1e6:.0f} µs ({t / seconds:.1f}×)" for name, t in baseline.items())
            self.rows.append(dict(kernel=f"sparse_attention[{codegen}]", shape=label, us=seconds * 1e6,
                                  metric=f"{flops / seconds / 1e12:.0f} TFLOP/s "
                                         f"({100 * flops / seconds / PEAK_BF16_FLOPS:.0f}%)",
                                  baseline=versus, config=_tuned(record)))

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
        batches = (1, 64) if self.args.quick else self.args.batches
        contexts = (32768,) if self.args.quick else self.args.contexts
        return [(batch, queries, context) for context in contexts for batch in batches
                for queries in ((2,) if self.args.quick else (1, 2))]

    def prefill_contexts(self) -> tuple[int, ...]:
        return (8192,) if self.args.quick else tuple(self.args.prefill_contexts)

    def plan(self):
        """--dry-run: every problem built on the meta device (shapes, no memory), its sparse-attention spec and
        legal configs on the profile: everything up to the first launch."""
        meta = torch.device("meta")
        shapes = self.decode_shapes() if self.args.only in (None, "decode") else []
        shapes += [(1, 4096, c) for c in self.prefill_contexts()] if self.args.only in (None, "prefill") else []
        if self.args.long_context or self.args.only == "long":
            shapes.append((self.args.long_context_batch, 2, LONG_CONTEXT))
        for batch, queries, context in shapes:
            problem = Problem(batch, queries, context, self.fp8, meta, self.args.fp8_cache and queries <= 2)
            args = problem.attention_args()
            spec = attention_family.spec_for(args[0], args[1], None, D_V)
            legal, _ = legal_configs(attention_family, "triton", spec, self.target.profile)
            print(f"dry run: B={batch} q={queries} ctx={context}: {spec.describe()}, {len(legal)} legal Triton configs "
                  f"on {self.target.profile.name}")

    def decode(self):
        for batch, queries, context in self.decode_shapes():
            torch.manual_seed(batch * 1000 + queries + context)
            problem = Problem(batch, queries, context, self.fp8, self.device, self.args.fp8_cache)
            label = f"decode B={batch} q={queries} ctx={context // 1024}K{' fp8-latent' if self.args.fp8_cache else ''}"
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            self.indexer_and_topk(problem, label)
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
        self.rows.append(dict(kernel="indexer -> top-k -> sparse_attention", shape=label, us=seconds * 1e6,
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
            self.sparse_attention(problem, label)
            del problem
            torch.cuda.empty_cache()

    def indexer_and_topk_prefill_row(self, problem, label, seconds, peak, chunk):
        causal_pairs = sum(int(p) + 1 for p in problem.query_pos.tolist())
        flops = 2 * INDEX_HEADS * INDEX_DIM * causal_pairs
        self.rows.append(dict(kernel="dsa_indexer+dsa_topk (chunked)", shape=label, us=seconds * 1e6,
                              metric=f"{flops / seconds / 1e12:.0f} indexer TFLOP/s (causal)",
                              baseline=f"logits peak {peak / 2**20:.0f} MiB (chunks of {chunk} rows)", config=""))

    def table(self) -> str:
        lines = ["| kernel | shape | µs | achieved | baselines | config |", "|---|---|---|---|---|---|"]
        for row in self.rows:
            lines.append(f"| {row['kernel']} | {row['shape']} | {row['us']:.1f} | {row['metric']} | "
                         f"{row['baseline']} | {row['config']} |")
        return "\n".join(lines)



def _tuned(record) -> str:
    return "; ".join(f"≤{bucket}: {entry['config']}" + (f" [{entry['path'].split(' (')[0]}]" if "path" in entry
                                                          else "")
                     for bucket, entry in sorted(record.tuned.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a subset (decode B in {1, 64}, 2 queries, 32K; prefill at 8K), untuned defaults")
    parser.add_argument("--musa-legal", action="store_true", help="only configs legal on MUSA mp_22, BF16 indexer")
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"],
                        help="code generators for sparse attention")
    parser.add_argument("--no-baselines", action="store_true", help="skip the dense-masked attention baselines")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="query rows per indexer/top-k chunk")
    parser.add_argument("--only", choices=["decode", "prefill", "long"],
                        help="run one part (the full run is long); long: only the --long-context row")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="decode rows over the FP8 latent cache (656 B/token) instead of bf16")
    parser.add_argument("--long-context", action="store_true", help="a decode step at 1M tokens of context")
    parser.add_argument("--long-context-batch", type=int, default=1, help="sequences in the 1M-token decode step")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128], help="decode batch sizes")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="decode contexts")
    parser.add_argument("--prefill-contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--cache-dir", default="/tmp/dzc-bench-dsa-cache")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the arguments, build what needs no device, print the plan")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    bench = Bench(args)
    if args.dry_run:
        bench.plan()
        return
    if args.only in (None, "decode"):
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
            f"{'untuned defaults' if args.quick else 'autotuned'}. Indexer: {'FP8' if bench.fp8 else 'BF16'} cache, "
            f"TB/s = cached-token bytes read per query row ÷ time, % of 4.8 TB/s. Top-k: time ÷ one read of the "
            f"fp32 logits at 4.8 TB/s. Sparse attention: useful FLOPs 2·H·topk·(Dqk+Dv) per query row, % of "
            f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s dense bf16; baselines: time (their time ÷ dzc's).")
    table = bench.table()
    print(meta)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(meta + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
