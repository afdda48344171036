"""Kernels for dzc.varlen_attention: packed variable-length (vision) attention, forward, non-causal.

One launch covers the whole pack: q, k, v are [tokens, heads, head_dim] with the segments (images, windows)
delimited by cu_seqlens; every (query block, head) of every segment is one program, so long and short images
share the GPU. Flash-attention style: a query tile stays on chip while key/value tiles stream through, with an
online softmax in fp32 (exp2, log2(e) folded into the scale). Optional rotary embedding (HF's vision
convention) is applied to q and k tiles as they load.

Head dims 72 and 80 are not powers of two. Triton tiles must be, so its kernel may split the head dim into a
power-of-two part and a remainder of >= 16 columns (80 = 64 + 16, 72 = 64 + 16 masked): two dots instead of
one padded to 128. TileLang tiles take any multiple of 16, so its kernel pads to the next multiple of 16
(72 -> 80, 80 -> 80, 128 -> 128).

Tuning is bucketed on the longest segment (max_seqlen), not the pack size: the best tile depends on how long
the segments are (64-token windows want small query blocks, 4K-patch images large ones). Kernels read
cu_seqlens on the device only (no host sync) and never rely on max_seqlen to cover every row; cu_seqlens'
values are validated by the op's reference, not here (that would need a sync per call).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import torch

from dzc import ir
from dzc.ops.varlen_attention import check_varlen_attention_args
from dzc.targets import tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import config_problems, tilelang_config_legal
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

# Candidates never run on a GPU, (params, why): out of users' tuning (launch.tuning_candidates).
# (OVERLAP=1's numerics passed on an H100 in session 39; TileLang's LONGEST_FIRST=1 in session 47, Triton's in
# session 52.)
UNVALIDATED = ()

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenAttentionSpec:
    """Everything a kernel is specialised on; token, segment and head counts and the scale are run-time."""

    head_dim: int
    dtype: torch.dtype  # of q, k, v and the output
    rope_dtype: torch.dtype | None  # of cos and sin; None: no rotary embedding
    # Text decoders' attention (dzc.ops.varlen_attention): causal against query positions (with a local window,
    # its size a run-time argument), per-head sinks, fewer KV heads than query heads, keys of their own segments.
    causal: bool = field(default=False, kw_only=True)
    sinks: bool = field(default=False, kw_only=True)
    grouped: bool = field(default=False, kw_only=True)
    own_keys: bool = field(default=False, kw_only=True)

    @property
    def rope(self) -> bool:
        return self.rope_dtype is not None

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.dtype,) + ((self.rope_dtype,) if self.rope else ())

    @property
    def extras(self) -> str:
        """The text-decoder parts this spec uses ('' for vision attention)."""
        parts = (("causal+window", self.causal), ("sinks", self.sinks), ("grouped kv", self.grouped),
                 ("own key segments", self.own_keys))
        return " ".join(name for name, used in parts if used)

    def describe(self) -> str:
        rope = f"rope={str(self.rope_dtype).removeprefix('torch.')}" if self.rope else "rope=none"
        return f"head_dim={self.head_dim} dtype={str(self.dtype).removeprefix('torch.')} {rope}" \
               f"{self.extras and ' ' + self.extras}"


def make_spec(head_dim: int, dtype: torch.dtype, rope_dtype: torch.dtype | None, **extras) -> VarlenAttentionSpec:
    """The spec, or a ValueError naming what no kernel supports."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"varlen_attention kernels support q/k/v dtypes {_SUPPORTED_DTYPES}, got {dtype}")
    if rope_dtype is not None:
        if rope_dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"varlen_attention kernels support cos/sin dtypes {_SUPPORTED_DTYPES}, got {rope_dtype}")
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim (rotate_half), got {head_dim}")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"varlen_attention kernels support head dims 16..256, got {head_dim}")
    return VarlenAttentionSpec(head_dim, dtype, rope_dtype, **extras)


def spec_from_node(node) -> VarlenAttentionSpec:
    arguments = {name: value.meta["val"] if isinstance(value, torch.fx.Node) else value
                 for name, value in ir.call_arguments(node).items() if name != "kernel_id"}
    return spec_from_arguments(**arguments)


