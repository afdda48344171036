"""Kernels of the DSA ops (dzc.dsa_indexer, dzc.dsa_topk, dzc.sparse_attention) against the ops' references.

CPU: the Triton kernels run through Triton's interpreter on small shapes (ragged batches in shuffled pages, both
indexer cache layouts, invalid indices, rows with no valid index, tied logits, rows shorter than k), in the
default config and in configs that take the other code paths (several query rows per program across a sequence
boundary, several tiles per program, decode split-K). Every emitted config is checked for legality on every
profile; Triton kernels are compiled ahead of time for sm_90 in a subprocess; the TileLang sparse attention and
top-k are lowered to CUDA and compiled with nvcc for sm_90a. GPU tests (marked gpu) run full DeepSeek-V3.2 shapes,
and the TileLang top-k in every config on rows of 4K to 200K positions (k = 2048 and 1, ties, -inf, NaN).
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from dzc import config as dzc_config
from dzc import kv_cache
from dzc.lowering import Execution
from dzc.ops import OPS
from dzc.ops.dsa import dsa_indexer_reference, dsa_topk_reference, sparse_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import INTERPRETER, TARGETS, dsa_cases, dsa_indexer, dsa_topk, sparse_attention, tilelang_codegen
from dzc.targets import triton_codegen
from dzc.targets.generated_module import import_generated
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.legality import config_problems
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90
from dzc.targets.stale_shared_memory import poison_shared_memory

# DeepSeek-V3.2's selection width and cache page size (the sparse attention specs' static sizes).
DSA_V32 = dict(topk=2048, page_size=64)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE
FAMILIES = {"dsa_indexer": dsa_indexer, "dsa_topk": dsa_topk, "sparse_attention": sparse_attention}


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _load_triton(family, spec, tmp_path):
    path = tmp_path / f"{family.__name__.rsplit('.', 1)[1]}_{abs(hash(spec))}.py"
    path.write_text(family.triton_source(spec, SM_90))
    return triton_codegen.load(family, path, spec, SM_90)


def _run_triton(family, spec, kernel, config, args):
    """Launch `config` on the op's arguments with NaN/garbage-poisoned outputs; returns the op's result."""
    inputs, outputs, _, result = family.prepare(spec, *args)
    for out in outputs:
        out.fill_(float("nan") if out.is_floating_point() else -7)
    family.triton_launch(kernel, config, *inputs, *outputs)
    return result


# ---------------------------------------------------------------------------------------------------------
# dsa_indexer

INDEXER_CASES = {
    # (seq_lens, queries per sequence, max_context): decode (1-2 per sequence), prefill chunks, a context wider
    # than every sequence (columns past the end are −inf) and one narrower than the longest.
    "decode": ([37, 200, 5, 64], [1, 2, 1, 1], None),
    "prefill": ([37, 130, 5], [6, 10, 3], 150),
    "narrow-context": ([90, 140], [2, 1], 100),
}
# layout -> (FP8 cache, q dtype): the FP8 cache with an e4m3 q, and with a bf16 q (the model's own, keys widened).
INDEXER_LAYOUTS = {"bf16": (False, torch.bfloat16), "fp8": (True, torch.float8_e4m3fn),
                   "fp8-bf16q": (True, torch.bfloat16), "fp32": (False, torch.float32)}
# fp32 caches (allowed by the op, multiplied in full precision) once; both DSA layouts in every case.
INDEXER_PARAMS = ([(case, layout) for case in INDEXER_CASES for layout in ("bf16", "fp8")]
                  + [("decode", "fp32"), ("prefill", "fp8-bf16q")])
INDEXER_CONFIGS = [
    None,  # the default
    KernelConfig.make(num_warps=4, num_stages=2, ROWS=4, BLOCK_N=32, BLOCKS_PER_PROGRAM=1),  # rows span sequences
    KernelConfig.make(num_warps=4, num_stages=2, ROWS=2, BLOCK_N=64, BLOCKS_PER_PROGRAM=3),  # tiles per program
]


@pytest.mark.parametrize("case, layout", INDEXER_PARAMS)
def test_indexer_matches_reference(case, layout, seed, tmp_path):
    seq_lens, per_seq, max_context = INDEXER_CASES[case]
    fp8, q_dtype = INDEXER_LAYOUTS[layout]
    fp8_q = q_dtype == torch.float8_e4m3fn
    args = dsa_cases.indexer_args(seq_lens, per_seq, heads=4, head_dim=64, fp8=fp8, page_size=16, device=DEVICE,
                                  generator=_generator(seed), max_context=max_context,
                                  dtype=torch.bfloat16 if fp8_q else q_dtype, fp8_q=fp8_q)
    assert args[0].dtype == q_dtype
    spec = dsa_indexer.spec_for(args[0], args[2])
    kernel = _load_triton(dsa_indexer, spec, tmp_path)
    expected = dsa_indexer_reference(*args)
    for config in INDEXER_CONFIGS:
        config = config or dsa_indexer.triton_default_config(spec, SM_90)
        logits = _run_triton(dsa_indexer, spec, kernel, config, args)
        assert not logits.isnan().any(), f"{config}: unwritten logits"
        assert torch.equal(logits.isinf(), expected.isinf()), f"{config}: −inf (masked) columns differ"
        # Exact products, fp32 sums in another order: relative to the magnitude of the terms. FP8 x FP8 on a
        # Hopper GPU: tiles of 64 rows or more run on wgmma, whose FP8 accumulation keeps about 14 bits (DeepSeek-V3
        # report, 3.3.2; measured here: errors up to 2^-12.2 of the largest logit), as DeepGEMM's indexer has.
        scale = expected[expected.isfinite()].abs().max()
        atol = (2**-10 if fp8_q and DEVICE.type == "cuda" else 1e-5) * scale
        torch.testing.assert_close(logits, expected, atol=atol, rtol=1e-5, msg=lambda m: f"{config}: {m}")


def test_indexer_rejects_mismatched_q_and_cache():
    args = dsa_cases.indexer_args([20], [1], 4, 64, fp8=False, page_size=16, device="cpu", generator=_generator(0))
    with pytest.raises(ValueError, match="needs a torch.bfloat16 q, got torch.float16"):
        dsa_indexer.spec_for(args[0].to(torch.float16), args[2])


# ---------------------------------------------------------------------------------------------------------
# dsa_topk

TOPK_CONFIGS = [
    # sampled bounds: a sample of 64 keys, at most 128 candidates (rows of 200: the bracket holds)
    KernelConfig.make(num_warps=4, num_stages=1, BLOCK=128, RADIX_BITS=8, SAMPLE=64, CANDIDATES=128),
    # 4-bit digits (8 passes), chunks that end mid-row, room for 16 candidates only: most rows overflow it and
    # take the whole-row radix select
    KernelConfig.make(num_warps=4, num_stages=1, BLOCK=64, RADIX_BITS=4, SAMPLE=32, CANDIDATES=16),
    KernelConfig.make(num_warps=4, num_stages=1, BLOCK=256, RADIX_BITS=8, SAMPLE=0, CANDIDATES=0),  # radix only
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
# 300 > width: every row is shorter than k; k = 1: Triton specializes an integer argument equal to 1 as a constant
@pytest.mark.parametrize("k", [1, 16, 300])
def test_topk_matches_reference(ties, k, seed, tmp_path):
    # Rows longer than k, shorter than k, empty, a length past the width (clamped), one short of the width.
    args = dsa_cases.topk_args(6, 200, [200, 10, 0, 1000, 199, 17], k, DEVICE, _generator(seed), ties=ties)
    spec = dsa_topk.DsaTopkSpec()
    kernel = _load_triton(dsa_topk, spec, tmp_path)
    expected = dsa_topk_reference(*args)
    for config in TOPK_CONFIGS:
        indices = _run_triton(dsa_topk, spec, kernel, config, args)
        torch.testing.assert_close(indices, expected, atol=0, rtol=0, msg=lambda m: f"{config}: {m}")


def test_topk_all_equal_row_takes_smallest_positions(tmp_path):
    """Every key equal: no digit separates them; the first k positions win."""
    logits = torch.full((2, 200), 0.5, device=DEVICE)
    logits[1, 150:] = float("-inf")  # −inf inside the length is still a candidate, after every finite value
    args = (logits, torch.tensor([200, 180], dtype=torch.int32, device=DEVICE), 160)
    spec = dsa_topk.DsaTopkSpec()
    indices = _run_triton(dsa_topk, spec, _load_triton(dsa_topk, spec, tmp_path), TOPK_CONFIGS[0], args)
    torch.testing.assert_close(indices, dsa_topk_reference(*args), atol=0, rtol=0)
    assert indices[0].tolist() == list(range(160))


def test_topk_signed_zeros_tie_and_every_nan_ranks_largest(seed, tmp_path):
    """As the reference's sort orders them: -0.0 and +0.0 are equal (the smaller position first), and NaNs of
    either sign and any payload are equal to each other and above +inf."""
    generator = _generator(seed)
    logits = torch.randn(2, 200, generator=generator).to(DEVICE)
    logits[:, 10:60] = torch.where(torch.arange(50) % 2 == 0, -0.0, 0.0).to(DEVICE)
    logits[:, 60:] -= 100.0  # below the zeros: the top 50 + 4 are the zeros, the NaNs and +inf
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
    logits[0, [150, 3, 77, 199]] = nans.view(torch.float32).to(DEVICE)
    logits[1, 120] = float("inf")
    logits[1, [5, 170]] = nans[1:3].view(torch.float32).to(DEVICE)
    args = (logits, torch.tensor([200, 200], dtype=torch.int32, device=DEVICE), 30)
    spec = dsa_topk.DsaTopkSpec()
    kernel = _load_triton(dsa_topk, spec, tmp_path)
    expected = dsa_topk_reference(*args)
    assert {3, 77, 150, 199} <= set(expected[0].tolist()) and {5, 120, 170} <= set(expected[1].tolist())
    for config in TOPK_CONFIGS:
        indices = _run_triton(dsa_topk, spec, kernel, config, args)
        torch.testing.assert_close(indices, expected, atol=0, rtol=0, msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("profile", [SM_90, MP_22], ids=lambda p: p.name)
def test_topk_untuned_choice_and_candidates_per_row_width(profile):
    """The untuned choice per row width: sampled bounds, chunks as wide as the row up to 4096 positions, 8 a thread;
    tuning times chunks no wider than the row, and the whole-row radix select beside them."""
    spec = dsa_topk.DsaTopkSpec()
    configs, _ = legal_configs(dsa_topk, "triton", spec, profile)
    default = dsa_topk.triton_default_config(spec, profile)
    assert default in configs and dsa_topk.radix_config(profile) in configs
    chosen = {}
    for width in (100, 2000, 8192, 32768, 131072):
        candidates, chosen[width] = dsa_topk.configs_for_bucket(spec, profile, dsa_topk.token_bucket(width),
                                                                configs, default)
        assert chosen[width] in candidates and set(candidates) <= set(configs), width
        assert dsa_topk.radix_config(profile) in candidates, width
        narrowest = min(c["BLOCK"] for c in configs if c["SAMPLE"])
        widest = max(dsa_topk.token_bucket(width), narrowest)
        assert all(c["BLOCK"] <= widest for c in candidates if c["SAMPLE"]), width
        assert chosen[width]["SAMPLE"] == dsa_topk.SAMPLE, width
    expected = [1024, 2048, 4096, 4096, 4096] if profile is SM_90 else [2048, 2048, 4096, 4096, 4096]
    assert [chosen[w]["BLOCK"] for w in chosen] == expected
    for config in configs:
        per_thread = config["BLOCK"] // (config.num_warps * profile.warp_size)
        assert per_thread <= 16 or config == dsa_topk.radix_config(profile), config


def test_topk_sampled_bounds_on_long_rows_match_reference(tmp_path):
    """Rows of thousands of positions with the shipped sample and candidate sizes: the sampled path on random
    rows, and rows it cannot bracket (all keys equal: every key is a candidate, more than fit) through the
    whole-row radix select; both exact."""
    generator = _generator(3)
    width, k = 6000, 300
    logits = torch.randn(4, width, generator=generator).to(DEVICE)
    logits[2] = 0.25  # ties everywhere: 6000 candidates > CANDIDATES
    logits[3, ::2] = logits[3, 1::2]  # pairs of equal keys
    lengths = torch.tensor([width, 4500, width, 5999], dtype=torch.int32, device=DEVICE)
    spec = dsa_topk.DsaTopkSpec()
    kernel = _load_triton(dsa_topk, spec, tmp_path)
    config = dsa_topk.configs_for_bucket(spec, SM_90, dsa_topk.token_bucket(width),
                                         dsa_topk.triton_configs(spec, SM_90),
                                         dsa_topk.triton_default_config(spec, SM_90))[1]
    assert config["SAMPLE"] == dsa_topk.SAMPLE and config["CANDIDATES"] == dsa_topk.CANDIDATES
    args = (logits, lengths, k)
    torch.testing.assert_close(_run_triton(dsa_topk, spec, kernel, config, args), dsa_topk_reference(*args),
                               atol=0, rtol=0)


@pytest.mark.parametrize("width, ties", [(1000, True), (1024, False)], ids=["padded-ties", "whole-pieces"])
def test_topk_of_long_rows_in_pieces_matches_reference(width, ties, seed, tmp_path, monkeypatch):
    """split_rows (rows at least SPLIT_FROM wide: the k largest of each piece, then of those), at small sizes:
    pieces of 128 from 256 positions on, the real kernel in both rounds (a small config: the interpreter runs a
    program per piece). Lengths end before, at, inside and past piece boundaries, below k and at 0; NaNs (the
    largest) in one row; outputs poisoned."""
    monkeypatch.setattr(dsa_topk, "SPLIT_WIDTH", 128)
    monkeypatch.setattr(dsa_topk, "SPLIT_FROM", 256)
    lengths = [width, 0, 5, 128, 129, 700, width - 1, 2 * width]
    assert len(lengths) < dsa_topk.SPLIT_ROWS_BELOW
    args = dsa_cases.topk_args(len(lengths), width, lengths, 16, DEVICE, _generator(seed), ties=ties)
    args[0][0, 3::37] = float("nan")
    # The largest finite logit at position 0, where the first round's −1s gather their values from: a second
    # round that read past the valid candidates would pick those and answer −1.
    args[0][:, 0] = 1e30
    spec = dsa_topk.DsaTopkSpec()
    indices = _run_triton(dsa_topk, spec, _load_triton(dsa_topk, spec, tmp_path), TOPK_CONFIGS[0], args)
    torch.testing.assert_close(indices, dsa_topk_reference(*args), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# sparse_attention

ATTENTION_SHAPES = {
    # heads, kv_heads, d_qk, d_v, separate v_cache, FP8 latent cache
    "mla": (16, 1, 80, 64, False, False),  # latent MQA: V = K[..., :64] (64 + 16 rope, FlashMLA's 512 + 64 in small)
    "mla-narrow-v": (16, 1, 80, 32, False, False),  # V = K[..., :32]: a second gather
    # V rows narrower than 128 bytes: the Triton V tile is padded to 64 columns (Triton 3.6's Hopper wgmma read
    # past a 32-byte-row tile: the fuzzer's crash), and a 64-byte K tile is not reused as V.
    "mqa-v16": (16, 1, 64, 16, False, False),
    "mqa-v-is-k32": (16, 1, 32, 32, False, False),
    "mqa-v-cache": (4, 1, 48, 32, True, False),
    "mha": (4, 4, 64, 64, True, False),
    # The FP8 latent layout (e4m3 + a scale per 128 values + bf16 rope): 2 scale tiles + a 16-wide rope.
    "mla-fp8": (16, 1, 272, 256, False, True),
}


def _attention_configs(spec, uneven_splits):
    """The prefill default, the decode default, 4 splits and, if asked, 3 splits (a split of padding tiles)."""
    default = sparse_attention.triton_default_config(spec, SM_90)
    decode = sparse_attention.configs_for_bucket(spec, SM_90, 1, sparse_attention.triton_configs(spec, SM_90),
                                                 default)[1]
    splits = [4, 3] if uneven_splits else [4]
    return [default, decode] + [KernelConfig.make(decode.num_warps, decode.num_stages,
                                                  **{**dict(decode.params), "SPLITS": n}) for n in splits
                                if n != decode["SPLITS"]]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_sparse_attention_matches_reference(shape, seed, tmp_path):
    heads, kv_heads, d_qk, d_v, separate_v, fp8_cache = ATTENTION_SHAPES[shape]
    args = dsa_cases.sparse_attention_args([37, 100, 5], [1, 4, 2], heads, kv_heads, d_qk, d_v, separate_v,
                                           topk=24, page_size=16, device=DEVICE, generator=_generator(seed),
                                           fp8_cache=fp8_cache)
    spec = sparse_attention.spec_for(args[0], args[1], args[2], args[6], args[8])
    assert spec.fp8_cache is fp8_cache
    kernels = _load_triton(sparse_attention, spec, tmp_path)
    expected = sparse_attention_reference(*args)
    assert (expected == 0).all(dim=(1, 2)).any(), "the case should have a row with no valid index"
    for config in _attention_configs(spec, uneven_splits=shape in ("mla", "mla-fp8")):
        out = _run_triton(sparse_attention, spec, kernels, config, args)
        assert not out.isnan().any(), f"{config}: unwritten output"
        # bf16 output of an fp32 softmax: two bf16 units at unit magnitude.
        torch.testing.assert_close(out.float(), expected.float(), atol=2**-6, rtol=2**-7,
                                   msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("shape", ["mla", "mha"])
@pytest.mark.parametrize("extras", [dict(causal=True), dict(window=6), dict(sinks=True), dict(window=6, sinks=True),
                                    dict(causal=True, index_block=4), dict(window=6, sinks=True, index_block=4)],
                         ids=["causal", "window", "sinks", "window+sinks", "blocks", "blocks+window+sinks"])
def test_sparse_attention_with_window_sinks_and_blocks_matches_reference(shape, extras, seed, tmp_path):
    """A local window beside the selected set (selected positions inside it, and past the query, skipped), per-head
    sinks, indices that select blocks of 4 positions, in the prefill kernel and in the decode kernels (sinks in
    their combine step)."""
    heads, kv_heads, d_qk, d_v, separate_v, _ = ATTENTION_SHAPES[shape]
    args = dsa_cases.sparse_attention_args([37, 100, 5], [1, 4, 2], heads, kv_heads, d_qk, d_v, separate_v,
                                           topk=24, page_size=16, device=DEVICE, generator=_generator(seed),
                                           **extras)
    spec = sparse_attention.spec_for(*args[:3], args[6], args[8], args[9], args[10], *args[12:])
    assert spec.causal is ("causal" in extras or "window" in extras) and spec.sinks is ("sinks" in extras)
    assert spec.index_block == extras.get("index_block", 1)
    assert sparse_attention.tilelang_configs(spec, SM_90) == []  # Triton serves them
    kernels = _load_triton(sparse_attention, spec, tmp_path)
    expected = sparse_attention_reference(*args)
    for config in _attention_configs(spec, uneven_splits=shape == "mla"):
        out = _run_triton(sparse_attention, spec, kernels, config, args)
        assert not out.isnan().any(), f"{config}: unwritten output"
        torch.testing.assert_close(out.float(), expected.float(), atol=2**-6, rtol=2**-7,
                                   msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("separate_v", [False, True], ids=["v-from-k", "v-cache"])
def test_index_blocks_over_rows_of_odd_stride(separate_v, seed, tmp_path):
    """Index blocks of 2 over fp32 caches whose token rows are one element longer than a row (an odd stride): the
    fuzzer's case that faulted on the H200 (misaligned address) when Triton 3.6 assumed pairs of positions were
    8-byte aligned rows; padding elements are NaN, so a row read from the wrong place shows."""
    args = list(dsa_cases.sparse_attention_args([37, 100, 5], [1, 4, 2], 16, 1, 48, 32, separate_v, topk=24,
                                                page_size=16, device=DEVICE, generator=_generator(seed),
                                                dtype=torch.float32, index_block=2))
    for i in (1, 2) if separate_v else (1,):
        padded = torch.full((*args[i].shape[:-1], args[i].shape[-1] + 1), float("nan"), device=DEVICE)
        padded[..., :-1] = args[i]
        args[i] = padded[..., :-1]
        assert args[i].stride(1) % 2 == 1
    spec = sparse_attention.spec_for(*args[:3], args[6], args[8], args[9], args[10], *args[12:])
    assert spec.index_block == 2 and not spec.causal
    kernels = _load_triton(sparse_attention, spec, tmp_path)
    expected = sparse_attention_reference(*args)
    for config in _attention_configs(spec, uneven_splits=True):
        out = _run_triton(sparse_attention, spec, kernels, config, args)
        assert not out.isnan().any(), f"{config}: unwritten output"
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"{config}: {m}")


def test_window_and_sinks_mean_what_dense_masked_attention_computes(seed):
    """The reference's window and sinks against dense attention over the whole sequence under the mask
    causal & (selected | window), with the sinks as an extra softmax column, written out independently."""
    window = 5
    q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, scale, d_v, query_pos, sinks, _ = \
        dsa_cases.sparse_attention_args([37, 20], [3, 2], 4, 4, 32, 32, True, topk=8, page_size=16, device="cpu",
                                        generator=_generator(seed), dtype=torch.float32, window=window, sinks=True)
    out = sparse_attention_reference(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, scale, d_v,
                                     query_pos, sinks, window)
    for t in range(q.shape[0]):
        b, position = int(query_seq[t]), int(query_pos[t])
        length = int(seq_lens[b])
        where = torch.arange(length)
        rows = block_table[b, where // 16].long() * 16 + where % 16
        keys = k_cache.flatten(0, 1)[rows].float()  # [length, H, D]
        values = v_cache.flatten(0, 1)[rows].float()
        selected = torch.zeros(length, dtype=torch.bool)
        chosen = indices[t][(indices[t] >= 0) & (indices[t] < length)].long()
        selected[chosen] = True
        keep = (where <= position) & (selected | (where > position - window))
        scores = torch.einsum("hd,khd->hk", q[t].float(), keys) * scale
        scores = torch.cat([scores.masked_fill(~keep, float("-inf")), sinks[:, None]], dim=1)
        expected = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=1)[:, :-1], values)
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


def test_index_blocks_mean_their_positions(seed):
    """index_block = 4: each index stands for its 4 positions; the same call with the positions listed one by one
    (index_block 1) is the same attention, future positions of the query's own block masked by query_pos."""
    args = dsa_cases.sparse_attention_args([37, 20], [3, 2], 4, 1, 32, 16, False, topk=5, page_size=8, device="cpu",
                                           generator=_generator(seed), dtype=torch.float32, causal=True,
                                           index_block=4)
    indices = args[6]
    assert (indices >= 0).any() and (indices[:, :, None] * 4 + 3 > args[9][:, None, None]).any()  # straddles
    listed = torch.where(indices[:, :, None] >= 0, indices[:, :, None] * 4 + torch.arange(4), -1).flatten(1)
    expected = sparse_attention_reference(*args[:6], listed.int(), *args[7:12])
    torch.testing.assert_close(sparse_attention_reference(*args), expected, atol=1e-6, rtol=1e-6)


