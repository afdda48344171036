"""Op fuzzer: every dzc op with kernels, every code generator that runs here, on seeded random cases.

    python tools/fuzz.py --quick                          # CI size: tiny shapes, Triton through the interpreter
    python tools/fuzz.py --out fuzz_h200.md               # on a GPU: larger shapes, Triton and TileLang
    python tools/fuzz.py --ops dsa_topk --codegens triton --seed 7 --only 3   # replay one case

For each op in targets.KERNEL_FAMILIES and each of its code generators (Triton: interpreter on CPU, compiled on
CUDA; TileLang: GPU only), cases are drawn from a seed: shapes with edge sizes (0 and 1, primes, just above and
below tile sizes, empty segments, the largest the mode allows), the dtypes the op takes, inputs as offset,
row-padded or transposed views into buffers whose other elements are NaN (or a harmless integer), and edge
values (inf/NaN inputs and scales, constant rows, all-masked rows, top-k larger than the context, duplicate and
out-of-range indices). Each case goes through dzc's own lowering (the fake checks, the family's spec and
legality: the path dzc.compile takes), then the family's prepare and launch with outputs poisoned (NaN, or -2
for indices), on the default config for the call's token bucket or a random legal one, and is compared with the
op's plain-torch reference under dtype-aware tolerances. Outcomes:
  match        the kernel's outputs equal the reference's within tolerance (NaN and inf where it has them);
  fallback     the family refuses the instance at compile time (a head dim no kernel takes, no legal config):
               dzc runs the op's reference there, which is right, but no kernel was tested;
  clear-error  a ValueError (or NoLegalConfig) for an input outside the op's domain; the same for an input
               inside it is a crash;
  mismatch     a wrong answer, or a silent answer for input outside the domain that is not the documented
               behaviour (listed with its seed and a one-line repro command);
  crash        any other exception (or, on a GPU, a fault that kills the worker process).
Out-of-domain cases state the behaviour the op documents for them (varlen_attention: an understated max_seqlen
is never trusted; mxfp4_moe: expert ids outside [0, E) give NaN rows, since checking needs a host sync).

On a GPU the cases run in a worker process: a fault (illegal address) kills the CUDA context, so the parent
records the case as a crash and restarts the worker at the next one. Exit status 1 when any case mismatched
or crashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dzc  # noqa: F401  (registers the ops; picks Triton's interpreter when there is no GPU)
from dzc import mxfp4
from dzc.lowering import PREFERRED_CODEGENS, Execution, NoLegalConfig, dzc_op_name, lower_graph
from dzc.ops import OPS
from dzc.options import CompileOptions
from dzc.targets import INTERPRETER, KERNEL_FAMILIES, resolve_target, tilelang_codegen
from dzc.targets.launch import legal_configs

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FLOATS = (BF16, FP16, FP32)
OUTCOMES = ("match", "fallback", "clear-error", "mismatch", "crash")
# Exit status of a worker whose CUDA context is gone (the parent restarts it at the next case).
_DEVICE_LOST = 3


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The largest sizes a mode draws (edge sizes around tiles are drawn below these)."""

    norm_rows: int
    norm_hidden: int
    attn_tokens: int  # varlen_attention: tokens of one pack
    attn_segment: int
    attn_heads: int
    moe_tokens: int
    moe_dim: int  # H and I (multiples of 32)
    moe_experts: int
    dsa_seq: int  # longest sequence of the DSA caches
    dsa_queries: int
    dsa_heads: int
    topk_width: int
    topk_rows: int
    topk_k: int


QUICK = Sizes(norm_rows=9, norm_hidden=300, attn_tokens=80, attn_segment=66, attn_heads=2, moe_tokens=5,
              moe_dim=64, moe_experts=4, dsa_seq=66, dsa_queries=5, dsa_heads=4, topk_width=300, topk_rows=5,
              topk_k=40)
# Inputs are drawn on the host: sizes keep a case's tensors to about 100 MB (MoE weights are E x 3 x H x I).
LARGE = Sizes(norm_rows=4099, norm_hidden=16500, attn_tokens=4500, attn_segment=4100, attn_heads=8,
              moe_tokens=600, moe_dim=1056, moe_experts=16, dsa_seq=9000, dsa_queries=300, dsa_heads=64,
              topk_width=70000, topk_rows=600, topk_k=2100)


# ---------------------------------------------------------------------------------------------------------
# Drawing sizes, tensors and views


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 67, 97, 127, 131, 251, 257, 509, 521, 1021, 1031, 2039, 2053, 4093,
           4099, 8191, 8209, 16381, 16411, 65521, 65537)