def spec_from_arguments(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k=None, query_pos=None,
                        window=0, sinks=None) -> VarlenAttentionSpec:
    """The spec of a call (real or fake tensors)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"varlen_attention needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if (cos is None) != (sin is None):
        raise ValueError("varlen_attention takes cos and sin together or neither")
    rope_dtype = None
    if cos is not None:
        if cos.dtype != sin.dtype:
            raise ValueError(f"varlen_attention needs cos and sin of one dtype, got {cos.dtype}, {sin.dtype}")
        rope_dtype = cos.dtype
    return make_spec(int(q.shape[-1]), q.dtype, rope_dtype, causal=query_pos is not None, sinks=sinks is not None,
                     grouped=int(k.shape[1]) != int(q.shape[1]), own_keys=cu_seqlens_k is not None)


def flops(head_dim: int, heads: int, lengths) -> int:
    """Useful FLOPs of one call: two [L, L] x [L, D] matmuls per segment and head, non-causal."""
    return sum(4 * heads * length * length * head_dim for length in lengths)


def bytes_moved(spec: VarlenAttentionSpec, tokens: int, heads: int) -> int:
    """Fewest bytes one call must move: read q, k, v and write the output once (plus cos and sin)."""
    rope = 2 * tokens * spec.head_dim * spec.rope_dtype.itemsize if spec.rope else 0
    return 4 * tokens * heads * spec.head_dim * spec.dtype.itemsize + rope


def token_bucket(max_seqlen: int) -> int:
    """Tuning results are kept per power-of-two bucket of the longest segment (what `prepare` reports)."""
    return 1 << max(max_seqlen - 1, 0).bit_length()


def prepare(spec: VarlenAttentionSpec, q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k=None,
            query_pos=None, window=0, sinks=None):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated), work size for the tuning bucket, results).

    The work size is max_seqlen (0 for an empty pack, which launches nothing)."""
    check_varlen_attention_args(q, k, v, cu_seqlens, max_seqlen, cos, sin, cu_seqlens_k, query_pos, window, sinks)
    # The call's spec, its dtypes aside (checked below, each with its own message).
    call = dataclasses.replace(spec_from_arguments(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k,
                                                   query_pos, window, sinks), dtype=spec.dtype,
                               rope_dtype=spec.rope_dtype)
    if call != spec:
        raise ValueError(f"varlen_attention kernel for {spec.describe()} got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}: {call.describe()}")
    if not (q.dtype == k.dtype == v.dtype == spec.dtype):
        raise ValueError(f"varlen_attention kernel for {spec.dtype} got q/k/v {q.dtype}/{k.dtype}/{v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [segments + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if (cos is None) != (not spec.rope) or (sin is None) != (not spec.rope):
        raise ValueError(f"varlen_attention kernel built {'with' if spec.rope else 'without'} rotary embedding "
                         f"got cos={'a tensor' if cos is not None else None}, "
                         f"sin={'a tensor' if sin is not None else None}")
    if spec.rope:
        expected = (q.shape[0], spec.head_dim)
        if cos.shape != expected or sin.shape != expected or cos.dtype != spec.rope_dtype \
                or sin.dtype != spec.rope_dtype:
            raise ValueError(f"cos and sin must be {spec.rope_dtype} [{expected[0]}, {expected[1]}], got "
                             f"{cos.dtype} {tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
    # Kernels take a token stride and dense [heads, head_dim] rows (the q/k/v slices of a fused qkv
    # projection are); anything else is copied.
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == spec.head_dim else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=spec.dtype, device=q.device)
    # Kernels never trust max_seqlen for coverage (a wrong one costs speed, not results); >= 1 keeps a pack
    # with tokens from looking empty.
    work = max(int(max_seqlen), 1) if q.shape[0] and q.shape[1] else 0
    # Absent optional tensors: pointers the Triton kernel never reads (CAUSAL / HAS_SINKS off; cu_seqlens stands
    # in for the keys' own segments).
    cu_seqlens = cu_seqlens.contiguous()
    extras = (cu_seqlens_k.contiguous() if cu_seqlens_k is not None else cu_seqlens,
              query_pos.contiguous() if query_pos is not None else cu_seqlens,
              int(window), sinks.contiguous() if sinks is not None else cu_seqlens)
    inputs = (q, k, v, cu_seqlens, int(max_seqlen), float(sm_scale), cos, sin, *extras)
    return inputs, (out,), work, out


# dzc-selftest's (atol, rtol) for outputs against the reference: an output element is a convex combination of v
# values (|v| up to ~4 for normal inputs), and the probabilities enter the second matmul rounded to the 16-bit
# dtype (relative error 2^-8 for bf16): about two bf16 units at |v| = 4.
SELFTEST_TOLERANCES = {torch.bfloat16: (4e-2, 2**-6), torch.float16: (4e-3, 2e-3)}


def selftest_cases(profile: DeviceProfile) -> list[tuple[str, Callable[[torch.device, torch.Generator], tuple]]]:
    """Named small cases for dzc-selftest, each building the op's arguments (without kernel_id) with fresh random
    inputs on a device: uneven packs with lengths that are not block multiples, the model head dims, RoPE."""
    dtype = torch.bfloat16 if profile.supports_dtype(torch.bfloat16) else torch.float16

    def case(lengths: tuple[int, ...], heads: int, head_dim: int, rope: bool):
        def build(device: torch.device, generator: torch.Generator) -> tuple:
            return random_pack(lengths, heads, head_dim, dtype, rope, device, generator)
        return build

    return [
        ("one image, head_dim 80", case((200,), 2, 80, False)),
        ("uneven pack (1, 200, 7, 64, 130), head_dim 72, rope", case((1, 200, 7, 64, 130), 2, 72, True)),
        ("64-token windows, head_dim 80, rope", case((64,) * 6 + (17,), 2, 80, True)),
        ("two images, head_dim 128", case((100, 157), 2, 128, False)),
    ]


def random_pack(lengths, heads: int, head_dim: int, dtype: torch.dtype, rope: bool, device, generator,
                rope_dtype: torch.dtype = torch.float32) -> tuple:
    """The op's arguments for a pack of segments of `lengths`, drawn from `generator` (on the generator's device,
    then moved to `device`). cos/sin are HF-style: angles of per-position frequencies, duplicated over the two
    halves of the head dim."""
    tokens = sum(lengths)
    source = generator.device
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=generator, device=source).to(device, dtype)
               for _ in range(3))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    cos = sin = None
    if rope:
        inverse_frequency = 1.0 / 10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float32) / (head_dim // 2))
        positions = torch.randint(0, 64, (tokens,), generator=generator, device=source).float().cpu()
        angles = torch.outer(positions, inverse_frequency)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(device, rope_dtype), angles.sin().to(device, rope_dtype)
    return q, k, v, cu_seqlens, max(lengths, default=0), 1.0 / math.sqrt(head_dim), cos, sin


def random_decoder_pack(q_lengths, k_lengths, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        window: int, sinks: bool, device, generator) -> tuple:
    """The op's arguments for text-decoder attention: segments of q_lengths queries over k_lengths keys each (a KV
    cache: the queries are the last ones, query_pos = k_len - q_len + i; keys of their own segments when the
    lengths differ), kv_heads KV heads, a local window (0: none), random per-head sinks or None."""
    source = generator.device
    q = torch.randn(sum(q_lengths), heads, head_dim, generator=generator, device=source).to(device, dtype)
    k, v = (torch.randn(sum(k_lengths), kv_heads, head_dim, generator=generator, device=source).to(device, dtype)
            for _ in range(2))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lengths)], dtype=torch.int32, device=device)
    cu_seqlens_k = None
    if list(q_lengths) != list(k_lengths):
        cu_seqlens_k = torch.tensor([0, *itertools.accumulate(k_lengths)], dtype=torch.int32, device=device)
    query_pos = torch.cat([torch.arange(k_len - q_len, k_len, dtype=torch.int32)
                           for q_len, k_len in zip(q_lengths, k_lengths)]).to(device)
    sink_logits = (torch.randn(heads, generator=generator, device=source) * 2).to(device) if sinks else None
    return (q, k, v, cu_seqlens, max(q_lengths, default=0), 1.0 / math.sqrt(head_dim), None, None, cu_seqlens_k,
            query_pos, window, sink_logits)


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAME = "varlen_attention_kernel"