def test_sparse_attention_refuses_a_window_without_query_positions():
    args = dsa_cases.sparse_attention_args([9], [1], 2, 1, 32, 32, False, topk=4, page_size=8, device="cpu",
                                           generator=_generator(0), window=3)
    with pytest.raises(ValueError, match="window must be >= 0 and needs query_pos"):
        torch.ops.dzc.sparse_attention(*args[:9], None, None, 3)
    with pytest.raises(ValueError, match=r"sinks must be fp32 \[heads=2\]"):
        torch.ops.dzc.sparse_attention(*args[:9], args[9], torch.zeros(3), 3)


def test_fp8_latent_reference_is_the_bf16_reference_over_dequantized_rows(seed):
    """The oracle of the FP8 latent cache: the selected rows dequantized (dzc.kv_cache.dequantize_latent), then the
    bf16 cache's math, exactly; a malformed FP8 cache is refused."""
    args = dsa_cases.sparse_attention_args([37, 100], [1, 3], 16, 1, 272, 256, False, topk=24, page_size=16,
                                           device=DEVICE, generator=_generator(seed), fp8_cache=True)
    dequantized = kv_cache.dequantize_latent(args[1], 256, torch.bfloat16)
    assert dequantized.shape == (*args[1].shape[:3], 272)
    expected = sparse_attention_reference(args[0], dequantized, *args[2:])
    assert torch.equal(sparse_attention_reference(*args), expected)
    with pytest.raises(ValueError, match="FP8 latent k_cache"):
        torch.ops.dzc.sparse_attention(*args[:8], 128)  # d_v 128: not this layout's NoPE width
    with pytest.raises(ValueError, match="FP8 latent k_cache"):
        torch.ops.dzc.sparse_attention(args[0], args[1], args[1], *args[3:])  # a v_cache beside it


def test_prefill_and_decode_buckets_pick_their_kernels():
    spec = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)
    for codegen in ("triton", "tilelang"):
        configs = getattr(sparse_attention, f"{codegen}_configs")(spec, SM_90)
        default = getattr(sparse_attention, f"{codegen}_default_config")(spec, SM_90)
        decode, decode_default = sparse_attention.configs_for_bucket(spec, SM_90, 128, configs, default)
        prefill, prefill_default = sparse_attention.configs_for_bucket(spec, SM_90, 4096, configs, default)
        assert decode and all(c["SPLITS"] >= 1 for c in decode + [decode_default])
        assert prefill and all(c["SPLITS"] == 0 for c in prefill + [prefill_default])
        assert "decode" in sparse_attention.describe_config(decode_default)
        assert "prefill" in sparse_attention.describe_config(prefill_default)


