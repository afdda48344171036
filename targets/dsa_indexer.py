"""Kernels for dzc.dsa_indexer: the lightning indexer's logits over a paged key cache, FP8 or BF16.

logits[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · k[s]) for the keys each query may see (causal, inside its
sequence), −inf for the rest of the [T, max_context] output. One program scores ROWS query rows against
BLOCKS_PER_PROGRAM·BLOCK_N key positions: the rows' heads form the M dimension of one MMA per gathered key tile
(FP8 × FP8 where the cache holds FP8 values with a per-token fp32 scale, BF16 × BF16 otherwise).

Decode is memory-bound: 132 bytes per cached token for the FP8 layout (Di = 128 values + a 4-byte scale), read
once per query row. Prefill is compute-bound; key blocks above every row's causal limit are skipped.

TileLang (targets/templates/dsa_indexer.tilelang.py.tmpl; issue 14): the same logits with the keys as the MMA's M
dimension and ROWS query rows' heads as its N (wgmma, FP8 e4m3 × e4m3 on Hopper), the key tiles gathered through
the block table by cp.async in a pipelined loop, the ReLU × weight × head sum over the accumulator's columns, the
FP8 scale applied after it; the context is split over programs at launch (span_tiles) so that decode fills the GPU.
Only specs the template takes get TileLang configs (tilelang_supports), so lowering picks Triton for the others.
PREFERRED_CODEGENS keeps Triton first for this op until the H200 run has checked and timed the TileLang kernel.

Tuning bucket: query rows × max_context (the number of logits), rounded up to a power of two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc import kv_cache
from dzc.ops import dsa as dsa_ops
from dzc.targets import dsa_cases, tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import tilelang_config_legal, warp_specialization_problems as profile_ws_problems
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

# Candidates never run on a GPU, (params, why): out of users' tuning (launch.tuning_candidates).
# (The warp-specialized FP8 prefill's numerics passed on an H100 in session 39.)
UNVALIDATED = ()

_TL_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                     torch.float8_e4m3fn: "*fp8e4nv"}


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class DsaIndexerSpec:
    """Everything a kernel is specialised on; tokens, context, page size and page count are run-time values."""

    heads: int
    head_dim: int
    q_dtype: torch.dtype  # the MMA dtype: the cache's; with the FP8 cache float8_e4m3fn or a float q (see spec_for)
    fp8: bool  # the cache is the uint8 FP8 layout (e4m3 values, then one fp32 scale per token, per page)

    @property
    def key_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8 else self.q_dtype

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.q_dtype, self.key_dtype, torch.float32)

    @property
    def block_heads(self) -> int:
        return max(16, _pow2_at_least(self.heads))  # tl.dot needs M >= 16

    @property
    def block_dim(self) -> int:
        return max(32 if self.fp8 else 16, _pow2_at_least(self.head_dim))  # an MMA's K: >= 32 for fp8

    def bytes_per_token(self) -> int:
        """Cache bytes read per key: Di values (+ the fp32 scale in the FP8 layout)."""
        return self.head_dim * self.key_dtype.itemsize + (kv_cache.SCALE_BYTES if self.fp8 else 0)

    def describe(self) -> str:
        cache = "fp8 values + fp32 scale per token" if self.fp8 else str(self.key_dtype).removeprefix("torch.")
        return f"heads={self.heads} head_dim={self.head_dim} q={str(self.q_dtype).removeprefix('torch.')} " \
               f"cache={cache}"


def spec_for(q: torch.Tensor, index_k_cache: torch.Tensor) -> DsaIndexerSpec:
    """The spec of a call (works on fake tensors). The op's checks ran already. With the FP8 layout q is either
    float8_e4m3fn (FP8 x FP8 MMA, q's scales folded into the weights, as DeepSeek's inference code quantizes it)
    or a float q as the model computed it (bf16 upstream): the e4m3 keys are then widened to q's dtype in
    registers (exactly) and multiplied in it, reading the same 132 bytes per token. A bf16/fp16/fp32 cache needs
    q in its own dtype."""
    _, heads, head_dim = q.shape
    fp8 = index_k_cache.dtype == torch.uint8
    if not fp8 and q.dtype != index_k_cache.dtype:
        raise ValueError(f"dsa_indexer kernels multiply q and keys in one dtype: a {index_k_cache.dtype} key cache "
                         f"needs a {index_k_cache.dtype} q, got {q.dtype}")
    return DsaIndexerSpec(int(heads), int(head_dim), q.dtype, fp8)


def spec_from_node(node) -> DsaIndexerSpec:
    return spec_for(node.args[0].meta["val"], node.args[2].meta["val"])


def token_bucket(tokens: int) -> int:
    """`tokens` is query rows × max_context; tuning results are kept per power of two of it."""
    return _pow2_at_least(tokens)


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAME = "dsa_indexer_kernel"


def triton_source(spec: DsaIndexerSpec, profile: DeviceProfile) -> str:
    fields = dict(profile=profile.name, spec=spec.describe())
    return Template((TEMPLATES / "dsa_indexer.triton.py.tmpl").read_text()).substitute(fields)


def _constexprs(spec: DsaIndexerSpec, config: KernelConfig, mma_in_fp32: bool) -> dict:
    return dict(HEADS=spec.heads, BLOCK_H=spec.block_heads, HEAD_DIM=spec.head_dim, BLOCK_D=spec.block_dim,
                FP8=spec.fp8, MMA_IN_FP32=mma_in_fp32,
                # fp32 caches multiply in full precision (Triton's default for fp32 operands is TF32).
                DOT_PRECISION="ieee" if spec.q_dtype == torch.float32 else "tf32",
                ROWS=config["ROWS"], BLOCK_N=config["BLOCK_N"],
                BLOCKS_PER_PROGRAM=config["BLOCKS_PER_PROGRAM"])


def triton_configs(spec: DsaIndexerSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Query rows per program (rows × heads is the MMA's M, at most 256) × keys per tile × tiles per program
    (more tiles amortise loading q) × warps × pipeline stages: at most 48 configs, each its own compile."""
    configs = []
    for rows in (1, 2, 4):
        if rows * spec.block_heads > 256 and rows > 1:
            continue
        for block_n in (64, 128):
            for blocks in (4, 16):
                for num_warps in (4, 8):
                    for num_stages in (2, 3):
                        configs.append(KernelConfig.make(num_warps=num_warps, num_stages=num_stages, ROWS=rows,
                                                         BLOCK_N=block_n, BLOCKS_PER_PROGRAM=blocks))
    return configs