def edge_size(rng: random.Random, upper: int, lower: int = 1, multiple: int = 1) -> int:
    """A size in [lower, upper] (a multiple of `multiple`): 1, the largest, a prime, a power of two or one
    either side of it (tile edges), or uniform."""
    def fit(n: int) -> int:
        n = max(lower, min(upper, n))
        n = n // multiple * multiple
        return max(n, -(-lower // multiple) * multiple)
    kind = rng.random()
    if kind < 0.12:
        return fit(lower)
    if kind < 0.22:
        return fit(upper)
    if kind < 0.45:
        return fit(rng.choice([p for p in _PRIMES if lower <= p <= upper] or [upper]))
    if kind < 0.75:
        powers = [1 << b for b in range(1, 18) if lower <= (1 << b) <= upper + 1]
        if powers:
            return fit(rng.choice(powers) + rng.choice((-1, 0, 1)) * multiple)
    return fit(rng.randint(lower, upper))


def edge_count(rng: random.Random, upper: int) -> int:
    """Like edge_size, but 0 (an empty input) is drawn too."""
    return 0 if rng.random() < 0.08 else edge_size(rng, upper)


def randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def place(t: torch.Tensor, rng: random.Random, device, fill,
          kinds=("dense", "offset", "padded", "strided", "permuted")):
    """t on `device` as drawn: dense, or an offset / row-padded / strided / transposed view into a larger buffer whose
    other elements are `fill` (NaN for floats: a kernel that reads past the view shows it)."""
    kind = rng.choice(kinds)
    if t.dim() == 0 or t.numel() == 0 or (kind == "permuted" and t.dim() < 2):
        kind = "dense"
    if kind == "dense":
        return t.to(device)
    if kind == "offset":
        offset = rng.choice((1, 4, 8, 13)) if t.dtype != torch.uint8 else rng.choice((4, 8, 16))
        buffer = torch.full((t.numel() + offset + 5,), fill, dtype=t.dtype, device=device)
        buffer[offset:offset + t.numel()] = t.reshape(-1).to(device)
        return buffer[offset:offset + t.numel()].view(t.shape)
    if kind == "padded":
        pad = rng.choice((1, 3, 8)) if t.dtype != torch.uint8 else rng.choice((4, 8))
        buffer = torch.full((*t.shape[:-1], t.shape[-1] + pad), fill, dtype=t.dtype, device=device)
        buffer[..., :t.shape[-1]] = t.to(device)
        return buffer[..., :t.shape[-1]]
    if kind == "strided":  # every other element of the last dim
        buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=device)
        buffer[..., ::2] = t.to(device)
        return buffer[..., ::2]
    return t.transpose(-1, -2).contiguous().to(device).transpose(-1, -2)  # last dim not unit-stride


def sprinkle(t: torch.Tensor, rng: random.Random, g: torch.Generator, values=(float("nan"), float("inf"),
                                                                               -float("inf")), count: int = 2):
    """t with a few elements replaced by special values (in place on a CPU tensor; returns it)."""
    if t.numel():
        flat = t.view(-1)
        for _ in range(count):
            flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = rng.choice(values)
    return t


def short(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "none"


# ---------------------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass
class Case:
    """One call of an op. `domain` is empty for arguments inside the op's domain, else why they are not; then
    `documented` (if the op documents what its kernels do there) gives the outputs the kernel must return."""

    args: tuple
    what: str
    domain: str = ""
    documented: Callable[[tuple, str], object] | None = None  # (args, the op whose reference applies)
    random_config: bool = False  # a random legal config instead of the default for the call's token bucket
    # Products may overflow fp32 (MXFP4 scales 2^126, 2^127): a sum whose terms or partial sums reach fp32's
    # largest number is a finite number, inf or NaN by the order it is added in (the reference's own matrix-matrix
    # and matrix-vector paths disagree), and an activation's clamp can turn that inf back into a finite number.
    # (args) -> a bool mask per output element: True where the value depends on the summation order (not compared).
    order_dependent: Callable[[tuple], torch.Tensor] | None = None


def _norm_common(rng, srng, g, size: Sizes, device, op: str) -> tuple[Case, dict]:
    hidden = edge_size(srng, size.norm_hidden)
    tokens = edge_count(rng, size.norm_rows)
    dtype = srng.choice(FLOATS)
    sum_dtype = srng.choice((dtype, dtype, FP32))
    out_dtype = srng.choice((dtype, dtype, sum_dtype))
    lead = (tokens,) if rng.random() < 0.7 else (rng.choice((1, 2)), tokens)
    scale = rng.choice((1.0, 1.0, 1e-3, 40.0))
    offset = rng.choice((0.0, 0.0, 3.0))  # a large mean: the variance must not cancel
    x = randn(g, *lead, hidden, scale=scale) + offset
    residual = randn(g, *lead, hidden, scale=scale)
    notes = []
    if rng.random() < 0.12:
        sprinkle(x, rng, g)
        notes.append("inf/nan in x")
    if rng.random() < 0.1 and tokens:
        x.view(-1, hidden)[0] = 0.5
        residual.view(-1, hidden)[0] = 0.25
        notes.append("constant row")
    weight = None
    if srng.random() < 0.8:
        weight = (1.0 + 0.1 * randn(g, hidden)).to(srng.choice((dtype, FP32)))
    eps = rng.choice((1e-6, 1e-5, 0.1))
    fill = float("nan")
    args = dict(x=place(x.to(dtype), rng, device, fill), residual=place(residual.to(sum_dtype), rng, device, fill),
                weight=None if weight is None else place(weight, rng, device, fill, ("dense", "offset")),
                eps=eps, dtype=dtype, sum_dtype=sum_dtype, out_dtype=out_dtype)
    what = (f"{op} x={short(dtype)}{list(args['x'].shape)} res={short(sum_dtype)} y={short(out_dtype)} "
            f"w={short(None if weight is None else weight.dtype)} eps={eps}{' ' + ', '.join(notes) if notes else ''}")
    return Case((), what), args


def gen_add_rms_norm(rng, srng, g, size, device) -> Case:
    case, a = _norm_common(rng, srng, g, size, device, "add_rms_norm")
    sum_in_fp32 = srng.random() < 0.3
    cast_before_weight = srng.random() < 0.5
    compute_dtype = FP32 if srng.random() < 0.8 else a["dtype"]
    divide_by_rms = srng.random() < 0.2
    case.args = (a["x"], a["residual"], a["weight"], a["eps"], sum_in_fp32, cast_before_weight, a["out_dtype"],
                 a["sum_dtype"], compute_dtype, divide_by_rms)
    case.what += f" fp32sum={sum_in_fp32} cast={cast_before_weight} compute={short(compute_dtype)} div={divide_by_rms}"
    return case


def gen_add_layer_norm(rng, srng, g, size, device) -> Case:
    case, a = _norm_common(rng, srng, g, size, device, "add_layer_norm")
    hidden = a["x"].shape[-1]
    bias = None
    if srng.random() < 0.7:
        bias = place((0.1 * randn(g, hidden)).to(srng.choice((a["dtype"], FP32))), rng, device, float("nan"),
                     ("dense", "offset"))
    sum_in_fp32 = srng.random() < 0.3
    case.args = (a["x"], a["residual"], a["weight"], bias, a["eps"], sum_in_fp32, a["out_dtype"], a["sum_dtype"])
    case.what += f" bias={short(None if bias is None else bias.dtype)} fp32sum={sum_in_fp32}"
    return case


def gen_decoder_attention(rng, srng, g, size, device, dtype) -> Case:
    """varlen_attention as text decoders use it: causal against query positions (the last queries of longer keys,
    some positions past the keys or before them), a local window, sinks, grouped KV heads."""
    head_dim = srng.choice((16, 32, 64, 80, 128))
    kv_heads = edge_size(rng, size.attn_heads)
    heads = kv_heads * srng.choice((1, 1, 2, 4))
    q_lengths, k_lengths, positions = [], [], []
    for _ in range(rng.randint(1, 4)):
        keys = edge_count(rng, size.attn_segment)
        queries = min(keys, rng.choice((1, 2, keys)))
        q_lengths.append(queries)
        k_lengths.append(keys)
        positions += list(range(keys - queries, keys))
    if positions and rng.random() < 0.2:  # a query before every key (sees none: 0), or past them
        positions[rng.randrange(len(positions))] = rng.choice((-1, -5, max(k_lengths) + 3))
    q = randn(g, sum(q_lengths), heads, head_dim, scale=rng.choice((1.0, 4.0))).to(dtype)
    k, v = (randn(g, sum(k_lengths), kv_heads, head_dim).to(dtype) for _ in range(2))
    window = rng.choice((0, 0, 1, 5, 64))
    sinks = (randn(g, heads) * 3).to(device) if srng.random() < 0.4 else None
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (q_lengths, k_lengths))
    query_pos = torch.tensor(positions, dtype=torch.int32)
    args = (place(q, rng, device, float("nan"), ("dense", "offset")),
            place(k, rng, device, float("nan"), ("dense", "offset")),
            place(v, rng, device, float("nan"), ("dense", "offset")), cu_q.to(device), max(q_lengths),
            head_dim ** -0.5, None, None, cu_k.to(device), place(query_pos, rng, device, 0, ("dense", "offset")),
            window, sinks)
    return Case(args, f"varlen_attention (decoder) {short(dtype)} heads={heads}/{kv_heads} d={head_dim} "
                      f"q={q_lengths} k={k_lengths} window={window}{' sinks' if sinks is not None else ''}")


def gen_varlen_attention(rng, srng, g, size, device, extras: bool = True) -> Case:
    dtype = srng.choice(FLOATS)
    if srng.random() < 0.35 and extras:
        return gen_decoder_attention(rng, srng, g, size, device, dtype)
    rope = srng.random() < 0.5
    head_dim = srng.choice((16, 32, 64, 72, 80, 128, 256) + ((17, 31, 97) if not rope else (18, 34, 98)))
    if srng.random() < 0.05:
        head_dim = srng.choice((8, 264)) if rope else srng.choice((7, 264))  # outside the kernels' 16..256
    heads = edge_size(rng, size.attn_heads)
    lengths, total = [], 0
    for _ in range(rng.randint(1, 6)):
        n = edge_count(rng, size.attn_segment)
        if total + n > size.attn_tokens:
            break
        lengths.append(n)
        total += n
    lengths = lengths or [0]
    qkv = randn(g, total, 3, heads, head_dim, scale=rng.choice((1.0, 1.0, 4.0)))
    notes = []
    if rng.random() < 0.1 and total:
        qkv[:, 0] = sprinkle(qkv[:, 0].contiguous(), rng, g, values=(float("nan"),), count=1)
        notes.append("nan in q")
    qkv = qkv.to(dtype)
    layout = rng.choice(("dense", "qkv", "permuted"))
    if layout == "qkv":  # slices of one fused projection: token stride 3 * heads * head_dim
        buffer = qkv.to(device)
        q, k, v = buffer[:, 0], buffer[:, 1], buffer[:, 2]
    else:
        q, k, v = (place(qkv[:, i].contiguous(), rng, device, float("nan"),
                         ("dense", "offset", "permuted") if layout == "permuted" else ("dense", "offset"))
                   for i in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_seqlens = place(cu, rng, device, 0, ("dense", "offset", "strided"))
    longest = max(lengths)
    max_seqlen = longest + rng.choice((0, 0, 0, 5))  # overstated is allowed
    cos = sin = None
    if rope:
        rope_dtype = srng.choice(FLOATS)
        angles = torch.rand(total, head_dim // 2, generator=g) * 40
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = (place(t.to(rope_dtype), rng, device, float("nan"), ("dense", "offset", "padded"))
                    for t in (angles.cos(), angles.sin()))
        notes.append(f"rope={short(rope_dtype)}")
    sm_scale = rng.choice((head_dim ** -0.5, head_dim ** -0.5, 0.0, 2.0))
    case = Case((q, k, v, cu_seqlens, max_seqlen, sm_scale, cos, sin),
                f"varlen_attention {short(dtype)} heads={heads} d={head_dim} lengths={lengths} layout={layout} "
                f"max_seqlen={max_seqlen} sm_scale={sm_scale:.3g}{' ' + ', '.join(notes) if notes else ''}")
    if longest > 1 and rng.random() < 0.1:
        # Understated max_seqlen: the reference refuses; kernels never trust it for coverage (documented).
        understated = rng.randint(1, longest - 1)
        case.args = case.args[:4] + (understated,) + case.args[5:]
        case.domain = f"max_seqlen={understated} < the longest segment {longest}"
        case.documented = lambda args, op, true=max_seqlen: OPS[op][1](*args[:4], true, *args[5:])
        case.what += f" (understated max_seqlen {understated})"
    return case


def _moe_weights(g, experts, n, k, scale_edges: bool, rng):
    w = randn(g, experts, n, k) * torch.exp2(torch.randint(-4, 2, (experts, n, 1), generator=g).float())
    blocks, scales = mxfp4.quantize(w * k ** -0.5)
    if scale_edges:  # the decode's saturation: 2^126, 2^127 (inf past E2M1's 6 * 2^127) and NaN (0xFF)
        flat = scales.view(-1)
        for _ in range(3):
            flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = rng.choice((0xFD, 0xFE, 0xFF, 0))
    return blocks, scales


def gen_moe(rng, srng, g, size, device, op: str) -> Case:
    hidden = edge_size(srng, size.moe_dim, lower=32, multiple=32)
    inter = edge_size(srng, size.moe_dim, lower=32, multiple=32)
    experts = edge_size(srng, size.moe_experts)
    top_k = srng.randint(1, min(experts, 4))
    tokens = edge_count(rng, size.moe_tokens)
    dtype = srng.choice(FLOATS)
    activation = srng.choice(("silu_glu", "clamped_swiglu"))
    interleaved = srng.random() < 0.5
    scale_edges = rng.random() < 0.15
    w13_blocks, w13_scales = _moe_weights(g, experts, 2 * inter, hidden, scale_edges, rng)
    w2_blocks, w2_scales = _moe_weights(g, experts, hidden, inter, False, rng)
    logits = randn(g, tokens, experts)
    if rng.random() < 0.3:
        logits[:, 0] += 12.0  # one expert takes nearly every token
    top_logits, ids = logits.topk(top_k, dim=-1)
    notes = ["scale bytes 0xFD/0xFE/0xFF/0"] if scale_edges else []
    if rng.random() < 0.1 and top_k > 1 and tokens:
        ids[:, 1] = ids[:, 0]  # duplicate experts in one token's slots
        notes.append("duplicate ids")
    weights_dtype = srng.choice((FP32, FP32, dtype))
    topk_weights = torch.softmax(top_logits, dim=-1).to(weights_dtype)
    bias = srng.random() < 0.6
    w13_bias = (randn(g, experts, 2 * inter)).to(dtype) if bias else None
    w2_bias = (randn(g, experts, hidden)).to(dtype) if bias else None
    ids_dtype = rng.choice((torch.int32, torch.int64))
    x = randn(g, tokens, hidden, scale=rng.choice((1.0, 1.0, 30.0)))
    fill = float("nan")
    args = (place(x.to(dtype), rng, device, fill), place(ids.to(ids_dtype), rng, device, 0, ("dense", "offset", "strided")),
            place(topk_weights, rng, device, fill, ("dense", "offset", "permuted")),
            w13_blocks.to(device), w13_scales.to(device), None if w13_bias is None else w13_bias.to(device),
            w2_blocks.to(device), w2_scales.to(device), None if w2_bias is None else w2_bias.to(device),
            activation, interleaved, 1.702, 7.0)
    case = Case(args, f"{op} {short(dtype)} T={tokens} H={hidden} I={inter} E={experts} top_k={top_k} "
                      f"{activation} interleaved={interleaved} bias={bias} ids={short(ids_dtype)} "
                      f"weights={short(weights_dtype)}{' ' + ', '.join(notes) if notes else ''}",
                order_dependent=_moe_order_dependent if scale_edges else None)
    if tokens and rng.random() < 0.08:
        bad = ids.clone()
        bad[0, 0] = rng.choice((experts, experts + 7, -1))
        case.args = (args[0], bad.to(ids_dtype).to(device)) + args[2:]
        case.domain = f"expert id {int(bad[0, 0])} outside [0, {experts})"
        case.documented = lambda a, op: _moe_documented(op, a)
        case.what += f" (expert id {int(bad[0, 0])} out of range)"
    return case


def _moe_order_dependent(args: tuple) -> torch.Tensor:
    """Output elements of an MoE call whose value depends on the order its sums are added in (Case.order_dependent):
    those of a token whose gate/up sum of absolute products (NaN weights left out: they give NaN in any order)
    comes within a factor 4 of fp32's largest number in any of its experts, since the activation feeds every output
    column; elsewhere those whose down-projection bound does. The factor covers the kernel's other roundings (W4A8:
    the activations' E4M3 steps, at most 2^-3 of each)."""
    from dzc.ops.mxfp4_moe import glu_activation
    hidden, ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias = args[:9]
    activation, interleaved, alpha, limit = args[9:13]
    ids = ids.long()
    experts = w13_blocks.shape[0]
    threshold = torch.finfo(FP32).max / 4
    x = hidden.float().abs()
    bound = torch.zeros(hidden.shape, dtype=FP32, device=hidden.device)
    rows = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    for e in ids.unique().tolist():
        if not 0 <= e < experts:
            continue  # documented NaN rows (_moe_documented)
        tokens, slots = torch.where(ids == e)
        w13 = mxfp4.dequantize(w13_blocks[e], w13_scales[e], FP32)
        gate_up_bound = x[tokens] @ w13.nan_to_num(nan=0.0).abs().T
        if w13_bias is not None:
            gate_up_bound = gate_up_bound + w13_bias[e].float().abs()
        rows[tokens] |= ~(gate_up_bound < threshold).all(dim=1)
        gate_up = hidden[tokens].float() @ w13.T + (w13_bias[e].float() if w13_bias is not None else 0.0)
        act = glu_activation(gate_up, activation, interleaved, alpha, limit).to(hidden.dtype).float()
        w2 = mxfp4.dequantize(w2_blocks[e], w2_scales[e], FP32).nan_to_num(nan=0.0).abs()
        y = act.nan_to_num(nan=0.0).abs() @ w2.T + (w2_bias[e].float().abs() if w2_bias is not None else 0.0)
        bound.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float().abs())
    return ~(bound < threshold) | rows[:, None]


def _moe_documented(op: str, args: tuple) -> torch.Tensor:
    """mxfp4_moe's kernels for expert ids outside [0, E) (targets/mxfp4_moe_routing.py): NaN rows for the tokens
    that have one; the other tokens as the reference computes them."""
    ids = args[1]
    experts = args[4].shape[0]
    bad_rows = ((ids < 0) | (ids >= experts)).any(dim=1)
    good = ~bad_rows
    expected = torch.full_like(args[0], float("nan"), memory_format=torch.contiguous_format)
    if good.any():
        expected[good] = OPS[op][1](args[0][good], ids[good], args[2][good], *args[3:])
    return expected


def _paging(rng, g, seq_lens, page_size, device):
    """A block table handing out pages in a shuffled order, -1 past each sequence's pages, plus spare pages."""
    needed = [-(-n // page_size) for n in seq_lens]
    pages = sum(needed) + rng.randint(0, 2)
    order = torch.randperm(max(pages, 1), generator=g).tolist()
    table = torch.full((len(seq_lens), max(max(needed), 1) + rng.choice((0, 0, 1))), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.int32)
        taken += n
    return table, max(pages, 1)


def _sequences(rng, size: Sizes):
    batch = rng.randint(1, 4)
    seq_lens = [edge_count(rng, size.dsa_seq) for _ in range(batch)]
    page_size = rng.choice((1, 7, 16, 16, 64))
    return seq_lens, page_size


def _queries(rng, g, seq_lens, size: Sizes):
    """(query_seq, query_pos): decode rows at the end of a sequence, prefill chunks, and rows of empty sequences."""
    seqs, positions = [], []
    for b, n in enumerate(seq_lens):
        count = min(rng.choice((1, 1, 2, 5)), max(n, 1))
        for pos in range(n - count, n):
            seqs.append(b)
            positions.append(max(pos, 0))
    while len(seqs) > size.dsa_queries:
        drop = rng.randrange(len(seqs))
        seqs.pop(drop)
        positions.pop(drop)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)


def gen_dsa_indexer(rng, srng, g, size, device) -> Case:
    from dzc import kv_cache
    seq_lens, page_size = _sequences(rng, size)
    heads = edge_size(srng, size.dsa_heads)
    fp8 = srng.random() < 0.4
    head_dim = srng.choice((32, 64, 128)) if fp8 else srng.choice((16, 32, 64, 72, 128))
    dtype = srng.choice(FLOATS)
    q_dtype = srng.choice((torch.float8_e4m3fn, dtype)) if fp8 else dtype
    table, pages = _paging(rng, g, seq_lens, page_size, device)
    query_seq, query_pos = _queries(rng, g, seq_lens, size)
    rows = query_seq.shape[0]
    keys = randn(g, pages * page_size, head_dim)
    if fp8:
        cache = torch.randint(0, 256, (pages, kv_cache.fp8_index_page_bytes(page_size, head_dim)), generator=g,
                              dtype=torch.uint8)
        kv_cache.write_index_keys(cache, torch.arange(pages * page_size), keys)
    else:
        cache = keys.view(pages, page_size, head_dim).to(dtype)
    q = randn(g, rows, heads, head_dim, scale=8.0 if q_dtype == torch.float8_e4m3fn else 1.0).to(q_dtype)
    weights = randn(g, rows, heads)
    longest = max(seq_lens)
    max_context = max(1, longest + rng.choice((0, 0, -3, 9)))
    cache_kinds = ("dense", "offset", "padded") if fp8 else ("dense", "offset", "padded", "permuted")
    args = (place(q, rng, device, float("nan") if not fp8 else 0.0, ("dense", "offset")),
            place(weights, rng, device, float("nan"), ("dense", "offset", "permuted")),
            place(cache, rng, device, float("nan") if not fp8 else 0xFF, cache_kinds),
            place(table, rng, device, 0, ("dense", "offset", "permuted")),
            place(torch.tensor(seq_lens, dtype=torch.int32), rng, device, 0, ("dense", "offset", "strided")),
            place(query_seq, rng, device, 0, ("dense", "offset", "strided")),
            place(query_pos, rng, device, 0, ("dense", "offset", "strided")), max_context)
    return Case(args, f"dsa_indexer q={short(q_dtype)} cache={'fp8' if fp8 else short(dtype)} heads={heads} "
                      f"d={head_dim} seq_lens={seq_lens} page={page_size} rows={rows} max_context={max_context}")


def gen_dsa_topk(rng, srng, g, size, device) -> Case:
    rows = edge_count(rng, size.topk_rows)
    width = edge_size(rng, size.topk_width)
    k = edge_size(rng, size.topk_k) if rng.random() < 0.8 else width + rng.randint(1, 9)  # k > context
    kind = rng.choice(("distinct", "ties", "ties", "constant"))
    if kind == "distinct":
        logits = randn(g, rows, width)
    elif kind == "ties":
        logits = torch.randint(-3, 4, (rows, width), generator=g).float()
    else:
        logits = torch.full((rows, width), 1.5)
    notes = []
    if rng.random() < 0.5:
        logits[torch.rand(rows, width, generator=g) < 0.1] = -float("inf")
    if rng.random() < 0.15 and rows:
        logits[0] = -float("inf")  # an all-masked row
        notes.append("all -inf row")
    if rng.random() < 0.1:
        sprinkle(logits, rng, g, values=(float("inf"), -0.0, 0.0))
        notes.append("+inf/signed zeros")
    lengths = torch.tensor([rng.choice((width, width, rng.randint(0, width), 0, width + 5, -3)) for _ in range(rows)],
                           dtype=torch.int32)
    args = (place(logits, rng, device, float("nan")), place(lengths, rng, device, 0, ("dense", "offset", "strided")), k)
    case = Case(args, f"dsa_topk rows={rows} width={width} k={k} {kind} lengths={lengths.tolist()[:6]}"
                      f"{' ' + ', '.join(notes) if notes else ''}")
    if rng.random() < 0.05:
        case.args = args[:2] + (rng.choice((0, -1)),)
        case.domain = f"k={case.args[2]} < 1"
        case.what += f" (k={case.args[2]})"
    return case


def gen_sparse_attention(rng, srng, g, size, device, extras: bool = True) -> Case:
    seq_lens, page_size = _sequences(rng, size)
    dtype = srng.choice(FLOATS)
    if srng.random() < 0.6:  # MLA / MQA: one latent KV head, V = K[..., :d_v] or a separate v_cache
        heads = edge_size(srng, size.dsa_heads)
        kv_heads = 1
        d_main = srng.choice((16, 32, 64) if size is QUICK else (64, 128, 512))
        d_qk = d_main + srng.choice((0, 16, 64 if d_main >= 64 else 16))
        d_v = srng.choice((d_main, d_main, 16))
        separate_v = srng.random() < 0.3
    else:  # MHA
        heads = edge_size(srng, min(size.dsa_heads, 8))
        kv_heads = heads
        d_qk = srng.choice((16, 32, 64))
        d_v = srng.choice((16, d_qk))
        separate_v = srng.random() < 0.7
    # The op's optional parts (what sparse designs after DSA add): causal against query_pos with a local window
    # beside the selection, per-head sinks, indices that select blocks of positions.
    causal = srng.random() < 0.3 and extras
    sinks = srng.random() < 0.25 and extras
    index_block = srng.choice((1, 1, 1, 2, 16)) if extras else 1
    table, pages = _paging(rng, g, seq_lens, page_size, device)
    query_seq, query_pos = _queries(rng, g, seq_lens, size)
    if size is not QUICK and rng.random() < 0.2:  # more than DECODE_MAX_ROWS rows: the prefill kernel
        query_seq = query_seq.repeat(300 // max(len(query_seq), 1) + 1)
        query_pos = query_pos.repeat(300 // max(len(query_pos), 1) + 1)
    rows = query_seq.shape[0]
    k_cache = randn(g, pages, page_size, kv_heads, d_qk).to(dtype)
    v_cache = randn(g, pages, page_size, kv_heads, d_v).to(dtype) if separate_v else None
    topk = edge_size(rng, 33 if size is QUICK else 2048)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    indices = torch.full((rows, topk), -1, dtype=torch.int32)
    notes = []
    for t in range(rows):
        visible = int(query_pos[t]) // index_block + 1
        chosen = torch.randperm(visible, generator=g)[:topk]
        indices[t, :chosen.numel()] = chosen.int()
        if rng.random() < 0.3:  # invalid entries: -1, other negatives, at or past the sequence's length
            n = seq_lens[int(query_seq[t])]
            for _ in range(rng.randint(1, 3)):
                indices[t, rng.randrange(topk)] = rng.choice((-1, -7, n, n + 1000, 2**31 - 1))
        if rng.random() < 0.1:
            indices[t] = -1  # no valid index: the row is 0
    if rng.random() < 0.2 and topk > 1 and rows:
        indices[:, 1] = indices[:, 0]  # duplicates count twice in the softmax
        notes.append("duplicate indices")
    sm_scale = rng.choice((d_qk ** -0.5, d_qk ** -0.5, 1.0))
    fill = float("nan")
    args = (place(randn(g, rows, heads, d_qk).to(dtype), rng, device, fill, ("dense", "offset", "permuted")),
            place(k_cache, rng, device, fill, ("dense", "offset", "padded")),
            None if v_cache is None else place(v_cache, rng, device, fill, ("dense", "offset", "padded")),
            place(table, rng, device, 0, ("dense", "offset", "permuted")),
            place(seq_lens_t, rng, device, 0, ("dense", "offset", "strided")),
            place(query_seq, rng, device, 0, ("dense", "offset", "strided")),
            place(indices, rng, device, -1, ("dense", "offset", "padded", "permuted")), sm_scale, d_v)
    window = rng.choice((0, 1, 3, 64)) if causal else 0
    if causal or sinks or index_block > 1:
        args += (place(query_pos, rng, device, 0, ("dense", "offset", "strided")) if causal else None,
                 place(randn(g, heads) * 3, rng, device, fill, ("dense", "offset")) if sinks else None,
                 window, index_block)
        notes += [f"causal window={window}"] * causal + ["sinks"] * sinks + [f"index_block={index_block}"]
    return Case(args, f"sparse_attention {short(dtype)} heads={heads} kv_heads={kv_heads} d_qk={d_qk} d_v={d_v} "
                      f"v={'cache' if separate_v else 'K'} seq_lens={seq_lens} page={page_size} rows={rows} "
                      f"topk={topk}{' ' + ', '.join(notes) if notes else ''}")


GENERATORS: dict[str, Callable] = {
    "add_rms_norm": gen_add_rms_norm,
    "add_layer_norm": gen_add_layer_norm,
    "varlen_attention": gen_varlen_attention,
    "mxfp4_moe": lambda rng, srng, g, size, device: gen_moe(rng, srng, g, size, device, "mxfp4_moe"),
    "mxfp4_moe_w4a8": lambda rng, srng, g, size, device: gen_moe(rng, srng, g, size, device, "mxfp4_moe_w4a8"),
    "dsa_indexer": gen_dsa_indexer,
    "dsa_topk": gen_dsa_topk,
    "sparse_attention": gen_sparse_attention,
}


# ---------------------------------------------------------------------------------------------------------
# Comparison with the reference


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


def _finite_amax(t: torch.Tensor | None) -> float:
    if t is None or t.numel() == 0:
        return 0.0
    t = t.float()
    finite = t[t.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def tolerance(op: str, args: tuple, expected, config) -> list[tuple]:
    """(atol, rtol) per output of `op` for these arguments (atol a number or a tensor of the output's shape): a
    few roundings of the output dtype at the scale the op's error grows with (the interpreter truncates where a
    GPU rounds)."""
    outputs = expected if isinstance(expected, tuple) else (expected,)
    if op in ("add_rms_norm", "add_layer_norm"):
        y, h = outputs
        # y: a few roundings of y's and the compute dtype each, at the normalised value's scale times the weight;
        # LayerNorm subtracts the mean, so a rounding of h's magnitude is amplified by 1/std (a large mean).
        # h: one rounding of the sum.
        weight = args[2]
        w = _finite_amax(weight) if weight is not None else 1.0
        compute = args[8] if op == "add_rms_norm" else FP32
        unit = max(_eps(y.dtype), _eps(compute), _eps(h.dtype) if op == "add_rms_norm" and args[5] else 0)
        scale = 1.0
        if op == "add_layer_norm" and h.numel():
            total = (args[0].float() + args[1].float()).reshape(-1, h.shape[-1]).cpu()
            rstd = torch.rsqrt(total.var(dim=-1, correction=0) + args[4])
            scale = max(_finite_amax(total.abs().amax(dim=-1) * rstd), 1.0)
        return [(4 * unit * w * scale, 4 * unit), (0.0, _eps(h.dtype))]
    if op in ("varlen_attention", "sparse_attention"):
        # A convex combination of V rows: errors in units of the output dtype at V's largest magnitude (the
        # probabilities enter the second product rounded to the 16-bit dtype).
        out = outputs[0]
        v = args[2] if op == "varlen_attention" else (args[2] if args[2] is not None else args[1])
        factor = 32 if out.dtype == FP32 else 4
        allowed = factor * _eps(out.dtype)
        allowed += 2 * (_score_error(args) if op == "varlen_attention" else _sparse_score_error(args))
        return [(allowed * max(_finite_amax(v), 1e-6), 0.0)]
    if op == "mxfp4_moe":
        relative = {BF16: 2**-7, FP16: 2**-10, FP32: 1e-5}[outputs[0].dtype]
        return [(relative * max(_finite_amax(outputs[0]), 1e-6), relative)]
    if op == "mxfp4_moe_w4a8":
        if not config or not dict(config.params).get("FP8"):  # decode sizes run W4A16 (its reference)
            return tolerance("mxfp4_moe", args, expected, config)
        # An activation an ulp from the reference's may quantize to the neighbouring E4M3 value (or its group to
        # the neighbouring scale): each product moves by at most one E4M3 step, 2^-3 of itself.
        ulp = {BF16: 2**-7, FP16: 2**-10, FP32: 2**-23}[outputs[0].dtype]
        magnitude = _w4a8_magnitude(args).cpu()
        return [(2**-3 * magnitude.nan_to_num(float("inf")) + 1e-30, ulp)]
    if op == "dsa_indexer":
        # Relative to the sum of absolute products (FP8 tensor cores accumulate with fewer bits than fp32).
        q, weights = args[0].float(), args[1].float()
        bound = (weights.abs().amax() * q.abs().amax() * q.shape[2] * q.shape[1]).item() if q.numel() else 0.0
        keys_scale = 8.0  # |keys| < ~5 for randn keys; fp8 keys are quantized from them
        return [(2**-10 * bound * keys_scale + 1e-6, 0.0)]
    return [(0.0, 0.0)]  # dsa_topk: indices, exact


def _score_error(args: tuple) -> float:
    """varlen_attention: the largest change of a score the kernel may make, sm_scale * u * sum_d |q_d| |k_d| over
    the pairs of a segment, with u = 2 sqrt(head_dim) fp32 epsilons (another summation order), plus, with RoPE,
    2 epsilons of q's dtype (the rotated q and k rounding the other way: a GPU's fused multiply-add, or the
    interpreter's truncating casts). A probability moves by at most about twice that."""
    from dzc.ops.varlen_attention import apply_vision_rotary
    q, k, _, cu_seqlens, _, sm_scale, cos, sin = args[:8]
    cu_seqlens_k = args[8] if len(args) > 8 and args[8] is not None else cu_seqlens
    u = _summation_units(q.shape[-1])
    if cos is not None:
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        u += 2 * _eps(args[0].dtype)
    # Grouped KV heads: query head h scores against KV head h // group.
    q, k = q.float().abs(), k.float().abs().repeat_interleave(q.shape[1] // max(k.shape[1], 1), dim=1)
    largest = 0.0
    for (start, end), (key_start, key_end) in zip(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]),
                                                  zip(cu_seqlens_k.tolist()[:-1], cu_seqlens_k.tolist()[1:])):
        if end > start and key_end > key_start:
            largest = max(largest, _finite_amax(torch.einsum("shd,thd->hst", q[start:end], k[key_start:key_end])))
    return abs(sm_scale) * u * largest


def _summation_units(head_dim: int) -> float:
    """u of the score bounds: 2 sqrt(head_dim) fp32 epsilons (a dot product summed in another order)."""
    return 2 * math.sqrt(head_dim) * _eps(FP32)


def _sparse_score_error(args: tuple) -> float:
    """sparse_attention: a bound on the change of a score the kernel may make (another summation order), sm_scale
    * u * max over rows and heads of sum_d |q_d| * the largest |k| (u: _summation_units)."""
    q, k_cache, sm_scale = args[0], args[1], args[7]
    if q.numel() == 0:
        return 0.0
    return abs(sm_scale) * _summation_units(q.shape[-1]) * _finite_amax(q.float().abs().sum(-1)) * _finite_amax(k_cache)


def _w4a8_magnitude(args: tuple) -> torch.Tensor:
    """Per output element of dzc.mxfp4_moe_w4a8: the sum of the absolute products of its down GEMM (the
    reference's E4M3 operands and scales) times |topk weight|, plus |bias|: the scale of a rounding flip."""
    from dzc.ops.mxfp4_moe import _fp8_matmul, glu_activation, mxfp4_to_e4m3, quantize_e4m3_groups
    hidden, ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias = args[:9]
    activation, interleaved, alpha, limit = args[9:13]
    ids = ids.long()
    x = hidden.float()
    magnitude = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in ids.unique().tolist():
        tokens, slots = torch.where(ids == e)
        gate_up = _fp8_matmul(*quantize_e4m3_groups(x[tokens]), *mxfp4_to_e4m3(w13_blocks[e], w13_scales[e]))
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        act = glu_activation(gate_up, activation, interleaved, alpha, limit).to(hidden.dtype).float()
        a_values, a_scales = quantize_e4m3_groups(act)
        w_values, w_scales = mxfp4_to_e4m3(w2_blocks[e], w2_scales[e])
        y = _fp8_matmul(a_values.abs(), a_scales, w_values.abs(), w_scales)
        if w2_bias is not None:
            y = y + w2_bias[e].float().abs()
        magnitude.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float().abs())
    return magnitude


def compare(actual, expected, tolerances: list[tuple[float, float]],
            free: torch.Tensor | None = None) -> str | None:
    """Why `actual` differs from `expected` (None if it does not): shapes, dtypes, integers exactly, floats where
    the reference is NaN or ±inf exactly there, elsewhere within (atol, rtol); any value of the first output where
    `free` is True (Case.order_dependent)."""
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, the reference has {len(expected)}"
    for index, (a, e, (atol, rtol)) in enumerate(zip(actual, expected, tolerances)):
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"output {index}: {a.dtype} {tuple(a.shape)}, reference {e.dtype} {tuple(e.shape)}"
        a, e = a.cpu(), e.cpu()
        if not e.is_floating_point():
            differ = a != e
            if differ.any():
                where = differ.nonzero()[0].tolist()
                return (f"output {index}: {int(differ.sum())} of {e.numel()} elements differ, first at {where}: "
                        f"{a[tuple(where)].item()} vs {e[tuple(where)].item()}")
            continue
        a32, e32 = a.float(), e.float()
        if free is not None and index == 0:
            a32, e32 = a32.where(~free.cpu(), 0.0), e32.where(~free.cpu(), 0.0)
        nan_differs = a32.isnan() != e32.isnan()
        inf_differs = (a32.isinf() | e32.isinf()) & (a32 != e32) & ~e32.isnan()
        if (nan_differs | inf_differs).any():
            where = (nan_differs | inf_differs).nonzero()[0].tolist()
            return (f"output {index}: NaN/inf pattern differs at {int((nan_differs | inf_differs).sum())} elements, "
                    f"first {where}: {a32[tuple(where)].item()} vs reference {e32[tuple(where)].item()}")
        finite = e32.isfinite()
        error = (a32 - e32).abs().where(finite, 0.0)
        allowed = atol + rtol * e32.abs().where(finite, 0.0)
        excess = error - allowed
        if (excess > 0).any():
            where = excess.argmax()
            return (f"output {index} ({e.dtype}): {int((excess > 0).sum())} of {e.numel()} elements past the "
                    f"tolerance (rtol={rtol:.3g}); worst: error {error.view(-1)[where]:.4g}, allowed "
                    f"{allowed.view(-1)[where]:.4g} (at {a32.view(-1)[where]:.6g} vs {e32.view(-1)[where]:.6g})")
    return None


# ---------------------------------------------------------------------------------------------------------
# Running a case


@dataclasses.dataclass
class Outcome:
    op: str
    codegen: str
    index: int
    outcome: str
    what: str
    why: str = ""
    config: str = ""
    seconds: float = 0.0


class Runner:
    """Lowers and launches cases of one target on one device; kernels are loaded once per generated source."""

    def __init__(self, target_name: str, device: torch.device, cache_dir: str):
        self.target = resolve_target(target_name)
        self.device = device
        self.execution = Execution(self.target.runtime if device.type == "cuda" else INTERPRETER)
        self.cache_dir = cache_dir
        self._compiled: dict[tuple[str, str], object] = {}

    def _lower(self, op: str, codegen: str, args: tuple):
        """dzc's lowering of one call: trace with fake tensors (the op's checks), then the family's spec, codegen
        and legality; (spec, source path). ValueError / NoLegalConfig from the lowering: the family refuses."""
        graph_module = make_fx(lambda *a: OPS[op][0](*a), tracing_mode="fake")(*args)
        options = CompileOptions(codegen=codegen, autotune=False, cache_dir=self.cache_dir)
        [record] = lower_graph(graph_module.graph, self.target, options, self.execution, self.device)
        [node] = [n for n in graph_module.graph.nodes if dzc_op_name(n) == op]
        return KERNEL_FAMILIES[op].spec_from_node(node), Path(record.source_path)

    def _kernel(self, op: str, codegen: str, spec, path: Path):
        key = (codegen, str(path))
        if key not in self._compiled:
            self._compiled[key] = self.target.codegens[codegen].load(KERNEL_FAMILIES[op], path, spec,
                                                                     self.target.profile)
        return self._compiled[key]

    def _config(self, op: str, codegen: str, spec, work: int, random_config: bool, rng: random.Random):
        family = KERNEL_FAMILIES[op]
        configs, _ = legal_configs(family, codegen, spec, self.target.profile)
        default = getattr(family, f"{codegen}_default_config")(spec, self.target.profile)
        narrow = getattr(family, "configs_for_bucket", None)
        if narrow is not None:
            configs, default = narrow(spec, self.target.profile, family.token_bucket(work), configs, default)
        return rng.choice(configs) if random_config and configs else default

    def run(self, op: str, codegen: str, case: Case, rng: random.Random) -> tuple[str, str, str]:
        """(outcome, why, config) of one case."""
        family = KERNEL_FAMILIES[op]
        try:
            spec, path = self._lower(op, codegen, case.args)
        except (ValueError, NoLegalConfig) as err:
            message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            if case.domain:
                return "clear-error", message, ""
            return "fallback", message, ""
        except Exception as err:
            if case.domain and isinstance(_root(err), ValueError):
                return "clear-error", f"{type(_root(err)).__name__}: {_root(err)}".splitlines()[0][:300], ""
            return "crash", _describe_exception(err, "lowering"), ""
        compiled = self._kernel(op, codegen, spec, path)
        config = ""
        try:
            inputs, outputs, work, results = family.prepare(spec, *case.args)
            for output in outputs:  # poisoned: an element the kernel does not write shows
                output.fill_(float("nan") if output.is_floating_point() else -2)
            if work:
                config = self._config(op, codegen, spec, work, case.random_config, rng)
                getattr(family, f"{codegen}_launch")(compiled, config, *inputs, *outputs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except ValueError as err:
            if case.domain:
                return "clear-error", f"ValueError: {err}".splitlines()[0][:300], str(config)
            return "crash", _describe_exception(err, "a ValueError for input inside the op's domain"), str(config)
        except Exception as err:
            return "crash", _describe_exception(err, "launch"), str(config)
        if op == "mxfp4_moe_w4a8" and config and not dict(config.params).get("FP8"):
            # Documented (targets/mxfp4_moe.py): at decode sizes the W4A8 op runs W4A16's online kernels.
            op = "mxfp4_moe"
        if case.domain:
            if case.documented is None:
                return "mismatch", f"a silent answer for input outside the domain ({case.domain})", str(config)
            expected = case.documented(case.args, op)
        else:
            try:
                expected = OPS[op][1](*case.args)
            except Exception as err:
                return "crash", _describe_exception(err, "the reference, on input inside the domain"), str(config)
        try:
            free = None
            if case.order_dependent is not None:  # neither compared nor setting the tolerance's scale
                free = case.order_dependent(case.args)
                expected = expected.where(~free, 0.0)
            why = compare(results, expected, tolerance(op, case.args, expected, config), free)
            if self.device.type == "cuda":
                # A fault of the reference's or the comparison's GPU work is this case's, not the next one's (it
                # would surface at the next case's first checked CUDA call).
                torch.cuda.synchronize(self.device)
        except Exception as err:
            return "crash", _describe_exception(err, "the reference or the comparison"), str(config)
        return ("mismatch", why, str(config)) if why else ("match", "", str(config))


def _root(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _describe_exception(err: BaseException, where: str) -> str:
    root = _root(err)
    frames = traceback.extract_tb(root.__traceback__)
    place_ = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{where}: {type(root).__name__}: {root}".splitlines()[0][:300] + place_


def _device_lost(text: str) -> bool:
    return any(s in text for s in ("illegal memory access", "CUDA error", "unspecified launch failure",
                                   "misaligned address", "device-side assert"))


# ---------------------------------------------------------------------------------------------------------
# The run


def codegens_for(op: str, device: torch.device) -> list[str]:
    """The op's code generators that run where we are: Triton everywhere, TileLang on a GPU where it imports (the
    report says why not otherwise)."""
    family = KERNEL_FAMILIES[op]
    names = [name for name in PREFERRED_CODEGENS[op] if hasattr(family, f"{name}_source")]
    return sorted(name for name in names
                  if name == "triton" or (device.type == "cuda" and tilelang_codegen.import_problem() is None))


# Large mode on a GPU: what a kernel is specialised on (its spec: dtypes, head dims, hidden size, ...) is drawn from
# this many variants per op and codegen, everything else per case: each spec and config is a compile (seconds for
# Triton, tens of seconds for TileLang), and the run has to fit a few minutes. Quick mode draws a spec per case.
SPEC_VARIANTS = {"triton": 6, "tilelang": 2}
# The optional parts of an op (decoder masks, sinks, index blocks) that a codegen declines (dzc runs the reference
# there): its cases leave them out, or its few spec variants can all land on them and test no kernel.
WITHOUT_EXTRAS = {("varlen_attention", "tilelang"), ("sparse_attention", "tilelang")}
# The share of cases on a random legal config instead of the bucket's default, per codegen (large mode).
RANDOM_CONFIG_SHARE = {"triton": 0.5, "tilelang": 0.15}


def _draw(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def case_rng(seed: int, op: str, codegen: str, index: int, quick: bool):
    """(rng for the case, rng for its spec, torch generator for its tensors), all from the seed and the case."""
    variant = index if quick else index % SPEC_VARIANTS[codegen]
    digest = _draw(f"{seed}:{op}:{codegen}:{index}")
    return (random.Random(digest), random.Random(_draw(f"{seed}:{op}:{codegen}:spec{variant}")),
            torch.Generator().manual_seed(digest & (2**62 - 1)))


def run_cases(plan: list[tuple[str, str, int]], args, device: torch.device, cache_dir: str,
              emit: Callable[[Outcome], None], started: Callable[[tuple[str, str, int]], None] = lambda item: None):
    runner = Runner(args.target, device, cache_dir)
    size = QUICK if args.quick else LARGE
    for item in plan:
        op, codegen, index = item
        started(item)
        rng, srng, g = case_rng(args.seed, op, codegen, index, args.quick)
        start = time.perf_counter()
        try:
            case = GENERATORS[op](rng, srng, g, size, device,
                                  **({"extras": False} if (op, codegen) in WITHOUT_EXTRAS else {}))
            case.random_config = rng.random() < (0.5 if args.quick else RANDOM_CONFIG_SHARE[codegen])
        except Exception as err:
            emit(Outcome(op, codegen, index, "crash", "case generation", _describe_exception(err, "the fuzzer")))
            continue
        outcome, why, config = runner.run(op, codegen, case, rng)
        what = case.what + layouts(op, case.args)
        emit(Outcome(op, codegen, index, outcome, what, why, config, round(time.perf_counter() - start, 3)))
        if outcome == "crash" and device.type == "cuda" and _device_lost(why):
            sys.stdout.flush()
            os._exit(_DEVICE_LOST)


def layouts(op: str, args: tuple) -> str:
    """The tensor arguments that are not plain dense tensors: name, strides, storage offset."""
    names = [argument.name for argument in OPS[op][0]._schema.arguments]
    views = [f"{name} strides {tuple(a.stride())} offset {a.storage_offset()}" for name, a in zip(names, args)
             if isinstance(a, torch.Tensor) and a.numel() and (not a.is_contiguous() or a.storage_offset())]
    return f" [views: {'; '.join(views)}]" if views else ""


def repro(args, outcome: Outcome) -> str:
    mode = " --quick" if args.quick else ""
    return (f"python tools/fuzz.py{mode} --ops {outcome.op} --codegens {outcome.codegen} --seed {args.seed} "
            f"--only {outcome.index}")


def make_plan(args, device: torch.device) -> list[tuple[str, str, int]]:
    """(op, codegen, case index) in rounds: case 0 of every op and codegen, then case 1, ...: a run stopped by a
    time limit has covered every op evenly (a case's inputs depend only on the seed, op, codegen and index)."""
    pairs = [(op, codegen) for op in args.ops for codegen in codegens_for(op, device)
             if not args.codegens or codegen in args.codegens]
    indices = args.only if args.only is not None else range(args.cases)
    return [(op, codegen, i) for i in indices for op, codegen in pairs]


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _output_tail(proc: subprocess.CompletedProcess, lines: int = 20) -> str:
    """The last lines of a worker's stderr and stdout, for the report of its death."""
    parts = []
    for name, text in (("stderr", proc.stderr), ("stdout", proc.stdout)):
        tail = (text or "").strip().splitlines()[-lines:]
        parts.append(f"--- worker {name} (last {len(tail)} lines) ---\n" + "\n".join(tail) if tail
                     else f"--- worker {name}: empty ---")
    return "\n".join(parts)


def _last_words(proc: subprocess.CompletedProcess) -> str:
    """One line of why a worker died: faulthandler's 'Fatal Python error' line, else its output's last line."""
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    fatal = [line for line in lines if line.startswith("Fatal Python error")]
    return (fatal or lines or ["no output"])[-1]


# A worker that dies before its first case is started again this many times (its predecessor's dead CUDA
# context may still be being torn down), then the run stops: the failure is not in a case.
_STARTUP_RETRIES = 2


def _run_worker(command: list[str], log_path: Path, scratch: str, on_entry) -> subprocess.CompletedProcess:
    """One worker process; each line it logs is passed to `on_entry` as it appears, so that a run stopped by a time
    limit still reports the cases done so far. The worker is killed if the parent is interrupted."""
    out_path, err_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        pending = ""
        try:
            with open(log_path, "a+") as log:
                log.seek(0)
                while True:
                    finished = proc.poll() is not None
                    pending += log.read()
                    *lines, pending = pending.split("\n")  # a line still being written waits for its end
                    for line in lines:
                        on_entry(line)
                    if finished:
                        break
                    time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if pending:
        on_entry(pending)  # the worker died mid-line: judged (and dropped) by the caller
    # Decoded leniently: a dying process can leave partial UTF-8 behind.
    text = [path.read_bytes().decode("utf-8", errors="replace") for path in (out_path, err_path)]
    return subprocess.CompletedProcess(command, proc.returncode, *text)


def run_isolated(plan, args, device, cache_dir, emit) -> None:
    """Cases in worker processes: a worker that dies (a GPU fault) costs its current case, recorded as a crash;
    the next worker starts at the case after it. A dead worker's exit status and output tail are printed."""
    remaining = list(plan)
    startup_failures = 0
    while remaining:
        with tempfile.TemporaryDirectory() as scratch:
            plan_path, log_path = Path(scratch) / "plan.json", Path(scratch) / "log.jsonl"
            plan_path.write_text(json.dumps(remaining))
            command = [sys.executable, __file__, "--worker", str(plan_path), "--log", str(log_path),
                       "--seed", str(args.seed), "--target", args.target, "--cache-dir", cache_dir]
            command += ["--quick"] if args.quick else []
            done, in_flight = 0, None

            def on_entry(line: str) -> None:
                nonlocal done, in_flight
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the worker's death
                    return
                if "started" in entry:
                    in_flight = tuple(entry["started"])
                else:
                    emit(Outcome(**entry))
                    done += 1
                    in_flight = None

            proc = _run_worker(command, log_path, scratch, on_entry)
        remaining = remaining[done:]
        if proc.returncode == 0 or not remaining:
            break
        status = _exit_status(proc.returncode)
        if proc.returncode != _DEVICE_LOST or in_flight is not None:  # not a fault the worker recorded itself
            print(f"\nfuzz worker died ({status}) after {done} case(s)\n{_output_tail(proc)}", file=sys.stderr,
                  flush=True)
        if in_flight is not None and tuple(remaining[0]) == in_flight:
            emit(Outcome(*in_flight, "crash", "(the worker died)",
                         f"worker process died ({status}): {_last_words(proc)[:300]}"))
            remaining = remaining[1:]
            startup_failures = 0
        elif done == 0:  # died before its first case
            startup_failures += 1
            if startup_failures > _STARTUP_RETRIES:
                raise RuntimeError(f"fuzz worker failed before any case {startup_failures} times in a row "
                                   f"({status})\n{_output_tail(proc)}")
        else:
            startup_failures = 0


def table(results: list[Outcome], ops: list[str], device: torch.device, args) -> str:
    lines = ["| op | codegen | cases | match | fallback | clear-error | mismatch | crash | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for op in ops:
        codegens = [c for c in codegens_for(op, device) if not args.codegens or c in args.codegens]
        if not codegens:
            lines.append(f"| {op} | (none runs here) | 0 | 0 | 0 | 0 | 0 | 0 | 0 |")
        for codegen in codegens:
            mine = [r for r in results if r.op == op and r.codegen == codegen]
            counts = [sum(r.outcome == name for r in mine) for name in OUTCOMES]
            seconds = sum(r.seconds for r in mine)
            lines.append(f"| {op} | {codegen} | {len(mine)} | " + " | ".join(str(c) for c in counts)
                         + f" | {seconds:.1f} |")
    return "\n".join(lines)


def report(results: list[Outcome], args, device: torch.device, seconds: float, partial: bool = False) -> str:
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else "CPU (Triton interpreter; TileLang needs a GPU)")
    if device.type == "cuda" and tilelang_codegen.import_problem() is not None:
        where += f" (TileLang not run: {tilelang_codegen.import_problem()})"
    text = [f"# dzc op fuzzer: {'--quick' if args.quick else 'large'} mode, seed {args.seed}"
            + (" (partial: still running or stopped)" if partial else ""), "",
            f"{where}; target {args.target}; torch {torch.__version__}; {len(results)} cases in {seconds:.0f} s", "",
            table(results, args.ops, device, args), ""]
    bad = [r for r in results if r.outcome in ("mismatch", "crash")]
    if bad:
        text += ["## Mismatches and crashes", ""]
        for r in bad:
            text += [f"- **{r.outcome}** {r.op}/{r.codegen} case {r.index}: {r.what}",
                     f"  - {r.why}" + (f" (config {r.config})" if r.config else ""),
                     f"  - repro: `{repro(args, r)}`"]
        text.append("")
    fallbacks = sorted({(r.op, r.codegen, r.why) for r in results if r.outcome == "fallback"})
    if fallbacks:
        text += ["## Instances the kernels refuse (dzc runs the reference there)", ""]
        text += [f"- {op}/{codegen}: {why}" for op, codegen, why in fallbacks[:30]]
        text.append("")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI size: tiny shapes (about a minute on 2 CPU cores)")
    parser.add_argument("--ops", nargs="+", choices=sorted(KERNEL_FAMILIES), default=sorted(KERNEL_FAMILIES))
    parser.add_argument("--codegens", nargs="+", choices=("triton", "tilelang"),
                        help="default: every code generator that runs here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, help="cases per op and codegen (default: 8 quick, 32 large)")
    parser.add_argument("--only", type=int, nargs="+",
                        help="run only these case indices, in this order (a repro; with --in-process in one process)")
    parser.add_argument("--target", default="cuda", help="the profile kernels are generated for (default cuda)")
    parser.add_argument("--out", help="write the table and the failures as markdown")
    parser.add_argument("--cache-dir", help="generated kernels (default: a fresh temp dir)")
    parser.add_argument("--in-process", action="store_true", help="on a GPU too, no worker process")
    parser.add_argument("--isolate", action="store_true", help="on a CPU too, cases in worker processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # NaN and inf inputs are drawn on purpose: numpy's (the interpreter's) and torch's warnings about them are noise.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message=".*degrees of freedom.*")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="dzc-fuzz-")

    if args.worker:
        faulthandler.enable()  # a hard crash (SIGSEGV, SIGABRT) still leaves a Python traceback on stderr
        plan = [tuple(item) for item in json.loads(Path(args.worker).read_text())]
        with open(args.log, "a") as log:
            def write(entry):
                log.write(json.dumps(entry) + "\n")
                log.flush()
            run_cases(plan, args, device, cache_dir, lambda r: write(dataclasses.asdict(r)),
                      started=lambda item: write({"started": list(item)}))
        return 0

    args.cases = args.cases if args.cases is not None else (8 if args.quick else 32)
    plan = make_plan(args, device)
    results: list[Outcome] = []

    start = time.perf_counter()

    def emit(result: Outcome) -> None:
        results.append(result)
        if args.out and (len(results) % 10 == 0 or result.outcome in ("mismatch", "crash")):
            # Kept current, so that a run stopped by a time limit still leaves its table.
            Path(args.out).write_text(report(results, args, device, time.perf_counter() - start, partial=True) + "\n")
        mark = {"match": ".", "fallback": "f", "clear-error": "e"}.get(result.outcome)
        if mark is None or args.only is not None:
            print(f"\n{result.outcome.upper()} {result.op}/{result.codegen} case {result.index}: {result.what}\n"
                  f"  {result.why}{f' (config {result.config})' if result.config else ''}\n  repro: "
                  f"{repro(args, result)}", flush=True)
        else:
            print(mark, end="", flush=True)

    interrupted = False
    try:
        if args.isolate or (device.type == "cuda" and not args.in_process):
            run_isolated(plan, args, device, cache_dir, emit)
        else:
            run_cases(plan, args, device, cache_dir, emit)
    except KeyboardInterrupt:  # a time limit (SIGINT): the cases done so far still make a table
        interrupted = True
    seconds = time.perf_counter() - start
    print()
    text = report(results, args, device, seconds, partial=interrupted)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if interrupted or any(r.outcome in ("mismatch", "crash") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