def test_untuned_decode_splits_fill_the_gpu_at_small_batches():
    """The untuned decode choice: at 1-2 query rows enough splits for DECODE_PROGRAMS_WITHOUT_SPLITS programs (the
    H200 took 194 µs for one sequence on 8 programs), never more splits than BLOCK_N tiles of selected slots, and
    none once rows x head blocks fill the GPU by themselves."""
    spec = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)
    default = sparse_attention.triton_default_config(spec, SM_90)
    tiles = DSA_V32["topk"] // default["BLOCK_N"]
    head_blocks = -(-128 // default["BLOCK_H"])
    for bucket in (1, 2, 4, 8, 16, 32, 64, 128):
        splits = sparse_attention.configs_for_bucket(spec, SM_90, bucket, [], default)[1]["SPLITS"]
        programs = bucket * head_blocks
        if programs >= sparse_attention.DECODE_PROGRAMS_WITHOUT_SPLITS:
            assert splits == 1, bucket
        else:
            assert 1 <= splits <= tiles, bucket
            assert programs * splits >= min(sparse_attention.DECODE_PROGRAMS_WITHOUT_SPLITS, programs * tiles), bucket
    narrow = dataclasses.replace(spec, topk=24)  # one tile of selected slots: splitting it finds nothing to share
    assert sparse_attention.configs_for_bucket(narrow, SM_90, 1, [], default)[1]["SPLITS"] == 1
    # TileLang's warp-specialized kernel (MLA's untuned choice) splits as Triton's does, at least two tiles a split
    # (it runs them in pairs); its other split kernel keeps 4 splits below the threshold.
    tilelang = sparse_attention.tilelang_default_config(spec, SM_90)
    assert tilelang["WARP_SPECIALIZED"] == 1
    assert sparse_attention.configs_for_bucket(spec, SM_90, 2, [], tilelang)[1]["SPLITS"] == tiles // 2
    classic = next(c for c in sparse_attention.tilelang_configs(spec, SM_90)
                   if not dict(c.params).get("WARP_SPECIALIZED"))
    assert sparse_attention.configs_for_bucket(spec, SM_90, 2, [], classic)[1]["SPLITS"] == 4


def _every_other(vector: torch.Tensor, fill: int) -> torch.Tensor:
    """`vector` as every other element of a buffer holding `fill` in between (stride 2)."""
    buffer = torch.full((2 * vector.shape[0],), fill, dtype=vector.dtype, device=vector.device)
    buffer[::2] = vector
    return buffer[::2]


# op -> (build its arguments, positions of its per-row / per-sequence int32 vectors)
STRIDED_VECTOR_CASES = {
    "dsa_indexer": (lambda g: dsa_cases.indexer_args([37, 20, 5], [1, 2, 1], 4, 64, fp8=False, page_size=16,
                                                     device=DEVICE, generator=g), (4, 5, 6)),
    "dsa_topk": (lambda g: dsa_cases.topk_args(4, 100, [100, 10, 0, 57], 16, DEVICE, g), (1,)),
    "sparse_attention": (lambda g: dsa_cases.sparse_attention_args([37, 20, 5], [1, 2, 1], 16, 1, 80, 64, False,
                                                                   topk=24, page_size=16, device=DEVICE,
                                                                   generator=g), (4, 5)),
}


@pytest.mark.parametrize("op", STRIDED_VECTOR_CASES)
def test_strided_int_vectors_are_read_by_element(op, seed, tmp_path):
    """seq_lens, query_seq, query_pos and lengths as strided views (found by tools/fuzz.py: the kernels indexed
    them as dense vectors and read the buffer's neighbouring elements)."""
    build, positions = STRIDED_VECTOR_CASES[op]
    args = list(build(_generator(seed)))
    for position in positions:
        args[position] = _every_other(args[position], 0)
    args = tuple(args)
    family = FAMILIES[op]
    spec = KERNEL_SPEC[op](args)
    expected = OPS[op][1](*args)
    # The top-k's lengths are read the same way in every config: its small sampled one (the default's 2048-key
    # sample is ~4 s a row for the interpreter's sort; the default's numerics: test_selftest_cases_through_lowering).
    config = TOPK_CONFIGS[0] if op == "dsa_topk" else family.triton_default_config(spec, SM_90)
    got = _run_triton(family, spec, _load_triton(family, spec, tmp_path), config, args)
    if op == "sparse_attention":
        torch.testing.assert_close(got.float(), expected.float(), atol=2**-6, rtol=2**-7)
    elif op == "dsa_indexer":
        assert torch.equal(got.isinf(), expected.isinf()), "masked (−inf) columns differ"
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    else:
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


KERNEL_SPEC = {
    "dsa_indexer": lambda args: dsa_indexer.spec_for(args[0], args[2]),
    "dsa_topk": lambda args: dsa_topk.DsaTopkSpec(),
    "sparse_attention": lambda args: sparse_attention.spec_for(args[0], args[1], args[2], args[6], args[8]),
}


# ---------------------------------------------------------------------------------------------------------
# Long context: a decode step at 1M tokens, its pages spread over pools past 2^31 bytes

LONG_CONTEXT = (1 << 20) + 37  # one sequence of 1M + 37 tokens: 16385 pages of 64


def _sparse_pool(path, pages: int, row_shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 page pool [pages, *row_shape] in a sparse file mapped shared: its size is virtual, only the pages a
    test writes or reads take memory, so a pool past 2^31 bytes costs what a small one does."""
    numel = pages * int(torch.Size(row_shape).numel())
    with open(path, "wb") as file:
        file.truncate(numel)
    return torch.from_file(str(path), shared=True, size=numel, dtype=torch.uint8).view(pages, *row_shape)


def test_decode_at_1m_context_with_offsets_past_2_31(seed, tmp_path):
    """Indexer over 1M keys in the FP8 cache, top-k over the 1M logits, sparse attention over the FP8 latent cache:
    each op's block table row is 16385 pages wide and maps the sequence to physical pages whose byte offsets pass
    2^31 (indexer keys, 2304 B/page: pages 940000..; latent, 41984 B/page: pages 52000..) in pools of sparse
    files. A 32-bit page or row offset reads the wrong page (or outside the pool); the references index in 64 bits.
    (The ops share one block table in a model; separate ones here keep each pool small.)"""
    if DEVICE.type != "cpu":
        pytest.skip("the CPU proof of the offsets; test_decode_at_1m_context_on_gpu runs it on the device")
    generator = _generator(seed)
    page_size, index_dim, heads, topk = 64, 32, 4, 64
    pages = -(-LONG_CONTEXT // page_size)

    def table_from(first_page: int, pool_pages: int) -> torch.Tensor:
        return (first_page + torch.randperm(pool_pages - first_page, generator=generator)[:pages]).int()[None]

    def slots_of(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[0].long()[positions // page_size] * page_size + positions % page_size

    seq_lens, query_seq = torch.tensor([LONG_CONTEXT], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    query_pos = seq_lens - 1
    index_pool_pages = 1_000_000
    index_table = table_from(940_000, index_pool_pages)
    index_cache = _sparse_pool(tmp_path / "index.bin", index_pool_pages,
                               (kv_cache.fp8_index_page_bytes(page_size, index_dim),))
    assert int(index_table.min()) * index_cache.stride(0) > 2**31
    kv_cache.write_index_keys(index_cache, slots_of(index_table, torch.arange(LONG_CONTEXT)),
                              torch.randn(LONG_CONTEXT, index_dim, generator=generator))
    q_index = (torch.randn(1, heads, index_dim, generator=generator) * 8).to(torch.float8_e4m3fn)
    weights = torch.randn(1, heads, generator=generator)
    index_args = (q_index, weights, index_cache, index_table, seq_lens, query_seq, query_pos, LONG_CONTEXT)
    spec = dsa_indexer.spec_for(q_index, index_cache)
    # Wide tiles: the interpreter's cost is per tile (the default 64-key tiles take minutes over 1M keys).
    config = KernelConfig.make(num_warps=4, num_stages=2, ROWS=1, BLOCK_N=8192, BLOCKS_PER_PROGRAM=16)
    logits = _run_triton(dsa_indexer, spec, _load_triton(dsa_indexer, spec, tmp_path), config, index_args)
    expected_logits = dsa_indexer_reference(*index_args)
    assert logits.shape == (1, LONG_CONTEXT) and not logits.isnan().any()
    scale = expected_logits.abs().max()
    torch.testing.assert_close(logits, expected_logits, atol=1e-5 * scale, rtol=1e-5)

    topk_args = (expected_logits, seq_lens, topk)
    spec = dsa_topk.DsaTopkSpec()
    # The 1M row takes split_rows' two rounds (33 pieces of 32K, then their 33 x 64 candidates), each row through
    # the sampled bracket and the shipped candidate count. A 256-key sample, not the shipped 2048: the interpreter
    # sorts it per program (~4 s a 2048-key sort on the CI machine, 33 of them); the bracket still holds (~900 of a
    # piece's keys, within CANDIDATES), so the path is the same. The shipped sample on long rows:
    # test_topk_sampled_bounds_on_long_rows_match_reference.
    config = KernelConfig.make(num_warps=4, num_stages=1, BLOCK=16384, RADIX_BITS=8, SAMPLE=256,
                               CANDIDATES=dsa_topk.CANDIDATES)
    indices = _run_triton(dsa_topk, spec, _load_triton(dsa_topk, spec, tmp_path), config, topk_args)
    assert torch.equal(indices, dsa_topk_reference(*topk_args))

    # The FP8 latent rows of the selected tokens only (the rest of the 1M stay unwritten holes), two beyond the
    # sequence's end (invalid) among them.
    d_v, d_qk = 512, 576  # DeepSeek-V3.2's 656 B/token
    latent_pool_pages = 70_000
    latent_table = table_from(52_000, latent_pool_pages)
    latent_cache = _sparse_pool(tmp_path / "latent.bin", latent_pool_pages,
                                (page_size, 1, kv_cache.fp8_latent_token_bytes(d_v, d_qk - d_v)))
    assert int(latent_table.min()) * latent_cache.stride(0) > 2**31
    kv_cache.write_latent(latent_cache, slots_of(latent_table, indices[0].long()),
                          torch.randn(topk, d_qk, generator=generator).bfloat16(), d_v)
    indices[0, :2] = torch.tensor([LONG_CONTEXT, -1], dtype=torch.int32)
    attention_args = (torch.randn(1, 16, d_qk, generator=generator).bfloat16(), latent_cache, None, latent_table,
                      seq_lens, query_seq, indices, d_qk ** -0.5, d_v)
    spec = sparse_attention.spec_for(*attention_args[:3], attention_args[6], d_v)
    kernels = _load_triton(sparse_attention, spec, tmp_path)
    expected = sparse_attention_reference(*attention_args)
    assert expected.abs().max() > 0
    for config in _attention_configs(spec, uneven_splits=False):
        out = _run_triton(sparse_attention, spec, kernels, config, attention_args)
        torch.testing.assert_close(out.float(), expected.float(), atol=2**-6, rtol=2**-7,
                                   msg=lambda m: f"{config}: {m}")


# ---------------------------------------------------------------------------------------------------------
# Through dzc's lowering: the op called with the kernel id that lowering binds (the path compiled graphs take)


@pytest.mark.parametrize("op", FAMILIES)
def test_selftest_cases_through_lowering(op, seed, tmp_path):
    family = FAMILIES[op]
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False, codegen="triton")
    op_overload, reference = OPS[op]
    for index, (name, build) in enumerate(family.selftest_cases(SM_90)):
        if name == "mla-prefill" and DEVICE.type == "cpu":
            continue  # 300 query rows: minutes in the interpreter (test_sparse_attention_* covers the kernel)
        args = build(DEVICE, _generator(seed + index))
        record, _ = lower_op(op, args, target, options, Execution(INTERPRETER if DEVICE.type == "cpu" else
                                                                    target.runtime))
        result = op_overload(*args, kernel_id=record.kernel_id)
        expected = reference(*args)
        if op == "dsa_topk":
            assert torch.equal(result, expected), name
        elif op == "dsa_indexer":
            assert torch.equal(result.isinf(), expected.isinf()), name
            torch.testing.assert_close(result, expected, atol=1e-3, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(result.float(), expected.float(), atol=2**-6, rtol=2**-7,
                                       msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------------
# Config legality on every profile

INDEXER_SPECS = [dsa_indexer.DsaIndexerSpec(64, 128, dtype, fp8)
                 for dtype, fp8 in ((torch.float8_e4m3fn, True), (torch.bfloat16, False))]
ATTENTION_SPECS = [sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32),
                   sparse_attention.SparseAttentionSpec(16, 16, 192, 128, torch.bfloat16, True, **DSA_V32),
                   sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, fp8_cache=True,
                                                        **DSA_V32)]
SPECS = [(dsa_indexer, s) for s in INDEXER_SPECS] + [(dsa_topk, dsa_topk.DsaTopkSpec())] \
    + [(sparse_attention, s) for s in ATTENTION_SPECS]


@pytest.mark.parametrize("profile", [SM_90, SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_every_emitted_config_is_legal(profile):
    for family, spec in SPECS:
        for codegen in ("triton", "tilelang"):
            if not hasattr(family, f"{codegen}_configs"):
                continue
            legal, _ = legal_configs(family, codegen, spec, profile)
            fp8 = getattr(spec, "fp8", False) or getattr(spec, "fp8_cache", False)
            fp8_without_fp8 = fp8 and not profile.supports_dtype(torch.float8_e4m3fn)
            mha_tilelang = codegen == "tilelang" and not getattr(spec, "shared_kv", True)
            where = (profile.name, codegen, spec.describe())
            if codegen == "tilelang" and getattr(spec, "fp8_cache", False):
                # Only the warp-specialized kernel reads the FP8 latent cache: on profiles with wgmma and TMA.
                wants = profile.matrix_instruction == "wgmma" and profile.bulk_tensor_copies and not fp8_without_fp8
                assert bool(legal) == wants, where
            else:
                assert bool(legal) != fp8_without_fp8 or mha_tilelang and legal, where
            smem = getattr(family, f"{codegen}_shared_memory_bytes")
            if legal:  # the untuned default (what runs without autotuning) is legal too
                legal = legal + [getattr(family, f"{codegen}_default_config")(spec, profile)]
            for config in legal:
                threads = config.num_warps * profile.warp_size
                assert threads <= profile.max_threads_per_block and threads % profile.warp_size == 0, where
                assert smem(spec, config) <= profile.shared_memory_per_block, (where, str(config))
                if codegen == "triton":
                    assert config.num_warps <= profile.max_num_warps, (where, str(config))
                assert config_problems(profile, threads=threads, num_warps=config.num_warps if codegen == "triton"
                                       else None, shared_memory_bytes=smem(spec, config), dtypes=spec.dtypes) == []


def test_fp8_indexer_has_configs_only_where_the_profile_has_fp8():
    fp8 = INDEXER_SPECS[0]
    assert legal_configs(dsa_indexer, "triton", fp8, MP_31)[0]
    assert not legal_configs(dsa_indexer, "triton", fp8, MP_22)[0]
    assert legal_configs(dsa_indexer, "triton", INDEXER_SPECS[1], MP_22)[0]


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation for sm_90 (catches what the interpreter lets through: layouts, dot shapes, dtypes)

_AOT_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from dzc.targets import dsa_indexer, dsa_topk, sparse_attention, triton_codegen
    from dzc.targets.profiles import SM_90
    workdir = Path(sys.argv[1])
    results = []
    def compile_one(family, spec, name, signature, constexprs, num_warps):
        path = workdir / (family.__name__.rsplit(".", 1)[1] + ".py")
        path.write_text(family.triton_source(spec, SM_90))
        compiled = triton_codegen.compile_ahead_of_time(path, name, signature, constexprs, num_warps, SM_90)
        results.append([name, compiled.metadata.shared, "wgmma.mma_async" in compiled.asm["ptx"]])
    for spec in (dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True),
                 dsa_indexer.DsaIndexerSpec(64, 128, torch.bfloat16, True),
                 dsa_indexer.DsaIndexerSpec(64, 128, torch.bfloat16, False)):
        config = dsa_indexer.triton_default_config(spec, SM_90)
        compile_one(dsa_indexer, spec, dsa_indexer.TRITON_KERNEL_NAME, *dsa_indexer.triton_signature(spec, config),
                    config.num_warps)
        results[-1].append(dsa_indexer.triton_shared_memory_bytes(spec, config))
    spec = dsa_topk.DsaTopkSpec()
    # the sampling default and the whole-row radix form (no sample, no candidates: session 16's form that the
    # interpreter ran and Triton refused to compile)
    for config in (dsa_topk.triton_default_config(spec, SM_90), dsa_topk.radix_config(SM_90)):
        compile_one(dsa_topk, spec, dsa_topk.TRITON_KERNEL_NAME, *dsa_topk.triton_signature(spec, config),
                    config.num_warps)
        results[-1].append(dsa_topk.triton_shared_memory_bytes(spec, config))
    # The bf16 and the FP8 (656 B/token) latent cache; the bf16 one with a window, sinks and index blocks too.
    for fp8_cache, extras in ((False, {}), (True, {}), (False, dict(causal=True, sinks=True, index_block=64))):
        spec = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, fp8_cache, topk=2048,
                                                    page_size=64, **extras)
        prefill = sparse_attention.triton_default_config(spec, SM_90)
        decode = sparse_attention.configs_for_bucket(spec, SM_90, 1, [], prefill)[1]
        for config in (prefill, decode):
            for name, (signature, constexprs, num_warps) in sparse_attention.triton_signatures(spec, config).items():
                compile_one(sparse_attention, spec, name, signature, constexprs, num_warps)
                results[-1].append(sparse_attention.triton_shared_memory_bytes(spec, config))
    print(json.dumps(results))
""")


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {name for name, *_ in results} == {dsa_indexer.TRITON_KERNEL_NAME, dsa_topk.TRITON_KERNEL_NAME,
                                               *sparse_attention.TRITON_KERNEL_NAMES}
    for name, shared, wgmma, estimate in results:
        # The legality estimate must bound what Triton really allocates, or pruning would let illegal configs by.
        assert shared <= estimate, (name, shared, estimate)
        # 64 heads x gathered rows on Hopper: warpgroup MMAs, with either cache (the FP8 rows dequantized first).
        if name in ("sparse_attention_kernel", "sparse_attention_split_kernel"):
            assert wgmma, name


# ---------------------------------------------------------------------------------------------------------
# TileLang sparse attention: lowered to CUDA and compiled with nvcc for sm_90a (no GPU needed)

requires_nvcc = pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not installed")
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)


