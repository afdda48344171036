"""Kernels for dzc.sparse_attention: attention of each query row over its top-k selected positions only.

The selected positions are gathered through the block table inside the kernels. Two variants, chosen per call
by the number of query rows (the report records which one each token bucket ran):
  prefill (rows > DECODE_MAX_ROWS): compute-bound. One program per (query row, block of BLOCK_H heads) runs an
      online softmax over all selected positions in tiles of BLOCK_N gathered rows. With one latent KV head
      (MLA/MQA: Dqk 576 = 512 + 64 rope, V = the first 512 columns of K) all BLOCK_H heads share each gathered
      tile: scores are one [BLOCK_H, Dqk] × [Dqk, BLOCK_N] MMA and the V tile is the K tile already loaded.
  decode (rows <= DECODE_MAX_ROWS): memory-bound, few programs. The selected positions are split across SPLITS
      programs per head block (split-K); each writes its normalised partial output and log-sum-exp, and a
      second kernel combines them. Workspace: SPLITS × rows × heads × (Dv + 1) fp32, nothing ∝ context.
MHA (Hkv = H) is supported with per-head gathers (no MMA); it is not the DSA shape.
FP8 latent cache (dzc.kv_cache's 656 B/token layout, FlashMLA's): the kernels load each gathered row's e4m3 NoPE
bytes and its fp32 scales (one per 128 values), dequantize value * scale to q's dtype in registers (what
dzc.kv_cache.dequantize_latent computes, the reference's oracle), load the bf16 RoPE part, then the same MMAs.
In TileLang only the warp-specialized kernel reads it (its producer dequantizes into shared memory): the untuned
choice where it fits (H200, 2026-12-03: 1.6x Triton's decode over that cache).

Tuning bucket: query rows, rounded up to a power of two.
"""

from __future__ import annotations

import functools
import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from dzc import ir, kv_cache
from dzc.ops import dsa as dsa_ops
from dzc.targets import dsa_cases, tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import config_problems, tilelang_config_legal
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

# Candidates never run on a GPU, (params, why): out of users' tuning (launch.tuning_candidates). None since
# session 40 (H100): BALANCED=1 passed its GPU numerics there.
UNVALIDATED = ()

# Query-row counts at or below this run the decode (split-K) kernels; above, the prefill kernel. 256 covers
# batch 128 × 2 queries per step (multi-token prediction).
DECODE_MAX_ROWS = 256


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class SparseAttentionSpec:
    heads: int
    kv_heads: int  # 1 (MLA/MQA latent) or heads (MHA)
    d_qk: int
    d_v: int
    dtype: torch.dtype  # q, k_cache, v_cache and out (FP8 cache: q, out and the dequantized rows)
    separate_v: bool  # v_cache given; otherwise V = K[..., :d_v]
    fp8_cache: bool = False  # k_cache is the uint8 FP8 latent layout (V = its dequantized NoPE part)
    # Selected slots per query row (indices' width) and the caches' rows per page, None where the graph has them
    # symbolic (a cache that grows a row a step, read as one page per sequence): the TileLang kernels are
    # specialised on both (their pipelined loop needs a static trip count), Triton's take them at run time.
    topk: int | None = field(kw_only=True)
    page_size: int | None = field(kw_only=True)
    # query_pos given: selected positions past the query's are skipped, and a local window (its size an argument
    # at run time) may be attended beside the selected set. sinks given: a per-head logit in each softmax's sum.
    causal: bool = field(default=False, kw_only=True)
    sinks: bool = field(default=False, kw_only=True)
    index_block: int = field(default=1, kw_only=True)  # consecutive positions one index selects (block-sparse)

    def serves(self, call: SparseAttentionSpec) -> bool:
        """Whether kernels made for this spec take a call of spec `call`: equal, sizes left symbolic aside."""
        return self == dataclasses.replace(call, topk=call.topk if self.topk is not None else None,
                                           page_size=call.page_size if self.page_size is not None else None)

    @property
    def shared_kv(self) -> bool:
        return self.kv_heads == 1

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        # Legality checks float dtypes (indices are int32 everywhere); the FP8 cache needs e4m3 conversions.
        return (self.dtype, torch.float32) + ((torch.float8_e4m3fn, kv_cache.ROPE_DTYPE) if self.fp8_cache else ())

    @property
    def fp8_groups(self) -> int:
        """fp32 scales per token of the FP8 latent layout (its NoPE part is d_main = d_v values)."""
        return self.d_main // kv_cache.FP8_LATENT_TILE if self.fp8_cache else 0

    @property
    def d_main(self) -> int:
        """The largest power of two in Dqk: the first MMA's K dimension (512 of MLA's 576)."""
        return 1 << (self.d_qk.bit_length() - 1)

    @property
    def d_tail(self) -> int:
        return self.d_qk - self.d_main

    @property
    def block_tail(self) -> int:
        """The rest of Dqk (MLA's 64 rope dims) padded to a power of two, at least 16 (an MMA's K)."""
        return max(16, _pow2_at_least(self.d_tail)) if self.d_tail else 0

    @property
    def v_is_k_main(self) -> bool:
        """V is exactly the gathered K tile's main part (MLA: d_v = 512 = d_main): no second load."""
        return self.shared_kv and not self.separate_v and self.d_v == self.d_main

    # Shared KV: the Triton kernels' P·V is an MMA whose V tile [BLOCK_N, BLOCK_DV] sits in shared memory with
    # BLOCK_DV contiguous. With rows narrower than 128 bytes there, Triton 3.6's Hopper wgmma reads outside the tile
    # (stale shared memory: NaN; past the allocation: illegal address; H200, D_V 16 fp16, fuzz seed 0 case 21), so
    # V is padded to 128-byte rows (loads and stores masked to D_V), and a K tile narrower than that is not reused
    # as V. The FP8 cache's V is its 512-wide NoPE part.
    @property
    def triton_v_is_k_main(self) -> bool:
        return self.v_is_k_main and (self.fp8_cache or self.d_main * self.dtype.itemsize >= 128)

    @property
    def block_dv(self) -> int:
        """The Triton kernels' V tile width."""
        narrowest = 128 // self.dtype.itemsize if self.shared_kv else 16
        return self.d_main if self.triton_v_is_k_main else max(narrowest, _pow2_at_least(self.d_v))

    def describe(self) -> str:
        values = "v_cache" if self.separate_v else f"K[..., :{self.d_v}]"
        cache = " cache=fp8 latent (e4m3 + fp32 scale per 128, bf16 rope)" if self.fp8_cache else ""
        return f"heads={self.heads} kv_heads={self.kv_heads} d_qk={self.d_qk} d_v={self.d_v} V={values} " \
               f"topk={self.topk} page_size={self.page_size} dtype={str(self.dtype).removeprefix('torch.')}{cache}" \
               f"{self.extras and ' ' + self.extras}"

    @property
    def extras(self) -> str:
        """The optional parts of the op this spec uses ('' for plain top-k attention)."""
        return " ".join(name for name, used in (("causal+window", self.causal), ("sinks", self.sinks),
                                                 (f"index_block={self.index_block}", self.index_block > 1)) if used)


