"""dzc.mxfp4_moe kernels: routing, both GEMM paths (online dequant, workspace), configs on every profile, Triton
compiled ahead of time for sm_90, TileLang lowered and nvcc-compiled for sm_90a, and GPU numerics.

On CPU the Triton kernels run through the interpreter (dots upcast to exact fp32; its fp32 -> bf16 casts truncate,
so bf16 results may differ from the reference by a unit in the last place per rounding). Inputs are fresh seeded
random MoE layers (weights quantized from random floats by dzc.mxfp4), outputs NaN-poisoned before every launch.
"""

import gc
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
import triton
from conftest import SASS_TABLES_TRITON, gpt_oss_gemm_sass, run_ahead_of_time_script

from dzc import mxfp4
from dzc.ops import mxfp4_moe_reference
from dzc.targets import TARGETS, mxfp4_moe, mxfp4_moe_routing, tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.legality import config_problems
from dzc.targets.profiles import MP_22, MP_31, SM_90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE
PROFILES = {name: target.profile for name, target in TARGETS.items()}

ONLINE_DECODE = KernelConfig.make(num_warps=4, num_stages=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, WORKSPACE=0)
ONLINE_WIDE = KernelConfig.make(num_warps=4, num_stages=2, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0)
WORKSPACE = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, WORKSPACE=1)
# Split-K decode: 3 splits of a 96-wide reduction in 64-wide steps leave the last split empty (H = 96) or short.
ONLINE_SPLIT = KernelConfig.make(num_warps=2, num_stages=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, WORKSPACE=0,
                                 SPLIT_K=3)
# The packed weights by TMA: 64-row boxes past I = 96 (zeros there), K tails; with splits too.
ONLINE_TMA = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, WORKSPACE=0, TMA=1)
ONLINE_TMA_SPLIT = KernelConfig.make(num_warps=4, num_stages=4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, WORKSPACE=0,
                                     SPLIT_K=3, TMA=1)
# tl.dot_scaled on the packed weights (bf16 activations): by plain loads, by TMA, and split (natural-order act
# through the split activation kernel).
DOT_SCALED = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, WORKSPACE=0,
                               DOT_SCALED=1)
DOT_SCALED_TMA_SPLIT = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=32, BLOCK_N=32, BLOCK_K=64,
                                         WORKSPACE=0, SPLIT_K=2, DOT_SCALED=1, TMA=1)
# The weights as the MMA's A operand (reduction in swap order): by plain loads, and by TMA with splits.
SWAP_AB = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SWAP_AB=1)
SWAP_AB_TMA_SPLIT = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0,
                                      SPLIT_K=2, SWAP_AB=1, TMA=1)
SWAP_AB_SPLIT = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0,
                                  SPLIT_K=2, SWAP_AB=1)
# The prefill SWAP_AB tile: 128 token rows, a 128-row weight tile over two warp groups.
SWAP_AB_PREFILL = KernelConfig.make(num_warps=8, num_stages=3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, WORKSPACE=0,
                                    SWAP_AB=1)
# 256 token rows a tile (wgmma's largest N; a tuning candidate on sm_90), 64 weight rows on two warp groups.
SWAP_AB_WIDE = KernelConfig.make(num_warps=8, num_stages=3, BLOCK_M=256, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0,
                                 SWAP_AB=1)
# Its word decoder that merges the signs four values at a time (DECODE=2; the interpreter runs the arithmetic path).
SWAP_AB_DECODE_2 = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0,
                                     SWAP_AB=1, DECODE=2)
# The W4A16 prefill pick's tile with DECODE=2 (3.4% faster at gpt-oss T=8192 on the H200, session 34).
SWAP_AB_PREFILL_DECODE_2 = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128,
                                             WORKSPACE=0, SPLIT_K=1, SWAP_AB=1, DECODE=2)


def tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """bf16: one rounding of the activation and one of the output, each a bf16 ulp (2^-8 relative), carried
    through the down GEMM; fp16 likewise at 2^-11; fp32: accumulation order only."""
    scale = expected.float().abs().max().item()
    relative = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    return dict(atol=relative * scale, rtol=relative)


def check_against_reference(args, out):
    expected = mxfp4_moe_reference(*args)
    assert out.dtype == expected.dtype
    assert not out.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    torch.testing.assert_close(out, expected, **tolerance(out.dtype, expected))


def load_triton(spec, tmp_path, profile=SM_90):
    path = tmp_path / f"mxfp4_moe_{abs(hash(spec))}.py"
    path.write_text(mxfp4_moe.triton_source(spec, profile))
    return triton_codegen.load(mxfp4_moe, path, spec, profile)


def run_triton(args, config, tmp_path):
    spec = mxfp4_moe.spec_from_args(*args[:11])
    kernels = load_triton(spec, tmp_path)
    inputs, (out,), tokens, result = mxfp4_moe.prepare(spec, *args)
    assert tokens == args[0].shape[0] and result is out
    out.fill_(float("nan"))
    mxfp4_moe.triton_launch(kernels, config, *inputs, out)
    return out