@pytest.fixture(scope="module")
def lowered_mla(tmp_path_factory):
    """CUDA source of the TileLang MLA kernels for sm_90a: prefill, decode split, decode combine."""
    path = tmp_path_factory.mktemp("tilelang") / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(MLA, SM_90))
    configs = sparse_attention.tilelang_configs(MLA, SM_90)
    default = sparse_attention.tilelang_default_config(MLA, SM_90)
    prefill = sparse_attention.configs_for_bucket(MLA, SM_90, 4096, configs, default)[1]
    decode = sparse_attention.configs_for_bucket(MLA, SM_90, 64, configs, default)[1]
    combine = KernelConfig.make(decode.num_warps, decode.num_stages, **dict(decode.params), PART=1)
    return {name: tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, config,
                                                          SM_90)
            for name, config in (("prefill", prefill), ("decode", decode), ("combine", combine))}


@pytest.mark.slow
def test_tilelang_sparse_attention_lowers_for_sm90a(lowered_mla):
    assert set(lowered_mla) == {"prefill", "decode", "combine"}
    for name, source in lowered_mla.items():
        assert "__global__" in source, name
    # 64 heads × gathered rows on Hopper: warpgroup MMAs (wgmma), not mma.sync or a scalar loop.
    assert "wgmma" in lowered_mla["prefill"] and "wgmma" in lowered_mla["decode"]


@requires_nvcc
@pytest.mark.slow
def test_tilelang_sparse_attention_compiles_with_nvcc(lowered_mla, tmp_path):
    """The decode split kernel (the prefill kernel is the same loop with another epilogue): one nvcc run, since
    each takes about a minute on the CI machine."""
    assert tilelang_codegen.nvcc_compile(lowered_mla["decode"], SM_90, tmp_path).stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------
# TileLang top-k: source, configs, launch; lowered to CUDA and compiled with nvcc for sm_90a (no GPU needed)

TOPK_SPEC = dsa_topk.DsaTopkSpec()


def _topk_tilelang_path(directory, profile=SM_90):
    path = directory / f"dsa_topk_tilelang_{profile.arch}.py"
    path.write_text(dsa_topk.tilelang_source(TOPK_SPEC, profile))
    return path