_TL_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def triton_source(spec: VarlenAttentionSpec, profile: DeviceProfile) -> str:
    fields = dict(
        profile=profile.name, head_dim=spec.head_dim, dtype=spec.dtype, rope=spec.rope, rope_dtype=spec.rope_dtype,
        extras=f"with {spec.extras}" if spec.extras else "non-causal, one KV head per query head",
        # fp32 inputs are computed in fp32 (Triton's default would be TF32 on tensor cores).
        input_precision='"ieee"' if spec.dtype == torch.float32 else "None",
    )
    return Template((TEMPLATES / "varlen_attention.triton.py.tmpl").read_text()).substitute(fields)


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def triton_head_splits(head_dim: int) -> list[tuple[int, int]]:
    """(D_LO, D_HI) tilings of the head dim: one padded power-of-two tile, and where it saves columns, a
    power-of-two part plus a remainder tile of >= 16 columns (tl.dot's smallest size)."""
    padded = (_power_of_two_at_least(head_dim), 0)
    low = 1 << (head_dim.bit_length() - 1)
    if low == head_dim:
        return [padded]
    split = (low, _power_of_two_at_least(max(16, head_dim - low)))
    return [padded, split] if sum(split) < sum(padded) else [padded]


def triton_configs(spec: VarlenAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Query block × key block × warps × pipeline stages × head-dim tiling, before legality pruning.

    A warp's tensor-core tile covers 16 query rows, so num_warps * 16 <= BLOCK_M. Grouped KV heads add the packed
    variant of each (PACK_GQA: a program's rows are (query, head of the group) pairs); vision attention the
    LONGEST_FIRST=1 twins."""
    configs = []
    for pack in _pack_choices(spec):
        for d_lo, d_hi in triton_head_splits(spec.head_dim):
            for block_m, block_n, num_warps in ((64, 32, 4), (64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)):
                if _miscompiled(d_hi, block_n):
                    continue
                for num_stages in (1, 2, 3):
                    configs.append(KernelConfig.make(num_warps=num_warps, num_stages=num_stages, BLOCK_M=block_m,
                                                     BLOCK_N=block_n, D_LO=d_lo, D_HI=d_hi, **pack))
            # The smallest tile, unpipelined, for tight shared memory (fp32 with RoPE on mp_22's 72 KiB).
            configs.append(KernelConfig.make(num_warps=2, num_stages=1, BLOCK_M=32, BLOCK_N=16, D_LO=d_lo, D_HI=d_hi,
                                             **pack))
    if not spec.extras:
        # Vision attention: each tile of 64+ rows with LONGEST_FIRST=1 (the segments longest first, as TileLang's
        # twin, 1.02-1.06x on an H100), a tuning candidate once its GPU numerics pass (UNVALIDATED).
        configs += [_longest_first_twin(c) for c in configs if c["BLOCK_M"] >= 64]
    return configs


def _pack_choices(spec: VarlenAttentionSpec) -> list[dict]:
    """The PACK_GQA values a spec's configs take, preferred first: packed for grouped KV heads (each K/V tile read
    once per group; a decode step's single query fills the MMA rows with the group's heads), the parameter absent
    otherwise (the vision specs' configs are unchanged)."""
    return [dict(PACK_GQA=1), dict(PACK_GQA=0)] if spec.grouped else [{}]


def _miscompiled(d_hi: int, block_n: int) -> bool:
    """Tilings Triton 3.6 miscompiles for sm_90 (seen on the H200): the split head dim (64 + 16) with 64-key blocks.
    On 4 warps it faulted at one pipeline stage (compute-sanitizer: out-of-range shared address in a reduction)
    and returned NaN at two (2026-11-29); on 8 warps, a pack of 64-token windows ending in a 17-token one came
    out wrong in that last window at two stages and faulted at one (2026-11-30, tools/
    diagnose_varlen_attention_configs.py). Every 32-key split tiling and every padded tiling ran correctly on the
    same packs. An autotuner that times every legal config must never launch them (a fault kills the process)."""
    return d_hi > 0 and block_n >= 64


def _legal_triton(spec: VarlenAttentionSpec, profile: DeviceProfile, config: KernelConfig) -> bool:
    return not config_problems(profile, threads=config.num_warps * profile.warp_size, num_warps=config.num_warps,
                               shared_memory_bytes=triton_shared_memory_bytes(spec, config), dtypes=spec.dtypes)


def triton_default_config(spec: VarlenAttentionSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: the narrowest head-dim tiling, with the first tile in order of preference that Triton
    compiles correctly for it and that is legal (128-row query blocks first, falling back to smaller tiles where
    shared memory is short). On the H200 (head dim 80, mixed pack) the split tiling on 64 x 32 tiles with 3
    stages ran 1.4x faster than the padded one on 128 x 64 (docs/results/vision_attention_h200.md)."""
    preferred = [(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 1), (32, 16, 2, 1)]
    for d_lo, d_hi in sorted(triton_head_splits(spec.head_dim), key=sum):
        for block_m, block_n, num_warps, num_stages in preferred:
            if _miscompiled(d_hi, block_n):
                continue
            config = KernelConfig.make(num_warps=num_warps, num_stages=num_stages, BLOCK_M=block_m,
                                       BLOCK_N=block_n, D_LO=d_lo, D_HI=d_hi, **_pack_choices(spec)[0])
            if _legal_triton(spec, profile, config):
                return config
    raise ValueError(f"no legal Triton varlen_attention config for {spec.describe()} on {profile.name}")


def triton_shared_memory_bytes(spec: VarlenAttentionSpec, config: KernelConfig) -> int:
    """Upper estimate of what Triton allocates: the q tile, and per pipeline stage (at least one) a buffer for
    every tile the loop loads: k and v, and with RoPE also k's rotation partner, cos and sin. Checked against
    compiled kernels' metadata.shared by the tests; on sm_90 without RoPE it is exact (q + stages × (k + v))."""
    width = config["D_LO"] + config["D_HI"]
    item = spec.dtype.itemsize
    loaded_per_stage = 2 * config["BLOCK_N"] * width * item
    if spec.rope:
        loaded_per_stage += config["BLOCK_N"] * width * (item + 2 * spec.rope_dtype.itemsize)
    return config["BLOCK_M"] * width * item + max(1, config.num_stages) * loaded_per_stage


def triton_divisible_arguments(spec: VarlenAttentionSpec) -> tuple[str, ...]:
    """Arguments a real launch has Triton specialise as multiples of 16 (for ahead-of-time compiles that match
    it): pointers from torch's allocator, and token strides of dense [tokens, heads, head_dim] tensors whose
    heads * head_dim is a multiple of 16 (16 heads of 72 or 80)."""
    pointers = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "cu_seqlens_ptr", "segment_order_ptr") + (
        ("cos_ptr", "sin_ptr") if spec.rope else ())
    return pointers + ("stride_q_token", "stride_k_token", "stride_v_token", "stride_out_token")


def triton_launch(kernel, config: KernelConfig, q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, cu_seqlens_k,
                  query_pos, window, sinks, out):
    """Launch over (query blocks, heads). The block count is an upper bound computed from shapes alone
    (sum over segments of ceil(len / BLOCK_M) <= (tokens + segments * (BLOCK_M - 1)) / BLOCK_M), so nothing
    waits for cu_seqlens' values; max_seqlen is not trusted for the grid."""
    block_m = config["BLOCK_M"]
    tokens, heads = q.shape[0], q.shape[1]
    segments = cu_seqlens.shape[0] - 1
    pack = _packs_gqa(config)  # rows are (query, head of a KV group) pairs, one program per KV head
    group = heads // k.shape[1] if k.shape[1] else 1
    rows = tokens * group if pack else tokens
    blocks = (rows + segments * (block_m - 1)) // block_m
    if blocks == 0 or heads == 0:
        return
    stride_rope = cos.stride(0) if cos is not None else 0
    longest_first = _longest_first(config)
    order = segments_longest_first(cu_seqlens) if longest_first else cu_seqlens  # (unread stand-in)
    kernel[(blocks, k.shape[1] if pack else heads)](
        q, k, v, out, cu_seqlens, cos, sin, cu_seqlens_k, query_pos, sinks, order, segments, sm_scale, window,
        group, q.stride(0), k.stride(0), v.stride(0), out.stride(0), stride_rope,
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], D_LO=config["D_LO"], D_HI=config["D_HI"],
        CAUSAL=query_pos is not cu_seqlens, HAS_SINKS=sinks is not cu_seqlens, PACK_GQA=pack,
        LONGEST_FIRST=longest_first, num_warps=config.num_warps, num_stages=config.num_stages)


def _longest_first(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("LONGEST_FIRST", 0))


def _packs_gqa(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("PACK_GQA", 0))


def triton_signature(spec: VarlenAttentionSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed)."""
    tensor = "*" + _TL_NAMES[spec.dtype]
    rope = "*" + _TL_NAMES[spec.rope_dtype] if spec.rope else "constexpr"
    signature = {
        "q_ptr": tensor, "k_ptr": tensor, "v_ptr": tensor, "out_ptr": tensor, "cu_seqlens_ptr": "*i32",
        "cos_ptr": rope, "sin_ptr": rope, "cu_seqlens_k_ptr": "*i32", "query_pos_ptr": "*i32",
        "sinks_ptr": "*fp32" if spec.sinks else "*i32", "segment_order_ptr": "*i32", "num_segments": "i32",
        "sm_scale": "fp32", "window": "i32", "group": "i32",
        **{name: "i32" for name in ("stride_q_token", "stride_k_token", "stride_v_token", "stride_out_token",
                                    "stride_rope")},
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "D_LO": "constexpr", "D_HI": "constexpr",
        "CAUSAL": "constexpr", "HAS_SINKS": "constexpr", "PACK_GQA": "constexpr", "LONGEST_FIRST": "constexpr",
    }
    constexprs = {**{name: config[name] for name in ("BLOCK_M", "BLOCK_N", "D_LO", "D_HI")},
                  "CAUSAL": spec.causal, "HAS_SINKS": spec.sinks, "PACK_GQA": _packs_gqa(config),
                  "LONGEST_FIRST": _longest_first(config)}
    if not spec.rope:
        constexprs.update(cos_ptr=None, sin_ptr=None)
    return signature, constexprs


# ---------------------------------------------------------------------------------------------------------
# TileLang
#
# Block (query block, segment, head) over a grid of ceil(max_seqlen / BLOCK_M) x segments x heads (a block strides
# on over segments longer than max_seqlen claims); tiles padded to a multiple of 16 columns. The q tile (and with
# RoPE each k tile) is built element-wise in shared memory: rows past the segment and padding columns 0, the
# rotation applied on the way; k and v tiles as wide as the head dim are bulk copies, asynchronous in the pipeline,
# but a segment's partial last key block is loaded element-wise (rows past the segment 0: a NaN or Inf there would
# reach P V as 0 * NaN) after the pipeline, in a tile of its own.

TILELANG_FACTORY_NAME = "build"

_TILELANG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def tilelang_padded_dim(head_dim: int) -> int:
    """The tile width: head_dim rounded up to the matrix instructions' k-step of 16 (72 -> 80, 80 -> 80)."""
    return -(-head_dim // 16) * 16


def _tilelang_element(tensor: str, row: str, rope: bool, column: str = "d") -> str:
    """The TIR expression for element (row, column) of q or k, with rotary embedding if `rope` (in fp32, rounded to
    DTYPE; column d only)."""
    element = f"{tensor}[{row}, head, {column}]"
    if rope:
        assert column == "d", "rotary embedding pairs columns d and d +- HALF_DIM"
        partner = f"{tensor}[{row}, head, T.if_then_else(d < HALF_DIM, d + HALF_DIM, d - HALF_DIM)]"
        rotated = f'T.if_then_else(d < HALF_DIM, -T.cast({partner}, "float32"), T.cast({partner}, "float32"))'
        element = (f'T.cast(T.cast({element}, "float32") * T.cast(cos[{row}, d], "float32") + '
                   f'{rotated} * T.cast(sin[{row}, d], "float32"), DTYPE)')
    return element


def _tilelang_operand(tensor: str, row: str, valid: str, rope: bool, column: str = "d") -> str:
    """The element of a q or k tile (_tilelang_element); 0 where not `valid`. if_then_else evaluates only the branch
    taken, so masked elements never read out of bounds."""
    return f"T.if_then_else({valid}, {_tilelang_element(tensor, row, rope, column)}, T.cast(0, DTYPE))"


def tilelang_supports(spec: VarlenAttentionSpec) -> bool:
    """TileLang's T.gemm computes fp32 operands as TF32 on tensor cores: fp32 attention runs in Triton; so do the
    text decoders' parts (causal, window, sinks, grouped KV, own key segments: not in the TileLang template yet)."""
    return spec.dtype != torch.float32 and not spec.extras


def _tilelang_key_value_loads(spec: VarlenAttentionSpec) -> str:
    """Statements filling k_tile and v_tile for one whole key block of the pipelined kernel (at key_start).

    Where the tile is as wide as the head dim, bulk copies (asynchronous in the pipeline). Padded tiles (72 -> 80;
    TileLang's copy cannot split a 72-wide row into 16-column steps) and rotated k tiles are built element-wise,
    padding 0.
    """
    indent = " " * 20
    rows = "seq_start + key_start:seq_start + key_start + block_n"
    padded = tilelang_padded_dim(spec.head_dim) > spec.head_dim
    lines = []
    for tensor, tile, element_wise in (("k", "k_tile", spec.rope or padded), ("v", "v_tile", padded)):
        if element_wise:
            lines.append(_tilelang_tile_load(spec, tensor, tile, "key_start", whole=True))
        else:
            lines.append(f"{indent}T.copy({tensor}[{rows}, head, :], {tile})")
    return "\n".join(lines)


def _tilelang_tile_load(spec: VarlenAttentionSpec, tensor: str, tile: str, start: str, whole: bool = False) -> str:
    """An element-wise load of `tile` from the key block of k or v at `start` (k rotated where the spec has rotary
    embedding): padding columns and (unless the block is `whole`ly inside the segment) rows past the segment 0,
    never read."""
    indent = " " * 20
    valid = "d < HEAD_DIM" if whole else f"{start} + j < seq_len and d < HEAD_DIM"
    element = _tilelang_operand(tensor, f"seq_start + {start} + j", valid, rope=spec.rope and tensor == "k")
    return f"{indent}for j, d in T.Parallel(block_n, DIM):\n{indent}    {tile}[j, d] = {element}"


def tilelang_source(spec: VarlenAttentionSpec, profile: DeviceProfile) -> str:
    if not tilelang_supports(spec):
        raise ValueError(f"the TileLang varlen_attention kernel takes float16/bfloat16 q/k/v ({spec.describe()}): "
                         f"T.gemm would compute fp32 as TF32; use codegen='triton' for fp32")
    rope_parameters = ""
    if spec.rope:
        rope_type = _TILELANG_DTYPES[spec.rope_dtype]
        rope_parameters = (f'        cos: T.Tensor((tokens, HEAD_DIM), "{rope_type}"),\n'
                           f'        sin: T.Tensor((tokens, HEAD_DIM), "{rope_type}"),\n')
    fields = dict(
        profile=profile.name, head_dim=spec.head_dim, padded_dim=tilelang_padded_dim(spec.head_dim),
        dtype=spec.dtype, tl_dtype=_TILELANG_DTYPES[spec.dtype], rope=spec.rope, rope_dtype=spec.rope_dtype,
        rope_parameters=rope_parameters,
        q_element=_tilelang_operand("q", "seq_start + q_start + i", "q_start + i < seq_len and d < HEAD_DIM",
                                    spec.rope),
        key_value_loads=_tilelang_key_value_loads(spec),
        tail_key_load=_tilelang_tile_load(spec, "k", "tail_tile", "tail_start"),
        tail_value_load=_tilelang_tile_load(spec, "v", "tail_tile", "tail_start"),
        pass_configs=repr(tilelang_codegen.fast_math_pass_configs(profile)),
        # The warp-specialized kernel reads q as it is (already rotated where the spec has rotary embedding).
        ws_q_element=_tilelang_operand("q", "seq_start + q_start + i", "q_start + i < seq_len and d < HEAD_DIM",
                                       rope=False),
        ws_q_high_element=_tilelang_operand("q", "seq_start + q_start + i",
                                            "q_start + i < seq_len and low + d < HEAD_DIM", rope=False,
                                            column="low + d"),
        rope_tl_dtype=_TILELANG_DTYPES[spec.rope_dtype] if spec.rope else "float32",
        q_rotated=_tilelang_element("q", "block * ROTATE_ROWS + i", rope=True),
        k_rotated=_tilelang_element("k", "block * ROTATE_ROWS + i", rope=True),
    )
    return Template((TEMPLATES / "varlen_attention.tilelang.py.tmpl").read_text()).substitute(fields)


def tilelang_configs(spec: VarlenAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Query block × key block × pipeline stages (two only where _pipelines_copies) × threads, pruned to what is
    legal on `profile`.

    Threads are whole warps of the profile and at most 2 per query row: T.gemm's FullRow policy gives each
    128-thread group (a Hopper warpgroup) 64 query rows. Then, where it fits, the warp-specialized kernel
    (WARP_SPECIALIZED=1: 128 query rows, 384 threads) with 64-, 128- and 176-key blocks, its two consumer
    warpgroups issuing their MMAs together or taking turns (PINGPONG=1); last, each 128-key-block one with OVERLAP=1
    (overlap_problem), and each 128- or 176-key-block one with LONGEST_FIRST=1 (segments_longest_first)."""
    if not tilelang_supports(spec):
        return []
    configs = []
    for block_m, block_n in ((64, 32), (64, 64), (128, 64), (128, 128)):
        for num_stages in (1, 2) if _pipelines_copies(spec, profile) else (1,):
            for threads in (128, 256):
                if threads % profile.warp_size or threads > 2 * block_m:
                    continue
                config = KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=num_stages,
                                           BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, THREADS=threads)
                if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                    configs.append(config)
    if _warp_specialization_fits(spec, profile):
        for pingpong in (0, 1):
            for block_n, split in ((64, 0), (128, 0), (176, 0), (128, 1)):
                if split and not _splits_columns(spec):
                    continue
                extra = {"PINGPONG": 1} if pingpong else {}
                if split:
                    extra["SPLIT_COLUMNS"] = 1
                config = KernelConfig.make(num_warps=_WS_THREADS // profile.warp_size, num_stages=2, BLOCK_M=128,
                                           BLOCK_N=block_n, NUM_STAGES=2, THREADS=_WS_THREADS, WARP_SPECIALIZED=1,
                                           **extra)
                if tilelang_config_legal(profile, config, tilelang_shared_memory_bytes(spec, config), spec.dtypes):
                    configs.append(config)
        # Tuning candidates: the 128-key-block kernels with OVERLAP=1 (slower than their twins on an H100, session
        # 39: never the untuned choice), then each warp-specialized kernel of 128- or 176-key blocks with
        # LONGEST_FIRST=1 (the untuned choice's twin is the untuned choice of long segments: configs_for_bucket).
        plain = [c for c in configs if _warp_specialized(c)]
        for config in [c for c in plain if c["BLOCK_N"] == 128]:
            overlapped = KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), OVERLAP=1)
            if not overlap_problem(spec, profile, overlapped):
                configs.append(overlapped)
        configs += [_longest_first_twin(c) for c in plain if c["BLOCK_N"] >= 128]
    return configs


# From this bucket of the longest segment on (token_bucket: max_seqlen above 2048), TileLang's untuned choice is its
# default's LONGEST_FIRST=1 twin (configs_for_bucket).
LONGEST_FIRST_MIN_BUCKET = 4096


def configs_for_bucket(spec: VarlenAttentionSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """Every config is a candidate at every size. Where the longest segment is over 2048 tokens (images), the
    warp-specialized default's LONGEST_FIRST=1 twin is the untuned choice: on an H100 (session 47,
    docs/results/vision_attention_h200.md) it was 1.02-1.06x the default at head dims 72, 80 and 128 on the mixed
    and large packs (9216-token images). Below (window layers: many segments of one length, where the order gains
    least and the argsort's launches weigh most; not timed), and for Triton, the default itself."""
    if bucket < LONGEST_FIRST_MIN_BUCKET or not _warp_specialized(default):
        return configs, default
    twin = _longest_first_twin(default)
    return configs, twin if twin in configs else default


def tilelang_prebuilt_configs(spec: VarlenAttentionSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """What tilelang_codegen.load starts building ahead: the untuned choices of every bucket (configs_for_bucket)."""
    default = tilelang_default_config(spec, profile)
    twin = _longest_first_twin(default)
    return [default, *([twin] if twin in tilelang_configs(spec, profile) else [])]


def _longest_first_twin(config: KernelConfig) -> KernelConfig:
    return KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), LONGEST_FIRST=1)


def segments_longest_first(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """LONGEST_FIRST=1's segment_order: the segment indices by length, longest first (int32, on cu_seqlens'
    device, no host sync). The kernel's grid takes segments in this order, so that the programs of the longest
    segments start first and the short ones fill the last wave. In segment order, a pack whose longest image
    comes last (or a head's last programs, heads being the grid's slowest axis) leaves the longest programs for
    the end, a few SMs running them while the rest idle: FlashAttention-3 orders its varlen batches the same way."""
    return torch.argsort(cu_seqlens[1:] - cu_seqlens[:-1], descending=True).to(torch.int32)


def overlap_problem(spec: VarlenAttentionSpec, profile: DeviceProfile, config: KernelConfig) -> str | None:
    """Why OVERLAP=1 does not apply to `config` (None where it does). OVERLAP=1 places the warp-specialized kernel's
    work on key block j where ptxas keeps it under an MMA, as the schedule means it to be: the softmax (row max,
    exp2s, row sums) inside the mask's two branches, before the wait for block j - 1's P V MMA; O's rescale after
    S_{j+1}'s MMA is issued, before P V_j's (FlashAttention-3's rescale before the second GEMM). As written for
    OVERLAP=0 (softmax after the branches' join, rescale after the wait) nvcc 13's ptxas puts the wait first: at
    head dim 128 (session 38) the loop's 66 MUFU.EX2, 69 FMNMX, 134 FADD and the rescale's 64 FMUL all run after
    `WARPGROUP.DEPBAR.LE gsb0, 0x0`, with none of the warpgroup's MMAs in flight (an empty asm on each result
    register before the wait changed nothing). Static only (SASS); not timed yet, so never the untuned choice."""
    if not tilelang_supports(spec):
        return f"no TileLang kernel for {spec.describe()}"
    if not _warp_specialization_fits(spec, profile):
        return f"{profile.name} has no warp-specialized kernel (wgmma, TMA): the pipelined kernel's schedule is " \
               f"TileLang's own"
    if not _warp_specialized(config):
        return "OVERLAP=1 is a knob of the warp-specialized kernel (WARP_SPECIALIZED=1)"
    return None


def _pipelines_copies(spec: VarlenAttentionSpec, profile: DeviceProfile) -> bool:
    """Whether the pipelined kernel may run more than one stage. Its full-width k and v tiles (head dim a multiple
    of 16) are T.copy's; where copies are not bulk (no TMA: sm_80, MUSA) TileLang 0.1.15 makes them cp.async, and
    its software pipeline over the segment's dynamic count of key blocks ends in a cp.async.wait_group whose count
    is computed from the loop variable, which its CUDA codegen rejects ("Downcast from tirx.Sub to ir.IntImm";
    session 34, at head dims 80 and 128 on sm_80; MUSA's TileLang could not be tried here: the same rule). Padded
    tiles (72) are built element-wise and pipeline."""
    return profile.bulk_tensor_copies or tilelang_padded_dim(spec.head_dim) > spec.head_dim


def _splits_columns(spec: VarlenAttentionSpec) -> bool:
    """Whether the warp-specialized kernel has SPLIT_COLUMNS=1 configs (its tiles as 64 columns + the rest: whole
    128-byte TMA boxes a row): tiles wider than 64 columns and not a multiple of 64 (head dims 72, 80, 96)."""
    width = tilelang_padded_dim(spec.head_dim)
    return width > 64 and width % 64 != 0


# The warp-specialized kernel (the template's _warp_specialized): 128 query rows, a producer and two consumer
# warpgroups, a two-stage ring.
_WS_THREADS = 384


def _warp_specialization_fits(spec: VarlenAttentionSpec, profile: DeviceProfile) -> bool:
    """On a target with warpgroup MMAs (wgmma_gemm, register-sourced P), TMA and mbarriers. Its producer only issues
    TMA copies (a padded head dim's last box reads zeros past the row: 72 -> 80), so with rotary embedding q and k
    are rotated by a kernel of their own first (rotating k tiles element-wise in the producer spilled: ptxas, 2 KB
    at head dim 80)."""
    return profile.matrix_instruction == "wgmma" and profile.bulk_tensor_copies


def _warp_specialized(config: KernelConfig) -> bool:
    return bool(dict(config.params).get("WARP_SPECIALIZED", 0))


def _rotation_config(config: KernelConfig) -> KernelConfig:
    """The factory config of the rotation kernel (part 1) that `config`'s launch runs first with rotary embedding."""
    return KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), PART=1)


def tilelang_kernel_configs(spec: VarlenAttentionSpec, config: KernelConfig) -> dict[str, KernelConfig]:
    """Factory config of every TileLang kernel `config` launches: the attention kernel, and before it the rotation
    (PART=1) where the warp-specialized kernel serves a spec with rotary embedding."""
    kernels = {TILELANG_FACTORY_NAME: config}
    if spec.rope and _warp_specialized(config):
        kernels["rotate"] = _rotation_config(config)
    return kernels


def tilelang_default_config(spec: VarlenAttentionSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice: the warp-specialized kernel with 128-key blocks, not ping-ponging, where it fits. On the H200
    (docs/results/vision_attention_h200.md, session 28) it was the fastest TileLang config or within 5% of it at head
    dims 72, 80 and 128, with and without RoPE, on the mixed and large packs: 176-key blocks were up to 0.5% faster
    with RoPE, ping-pong 1-5% faster at 72 and 7-8% slower at 80. Where a row's bytes are not whole 32-byte sectors
    (head dim 72 in 16-bit: 144 bytes, every other row straddling a sector in the unsplit kernel's boxes), split
    columns with ping-pong instead: 1.12x faster than the unsplit default at head dim 72 on the mixed pack, and
    1.06x cuDNN (session 34, docs/results/vision_attention_h200.md); at 80 it was 3% slower than the unsplit
    default. Else the first legal of 128 x 64 tiles with 256 threads, 64 x 64 with 128 (most stages first), then
    anything."""
    configs = tilelang_configs(spec, profile)
    if not configs:
        raise ValueError(f"no legal TileLang varlen_attention config for {spec.describe()} on {profile.name}")
    split = (spec.head_dim * spec.dtype.itemsize) % 32 != 0 and _splits_columns(spec)
    for candidate in configs:
        params = dict(candidate.params)
        if (_warp_specialized(candidate) and candidate["BLOCK_N"] == 128 and not params.get("OVERLAP")
                and not params.get("LONGEST_FIRST")
                and params.get("PINGPONG", 0) == params.get("SPLIT_COLUMNS", 0) == split):
            return candidate
    for block_m, block_n, threads in ((128, 64, 256), (64, 64, 128)):
        for config in sorted(configs, key=lambda c: -c["NUM_STAGES"]):
            if (config["BLOCK_M"], config["BLOCK_N"], config["THREADS"]) == (block_m, block_n, threads):
                return config
    return configs[0]


def tilelang_shared_memory_bytes(spec: VarlenAttentionSpec, config: KernelConfig) -> int:
    """The q tile, a k and a v tile per pipeline stage, the reduction workspace (one fp32 per thread); the
    pipelined kernel adds the tile of a segment's partial last key block (k, then v), the warp-specialized
    kernel (whose ring has two stages) its 15 mbarriers."""
    width = tilelang_padded_dim(spec.head_dim)
    item = spec.dtype.itemsize
    stages = max(1, config["NUM_STAGES"])
    tiles = config["BLOCK_M"] + 2 * stages * config["BLOCK_N"]
    if _warp_specialized(config):
        return tiles * width * item + 4 * config["THREADS"] + 15 * 8
    return (tiles + config["BLOCK_N"]) * width * item + 4 * config["THREADS"]


def tilelang_launch_arguments(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, _cu_seqlens_k, _query_pos,
                              _window, _sinks, out, segment_order=None) -> tilelang_codegen.LaunchArguments:
    """What tilelang_launch calls the kernel with: q, k, v, cu_seqlens, segment_order where the kernel is
    LONGEST_FIRST=1's, cos and sin where it has rotary embedding, out, max_seqlen, sm_scale (the text decoders'
    parts are absent stand-ins, see tilelang_launch). The
    kernel is compiled for dense [tokens, heads, head_dim] tensors at 16-byte-aligned bases and vectorises on both,
    so other inputs (the token-strided slices of a fused qkv projection, offset views) are copied, and such an
    output is computed into a temporary that is copied back."""
    # The grid's width comes from max_seqlen; the kernel strides over longer segments, so it only has to be >= 1.
    return tilelang_codegen.launch_arguments((q, k, v, cu_seqlens, segment_order, cos, sin), (out,),
                                             (max(int(max_seqlen), 1), float(sm_scale)))


def tilelang_launch(compiled, config: KernelConfig, q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin,
                    _cu_seqlens_k, _query_pos, _window, _sinks, out):
    """Launch on [tokens, heads, head_dim] tensors (see tilelang_launch_arguments). Its specs have none of the text
    decoders' parts (tilelang_supports): the four arguments before out are their absent stand-ins."""
    if q.shape[0] == 0 or q.shape[1] == 0 or cu_seqlens.shape[0] < 2:
        return
    if cos is not None and _warp_specialized(config):
        # Its attention kernel reads q and k rotated: the rotation kernel (part 1) writes them first.
        rotated = (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                   torch.empty(k.shape, dtype=k.dtype, device=k.device))
        rotation = compiled.kernel_for(_rotation_config(config))
        tilelang_codegen.launch_arguments((q, k, cos, sin), rotated).launch(rotation)
        (q, k), cos, sin = rotated, None, None
    order = segments_longest_first(cu_seqlens) if _longest_first(config) else None
    arguments = tilelang_launch_arguments(q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin, _cu_seqlens_k,
                                          _query_pos, _window, _sinks, out, order)
    arguments.launch(compiled.kernel_for(config))