def case_args(name: str, seed: int, device=DEVICE):
    cases = dict(mxfp4_moe.selftest_cases(SM_90))
    return cases[name](torch.device(device), torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# Routing


@pytest.mark.parametrize("pairs", [100, 300], ids=["one-chunk", "three-chunks"])
def test_routing_groups_pairs_by_expert_deterministically(pairs, seed):
    """Decode-sized calls route in one launch, larger ones in count / schedule / scatter: same result."""
    experts, block_m = 5, 4
    ids = torch.randint(0, experts, (pairs,), dtype=torch.int64, device=DEVICE)
    ids[::7] = 0  # one dominant expert
    ids[3], ids[pairs // 2] = experts, -1  # outside [0, E): left out
    assert (pairs <= mxfp4_moe_routing.ROUTING_CHUNK) == (pairs == 100)
    plan = mxfp4_moe.route(ids, experts, block_m)
    valid = (ids >= 0) & (ids < experts)
    counts = torch.bincount(ids[valid], minlength=experts)
    assert plan.expert_counts[:experts].tolist() == counts.tolist()
    # Sorted rows: by expert, then by pair index (stable), exactly what a stable sort gives.
    expected_order = torch.argsort(torch.where(valid, ids, experts), stable=True)[: int(valid.sum())]
    assert plan.sorted_pairs[: int(valid.sum())].long().tolist() == expected_order.tolist()
    # Row blocks: every valid row in exactly one block of its expert, at most block_m rows each, then -1.
    used = plan.block_expert >= 0
    n_used = int(used.sum())
    assert used[:n_used].all() and not used[n_used:].any()
    assert plan.block_expert.numel() == mxfp4_moe_routing.max_row_blocks(pairs, experts, block_m)
    covered = []
    for b in range(n_used):
        start, end = int(plan.block_row_start[b]), int(plan.block_row_end[b])
        assert 0 < end - start <= block_m
        rows = plan.sorted_pairs[start:end].long()
        assert (ids[rows] == plan.block_expert[b]).all()
        covered.extend(range(start, end))
    assert covered == list(range(int(valid.sum())))
    # Workspace slots: activated experts numbered 0.. in expert order.
    active = (counts > 0).nonzero().flatten().tolist()
    assert [int(plan.expert_slots[e]) for e in active] == list(range(len(active)))


# ---------------------------------------------------------------------------------------------------------
# Numerics of both paths (interpreter on CPU, compiled on a GPU)

NUMERIC_CASES = [
    ("gptoss-bfloat16-T1", ONLINE_DECODE),
    ("gptoss-bfloat16-T5", WORKSPACE),
    ("gptoss-float32-T5", ONLINE_WIDE),
    ("gptoss-float16-T1", WORKSPACE),
    ("silu-concat-nobias-T37-skewed", ONLINE_DECODE),
    ("silu-concat-nobias-T37-skewed", WORKSPACE),
    ("gptoss-T37-skewed-bf16-weights", ONLINE_WIDE),
    ("gptoss-bfloat16-T5", ONLINE_SPLIT),
    ("silu-concat-nobias-T37-skewed", ONLINE_SPLIT),
    ("gptoss-bfloat16-T5", ONLINE_TMA),  # gate and up rows interleaved
    ("silu-concat-nobias-T37-skewed", ONLINE_TMA),  # gate and up halves
    ("gptoss-float32-T5", ONLINE_TMA_SPLIT),
    ("gptoss-bfloat16-T5", DOT_SCALED),
    ("silu-concat-nobias-T37-skewed", DOT_SCALED),
    ("gptoss-T37-skewed-bf16-weights", DOT_SCALED_TMA_SPLIT),
    ("silu-concat-nobias-T37-skewed", DOT_SCALED_TMA_SPLIT),
    ("gptoss-bfloat16-T5", SWAP_AB),
    ("silu-concat-nobias-T37-skewed", SWAP_AB),
    ("gptoss-T37-skewed-bf16-weights", SWAP_AB_TMA_SPLIT),
    ("silu-concat-nobias-T37-skewed", SWAP_AB_TMA_SPLIT),
    ("gptoss-T37-skewed-bf16-weights", SWAP_AB_PREFILL),
    ("silu-concat-nobias-T37-skewed", SWAP_AB_DECODE_2),
    ("gptoss-T37-skewed-bf16-weights", SWAP_AB_PREFILL_DECODE_2),
]


def _case_id(case: str, config: KernelConfig) -> str:
    path = "workspace" if config["WORKSPACE"] else "online"
    split = dict(config.params).get("SPLIT_K", 1)
    options = dict(config.params)
    return (f"{case}-{path}" + (f"-split{split}" if split > 1 else "") + ("-tma" if options.get("TMA") else "")
            + ("-dot_scaled" if options.get("DOT_SCALED") else "") + ("-swap_ab" if options.get("SWAP_AB") else "")
            + (f"-decode{options['DECODE']}" if "DECODE" in options else ""))


@pytest.mark.parametrize("case, config", NUMERIC_CASES, ids=[_case_id(c, cfg) for c, cfg in NUMERIC_CASES])
def test_triton_path_matches_reference(case, config, seed, tmp_path):
    args = case_args(case, seed)
    if case.endswith("skewed"):
        counts = torch.bincount(args[1].flatten().long())
        assert counts[0] >= 0.8 * args[0].shape[0], "routing should send nearly every token to expert 0"
    if config["WORKSPACE"]:
        mxfp4_moe.release_workspaces()
    out = run_triton(args, config, tmp_path)
    check_against_reference(args, out)
    if config["WORKSPACE"]:
        spec = mxfp4_moe.spec_from_args(*args[:11])
        assert mxfp4_moe.workspace_bytes(args[0].device) == (
            mxfp4_moe.workspace_elements(spec, args[0].shape[0]) * (4 if spec.dot_fp32 else 2))


@pytest.mark.parametrize("config", [SWAP_AB, SWAP_AB_SPLIT, SWAP_AB_TMA_SPLIT], ids=["plain", "split", "tma-split"])
def test_swap_ab_over_several_k_tiles_with_tails(config, seed, tmp_path):
    """SWAP_AB reorders each 128-column K tile: H = 288 and I = 160 give whole tiles, a partial last tile (one
    and a quarter MX groups) and partial row blocks in both GEMMs, with a NaN scale in one down-weight group."""
    args = list(mxfp4_moe.random_moe_args(torch.device(DEVICE), torch.Generator().manual_seed(seed), tokens=9,
                                          hidden=288, inter=160, experts=3, top_k=2))
    scales = args[7].clone()
    scales[1, 5, 4] = 255  # expert 1, output column 5, columns 128..159 of the down GEMM's reduction
    args[7] = scales
    check_against_reference_with_nan_column(args, run_triton(args, config, tmp_path), column=5,
                                            expert=1, topk_ids=args[1])


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("config", [SWAP_AB, SWAP_AB_SPLIT, SWAP_AB_TMA_SPLIT, SWAP_AB_PREFILL],
                         ids=["plain", "split", "tma-split", "prefill"])
def test_swap_ab_gate_up_nan_scale_reaches_its_tokens_only(config, interleaved, seed, tmp_path):
    """A NaN scale in one gate/up weight row of one expert: the stacked (non-TMA) and two-accumulator (TMA) gate/up
    GEMMs put NaN in that activation column, so every output column of the tokens routed to that expert is NaN
    (the reference's NaN weight does the same); the other tokens match the reference, over several K tiles."""
    check_gate_up_nan_scale_reaches_its_tokens_only(config, seed, tmp_path, interleaved=interleaved)


def check_gate_up_nan_scale_reaches_its_tokens_only(config, seed, tmp_path, interleaved=True):
    """A NaN scale in gate/up weight row 161 of expert 2 (interleaved: column 80's up row; halves: column 1's),
    columns 160..191: the tokens routed to expert 2 are NaN throughout, the others match the reference."""
    # 24 tokens over 4 experts, top-2: each token misses expert 2 with probability 1/2, so both kinds of token occur
    args = list(mxfp4_moe.random_moe_args(torch.device(DEVICE), torch.Generator().manual_seed(seed), tokens=24,
                                          hidden=288, inter=160, experts=4, top_k=2, interleaved=interleaved))
    scales = args[4].clone()
    scales[2, 161, 5] = 255  # expert 2: an up row (interleaved: of column 80; halves: of column 1), columns 160..191
    args[4] = scales
    out = run_triton(args, config, tmp_path)
    expected = mxfp4_moe_reference(*args)
    routed = (args[1] == 2).any(dim=1)
    assert routed.any() and (~routed).any() and expected[routed].isnan().all()
    assert out[routed].isnan().all()
    assert not out[~routed].isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    torch.testing.assert_close(out[~routed], expected[~routed], **tolerance(out.dtype, expected[~routed]))


def test_swap_ab_256_row_tiles_with_full_partial_and_empty_row_blocks(seed, tmp_path):
    """SWAP_AB with 256 token rows a tile: experts with 300 rows (a full block and a partial one), 260 (a full
    block and 4 rows), 40 (one partial block) and none, over H = 288 and I = 160 (whole and partial K tiles)."""
    generator = torch.Generator().manual_seed(seed)
    args = list(mxfp4_moe.random_moe_args(torch.device(DEVICE), generator, tokens=300, hidden=288, inter=160,
                                          experts=4, top_k=2))
    ids = torch.tensor([0, 3], dtype=torch.int32).repeat(300, 1)
    ids[:40, 1] = 1
    args[1] = ids[torch.randperm(300, generator=generator)].to(DEVICE)
    assert torch.bincount(args[1].flatten().long(), minlength=4).tolist() == [300, 40, 0, 260]
    check_against_reference(args, run_triton(args, SWAP_AB_WIDE, tmp_path))


def check_against_reference_with_nan_column(args, out, column, expert, topk_ids):
    """The tokens routed to `expert` get NaN in `column`; everything else matches the reference."""
    expected = mxfp4_moe_reference(*args)
    routed = (topk_ids == expert).any(dim=1)
    assert routed.any() and expected[routed, column].isnan().all()
    assert out[routed, column].isnan().all()
    out, expected = out.clone(), expected.clone()
    out[routed, column] = 0
    expected[routed, column] = 0
    assert not out.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    torch.testing.assert_close(out, expected, **tolerance(out.dtype, expected))


@pytest.mark.parametrize("config", [ONLINE_TMA, SWAP_AB], ids=["tma", "swap_ab"])
def test_config_on_weights_off_16_byte_alignment_runs_by_plain_loads(config, seed, tmp_path):
    """TMA reads from 16-byte aligned addresses only, SWAP_AB reads 4-byte words: weights 8 bytes off one run the
    same tile by plain byte loads."""
    args = list(case_args("gptoss-bfloat16-T5", seed))
    for index in (3, 6):  # w13_blocks, w2_blocks
        blocks = args[index]
        shifted = torch.empty(blocks.numel() + 8, dtype=blocks.dtype, device=blocks.device)[8:].view(blocks.shape)
        shifted.copy_(blocks)
        assert shifted.data_ptr() % mxfp4_moe.TMA_ALIGNMENT != 0
        args[index] = shifted
    check_against_reference(args, run_triton(args, config, tmp_path))


def test_tma_descriptors_are_cached_by_the_facts_they_are_made_of(seed):
    """A weight's TMA descriptors are built once per (address, dtype, device, shape, strides, row order, box): the
    same memory through another tensor object gets the same descriptors, other memory or another box new ones, and
    an entry goes when its weights are freed."""
    args = case_args("gptoss-bfloat16-T5", seed)
    w13, w2 = args[3], args[6]
    sources = mxfp4_moe._tma_sources(w13, w2, True, 64, 64, False)
    assert mxfp4_moe._tma_sources(w13.view(w13.shape), w2.view(w2.shape), True, 64, 64, False) is sources
    fresh = mxfp4_moe._make_tma_sources(w13, w2, True, 64, 64, False)
    for cached, built in zip(sources, fresh):
        assert (cached.base.data_ptr(), cached.base.dtype, list(cached.shape), list(cached.strides),
                cached.block_shape) == (built.base.data_ptr(), built.base.dtype, list(built.shape),
                                        list(built.strides), built.block_shape)
    for other in [(False, 64, 64, False), (True, 32, 64, False), (True, 64, 128, False), (True, 64, 64, True)]:
        assert mxfp4_moe._tma_sources(w13, w2, *other) is not sources
    copy = w13.clone()
    moved = mxfp4_moe._tma_sources(copy, w2, True, 64, 64, False)
    assert moved is not sources and moved[0].base.data_ptr() == copy.data_ptr()
    held = [key for key in mxfp4_moe._TMA_SOURCES if key[0][0] == copy.data_ptr()]
    assert held
    del copy, moved
    gc.collect()
    assert not any(key in mxfp4_moe._TMA_SOURCES for key in held)


def test_tma_launch_on_other_weights_uses_their_own_descriptors(seed, tmp_path):
    """Two layers' weights, one TMA config, alternately: each call matches its own layer's reference (a cached
    descriptor never serves other weights), and a repeated call is bit-identical."""
    first = case_args("gptoss-bfloat16-T5", seed)
    second = case_args("gptoss-bfloat16-T5", seed + 1)
    outputs = [run_triton(args, ONLINE_TMA, tmp_path) for args in (first, second, first)]
    check_against_reference(first, outputs[0])
    check_against_reference(second, outputs[1])
    assert torch.equal(outputs[0], outputs[2])


def test_routing_kernels_launch_through_the_cached_launcher_unless_interpreting():
    kernel = mxfp4_moe_routing.moe_combine_kernel
    assert triton_codegen.launchable(kernel, interpret=True) is kernel
    compiled = triton.runtime.jit.JITFunction(getattr(kernel, "fn", kernel))  # (this process may interpret)
    wrapped = triton_codegen.launchable(compiled, interpret=False)
    assert isinstance(wrapped, triton_codegen.CachedLaunchKernel) and wrapped.fn is compiled
    for name, fn in mxfp4_moe_routing.ROUTING_KERNELS.items():
        launched = mxfp4_moe_routing.launchable(name)
        assert launched is mxfp4_moe_routing.launchable(name)  # wrapped once
        if triton_codegen.interpreting():
            assert launched is fn
        else:
            assert isinstance(launched, triton_codegen.CachedLaunchKernel) and launched.fn is fn


def _ptx_word_decoder(asm: str):
    """A word decoder's inline PTX ($0..$7: bf16 outputs, $8: packed word, $9: scale pair), run on the CPU: the
    instructions the decoders use, on torch int64 lanes (every register value kept in [0, 2^32))."""
    body = [line.strip().rstrip(";") for line in asm.splitlines()]
    mask = 0xFFFFFFFF

    def run(words: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
        regs = {"$8": words.long() & mask, "$9": scales.long() & mask}
        outputs = {}

        def value(token):
            return regs[token] if token in regs else torch.full_like(words.long(), int(token, 0))

        for line in body:
            if not line or line.startswith((".reg", "{", "}")):
                continue
            for statement in filter(None, (part.strip() for part in line.split(";"))):
                op, rest = statement.split(None, 1)
                halves = re.match(r"\{(\$\d), (\$\d)\}, (\w+)", rest)
                if halves:  # mov.b32 {lo, hi}, r
                    outputs[halves.group(1)] = regs[halves.group(3)] & 0xFFFF
                    outputs[halves.group(2)] = regs[halves.group(3)] >> 16
                    continue
                dst, *src = [t.strip() for t in rest.split(",")]
                a = [value(t) for t in src]
                if op == "mov.b32":
                    result = a[0]
                elif op == "and.b32":
                    result = a[0] & a[1]
                elif op == "shr.u32":
                    result = a[0] >> a[1]
                elif op == "shl.b32":
                    result = (a[0] << a[1]) & mask
                elif op == "prmt.b32":
                    pool = a[0] | (a[1] << 32)
                    result = torch.zeros_like(pool)
                    for k in range(4):
                        selector = (a[2] >> (4 * k)) & 15
                        byte = (pool >> (8 * (selector & 7))) & 255
                        byte = torch.where(selector >= 8, torch.where(byte >= 128, 255, 0), byte)
                        result |= byte << (8 * k)
                elif op == "lop3.b32":
                    lut, result = int(src[3], 0), torch.zeros_like(a[0])
                    for index in range(8):
                        if lut >> index & 1:
                            terms = [x if index >> shift & 1 else ~x & mask for x, shift in zip(a[:3], (2, 1, 0))]
                            result |= terms[0] & terms[1] & terms[2]
                elif op == "fma.rn.bf16x2":
                    result = torch.zeros_like(a[0])
                    for shift in (0, 16):
                        x, y, z = (((t >> shift) & 0xFFFF).to(torch.int32) << 16 for t in a)
                        x, y, z = (t.view(torch.float32) for t in (x, y, z))
                        bits = (x * y + z).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
                        result |= bits << shift
                else:
                    raise AssertionError(f"no emulation of {op}")
                regs[dst] = result
        return [outputs[f"${i}"] for i in range(8)]

    return run


def test_swap_ab_decode_2_word_decoder_gives_decode_1_bits():
    """DECODE=2's inline PTX (signs merged into the looked-up high bytes, 19 instructions a word) and DECODE=1's
    (23), both emulated instruction by instruction on the CPU (Triton's interpreter runs the arithmetic decoder
    instead, so the layer tests do not reach them): every E2M1 code in every nibble of a word, random words, at
    scale bytes from 0 (read as 2^-126) to 254 (products past bf16's range: inf), give each value of the word,
    natural order, times its scale, as bf16, the same bits from both."""
    decode_2 = re.search(r'"""\{(.*?)\}"""', mxfp4_moe._WORD_DECODER_2, re.S).group(1)
    lut = (Path(mxfp4_moe.TEMPLATES) / "mxfp4_decode_lut.triton.py.tmpl").read_text().replace("$$", "$")
    decode_1 = re.search(r'def _e2m1_word_lut\(.*?"""\{(.*?)\}"""', lut, re.S).group(1)
    generator = torch.Generator().manual_seed(0)
    codes = torch.arange(16)
    words = torch.cat([(codes[:, None] << (4 * torch.arange(8))).flatten(),  # one code in one nibble, zeros around
                       (codes[:, None] * 0x11111111).flatten(),  # the same code in every nibble
                       torch.randint(0, 2**32, (4096,), generator=generator)])
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    for scale in (0, 1, 2, 100, 127, 128, 140, 200, 253, 254):
        bits = max(scale, 1) << 7
        pairs = torch.full_like(words, bits | bits << 16)
        nibbles = (words[:, None] >> (4 * torch.arange(8))) & 15
        expected = (torch.where(nibbles >= 8, -1.0, 1.0).double() * magnitudes[nibbles & 7]
                    * 2.0 ** (max(scale, 1) - 127)).float().to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
        got_1 = torch.stack(_ptx_word_decoder(decode_1)(words, pairs), dim=1)
        got_2 = torch.stack(_ptx_word_decoder(decode_2)(words, pairs), dim=1)
        assert torch.equal(got_1, expected), scale
        assert torch.equal(got_2, expected), scale


@pytest.mark.parametrize("case", ["gptoss-bfloat16-T5", "gptoss-float32-T5"])
def test_tma_dot_scaled_and_swap_ab_configs_only_where_they_apply(case):
    """TMA tiles where the profile's Triton has tensor descriptors, DOT_SCALED ones where it compiles dot_scaled
    and the activations are bf16, SWAP_AB ones for bf16 activations. The untuned choice of a decode bucket is a
    TMA tile exactly where descriptor loads are bulk copies (measured faster there, slower at prefill size), and
    that of every bucket a SWAP_AB one exactly where the MMA is wgmma and the activations are bf16 (measured
    faster at every size); DOT_SCALED tiles (measured slower) never are, nor SWAP_AB tiles of 256 token rows (where
    the MMA is wgmma; measured slower than 128). A decode bucket's TMA choice is a TMA_STACKED tile (interleaved
    gate/up rows; measured 1.18-1.20x faster at 8 and 64 tokens) exactly where one has the bucket's split. DECODE=2
    (SWAP_AB tiles where Triton has inline assembly; measured faster) is the untuned choice's decoder exactly where
    such a tile of its BLOCK_M and stacking is."""
    spec = mxfp4_moe.spec_from_args(*case_args(case, 0)[:11])
    bf16 = spec.hidden_dtype == torch.bfloat16
    for profile in PROFILES.values():
        configs = mxfp4_moe.triton_configs(spec, profile)
        tma = [c for c in configs if dict(c.params).get("TMA")]
        scaled = [c for c in configs if dict(c.params).get("DOT_SCALED")]
        swapped = [c for c in configs if dict(c.params).get("SWAP_AB")]
        assert bool(tma) == profile.triton_tensor_descriptors, profile.name
        assert bool(scaled) == (profile.triton_dot_scaled and bf16), profile.name
        assert bool(swapped) == bf16 and all(c["BLOCK_K"] == 128 for c in swapped), profile.name
        assert all(c["WORKSPACE"] == 0 and c.num_stages >= 3 for c in tma + scaled + swapped)
        decode_2 = [c for c in configs if dict(c.params).get("DECODE", 1) != 1]
        assert bool(decode_2) == (profile.triton_inline_asm and bf16), profile.name
        assert all(dict(c.params)["DECODE"] == 2 and c in swapped for c in decode_2), profile.name
        wide = [c for c in configs if c["BLOCK_M"] > 128]  # 256 token rows: wgmma's N, SWAP_AB only
        assert bool(wide) == (profile.matrix_instruction == "wgmma" and bf16), profile.name
        assert all(c in swapped and c.num_warps == 8 for c in wide), profile.name
        for bucket in (1, 8, 64, 4096):
            _, default = mxfp4_moe.configs_for_bucket(spec, profile, bucket, configs, configs[0])
            options = dict(default.params)
            decode = mxfp4_moe.rows_per_expert(spec, bucket) <= mxfp4_moe.DECODE_MAX_ROWS_PER_EXPERT
            assert bool(options.get("TMA")) == (profile.bulk_tensor_copies and decode), (profile.name, bucket)
            assert bool(options.get("SWAP_AB")) == (profile.matrix_instruction == "wgmma" and bf16), \
                (profile.name, bucket)
            assert "DOT_SCALED" not in options, (profile.name, bucket)
            stacked = options.get("TMA_STACKED", 0)
            assert bool(stacked) == any(dict(c.params).get("TMA_STACKED") and c["SPLIT_K"] == default["SPLIT_K"]
                                        for c in configs if options.get("TMA")), (profile.name, bucket)
            has_decode_2 = any(dict(c.params).get("DECODE") == 2 and c["BLOCK_M"] == default["BLOCK_M"]
                               and dict(c.params).get("TMA_STACKED", 0) == stacked for c in decode_2)
            assert options.get("DECODE", 1) == (2 if options.get("SWAP_AB") and has_decode_2 else 1), \
                (profile.name, bucket)
            assert default["BLOCK_M"] <= 128, (profile.name, bucket)


def test_int64_ids_and_strided_hidden(seed, tmp_path):
    args = list(case_args("gptoss-bfloat16-T5", seed))
    wide = torch.randn(5, 2 * args[0].shape[1], device=DEVICE).to(args[0].dtype)
    wide[:, : args[0].shape[1]] = args[0]
    args[0] = wide[:, : args[0].shape[1]]
    args[1] = args[1].long()
    out = run_triton(tuple(args), ONLINE_DECODE, tmp_path)
    check_against_reference(tuple(args), out)


def test_bad_routing_and_nan_scales_show_as_nan(seed, tmp_path):
    """An expert id outside [0, E) cannot raise without a host sync: its token's row becomes NaN. A NaN scale
    (0xFF) makes the output columns it feeds NaN, as the reference's NaN weight does."""
    args = list(case_args("gptoss-bfloat16-T5", seed))
    args[1] = args[1].clone()
    args[1][2, 1] = 99
    out = run_triton(tuple(args), ONLINE_DECODE, tmp_path)
    assert out[2].isnan().all()
    good = [0, 1, 3, 4]
    args[1][2, 1] = args[1][2, 0]  # what the reference can evaluate
    expected = mxfp4_moe_reference(*args)
    torch.testing.assert_close(out[good], expected[good], **tolerance(out.dtype, expected))

    args = list(case_args("gptoss-bfloat16-T1", seed))
    w2_scales = args[7].clone()
    expert = int(args[1][0, 0])
    w2_scales[expert, 3, 0] = 255  # output column 3 of the down GEMM
    args[7] = w2_scales
    for config in (ONLINE_DECODE, WORKSPACE):  # the GEMM's per-column flag; the dequantization's per element
        out = run_triton(tuple(args), config, tmp_path)
        assert out[0, 3].isnan(), config
        assert not out[0, torch.arange(out.shape[1]) != 3].isnan().any(), config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoding_saturates_to_inf_at_the_largest_scales(dtype, seed, tmp_path):
    """The top of E8M0's range through the workspace decode, against dzc.mxfp4.dequantize: bytes 0xFC-0xFE
    (4 * 2^126 and up are past fp32's and bf16's largest finite number: inf, not an exponent wrapped into the
    sign bit) and 0xFF (NaN). bf16 takes the byte-permute decoder on a GPU, the arithmetic one elsewhere."""
    experts, n, k = 2, 8, 64
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 140, (experts, n, k // 32), dtype=torch.uint8, generator=generator)
    scales[0, :5, 0] = torch.tensor([2, 0xFC, 0xFD, 0xFE, 0xFF], dtype=torch.uint8)
    scales[1, :, 1] = 0xFE
    spec = mxfp4_moe.MXFP4MoESpec(k, k, experts, 1, dtype, torch.float32, None, None, "silu_glu", False)
    kernels = load_triton(spec, tmp_path)
    on = [t.to(DEVICE) for t in (blocks, scales, torch.ones(experts, dtype=torch.int32),
                                 torch.arange(experts, dtype=torch.int32))]
    ws = torch.full((experts, n, k), 7.0, dtype=torch.float32 if spec.dot_fp32 else torch.bfloat16, device=DEVICE)
    grid = (experts, -(-n // mxfp4_moe.DEQUANT_BLOCK_N), -(-k // mxfp4_moe.DEQUANT_BLOCK_K))
    kernels["mxfp4_dequantize_experts_kernel"][grid](*on, ws, N=n, K=k, BLOCK_N=mxfp4_moe.DEQUANT_BLOCK_N,
                                                     BLOCK_K=mxfp4_moe.DEQUANT_BLOCK_K,
                                                     num_warps=mxfp4_moe.DEQUANT_NUM_WARPS)
    columns = torch.arange(k)
    actual = ws.float().cpu()[..., columns // 32 * 32 + columns % 2 * 16 + columns % 32 // 2]  # nibble order
    expected = mxfp4.dequantize(blocks, scales, torch.float32).to(dtype).float()
    assert expected[0, 2:4].isinf().any() and expected[1].isinf().any(), "the case must reach past the range"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def test_prepare_rejects_arguments_of_another_spec(seed, tmp_path):
    args = case_args("gptoss-bfloat16-T1", seed)
    spec = mxfp4_moe.spec_from_args(*args[:11])
    for _ in range(2):  # the second from the checked facts: a mismatch after it is still refused
        mxfp4_moe.prepare(spec, *args)
    with pytest.raises(ValueError, match="got arguments for"):
        mxfp4_moe.prepare(spec, args[0].float(), *args[1:])
    with pytest.raises(ValueError, match="activation"):
        mxfp4_moe.prepare(spec, *args[:9], "relu", *args[10:])


# ---------------------------------------------------------------------------------------------------------
# Configs: legal on every profile, tiers per token bucket, path recorded


SPECS = {
    "gptoss-120b": mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16,
                                          torch.bfloat16, "clamped_swiglu", True),
    "deepseek": mxfp4_moe.MXFP4MoESpec(7168, 2048, 256, 8, torch.bfloat16, torch.float32, None, None, "silu_glu",
                                       False),
    "fp32-tiny": mxfp4_moe.MXFP4MoESpec(96, 64, 4, 2, torch.float32, torch.float32, torch.float32, None,
                                        "clamped_swiglu", True),
}


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("codegen", ["triton", "tilelang"])
def test_every_emitted_config_is_legal(codegen, name):
    profile = PROFILES[name]
    for spec_name, spec in SPECS.items():
        legal, illegal = legal_configs(mxfp4_moe, codegen, spec, profile)
        emitted = getattr(mxfp4_moe, f"{codegen}_configs")(spec, profile)
        if codegen == "tilelang" and not mxfp4_moe.tilelang_supports(spec):
            assert not emitted, (name, spec_name)  # fp32 activations: Triton only
            continue
        assert legal, (codegen, name, spec_name)
        smem = getattr(mxfp4_moe, f"{codegen}_shared_memory_bytes")
        for config in legal:
            threads = config["THREADS"] if codegen == "tilelang" else config.num_warps * profile.warp_size
            where = (codegen, name, spec_name, str(config))
            assert threads <= profile.max_threads_per_block and threads % profile.warp_size == 0, where
            assert config.num_warps * profile.warp_size == threads, where
            if codegen == "triton":
                assert config.num_warps <= profile.max_num_warps, where
            assert smem(spec, config) <= profile.shared_memory_per_block, where
            assert not config_problems(profile, threads=threads, num_warps=None, shared_memory_bytes=smem(spec, config),
                                       dtypes=spec.dtypes), where
        assert len(legal) + illegal == len(emitted)
        assert len(set(emitted)) == len(emitted), "a config listed twice is timed twice by the tuner"
        default = getattr(mxfp4_moe, f"{codegen}_default_config")(spec, profile)
        assert default in legal, (codegen, name, spec_name)
        # Every token bucket gets a non-empty tier and a default inside it.
        for bucket in (1, 8, 64, 512, 2048, 8192):
            tier, bucket_default = mxfp4_moe.configs_for_bucket(spec, profile, bucket, legal, default)
            assert tier and bucket_default in tier and set(tier) <= set(legal), (codegen, name, spec_name, bucket)


def test_mp_22_prunes_wide_tiles_and_keeps_decode_configs():
    spec = SPECS["gptoss-120b"]
    legal, illegal = legal_configs(mxfp4_moe, "triton", spec, MP_22)
    assert illegal > 0
    assert all(c.num_warps * 128 <= 1024 and mxfp4_moe.triton_shared_memory_bytes(spec, c) <= 72 * 1024
               for c in legal)
    tier, _ = mxfp4_moe.configs_for_bucket(spec, MP_22, 1, legal, legal[0])
    assert all(c["BLOCK_M"] == 16 for c in tier)


def test_cost_model_picks_online_for_decode_and_workspace_for_prefill_without_wgmma():
    """Online for decode; at 8192 tokens (8192 * 4 / 128 = 256 rows an expert) the workspace path where the MMA
    is not wgmma, and on Hopper the online SWAP_AB tile with 128 token rows (measured 1.46x faster there)."""
    spec = SPECS["gptoss-120b"]
    paths = {}
    for profile in (SM_90, MP_31):
        legal, _ = legal_configs(mxfp4_moe, "triton", spec, profile)
        default = mxfp4_moe.triton_default_config(spec, profile)
        for bucket in (1, 64, 8192):
            _, config = mxfp4_moe.configs_for_bucket(spec, profile, bucket, legal, default)
            paths[profile.name, bucket] = mxfp4_moe.describe_config(config), config
    for profile in (SM_90, MP_31):
        assert paths[profile.name, 1][0].startswith("online") and paths[profile.name, 64][0].startswith("online")
    assert paths[MP_31.name, 8192][0].startswith("workspace")
    description, config = paths[SM_90.name, 8192]
    assert description.startswith("online") and "A operand" in description and config["BLOCK_M"] == 128


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time Triton compilation for sm_90 (no GPU needed)

_AOT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dzc
    from dzc.targets import mxfp4_moe as family, mxfp4_moe_routing as routing, triton_codegen
    from dzc.targets.kernel_config import KernelConfig
    from dzc.targets.profiles import SM_90

    assert not triton_codegen.interpreting()
    TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
    SERIALIZATION_CHECKED = "gptoss-bf16/prefill-swap_ab/moe_gate_up_kernel"
    out = Path(sys.argv[1])
    target = GPUTarget("cuda", 90, 32)
    jobs = []  # what to compile, in order; compiled below

    def compile_kernel(fn, signature, constexprs, num_warps, num_stages, label, estimate=None):
        jobs.append((fn, signature, constexprs, num_warps, num_stages, label, estimate))

    def compile_job(index):
        fn, signature, constexprs, num_warps, num_stages, label, estimate = jobs[index]
        # Pointers divisible by 16, as the JIT specialises torch's allocations: without it no load is wide
        # enough to be asynchronous, nothing is pipelined, and the shared memory checked is not the launched one's.
        names = list(signature)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
        kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), target=target,
                                options={"num_warps": num_warps, "num_stages": num_stages})
        result = dict(label=label, shared=kernel.metadata.shared, ptx="ld.global" in kernel.asm["ptx"],
                      mma="mma" in kernel.asm["ptx"], tma_loads=kernel.asm["ttgir"].count("async_tma_copy"),
                      fp4_to_fp="fp4_to_fp" in kernel.asm["ttgir"], wgmma="wgmma" in kernel.asm["ptx"],
                      async_copies=kernel.asm["ttgir"].count("async_copy_global_to_local"))
        if estimate is not None:
            result["estimate"] = estimate
        if label == SERIALIZATION_CHECKED and TRITON_VERSION >= (3, 9):  # ptxas's verdict on its wgmma (C7515)
            import subprocess, tempfile
            from triton.backends.nvidia.compiler import get_ptxas
            with tempfile.TemporaryDirectory() as tmp:
                ptx = Path(tmp) / "kernel.ptx"
                ptx.write_text(kernel.asm["ptx"])
                run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                                     capture_output=True, text=True)
            result["wgmma_serialized"] = "C7515" in run.stdout + run.stderr
        return result

    # (spec, config): gpt-oss decode (online) and prefill (workspace, with the dequantization kernel), and the
    # fp32-operand variant that fp16 activations take.
    specs = {
        "gptoss-bf16": family.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16,
                                           torch.bfloat16, "clamped_swiglu", True),
        "deepseek-fp16": family.MXFP4MoESpec(7168, 2048, 256, 8, torch.float16, torch.bfloat16, None, None,
                                             "silu_glu", False),
    }
    cases = [("gptoss-bf16", "decode", KernelConfig.make(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0)),
             ("gptoss-bf16", "prefill-workspace",
              KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, WORKSPACE=1)),
             ("deepseek-fp16", "decode", KernelConfig.make(4, 2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, WORKSPACE=0)),
             ("gptoss-bf16", "decode-split",
              KernelConfig.make(2, 2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0, SPLIT_K=4)),
             ("gptoss-bf16", "decode-tma",
              KernelConfig.make(4, 4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0, SPLIT_K=2, TMA=1)),
             ("gptoss-bf16", "decode-tma-dot_scaled",
              KernelConfig.make(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0, SPLIT_K=2, TMA=1,
                                DOT_SCALED=1)),
             ("gptoss-bf16", "prefill-tma-dot_scaled",
              KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, WORKSPACE=0, TMA=1, DOT_SCALED=1)),
             ("gptoss-bf16", "decode-swap_ab",
              KernelConfig.make(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=2, SWAP_AB=1)),
             ("gptoss-bf16", "decode-tma-swap_ab",
              KernelConfig.make(4, 3, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, WORKSPACE=0, TMA=1, SWAP_AB=1)),
             ("gptoss-bf16", "prefill-swap_ab",
              KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, WORKSPACE=0, SWAP_AB=1))]
    for spec_name, config_name, config in cases:
        spec = specs[spec_name]
        path = out / f"mxfp4_moe_{spec_name}.py"
        path.write_text(family.triton_source(spec, SM_90))
        kernels = triton_codegen.load(family, path, spec, SM_90)
        for name, (signature, constexprs, *own_warps) in family.triton_signatures(spec, config).items():
            if name == "moe_down_kernel" and spec_name == "deepseek-fp16":
                continue
            if name not in ("moe_gate_up_kernel", "moe_down_kernel") and "-tma" in config_name:
                continue
            if name == "moe_reorder_kernel" and config_name not in ("decode", "decode-swap_ab"):
                continue
            if name == "mxfp4_dequantize_experts_kernel" and config_name != "prefill-workspace":
                continue
            if name == "moe_split_activation_kernel" and config_name != "decode-split":
                continue
            fn = getattr(kernels[name], "fn", kernels[name])
            warps = own_warps[0] if own_warps else config.num_warps
            estimate = (family.triton_shared_memory_bytes(spec, config)
                        if name in ("moe_gate_up_kernel", "moe_down_kernel") else None)
            compile_kernel(fn, signature, constexprs, warps, config.num_stages,
                           f"{spec_name}/{config_name}/{name}", estimate)
    e_pow2, chunk = 256, routing.ROUTING_CHUNK
    i32 = "*i32"
    compile_kernel(routing.moe_route_one_chunk_kernel, dict(ids_ptr=i32, sorted_pairs_ptr=i32, pairs="i32",
                   num_experts="i32", expert_offsets_ptr=i32, expert_counts_ptr=i32, expert_slots_ptr=i32,
                   expert_first_block_ptr=i32, block_expert_ptr=i32, block_row_start_ptr=i32, block_row_end_ptr=i32,
                   max_blocks="i32", E_POW2="constexpr", BLOCK_M="constexpr", SCHEDULE_STEP="constexpr",
                   CHUNK="constexpr"), dict(E_POW2=e_pow2, BLOCK_M=16, SCHEDULE_STEP=routing.SCHEDULE_STEP,
                   CHUNK=chunk), 4, 1, "routing/one-chunk")
    compile_kernel(routing.moe_count_kernel, dict(ids_ptr="*i64", chunk_counts_ptr=i32, pairs="i32",
                   num_experts="i32", E_POW2="constexpr", CHUNK="constexpr"), dict(E_POW2=e_pow2, CHUNK=chunk),
                   4, 1, "routing/count")
    compile_kernel(routing.moe_schedule_kernel, dict(chunk_counts_ptr=i32, n_chunks="i32", chunk_bases_ptr=i32,
                   expert_offsets_ptr=i32, expert_counts_ptr=i32, expert_slots_ptr=i32, expert_first_block_ptr=i32,
                   block_expert_ptr=i32, block_row_start_ptr=i32, block_row_end_ptr=i32, max_blocks="i32",
                   E_POW2="constexpr", BLOCK_M="constexpr", SCHEDULE_STEP="constexpr"),
                   dict(E_POW2=e_pow2, BLOCK_M=16, SCHEDULE_STEP=routing.SCHEDULE_STEP), 4, 1, "routing/schedule")
    compile_kernel(routing.moe_scatter_kernel, dict(ids_ptr=i32, chunk_bases_ptr=i32, sorted_pairs_ptr=i32,
                   pairs="i32", num_experts="i32", E_POW2="constexpr", CHUNK="constexpr"),
                   dict(E_POW2=e_pow2, CHUNK=chunk), 4, 1, "routing/scatter")
    compile_kernel(routing.moe_combine_kernel, dict(pair_out_ptr="*fp32", ids_ptr=i32, out_ptr="*bf16",
                   num_experts="i32", stride_out="i32", pairs="i32", HIDDEN="constexpr", TOP_K="constexpr",
                   BLOCK_H="constexpr", SPLITS="constexpr"), dict(HIDDEN=2880, TOP_K=4, BLOCK_H=1024, SPLITS=4), 4, 1,
                   "routing/combine")
    # Compiled by two processes forked from this one (the kernels live in its memory): the CI machine's two cores.
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(compile_job, range(len(jobs)), chunksize=1)
    print("RESULTS " + json.dumps(results))