@pytest.mark.parametrize("profile", [SM_90, SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_tilelang_topk_source_and_configs(profile):
    """The source renders for every profile (its warp size in it); the default and every bucket's choice are legal
    configs; rows up to a span are written from one bitmap span, longer ones span by span."""
    import ast

    source = dsa_topk.tilelang_source(TOPK_SPEC, profile)
    module = ast.parse(source)
    assert "do not edit" in ast.get_docstring(module) and "$" not in source
    assert f"WARP = {profile.warp_size} " in source
    (factory,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == dsa_topk.TILELANG_FACTORY_NAME]
    assert [arg.arg for arg in factory.args.args] == ["threads", "width", "candidates", "sweep", "radix_bits", "cache",
                                                      "warp_vote", "speculate", "speculate_buffer", "phase_stamps"]
    (kernel,) = [n for n in ast.walk(factory) if isinstance(n, ast.FunctionDef) and n.name == "dsa_topk"]
    # (stamps: a kernel argument only with phase_stamps)
    assert [arg.arg for arg in kernel.args.args] == ["logits", "lengths", "indices", "stamps"]
    configs, _ = legal_configs(dsa_topk, "tilelang", TOPK_SPEC, profile)
    default = dsa_topk.tilelang_default_config(TOPK_SPEC, profile)
    assert configs and default in configs
    assert not any("PHASE_STAMPS" in dict(c.params) for c in configs)  # a diagnostic build, never tuned
    # Warp votes: only where a warp is one 32-bit bitmap word, each the twin of a legal config without them, never
    # in the default (the widest span, past the cached keys)
    votes = [c for c in configs if dict(c.params).get("WARP_VOTE")]
    assert not votes or profile.warp_size == 32
    assert {dict(c.params).get("WARP_VOTE") for c in votes} <= {1} and "WARP_VOTE" not in dict(default.params)
    assert all(KernelConfig.make(c.num_warps, c.num_stages, **{n: v for n, v in c.params if n != "WARP_VOTE"})
               in configs for c in votes)
    if profile is SM_90:
        assert sorted(c["WIDTH"] for c in votes) == list(dsa_topk.TILELANG_WIDTHS)
    # The speculative buffer: likewise, each the twin of its span's choice without it (where it is legal), and the
    # untuned choice itself exactly where the span is wider than the cached keys (measured faster there)
    speculative = [c for c in configs if dict(c.params).get("SPECULATE")]
    assert not speculative or profile.warp_size == 32
    assert {(c["SPECULATE"], c["SPECULATE_BUFFER"]) for c in speculative} <= {(1, dsa_topk.TILELANG_SPECULATE_BUFFER)}
    assert len({c["WIDTH"] for c in speculative}) == len(speculative)
    for config in speculative:
        twin = KernelConfig.make(config.num_warps, config.num_stages,
                                 **{n: v for n, v in config.params if not n.startswith("SPECULATE")})
        without = [c for c in configs if not dict(c.params).get("SPECULATE") and not dict(c.params).get("WARP_VOTE")]
        assert twin == dsa_topk.configs_for_bucket(TOPK_SPEC, profile, config["WIDTH"], without, default)[1], config
    if profile is SM_90:
        assert sorted(c["WIDTH"] for c in speculative) == list(dsa_topk.TILELANG_WIDTHS)
    for bucket in (1024, 4096, 32768, 131072, 1 << 20):
        candidates, chosen = dsa_topk.configs_for_bucket(TOPK_SPEC, profile, bucket, configs, default)
        assert chosen in candidates and set(candidates) <= set(configs), bucket
        assert len({c["WIDTH"] for c in candidates}) == 1, bucket
        assert (chosen["THREADS"], chosen["SWEEP"]) == (default["THREADS"], default["SWEEP"]), bucket
        wider = chosen["WIDTH"] > dict(chosen.params).get("CACHE", 0)
        # votes where the span is within the cached keys (timed faster there), the speculative buffer past them
        assert bool(dict(chosen.params).get("WARP_VOTE")) == (not wider and any(c["WIDTH"] == chosen["WIDTH"]
                                                                               for c in votes)), bucket
        if profile is SM_90:
            assert bool(dict(chosen.params).get("WARP_VOTE")) == (bucket <= 32768), bucket
        assert bool(dict(chosen.params).get("SPECULATE")) == (wider and any(c["WIDTH"] == chosen["WIDTH"]
                                                                          for c in speculative)), bucket
        if profile is SM_90:
            assert bool(dict(chosen.params).get("SPECULATE")) == (bucket > 32768), bucket
        widths = sorted({c["WIDTH"] for c in configs})
        assert chosen["WIDTH"] == next((w for w in widths if w >= bucket), widths[-1]), bucket
    # The Triton configs still narrow the Triton way.
    triton_configs, _ = legal_configs(dsa_topk, "triton", TOPK_SPEC, profile)
    chosen = dsa_topk.configs_for_bucket(TOPK_SPEC, profile, 32768, triton_configs,
                                         dsa_topk.triton_default_config(TOPK_SPEC, profile))[1]
    assert chosen["SAMPLE"] == dsa_topk.SAMPLE


def test_tilelang_topk_launch_passes_logits_lengths_and_indices():
    """The Triton launch's arguments; the kernel gets the logits, the lengths and the indices (k is their width;
    no scratch); strided logits are copied into a dense tensor first."""

    class RecordingKernels:
        def __init__(self):
            self.calls = []

        def kernel_for(self, config):
            return lambda *args: self.calls.append((config, args))

    config = dsa_topk.tilelang_default_config(TOPK_SPEC, SM_90)
    logits, lengths = torch.randn(3, 100), torch.tensor([100, 5, 0], dtype=torch.int32)
    inputs, outputs, work, result = dsa_topk.prepare(TOPK_SPEC, logits, lengths, 16)
    kernels = RecordingKernels()
    dsa_topk.tilelang_launch(kernels, config, *inputs, *outputs)
    dsa_topk.tilelang_launch(kernels, config, torch.randn(3, 200)[:, ::2], lengths, 16, *outputs)
    (_, dense), (_, strided) = kernels.calls
    assert len(dense) == 3 and dense[0] is logits and dense[1] is inputs[1] and dense[2] is result
    assert strided[0].is_contiguous() and strided[0].shape == (3, 100) and strided[2] is result


def test_tilelang_kernel_pass_configs_must_exist(tmp_path):
    """PASS_CONFIGS of a generated module reach lowering; a name the installed TileLang lacks is an error."""
    import tilelang

    path = _topk_tilelang_path(tmp_path)
    configs = tilelang_codegen.kernel_pass_configs(path, SM_90)
    assert configs == {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    bad = tmp_path / "bad_kernel.py"
    bad.write_text('PASS_CONFIGS = {"TL_NO_SUCH_CONFIG": True}\n')
    with pytest.raises(RuntimeError, match="TL_NO_SUCH_CONFIG"):
        tilelang_codegen.kernel_pass_configs(bad, SM_90)


@pytest.fixture(scope="module")
def topk_lowering(tmp_path_factory):
    """config -> TileLang's artifact of the top-k kernel (TOPK_SPEC) for sm_90a, each config lowered once for the
    whole module (10-30 s each on the CI machine; several tests read the same config's CUDA)."""
    path = _topk_tilelang_path(tmp_path_factory.mktemp("tilelang_topk_lowered"))
    artifacts = {}

    def lower(config: KernelConfig):
        if config not in artifacts:
            artifacts[config] = tilelang_codegen.lower(path, dsa_topk.TILELANG_FACTORY_NAME, config, SM_90)
        return artifacts[config]

    return lower


@pytest.fixture(scope="module")
def lowered_topk(topk_lowering):
    """TileLang's artifacts of the top-k kernel for sm_90a: the default (1024 threads, the 128K span, SPECULATE=1),
    512 threads over the 32K span with 32 loads in flight a thread, and 1024 threads over the 32K span with its keys
    cached."""
    default = dsa_topk.tilelang_default_config(TOPK_SPEC, SM_90)
    narrow = KernelConfig.make(num_warps=16, num_stages=1, THREADS=512, WIDTH=32768,
                               CANDIDATES=dsa_topk.TILELANG_CANDIDATES, SWEEP=16384)
    cached = KernelConfig.make(num_warps=32, num_stages=1, THREADS=1024, WIDTH=32768,
                               CANDIDATES=dsa_topk.TILELANG_CANDIDATES, SWEEP=8192, RADIX_BITS=10,
                               CACHE=dsa_topk.TILELANG_CACHE)
    return {config: topk_lowering(config) for config in (default, narrow, cached)}


def _sweep_around(lines: list[str], index: int) -> list[str] | None:
    """The whole loop (header to closing brace) that lines[index] sits in: the innermost `for` around it that is
    not an unrolled one; None where there is none (SPECULATE=1's first sweep step, peeled: straight-line code)."""
    depth = len(lines[index]) - len(lines[index].lstrip())
    for start in range(index - 1, -1, -1):
        indent = len(lines[start]) - len(lines[start].lstrip())
        if indent >= depth:
            continue
        depth = indent
        if lines[start].lstrip().startswith("for (") and "#pragma unroll" not in lines[start - 1]:
            end = next(i for i in range(start + 1, len(lines))
                       if lines[i].strip() == "}" and len(lines[i]) - len(lines[i].lstrip()) == indent)
            return lines[start:end + 1]
    return None


@pytest.mark.slow
def test_tilelang_topk_lowers_for_sm90a(lowered_topk):
    """Both configs lower; the row's offsets are 64-bit (rows × width may pass 2^31: 4096 prefill rows × 1M); the
    shared memory is what the legality estimate says; no barrier inside the sweeps over the row (TileLang's
    automatic ones are off: PASS_CONFIGS) and the histogram's and candidates' updates are shared-memory atomics."""
    import re

    for config, artifact in lowered_topk.items():
        source = artifact.kernel_source
        assert "__global__" in source, config
        for parameter in ("int* __restrict__ indices", "const int* __restrict__ lengths",
                          "const float* __restrict__ logits", "int k", "int n_cols", "int rows"):
            assert parameter in source, (config, parameter)
        offsets = re.findall(r"logits\[([^\]]*)\]", source)
        assert offsets and all("int64_t" in offset for offset in offsets), config
        (device_func,) = artifact.device_mod.functions.values()
        assert int(device_func.attrs["dyn_shared_memory_buf"]) <= dsa_topk.tilelang_shared_memory_bytes(
            TOPK_SPEC, config) <= SM_90.shared_memory_per_block
        lines = source.splitlines()
        atomics = [i for i, line in enumerate(lines) if "AtomicAdd" in line or "AtomicOr" in line]
        # the first histogram, the candidates' counter, the rounds' histograms, the bitmaps
        assert {"hist", "candidate_count", "above_bits", "tie_bits"} <= set(re.findall(
            r"Atomic\w+\(\(&\(\(\(\w+\*\)(\w+)\)", "\n".join(lines[i] for i in atomics))), config
        sweeps = [sweep for sweep in (_sweep_around(lines, index) for index in atomics) if sweep is not None]
        assert sweeps, config
        for sweep in sweeps:
            assert not any("__syncthreads" in line for line in sweep), (config, sweep[0])
        # TileLang 0.1.15's AtomicOr on a uint32 is a global-memory reduction: wrong on the shared bitmaps
        assert "AtomicOr" not in source, config


@requires_nvcc
@pytest.mark.slow
def test_tilelang_topk_compiles_with_nvcc(lowered_topk, tmp_path):
    """The default config (the 512-thread one differs in constants and unrolling only)."""
    config = dsa_topk.tilelang_default_config(TOPK_SPEC, SM_90)
    assert tilelang_codegen.nvcc_compile(lowered_topk[config].kernel_source, SM_90, tmp_path).stat().st_size > 0


@pytest.mark.slow
def test_tilelang_topk_phase_stamps_lower_for_sm90a(lowered_topk, tmp_path):
    """PHASE_STAMPS=1 (tools/diagnose_dsa_topk_phases.py): thread 0 reads %globaltimer and clock64 at each phase's
    end into a (rows, 2, phases) int64 argument, one barrier
    added before the last stamp; PHASE_STAMPS=0 is the plain kernel: the same TIR (structurally equal prim_funcs,
    which TileLang lowers alike; checked there rather than by a second 25-s lowering)."""
    from tilelang import tvm

    default = dsa_topk.tilelang_default_config(TOPK_SPEC, SM_90)
    plain = lowered_topk[default].kernel_source
    path = _topk_tilelang_path(tmp_path)
    off = KernelConfig.make(default.num_warps, default.num_stages, **dict(default.params), PHASE_STAMPS=0)
    name = dsa_topk.TILELANG_FACTORY_NAME
    assert tvm.ir.structural_equal(tilelang_codegen.build_prim_func(path, name, off),
                                   tilelang_codegen.build_prim_func(path, name, default))
    stamped = tilelang_codegen.lower_to_device_source(path, name, dsa_topk.tilelang_phase_stamped(default), SM_90)
    phases = import_generated(path).phases(default["RADIX_BITS"])
    assert phases[0] == "start" and phases[-1] == "write" and len(phases) == 11  # 10-bit rounds: two
    # each of the two round loops (over the candidates, over the whole row) stamps a round's two ends, indexed by it
    sites = sum(not name.startswith("round") for name in phases) + 2 * 2
    assert stamped.count("= dsa_topk_globaltimer();") == sites and stamped.count("= clock64();") == sites
    assert "asm volatile(\"mov.u64 %0, %%globaltimer;\"" in stamped
    assert "int64_t* __restrict__ stamps" in stamped and "stamps" not in plain and "globaltimer" not in plain
    stride = {int(s) for s in re.findall(r"\(\(int64_t\)\(\(int\)blockIdx\.x\)\) \* \(int64_t\)(\d+)\)", stamped)}
    assert stride == {2 * len(phases)}
    assert stamped.count("__syncthreads()") == plain.count("__syncthreads()") + 1


@requires_nvcc
@pytest.mark.slow
def test_tilelang_topk_warp_vote_collects_without_per_key_atomics(lowered_topk, topk_lowering, tmp_path):
    """WARP_VOTE=1 (session 34, the untuned choice within the cached keys): the second sweep (its twin without votes
    is lowered_topk's cached config) takes ABOVE's words from warp ballots (a plain store a word) and appends the
    bin's keys as SPECULATE=1's first sweep does (session 55): a mask a thread, one population count, a shuffle scan
    of the lanes' counts, one shared-memory atomicAdd a warp and step (lane 31's), broadcast by a shuffle; no
    ballot of "in the bin" (its popcounts were ~24 a warp and step), no atomic per key in that sweep, no barrier
    added. It compiles for sm_90a without spills (nvcc: at most the 64 registers a thread 1024 threads allow). Its
    numerics: test_tilelang_topk_cuda_runs_on_cpu_threads, and on a GPU every config's
    test_tilelang_topk_matches_reference_on_gpu."""
    (plain_config,) = [c for c in lowered_topk if dict(c.params).get("CACHE") and c["WIDTH"] == 32768]
    config = KernelConfig.make(plain_config.num_warps, plain_config.num_stages, **dict(plain_config.params),
                               WARP_VOTE=1)
    assert config in dsa_topk.tilelang_configs(TOPK_SPEC, SM_90)
    plain = lowered_topk[plain_config].kernel_source
    source = topk_lowering(config).kernel_source
    # above the bin, in a step inside the row and in the row's last step
    assert "__ballot_sync(" not in plain and source.count("__ballot_sync(") == 2
    assert "AtomicAddRet((&(((int*)candidate_count)" in plain
    assert "AtomicAddRet((&(((int*)candidate_count)" not in source
    lines = source.splitlines()
    (append,) = [i for i, line in enumerate(lines) if "atomicAdd((&(((int*)candidate_count)[0]))" in line]
    assert "threadIdx.x) & 31) == 31)" in lines[append - 1]  # lane 31's, after the scan
    sweep = "\n".join(_sweep_around(lines, append))
    assert sweep.count("__ballot_sync(") == 2 and "__shfl_up_sync(" in sweep and "__shfl_sync(" in sweep
    assert sweep.count("__popc(") == 2  # the mask's count, and a stored key's index in its thread's registers
    assert "AtomicAdd" not in sweep and "__syncthreads" not in sweep
    assert re.search(r"\(\(uint\*\)above_bits\)\[[^;]* >> 5\)\)\] = word\w*;", sweep)  # a word, stored
    assert source.count("__syncthreads()") == plain.count("__syncthreads()")
    report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path)
    assert "dsa_topk_kernel" in report and "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 64, report


@requires_nvcc
@pytest.mark.slow
def test_tilelang_topk_speculate_appends_by_warp_votes(topk_lowering, tmp_path):
    """SPECULATE=1 (session 35, a tuning candidate) at the 128K span on the H200: the first sweep's appends to the
    speculative buffer are one shared-memory atomicAdd a warp and step, by lane 31 after a shuffle scan of the
    lanes' counts (on the first step after the estimate, and in the loop over the rest, which has no barrier, for
    a step inside the row and for the last one); the candidates' arrays grow to the buffer (the shared memory is the
    legality estimate, within the H200's 227 KiB); it compiles for sm_90a without spills within the 64 registers a
    thread 1024 threads allow (nvcc 13.0: 55, 229680 bytes of shared memory). Its numerics:
    test_tilelang_topk_speculate_runs_on_cpu_threads, and on a GPU test_tilelang_topk_matches_reference_on_gpu."""
    (config,) = [c for c in dsa_topk.tilelang_configs(TOPK_SPEC, SM_90)
                 if dict(c.params).get("SPECULATE") and c["WIDTH"] == 131072]
    artifact = topk_lowering(config)
    source = artifact.kernel_source
    (device_func,) = artifact.device_mod.functions.values()
    shared = int(device_func.attrs["dyn_shared_memory_buf"])
    assert shared == dsa_topk.tilelang_shared_memory_bytes(TOPK_SPEC, config) <= SM_90.shared_memory_per_block
    lines = source.splitlines()
    appends = [i for i, line in enumerate(lines) if "atomicAdd((&(((int*)spec_count)[0]))" in line]
    assert len(appends) == 3 and all("threadIdx.x) & 31) == 31)" in lines[i - 1] for i in appends)  # lane 31's
    sweep = "\n".join(_sweep_around(lines, appends[1]))
    assert _sweep_around(lines, appends[2]) == _sweep_around(lines, appends[1])
    assert sweep.count("__shfl_up_sync(") == 2 and "__shfl_sync(" in sweep and "__syncthreads" not in sweep
    assert "AtomicAdd((&(((int*)hist)" in sweep and "logits[" in sweep  # the first sweep's histogram and loads
    report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path)
    assert "dsa_topk_kernel" in report and "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 64, report


@requires_nvcc
@pytest.mark.slow
def test_tilelang_topk_speculate_sweep_is_lean(topk_lowering):
    """SPECULATE=1's first sweep at the 128K span (session 35): on the H200 the appends had doubled its time (17.8
    -> 33.7 us), not by holding back its loads (the next step's were issued before the appends, as in the plain
    sweep) but by instructions: ~350 a warp and step against the plain sweep's ~169 (8 ballots and 17 population
    counts, 16 predicated stores, every key's order_key computed twice, a position test and a branch around each
    atomic). Now a step inside the row takes no position test: its next step's loads are plain loads (no bounds
    test: the only `n_cols` test in the loop is the last step's), its histogram atomics are unconditional, and its
    appends take no ballot: a compare and an or a key into a mask, one population count, a shuffle scan, one
    atomic a warp, and a loop over the thread's marked keys (few) for the stores. (307572f: ballots, no
    dsa_topk_load.)"""
    (config,) = [c for c in dsa_topk.tilelang_configs(TOPK_SPEC, SM_90)
                 if dict(c.params).get("SPECULATE") and c["WIDTH"] == 131072]
    source = topk_lowering(config).kernel_source
    lines = source.splitlines()
    appends = [i for i, line in enumerate(lines) if "atomicAdd((&(((int*)spec_count)[0]))" in line]
    sweep = _sweep_around(lines, appends[1])
    text = "\n".join(sweep)
    assert "__ballot_sync(" not in text
    # a step inside the row: every load unconditional, and the last step's loads the loop's only bounds tests
    loads = [i for i, line in enumerate(sweep) if "dsa_topk_load((&(logits[" in line]
    assert len(loads) == 1 and sweep[loads[0] - 1].lstrip().startswith("for (")
    assert sum("< n_cols" in line for line in sweep) == 1
    # the histogram of a step inside the row: its atomics under the unrolled loop directly (no position test)
    histogram = [i for i, line in enumerate(sweep) if "AtomicAdd((&(((int*)hist)" in line]
    assert len(histogram) == 2 and sum(sweep[i - 1].lstrip().startswith("for (") for i in histogram) == 1
    # population counts: a mask's count and a marked key's index, for each kind of step
    assert text.count("__popc(") == 4 and text.count("__shfl_up_sync(") == 2


# ---------------------------------------------------------------------------------------------------------
# GPU: DeepSeek-V3.2 shapes through dzc's lowering, both codegens for sparse attention


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["triton", "tilelang"])
@pytest.mark.parametrize("rows_per_seq", [[2, 1, 2], [200, 150, 300]], ids=["decode", "prefill"])
def test_full_size_sparse_attention_on_gpu(codegen, rows_per_seq, seed, tmp_path):
    target = TARGETS["cuda:sm_90"]
    args = dsa_cases.sparse_attention_args([3000, 700, 2500], rows_per_seq, 128, 1, 576, 512, False, topk=2048,
                                           page_size=64, device=DEVICE, generator=_generator(seed))
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False, codegen=codegen)
    record, _ = lower_op("sparse_attention", args, target, options, Execution(target.runtime))
    out = torch.ops.dzc.sparse_attention(*args, kernel_id=record.kernel_id)
    # The reference broadcasts K over the 128 heads in fp32: a few rows at a time.
    for start in range(0, out.shape[0], 8):
        rows = slice(start, start + 8)
        part = (args[0][rows], *args[1:5], args[5][rows], args[6][rows], *args[7:])
        torch.testing.assert_close(out[rows].float(), sparse_attention_reference(*part).float(), atol=2**-6,
                                   rtol=2**-6, msg=lambda m: f"rows {rows}: {m}")
    [(_, tuned)] = record.tuned.items()
    assert ("decode" if sum(rows_per_seq) <= sparse_attention.DECODE_MAX_ROWS else "prefill") in tuned["path"]


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk, d_v, dtype", [(64, 16, torch.float16), (32, 32, torch.bfloat16),
                                              (80, 32, torch.bfloat16)], ids=["v16-fp16", "v-is-k32", "v32-rope"])
