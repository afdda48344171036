"""Kernels for dzc.mxfp4_moe: routing, the two expert GEMMs on MXFP4 weights, and the weighted combine.

One call runs (routing and combine in targets/mxfp4_moe_routing.py, GEMMs in the generated module):
    route (count, schedule, scatter; one launch at decode) -> gate/up GEMM with the activation fused -> down GEMM
    with the routing weight fused, one fp32 row per (token, slot) pair -> combine (out[t] = sum over slots, in slot
    order: deterministic, where atomic adds into out would not be)
on one of two paths, chosen per token bucket (a config parameter, WORKSPACE, so the tuner can also measure it):
  online dequant (default for decode): weights stay packed; each GEMM decodes its tiles in registers (W4A16).
  workspace (prefill, Triton only): the activated experts' weights are dequantized once into one per-device
      buffer, shared by every layer, and both GEMMs read plain bf16 tiles. It moves ~4.8x the weight bytes, so it
      only pays when each expert has enough rows that decoding the same tile again for every row block costs more.
TileLang runs the online path for bf16 and fp16 activations; it multiplies bf16 x bf16 only (its fp32 GEMM is
TF32), so fp16 activations enter as 2 stacked bf16 terms, which hold them exactly (fp32: Triton, see
tilelang_supports).
W4A8 (the dzc.mxfp4_moe_w4a8 op, profiles with native FP8; Triton): the activations are converted to E4M3 (one scale
per 128 columns) once per call and both GEMMs multiply FP8 tiles (configs with FP8=1). The weights are converted
once per call into the workspace (WORKSPACE=1, the untuned choice: measured), or inside the GEMMs from the packed
bytes (WORKSPACE=0, the online W4A8 path: a byte-permute lookup per word, no conversion kernel and no workspace;
tuning candidates, not yet timed). Either way W4A8 is for prefill: at decode sizes the op is W4A16
(dzc.ops.mxfp4_moe.fp8_applies: fewer than 128 rows per expert; converting every activated expert per call made
W4A8 6.7x slower than W4A16 at 64 tokens of gpt-oss-120b on the H200, 7628 vs 1142 us, 2026-12-01): the launch
follows the call's token count, and the tier of a decode bucket is W4A16's online one (FP8=0); the report's path
per token bucket says which ran. The two are not mixed in one tier: the tuner's agreement check (1/16 of the
output's scale) could not tell FP8 rounding (up to ~2^-4 of it) from a wrong result.

Decode is weight-bandwidth bound: useful bytes = the packed weights (and scales) of the experts actually touched.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc import mxfp4
from dzc.ops.mxfp4_moe import ACTIVATIONS, FP8_GROUP, check_mxfp4_moe_args, fp8_applies
from dzc.targets import mxfp4_moe_routing as routing
from dzc.targets import tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import tilelang_config_legal, warp_specialization_problems as profile_ws_problems
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

# Candidates never run on a GPU, (params, why): out of users' tuning (launch.tuning_candidates). None since
# session 40 (H100): W4A8 online and TileLang's WARP_SPECIALIZED=1 passed their GPU numerics there.
UNVALIDATED = ()

# Cost model for the untuned choice of path: dequantizing an expert to the workspace costs ~2 extra bytes written
# and read per weight (vs ~0.53 packed), while the online path decodes each weight tile once per row block. With
# 128-row blocks, an expert with >= 128 rows on average decodes every tile at least twice online: from there on
# the workspace is the cheaper path (kernels.md §2.8 puts the break-even for an fp8 workspace at 500-1000 rows;
# bf16 MMA halves the MMA time per weight, which moves it down). The tuner measures both when it runs.
WORKSPACE_MIN_ROWS_PER_EXPERT = 128
# Row blocks of 16 suit decode (an expert rarely has more rows than that); beyond that, larger blocks.
DECODE_MAX_ROWS_PER_EXPERT = 16


@dataclass(frozen=True)
class MXFP4MoESpec:
    """What the kernels are specialised on; the token count is a run-time size."""

    hidden: int  # H
    inter: int  # I
    experts: int  # E
    top_k: int
    hidden_dtype: torch.dtype
    weights_dtype: torch.dtype  # topk_weights
    w13_bias_dtype: torch.dtype | None
    w2_bias_dtype: torch.dtype | None
    activation: str
    interleaved: bool
    fp8_activations: bool = False  # dzc.mxfp4_moe_w4a8: both GEMMs multiply E4M3 operands

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        fp8 = torch.float8_e4m3fn if self.fp8_activations else None
        return tuple(d for d in (self.hidden_dtype, self.weights_dtype, self.w13_bias_dtype, self.w2_bias_dtype, fp8)
                     if d is not None)

    @property
    def dot_fp32(self) -> bool:
        """Triton: bf16 activations multiply bf16 weights (exact); fp16/fp32 activations multiply in fp32."""
        return self.hidden_dtype != torch.bfloat16

    def describe(self) -> str:
        bias = "/".join("none" if d is None else str(d).removeprefix("torch.")
                        for d in (self.w13_bias_dtype, self.w2_bias_dtype))
        return (f"H={self.hidden} I={self.inter} E={self.experts} top_k={self.top_k} "
                f"x={str(self.hidden_dtype).removeprefix('torch.')} "
                f"topk_weights={str(self.weights_dtype).removeprefix('torch.')} bias={bias} "
                f"{self.activation} interleaved={self.interleaved}{' W4A8 (e4m3)' if self.fp8_activations else ''}")


def spec_from_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
                   activation, gate_up_interleaved, fp8_activations: bool = False) -> MXFP4MoESpec:
    check_mxfp4_moe_args(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
                         w2_bias, activation)
    experts, two_i, _ = w13_scales.shape
    return MXFP4MoESpec(int(hidden.shape[1]), int(two_i) // 2, int(experts), int(topk_ids.shape[1]), hidden.dtype,
                        topk_weights.dtype, None if w13_bias is None else w13_bias.dtype,
                        None if w2_bias is None else w2_bias.dtype, activation, bool(gate_up_interleaved),
                        fp8_activations)


def spec_from_node(node) -> MXFP4MoESpec:
    values = [a.meta["val"] if hasattr(a, "meta") else a for a in node.args[:9]]
    activation, interleaved = node.args[9], node.args[10]
    return spec_from_args(*values, activation, interleaved, fp8_activations=node.target._opname == "mxfp4_moe_w4a8")


def token_bucket(tokens: int) -> int:
    """Tuning results are kept per power-of-two bucket of the token count."""
    return 1 << max(tokens - 1, 0).bit_length()


def rows_per_expert(spec: MXFP4MoESpec, tokens: int) -> float:
    """Average sorted rows (token, slot pairs) per expert: what decides tile sizes and the path."""
    return tokens * spec.top_k / spec.experts


# ---------------------------------------------------------------------------------------------------------
# Work and bytes (benchmarks and the report's roofline figures)


def packed_expert_bytes(spec: MXFP4MoESpec) -> int:
    """Bytes of one expert's packed weights and scales (gate/up and down)."""
    elements = 3 * spec.hidden * spec.inter
    return elements // 2 + elements // mxfp4.BLOCK


def flops(spec: MXFP4MoESpec, tokens: int) -> int:
    """Useful FLOPs: 2 * rows * (2I*H + H*I)."""
    return 2 * tokens * spec.top_k * 3 * spec.hidden * spec.inter


# ---------------------------------------------------------------------------------------------------------
# The workspace: one buffer per device, shared by every layer (and every kernel of this family).

_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _device_key(device) -> torch.device:
    """`device` with its index: "cuda" and a tensor's "cuda:0" name the same workspace."""
    device = torch.device(device)
    module = getattr(torch, device.type, None)  # torch.cuda; torch.musa where torch_musa is imported
    if device.type != "cpu" and device.index is None and hasattr(module, "current_device"):
        device = torch.device(device.type, module.current_device())
    return device


def workspace_elements(spec, tokens: int) -> int:
    """Elements the workspace path needs: the activated experts (at most min(E, tokens * top_k)) of the larger of
    the two weights, which take turns in the same buffer."""
    return min(spec.experts, tokens * spec.top_k) * max(2 * spec.inter * spec.hidden, spec.hidden * spec.inter)