def triton_default_config(spec: DsaIndexerSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: one row, 64-key tiles, 4 tiles per program, 4 warps."""
    return KernelConfig.make(num_warps=4, num_stages=2, ROWS=1, BLOCK_N=64, BLOCKS_PER_PROGRAM=4)


def triton_shared_memory_bytes(spec: DsaIndexerSpec, config: KernelConfig) -> int:
    """Upper estimate: the q tile, one key tile per pipeline stage, and the fp32 score tile when the head sum
    converts its layout through shared memory."""
    key_item, q_item = spec.key_dtype.itemsize, spec.q_dtype.itemsize
    m = config["ROWS"] * spec.block_heads
    # FP8 keys multiplied in q's wider dtype are staged as loaded, then stored widened as the MMA operand.
    widened = config["BLOCK_N"] * spec.block_dim * q_item if q_item != key_item else 0
    return (m * spec.block_dim * q_item + config.num_stages * config["BLOCK_N"] * spec.block_dim * key_item
            + widened + m * config["BLOCK_N"] * 4)


def triton_launch(kernel, config: KernelConfig, q, weights, k_values, k_scales, block_table, seq_lens, query_seq,
                  query_pos, page_size, max_context, spec, logits):
    """k_values: [pages, page_size, Di] (bf16, or fp8 viewed from the uint8 pages); k_scales: fp32 [pages,
    page_size] view of the FP8 layout's scales (k_values itself for bf16, never read)."""
    rows = q.shape[0]
    span = config["BLOCK_N"] * config["BLOCKS_PER_PROGRAM"]
    grid = (-(-rows // config["ROWS"]), -(-max_context // span))
    kernel[grid](q, weights, k_values, k_scales, block_table, seq_lens, query_seq, query_pos, logits,
                 rows, max_context, page_size,
                 q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
                 k_values.stride(0), k_values.stride(1), k_values.stride(2), k_scales.stride(0), k_scales.stride(1),
                 block_table.stride(0), block_table.stride(1), logits.stride(0), logits.stride(1),
                 **_constexprs(spec, config, triton_codegen.interpreting()),
                 num_warps=config.num_warps, num_stages=config.num_stages)


def triton_signature(spec: DsaIndexerSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed)."""
    q_type = _TL_POINTER_TYPES[spec.q_dtype]
    k_type = _TL_POINTER_TYPES[spec.key_dtype]
    signature = {
        "q_ptr": q_type, "weights_ptr": "*fp32", "k_ptr": k_type, "k_scale_ptr": "*fp32" if spec.fp8 else q_type,
        "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_seq_ptr": "*i32", "query_pos_ptr": "*i32",
        "logits_ptr": "*fp32", "n_rows": "i32", "max_context": "i32", "page_size": "i32",
    }
    for name in ("stride_qt", "stride_qh", "stride_qd", "stride_wt", "stride_wh", "stride_kp", "stride_ks",
                 "stride_kd", "stride_sp", "stride_ss", "stride_bt_seq", "stride_bt_page", "stride_lt",
                 "stride_ls"):
        signature[name] = "i32"
    constexprs = _constexprs(spec, config, mma_in_fp32=False)
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs


# ---------------------------------------------------------------------------------------------------------
# TileLang

TILELANG_FACTORY_NAME = "build"
_TILELANG_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# (threads, keys per tile, query rows, tiles per chunk, programs a multiprocessor): 16 keys a warp along M (wgmma:
# 64 a warpgroup), rows·heads ≤ 256 along N (one wgmma), at most 128 fp32 accumulators a thread. A chunk is the
# template's pipelined loop (a static trip count): the pipeline drains at its end, and a span is a whole number of
# chunks. 128 × 64 × 2 in chunks of 8 is the untuned choice: on the H200 (FP8 cache) it was 1.18x faster than 256 ×
# 128 × 2 in chunks of 4 at decode (64 sequences x 2 rows, 32K: 166 against 196 µs, two programs a multiprocessor
# against one: ptxas gives both ~228 registers a thread) and 1.13x on a 1024-row prefill chunk of an 8K context; at
# one sequence the smaller chunks of 256 × 128 × 2 win (8 against 11 µs: more, shorter programs), so it stays a
# candidate (docs/results/dsa_indexer_tilelang_h200.md, session 29). Its twin that asks for three programs a
# multiprocessor (160 registers, no spills for sm_90a) is a candidate not yet timed. 512 × 256 × 2 is the shape of
# the public TileLang fp8_lighting_indexer (4 warpgroups of 64 keys against 2 rows' heads).
TILELANG_SHAPES = ((128, 64, 2, 8, 1), (128, 64, 2, 8, 3), (256, 128, 2, 4, 1), (256, 128, 4, 4, 1),
                   (128, 64, 4, 4, 1), (512, 256, 2, 4, 1))
TILELANG_STAGES = (2, 3)
TILELANG_DEFAULT = (128, 64, 2, 8, 3)  # threads, keys per tile, rows, chunk, stages (no MIN_BLOCKS asked)
# The untuned choice of small launches (configs_for_bucket): below SMALL_LAUNCH_BUCKET query rows × keys. Measured
# at 2^16 (one sequence × 2 rows × 32K: this one 8.0 µs, TILELANG_DEFAULT 11.0) and 2^22 (64 sequences: 196
# against 166 µs); the crossover between them is not measured yet (diagnose_dsa_indexer_configs.py's decode-16
# shape is 2^20).
TILELANG_SMALL_LAUNCH_DEFAULT = (256, 128, 2, 4, 2)
SMALL_LAUNCH_BUCKET = 1 << 20
# Programs a launch aims for (per multiprocessor), and the fewest key tiles a program takes when decode splits
# the context: more programs fill the GPU, fewer reload q and the weights less often.
_PROGRAMS_PER_SM = 4
_MIN_TILES_PER_PROGRAM = 2


def tilelang_supports(spec: DsaIndexerSpec) -> bool:
    """The TileLang kernel multiplies q and keys in one dtype on the tensor cores: an e4m3 q against the FP8 cache
    (FP8 × FP8 MMA) or a bf16/fp16 q against a cache of the same dtype. Other specs are Triton's: the FP8 cache
    against a float q (the keys would be widened in shared memory: not written), fp32 caches (the op multiplies them
    in full precision, not TF32). The heads fill the MMA's N dimension with the rows: heads a multiple of 16 up
    to 256; Di a multiple of 32 (an fp8 MMA's K step) up to 256."""
    if spec.fp8 != (spec.q_dtype == torch.float8_e4m3fn) or spec.key_dtype not in _TILELANG_DTYPES:
        return False
    return spec.heads % 16 == 0 and spec.heads <= 256 and spec.head_dim % 32 == 0 and spec.head_dim <= 256


def tilelang_source(spec: DsaIndexerSpec, profile: DeviceProfile) -> str:
    if not tilelang_supports(spec):
        raise ValueError(f"no TileLang dsa_indexer kernel for {spec.describe()} (Triton serves it)")
    scale_param = ('k_scales: T.StridedTensor((pages, page_size), (scale_page_stride, 1), "float32"),'
                   if spec.fp8 else "")
    return Template((TEMPLATES / "dsa_indexer.tilelang.py.tmpl").read_text()).substitute(
        profile=profile.name, spec=spec.describe(), heads=spec.heads, head_dim=spec.head_dim,
        q_dtype=_TILELANG_DTYPES[spec.q_dtype], k_dtype=_TILELANG_DTYPES[spec.key_dtype], fp8=spec.fp8,
        scale_param=scale_param)


def tilelang_configs(spec: DsaIndexerSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Shapes × pipeline stages, pruned to what the template takes and `profile` allows (threads, shared memory,
    the cache's dtype). A spec the template does not take (tilelang_supports) gets none, so lowering picks
    Triton for it."""
    if not tilelang_supports(spec):
        return []
    configs = []
    for threads, block_n, rows, chunk, min_blocks in TILELANG_SHAPES:
        if rows * spec.heads > 256 or block_n * rows * spec.heads // threads > 128 or threads % profile.warp_size:
            continue
        for stages in TILELANG_STAGES:
            config = KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=stages, THREADS=threads,
                                       BLOCK_N=block_n, ROWS=rows, STAGES=stages, CHUNK=chunk,
                                       # (only where asked: the other configs keep their tuning-database names)
                                       **({"MIN_BLOCKS": min_blocks} if min_blocks > 1 else {}))
            if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                configs.append(config)
    return configs + _warp_specialized_configs(spec, profile)


# WARP_SPECIALIZED=1 (the template's _warp_specialized; a tuning candidate, never the untuned choice: it has not run
# on a GPU): a producer warpgroup gathers 64-key tiles and their scales into a ring of WS_STAGES stages by cp.async,
# completing an mbarrier a stage, and two consumer warpgroups take the tiles in turn (one wgmma of 64 keys × 2 rows'
# heads each; while one waits for its MMA the other runs its ReLU × weight × head-sum epilogue), with setmaxnreg
# moving registers from the producer to the consumers; no pipeline chunks (CHUNK only rounds the decode split).
# For prefill, where the untuned kernel is latency-bound (docs/results/dsa_indexer_tilelang_h200.md). Its THREADS
# are the two consumer warpgroups (the MMA shape, as the 256-thread configs'; the launch adds the producer's 128:
# num_warps 12), its BLOCK_N the 128 keys of a tile pair (one 64-key tile a consumer; a ring stage holds one tile).
WS_THREADS = 256
WS_LAUNCH_THREADS = WS_THREADS + 128
WS_BLOCK_N = 128
# Query rows a program: 2 (the MMA's N 128) and 4 (N 256: a key tile serves twice the rows, so the producer's copies
# and a tile's barrier, fence and MMA wait come half as often for the same FLOPs; ptxas fits both in the consumers'
# 216 registers without spilling).
WS_ROWS = (2, 4)
WS_STAGES = (4,)
WS_CHUNK = 1


def warp_specialization_problems(spec: DsaIndexerSpec, profile: DeviceProfile) -> list[str]:
    """Why WARP_SPECIALIZED=1 is not offered for `spec` on `profile`; empty where it is."""
    problems = []
    if not tilelang_supports(spec):
        problems.append(f"no TileLang dsa_indexer kernel for {spec.describe()}")
    elif not spec.fp8:
        problems.append("WARP_SPECIALIZED=1 is written for the FP8 cache (e4m3 x e4m3 wgmma, one fp32 scale a key): "
                        f"{spec.describe()}")
    if min(WS_ROWS) * spec.heads > 256:
        problems.append(f"WARP_SPECIALIZED=1 puts {min(WS_ROWS)} or more rows' heads on one wgmma's N (at most "
                        f"256): {spec.heads} heads")
    if spec.head_dim % 128:
        problems.append(f"WARP_SPECIALIZED=1's producer copies a key in 16-byte pieces by 8 threads: head_dim "
                        f"{spec.head_dim} is not 128 (or a multiple)")
    return problems + profile_ws_problems(profile, "WARP_SPECIALIZED=1")


def _warp_specialized_configs(spec: DsaIndexerSpec, profile: DeviceProfile) -> list[KernelConfig]:
    if warp_specialization_problems(spec, profile):
        return []
    configs = []
    for rows in WS_ROWS:
        for stages in WS_STAGES:
            if rows * spec.heads > 256:
                continue
            config = KernelConfig.make(num_warps=WS_LAUNCH_THREADS // profile.warp_size, num_stages=stages,
                                       THREADS=WS_THREADS, BLOCK_N=WS_BLOCK_N, ROWS=rows, STAGES=stages,
                                       CHUNK=WS_CHUNK, WARP_SPECIALIZED=1)
            if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                configs.append(config)
    return configs


def warp_specialized(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("WARP_SPECIALIZED", 0))


def tilelang_default_config(spec: DsaIndexerSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: TILELANG_DEFAULT (128 threads, 64-key tiles, 2 rows, chunks of 8 tiles, 3 stages), else the
    first legal config."""
    configs = tilelang_configs(spec, profile)
    if not configs:
        raise ValueError(f"no legal TileLang dsa_indexer config for {spec.describe()} on {profile.name}")
    return _with_shape(configs, TILELANG_DEFAULT) or configs[0]


def _with_shape(configs: list[KernelConfig], shape: tuple) -> KernelConfig | None:
    """The config of `configs` with (threads, keys per tile, rows, chunk, stages) == shape and no MIN_BLOCKS ask."""
    return next((c for c in configs if "MIN_BLOCKS" not in dict(c.params) and not warp_specialized(c)
                 and (c["THREADS"], c["BLOCK_N"], c["ROWS"], c["CHUNK"], c["STAGES"]) == shape), None)


def configs_for_bucket(spec: DsaIndexerSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """Every config is a candidate at every size. TileLang's untuned choice for a launch of fewer than
    SMALL_LAUNCH_BUCKET rows × keys (a few sequences' decode: fewer programs than multiprocessors, so each
    program's latency is the launch's) is TILELANG_SMALL_LAUNCH_DEFAULT where legal, whose shorter chunks give
    shorter programs; Triton's is its default."""
    if "THREADS" not in dict(default.params) or bucket >= SMALL_LAUNCH_BUCKET:
        return configs, default
    return configs, _with_shape(configs, TILELANG_SMALL_LAUNCH_DEFAULT) or default


def tilelang_prebuilt_configs(spec: DsaIndexerSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """What tilelang_codegen.load starts building ahead: the untuned choices of large and small launches
    (configs_for_bucket; a few sequences' decode is a small launch, whose kernel was otherwise built in-process
    at its first call)."""
    default = tilelang_default_config(spec, profile)
    small = _with_shape(tilelang_configs(spec, profile), TILELANG_SMALL_LAUNCH_DEFAULT)
    return [default, *([small] if small is not None and small != default else [])]


def tilelang_kernel_configs(spec: DsaIndexerSpec, config: KernelConfig) -> dict[str, KernelConfig]:
    """The factory config the launch compiles for `config` over DeepSeek's 64-token pages (dzc-selftest's lowering
    check: the launch adds the cache's own page size, PAGE_SIZE)."""
    return {TILELANG_FACTORY_NAME: KernelConfig.make(num_warps=config.num_warps, num_stages=config.num_stages,
                                                     **dict(config.params), PAGE_SIZE=kv_cache.PAGE_SIZE)}


def tilelang_shared_memory_bytes(spec: DsaIndexerSpec, config: KernelConfig) -> int:
    """q's tile (rows·heads × Di), one key tile and its scales per stage, the per-row scalars, and the head sum's
    cross-thread scratch (at most one fp32 per accumulator column), each rounded up to 16 bytes as TileLang
    places them, plus 1 KiB for the pipeline's barriers and alignment."""
    m, block_n, stages = config["ROWS"] * spec.heads, config["BLOCK_N"], config["STAGES"]
    sizes = (m * spec.head_dim * spec.q_dtype.itemsize, stages * block_n * spec.head_dim * spec.key_dtype.itemsize,
             stages * block_n * 4, *(4 * config["ROWS"],) * 5, block_n * config["ROWS"] * 4)
    if warp_specialized(config):  # a ring stage holds one consumer's tile (half of BLOCK_N); 2 · STAGES mbarriers
        sizes = (m * spec.head_dim * spec.q_dtype.itemsize, stages * block_n // 2 * spec.head_dim,
                 stages * block_n // 2 * 4, *(4 * config["ROWS"],) * 5, 2 * stages * 8)
    return sum(-(-size // 16) * 16 for size in sizes) + 1024


@functools.cache
def _multiprocessors_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def span_tiles(rows: int, max_context: int, config: KernelConfig, multiprocessors: int) -> int:
    """Key tiles a program covers: the whole context when the row blocks alone fill the GPU (prefill), else the
    context split over enough programs (decode), at least _MIN_TILES_PER_PROGRAM tiles each, in whole chunks."""
    row_blocks = max(1, -(-rows // config["ROWS"]))
    context_tiles = max(1, -(-max_context // config["BLOCK_N"]))
    splits = max(1, -(-_PROGRAMS_PER_SM * multiprocessors // row_blocks))
    tiles = min(context_tiles, max(_MIN_TILES_PER_PROGRAM, -(-context_tiles // splits)))
    return -(-tiles // config["CHUNK"]) * config["CHUNK"]  # whole chunks (the template's pipelined loop)


def tilelang_launch(compiled, config: KernelConfig, q, weights, k_values, k_scales, block_table, seq_lens,
                    query_seq, query_pos, page_size, max_context, spec, logits):
    """The Triton launch's arguments. The cache views go to the kernel as they are (strided views of the pages,
    which TileLang takes as declared: a copy would move the whole pool); the kernel is compiled per page size
    (PAGE_SIZE added to the config). `compiled` is what tilelang_codegen.load returns."""
    rows = q.shape[0]
    if rows == 0 or max_context == 0:
        return
    values_stride = (k_values.stride(0), k_values.stride(1), k_values.stride(2))
    expected = (page_size * (spec.head_dim + kv_cache.SCALE_BYTES) if spec.fp8 else page_size * spec.head_dim,
                spec.head_dim, 1)
    if values_stride != expected or k_values.data_ptr() % tilelang_codegen.ALIGNMENT:
        raise ValueError(f"dsa_indexer[tilelang]: the cache's pages must be dense and 16-byte aligned (value strides "
                         f"{values_stride}, expected {expected})")
    device = q.device
    tiles = span_tiles(rows, max_context, config,
                       _multiprocessors_cached(device.index if device.index is not None else
                                               torch.cuda.current_device()) if device.type == "cuda" else 1)
    kernel = compiled.kernel_for(KernelConfig.make(num_warps=config.num_warps, num_stages=config.num_stages,
                                                   **dict(config.params), PAGE_SIZE=page_size))
    small = tilelang_codegen.launch_arguments((q, weights), ())
    tables = tilelang_codegen.launch_arguments((block_table, seq_lens, query_seq, query_pos), (logits,))
    caches = (k_values, k_scales) if spec.fp8 else (k_values,)
    kernel(*small.arguments, *caches, *tables.arguments, tiles)
    tables.finish()


def cache_views(spec: DsaIndexerSpec, index_k_cache: torch.Tensor):
    """(page_size, values [pages, page_size, Di], scales [pages, page_size]) of a key cache, as views.

    FP8 layout: dzc.kv_cache.split_fp8_index_pages (the one definition of it). Other layouts: `scales` is the
    cache itself (the kernel never reads it)."""
    if not spec.fp8:
        return index_k_cache.shape[1], index_k_cache, index_k_cache
    if index_k_cache.stride(1) != 1 or index_k_cache.stride(0) % kv_cache.SCALE_BYTES \
            or index_k_cache.storage_offset() % kv_cache.SCALE_BYTES:
        raise ValueError("dsa_indexer: the FP8 key cache's pages must be dense byte rows, 4-byte aligned "
                         f"(got strides {index_k_cache.stride()}, offset {index_k_cache.storage_offset()})")
    values, scales = kv_cache.split_fp8_index_pages(index_k_cache, spec.head_dim)
    return values.shape[1], values, scales


def prepare(spec: DsaIndexerSpec, q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
            max_context, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), logits count, the op's result)."""
    dsa_ops.check_dsa_indexer_args(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos)
    if spec_for(q, index_k_cache) != spec:
        raise ValueError(f"dsa_indexer kernel for {spec.describe()} got q {q.dtype} {tuple(q.shape)} and cache "
                         f"{index_k_cache.dtype} {tuple(index_k_cache.shape)}")
    rows = q.shape[0]
    page_size, values, scales = cache_views(spec, index_k_cache)
    max_context = int(max_context)
    logits = torch.empty(rows, max_context, dtype=torch.float32, device=q.device)
    # The kernel indexes seq_lens, query_seq and query_pos as dense vectors (strided ones were read at the wrong
    # elements).
    seq_lens, query_seq, query_pos = seq_lens.contiguous(), query_seq.contiguous(), query_pos.contiguous()
    inputs = (q, weights, values, scales, block_table, seq_lens, query_seq, query_pos, page_size, max_context, spec)
    return inputs, (logits,), rows * max_context, logits


# dzc-selftest's fp32 tolerance for the logits: Hopper's FP8 MMA accumulates with fewer than fp32's bits, and
# logits sum ±hundreds over heads; a wrong key or a missed mask is off by far more.
SELFTEST_TOLERANCES = {torch.float32: (5e-2, 1e-3)}


def selftest_cases(profile: DeviceProfile):
    """Named small cases for dzc-selftest: (name, build(device, generator) -> the op's arguments). Ragged batches
    in shuffled pages; decode (1-2 queries per sequence) and prefill chunks; FP8 only where the profile has it."""
    layouts = [("bf16", False, True)]
    if profile.supports_dtype(torch.float8_e4m3fn):  # FP8 cache with an FP8 q, and with the model's bf16 q
        layouts += [("fp8", True, True), ("fp8-bf16q", True, False)]
    cases = []
    for name, fp8, fp8_q in layouts:
        for shape, per_seq in (("decode", [1, 2, 1]), ("prefill", [4, 6, 2])):
            cases.append((f"{shape}-{name}", functools.partial(
                _build_case, seq_lens=[37, 200, 5], per_seq=per_seq, fp8=fp8, fp8_q=fp8_q)))
    return cases


def _build_case(device, generator, *, seq_lens, per_seq, fp8, fp8_q):
    return dsa_cases.indexer_args(seq_lens, per_seq, heads=8, head_dim=64, fp8=fp8, page_size=16, device=device,
                                  generator=generator, fp8_q=fp8_q)