def test_narrow_values_read_only_their_own_shared_memory(d_qk, d_v, dtype, seed, tmp_path):
    """Values narrower than 128-byte rows, V = K's first columns, 64 heads over one KV head (the fuzzer's case 21:
    d_v 16 in fp16 read outside its V tile, Triton 3.6's wgmma over 32-byte rows): the untuned configs and the 64 x
    64 tiles without splits or with one (case 21's), each launched right after a kernel that leaves NaN in every
    SM's shared memory, so that a read outside a tile shows as NaN (or faults) instead of passing on clean memory."""
    args = dsa_cases.sparse_attention_args([37, 300, 5], [1, 4, 2], 64, 1, d_qk, d_v, False, topk=70, page_size=16,
                                           device=DEVICE, generator=_generator(seed), dtype=dtype)
    spec = sparse_attention.spec_for(args[0], args[1], args[2], args[6], args[8])
    kernels = _load_triton(sparse_attention, spec, tmp_path)
    expected = sparse_attention_reference(*args)
    configs, _ = legal_configs(sparse_attention, "triton", spec, SM_90)
    chosen = _attention_configs(spec, uneven_splits=False)
    chosen += [c for c in configs if (c["BLOCK_H"], c["BLOCK_N"]) == (64, 64) and c["SPLITS"] in (0, 1)
               and c not in chosen]
    for config in chosen:
        poison_shared_memory(DEVICE)
        out = _run_triton(sparse_attention, spec, kernels, config, args)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{config}: NaN (a read of stale shared memory, or an unwritten output)"
        torch.testing.assert_close(out.float(), expected.float(), atol=2**-6, rtol=2**-7,
                                   msg=lambda m: f"{config}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_full_size_indexer_and_topk_on_gpu(fp8, seed, tmp_path):
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False)  # tuning is tested elsewhere
    args = dsa_cases.indexer_args([5000, 1200, 4097], [2, 1, 64], 64, 128, fp8, 64, DEVICE, _generator(seed))
    record, _ = lower_op("dsa_indexer", args, target, options, Execution(target.runtime))
    logits = torch.ops.dzc.dsa_indexer(*args, kernel_id=record.kernel_id)
    expected = dsa_indexer_reference(*args)
    assert torch.equal(logits.isinf(), expected.isinf())
    scale = expected[expected.isfinite()].abs().max()
    # Hopper's FP8 MMA accumulates with fewer than fp32's bits: 1e-3 of the largest logit; a wrong key is O(1).
    torch.testing.assert_close(logits, expected, atol=1e-3 * scale, rtol=1e-4)
    lengths = (args[6] + 1).to(torch.int32)
    record, _ = lower_op("dsa_topk", (expected, lengths, 2048), target, options, Execution(target.runtime))
    indices = torch.ops.dzc.dsa_topk(expected, lengths, 2048, kernel_id=record.kernel_id)
    assert torch.equal(indices, dsa_topk_reference(expected, lengths, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_latent", [True, False], ids=["fp8-latent", "bf16-latent"])
def test_decode_at_1m_context_on_gpu(fp8_latent, seed, tmp_path):
    """A decode step (2 query rows, multi-token prediction) of one 1M-token sequence in dzc's paged cache, at
    DeepSeek-V3.2's shapes, through dzc's lowering: FP8 indexer logits over 1M keys, top-k 2048 of the 1M logits,
    sparse attention over the latent cache (FP8 656 B/token or bf16), each against its reference."""
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False)
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    config = kv_cache.DSACacheConfig(layers=1)
    cache = kv_cache.PagedKVCache(config, max_pages=LONG_CONTEXT // 64 + 8, batch=1, fp8_index=True, device=DEVICE,
                                  fp8_latent=fp8_latent)
    slots = cache.reserve([LONG_CONTEXT])
    for start in range(0, LONG_CONTEXT, 1 << 18):  # in chunks: the fp32 temporaries of 1M rows add up
        part = slots[start:start + (1 << 18)]
        cache.write_index_keys(0, part, torch.randn(len(part), 128, device=DEVICE, generator=generator))
        cache.write_latent(0, part, torch.randn(len(part), 576, device=DEVICE, generator=generator).bfloat16())
    seq_lens, table = cache.seq_lens, cache.block_table
    query_seq = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    query_pos = torch.tensor([LONG_CONTEXT - 2, LONG_CONTEXT - 1], dtype=torch.int32, device=DEVICE)
    q_index = (torch.randn(2, 64, 128, device=DEVICE, generator=generator) * 8).to(torch.float8_e4m3fn)
    weights = torch.randn(2, 64, device=DEVICE, generator=generator)
    index_args = (q_index, weights, cache.index_keys[0], table, seq_lens, query_seq, query_pos, LONG_CONTEXT)
    record, _ = lower_op("dsa_indexer", index_args, target, options, Execution(target.runtime))
    logits = torch.ops.dzc.dsa_indexer(*index_args, kernel_id=record.kernel_id)
    expected = dsa_indexer_reference(*index_args)
    assert torch.equal(logits.isinf(), expected.isinf())
    torch.testing.assert_close(logits, expected, atol=1e-3 * expected[expected.isfinite()].abs().max(), rtol=1e-4)
    lengths = (query_pos + 1).to(torch.int32)
    record, _ = lower_op("dsa_topk", (expected, lengths, 2048), target, options, Execution(target.runtime))
    indices = torch.ops.dzc.dsa_topk(expected, lengths, 2048, kernel_id=record.kernel_id)
    assert torch.equal(indices, dsa_topk_reference(expected, lengths, 2048))
    q = torch.randn(2, 128, 576, device=DEVICE, generator=generator).bfloat16()
    attention_args = (q, cache.latent[0], None, table, seq_lens, query_seq, indices, 576 ** -0.5, 512)
    record, _ = lower_op("sparse_attention", attention_args, target, options, Execution(target.runtime))
    out = torch.ops.dzc.sparse_attention(*attention_args, kernel_id=record.kernel_id)
    torch.testing.assert_close(out.float(), sparse_attention_reference(*attention_args).float(), atol=2**-6,
                               rtol=2**-6)


# TileLang's CUDA for the top-k run on the CPU: each CUDA thread a std::thread, std::barrier for __syncthreads and
# for the warp shuffles, GCC atomics for the shared-memory atomics; stale shared memory (0xAB) and poisoned outputs
# (-7). Enough for a kernel without MMA, async copies or vector loads. Input: rows, n_cols, k, the logits, the
# lengths (binary); output: the indices.
_CUDA_ON_CPU_THREADS = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
typedef unsigned int uint;
typedef unsigned char uchar;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __restrict__
struct Dim3 { int x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx;
Dim3 blockIdx;
uchar *g_shmem;
std::barrier<> *g_block;
std::vector<std::barrier<> *> g_warps;
int g_exchange[64][32];
int *g_probe;  // a value per block that a test's edit of the kernel source records (-1 if none)
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline int __shfl_up_sync(uint, int v, int delta, int width) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (width != 32) { std::fprintf(stderr, "width %d\n", width); std::abort(); }
  g_exchange[warp][lane] = v;
  g_warps[warp]->arrive_and_wait();
  int r = lane >= delta ? g_exchange[warp][lane - delta] : v;
  g_warps[warp]->arrive_and_wait();
  return r;
}
inline uint __ballot_sync(uint mask, int p) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (mask != 0xFFFFFFFFu) { std::fprintf(stderr, "mask %x\n", mask); std::abort(); }
  g_exchange[warp][lane] = p != 0;
  g_warps[warp]->arrive_and_wait();  // (a lane that skips the vote leaves its warp waiting: the test times out)
  uint r = 0;
  for (int l = 0; l < 32; ++l) r |= (uint)g_exchange[warp][l] << l;
  g_warps[warp]->arrive_and_wait();
  return r;
}
inline int __shfl_sync(uint mask, int v, int src, int width) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (mask != 0xFFFFFFFFu || width != 32 || src < 0 || src >= 32) { std::fprintf(stderr, "shfl\n"); std::abort(); }
  g_exchange[warp][lane] = v;
  g_warps[warp]->arrive_and_wait();
  int r = g_exchange[warp][src];
  g_warps[warp]->arrive_and_wait();
  return r;
}
inline int __popc(uint x) { return __builtin_popcount(x); }
template <class T1, class T2> void AtomicAdd(T1 *a, T2 v) { __atomic_fetch_add(a, (T1)v, __ATOMIC_RELAXED); }
template <class T1, class T2> T1 AtomicAddRet(T1 *a, T2 v) { return __atomic_fetch_add(a, (T1)v, __ATOMIC_RELAXED); }
inline int atomicAdd(int *a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }
using std::max;
using std::min;
#include "kernel.inc"
int main(int argc, char **argv) {
  int threads = atoi(argv[1]);
  FILE *f = fopen(argv[2], "rb");
  int rows, n_cols, k;
  fread(&rows, 4, 1, f); fread(&n_cols, 4, 1, f); fread(&k, 4, 1, f);
  std::vector<float> logits((size_t)rows * n_cols);
  std::vector<int> lengths(rows), indices((size_t)rows * k, -7);
  fread(logits.data(), 4, logits.size(), f); fread(lengths.data(), 4, rows, f); fclose(f);
  std::vector<int> probe(rows, -1);
  g_probe = probe.data();
  std::vector<uchar> shmem(256 * 1024);
  for (int b = 0; b < rows; ++b) {
    memset(shmem.data(), 0xAB, shmem.size());  // stale shared memory
    g_shmem = shmem.data();
    blockIdx.x = b;
    std::barrier<> block(threads);
    g_block = &block;
    std::vector<std::barrier<> *> warps;
    for (int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
    g_warps = warps;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        threadIdx.x = t;
        dsa_topk_kernel(indices.data(), lengths.data(), logits.data(), k, n_cols, rows);
      });
    for (auto &th : pool) th.join();
    for (auto *w : warps) delete w;
  }
  FILE *o = fopen(argv[3], "wb");
  fwrite(indices.data(), 4, indices.size(), o); fclose(o);
  if (argc > 4) { o = fopen(argv[4], "wb"); fwrite(probe.data(), 4, rows, o); fclose(o); }
}
"""
# (kind, rows, width, k) with 256 threads, 8K-position bitmaps and 512 candidates: every path (candidates or rounds
# over the row; one bitmap span or several) and rows shorter than k.
_CPU_THREAD_CASES = [("normal", 6, 8192, 2048), ("normal", 6, 8192, 1), ("normal", 3, 20000, 2048),
                     ("ties", 6, 4096, 2048), ("ties", 3, 12000, 1000), ("special", 6, 6000, 2048),
                     ("special", 6, 6000, 1), ("equal", 2, 8192, 2048), ("normal", 4, 3000, 100),
                     ("special", 4, 17000, 5000)]


# The untuned choice's shape (1024 threads: 32 warps, a whole warp of warp sums to scan; 32K bitmaps), on fewer rows:
# every one of its threads is a thread of the host.
_CPU_THREAD_CASES_1024 = [("normal", 2, 32768, 2048), ("ties", 2, 32768, 2048), ("special", 2, 16384, 2048),
                          ("normal", 1, 70000, 2048)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.slow
@pytest.mark.parametrize(("threads", "radix_bits", "cache", "warp_vote"),
                         [(256, 8, 0, 0), (256, 10, 0, 0), (1024, 8, 0, 0), (256, 8, 4096, 0), (1024, 10, 32768, 0),
                          (256, 8, 0, 1), (256, 10, 4096, 1), (1024, 10, 32768, 1)])
def test_tilelang_topk_cuda_runs_on_cpu_threads(threads, radix_bits, cache, warp_vote, topk_lowering, seed,
                                                tmp_path):
    """The generated CUDA of a 256- and a 1024-thread config, compiled with g++ over _CUDA_ON_CPU_THREADS, gives the
    reference's positions: the kernel's numerics without a GPU (this found a loop whose bound the generated C
    re-evaluated each iteration while the loop shrank it). With 8- and 10-bit radix rounds (three and two rounds
    after the first histogram; 10 bits are four bins a thread at 256 threads), and keys cached in shared memory:
    4096 positions of rows up to 20000 wide (sweeps partly from the cache, partly from the logits) and 32K. With
    warp votes (WARP_VOTE: ballots, a shuffle, a warp's candidates' slots from one atomic add; a lane that skipped a
    vote would leave its warp's barrier waiting) on every path too: rows shorter than k, past the bitmap span,
    whose threshold bin overflows the candidates, with partial last warps and words."""
    extra = ({"RADIX_BITS": radix_bits} if radix_bits != 8 else {}) | ({"CACHE": cache} if cache else {}) | (
        {"WARP_VOTE": 1} if warp_vote else {})
    if threads == 256:
        config = KernelConfig.make(num_warps=8, num_stages=1, THREADS=256, WIDTH=8192, CANDIDATES=512, SWEEP=2048,
                                   **extra)
        cases = _CPU_THREAD_CASES
    else:
        config = KernelConfig.make(num_warps=32, num_stages=1, THREADS=1024, WIDTH=32768, CANDIDATES=4096,
                                   SWEEP=8192, **extra)
        cases = _CPU_THREAD_CASES_1024
    binary = _topk_on_cpu_threads(topk_lowering(config).kernel_source, tmp_path)
    generator = _generator(seed)
    for kind, rows, width, k in cases:
        _run_topk_on_cpu_threads(binary, threads, kind, *_topk_rows(kind, rows, width, k, generator), tmp_path)


def _topk_on_cpu_threads(source: str, tmp_path, edit=lambda kernel: kernel):
    """A config's generated CUDA (`source`, `edit`ed) compiled with g++ over _CUDA_ON_CPU_THREADS: the binary's
    path."""
    shared = "extern __shared__ __align__(1024) uchar buf_dyn_shmem[];"
    assert shared in source
    kernel = "\n".join(line for line in source.splitlines() if not line.startswith("#include <tl_templates"))
    (tmp_path / "kernel.inc").write_text(edit(kernel.replace(shared, "uchar* buf_dyn_shmem = g_shmem;")))
    (tmp_path / "main.cpp").write_text(_CUDA_ON_CPU_THREADS)
    binary = tmp_path / "topk_on_cpu"
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-w",
                            str(tmp_path / "main.cpp"), "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return binary


def _run_topk_on_cpu_threads(binary, threads: int, kind: str, logits, lengths, k: int, tmp_path) -> list[int]:
    """Runs the binary on the rows (outputs poisoned: -7), asserts the reference's positions; the blocks' probes."""
    import numpy as np

    logits, lengths = logits.cpu(), lengths.cpu()
    rows, width = logits.shape
    with open(tmp_path / "in.bin", "wb") as f:
        f.write(np.array([rows, width, k], dtype=np.int32).tobytes())
        f.write(logits.numpy().tobytes())
        f.write(lengths.numpy().tobytes())
    subprocess.run([str(binary), str(threads), str(tmp_path / "in.bin"), str(tmp_path / "out.bin"),
                    str(tmp_path / "probe.bin")], check=True, timeout=300)
    indices = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.int32).reshape(rows, k))
    expected = dsa_topk_reference(logits, lengths, k)
    wrong = (indices != expected).any(dim=-1).nonzero().flatten().tolist()
    assert not wrong, (f"{kind} rows={rows} width={width} k={k}: rows {wrong} (lengths "
                       f"{lengths[wrong].tolist()}) differ, first: {indices[wrong[0]][:16].tolist()} vs "
                       f"{expected[wrong[0]][:16].tolist()}")
    return np.fromfile(tmp_path / "probe.bin", dtype=np.int32).tolist()


# SPECULATE=1 on CPU threads (kind, rows, width, k) at 256 threads, 8K bitmaps, 512 candidates, 2048-position sweep
# steps and a 1024-entry buffer: rows whose buffer holds their keys (normal; ties, whose threshold bin overflows the
# candidates but not the buffer: rounds and marks over the buffer; NaN, -0.0, -inf; past the bitmap span), rows
# that overflow it (ascending: the first step underestimates the bin; one value throughout; k large for the
# buffer), a row whose bin lies below the estimate (descending), rows of at most k positions.
_SPECULATE_CASES = [("normal", 6, 20000, 100), ("normal", 4, 8192, 200), ("ties", 6, 4096, 100),
                    ("special", 6, 6000, 150), ("ascending", 3, 20000, 100), ("descending", 3, 20000, 1000),
                    ("equal", 3, 3000, 100), ("normal", 4, 5000, 2048), ("normal", 3, 700, 32)]
# The 32K span's SPECULATE=1 config on the H200 (1024 threads, the row's first 32K keys cached, 10-bit rounds, 6144
# entries): at k = 2048 the buffer holds a 32K row's keys and a 70000-position one's (past the span and the cache);
# 7 tied levels at 32K: a threshold bin of ~4.7K keys, more than the candidates, in the buffer; descending rows.
_SPECULATE_CASES_1024 = [("normal", 2, 32768, 2048), ("ties", 1, 32768, 2048), ("normal", 1, 70000, 2048),
                         ("descending", 1, 40000, 2048)]


def _speculation_model(logits, lengths, k: int, sweep: int, buffer: int) -> list[int]:
    """The template's speculate decision for each row (-1: at most k positions, never reached): 1 where the keys from
    the estimated bin up fit the buffer and the threshold bin is not below it, else 0 (the second sweep)."""
    import numpy as np

    bits = logits.cpu().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    keys = torch.where(bits > 0x80000000, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    keys = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, keys)
    bins = keys >> 20
    decisions = []
    for row, length in enumerate(lengths.clamp(0, logits.shape[1]).tolist()):
        if length <= k:
            decisions.append(-1)
            continue
        step = min(sweep, length)
        rank = min(step, int(np.float32(k) * np.float32(1.5) * np.float32(step) / np.float32(length)) + 16)

        def bin_at_rank(b, r):  # the highest bin with at least r of b's keys from it up
            from_top = torch.bincount(b, minlength=4096).flip(0).cumsum(0).flip(0)
            return int((from_top >= r).nonzero().max())

        guess = bin_at_rank(bins[row, :step], rank)
        held = int((bins[row, :length] >= guess).sum())
        decisions.append(int(held <= buffer and bin_at_rank(bins[row, :length], k) >= guess))
    return decisions


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.slow
@pytest.mark.parametrize("threads", [256, 1024])
def test_tilelang_topk_speculate_runs_on_cpu_threads(threads, topk_lowering, seed, tmp_path):
    """SPECULATE=1's generated CUDA on CPU threads (as test_tilelang_topk_cuda_runs_on_cpu_threads) gives the
    reference's positions on every _SPECULATE_CASES row, and each row takes the path the template's rule says
    (_speculation_model; the kernel records its decision through an edit of its source): the buffer on normal,
    tied and special rows, the second sweep after an overflow or an estimate above the threshold bin, both seen.
    At 1024 threads the 32K span's tuning candidate, on _SPECULATE_CASES_1024."""
    if threads == 256:
        config = KernelConfig.make(num_warps=8, num_stages=1, THREADS=256, WIDTH=8192, CANDIDATES=512, SWEEP=2048,
                                   SPECULATE=1, SPECULATE_BUFFER=1024)
        cases = _SPECULATE_CASES
    else:
        (config,) = [c for c in dsa_topk.tilelang_configs(TOPK_SPEC, SM_90)
                     if dict(c.params).get("SPECULATE") and c["WIDTH"] == 32768]
        cases = _SPECULATE_CASES_1024
    sweep, buffer = config["SWEEP"], config["SPECULATE_BUFFER"]

    def record(kernel):  # the block's decision, into the harness's probe
        decision = re.compile(r"^(\s*speculated = condval_\d+;)$", re.MULTILINE)
        assert len(decision.findall(kernel)) == 1
        return decision.sub(r"\1 __atomic_store_n(&g_probe[blockIdx.x], speculated, __ATOMIC_RELAXED);", kernel)

    binary = _topk_on_cpu_threads(topk_lowering(config).kernel_source, tmp_path, record)
    generator = _generator(seed)
    taken = {}
    for kind, rows, width, k in cases:
        logits, lengths, k = _topk_rows(kind, rows, width, k, generator)
        probes = _run_topk_on_cpu_threads(binary, threads, kind, logits, lengths, k, tmp_path)
        assert probes == _speculation_model(logits, lengths, k, sweep, buffer), (kind, width, k, lengths.tolist())
        for probe in probes:
            taken.setdefault(kind, set()).add(probe)
    assert 1 in taken["normal"] and 1 in taken["ties"] and 0 in taken["descending"]
    if threads == 256:
        assert 1 in taken["special"] and 0 in taken["ascending"] and 0 in taken["equal"]


# The TileLang top-k on fresh random rows (kind, rows, width, k): normal logits at the DSA shapes (32K and 128K, k =
# 2048 and k = 1), ties (7 levels: at 32K the threshold bin holds more keys than the shared candidates, so the
# rounds read the row), -inf / NaN of both signs / zeros of both signs, one value throughout, and rows past every
# bitmap span (written span by span). The 32K span configs write the 128K rows span by span too.
TILELANG_TOPK_CASES = [("normal", 64, 32768, 2048), ("normal", 64, 32768, 1), ("normal", 2, 131072, 2048),
                       ("ties", 8, 4096, 2048), ("ties", 4, 32768, 2048), ("special", 6, 16384, 2048),
                       ("special", 6, 16384, 1), ("equal", 2, 8192, 2048), ("normal", 2, 200000, 2048)]


def _topk_rows(kind: str, rows: int, width: int, k: int, generator: torch.Generator):
    """dsa_topk's arguments for a TILELANG_TOPK_CASES entry (or a _SPECULATE_CASES one): logits of the kind, lengths
    mostly past k, and rows
    of length 0, k + 1, k, k - 1, width - 1 and past the width (clamped) where there are rows for them; the first
    row (and with "special" the last, whose logits past k / 2 are -inf) spans the width."""
    if kind == "ties":
        logits = torch.randint(-3, 4, (rows, width), generator=generator).float()
    elif kind == "equal":
        logits = torch.full((rows, width), 0.25)
    elif kind in ("ascending", "descending"):  # distinct logits over many first-histogram bins, in order
        logits = torch.linspace(-8, 8, width).expand(rows, width).clone()
        if kind == "descending":
            logits = logits.flip(-1)
    else:
        logits = torch.randn(rows, width, generator=generator)
    if kind == "special":
        draw = torch.rand(rows, width, generator=generator)
        logits[draw < 0.3] = float("-inf")
        logits[(draw >= 0.30) & (draw < 0.31)] = float("nan")
        logits[(draw >= 0.31) & (draw < 0.32)] = -float("nan")  # the sign bit set: still NaN to torch.sort
        logits[(draw >= 0.32) & (draw < 0.37)] = 0.0
        logits[(draw >= 0.37) & (draw < 0.42)] = -0.0
        logits[-1, k // 2:] = float("-inf")  # fewer finite logits than k: the threshold is -inf, its ties cut
    lengths = torch.randint(min(k + 1, width), width + 1, (rows,), generator=generator)
    lengths[0] = width
    special = [0, k + 1, k, k - 1, width - 1, width + 100][:max(rows - 2, 0)]
    lengths[1:1 + len(special)] = torch.tensor(special, dtype=lengths.dtype)
    if kind == "special":
        lengths[-1] = width
    return logits.to(DEVICE), lengths.to(torch.int32).to(DEVICE), k


@pytest.fixture(scope="module")
def tilelang_topk_kernels(tmp_path_factory):
    """tilelang_codegen.load's kernels of the top-k for the GPU's profile (each config compiles on first use)."""
    path = _topk_tilelang_path(tmp_path_factory.mktemp("tilelang_topk_gpu"))
    return tilelang_codegen.load(dsa_topk, path, TOPK_SPEC, SM_90)


@pytest.mark.gpu
@pytest.mark.parametrize("config", dsa_topk.tilelang_configs(TOPK_SPEC, SM_90),
                         ids=lambda c: f"threads{c['THREADS']}-width{c['WIDTH']}-sweep{c['SWEEP']}"
                         f"-radix{dict(c.params).get('RADIX_BITS', 8)}-cache{dict(c.params).get('CACHE', 0)}"
                         f"{'-vote' if dict(c.params).get('WARP_VOTE') else ''}"
                         f"{'-speculate' if dict(c.params).get('SPECULATE') else ''}")
def test_tilelang_topk_matches_reference_on_gpu(config, tilelang_topk_kernels, seed):
    """Every legal config on every TILELANG_TOPK_CASES entry, exactly the reference's positions (order, -1 padding);
    the outputs are poisoned (-7) before each launch."""
    generator = _generator(seed)
    for kind, rows, width, k in TILELANG_TOPK_CASES:
        args = _topk_rows(kind, rows, width, k, generator)
        inputs, outputs, _, indices = dsa_topk.prepare(TOPK_SPEC, *args)
        for out in outputs:
            out.fill_(-7)
        dsa_topk.tilelang_launch(tilelang_topk_kernels, config, *inputs, *outputs)
        expected = dsa_topk_reference(*args)
        wrong = (indices != expected).any(dim=-1).nonzero().flatten().tolist()
        assert not wrong, (f"{kind} rows={rows} width={width} k={k}: rows {wrong} (lengths "
                           f"{args[1][wrong].tolist()}) differ, first: {indices[wrong[0]][:16].tolist()} vs "
                           f"{expected[wrong[0]][:16].tolist()}")


@pytest.mark.gpu
def test_tilelang_topk_through_lowering_on_gpu(seed, tmp_path):
    """The op with the kernel id dzc's lowering binds for codegen "tilelang" (prepare, the bucket's config, the
    launch), at 64 × 2 rows of 32K and 2 of 128K."""
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False, codegen="tilelang")
    generator = _generator(seed)
    for rows, width in ((128, 32768), (2, 131072)):
        args = _topk_rows("normal", rows, width, 2048, generator)
        record, _ = lower_op("dsa_topk", args, target, options, Execution(target.runtime))
        assert record.codegen == "tilelang"
        assert torch.equal(torch.ops.dzc.dsa_topk(*args, kernel_id=record.kernel_id), dsa_topk_reference(*args))
        [(bucket, tuned)] = record.tuned.items()
        assert f"WIDTH={max(32768, bucket)}" in tuned["config"], tuned


def test_auto_codegen_falls_back_to_triton_without_a_legal_tilelang_config():
    """The tiny DSA layer's sparse attention (Dqk 40 = 32 + 8) has no legal TileLang tiling on sm_90: "auto" must
    pick Triton on a GPU (TileLang first otherwise), not fail lowering."""
    from dzc.lowering import Execution, choose_codegen
    from dzc.options import CompileOptions
    from dzc.targets.device_runtime import CudaRuntime

    gpu, auto = Execution(CudaRuntime()), CompileOptions()
    tiny = sparse_attention.SparseAttentionSpec(4, 1, 40, 32, torch.bfloat16, False, topk=32, page_size=64)
    assert not legal_configs(sparse_attention, "tilelang", tiny, SM_90)[0]
    assert choose_codegen("sparse_attention", auto, gpu, tiny, SM_90) == "triton"
    full = ATTENTION_SPECS[0]
    assert legal_configs(sparse_attention, "tilelang", full, SM_90)[0]
    expected = "tilelang" if tilelang_codegen.installed() else "triton"
    assert choose_codegen("sparse_attention", auto, gpu, full, SM_90) == expected


def test_tilelang_small_value_dims_get_configs_that_lower(tmp_path):
    """Dv 16 has two 16×8 output MMA pieces a 16-head block: 4 warps cannot share them, and TileLang's lowering
    fails (the H200 fuzzer, session 11). Every prefill tile the space offers lowers for sm_90a."""
    # The fuzzer's failing case.
    spec = sparse_attention.SparseAttentionSpec(6, 6, 16, 16, torch.bfloat16, True, topk=24, page_size=64)
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(spec, SM_90))
    configs = [c for c in sparse_attention.tilelang_configs(spec, SM_90) if c["SPLITS"] == 0 and c.num_stages == 1]
    assert configs
    for config in configs:
        source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, config, SM_90)
        assert "__global__" in source, config