def spec_for(q, k_cache, v_cache, indices, d_v, query_pos=None, sinks=None, index_block=1) -> SparseAttentionSpec:
    """The spec of a call (works on fake tensors; the op's checks ran already). The kernels also need the caches
    in q's dtype, or the FP8 latent layout (dequantized to q's dtype), whose NoPE part must be Dqk's power-of-two
    main part (MLA's 512 of 576: the kernels' first MMA)."""
    heads, d_qk = int(q.shape[1]), int(q.shape[2])  # not the token count: int() would specialise it
    fp8_cache = dsa_ops.is_fp8_latent_cache(k_cache)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache is not None and cache.dtype != q.dtype and not fp8_cache:
            raise ValueError(f"sparse_attention kernels read the caches in q's dtype: {name} is {cache.dtype}, "
                             f"q is {q.dtype}")
    spec = SparseAttentionSpec(heads, int(k_cache.shape[2]), d_qk, int(d_v), q.dtype, v_cache is not None, fp8_cache,
                               topk=_static(indices.shape[1]), page_size=_static(k_cache.shape[1]),
                               causal=query_pos is not None, sinks=sinks is not None, index_block=int(index_block))
    if fp8_cache and not spec.v_is_k_main:
        raise ValueError(f"sparse_attention kernels read an FP8 latent cache whose NoPE part is Dqk's power-of-two "
                         f"main part: d_v={d_v}, d_qk={d_qk}")
    return spec


def _static(size) -> int | None:
    """A size the graph fixes, or None for a symbolic one (int() would read its hint, not guard it)."""
    return int(size) if is_concrete_int(size) else None


def spec_from_node(node) -> SparseAttentionSpec:
    arguments = ir.call_arguments(node)

    def value(name):
        argument = arguments.get(name)
        return argument.meta["val"] if isinstance(argument, torch.fx.Node) else None

    return spec_for(value("q"), value("k_cache"), value("v_cache"), value("indices"), arguments["d_v"],
                    value("query_pos"), value("sinks"), arguments.get("index_block", 1))


def token_bucket(tokens: int) -> int:
    """`tokens` is the number of query rows; tuning results are kept per power of two of it."""
    return _pow2_at_least(tokens)


def variant_for_bucket(bucket: int) -> str:
    return "decode" if bucket <= DECODE_MAX_ROWS else "prefill"


def config_variant(config: KernelConfig) -> str:
    """SPLITS = 0: the prefill kernel; SPLITS >= 1: the decode kernels with that many splits."""
    return "decode" if config["SPLITS"] else "prefill"


def describe_config(config: KernelConfig) -> str:
    """What the report prints as the path a token bucket ran."""
    if config["SPLITS"]:
        return f"decode kernels (split-K over {config['SPLITS']} programs per head block, then combine)"
    return "prefill kernel (one program per query row and head block)"