def workspace(device: torch.device, dtype: torch.dtype, elements: int) -> torch.Tensor:
    """The device's workspace as `elements` of `dtype`. Allocated on first use and grown only when a larger layer
    needs more, so the model's largest layer decides its size and every layer reuses it.

    While a CUDA graph is being captured, a buffer of the graph's own instead (from its memory pool): the graph
    keeps the address it captured for as long as it lives, and the shared buffer may be replaced when it grows."""
    device = _device_key(device)
    nbytes = elements * dtype.itemsize
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device).view(dtype)
    buffer = _WORKSPACES.get(device)
    if buffer is None or buffer.numel() < nbytes:
        _WORKSPACES.pop(device, None)
        buffer = _WORKSPACES[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer[:nbytes].view(dtype)


def workspace_bytes(device: torch.device) -> int:
    buffer = _WORKSPACES.get(_device_key(device))
    return 0 if buffer is None else buffer.numel()


def release_workspaces() -> None:
    """Drop every device's workspace (benchmarks measuring peak memory from a clean state)."""
    _WORKSPACES.clear()


# ---------------------------------------------------------------------------------------------------------
# Routing (host side: launches the routing kernels; no synchronisation)


@dataclass
class Routing:
    sorted_pairs: torch.Tensor  # int32 [P]: pair index of each sorted row
    block_expert: torch.Tensor  # int32 [max_blocks]: expert of each row block, -1 past the last
    block_row_start: torch.Tensor  # int32 [max_blocks]
    block_row_end: torch.Tensor  # int32 [max_blocks]
    expert_counts: torch.Tensor  # int32 [E_POW2]
    expert_slots: torch.Tensor  # int32 [E_POW2]: workspace slot of each activated expert
    max_blocks: int


def route(ids: torch.Tensor, experts: int, block_m: int, num_warps: int = 4) -> Routing:
    """Group the pairs of `ids` (flat [P] expert ids) by expert into row blocks of block_m rows."""
    pairs = ids.numel()
    device = ids.device
    e_pow2 = triton_next_power_of_2(experts)
    chunks = -(-pairs // routing.ROUTING_CHUNK)
    max_blocks = routing.max_row_blocks(pairs, experts, block_m)
    int32 = dict(dtype=torch.int32, device=device)
    expert_table = torch.empty(4, e_pow2, **int32)  # offsets, counts, slots, first block
    blocks = torch.empty(3, max_blocks, **int32)  # expert, row start, row end
    sorted_pairs = torch.empty(pairs, **int32)
    schedule = (expert_table[0], expert_table[1], expert_table[2], expert_table[3], blocks[0], blocks[1], blocks[2],
                max_blocks)
    if chunks == 1:
        routing.launchable("moe_route_one_chunk_kernel")[(1,)](
            ids, sorted_pairs, pairs, experts, *schedule, E_POW2=e_pow2, BLOCK_M=block_m,
            SCHEDULE_STEP=routing.SCHEDULE_STEP, CHUNK=routing.ROUTING_CHUNK, num_warps=num_warps)
    else:
        chunk_counts = torch.empty(chunks, e_pow2, **int32)
        chunk_bases = torch.empty(chunks, e_pow2, **int32)
        routing.launchable("moe_count_kernel")[(chunks,)](ids, chunk_counts, pairs, experts, E_POW2=e_pow2,
                                                          CHUNK=routing.ROUTING_CHUNK, num_warps=num_warps)
        routing.launchable("moe_schedule_kernel")[(1,)](
            chunk_counts, chunks, chunk_bases, *schedule, E_POW2=e_pow2, BLOCK_M=block_m,
            SCHEDULE_STEP=routing.SCHEDULE_STEP, num_warps=num_warps)
        routing.launchable("moe_scatter_kernel")[(chunks,)](ids, chunk_bases, sorted_pairs, pairs, experts,
                                                            E_POW2=e_pow2, CHUNK=routing.ROUTING_CHUNK,
                                                            num_warps=num_warps)
    return Routing(sorted_pairs, blocks[0], blocks[1], blocks[2], expert_table[1], expert_table[2], max_blocks)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


COMBINE_BLOCK_H = 1024


def combine(pair_out: torch.Tensor, ids: torch.Tensor, spec, out: torch.Tensor) -> None:
    """out[t] = sum over slots of pair_out[t * top_k + j] (spec: anything with hidden, experts, top_k); pair_out
    is [pairs, H], or [splits, pairs, H] of split-K partial sums, added in split order."""
    tokens = out.shape[0]
    splits = pair_out.shape[0] if pair_out.dim() == 3 else 1
    block_h = min(COMBINE_BLOCK_H, triton_next_power_of_2(spec.hidden))
    routing.launchable("moe_combine_kernel")[(tokens, -(-spec.hidden // block_h))](
        pair_out, ids, out, spec.experts, out.stride(0), ids.numel(), HIDDEN=spec.hidden, TOP_K=spec.top_k,
        BLOCK_H=block_h, SPLITS=splits, num_warps=4)


# ---------------------------------------------------------------------------------------------------------
# Arguments


# (shape and dtype of each argument tensor, activation, row order, W4A8) -> the spec spec_from_args gives them
_CHECKED_SPECS: dict[tuple, MXFP4MoESpec] = {}


def prepare(spec: MXFP4MoESpec, hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
            w2_scales, w2_bias, activation, gate_up_interleaved, alpha, limit):
    """Op arguments -> (kernel inputs, (out,), token count, out). Inputs are made dense (the kernels index them
    as contiguous rows); the packed weights and biases of a model already are, so they pass as they are. The
    last inputs say whether gate and up rows are interleaved (TMA launches view the weights by it) and whether the
    call quantizes its activations (the W4A8 op at prefill sizes, fp8_applies)."""
    tensors = (hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias)
    # The check reads the tensors' shapes and dtypes only: once per set of those facts, not per call.
    facts = (tuple([None if t is None else (t.shape, t.dtype) for t in tensors]), activation,
             bool(gate_up_interleaved), spec.fp8_activations)
    got = _CHECKED_SPECS.get(facts)
    if got is None:
        got = spec_from_args(*tensors, activation, gate_up_interleaved, spec.fp8_activations)
        if len(_CHECKED_SPECS) >= 4096:  # prefill of ever new lengths: bounded
            _CHECKED_SPECS.clear()
        _CHECKED_SPECS[facts] = got
    if got != spec:
        raise ValueError(f"mxfp4_moe kernel for {spec.describe()} got arguments for {got.describe()}")
    dense = [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    fp8 = spec.fp8_activations and fp8_applies(hidden.shape[0], spec.top_k, spec.experts)
    return (*dense, float(alpha), float(limit), bool(gate_up_interleaved), fp8), (out,), hidden.shape[0], out


# ---------------------------------------------------------------------------------------------------------
# Config tiers: which part of the space suits a token bucket (the tuner times only that part)


def _tier(spec: MXFP4MoESpec, bucket: int) -> tuple[set[int], set[int]]:
    """(BLOCK_M values, paths (see _path)) worth trying for `bucket` tokens. W4A8's FP8 configs, with the workspace or
    online, are one path; at decode sizes its tier is W4A16's online one instead (module docstring)."""
    rows = rows_per_expert(spec, bucket)
    if rows <= DECODE_MAX_ROWS_PER_EXPERT:
        block_ms, paths = {16}, {0}
    elif rows < WORKSPACE_MIN_ROWS_PER_EXPERT:
        block_ms, paths = {32, 64}, {0}
    else:
        block_ms, paths = {64, 128}, {0, 1}
        if rows >= SWAP_AB_WIDE_ROWS:  # SWAP_AB's 256-row tiles only where an expert's rows fill one on average
            block_ms.add(SWAP_AB_WIDE_ROWS)
    if spec.fp8_activations:  # the FP8 configs at prefill sizes; decode sizes run W4A16 online
        paths = {FP8_PATH} if fp8_applies(bucket, spec.top_k, spec.experts) else {0}
    return block_ms, paths


# A tier's paths: WORKSPACE's value (0 online, 1 workspace) for W4A16 configs, FP8_PATH for W4A8's FP8 ones.
FP8_PATH = 2


def _path(config: KernelConfig) -> int:
    return FP8_PATH if _fp8(config) else dict(config.params).get("WORKSPACE", 0)


def _uses_workspace(config: KernelConfig) -> bool:
    return dict(config.params).get("WORKSPACE", 0) == 1


def _split_k(config: KernelConfig) -> int:
    return dict(config.params).get("SPLIT_K", 1)


def _default_split_k(spec: MXFP4MoESpec, bucket: int) -> int:
    """Split-K for the untuned decode choice. A GEMM has one program per activated expert (at most
    tokens x top_k of them) and column block, each streaming its weight rows through a chain of dependent loads;
    with only a few experts active too few loads are in flight. On the H200 (docs/results/mxfp4_moe_h200.md),
    4 slices made gpt-oss at 1 token (4 experts) 1.43x and DeepSeek's (8) 1.20x faster, while at 8 tokens
    (28 and 55 experts) splitting gained nothing or lost. The tuner measures every split."""
    pairs = bucket * spec.top_k
    return 4 if pairs <= 8 else 2 if pairs <= 16 else 1


def configs_for_bucket(spec: MXFP4MoESpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """The legal configs worth timing for `bucket`, and the untuned choice for it (cost model above)."""
    block_ms, paths = _tier(spec, bucket)
    tier = [c for c in configs if c["BLOCK_M"] in block_ms and _path(c) in paths]
    if not tier:
        return configs, default
    # Where the MMA is wgmma, SWAP_AB tiles (the decoded weights as wgmma's A operand, from registers) at every
    # size: with their activations in swap order they were the tuner's pick at 1, 8 and 64 tokens of both shapes,
    # 1.04-1.24x faster than the TMA tile (docs/results/mxfp4_moe_swap_h200.md), and at gpt-oss T=2048 and 8192
    # 1.6x and 1.46x faster than the best plain online and workspace tiles (docs/results/mxfp4_moe_h200.md,
    # session 26). Elsewhere the workspace path from WORKSPACE_MIN_ROWS_PER_EXPERT rows an expert.
    want_swap = profile.matrix_instruction == "wgmma" and any(_swap_ab(c) for c in tier)
    # W4A8 converts online (E4M3 words by byte permutes inside the GEMMs) wherever it runs: at gpt-oss-120b T=8192
    # its 64 x 64 stacked tile's kernels took 7528 µs against the workspace tile's 15102, of which the conversion
    # kernel 9212 (H100, session 40, docs/results/mxfp4_moe_w4a8_online_h200.md).
    want_workspace = (rows_per_expert(spec, bucket) >= WORKSPACE_MIN_ROWS_PER_EXPERT and not want_swap
                      and FP8_PATH not in paths)
    # Where descriptor loads are bulk copies (Hopper's TMA), a decode tile's TMA twin: 1.07-1.19x faster at 1-64
    # tokens on gpt-oss-120b and DeepSeek-style shapes on the H200 (docs/results/mxfp4_moe_tma_h200.md); at
    # T=8192 the 128-row SWAP_AB tiles were 1.06-1.6x slower with TMA (session 26). DOT_SCALED tiles were slower
    # everywhere: tuning only; so are SWAP_AB's 256-row tiles (1.14-1.19x slower than 128 rows at gpt-oss T=8192,
    # session 35).
    decode = rows_per_expert(spec, bucket) <= DECODE_MAX_ROWS_PER_EXPERT
    want_tma = profile.bulk_tensor_copies and decode
    # TMA_STACKED's decode tiles with DECODE=2 where the bucket's split has one: at gpt-oss-120b T=8 and 64 (split 1)
    # the layer's kernels took 199.7 and 670.1 µs against 235.3 and 801.6 for the TMA tile (1.18x, 1.20x; H100,
    # session 39, docs/results/mxfp4_moe_decode_stacked_h200.md); at T=1 (split 4) the TMA tile stays (67.5 µs,
    # stacked tiles 68.0-76.5).
    want_stacked = want_tma and any(_tma_stacked(x) and _split_k(x) == _default_split_k(spec, bucket) for x in tier)
    # SWAP_AB's DECODE=2 (signs merged four values a PRMT): 1.04x faster on the 128-row prefill tile at gpt-oss
    # T=8192 in sessions 34 and 35, its GPU numerics passed (session 35). W4A8's FP8_STACKED (gate and up in one MMA
    # a step) on 64 x 64 tiles: 1.05x the same tile unstacked and 1.15x the 128 x 64 one (session 35).
    want_decode = 2 if want_swap and any(_decode(x) == 2 for x in tier) else 1
    want_fp8_stacked = any(_fp8_stacked(x) for x in tier)
    # TileLang's WARP_SPECIALIZED=1 at prefill sizes, its widest, deepest tile: at gpt-oss-120b T=8192 (256 rows an
    # expert) 128 x 256 with 4 stages took 8730 µs, TileLang's plain tile 125316 (14.4x; H100, session 40,
    # docs/results/mxfp4_moe_h200.md). The Triton default took 5287 there: where the codegen is chosen, Triton.
    want_ws = not decode and rows_per_expert(spec, bucket) >= WORKSPACE_MIN_ROWS_PER_EXPERT and any(
        warp_specialized(x) for x in tier)

    def preference(c: KernelConfig):
        # The cost model's path, the tier's largest row block (W4A8: 64 rows), then mid-size tiles (64 x 128) with
        # 128 threads: for decode many small blocks keep every SM loading; for prefill one warp group per block
        # measured fastest on the H200 (docs/results/mxfp4_moe_h200.md).
        threads = c.num_warps * profile.warp_size
        rows = abs(c["BLOCK_M"] - W4A8_BLOCK_M) if _fp8(c) else -c["BLOCK_M"]
        widest_ws = (-c["BLOCK_N"], -c["NUM_STAGES"]) if warp_specialized(c) else (0, 0)
        return (warp_specialized(c) != want_ws, widest_ws,
                _uses_workspace(c) != want_workspace and any(_uses_workspace(x) == want_workspace for x in tier),
                _dot_scaled(c), _tma_stacked(c) != want_stacked, _fp8_stacked(c) != want_fp8_stacked,
                _decode(c) != want_decode,
                c["BLOCK_M"] >= SWAP_AB_WIDE_ROWS, _swap_ab(c) != want_swap, _tma(c) != want_tma, rows,
                _split_k(c) != _default_split_k(spec, bucket), abs(c["BLOCK_N"] - 64), abs(c["BLOCK_K"] - 128),
                abs(threads - 128), c.num_stages != 3)

    return tier, min(tier, key=preference)


def _fp8(config: KernelConfig) -> bool:
    return dict(config.params).get("FP8", 0) == 1


def _tma(config: KernelConfig) -> bool:
    return dict(config.params).get("TMA", 0) == 1


def _dot_scaled(config: KernelConfig) -> bool:
    return dict(config.params).get("DOT_SCALED", 0) == 1


def _swap_ab(config: KernelConfig) -> bool:
    return dict(config.params).get("SWAP_AB", 0) == 1


def _fp8_stacked(config: KernelConfig) -> bool:
    return dict(config.params).get("FP8_STACKED", 0) == 1


def _decode(config: KernelConfig) -> int:
    return dict(config.params).get("DECODE", 1)


def _tma_stacked(config: KernelConfig) -> bool:
    return dict(config.params).get("TMA_STACKED", 0) == 1


# The column orders the GEMMs read their activations in (the generated module's ACT_ORDER values).
NATURAL_ORDER, NIBBLE_ORDER, SWAP_ORDER = 0, 1, 2
# SWAP_AB: activation rows in swap order are padded to whole tiles of this many columns.
SWAP_TILE = 128
# SWAP_AB prefill tiles of this many token rows (wgmma's largest N; tuning candidates, see triton_configs).
SWAP_AB_WIDE_ROWS = 256
# W4A8's untuned row block: 64 x 64 tiles beat 128 x 64 (4 and 8 warps) and 128 x 128 at gpt-oss T=8192 on the
# H200 (sessions 34-35, docs/results/mxfp4_moe_h200.md).
W4A8_BLOCK_M = 64


def _act_order(config: KernelConfig) -> int:
    return NATURAL_ORDER if _dot_scaled(config) else SWAP_ORDER if _swap_ab(config) else NIBBLE_ORDER


def _act_width(columns: int, order: int) -> int:
    """Row width of activations of `columns` columns in `order`."""
    return -(-columns // SWAP_TILE) * SWAP_TILE if order == SWAP_ORDER else columns


def describe_config(config: KernelConfig) -> str:
    """Which path a config runs: what the compile report records per token bucket."""
    if _fp8(config):
        stacked = ", gate and up as one MMA a step" if _fp8_stacked(config) else ""
        if not _uses_workspace(config):
            return f"W4A8 online (MXFP4 converted to E4M3 in registers inside the grouped FP8 GEMMs{stacked})"
        return f"W4A8 workspace (activated experts converted once to E4M3, then grouped FP8 GEMM{stacked})"
    if _uses_workspace(config):
        return "workspace (dequantize activated experts once, then grouped bf16 GEMM)"
    if warp_specialized(config):
        return ("online dequant, warp-specialized (a producer warpgroup decodes MXFP4 into shared memory, two "
                "consumer warpgroups run wgmma)")
    split = f", split-K {_split_k(config)}" if _split_k(config) > 1 else ""
    tma = ", weights by TMA" if _tma(config) else ""
    if _dot_scaled(config):
        return f"online dequant (tl.dot_scaled: the compiler decodes MXFP4 into the MMA operand{split}{tma})"
    if _swap_ab(config):
        decoder = ", signs merged before the interleave (DECODE=2)" if _decode(config) == 2 else ""
        decoder += ", gate and up rows as one TMA box and MMA operand" if _tma_stacked(config) else ""
        return f"online dequant (MXFP4 decoded into the MMA's A operand, tokens as N{split}{tma}{decoder})"
    return f"online dequant (MXFP4 decoded in registers inside the GEMMs{split}{tma})"


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAMES = ("moe_reorder_kernel", "moe_gate_up_kernel", "moe_down_kernel",
                       "moe_split_activation_kernel", "mxfp4_dequantize_experts_kernel", "moe_quantize_e4m3_kernel",
                       "mxfp4_to_e4m3_experts_kernel")
# Columns per program of the activations' reordering (bandwidth bound and small: one shape serves).
REORDER_BLOCK = 1024
# The workspace dequantization's tile (it is bandwidth bound; one shape serves).
DEQUANT_BLOCK_N = 32
DEQUANT_BLOCK_K = 256
DEQUANT_NUM_WARPS = 4
# Rows per program of W4A8's activation quantization (bandwidth bound: 32 rows x one 128-column group, 4 warps).
QUANTIZE_ROWS = 32

_TRITON_ACTIVATIONS = {
    "silu_glu": ["act = gate / (1.0 + tl.exp(-gate)) * up"],
    "clamped_swiglu": [
        "gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)",
        "up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,",
        "                propagate_nan=tl.PropagateNan.ALL)",
        "act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)",
    ],
}


def _name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def _template_fields(spec: MXFP4MoESpec, profile: DeviceProfile) -> dict:
    return dict(profile=profile.name, hidden=spec.hidden, inter=spec.inter, experts=spec.experts, top_k=spec.top_k,
                hidden_dtype=_name(spec.hidden_dtype), weights_dtype=_name(spec.weights_dtype),
                w13_bias=_name(spec.w13_bias_dtype), w2_bias=_name(spec.w2_bias_dtype), activation=spec.activation,
                interleaved=spec.interleaved, has_w13_bias=spec.w13_bias_dtype is not None,
                has_w2_bias=spec.w2_bias_dtype is not None, dot_fp32=spec.dot_fp32)


def triton_source(spec: MXFP4MoESpec, profile: DeviceProfile) -> str:
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"mxfp4_moe: no kernel for activation {spec.activation!r}")
    fields = _template_fields(spec, profile)
    fields["activation_code"] = "\n    ".join(_TRITON_ACTIVATIONS[spec.activation])
    fields["decoder_code"] = triton_decoder_source(profile)
    fields["scaled_product_code"] = _SCALED_PRODUCT[profile.triton_dot_scaled]
    fields["word_decoder_code"] = _WORD_DECODER_2 if profile.triton_inline_asm else _WORD_DECODER_2_ARITHMETIC
    fields["e4m3_word_code"] = _E4M3_WORDS if profile.triton_inline_asm else _E4M3_WORDS_ARITHMETIC
    fields.update(natural_order=NATURAL_ORDER, nibble_order=NIBBLE_ORDER, swap_order=SWAP_ORDER, swap_tile=SWAP_TILE)
    return Template((TEMPLATES / "mxfp4_moe.triton.py.tmpl").read_text()).substitute(fields)


# The generated module's `_scaled_product` (DOT_SCALED tiles): tl.dot_scaled where the profile's Triton compiles it;
# elsewhere no call at all (no such config is emitted there, and the MUSA static check refuses the name in source).
_SCALED_PRODUCT = {
    True: 'return tl.dot_scaled(a, None, "bf16", tl.trans(packed), scales, "e2m1", acc)',
    False: 'tl.static_assert(False, "tl.dot_scaled is not available on this profile")\n    return acc',
}


# SWAP_AB's DECODE=2 word decoder (the generated module's `_decode_words_2`). The DECODE=1 one (the decoder template's
# `_e2m1_word_lut`) looks 8 magnitudes up with 4 prmt, interleaves them into bf16 pairs with 4 more, then merges the
# signs one pair at a time (a prmt and a lop3 each) and scales (a bf16x2 fma each): 23 instructions a word. DECODE=2
# merges the signs into the looked-up high bytes, four values at once, before the interleave: prmt(q << 4, q) puts
# the sign of value 2j (bit 8j + 3) and of value 2j + 1 (bit 8j + 7) at the top bits of output bytes 2j' and
# 2j' + 1 (j' = j mod 2), the high bytes' own top bits, which the table leaves 0 (E2M1 magnitudes are positive):
# one prmt and one lop3 per 4 values, 19 instructions a word, the same bits. Where Triton has no inline assembly
# (and in its interpreter) the DECODE=1 decoder's arithmetic path.
_WORD_DECODER_2 = '''
@triton.jit
def _e2m1_word_lut_2(words, scale_pairs):
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 m, mh, h0, l0, h1, l1, p0, p1, p2, p3, u, s, t0, t1, t2, t3, n, sm;
        mov.b32 t0, 0x3F3F3F00; mov.b32 t1, 0x40404040; mov.b32 t2, 0xC0800000; mov.b32 t3, 0xC0804000;
        mov.b32 n, 0x80008000; mov.b32 sm, 0x80808080;
        and.b32 m, $8, 0x77777777;
        shr.u32 mh, m, 16;
        shl.b32 u, $8, 4;
        prmt.b32 h0, t0, t1, m;
        prmt.b32 s, u, $8, 0x5140;
        lop3.b32 h0, h0, s, sm, 0xF8;
        prmt.b32 h1, t0, t1, mh;
        prmt.b32 s, u, $8, 0x7362;
        lop3.b32 h1, h1, s, sm, 0xF8;
        prmt.b32 l0, t2, t3, m;
        prmt.b32 l1, t2, t3, mh;
        prmt.b32 p0, l0, h0, 0x5140;
        prmt.b32 p1, l0, h0, 0x7362;
        prmt.b32 p2, l1, h1, 0x5140;
        prmt.b32 p3, l1, h1, 0x7362;
        fma.rn.bf16x2 p0, p0, $9, n;
        fma.rn.bf16x2 p1, p1, $9, n;
        fma.rn.bf16x2 p2, p2, $9, n;
        fma.rn.bf16x2 p3, p3, $9, n;
        mov.b32 {$0, $1}, p0;
        mov.b32 {$2, $3}, p1;
        mov.b32 {$4, $5}, p2;
        mov.b32 {$6, $7}, p3;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scale_pairs], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _decode_words_2(words, scale):
    """_decode_words with DECODE=2's word decoder (_e2m1_word_lut_2): the same values."""
    if INTERPRETED:
        return _decode_words_arithmetic(words, scale)
    return _e2m1_word_lut_2(words, scale)
'''
_WORD_DECODER_2_ARITHMETIC = '''
@triton.jit
def _decode_words_2(words, offsets):
    """No inline assembly: DECODE=2 is DECODE=1 (_decode_words)."""
    return _decode_words(words, offsets)
'''

# W4A8 online's word lookup (the generated module's `_e4m3_words`): where Triton has inline assembly, each word's 8
# E2M1 codes looked up in their group's E4M3 table by byte permutes, 12 instructions a word. The magnitudes' low
# nibbles (bytes 0..3) and high nibbles gather into one selector word (two lop3 and a prmt), two prmt look 4 bytes
# up each from the table's 8, and one lop3 each merges the signs: a low nibble's sign (bit 8k + 3) shifted 4 up, a
# high nibble's (bit 8k + 7) in place, are the E4M3 bytes' top bits. In the interpreter the arithmetic form.
_E4M3_WORDS = '''
@triton.jit
def _e4m3_word_lut(words, table_low, table_high):
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 m, a, b, sl, sh, s, t, u, mask;
        mov.b32 mask, 0x80808080;
        and.b32 m, $2, 0x77777777;
        shr.u32 a, m, 4;
        shr.u32 b, m, 8;
        lop3.b32 sl, m, a, 0x000F000F, 0xE4;
        lop3.b32 sh, a, b, 0x000F000F, 0xE4;
        prmt.b32 s, sl, sh, 0x6420;
        shr.u32 t, s, 16;
        prmt.b32 $0, $3, $4, s;
        prmt.b32 $1, $3, $4, t;
        shl.b32 u, $2, 4;
        lop3.b32 $0, $0, u, mask, 0xF8;
        lop3.b32 $1, $1, $2, mask, 0xF8;
        }""",
        "=r,=r,r,r,r", [words, table_low, table_high], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _e4m3_words(words, table_low, table_high):
    """_e4m3_words_arithmetic's bytes by byte-permute lookups (_e4m3_word_lut)."""
    if INTERPRETED:
        return _e4m3_words_arithmetic(words, table_low, table_high)
    return _e4m3_word_lut(words, table_low, table_high)
'''
_E4M3_WORDS_ARITHMETIC = '''
@triton.jit
def _e4m3_words(words, table_low, table_high):
    """No inline assembly: the arithmetic form."""
    return _e4m3_words_arithmetic(words, table_low, table_high)
'''


def triton_decoder_source(profile: DeviceProfile) -> str:
    """The generated module's `_decode_mxfp4`: a byte-permute lookup in inline PTX where the profile's Triton has
    inline assembly (CUDA), integer arithmetic elsewhere (MUSA). Both give the same bits."""
    name = "mxfp4_decode_lut" if profile.triton_inline_asm else "mxfp4_decode_arithmetic"
    return Template((TEMPLATES / f"{name}.triton.py.tmpl").read_text()).substitute()


def triton_configs(spec: MXFP4MoESpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Every tier's tiles (configs_for_bucket picks a tier per bucket), before legality pruning.

    BLOCK_K is at least 64 (each row step reads 32+ contiguous bytes per weight row; decode reads 64+); BLOCK_N
    tiles the output columns (for the gate/up GEMM BLOCK_N gate and BLOCK_N up rows). Decode tiles also take 1 and
    2 warps: with 128-lane warps (mp_22) those are the 128- and 256-thread blocks that suit them, and split the
    reduction (SPLIT_K); one pipeline depth, since decoded weight loads are not software-pipelined (measured:
    tools/diagnose_mxfp4_decode.py). Blocks of 64 rows or fewer take 4 warps only: compiled for sm_90 (Triton
    3.6), 8 warps on them split the accumulators over two MMA layouts converted into each other at every step,
    and ran 2-3x slower on the H200 (docs/results/mxfp4_moe_h200.md); 128-row blocks take 4 and 8.
    Where the profile's Triton has tensor descriptors, decode tiles also come with TMA=1: the packed weights by
    TMA, which Triton does pipeline (3 and 4 stages: 2 and 3 buffers); on the H200 that streamed the bytes 1.75x
    faster and made the gpt-oss layer 1.12-1.19x faster at 1-64 tokens (docs/results/mxfp4_moe_tma_h200.md).
    Where it compiles tl.dot_scaled and the activations are bf16, DOT_SCALED=1 tiles (decode and prefill sizes,
    with and without TMA) let the compiler decode the weights into the MMA operand (generated module docstring).
    """
    if spec.fp8_activations:
        # W4A8: the workspace path, one scale group per step (see the module docstring); where FP8 is native, the
        # W4A16 online configs for decode sizes too (on other profiles nothing: the op has no kernel there).
        fp8 = [KernelConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_K=FP8_GROUP, WORKSPACE=1, SPLIT_K=1, FP8=1)
               for block_m in (16, 32, 64, 128) for block_n in (64, 128)
               for warps in ((4,) if block_m <= 64 else (4, 8)) for stages in (2, 3, 4)]
        # FP8_STACKED: the gate/up GEMM's gate and up weight rows stacked into one MMA a step (one wgmma wait a
        # step, not two; its scales loaded a step ahead: generated module docstring), at the prefill tiles whose
        # sm_90 K step it shortened without spilling more (static: docs/mxfp4_moe_kernels.md); 64 x 128 and
        # 128 x 64 on 4 warps spilled more than without. On the H200 1.14-1.46x faster gate/up GEMMs (sessions
        # 34-35); the 64 x 64 one is the untuned choice (configs_for_bucket).
        fp8 += [KernelConfig.make(num_warps=warps, num_stages=3, BLOCK_M=block_m, BLOCK_N=block_n,
                                  BLOCK_K=FP8_GROUP, WORKSPACE=1, SPLIT_K=1, FP8=1, FP8_STACKED=1)
                for block_m, block_n, warps in ((64, 64, 4), (128, 64, 8), (128, 128, 8))]
        # Online (WORKSPACE=0): the GEMMs convert the packed weights to E4M3 in registers (generated module
        # docstring): no conversion kernel, no workspace. Tuning candidates only, not yet timed on a GPU, at the
        # prefill tiles whose sm_90 K loops spill nothing (gpt-oss-120b, Triton 3.9: docs/mxfp4_moe_kernels.md);
        # 128 x 64 on 4 warps, 64 x 128 and 128 x 128 spill in the gate/up loop.
        fp8 += [KernelConfig.make(num_warps=warps, num_stages=3, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=FP8_GROUP,
                                  WORKSPACE=0, SPLIT_K=1, FP8=1, **stacked)
                for block_m, warps in ((64, 4), (128, 8)) for stacked in ({}, {"FP8_STACKED": 1})]
        if not profile.supports_dtype(torch.float8_e4m3fn):
            return fp8
        w4a16 = triton_configs(dataclasses.replace(spec, fp8_activations=False), profile)
        return fp8 + [c for c in w4a16 if not _uses_workspace(c) and c["BLOCK_M"] <= 64]
    configs = []
    for block_m, block_n, block_k, warps, stages, use_workspace, split_k in (
            [(16, n, k, w, 2, 0, split) for n in (32, 64, 128) for k in (128, 256) for w in (1, 2, 4, 8)
             for split in (1, 2, 4, 8)]
            + [(32, n, k, 4, s, 0, 1) for n in (64, 128) for k in (64, 128) for s in (2, 3)]
            + [(m, n, k, w, s, ws, 1) for m in (64, 128) for n in (64, 128) for k in (64, 128)
               for w in ((4,) if m == 64 else (4, 8)) for s in (2, 3, 4) for ws in (0, 1)]):
        configs.append(KernelConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=block_m, BLOCK_N=block_n,
                                         BLOCK_K=block_k, WORKSPACE=use_workspace, SPLIT_K=split_k))
    tmas = [{}, {"TMA": 1}] if profile.triton_tensor_descriptors else [{}]  # the weights by plain loads / TMA
    if profile.triton_tensor_descriptors:
        configs += [KernelConfig.make(num_warps=4, num_stages=stages, BLOCK_M=block_m, BLOCK_N=block_n,
                                      BLOCK_K=block_k, WORKSPACE=0, SPLIT_K=split_k, TMA=1)
                    for block_m, splits in ((16, (1, 2, 4, 8)), (32, (1,))) for block_n in (64, 128)
                    for block_k in (128, 256) for split_k in splits for stages in (3, 4)]
    if profile.triton_dot_scaled and not spec.dot_fp32:
        # 64- and 128-row weight tiles: on Hopper the weights are wgmma's A operand (decoded into registers), so
        # BLOCK_N is the MMA's M (one or two warp groups' worth) and BLOCK_M, the token rows, its N
        configs += [KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                      WORKSPACE=0, SPLIT_K=split_k, DOT_SCALED=1, **tma)
                    for block_m, splits in ((16, (1, 2, 4, 8)), (32, (1,)), (64, (1,))) for block_n in (64, 128)
                    for block_k in (128, 256) for split_k in splits for tma in tmas]
        configs += [KernelConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=block_m, BLOCK_N=128,
                                      BLOCK_K=128, WORKSPACE=0, SPLIT_K=1, DOT_SCALED=1, **tma)
                    for block_m in (64, 128) for warps in (4, 8) for stages in (3, 4) for tma in tmas]
    if not spec.dot_fp32:
        # The SWAP_AB tiles' decoders: DECODE=2 (inline PTX) where Triton has inline assembly.
        decoders = [{}, {"DECODE": 2}] if profile.triton_inline_asm else [{}]
        # The weights as the MMA's A operand, decoded into its registers (generated module docstring): BLOCK_N is
        # the MMA's M (64 or 128 rows: one warp group, twice), the token rows its N; BLOCK_K four MX groups.
        configs += [KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=block_m, BLOCK_N=block_n,
                                      BLOCK_K=SWAP_TILE, WORKSPACE=0, SPLIT_K=split_k, SWAP_AB=1, **tma)
                    for block_m, splits in ((16, (1, 2, 4, 8)), (32, (1, 2)), (64, (1,))) for block_n in (64, 128)
                    for split_k in splits for tma in tmas]
        # Prefill: 128 token rows a tile, so each decoded weight feeds twice the MMA work of a 64-row tile. A
        # 128-row weight tile takes two warp groups (its gate and up accumulators fill 4 warps' registers).
        configs += [KernelConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=128, BLOCK_N=block_n,
                                      BLOCK_K=SWAP_TILE, WORKSPACE=0, SPLIT_K=1, SWAP_AB=1, **tma)
                    for block_n, warps in ((64, 4), (128, 8)) for stages in (3, 4) for tma in tmas]
        if profile.triton_inline_asm:
            # DECODE=2: the same prefill tiles with the signs merged four values at a time (_WORD_DECODER_2):
            # a shorter sm_90 K step (docs/mxfp4_moe_kernels.md), 1.04x faster on the H200 (sessions 34-35).
            configs += [KernelConfig.make(num_warps=warps, num_stages=3, BLOCK_M=128, BLOCK_N=block_n,
                                          BLOCK_K=SWAP_TILE, WORKSPACE=0, SPLIT_K=1, SWAP_AB=1, DECODE=2)
                        for block_n, warps in ((64, 4), (128, 8))]
        if profile.triton_tensor_descriptors and spec.interleaved:
            # TMA_STACKED (decode, interleaved gate/up rows): the gate/up GEMM's gate and up rows come as one TMA
            # box of 2 * BLOCK_N interleaved w13 rows, decoded into one MMA operand with one accumulator (the
            # plain-load tile's stacked form), its scales a step ahead. Compiled for sm_90 (gpt-oss-120b, Triton
            # 3.9; docs/mxfp4_moe_kernels.md, "Decode beside triton_kernels"): the T=8 tile's gate/up K step 711 ->
            # 636 SASS instructions (580 with DECODE=2; triton_kernels: 450 for the same weight bytes), wgmma waits
            # 3, 3, 3, 3 -> 1, 1, no spill. GPU numerics passed and timed on an H100 (session 39): with DECODE=2
            # the decode buckets' untuned choice (configs_for_bucket).
            configs += [KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=block_n,
                                          BLOCK_K=SWAP_TILE, WORKSPACE=0, SPLIT_K=split_k, SWAP_AB=1, TMA=1,
                                          TMA_STACKED=1, **decoder)
                        for block_n in (64, 128) for split_k in (1, 2) for decoder in decoders]
        if profile.matrix_instruction == "wgmma":
            # 256 token rows a tile (wgmma's largest N): each decoded weight feeds twice a 128-row tile's MMA work.
            # 64 weight rows on 8 warps: each warp group holds 64 of the 128 stacked gate/up rows x 256 tokens
            # (128 fp32 accumulator registers a thread). Tuning only: 1.14-1.19x slower than the 128-row tile at
            # gpt-oss T=8192 on the H200 (session 35), with and without DECODE=2. Compiled for sm_90
            # (gpt-oss-120b, Triton 3.9, 3 stages; docs/mxfp4_moe_kernels.md, session 34): gate/up K step 452 SASS
            # instructions a warp, 14.1 a token row for the block (128x64 on 4 warps: 728, 22.8), 188 B spilled,
            # none in the loop (128x64: 256 B, 23 local accesses a step); down 394 (12.3 against 14.3: its two warp
            # groups decode the same 64 rows), no spill; DECODE=2 spills no more. On 4 warps (6064 B, 570 local
            # accesses a step) or with BLOCK_N 128 (3728 B, 539; wgmma serialized) the gate/up loop spills: not
            # offered. 2 stages: about the same spills (172 B) and no more blocks an SM (the registers allow one).
            configs += [KernelConfig.make(num_warps=8, num_stages=3, BLOCK_M=SWAP_AB_WIDE_ROWS, BLOCK_N=64,
                                          BLOCK_K=SWAP_TILE, WORKSPACE=0, SPLIT_K=1, SWAP_AB=1, **decoder)
                        for decoder in decoders]
    return list(dict.fromkeys(configs))  # the lists overlap (64-row DOT_SCALED tiles): each config once


def triton_default_config(spec: MXFP4MoESpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice without a token count: the decode tier's (configs_for_bucket refines it per bucket)."""
    from dzc.targets import launch, mxfp4_moe  # noqa: PLC0415 (launch imports dzc, which imports the targets)

    legal, _ = launch.legal_configs(mxfp4_moe, "triton", spec, profile)
    if not legal:
        raise ValueError(f"no legal Triton mxfp4_moe config for {spec.describe()} on {profile.name}")
    return configs_for_bucket(spec, profile, 1, legal, legal[0])[1]


def triton_shared_memory_bytes(spec: MXFP4MoESpec, config: KernelConfig) -> int:
    """Upper estimate: per pipeline stage the activation tile and two weight tiles (gate and up; packed bytes and
    scales online, bf16/fp32 from the workspace), plus the decoded operands the MMA reads from shared memory."""
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    operand = 1 if _fp8(config) else 4 if spec.dot_fp32 else 2
    activation = block_m * block_k * (1 if _fp8(config) else spec.hidden_dtype.itemsize)
    if _uses_workspace(config):
        weights = 2 * block_n * block_k * operand
    else:
        weights = 2 * (block_n * block_k // 2 + block_n * block_k // mxfp4.BLOCK)
    if _fp8(config):  # and each step's activation-row and weight-column scales (fp32)
        weights += (block_m + 2 * block_n) * 4
    if _swap_ab(config) and block_m >= SWAP_AB_WIDE_ROWS:
        # Emitted for wgmma only (triton_configs), which takes the decoded weights from registers and reads the
        # activations in place: the pipeline's buffers alone (sm_90, 3 stages: 212992 B compiled, 222720 here).
        return config.num_stages * (activation + weights)
    staged = max(config.num_stages - 1, 1) * (activation + weights)
    return staged + 2 * block_n * block_k * operand + block_m * block_k * operand


@dataclass(frozen=True)
class _LaunchPlan:
    """What triton_launch reads of a config, worked out once per config (_launch_plan), not per call."""

    config: KernelConfig
    word_loads: bool  # TMA, SWAP_AB or W4A8 online: the weights must be 16-byte aligned (_plain_loads otherwise)
    order: int  # the activations' column order (_act_order)
    options: Mapping  # the GEMMs' constexprs and launch options (FP8, WORKSPACE, SPLIT_K, BLOCK_N, ...)


@functools.cache
def _launch_plan(config: KernelConfig) -> _LaunchPlan:
    # The interpreter multiplies upcast operands (UPCAST_DOT); the mode is fixed for the process.
    upcast = triton_codegen.interpreting()
    options = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                   WORKSPACE=_uses_workspace(config), SPLIT_K=_split_k(config), UPCAST_DOT=upcast,
                   FP8=_fp8(config), TMA=_tma(config), K_STAGES=config.num_stages, DOT_SCALED=_dot_scaled(config),
                   SWAP_AB=_swap_ab(config), FP8_STACKED=_fp8_stacked(config), DECODE=_decode(config),
                   TMA_STACKED=_tma_stacked(config), num_warps=config.num_warps, num_stages=config.num_stages)
    word_loads = _tma(config) or _swap_ab(config) or (_fp8(config) and not _uses_workspace(config))
    return _LaunchPlan(config, word_loads, _act_order(config), types.MappingProxyType(options))


def triton_launch(kernels: dict, config: KernelConfig, hidden, topk_ids, topk_weights, w13_blocks, w13_scales,
                  w13_bias, w2_blocks, w2_scales, w2_bias, alpha, limit, interleaved, fp8, out):
    """Route, run both GEMMs on the config's path, combine into `out` [T, H] (preallocated). Arguments as
    `prepare` returns them (checked there against the spec the kernels were generated for). `fp8` (the W4A8
    op's arithmetic for this call's token count) decides between W4A8 and W4A16: a config of the other path
    gives way to that path's standard tile (_PATH_CONFIGS); the tuner's tiers keep that to calls whose token
    bucket straddles FP8_MIN_ROWS_PER_EXPERT."""
    plan = _launch_plan(config)
    if fp8 != plan.options["FP8"]:
        plan = _launch_plan(_PATH_CONFIGS[fp8])
    if plan.word_loads and (w13_blocks.data_ptr() % TMA_ALIGNMENT or w2_blocks.data_ptr() % TMA_ALIGNMENT):
        # TMA reads from 16-byte aligned addresses only, SWAP_AB and W4A8 online read words: the same tile by plain
        # byte loads
        plan = _launch_plan(_plain_loads(plan.config))
    options, order = plan.options, plan.order
    split_k, block_n = options["SPLIT_K"], options["BLOCK_N"]
    spec = _LaunchShape.of(hidden, topk_ids, w13_scales)
    tokens = hidden.shape[0]
    pairs = tokens * spec.top_k
    ids = topk_ids.reshape(-1)
    route_plan = route(ids, spec.experts, options["BLOCK_M"])
    device = hidden.device
    # swap order: rows padded to whole tiles, whose padding must hold zeros (the GEMMs multiply it by zero weights)
    act_width = _act_width(spec.inter, order)
    act = (torch.zeros if act_width != spec.inter else torch.empty)(pairs, act_width, dtype=spec.hidden_dtype,
                                                                    device=device)
    pair_out = torch.empty(pairs, spec.hidden, dtype=torch.float32, device=device)
    # The weights' TMA descriptors (TMA configs); otherwise any pointer will do, the kernels never read them.
    gate_source, up_source, down_source = (
        _tma_sources(w13_blocks, w2_blocks, interleaved, block_n, options["BLOCK_K"], options["SWAP_AB"],
                     options["TMA_STACKED"])
        if options["TMA"] else (w13_blocks,) * 3)
    if options["FP8"]:
        _launch_w4a8(kernels, route_plan, options, hidden, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks,
                     w2_scales, w2_bias, alpha, limit, act, pair_out, spec)
        combine(pair_out, ids, spec, out)
        return
    if split_k > 1:  # fp32 partial sums of each split: gate/up [S, P, 2I] (by sorted row), down [S, P, H]
        gate_up_partial = torch.empty(split_k, pairs, 2 * spec.inter, dtype=torch.float32, device=device)
        pair_out = torch.empty(split_k, pairs, spec.hidden, dtype=torch.float32, device=device)
    else:  # no partial sums: any pointer will do, with SPLIT_K = 1 the kernels never read it
        gate_up_partial = pair_out
    ws = workspace(device, spec.workspace_dtype, workspace_elements(spec, tokens)) if options["WORKSPACE"] else hidden
    # Absent biases: any pointer will do, the kernels never read it (HAS_*_BIAS is False in their source).
    w13_bias_arg = w13_bias if w13_bias is not None else hidden
    w2_bias_arg = w2_bias if w2_bias is not None else hidden
    if options["WORKSPACE"]:
        _dequantize_experts(kernels, w13_blocks, w13_scales, route_plan, ws, 2 * spec.inter, spec.hidden, spec)
    if order == NATURAL_ORDER:
        hidden_n = hidden
    else:  # the GEMMs reduce in nibble or swap order (see the generated module's docstring): x in that order first
        width = _act_width(spec.hidden, order)
        hidden_n = torch.empty(tokens, width, dtype=spec.hidden_dtype, device=device)
        kernels["moe_reorder_kernel"][(tokens, -(-width // REORDER_BLOCK))](
            hidden, hidden_n, hidden.stride(0), BLOCK=REORDER_BLOCK, ACT_ORDER=order, num_warps=4)
    gate_up_tiles = _tiles(route_plan, spec.inter, block_n)
    schedule = (route_plan.sorted_pairs, route_plan.block_expert, route_plan.block_row_start,
                route_plan.block_row_end, route_plan.expert_slots)
    # W4A8's scale arguments (x_scales_ptr, w_block_scales_ptr): any pointer will do, with FP8 = False the
    # kernels never read them.
    kernels["moe_gate_up_kernel"][(gate_up_tiles, split_k)](
        hidden_n, *schedule, w13_blocks, w13_scales, ws, w13_bias_arg, act, gate_up_partial, pair_out, pair_out,
        alpha, limit, pairs, gate_source, up_source, **options)
    if split_k > 1:
        kernels["moe_split_activation_kernel"][(gate_up_tiles,)](
            gate_up_partial, route_plan.block_expert, route_plan.block_row_start, route_plan.block_row_end,
            w13_bias_arg, act, alpha, limit, pairs, BLOCK_M=options["BLOCK_M"], BLOCK_N=block_n, SPLIT_K=split_k,
            ACT_ORDER=order, num_warps=options["num_warps"])
    if options["WORKSPACE"]:
        _dequantize_experts(kernels, w2_blocks, w2_scales, route_plan, ws, spec.hidden, spec.inter, spec)
    kernels["moe_down_kernel"][(_tiles(route_plan, spec.hidden, block_n), split_k)](
        act, *schedule, w2_blocks, w2_scales, ws, w2_bias_arg, topk_weights.reshape(-1), pair_out, pair_out,
        pair_out, pairs, down_source, **options)
    combine(pair_out, ids, spec, out)


# TMA descriptors need 16-byte aligned base addresses and strides (every MXFP4 row stride, K/2 bytes, is one).
TMA_ALIGNMENT = 16


def _plain_loads(config: KernelConfig) -> KernelConfig:
    """The same tile with its weights by plain byte loads: without TMA and SWAP_AB; W4A8 online's from the
    workspace (its conversion kernel reads bytes)."""
    params = tuple((k, 1 if k == "WORKSPACE" and _fp8(config) else v) for k, v in config.params
                   if k not in ("TMA", "SWAP_AB", "TMA_STACKED"))
    return KernelConfig(params, config.num_warps, config.num_stages)


# (facts of both weights, row order, box) -> their three descriptors (_tma_sources). Bounded; an entry holds the
# weights' memory (through detached views, not the weight tensors themselves) until evicted, and is evicted when
# either weight tensor is freed, so that a dropped model's weights do not stay allocated.
_TMA_SOURCES: dict[tuple, tuple] = {}
_TMA_SOURCES_MAX = 256


def _tma_sources(w13_blocks, w2_blocks, interleaved: bool, block_n: int, block_k: int, words: bool,
                 stacked: bool = False):
    """TMA descriptors over the packed weights as the GEMMs tile them, [E, N, K/2] bytes with boxes of [1, BLOCK_N,
    BLOCK_K/2] (words: [E, N, K/8] int32 words, boxes [1, BLOCK_N, BLOCK_K/8]): the gate rows and the up rows of
    w13 (every other row where interleaved, else its two halves), and w2's rows. `stacked` (TMA_STACKED, interleaved
    words): the gate/up GEMM's descriptor covers every w13 row with boxes of 2 * BLOCK_N rows (a tile's gate and up
    rows, interleaved), given twice.

    Built once per set of facts they are made of (each weight's address, dtype, device, shape and strides, the
    row order and the box): equal facts give equal descriptors, wherever the tensors came from."""
    key = (_memory_facts(w13_blocks), _memory_facts(w2_blocks), interleaved, block_n, block_k, words, stacked)
    sources = _TMA_SOURCES.get(key)
    if sources is None:
        if len(_TMA_SOURCES) >= _TMA_SOURCES_MAX:
            del _TMA_SOURCES[next(iter(_TMA_SOURCES))]  # the oldest
        sources = _TMA_SOURCES[key] = _make_tma_sources(w13_blocks.detach(), w2_blocks.detach(), interleaved,
                                                        block_n, block_k, words, stacked)
        for weight in (w13_blocks, w2_blocks):
            weakref.finalize(weight, _TMA_SOURCES.pop, key, None)
    return sources


def _memory_facts(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.device, t.shape, t.stride()


def _make_tma_sources(w13_blocks, w2_blocks, interleaved: bool, block_n: int, block_k: int, words: bool,
                      stacked: bool = False):
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415 (CUDA Tritons only)

    experts, two_i = w13_blocks.shape[:2]
    w13 = w13_blocks.view(experts, two_i, -1)
    w2 = w2_blocks.view(*w2_blocks.shape[:2], -1)
    if words:
        w13, w2 = w13.view(torch.int32), w2.view(torch.int32)
    if interleaved:
        gate, up = w13.view(experts, two_i // 2, 2, -1).unbind(2)
    else:
        gate, up = w13.split(two_i // 2, dim=1)
    box = [1, block_n, block_k // (8 if words else 2)]
    if stacked:
        if not (interleaved and words):
            raise ValueError("TMA_STACKED: SWAP_AB tiles of interleaved gate/up rows only")
        gate_up = TensorDescriptor.from_tensor(w13, [1, 2 * block_n, block_k // 8])
        return gate_up, gate_up, TensorDescriptor.from_tensor(w2, box)
    return (TensorDescriptor.from_tensor(gate, box), TensorDescriptor.from_tensor(up, box),
            TensorDescriptor.from_tensor(w2, box))


# The tile a W4A8-op launch runs when its config belongs to the other path (by FP8): the prefill tests' FP8 tile, or
# the decode tier's W4A16 default; both legal on every profile with native FP8 (4 warps of 32 lanes, under 100 KiB
# of shared memory).
_PATH_CONFIGS = {
    True: KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=FP8_GROUP, WORKSPACE=1,
                            SPLIT_K=1, FP8=1),
    False: KernelConfig.make(num_warps=4, num_stages=2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=1),
}


def _launch_w4a8(kernels, plan: Routing, options: dict, hidden, topk_weights, w13_blocks, w13_scales, w13_bias,
                 w2_blocks, w2_scales, w2_bias, alpha, limit, act, pair_out, spec: "_LaunchShape") -> None:
    """W4A8 (FP8 configs): x and the activations to E4M3 with their scales, both GEMMs on E4M3 tiles. Workspace
    configs convert each weight into the workspace (E4M3 bytes, then its block scales) before its GEMM; online
    ones (WORKSPACE=0) convert the packed weights inside the GEMMs: no conversion kernel, no workspace."""
    tokens, pairs, device = hidden.shape[0], act.shape[0], hidden.device
    e4m3 = torch.float8_e4m3fn
    x8 = torch.empty(tokens, spec.hidden, dtype=torch.uint8, device=device)
    x_scales = torch.empty(tokens, _groups(spec.hidden), dtype=torch.float32, device=device)
    kernels["moe_quantize_e4m3_kernel"][(-(-tokens // QUANTIZE_ROWS), _groups(spec.hidden))](
        hidden, x8, x_scales, hidden.stride(0), tokens, K=spec.hidden, ROWS=QUANTIZE_ROWS, REORDER=True, num_warps=4)
    if options["WORKSPACE"]:
        weight_bytes = workspace_elements(spec, tokens)  # one byte per E4M3 element
        # Block scales after the E4M3 bytes, 16-byte aligned.
        scales_offset = -(-weight_bytes // 16) * 16
        slots = min(spec.experts, tokens * spec.top_k)
        scale_count = slots * max(2 * spec.inter * _groups(spec.hidden), spec.hidden * _groups(spec.inter))
        ws = workspace(device, torch.uint8, scales_offset + 4 * scale_count)
        ws_values, ws_scales = ws[:weight_bytes], ws[scales_offset:].view(torch.float32)
        _convert_experts(kernels, w13_blocks, w13_scales, plan, ws_values, ws_scales, 2 * spec.inter, spec.hidden,
                         spec)
    else:  # online: any pointers will do, the GEMMs never read them
        ws_values, ws_scales = x8, x_scales
    bias = [b if b is not None else hidden for b in (w13_bias, w2_bias)]  # absent: never read
    kernels["moe_gate_up_kernel"][(_tiles(plan, spec.inter, options["BLOCK_N"]), 1)](
        x8.view(e4m3), plan.sorted_pairs, plan.block_expert, plan.block_row_start, plan.block_row_end,
        plan.expert_slots, w13_blocks, w13_scales, ws_values.view(e4m3), bias[0], act, pair_out, x_scales, ws_scales,
        alpha, limit, pairs, w13_blocks, w13_blocks, **options)
    act8 = torch.empty(pairs, spec.inter, dtype=torch.uint8, device=device)
    act_scales = torch.empty(pairs, _groups(spec.inter), dtype=torch.float32, device=device)
    kernels["moe_quantize_e4m3_kernel"][(-(-pairs // QUANTIZE_ROWS), _groups(spec.inter))](
        act, act8, act_scales, act.stride(0), pairs, K=spec.inter, ROWS=QUANTIZE_ROWS, REORDER=False, num_warps=4)
    if options["WORKSPACE"]:
        _convert_experts(kernels, w2_blocks, w2_scales, plan, ws_values, ws_scales, spec.hidden, spec.inter, spec)
    kernels["moe_down_kernel"][(_tiles(plan, spec.hidden, options["BLOCK_N"]), 1)](
        act8.view(e4m3), plan.sorted_pairs, plan.block_expert, plan.block_row_start, plan.block_row_end,
        plan.expert_slots, w2_blocks, w2_scales, ws_values.view(e4m3), bias[1], topk_weights.reshape(-1), pair_out,
        act_scales, ws_scales, pairs, w2_blocks, **options)


def _tiles(plan: Routing, columns: int, block_n: int) -> int:
    """Grid axis 0 of a GEMM: its row blocks x column blocks, the column blocks of a row block consecutive (the
    kernels' _tile); split-K slices are axis 1."""
    return plan.max_blocks * -(-columns // block_n)


def _groups(k: int) -> int:
    """W4A8 scale groups along a reduction of k columns."""
    return -(-k // FP8_GROUP)


def _convert_experts(kernels, blocks, scales, plan: Routing, ws_values, ws_scales, n: int, k: int,
                     spec: "_LaunchShape") -> None:
    grid = (spec.experts, -(-n // DEQUANT_BLOCK_N), _groups(k))
    kernels["mxfp4_to_e4m3_experts_kernel"][grid](blocks, scales, plan.expert_counts, plan.expert_slots, ws_values,
                                                  ws_scales, N=n, K=k, BLOCK_N=DEQUANT_BLOCK_N,
                                                  num_warps=DEQUANT_NUM_WARPS)


@dataclass(frozen=True)
class _LaunchShape:
    """The sizes a launch needs, read from its arguments (the generated source holds the rest of the spec)."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    hidden_dtype: torch.dtype

    @staticmethod
    def of(hidden: torch.Tensor, topk_ids: torch.Tensor, w13_scales: torch.Tensor) -> "_LaunchShape":
        experts, two_i, _ = w13_scales.shape
        return _LaunchShape(hidden.shape[1], two_i // 2, experts, topk_ids.shape[1], hidden.dtype)

    @property
    def workspace_dtype(self) -> torch.dtype:
        """The dequantized weights' dtype: the Triton GEMMs' operand type (see MXFP4MoESpec.dot_fp32)."""
        return torch.bfloat16 if self.hidden_dtype == torch.bfloat16 else torch.float32


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def triton_signatures(spec: MXFP4MoESpec, config: KernelConfig) -> dict[str, tuple[dict, dict]]:
    """Per generated kernel, (signature, constexprs[, num_warps if not the config's]) for compiling it ahead of
    time with triton.compile (dzc-selftest --dry-run and the tests do)."""
    x = "*" + _TRITON_TYPES[spec.hidden_dtype]
    ws = "*" + _TRITON_TYPES[_LaunchShape(spec.hidden, spec.inter, spec.experts, spec.top_k,
                                          spec.hidden_dtype).workspace_dtype]
    fp8 = _fp8(config)
    # W4A8: the GEMMs read E4M3 activations and weights (uint8 buffers viewed as float8_e4m3fn).
    operand, weights = ("*fp8e4nv", "*fp8e4nv") if fp8 else (x, ws)
    w13_bias = "*" + _TRITON_TYPES[spec.w13_bias_dtype or spec.hidden_dtype]
    w2_bias = "*" + _TRITON_TYPES[spec.w2_bias_dtype or spec.hidden_dtype]
    tiles = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                 WORKSPACE=_uses_workspace(config), SPLIT_K=_split_k(config), UPCAST_DOT=False, FP8=fp8,
                 TMA=_tma(config), K_STAGES=config.num_stages, DOT_SCALED=_dot_scaled(config),
                 SWAP_AB=_swap_ab(config), FP8_STACKED=_fp8_stacked(config), DECODE=_decode(config),
                 TMA_STACKED=_tma_stacked(config))
    # the weights' TMA descriptors (_tma_sources), else the packed bytes (unread)
    box = (f"i32[1, {config['BLOCK_N']}, {config['BLOCK_K'] // 8}]" if _swap_ab(config)
           else f"u8[1, {config['BLOCK_N']}, {config['BLOCK_K'] // 2}]")
    source = f"tensordesc<{box}>" if _tma(config) else "*u8"
    # TMA_STACKED: the gate/up GEMM's one descriptor has boxes of 2 * BLOCK_N interleaved w13 rows (_tma_sources)
    gate_up_source = (f"tensordesc<i32[1, {2 * config['BLOCK_N']}, {config['BLOCK_K'] // 8}]>" if _tma_stacked(config)
                      else source)
    constexprs = {name: "constexpr" for name in tiles}
    schedule = dict(sorted_pairs_ptr="*i32", block_expert_ptr="*i32", block_row_start_ptr="*i32",
                    block_row_end_ptr="*i32", expert_slots_ptr="*i32", w_blocks_ptr="*u8", w_scales_ptr="*u8",
                    workspace_ptr=weights)
    gate_up = dict(x_ptr=operand, **schedule, bias_ptr=w13_bias, act_ptr=x, partial_ptr="*fp32",
                   x_scales_ptr="*fp32", w_block_scales_ptr="*fp32", alpha="fp32", limit="fp32", pairs="i32",
                   gate_source=gate_up_source, up_source=gate_up_source, **constexprs)
    down = dict(act_ptr=operand, **schedule, bias_ptr=w2_bias,
                topk_weights_ptr="*" + _TRITON_TYPES[spec.weights_dtype], pair_out_ptr="*fp32",
                act_scales_ptr="*fp32", w_block_scales_ptr="*fp32", pairs="i32", w_source=source, **constexprs)
    split_activation = dict(partial_ptr="*fp32", block_expert_ptr="*i32", block_row_start_ptr="*i32",
                            block_row_end_ptr="*i32", bias_ptr=w13_bias, act_ptr=x, alpha="fp32", limit="fp32",
                            pairs="i32", BLOCK_M="constexpr", BLOCK_N="constexpr", SPLIT_K="constexpr",
                            ACT_ORDER="constexpr")
    split_tiles = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], SPLIT_K=_split_k(config),
                       ACT_ORDER=_act_order(config))
    reorder = dict(x_ptr=x, out_ptr=x, stride_x="i32", BLOCK="constexpr", ACT_ORDER="constexpr")
    dequant = dict(w_blocks_ptr="*u8", w_scales_ptr="*u8", expert_counts_ptr="*i32", expert_slots_ptr="*i32",
                   workspace_ptr=ws, N="constexpr", K="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr")
    dequant_constexprs = dict(N=2 * spec.inter, K=spec.hidden, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K)
    if fp8:  # the W4A8 path's kernels instead of the W4A16 workspace's and split-K's
        quantize = dict(x_ptr=x, out_ptr="*u8", scales_ptr="*fp32", stride_x="i32", rows_total="i32", K="constexpr",
                        ROWS="constexpr", REORDER="constexpr")
        convert = dict(w_blocks_ptr="*u8", w_scales_ptr="*u8", expert_counts_ptr="*i32", expert_slots_ptr="*i32",
                       workspace_ptr="*u8", block_scales_ptr="*fp32", N="constexpr", K="constexpr",
                       BLOCK_N="constexpr")
        return {"moe_quantize_e4m3_kernel": (quantize, dict(K=spec.hidden, ROWS=QUANTIZE_ROWS, REORDER=True), 4),
                "moe_gate_up_kernel": (gate_up, tiles), "moe_down_kernel": (down, tiles),
                "mxfp4_to_e4m3_experts_kernel": (convert, dict(N=2 * spec.inter, K=spec.hidden,
                                                               BLOCK_N=DEQUANT_BLOCK_N), DEQUANT_NUM_WARPS)}
    return {"moe_reorder_kernel": (reorder, dict(BLOCK=REORDER_BLOCK, ACT_ORDER=_act_order(config)), 4),
            "moe_gate_up_kernel": (gate_up, tiles), "moe_down_kernel": (down, tiles),
            "moe_split_activation_kernel": (split_activation, split_tiles),
            "mxfp4_dequantize_experts_kernel": (dequant, dequant_constexprs, DEQUANT_NUM_WARPS)}


def _dequantize_experts(kernels, blocks, scales, plan: Routing, ws, n: int, k: int, spec: _LaunchShape) -> None:
    grid = (spec.experts, -(-n // DEQUANT_BLOCK_N), -(-k // DEQUANT_BLOCK_K))
    kernels["mxfp4_dequantize_experts_kernel"][grid](blocks, scales, plan.expert_counts, plan.expert_slots, ws,
                                                     N=n, K=k, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K,
                                                     num_warps=DEQUANT_NUM_WARPS)


# ---------------------------------------------------------------------------------------------------------
# TileLang (online dequant only: the workspace path is Triton's)

TILELANG_FACTORY_NAME = "build"
_TILELANG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# bf16 terms that hold an activation exactly (the TileLang kernels multiply bf16 x bf16 only).
_ACTIVATION_TERMS = {torch.bfloat16: 1, torch.float16: 2}
_TILELANG_ACTIVATIONS = {
    "silu_glu": ["return gate / (1.0 + T.exp(-gate)) * up"],
    "clamped_swiglu": [
        "gate = T.if_then_else(gate > limit, limit, gate)",
        "up = T.if_then_else(up > limit, limit, T.if_then_else(up < -limit, -limit, up))",
        "return gate / (1.0 + T.exp(-alpha * gate)) * (up + 1.0)",
    ],
}


def tilelang_supports(spec: MXFP4MoESpec) -> bool:
    """TileLang has the W4A16 online path for bf16 and fp16 activations; W4A8 and fp32 activations are Triton's.

    fp32 activations (three stacked bf16 terms, or four) gave wrong products in both GEMMs on the H200 (2026-12-01,
    TileLang 0.1.15, tools/diagnose_mxfp4_moe_numerics.py: every output element, with the bf16 and fp16 cases of
    the same run exact); the CUDA TileLang emits for them reads consistently, and the cause is not found yet."""
    return not spec.fp8_activations and spec.hidden_dtype in _ACTIVATION_TERMS


def tilelang_source(spec: MXFP4MoESpec, profile: DeviceProfile) -> str:
    if not tilelang_supports(spec):
        raise ValueError(f"mxfp4_moe: no TileLang kernel for {spec.describe()} (W4A8 and fp32 activations are "
                         "Triton's); use codegen='triton'")
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"mxfp4_moe: no kernel for activation {spec.activation!r}")
    fields = _template_fields(spec, profile)
    fields.update(
        x_tl_dtype=_TILELANG_DTYPES[spec.hidden_dtype], weights_tl_dtype=_TILELANG_DTYPES[spec.weights_dtype],
        # An absent bias is passed as fp32 zeros.
        w13_bias_tl_dtype=_TILELANG_DTYPES[spec.w13_bias_dtype or torch.float32],
        w2_bias_tl_dtype=_TILELANG_DTYPES[spec.w2_bias_dtype or torch.float32],
        activation_terms=_ACTIVATION_TERMS[spec.hidden_dtype],
        activation_code="\n    ".join(_TILELANG_ACTIVATIONS[spec.activation]))
    return Template((TEMPLATES / "mxfp4_moe.tilelang.py.tmpl").read_text()).substitute(fields)


def tilelang_configs(spec: MXFP4MoESpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Row block x column block x K step x threads x stages, already pruned to what is legal on `profile`.

    T.gemm needs whole warps along M and N; threads are whole warps of the profile (one 128-lane QY2 warp is four
    32-lane ones). Row blocks of 16 serve decode, 64 prefill-sized groups."""
    if not tilelang_supports(spec):
        return []
    configs = []
    for block_m, block_n, block_k, threads, stages in (
            [(16, n, k, t, s) for n in (64, 128) for k in (64, 128) for t in (128, 256) for s in (1, 2)]
            + [(64, n, 64, t, s) for n in (64, 128) for t in (128, 256) for s in (1, 2)]):
        if threads % profile.warp_size:
            continue
        config = KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=stages, BLOCK_M=block_m,
                                   BLOCK_N=block_n, BLOCK_K=block_k, THREADS=threads, NUM_STAGES=stages)
        if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
            configs.append(config)
    return configs + _warp_specialized_configs(spec, profile)


# WARP_SPECIALIZED=1 (the template's _warp_specialized; issue 15; a tuning candidate, never the untuned choice: it has
# not run on a GPU): a block is 128 rows of one expert's row block x BLOCK_N decoded weight rows (gate/up: BLOCK_N / 2
# outputs, their gate and their up rows; down: BLOCK_N outputs). A producer warpgroup loads each 64-wide K step's
# packed E2M1 bytes (16-byte loads) and E8M0 scales, decodes them in registers (whole words: a byte permute, a
# multiply-and-mask, one bf16x2 multiply a pair of values, two for scales past 2) and stores them to a ring stage as
# 16-byte vectors, with the block's activation rows gathered into the same stage by 16-byte cp.async; two consumer
# warpgroups (64 rows each) run wgmma from shared memory over the ring (full / empty mbarriers); the epilogue is the
# untuned kernel's. Its THREADS are the block's three warpgroups (num_warps 12).
WS_BLOCK_M = 128
WS_BLOCK_K = 64
WS_THREADS = 384
WS_BLOCK_NS = (128, 256)
WS_STAGES = (2, 4)


def warp_specialization_problems(spec: MXFP4MoESpec, profile: DeviceProfile) -> list[str]:
    """Why WARP_SPECIALIZED=1 is not offered for `spec` on `profile`; empty where it is."""
    problems = []
    if not tilelang_supports(spec):
        problems.append(f"no TileLang mxfp4_moe kernel for {spec.describe()}")
    elif spec.hidden_dtype != torch.bfloat16:
        problems.append("WARP_SPECIALIZED=1 multiplies bf16 activations as they are (one wgmma operand, copied by "
                        f"cp.async): {str(spec.hidden_dtype).removeprefix('torch.')} activations are not bf16")
    for name, k in (("H", spec.hidden), ("I", spec.inter)):
        if k % WS_BLOCK_K:
            problems.append(f"WARP_SPECIALIZED=1 has no K tail: {name}={k} is not a multiple of its K step "
                            f"{WS_BLOCK_K}")
    return problems + profile_ws_problems(profile, "WARP_SPECIALIZED=1")


def _warp_specialized_configs(spec: MXFP4MoESpec, profile: DeviceProfile) -> list[KernelConfig]:
    if warp_specialization_problems(spec, profile):
        return []
    configs = []
    for block_n in WS_BLOCK_NS:
        for stages in WS_STAGES:
            config = KernelConfig.make(num_warps=WS_THREADS // profile.warp_size, num_stages=stages,
                                       BLOCK_M=WS_BLOCK_M, BLOCK_N=block_n, BLOCK_K=WS_BLOCK_K, THREADS=WS_THREADS,
                                       NUM_STAGES=stages, WARP_SPECIALIZED=1)
            if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                configs.append(config)
    return configs


def warp_specialized(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("WARP_SPECIALIZED", 0))


def tilelang_default_config(spec: MXFP4MoESpec, profile: DeviceProfile) -> KernelConfig:
    configs = tilelang_configs(spec, profile)
    if not configs:
        raise ValueError(f"no legal TileLang mxfp4_moe config for {spec.describe()} on {profile.name}")
    return configs_for_bucket(spec, profile, 1, configs, configs[0])[1]


# The token buckets whose untuned TileLang choices tilelang_codegen.load builds ahead: 1 to 2^20 tokens a call.
_PREBUILT_BUCKETS = tuple(1 << i for i in range(21))


def tilelang_prebuilt_configs(spec: MXFP4MoESpec, profile: DeviceProfile) -> list[KernelConfig]:
    """What tilelang_codegen.load starts building ahead: the untuned choice of every token bucket (decode's, the
    default, first). A prefill's (the warp-specialized kernel from 4096 tokens of gpt-oss-120b) was otherwise built
    in-process at its first call, ~30 s into a model's first prefill."""
    configs, default = tilelang_configs(spec, profile), tilelang_default_config(spec, profile)
    chosen = [default]
    for bucket in _PREBUILT_BUCKETS:
        config = configs_for_bucket(spec, profile, bucket, configs, default)[1]
        if config not in chosen:
            chosen.append(config)
    return chosen


def tilelang_shared_memory_bytes(spec: MXFP4MoESpec, config: KernelConfig) -> int:
    """Per stage the activation tile (its bf16 terms stacked) and the two decoded weight tiles (gate and up), bf16;
    then the two fp32 accumulators staged for the epilogue, and the row -> token table. WARP_SPECIALIZED=1: per stage
    the 128 activation rows and BLOCK_N decoded weight rows (bf16), and 2 mbarriers, plus 1 KiB for alignment."""
    if warp_specialized(config):
        return config["NUM_STAGES"] * ((WS_BLOCK_M + config["BLOCK_N"]) * WS_BLOCK_K * 2 + 16) + 1024
    rows = _ACTIVATION_TERMS[spec.hidden_dtype] * config["BLOCK_M"]
    tiles = (rows + 2 * config["BLOCK_N"]) * config["BLOCK_K"] * 2
    return max(config["NUM_STAGES"], 1) * tiles + 2 * rows * config["BLOCK_N"] * 4 + 4 * config["BLOCK_M"]


_ZERO_BIASES: dict[tuple, torch.Tensor] = {}


def _bias_or_zeros(bias, experts: int, rows: int, device) -> torch.Tensor:
    """The bias, or cached fp32 zeros of its shape (TileLang kernels always add one)."""
    if bias is not None:
        return bias
    key = (torch.device(device), experts, rows)
    if key not in _ZERO_BIASES:
        _ZERO_BIASES[key] = torch.zeros(experts, rows, dtype=torch.float32, device=device)
    return _ZERO_BIASES[key]


TILELANG_KERNELS = ("moe_gate_up", "moe_down")  # the factory's gemm=0 and gemm=1


def tilelang_kernel_configs(spec: MXFP4MoESpec, config: KernelConfig) -> dict[str, KernelConfig]:
    """Kernel name -> factory config of the two TileLang GEMMs one tuning config launches (they share its tiles)."""
    return {name: KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), GEMM=gemm)
            for gemm, name in enumerate(TILELANG_KERNELS)}


def tilelang_launch(compiled, config: KernelConfig, hidden, topk_ids, topk_weights, w13_blocks, w13_scales,
                    w13_bias, w2_blocks, w2_scales, w2_bias, alpha, limit, interleaved, fp8, out):
    """Route (Triton routing kernels), both TileLang GEMMs with online dequant, combine into `out`. (`interleaved`
    is in the generated source already.)

    `compiled` is what tilelang_codegen.load returns; the packed weights are passed as [E, N, K/2] bytes."""
    if _uses_workspace(config) or fp8:
        raise ValueError("the TileLang mxfp4_moe kernels have no workspace or W4A8 path (use codegen='triton')")
    shape = _LaunchShape.of(hidden, topk_ids, w13_scales)
    pairs = hidden.shape[0] * shape.top_k
    ids = topk_ids.reshape(-1)
    plan = route(ids, shape.experts, config["BLOCK_M"])
    act = torch.empty(pairs, shape.inter, dtype=hidden.dtype, device=hidden.device)
    pair_out = torch.empty(pairs, shape.hidden, dtype=torch.float32, device=hidden.device)
    schedule = (plan.sorted_pairs, plan.block_expert, plan.block_row_start, plan.block_row_end)
    gate_up_config, down_config = tilelang_kernel_configs(None, config).values()
    # TileLang compiles for dense tensors at 16-byte-aligned bases (its loads are vectorised): offset or strided
    # views are copied first (act and pair_out are fresh, so they pass as they are).
    gate_up = tilelang_codegen.launch_arguments(
        (hidden, *schedule, w13_blocks.flatten(2), w13_scales,
         _bias_or_zeros(w13_bias, shape.experts, 2 * shape.inter, hidden.device)), (act,), (float(alpha), float(limit)))
    gate_up.launch(compiled.kernel_for(gate_up_config))
    down = tilelang_codegen.launch_arguments(
        (act, *schedule, w2_blocks.flatten(2), w2_scales,
         _bias_or_zeros(w2_bias, shape.experts, shape.hidden, hidden.device), topk_weights.reshape(-1)), (pair_out,))
    down.launch(compiled.kernel_for(down_config))
    combine(pair_out, ids, shape, out)


# ---------------------------------------------------------------------------------------------------------
# Self-test cases: small random problems that exercise every path (dzc-selftest runs them on a device)


def random_moe_args(device, generator: torch.Generator, *, tokens: int, hidden: int, inter: int, experts: int,
                    top_k: int, dtype: torch.dtype = torch.bfloat16, activation: str = "clamped_swiglu",
                    interleaved: bool = True, bias: bool = True, skew: float = 0.0,
                    weights_dtype: torch.dtype = torch.float32) -> tuple:
    """The op's arguments (without kernel_id) for a random MoE layer: weights quantized from random floats by
    dzc.mxfp4.quantize, distinct top-k experts per token; with `skew` > 0, expert 0 is favoured (skew=3 sends it
    nearly every token). Built with `generator` on its device, then moved to `device`."""
    on = dict(generator=generator, device=generator.device)

    def weight(n, k):
        # Rows of varied magnitude, so that the blocks' scales differ.
        w = torch.randn(experts, n, k, **on) * torch.exp2(torch.randint(-4, 2, (experts, n, 1), **on).float())
        return mxfp4.quantize(w * k ** -0.5)

    w13_blocks, w13_scales = weight(2 * inter, hidden)
    w2_blocks, w2_scales = weight(hidden, inter)
    logits = torch.randn(tokens, experts, **on)
    logits[:, 0] += skew * 4
    top_logits, topk_ids = logits.topk(top_k, dim=-1)
    topk_weights = torch.softmax(top_logits, dim=-1).to(weights_dtype)
    x = torch.randn(tokens, hidden, **on).to(dtype)
    w13_bias = torch.randn(experts, 2 * inter, **on).to(dtype) if bias else None
    w2_bias = torch.randn(experts, hidden, **on).to(dtype) if bias else None
    tensors = [x, topk_ids.to(torch.int32), topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales,
               w2_bias]
    tensors = [None if t is None else t.to(device) for t in tensors]
    return (*tensors, activation, interleaved, 1.702, 7.0)


def selftest_cases(profile: DeviceProfile) -> list[tuple[str, Callable[[torch.device, torch.Generator], tuple]]]:
    """Named small cases, each building the op's arguments (without kernel_id) from fresh random inputs.

    Shapes are tiny multiples of 32 with H != I != a power of two where it matters (K tails); token counts cover
    decode (1), a few rows per expert (5), several row blocks with one dominant expert (37, skewed) and a prefill
    size (128 rows per expert, where the W4A8 op quantizes)."""
    dtypes = [d for d in (torch.bfloat16, torch.float16, torch.float32) if profile.supports_dtype(d)]
    cases = []

    def case(name, **kwargs):
        cases.append((name, lambda device, generator, kw=kwargs: random_moe_args(device, generator, **kw)))

    for dtype in dtypes:
        short = str(dtype).removeprefix("torch.")
        case(f"gptoss-{short}-T1", tokens=1, hidden=96, inter=64, experts=4, top_k=2, dtype=dtype)
        case(f"gptoss-{short}-T5", tokens=5, hidden=96, inter=64, experts=4, top_k=2, dtype=dtype)
    case("silu-concat-nobias-T37-skewed", tokens=37, hidden=64, inter=96, experts=6, top_k=3,
         activation="silu_glu", interleaved=False, bias=False, skew=3.0)
    case("gptoss-T37-skewed-bf16-weights", tokens=37, hidden=96, inter=64, experts=5, top_k=2, skew=3.0,
         weights_dtype=torch.bfloat16)
    # 128 rows per expert: the W4A8 op quantizes here (dzc.ops.mxfp4_moe.fp8_applies), below it is W4A16.
    case("gptoss-T128-prefill-rows", tokens=128, hidden=64, inter=64, experts=2, top_k=2)
    return cases