def test_tilelang_kernels_need_a_static_topk_and_page_size():
    """A cache that grows a row a step (one page per sequence) leaves the page size symbolic in the graph: the spec
    records None, TileLang (specialised on both sizes) offers no kernel and Triton serves it; a spec with a size
    fixed serves only calls of that size."""
    fixed = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)
    for symbolic in (dataclasses.replace(fixed, page_size=None), dataclasses.replace(fixed, topk=None)):
        assert not sparse_attention.tilelang_configs(symbolic, SM_90)
        assert sparse_attention.triton_configs(symbolic, SM_90)
        assert symbolic.serves(fixed) and not fixed.serves(symbolic)
    assert sparse_attention.tilelang_configs(fixed, SM_90)
    assert not fixed.serves(dataclasses.replace(fixed, topk=1024))
    assert not fixed.serves(dataclasses.replace(fixed, page_size=32))


# ---------------------------------------------------------------------------------------------------------
# GPU: the warp-specialized TileLang kernel (producer warpgroup gathering through the block table, two consumer
# warpgroups), at DeepSeek-V3.2's MLA shape


def _warp_specialized_configs(spec, splits, profile=SM_90):
    return [c for c in sparse_attention.tilelang_configs(spec, profile)
            if dict(c.params).get("WARP_SPECIALIZED") and c["SPLITS"] in splits]