def configs_for_bucket(spec: SparseAttentionSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """The configs of the variant that serves `bucket` (see targets/launch.py) and that variant's default: the
    family default (a prefill config) with _decode_splits for decode; there, at one split, the FP8 reader's CLUSTER=2
    twin where it is legal (H100, session 39, 64 x 2 rows, 32K context: 298 µs against 320; numerics passed)."""
    variant = variant_for_bucket(bucket)
    chosen = [c for c in configs if config_variant(c) == variant]
    if config_variant(default) != variant:
        splits = _decode_splits(spec, default, bucket) if variant == "decode" else 0
        default = KernelConfig.make(default.num_warps, default.num_stages, **{**dict(default.params), "SPLITS": splits})
        cluster = KernelConfig.make(default.num_warps, default.num_stages,
                                    **{**dict(default.params), "CLUSTER": _FP8_CLUSTER})
        if splits == 1 and dict(default.params).get("FP8_INTERLEAVED") and cluster in chosen:
            default = cluster
    return chosen, default


# Decode programs that keep a GPU busy without splitting: about one per SM of the largest targets (H200: 132).
DECODE_PROGRAMS_WITHOUT_SPLITS = 128


def _decode_splits(spec: SparseAttentionSpec, config: KernelConfig, bucket: int) -> int:
    """Splits of the untuned decode choice: none once query rows x head blocks give enough programs by themselves
    (H200, 64 sequences x 2 rows at 32K context, 64 x 64 tiles: 1 split 435 µs, 2 460, 4 523, 8 644;
    tools/diagnose_sparse_attention_configs.py), else (Triton) enough to make that many programs, at most one per
    BLOCK_N tile of the selected slots (H200, 1 sequence x 2 rows, top-k 2048: 4 splits, 8 programs, took 194 µs; 32
    splits 20 µs as a CUDA graph replay), or (TileLang) 4."""
    programs = bucket * -(-spec.heads // config["BLOCK_H"])
    if programs >= DECODE_PROGRAMS_WITHOUT_SPLITS:
        return 1
    if "NUM_STAGES" in dict(config.params) and not _warp_specialized(config):
        # TileLang's split kernel keeps its earlier default: more splits (each a pipelined loop of fewer tiles)
        # have not run on a GPU yet; Triton's have, at 32 splits of one tile.
        return 4
    splits = -(-DECODE_PROGRAMS_WITHOUT_SPLITS // programs)
    if spec.topk is not None:  # a symbolic top-k leaves the count uncapped (splits past the last tile find no slot)
        tiles = -(-(spec.topk * spec.index_block) // config["BLOCK_N"])
        # The warp-specialized kernel runs its tiles in pairs (its two-stage ring): at least a pair a split.
        splits = min(splits, max(tiles // 2 if _warp_specialized(config) else tiles, 1))
    return splits


def prepare(spec: SparseAttentionSpec, q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale,
            d_v, query_pos=None, sinks=None, window=0, index_block=1):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), query rows, the op's result)."""
    dsa_ops.check_sparse_attention_args(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, d_v,
                                        query_pos, sinks, window, index_block)
    if not spec.serves(spec_for(q, k_cache, v_cache, indices, d_v, query_pos, sinks, index_block)):
        raise ValueError(f"sparse_attention kernel for {spec.describe()} got q {q.dtype} {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, indices {tuple(indices.shape)}, d_v {d_v}")
    out = torch.empty(q.shape[0], spec.heads, spec.d_v, dtype=q.dtype, device=q.device)
    # exp2 in the kernels: fold log2(e) into the scale once.
    scale_log2 = float(sm_scale) * math.log2(math.e)
    values = v_cache if v_cache is not None else k_cache  # never read when V comes from K
    # The kernels index seq_lens and query_seq as dense vectors (a strided one was read at the wrong elements).
    seq_lens, query_seq = seq_lens.contiguous(), query_seq.contiguous()
    # Absent optional tensors: pointers the kernels never read (CAUSAL / HAS_SINKS are off).
    query_pos = query_pos.contiguous() if query_pos is not None else query_seq
    sinks = sinks.contiguous() if sinks is not None else seq_lens
    inputs = (q, k_cache, values, block_table, seq_lens, query_seq, indices, query_pos, sinks, int(window),
              scale_log2, spec)
    return inputs, (out,), q.shape[0], out


def _check_fp8_token_rows(k_cache) -> None:
    """The FP8 latent cache's tokens must be dense byte rows, 4-byte aligned: the kernels view them as e4m3, fp32
    and bf16."""
    if any(stride % kv_cache.SCALE_BYTES for stride in k_cache.stride()[:3]) or k_cache.stride(3) != 1 \
            or k_cache.storage_offset() % kv_cache.SCALE_BYTES:
        raise ValueError("sparse_attention: the FP8 latent cache's tokens must be dense byte rows, 4-byte aligned "
                         f"(got strides {k_cache.stride()}, offset {k_cache.storage_offset()})")


def fp8_cache_views(spec: SparseAttentionSpec, k_cache):
    """(e4m3 values, fp32 scales, bf16 rope) views of an FP8 latent cache for the kernels' typed loads, each based
    at its part of token 0 (dzc.kv_cache.fp8_latent_parts), so that a token's byte offset divided by the element
    size indexes all three; other caches: k_cache three times (never read as such)."""
    if not spec.fp8_cache:
        return k_cache, k_cache, k_cache
    _check_fp8_token_rows(k_cache)
    scale_at, rope_at = kv_cache.fp8_latent_parts(spec.d_main)
    return (k_cache.view(torch.float8_e4m3fn), k_cache[..., scale_at:rope_at].view(torch.float32),
            k_cache[..., rope_at:].view(kv_cache.ROPE_DTYPE))


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAMES = ("sparse_attention_kernel", "sparse_attention_split_kernel", "sparse_attention_combine_kernel")


def triton_source(spec: SparseAttentionSpec, profile: DeviceProfile) -> str:
    fields = dict(profile=profile.name, heads=spec.heads, kv_heads=spec.kv_heads, d_qk=spec.d_qk,
                  d_qk_main=spec.d_main, d_qk_tail=spec.d_tail, d_v=spec.d_v, dtype=spec.dtype,
                  value_source="v_cache" if spec.separate_v else f"K[..., :{spec.d_v}]",
                  cache_layout="FP8 latent (e4m3 + fp32 scale per 128, bf16 rope)" if spec.fp8_cache else "dense",
                  extras=f"with {spec.extras}" if spec.extras else "no window, sinks or index blocks")
    return Template((TEMPLATES / "sparse_attention.triton.py.tmpl").read_text()).substitute(fields)


def _attend_constexprs(spec: SparseAttentionSpec, config: KernelConfig, mma_in_fp32: bool) -> dict:
    return dict(HEADS=spec.heads, BLOCK_H=config["BLOCK_H"], SHARED_KV=spec.shared_kv, D_MAIN=spec.d_main,
                D_TAIL=spec.d_tail, BLOCK_TAIL=spec.block_tail, D_V=spec.d_v, BLOCK_DV=spec.block_dv,
                V_IS_K_MAIN=spec.triton_v_is_k_main, V_FROM_K=not spec.separate_v, BLOCK_N=config["BLOCK_N"],
                FP8_GROUPS=spec.fp8_groups, MMA_IN_FP32=mma_in_fp32, CAUSAL=spec.causal, INDEX_BLOCK=spec.index_block,
                # fp32 caches multiply in full precision (Triton's default for fp32 operands is TF32).
                DOT_PRECISION="ieee" if spec.dtype == torch.float32 else "tf32")


def _combine_constexprs(spec: SparseAttentionSpec, config: KernelConfig) -> dict:
    return dict(D_V=spec.d_v, BLOCK_DV=spec.block_dv, BLOCK_SPLITS=_pow2_at_least(config["SPLITS"]),
                HAS_SINKS=spec.sinks)


def triton_configs(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Heads per program × gathered rows per tile × warps × stages, for the prefill kernel (SPLITS = 0) and the
    decode kernels (SPLITS >= 1). The fp32 accumulator [BLOCK_H, Dv] is kept at most 128 values per thread."""
    if spec.shared_kv:
        head_blocks = [h for h in (16, 32, 64) if h <= max(16, _pow2_at_least(spec.heads))]
        row_blocks, warp_counts = (16, 32, 64), (4, 8)
    else:
        head_blocks, row_blocks, warp_counts = (1, 2, 4), (16, 32), (2, 4)
    configs = []
    for splits in (0, 1, 2, 4, 8, 16, 32):
        for block_h in head_blocks:
            for block_n in row_blocks:
                for num_warps in warp_counts:
                    if block_h * spec.block_dv > 128 * num_warps * profile.warp_size:
                        continue
                    for num_stages in ((1, 2) if spec.shared_kv else (1,)):
                        configs.append(KernelConfig.make(num_warps=num_warps, num_stages=num_stages, SPLITS=splits,
                                                         BLOCK_H=block_h, BLOCK_N=block_n))
    return configs


def triton_default_config(spec: SparseAttentionSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned prefill choice (the decode default is the same tile with the splits of _decode_splits), legal on
    `profile`: the most heads per program, the most gathered rows per tile, pipelined if that fits, the fewest
    warps that hold the accumulator. On the H200 (MLA, 4096 query rows at 8K context) 64 heads x 64 rows with 2
    stages took 10.7 ms, the previous choice (64 x 32, 1 stage) 21.4 ms, every smaller tile more
    (tools/diagnose_sparse_attention_configs.py)."""
    legal = [c for c in triton_configs(spec, profile) if c["SPLITS"] == 0
             and not config_problems(profile, threads=c.num_warps * profile.warp_size, num_warps=c.num_warps,
                                     shared_memory_bytes=triton_shared_memory_bytes(spec, c), dtypes=spec.dtypes)]
    if not legal:
        raise ValueError(f"no legal Triton sparse_attention config for {spec.describe()} on {profile.name}")
    return max(legal, key=lambda c: (c["BLOCK_H"], c["BLOCK_N"], c.num_stages, -c.num_warps))


def triton_shared_memory_bytes(spec: SparseAttentionSpec, config: KernelConfig) -> int:
    """Upper estimate. Shared KV: the q tile, one gathered K tile (and V tile when separate) per stage and the
    probabilities tile, or the fp32 output tile if larger. MHA: the cross-warp reduction scratch of the per-head
    sums."""
    item = spec.dtype.itemsize
    block_h, block_n = config["BLOCK_H"], config["BLOCK_N"]
    width = spec.d_main + spec.block_tail
    if not spec.shared_kv:
        return 4 * block_h * block_n * config.num_warps
    v_tile = 0 if spec.triton_v_is_k_main else block_n * spec.block_dv * item
    if spec.fp8_cache:
        # The dequantized K operand, and the loaded bytes (e4m3, scales, bf16 rope) of the stages ahead: the loads
        # go through registers to be converted (sm_90: ld.global.v4, no cp.async; 189696 B at 64 x 64, 2 stages).
        loaded = block_n * (spec.d_main + 4 * spec.fp8_groups + spec.block_tail * kv_cache.ROPE_DTYPE.itemsize)
        gathered = (config.num_stages - 1) * loaded + block_n * width * item
    else:
        gathered = config.num_stages * (block_n * width * item + v_tile)
    operands = block_h * width * item + gathered + block_h * block_n * item
    # The decode kernel's fp32 partial output goes through shared memory on its way to global memory.
    return max(operands, block_h * spec.block_dv * 4)


def triton_launch(kernels, config: KernelConfig, q, k_cache, v_cache, block_table, seq_lens, query_seq, indices,
                  query_pos, sinks, window, scale_log2, spec, out):
    """kernels: TRITON_KERNEL_NAMES -> @triton.jit. v_cache is k_cache itself when V comes from K (not read)."""
    rows, topk = indices.shape
    page_size = k_cache.shape[1]
    head_blocks = -(-spec.heads // config["BLOCK_H"])
    k_values, k_scales, k_rope = fp8_cache_views(spec, k_cache)
    common = (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              k_cache.stride(3), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
              block_table.stride(0), block_table.stride(1), indices.stride(0), indices.stride(1))
    constexprs = _attend_constexprs(spec, config, triton_codegen.interpreting())
    splits = config["SPLITS"]
    if splits == 0:
        kernels["sparse_attention_kernel"][(rows, head_blocks)](
            q, k_values, k_scales, k_rope, v_cache, block_table, seq_lens, query_seq, indices, query_pos, sinks, out,
            topk, window, page_size, scale_log2, *common, out.stride(0), out.stride(1), out.stride(2), **constexprs,
            HAS_SINKS=spec.sinks, num_warps=config.num_warps, num_stages=config.num_stages)
        return
    # Decode: each split covers a whole number of BLOCK_N tiles of the selected and window slots.
    per_split = -(-(-(-(topk * spec.index_block + window) // splits)) // config["BLOCK_N"]) * config["BLOCK_N"]
    partial = torch.empty(splits, rows, spec.heads, spec.d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, rows, spec.heads, dtype=torch.float32, device=q.device)
    kernels["sparse_attention_split_kernel"][(rows, head_blocks, splits)](
        q, k_values, k_scales, k_rope, v_cache, block_table, seq_lens, query_seq, indices, query_pos, partial, lse,
        topk, window, page_size, scale_log2, per_split, *common, partial.stride(0), partial.stride(1),
        partial.stride(2), lse.stride(0), lse.stride(1),
        **constexprs, num_warps=config.num_warps, num_stages=config.num_stages)
    kernels["sparse_attention_combine_kernel"][(rows, spec.heads)](
        partial, lse, sinks, out, splits, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), out.stride(2), **_combine_constexprs(spec, config),
        num_warps=4)


_TL_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_STRIDES = ("stride_qt", "stride_qh", "stride_qd", "stride_kp", "stride_ks", "stride_kh", "stride_kd", "stride_vp",
            "stride_vs", "stride_vh", "stride_vd", "stride_bt_seq", "stride_bt_page", "stride_it", "stride_ii")


def triton_signatures(spec: SparseAttentionSpec, config: KernelConfig) -> dict[str, tuple[dict, dict, int]]:
    """Kernel name -> (signature, constexprs, num_warps) of every kernel `config` launches, for compiling them
    ahead of time with triton.compile (no GPU needed)."""
    dtype = "*" + _TL_TYPES[spec.dtype]
    k_types = ("*fp8e4nv", "*fp32", "*bf16", "*u8") if spec.fp8_cache else (dtype,) * 4
    tensors = {"q_ptr": dtype, **dict(zip(("k_ptr", "k_scale_ptr", "k_rope_ptr", "v_ptr"), k_types)),
               "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_seq_ptr": "*i32", "indices_ptr": "*i32",
               "query_pos_ptr": "*i32"}
    sinks = "*fp32" if spec.sinks else "*i32"  # seq_lens stands in for absent sinks (never read)
    attend = _attend_constexprs(spec, config, mma_in_fp32=False)
    strides = {name: "i32" for name in _STRIDES}
    if config["SPLITS"] == 0:
        prefill = {**attend, "HAS_SINKS": spec.sinks}
        signature = {**tensors, "sinks_ptr": sinks, "out_ptr": dtype, "topk": "i32", "window": "i32",
                     "page_size": "i32", "scale_log2": "fp32", **strides, "stride_ot": "i32", "stride_oh": "i32",
                     "stride_od": "i32", **{name: "constexpr" for name in prefill}}
        return {"sparse_attention_kernel": (signature, prefill, config.num_warps)}
    as_constexpr = {name: "constexpr" for name in attend}
    split = {**tensors, "partial_ptr": "*fp32", "lse_ptr": "*fp32", "topk": "i32", "window": "i32",
             "page_size": "i32", "scale_log2": "fp32", "per_split": "i32", **strides,
             **{name: "i32" for name in ("stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt")},
             **as_constexpr}
    combine_constexprs = _combine_constexprs(spec, config)
    combine = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "sinks_ptr": sinks, "out_ptr": dtype, "splits": "i32",
               **{name: "i32" for name in ("stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt",
                                           "stride_ot", "stride_oh", "stride_od")},
               **{name: "constexpr" for name in combine_constexprs}}
    return {"sparse_attention_split_kernel": (split, attend, config.num_warps),
            "sparse_attention_combine_kernel": (combine, combine_constexprs, 4)}


def selftest_cases(profile: DeviceProfile):
    """Named small cases for dzc-selftest: MLA-shaped (one latent KV head, V = K[..., :d_v], Dqk = 64 + 16 rope)
    in decode (few rows: split-K kernels) and prefill (more than DECODE_MAX_ROWS rows), and MHA with a separate
    v_cache; invalid indices and rows with none valid in each."""
    mla = dict(heads=16, kv_heads=1, d_qk=80, d_v=64, separate_v=False)
    mha = dict(heads=4, kv_heads=4, d_qk=64, d_v=64, separate_v=True)
    cases = [
        ("mla-decode", functools.partial(_build_case, seq_lens=[37, 200, 5], per_seq=[1, 2, 1], **mla)),
        ("mla-prefill", functools.partial(_build_case, seq_lens=[300, 200], per_seq=[150, 150], **mla)),
        ("mha-decode", functools.partial(_build_case, seq_lens=[37, 100], per_seq=[2, 1], **mha)),
    ]
    if profile.supports_dtype(torch.float8_e4m3fn):  # the FP8 latent cache: one 128-value scale tile + 16 rope
        cases.append(("mla-fp8-decode", functools.partial(
            _build_case, seq_lens=[37, 200, 5], per_seq=[1, 2, 1], heads=16, kv_heads=1, d_qk=144, d_v=128,
            separate_v=False, fp8_cache=True)))
    return cases


def _build_case(device, generator, *, seq_lens, per_seq, heads, kv_heads, d_qk, d_v, separate_v, fp8_cache=False):
    return dsa_cases.sparse_attention_args(seq_lens, per_seq, heads, kv_heads, d_qk, d_v, separate_v, topk=16,
                                           page_size=16, device=device, generator=generator, fp8_cache=fp8_cache)


# ---------------------------------------------------------------------------------------------------------
# TileLang
#
# The same two variants: build(block_h, block_n, splits=0, ...) is the prefill kernel; splits >= 1 the decode
# split kernel, and part=1 (derived by tilelang_launch, never tuned) the kernel that combines its splits.

TILELANG_FACTORY_NAME = "build"

_TILELANG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# An MMA's K and N step: every Dqk part and Dv must be whole steps (no padding in the TileLang kernels).
_TILELANG_MMA_STEP = 16


def tilelang_source(spec: SparseAttentionSpec, profile: DeviceProfile) -> str:
    d_v_cache = spec.d_v if spec.separate_v else spec.d_qk
    fields = dict(profile=profile.name, spec=spec.describe(), heads=spec.heads, kv_heads=spec.kv_heads,
                  d_main=spec.d_main, d_tail=spec.d_tail, d_v=spec.d_v, d_v_cache=d_v_cache,
                  v_is_k_main=spec.v_is_k_main, separate_v=spec.separate_v, topk=spec.topk,
                  page_size=spec.page_size, tl_dtype=_TILELANG_DTYPES[spec.dtype], fp8_cache=spec.fp8_cache,
                  k_cache_last=spec.d_qk, k_cache_dtype=_TILELANG_DTYPES[spec.dtype], v_cache_last=d_v_cache,
                  v_cache_dtype=_TILELANG_DTYPES[spec.dtype], fp8_group=kv_cache.FP8_LATENT_TILE, fp8_scale_at=0,
                  fp8_rope_at=0, pass_configs=repr(tilelang_codegen.fast_math_pass_configs(profile)))
    if spec.fp8_cache:  # the cache's bytes as e4m3 (k_cache) and as bf16 (v_cache): tilelang_launch's views
        token_bytes = kv_cache.fp8_latent_token_bytes(spec.d_main, spec.d_tail)
        scale_at, rope_at = kv_cache.fp8_latent_parts(spec.d_main)
        half = kv_cache.ROPE_DTYPE.itemsize  # v_cache's element: the bytes as bf16
        fields.update(k_cache_last=token_bytes, k_cache_dtype="float8_e4m3", v_cache_last=token_bytes // half,
                      v_cache_dtype="bfloat16", fp8_scale_at=scale_at // half, fp8_rope_at=rope_at // half)
    return Template((TEMPLATES / "sparse_attention.tilelang.py.tmpl").read_text()).substitute(fields)


def tilelang_configs(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Heads per block × gathered rows per tile × threads × pipeline stages, for the prefill kernel (SPLITS = 0)
    and the decode split kernel (SPLITS >= 1); none when a Dqk part or Dv is not whole MMA steps. The fp32
    accumulator [BLOCK_H, Dv] is kept at most 128 values per thread. Already pruned to what is legal on
    `profile`."""
    if spec.topk is None or spec.page_size is None:
        return []  # the kernels are specialised on both (Triton serves symbolic ones)
    if spec.extras:
        return []  # no window, sinks or index blocks in the TileLang template yet (Triton serves them)
    if spec.fp8_cache:  # only the warp-specialized kernel reads the FP8 latent cache (dequantizing in its producer)
        return _warp_specialized_configs(spec, profile) if _fp8_reader_fits(spec) else []
    if any(d % _TILELANG_MMA_STEP for d in (spec.d_main, spec.d_tail, spec.d_v)):
        return []
    head_blocks = [h for h in (16, 32, 64) if h <= max(16, _pow2_at_least(spec.heads))] if spec.shared_kv else [16]
    configs = []
    # Every TileLang config is a separate compile (tens of seconds): a small space, splits {0 (prefill), 2, 8}.
    for splits in (0, 2, 8):
        for block_h in head_blocks:
            for block_n in (32, 64):
                threads = _tilelang_threads(spec, block_h, block_n)
                if threads is None or threads % profile.warp_size:
                    continue
                for stages in (1, 2):
                    config = KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=stages,
                                               SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, THREADS=threads,
                                               NUM_STAGES=stages)
                    if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config),
                                             spec.dtypes):
                        configs.append(config)
    # Only the most heads per block that fits: fewer heads per block gather the same rows again.
    most_heads = max((c["BLOCK_H"] for c in configs), default=0)
    return [c for c in configs if c["BLOCK_H"] == most_heads] + _warp_specialized_configs(spec, profile)


def _warp_specialized_configs(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Prefill, then decode with 1 split (enough programs at 64+ rows) up to 16 (a 2-row step on 132 SMs), where
    the warp-specialized kernel fits (none otherwise)."""
    if not _warp_specialization_fits(spec, profile):
        return []
    configs = []
    # FP8 cache: the producer's interleaved column order (FP8_INTERLEAVED=1, its shared-memory stores free of bank
    # conflicts; the untuned choice) beside the plain order (a tuning candidate). bf16 cache: the producer's copies
    # addressed from one base a row (ROW_ADDRESS=1, a tuning candidate: 439 SASS instructions a stage pair in its
    # loop against 681; timed in tilelang_default_config) beside the page/slot addressing.
    # FP8 cache with 128+ heads on a target with clusters: CLUSTER=2 beside the interleaved order (FlashMLA's
    # crossover: the two head blocks of a row dequantize half a tile each and copy it into each other's shared
    # memory; numerics passed on an H100 in session 39, the untuned decode choice at one split: configs_for_bucket;
    # fp8_cluster_problems says where it is not offered).
    if spec.fp8_cache:
        variants = ({}, {"FP8_INTERLEAVED": 1}) if spec.d_main % 64 == 0 and kv_cache.FP8_LATENT_TILE % 64 == 0 \
            else ({},)
        if not fp8_cluster_problems(spec, profile):
            variants += ({"FP8_INTERLEAVED": 1, "CLUSTER": _FP8_CLUSTER},)
    else:
        variants = ({}, {"ROW_ADDRESS": 1})
        # BALANCED=1 (a tuning candidate: no faster than the untuned kernel at prefill, session 40): FlashMLA's
        # consumer split, each consumer warpgroup the
        # score GEMM and softmax of its own tile of a pair and half of both tiles' P V (balanced_problems: where not).
        if not balanced_problems(spec, profile):
            variants += ({"BALANCED": 1},)
    for extra in variants:
        for splits in (0, 1, 4, 16):
            config = KernelConfig.make(num_warps=_WS_THREADS // profile.warp_size, num_stages=2, SPLITS=splits,
                                       BLOCK_H=_WS_BLOCK, BLOCK_N=_WS_BLOCK, THREADS=_WS_THREADS, NUM_STAGES=2,
                                       WARP_SPECIALIZED=1, **extra)
            if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                configs.append(config)
    return configs


_FP8_CLUSTER = 2  # CTAs a cluster of the FP8 crossover: the two 64-head blocks of one query row


def fp8_cluster_problems(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[str]:
    """Why the warp-specialized kernel's CLUSTER=2 (the FP8 latent cache's two-CTA crossover; see the template) does
    not apply to `spec` on `profile`; empty where it is offered."""
    problems = []
    if not spec.fp8_cache:
        problems.append("CLUSTER=2 shares dequantized FP8 latent rows between head blocks: the cache is not FP8 "
                        "(a bf16 cache's rows are copied as they are, nothing to share)")
    elif not (_fp8_reader_fits(spec) and spec.d_main % 64 == 0 and kv_cache.FP8_LATENT_TILE % 64 == 0):
        problems.append("CLUSTER=2 extends the interleaved FP8 reader (FP8_INTERLEAVED=1), which does not fit "
                        f"{spec.describe()}")
    if spec.heads % (_FP8_CLUSTER * _WS_BLOCK):
        problems.append(f"CLUSTER=2 pairs the two {_WS_BLOCK}-head blocks of a query row: {spec.heads} heads is not a "
                        f"multiple of {_FP8_CLUSTER * _WS_BLOCK}")
    if not _warp_specialization_fits(spec, profile):
        problems.append(f"CLUSTER=2 is a variant of the warp-specialized kernel, which does not fit {spec.describe()} "
                        f"on {profile.name}")
    if not profile.thread_block_clusters:
        problems.append(f"CLUSTER=2 needs thread block clusters (DSMEM copies, remote mbarriers): {profile.name} "
                        "has none")
    return problems


def balanced_problems(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[str]:
    """Why the warp-specialized kernel's BALANCED=1 (FlashMLA's consumer split: consumer c computes S and the softmax
    of stage c of every pair, both take half of both tiles' P V; see the template) does not apply to `spec` on
    `profile`; empty where it is offered."""
    problems = []
    if spec.fp8_cache:
        problems.append("BALANCED=1 is written for the bf16 cache: the FP8 reader's producer (its dequantization) is "
                        "that kernel's limit (s25-ncu), not the consumers")
    if spec.d_tail != _WS_BLOCK:
        problems.append(f"BALANCED=1 keeps each tile's P [{_WS_BLOCK} heads, {_WS_BLOCK} rows] in the tile's own RoPE "
                        f"columns (read by S, free after it): Dqk - Dv = {spec.d_tail} is not {_WS_BLOCK}, and a "
                        "separate P pair (16 KiB) would not fit beside Q and the 2-stage ring")
    if not _warp_specialization_fits(spec, profile):
        problems.append(f"BALANCED=1 is a variant of the warp-specialized kernel, which does not fit {spec.describe()} "
                        f"on {profile.name}")
    return problems


def _fp8_reader_fits(spec: SparseAttentionSpec) -> bool:
    """The warp-specialized producer's FP8 reader: each of a row's 8 threads dequantizes D_main / 8 values within
    one scale group and copies 16 bytes of bf16 RoPE (DeepSeek-V3.2's 512 + 64) as they are, so q's dtype (the
    shared tile's) must be the RoPE's."""
    per_thread = spec.d_main // 8
    return (spec.dtype == kv_cache.ROPE_DTYPE and per_thread % 16 == 0
            and kv_cache.FP8_LATENT_TILE % per_thread == 0 and spec.d_tail * kv_cache.ROPE_DTYPE.itemsize == 8 * 16)


# The warp-specialized kernel (the template's _warp_specialized): 64 heads x 64 gathered rows, three warpgroups.
_WS_BLOCK = 64
_WS_THREADS = 384
_WS_MIN_HEADS = 16


def _warp_specialization_fits(spec: SparseAttentionSpec, profile: DeviceProfile) -> bool:
    """The warp-specialized kernel's shapes: MLA (one latent KV head, V = the gathered K tile's main part), 16-bit,
    at least 16 heads (blocks of 64, one warpgroup MMA's M; a tensor-parallel rank's 16 or 32 heads pad one block
    with zero rows, at most 4x the MMA work of its real heads), Dqk in whole 64-column gathers, each half of Dv
    whole MMA steps; on a target with warpgroup MMAs, TMA and mbarriers (its wgmma, tma_copy and barriers)."""
    return (profile.matrix_instruction == "wgmma" and profile.bulk_tensor_copies and spec.v_is_k_main
            and spec.dtype in (torch.bfloat16, torch.float16) and spec.heads >= _WS_MIN_HEADS
            and spec.d_qk % 64 == 0 and spec.d_v % (2 * _TILELANG_MMA_STEP) == 0)


def _warp_specialized(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("WARP_SPECIALIZED", 0))


def _tilelang_threads(spec: SparseAttentionSpec, block_h: int, block_n: int) -> int | None:
    """Threads of a TileLang block: the most of (256 for 32+ heads a block, else 128; then half) for which T.gemm
    gives each 32-lane warp whole 16×8 pieces of both MMAs, scores [BLOCK_H, BLOCK_N] and output [BLOCK_H, Dv]
    (a small Dv, 16, has too few for 4 warps), and the fp32 accumulator [BLOCK_H, Dv] stays within 128 values a
    thread; None if neither."""
    for threads in ((128, 64) if block_h == 16 else (256, 128)):
        pieces = (block_h // 16) * min(block_n // 8, spec.d_v // 8)
        if threads // 32 <= pieces and block_h * spec.d_v <= 128 * threads:
            return threads
    return None


def tilelang_default_config(spec: SparseAttentionSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned prefill choice: the largest tile, with its gathers pipelined a stage ahead where that fits (the
    space has one head-block size)."""
    prefill = [c for c in tilelang_configs(spec, profile) if c["SPLITS"] == 0]
    if not prefill:
        raise ValueError(f"no legal TileLang sparse_attention config for {spec.describe()} on {profile.name}")
    # A padded head block (fewer than 64 heads a block; its numerics passed on the H200, not timed yet) is a tuning
    # candidate only (the tuner drops a candidate whose outputs disagree with the untuned default's), not the
    # untuned choice. The FP8 reader's interleaved order is the choice where it fits: on the H200 (64 x 2 rows,
    # 32K context, 1 split) 325 µs against 356 for the plain order (s25-ncu, 2026-12-04; numerics passed in s23-2).
    # ROW_ADDRESS (the bf16 producer's row-based copy addresses: at the 128-head prefill 0.97x the untuned kernel on
    # the H200, session 34, 1.03x on an H100, session 46; 1.01x at decode on that H100: which is faster depends on
    # the card, so the tuner decides) and BALANCED (FlashMLA's consumer split: 4659 µs against the untuned kernel's
    # 4629 at the 128-head prefill on an H100, session 40) are tuning candidates; CLUSTER (the FP8 reader's two-CTA
    # crossover) was timed at decode only (configs_for_bucket).
    verified = spec.heads % _WS_BLOCK == 0
    return max(prefill, key=lambda c: (_warp_specialized(c) and verified, dict(c.params).get("FP8_INTERLEAVED", 0),
                                       not dict(c.params).get("ROW_ADDRESS", 0), not dict(c.params).get("CLUSTER", 0),
                                       not dict(c.params).get("BALANCED", 0), c["BLOCK_N"], c["NUM_STAGES"]))


def tilelang_shared_memory_bytes(spec: SparseAttentionSpec, config: KernelConfig) -> int:
    """The q tile, one gathered K (and V, unless V is K's main part) tile per pipeline stage, the probabilities;
    the warp-specialized kernel adds its valid flags, two fp32 vectors (factor, row sums) and 8 mbarriers; BALANCED
    has no P tile (each P in its tile's RoPE columns) but the two consumers' maxima of two pairs and partial sums
    and 2 more mbarriers."""
    item = spec.dtype.itemsize
    block_h, block_n = config["BLOCK_H"], config["BLOCK_N"]
    gathered = block_n * (spec.d_qk + (0 if spec.v_is_k_main else spec.d_v)) * item
    tiles = block_h * spec.d_qk * item + config["NUM_STAGES"] * gathered + block_h * block_n * item
    if _warp_specialized(config):
        tiles += config["NUM_STAGES"] * block_n + 2 * 4 * block_h + 8 * 8
        if dict(config.params).get("BALANCED"):
            tiles += -block_h * block_n * item + (2 * 2 + 2) * 4 * block_h + 2 * 8
    return tiles


def tilelang_launch_arguments(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, scale_log2, out, lse
                              ) -> tilelang_codegen.LaunchArguments:
    """What tilelang_launch calls the attention kernel with: the seven inputs, out (the splits' fp32 partials when
    it splits), lse, scale_log2. The kernel is compiled for dense tensors at 16-byte-aligned bases and vectorises
    on both, so other inputs are copied (a dense cache, as dzc's paged cache is, passes as it is; one cache serving
    as keys and values is copied once), and such an output is computed into a temporary that is copied back."""
    return tilelang_codegen.launch_arguments((q, k_cache, v_cache, block_table, seq_lens, query_seq, indices),
                                             (out, lse), (scale_log2,))


def _tilelang_fp8_views(k_cache):
    """The FP8 latent cache's bytes as e4m3 and as bf16 (views of its memory, for the warp-specialized kernel's
    typed loads)."""
    _check_fp8_token_rows(k_cache)
    return k_cache.view(torch.float8_e4m3fn), k_cache.view(kv_cache.ROPE_DTYPE)


def tilelang_launched_configs(config: KernelConfig) -> list[KernelConfig]:
    """The factory configs tilelang_launch compiles for `config`: the attention kernel's, then the combine's (PART=1)
    where it splits."""
    if config["SPLITS"] == 1 and _warp_specialized(config):
        # One split is the whole selection: the prefill kernel writes the output itself (no fp32 partial to write
        # and combine; at 64 sequences x 2 rows that is 33 MB each way).
        return [KernelConfig.make(config.num_warps, config.num_stages, **{**dict(config.params), "SPLITS": 0})]
    if config["SPLITS"] == 0:
        return [config]
    return [config, KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), PART=1)]


def tilelang_prebuilt_configs(spec: SparseAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """What tilelang_codegen.load starts building ahead: the untuned choice of every token bucket (prefill's first,
    then each decode bucket's: their splits differ with the rows), as tilelang_launch compiles them. Without the
    decode ones, a model's first decode step built its kernel and combine in-process (30-60 s each on the H200)."""
    configs, default = tilelang_configs(spec, profile), tilelang_default_config(spec, profile)
    buckets = [2 * DECODE_MAX_ROWS] + [1 << n for n in range(DECODE_MAX_ROWS.bit_length())]
    chosen = []
    for bucket in buckets:
        for config in tilelang_launched_configs(configs_for_bucket(spec, profile, bucket, configs, default)[1]):
            if config not in chosen:
                chosen.append(config)
    return chosen


def tilelang_launch(compiled, config: KernelConfig, q, k_cache, v_cache, block_table, seq_lens, query_seq, indices,
                    query_pos, sinks, window, scale_log2, spec, out):
    """`compiled` is tilelang_codegen's KernelsByConfig (see tilelang_launch_arguments). Its specs have no window
    or sinks (tilelang_configs): query_pos, sinks and window are the absent ones' stand-ins."""
    rows = q.shape[0]
    if spec.fp8_cache:  # the template's k_cache / v_cache: the cache's bytes as e4m3 and as bf16
        k_cache, v_cache = _tilelang_fp8_views(k_cache)
    attention, *combine = tilelang_launched_configs(config)
    splits = attention["SPLITS"]
    kernel = compiled.kernel_for(attention)
    inputs = (q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, scale_log2)
    if splits == 0:
        no_lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
        arguments = tilelang_launch_arguments(*inputs, out, no_lse)
        arguments.launch(kernel)
        return
    partial = torch.empty(splits, rows, spec.heads, spec.d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, rows, spec.heads, dtype=torch.float32, device=q.device)
    kernel(*tilelang_launch_arguments(*inputs, partial, lse).arguments)  # fresh partials: nothing to copy back
    arguments = tilelang_codegen.launch_arguments((partial, lse), (out,))
    arguments.launch(compiled.kernel_for(combine[0]))