""")


def test_triton_kernels_compile_ahead_of_time_for_sm_90(tmp_path):
    results = run_ahead_of_time_script(_AOT_SCRIPT, tmp_path)
    labels = [r["label"] for r in results]
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 9):  # ptxas ran on the checked tile
        assert sum("wgmma_serialized" in r for r in results) == 1, labels
    assert len(results) == 4 + 3 + 1 + 3 + 2 + 2 + 2 + 3 + 2 + 2 + 5, labels
    for r in results:
        assert r["ptx"], r
        # TMA: the weight loads pipelined (stages - 1 prologue copies, then one per step, per weight tile); not
        # pipelined there would be one copy per tile
        assert (r["tma_loads"] >= 3) == ("-tma" in r["label"]), r
        # DOT_SCALED: the compiler's E2M1 conversion into the operand registers, then Hopper's warp-group MMA
        if "dot_scaled" in r["label"]:
            assert r["fp4_to_fp"] and r["wgmma"], r
        # SWAP_AB: the decoded weights are the warp-group MMA's A operand; without TMA or split-K the gate/up
        # GEMM's stacked operand keeps ptxas from serializing the wgmma pipeline (the two-accumulator form did:
        # C7515). Split-K tiles (a reduction range known at run time) are still serialized. Checked with Triton 3.9's
        # PTX and ptxas; the H200 machine's Triton 3.6 has not been looked at.
        if "swap_ab" in r["label"] and "estimate" in r:
            assert r["wgmma"], r
            if "wgmma_serialized" in r:  # (the prefill tile's gate/up, compiled by Triton 3.9+)
                assert not r["wgmma_serialized"], r
        # The workspace GEMMs read plain bf16 tiles: pipelined, their loads asynchronous copies in flight
        if "prefill-workspace/moe_" in r["label"] and "estimate" in r:
            assert r["async_copies"] >= 3, r
        if "estimate" in r and "bf16" in r["label"]:
            assert r["mma"], f"{r['label']}: the GEMM did not use matrix instructions"
            assert r["shared"] <= r["estimate"], f"{r['label']}: shared memory {r['shared']} > estimate"


# The W4A16 prefill pick at gpt-oss-120b T=8192 on the H200 (SWAP_AB, 128 token rows, BLOCK_N 64, 4 warps, 3 stages).
SWAP_AB_PREFILL_PICK = "BLOCK_M=128,BLOCK_N=64,BLOCK_K=128,WORKSPACE=0,SPLIT_K=1,SWAP_AB=1,num_warps=4,num_stages=3"


def _wide_swap_ab_tiles():
    """The SWAP_AB tiles of 256 token rows that triton_configs offers gpt-oss-120b on sm_90."""
    return [c for c in mxfp4_moe.triton_configs(SPECS["gptoss-120b"], SM_90) if c["BLOCK_M"] == 256]


@pytest.fixture(scope="module")
def swap_ab_sass(tmp_path_factory):
    """gpt_oss_gemm_sass of the W4A16 prefill pick ("pick"), the pick with DECODE=2 ("decode2") and each 256-row
    SWAP_AB tile ("wide0", ...), compiled in one process (a process and the pick's compile per test before, ~15 s);
    label -> (config text, its result)."""
    configs = dict(pick=SWAP_AB_PREFILL_PICK, decode2=SWAP_AB_PREFILL_PICK.replace("SWAP_AB=1", "SWAP_AB=1,DECODE=2"),
                   **{f"wide{i}": str(c).replace(" ", ",") for i, c in enumerate(_wide_swap_ab_tiles())})
    results = gpt_oss_gemm_sass(tmp_path_factory.mktemp("swap_ab_sass"), **configs)
    return {label: (configs[label], results[label]) for label in configs}


def test_swap_ab_prefill_tile_keeps_wgmma_in_flight_across_its_k_step(swap_ab_sass):
    """The W4A16 prefill pick at gpt-oss-120b T=8192 (SWAP_AB, 128 token rows, BLOCK_N 64, 4 warps, 3 stages),
    compiled for sm_90 and read by `tools/diagnose_mxfp4_moe_kernels.py --sass` (docs/mxfp4_moe_kernels.md, static
    diagnosis): each GEMM's K loop multiplies by wgmma (64 x 128 x 16 bf16: 16 a step for the stacked gate/up, 8 for
    down) and never waits for every wgmma issued (each wait leaves one group in flight, across the decode of the next
    half-tile and across the step's end): a serialized pipeline (C7515) would show waits of depth 0 here. The waits
    and MMA counts are checked with Triton 3.9+ (what the doc's table was read from; Triton 3.6's SASS has not been
    read)."""
    results = swap_ab_sass["pick"][1]["profiles"]
    mmas = {"moe_gate_up_kernel": 16, "moe_down_kernel": 8}
    for name, profile in results.items():
        loop = profile["loop"]
        assert loop and loop["mma_shapes"], f"{name}: no K loop with MMAs found in the SASS"
        assert all(shape.startswith("HGMMA.") for shape in loop["mma_shapes"]), (name, loop["mma_shapes"])
        if SASS_TABLES_TRITON:
            assert loop["mma_shapes"] == {"HGMMA.64x128x16.F32.BF16": mmas[name]}, (name, loop["mma_shapes"])
            assert loop["waits"] and min(loop["waits"]) >= 1, (name, loop["waits"])
            assert not profile["wgmma_serialized"], name


def test_swap_ab_decode_2_shortens_the_prefill_tiles_k_step(swap_ab_sass):
    """The W4A16 prefill pick (SWAP_AB 128 x 64, 4 warps, 3 stages, gpt-oss-120b) with DECODE=2 against DECODE=1,
    compiled for sm_90 and read by `tools/diagnose_mxfp4_moe_kernels.py --sass`: in both GEMMs' K step the decode's
    ALU work (PRMT + LOP3 + SHF + HFMA2; gate/up 393 = 3.1 a value with DECODE=1) shrinks by at least 10%, the step
    by at least 5%, with no more spill bytes or local accesses and the wgmma still in flight (waits of depth 1).
    Checked with Triton 3.9+ (docs/mxfp4_moe_kernels.md)."""
    results = {"1": swap_ab_sass["pick"][1], "2": swap_ab_sass["decode2"][1]}
    if not SASS_TABLES_TRITON:
        pytest.skip("the counts were read from Triton 3.9's SASS")
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        old, new = results["1"]["profiles"][name], results["2"]["profiles"][name]

        def decode_alu(profile):
            counts = profile["loop"]["counts"]
            return sum(counts.get(k, 0) for k in ("PRMT", "LOP3", "SHF", "HFMA2/HMUL2"))

        assert decode_alu(new) <= 0.9 * decode_alu(old), (name, decode_alu(old), decode_alu(new))
        assert new["loop"]["instructions"] <= 0.95 * old["loop"]["instructions"], name
        assert new["spill_bytes"][0] <= old["spill_bytes"][0], (name, old["spill_bytes"], new["spill_bytes"])
        assert new["loop"]["spill_accesses_in_loop"] <= old["loop"]["spill_accesses_in_loop"], name
        assert new["loop"]["mma_shapes"] == old["loop"]["mma_shapes"], name
        assert min(new["loop"]["waits"]) >= 1 and not new["wgmma_serialized"], (name, new["loop"]["waits"])


def test_swap_ab_256_row_tiles_cut_the_k_step_per_token_row_without_spilling_more(swap_ab_sass):
    """Every SWAP_AB tile of 256 token rows that triton_configs offers on sm_90 (8 warps, BLOCK_N 64, 3 stages,
    DECODE 1 and 2) against the 128-row prefill pick, compiled for gpt-oss-120b and read by
    `tools/diagnose_mxfp4_moe_kernels.py --sass` (docs/mxfp4_moe_kernels.md, session 34): each GEMM spills no more
    bytes and has no local access in its K loop, keeps a wgmma group in flight, and fits its shared-memory
    estimate, which fits sm_90. The block's SASS instructions a K step per token row: gate/up at most 0.7x the
    pick's (each warp group decodes 64 of the 128 stacked rows for all 256 tokens), down at most 0.9x (its two warp
    groups decode the same 64 rows). Checked with Triton 3.9+."""
    if not SASS_TABLES_TRITON:
        pytest.skip("the counts were read from Triton 3.9's SASS")
    wide = _wide_swap_ab_tiles()
    assert len(wide) == 2 and all(c.num_warps == 8 and c["BLOCK_N"] == 64 for c in wide)
    labels = ["pick", *(f"wide{i}" for i in range(len(wide)))]
    configs = {label: swap_ab_sass[label][0] for label in labels}
    results = {label: swap_ab_sass[label][1] for label in labels}
    # (warps, token rows) of each tile (all of BLOCK_N 64): the pick's 4 and 128
    shapes = dict(pick=(4, 128), **{f"wide{i}": (c.num_warps, c["BLOCK_M"]) for i, c in enumerate(wide)})

    def per_row(label, name):  # the block's instructions a K step per token row
        warps, rows = shapes[label]
        return results[label]["profiles"][name]["loop"]["instructions"] * warps / rows

    mma = {"moe_gate_up_kernel": "HGMMA.64x256x16.F32.BF16", "moe_down_kernel": "HGMMA.64x128x16.F32.BF16"}
    ratio = {"moe_gate_up_kernel": 0.7, "moe_down_kernel": 0.9}
    for label in configs.keys() - {"pick"}:
        for name in mma:
            pick, new = results["pick"]["profiles"][name], results[label]["profiles"][name]
            where = (configs[label], name)
            assert new["spill_bytes"][0] <= pick["spill_bytes"][0], (where, pick["spill_bytes"], new["spill_bytes"])
            assert new["loop"]["spill_accesses_in_loop"] == 0, where
            assert new["loop"]["mma_shapes"] == {mma[name]: 8}, (where, new["loop"]["mma_shapes"])
            assert min(new["loop"]["waits"]) >= 1 and not new["wgmma_serialized"], (where, new["loop"]["waits"])
            assert per_row(label, name) <= ratio[name] * per_row("pick", name), (where, per_row(label, name))
            assert new["shared"] <= results[label]["shared_estimate"] <= SM_90.shared_memory_per_block, where


# ---------------------------------------------------------------------------------------------------------
# TileLang: rendered, lowered to CUDA, compiled by nvcc for sm_90a (no GPU needed)


def test_tilelang_source_renders_both_gemms():
    for spec in SPECS.values():
        if not mxfp4_moe.tilelang_supports(spec):
            with pytest.raises(ValueError, match="no TileLang kernel"):
                mxfp4_moe.tilelang_source(spec, SM_90)
            continue
        source = mxfp4_moe.tilelang_source(spec, SM_90)
        assert "$" not in source and "do not edit" in source
        compile(source, "mxfp4_moe.tilelang.py", "exec")
        assert "def build(block_m: int, block_n: int, block_k: int, threads: int, num_stages: int, gemm: int,\n" \
               "          warp_specialized: int = 0):" in source


@pytest.mark.slow
@pytest.mark.skipif(not tilelang_codegen.installed_target_kinds() or not os.environ.get("PATH"),
                    reason="no TileLang")
def test_tilelang_gemms_lower_to_cuda_and_compile_with_nvcc(tmp_path):
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    spec = SPECS["gptoss-120b"]
    path = tmp_path / "mxfp4_moe_tilelang.py"
    path.write_text(mxfp4_moe.tilelang_source(spec, SM_90))
    config = next(c for c in mxfp4_moe.tilelang_configs(spec, SM_90)
                  if c["BLOCK_M"] == 16 and c["BLOCK_N"] == 64 and c["BLOCK_K"] == 64 and c["THREADS"] == 128
                  and c["NUM_STAGES"] == 1)
    objects = []
    # Each nvcc (~9 s) runs beside the next kernel's lowering and the other nvcc: the CI machine has two cores.
    with ThreadPoolExecutor(2) as nvcc:
        for name, kernel_config in mxfp4_moe.tilelang_kernel_configs(spec, config).items():
            kernel_name = f"{name}_kernel"
            cuda_source = tilelang_codegen.lower_to_device_source(path, mxfp4_moe.TILELANG_FACTORY_NAME,
                                                                  kernel_config, SM_90)
            assert f"void __launch_bounds__(128, 1) {kernel_name}" in cuda_source
            assert "if (0 <= expert)" in cuda_source  # unused row blocks of the upper-bound grid do nothing
            if shutil.which("nvcc"):
                objects.append(nvcc.submit(tilelang_codegen.nvcc_compile, cuda_source, SM_90, tmp_path / "nvcc"))
        for compiled in objects:
            assert compiled.result().stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------
# GPU: both codegens, both paths, every self-test case


def gpu_profile():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the mxfp4_moe GPU tests target sm_90")
    return SM_90


GPU_CONFIGS = [ONLINE_DECODE, ONLINE_WIDE, WORKSPACE, ONLINE_SPLIT,
               KernelConfig.make(2, 2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0, SPLIT_K=4),
               KernelConfig.make(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WORKSPACE=0),
               KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, WORKSPACE=1),
               KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, WORKSPACE=0), ONLINE_TMA, ONLINE_TMA_SPLIT,
               KernelConfig.make(4, 4, BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, WORKSPACE=0, SPLIT_K=2, TMA=1)]


@pytest.mark.gpu
def test_triton_on_gpu_every_selftest_case(seed, tmp_path):
    """Every self-test case on both paths, in every GPU config whose shared-memory estimate fits the profile."""
    profile = gpu_profile()
    for name, build in mxfp4_moe.selftest_cases(profile):
        args = build(torch.device("cuda"), torch.Generator(device="cuda").manual_seed(seed))
        spec = mxfp4_moe.spec_from_args(*args[:11])
        fitting = [c for c in GPU_CONFIGS
                   if mxfp4_moe.triton_shared_memory_bytes(spec, c) <= profile.shared_memory_per_block]
        assert any(c["WORKSPACE"] for c in fitting) and any(not c["WORKSPACE"] for c in fitting), name
        for config in fitting:
            out = run_triton(args, config, tmp_path)
            check_against_reference(args, out)


@pytest.mark.gpu
def test_default_configs_cover_both_paths_on_gpu(seed, tmp_path):
    """The cost model's own choices for a decode and a prefill bucket, on a layer large enough to tile: online at
    decode; at prefill the SWAP_AB online tile where the MMA is wgmma (measured faster than the workspace path on
    the H200), else the workspace path."""
    profile = gpu_profile()
    generator = torch.Generator(device="cuda").manual_seed(seed)
    prefill_path = "online dequant (MXFP4 decoded into the MMA's A operand" \
        if profile.matrix_instruction == "wgmma" else "workspace"
    for tokens, path in ((4, "online"), (512, prefill_path)):
        args = mxfp4_moe.random_moe_args(torch.device("cuda"), generator, tokens=tokens, hidden=2880, inter=256,
                                         experts=8, top_k=2)
        spec = mxfp4_moe.spec_from_args(*args[:11])
        legal, _ = legal_configs(mxfp4_moe, "triton", spec, profile)
        _, config = mxfp4_moe.configs_for_bucket(spec, profile, mxfp4_moe.token_bucket(tokens), legal,
                                                 mxfp4_moe.triton_default_config(spec, profile))
        assert mxfp4_moe.describe_config(config).startswith(path)
        check_against_reference(args, run_triton(args, config, tmp_path))


# WARP_SPECIALIZED=1 takes K multiples of 64 (of the selftest cases only the 128-row prefill one): these add rows past
# one 128-row block an expert (skewed), N tails of both GEMMs' 128 and 256 weight rows, silu_glu with gate and up
# concatenated and no bias.
WS_GPU_CASES = {
    "ws-T300-skewed": dict(tokens=300, hidden=192, inter=320, experts=3, top_k=2, skew=3.0),
    "ws-silu-concat-nobias-T200": dict(tokens=200, hidden=128, inter=192, experts=4, top_k=2, activation="silu_glu",
                                       interleaved=False, bias=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["untuned", "warp_specialized"])
def test_tilelang_on_gpu_every_selftest_case(form, seed, tmp_path):
    """untuned: the default config on every case; the 64-row config on the first (each TileLang config compiles
    ~30 s). warp_specialized: every WARP_SPECIALIZED=1 config on the cases it takes (and WS_GPU_CASES)."""
    profile = gpu_profile()
    cases = mxfp4_moe.selftest_cases(profile)
    if form == "warp_specialized":
        cases += [(name, lambda device, generator, kw=kw: mxfp4_moe.random_moe_args(device, generator, **kw))
                  for name, kw in WS_GPU_CASES.items()]
    for index, (name, build) in enumerate(cases):
        args = build(torch.device("cuda"), torch.Generator(device="cuda").manual_seed(seed))
        spec = mxfp4_moe.spec_from_args(*args[:11])
        if not mxfp4_moe.tilelang_supports(spec):  # fp32 activations: Triton only (see tilelang_supports)
            continue
        if form == "warp_specialized" and mxfp4_moe.warp_specialization_problems(spec, profile):
            continue
        path = tmp_path / f"mxfp4_moe_tl_{abs(hash(spec))}.py"
        path.write_text(mxfp4_moe.tilelang_source(spec, profile))
        kernels = tilelang_codegen.load(mxfp4_moe, path, spec, profile)
        inputs, (out,), _, _ = mxfp4_moe.prepare(spec, *args)
        configs = [mxfp4_moe.tilelang_default_config(spec, profile)]
        if form == "warp_specialized":
            configs = [c for c in mxfp4_moe.tilelang_configs(spec, profile) if mxfp4_moe.warp_specialized(c)]
            assert configs, name
        elif index == 0:
            configs.append(next(c for c in mxfp4_moe.tilelang_configs(spec, profile) if c["BLOCK_M"] == 64))
        for config in configs:
            out.fill_(float("nan"))
            mxfp4_moe.tilelang_launch(kernels, config, *inputs, out)
            check_against_reference(args, out)