def test_warp_specialized_configs_only_where_they_apply():
    """MLA with 16+ heads on sm_90 gets the warp-specialized kernel (16 and 32: one padded head block), as its
    untuned choice at multiples of 64 heads; fewer heads, MHA, and targets without warpgroup MMAs and TMA do not
    get it."""
    for heads in (16, 32, 96, 128):
        spec = dataclasses.replace(MLA, heads=heads)
        default = sparse_attention.tilelang_default_config(spec, SM_90)
        # Until a GPU run of padded head blocks, they are tuning candidates, not the untuned choice.
        assert bool(dict(default.params).get("WARP_SPECIALIZED")) == (heads % 64 == 0), heads
        assert {c["SPLITS"] for c in _warp_specialized_configs(spec, (0, 1, 4, 16))} == {0, 1, 4, 16}, heads
    for spec, profile in ((dataclasses.replace(MLA, heads=8), SM_90), (MLA, TARGETS["musa:mp_31"].profile),
                          (sparse_attention.SparseAttentionSpec(64, 64, 128, 128, torch.bfloat16, True, **DSA_V32),
                           SM_90)):
        assert not _warp_specialized_configs(spec, (0, 1, 4, 16), profile), (spec, profile.name)


@pytest.mark.slow
def test_warp_specialized_partial_head_block_lowers_for_sm90a(tmp_path):
    """16 heads (a tensor-parallel rank of DeepSeek-V3.2's 128 over 8): q is loaded masked by every thread (zero
    rows past the last head) and fenced for the wgmma's async proxy before the barrier; the 64-head block's TMA
    load of q is not used, and the lowered prefill kernel still runs its MMAs as wgmma."""
    spec = dataclasses.replace(MLA, heads=16)
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(spec, SM_90))
    [config] = [c for c in _warp_specialized_configs(spec, (0,))
                if not dict(c.params).get("ROW_ADDRESS") and not dict(c.params).get("BALANCED")]
    source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, config, SM_90)
    assert "tma_load(q_desc" not in source and "wgmma" in source
    load_q = source.index("q_shared")
    assert load_q < source.index("fence_proxy_async") < source.index("bar_q[0].arrive()")


def test_tilelang_kernels_take_fast_math_unless_the_profile_pins_it(tmp_path):
    """The softmax's exp2 as one MUFU.EX2 (nvcc --use_fast_math, as Triton's exp2 and the public TileLang kernels):
    on sm_90, not on MUSA profiles, whose TileLang kernels run without fast math."""
    import tilelang

    for profile, fast in ((SM_90, True), (SM_80, True), (MP_22, None), (MP_31, None)):
        path = tmp_path / f"sparse_attention_{profile.arch}.py"
        path.write_text(sparse_attention.tilelang_source(MLA, profile))
        configs = tilelang_codegen.kernel_pass_configs(path, profile)
        pinned = dict(profile.tilelang_pass_configs).get("TL_ENABLE_FAST_MATH")
        assert configs.get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH) == (fast if fast else pinned), profile.name


def test_warp_specialized_fp8_reader_lowers_and_is_chosen(tmp_path):
    """The FP8 latent cache (656 B/token) gets the warp-specialized kernel only (its producer dequantizes: e4m3
    values as a 16-byte vector, x the group's fp32 scale, rounded to bf16, stored to shared memory; the RoPE bytes
    by cp.async; both arrive on the stage's barrier, 256 arrivals). It passed on the H200, so "auto" picks it
    where it fits; a profile without warpgroup MMAs keeps Triton."""
    from dzc.lowering import Execution, choose_codegen
    from dzc.options import CompileOptions
    from dzc.targets.device_runtime import CudaRuntime

    spec = dataclasses.replace(MLA, fp8_cache=True)
    configs = sparse_attention.tilelang_configs(spec, SM_90)
    assert configs and all(c["WARP_SPECIALIZED"] == 1 for c in configs)
    # The interleaved column order beside each split count, and the untuned choice (measured faster on the H200).
    # The two-CTA crossover (CLUSTER=2, interleaved too) has its own tests (test_sparse_attention_fp8_cluster.py).
    configs = [c for c in configs if "CLUSTER" not in dict(c.params)]
    interleaved = [c for c in configs if dict(c.params).get("FP8_INTERLEAVED")]
    assert {c["SPLITS"] for c in interleaved} == {0, 1, 4, 16} and len(configs) == 2 * len(interleaved)
    assert dict(sparse_attention.tilelang_default_config(spec, SM_90).params).get("FP8_INTERLEAVED") == 1
    assert not any(dict(c.params).get("FP8_INTERLEAVED") for c in sparse_attention.tilelang_configs(MLA, SM_90))
    assert choose_codegen("sparse_attention", CompileOptions(), Execution(CudaRuntime()), spec, SM_90) == "tilelang"
    assert choose_codegen("sparse_attention", CompileOptions(), Execution(CudaRuntime()), spec, SM_80) == "triton"
    # The RoPE bytes are copied as they are: an fp16 model's tile would misread them.
    assert not sparse_attention.tilelang_configs(dataclasses.replace(spec, dtype=torch.float16), SM_90)
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(spec, SM_90))
    plain, interleaved = sorted((c for c in configs if c["SPLITS"] == 0),
                                key=lambda c: dict(c.params).get("FP8_INTERLEAVED", 0))
    source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, plain, SM_90)
    assert "fp8_e4_16_t" in source and "__float22bfloat162_rn" in source and "wgmma" in source
    assert "bar_k_ready[0].init(256)" in source
    # Interleaved: 8 e4m3 values (8 bytes) of each 64-column block a thread, its 16-byte stores a row's 8 threads
    # side by side in one block (not 8 KiB apart, one bank group).
    source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, interleaved,
                                                     SM_90)
    assert "fp8_e4_8_t" in source and "fp8_e4_16_t" not in source and "bar_k_ready[0].init(256)" in source


def test_warp_specialized_prefill_compiles_without_spills(tmp_path):
    """ptxas on the untuned prefill choices of the warp-specialized kernel (bf16 and FP8 caches), with fast math as
    TileLang builds them: no spills. With 240 registers for consumer 0 it spilled 8 bytes (Nsight Compute on the
    H200: 256 local-memory requests a block)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    for spec in (MLA, dataclasses.replace(MLA, fp8_cache=True)):
        path = tmp_path / f"sparse_attention_{int(spec.fp8_cache)}.py"
        path.write_text(sparse_attention.tilelang_source(spec, SM_90))
        source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME,
                                                         sparse_attention.tilelang_default_config(spec, SM_90), SM_90)
        assert "tl::warpgroup_reg_alloc<248>" in source
        report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path / "nvcc", fast_math=True)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(stores == loads == "0" for stores, loads in spills), report


@pytest.mark.gpu
@pytest.mark.parametrize("heads, splits, fp8", [(128, 0, False), (128, 1, False), (128, 16, False), (16, 0, False),
                                                (16, 16, False), (128, 0, "plain"), (128, 16, "plain"),
                                                (128, 0, "interleaved"), (128, 16, "interleaved"),
                                                (128, 0, "row-address"), (128, 16, "row-address"),
                                                (16, 16, "row-address"), (128, 0, "cluster"), (128, 1, "cluster"),
                                                (128, 16, "cluster"), (128, 0, "balanced"), (128, 1, "balanced"),
                                                (128, 16, "balanced"), (16, 16, "balanced")],
                         ids=["128h-prefill", "128h-1-split", "128h-16-splits", "16h-prefill", "16h-16-splits",
                              "fp8-128h-prefill", "fp8-128h-16-splits", "fp8-interleaved-128h-prefill",
                              "fp8-interleaved-128h-16-splits", "row-address-128h-prefill",
                              "row-address-128h-16-splits", "row-address-16h-16-splits", "fp8-cluster-128h-prefill",
                              "fp8-cluster-128h-1-split", "fp8-cluster-128h-16-splits", "balanced-128h-prefill",
                              "balanced-128h-1-split", "balanced-128h-16-splits", "balanced-16h-16-splits"])
def test_warp_specialized_sparse_attention_on_gpu(heads, splits, fp8, seed, tmp_path):
    """Sequences longer and shorter than top-k through a shuffled block table, rows with invalid indices (−1, past
    the sequence) and rows with none valid; unowned cache slots hold NaN (random bytes in the FP8 cache), the
    output is poisoned, and shared memory is left full of NaN before each launch. 16 heads: one padded head
    block; fp8: the FP8 latent cache, dequantized by the producer (each thread's columns in one scale group, or
    interleaved as the bf16 gather's); cluster: the FP8 cache's two-CTA crossover (CLUSTER=2, interleaved, the two
    head blocks of a query row as one cluster: tests/test_sparse_attention_fp8_cluster.py); row-address: the bf16
    cache, the producer's copies addressed from a base a row (ROW_ADDRESS); balanced: the bf16 cache, FlashMLA's
    consumer split (BALANCED=1: tests/test_sparse_attention_balanced.py)."""
    row_address = fp8 == "row-address"
    cluster = fp8 == "cluster"
    balanced = fp8 == "balanced"
    fp8 = "interleaved" if cluster else False if row_address or balanced else fp8
    spec = dataclasses.replace(MLA, heads=heads, fp8_cache=bool(fp8))
    [config] = [c for c in _warp_specialized_configs(spec, (splits,))
                if bool(dict(c.params).get("FP8_INTERLEAVED")) == (fp8 == "interleaved")
                and bool(dict(c.params).get("ROW_ADDRESS")) == row_address
                and bool(dict(c.params).get("CLUSTER")) == cluster
                and bool(dict(c.params).get("BALANCED")) == balanced]
    args = dsa_cases.sparse_attention_args([3000, 700, 2500, 40], [3, 2, 3, 1], heads, 1, 576, 512, False,
                                           device=DEVICE, generator=_generator(seed), fp8_cache=bool(fp8), **DSA_V32)
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(spec, SM_90))
    # One config is launched: no children building the spec's other untuned choices (up to 9 a case).
    with dzc_config.scope(DZC_TILELANG_PREBUILD="0"):
        compiled = tilelang_codegen.load(sparse_attention, path, spec, SM_90)
    inputs, (out,), _, result = sparse_attention.prepare(spec, *args)
    out.fill_(float("nan"))
    poison_shared_memory(DEVICE)
    sparse_attention.tilelang_launch(compiled, config, *inputs, out)
    torch.cuda.synchronize()
    assert not result.isnan().any(), f"{config}: NaN (an unwritten output, or a read of an unowned slot)"
    expected = sparse_attention_reference(*args)
    torch.testing.assert_close(result.float(), expected.float(), atol=2**-6, rtol=2**-6,
                               msg=lambda m: f"{config}: {m}")


def test_tuning_skips_a_top_k_config_that_selects_other_positions(seed, tmp_path, monkeypatch):
    """The tuner compares top-k candidates by their selected logits (dsa_topk.agreement_values), not skipping them
    as integer outputs: a config that swaps one selected position for an unselected one is a failure with its
    reason, and the tuned op still returns the reference's positions."""
    launch = dsa_topk.triton_launch
    legal, _ = legal_configs(dsa_topk, "triton", TOPK_SPEC, SM_90)
    _, default = dsa_topk.configs_for_bucket(TOPK_SPEC, SM_90, dsa_topk.token_bucket(128), legal,
                                             dsa_topk.triton_default_config(TOPK_SPEC, SM_90))  # timed first

    def sabotaged(kernel, config, logits, lengths, k, indices, scratch):
        launch(kernel, config, logits, lengths, k, indices, scratch)
        if config != default:  # the first row's first position becomes one no right answer selects
            unselected = [p for p in range(logits.shape[1]) if p not in indices[0].tolist()
                          and logits[0, p] < logits[0, indices[0].long()].min()]
            indices[0, 0] = unselected[0]

    monkeypatch.setattr(dsa_topk, "triton_launch", sabotaged)
    # Through the interpreter, one run a candidate (its bench's four cost minutes): what is checked is its result.
    monkeypatch.setattr(INTERPRETER, "bench", lambda fn, device: (fn(), 1e-3)[1])
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=True, codegen="triton")
    args = dsa_cases.topk_args(2, 128, [128, 10], 8, DEVICE, _generator(seed))
    record, _ = lower_op("dsa_topk", args, target, options, Execution(INTERPRETER if DEVICE.type == "cpu" else
                                                                       target.runtime))
    assert torch.equal(OPS["dsa_topk"][0](*args, kernel_id=record.kernel_id), dsa_topk_reference(*args))
    [(_, entry)] = record.tuned.items()
    assert entry["config"] == str(default), entry
    assert entry["failures"] and all("values in 1 rows differ" in why for why in entry["failures"].values()), entry


@pytest.mark.parametrize("spec", [MLA, dataclasses.replace(MLA, fp8_cache=True)], ids=["bf16", "fp8"])
def test_loading_builds_every_buckets_untuned_sparse_attention_kernels_ahead(spec):
    """tilelang_codegen.load starts building the untuned choice of every token bucket as the launch compiles it (the
    prefill kernel first; each decode bucket's split kernel and its combine): a model's first decode step no longer
    builds them in-process."""
    legal, _ = legal_configs(sparse_attention, "tilelang", spec, SM_90)
    default = sparse_attention.tilelang_default_config(spec, SM_90)
    launched = {config for rows in range(1, 4 * sparse_attention.DECODE_MAX_ROWS, 7)
                for config in sparse_attention.tilelang_launched_configs(sparse_attention.configs_for_bucket(
                    spec, SM_90, sparse_attention.token_bucket(rows), legal, default)[1])}
    prebuilt = sparse_attention.tilelang_prebuilt_configs(spec, SM_90)
    assert prebuilt[0] == default and len(prebuilt) == len(set(prebuilt))
    assert set(prebuilt) == launched and any(c["SPLITS"] for c in launched)
    # Every split kernel with its combine, none without
    assert {c for c in prebuilt if dict(c.params).get("PART")} == {
        KernelConfig.make(c.num_warps, c.num_stages, **dict(c.params), PART=1) for c in prebuilt
        if c["SPLITS"] and not dict(c.params).get("PART")}


def test_loading_builds_every_spans_untuned_top_k_kernel_ahead():
    spec = dsa_topk.DsaTopkSpec()
    legal, _ = legal_configs(dsa_topk, "tilelang", spec, SM_90)
    default = dsa_topk.tilelang_default_config(spec, SM_90)
    chosen = {dsa_topk.configs_for_bucket(spec, SM_90, dsa_topk.token_bucket(width), legal, default)[1]
              for width in (1, 2048, 40000, 1 << 20)}
    prebuilt = dsa_topk.tilelang_prebuilt_configs(spec, SM_90)
    assert prebuilt[0] == default and set(prebuilt) == chosen and len(prebuilt) == len(chosen) > 1
