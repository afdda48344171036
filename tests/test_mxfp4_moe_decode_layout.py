"""dzc.mxfp4_moe decode tiles laid out like triton_kernels' (issue 15, docs/mxfp4_moe_kernels.md, "Decode beside
triton_kernels, static"): TMA_STACKED, the SWAP_AB TMA gate/up tile whose gate and up rows (interleaved in w13)
come as one TMA box of 2 * BLOCK_N rows and are decoded into one MMA operand with one accumulator.

Numerics on DEVICE (Triton's interpreter on CPU, dots upcast to exact fp32) against the op's reference on seeded
random layers, outputs NaN-poisoned before every launch (run_triton); the sm_90 SASS of gpt-oss-120b's decode GEMMs
compiled ahead of time (no GPU) and read by tools/diagnose_mxfp4_moe_kernels.py --sass.
"""

import os
from pathlib import Path

import pytest
import torch
import triton
from conftest import SASS_TABLES_TRITON, gpt_oss_gemm_sass
from test_mxfp4_moe_kernels import (
    PROFILES,
    case_args,
    check_against_reference,
    check_against_reference_with_nan_column,
    check_gate_up_nan_scale_reaches_its_tokens_only,
    run_triton,
)

from dzc.targets import mxfp4_moe
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE


def stacked(block_n: int = 64, split_k: int = 1, decode: int = 1, block_m: int = 16) -> KernelConfig:
    extra = {"DECODE": 2} if decode == 2 else {}
    return KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, WORKSPACE=0,
                             SPLIT_K=split_k, SWAP_AB=1, TMA=1, TMA_STACKED=1, **extra)


# The offered tiles (DECODE=1), the DECODE=2 ones the GPU campaign times too (the interpreter runs the arithmetic
# decoder for both: their PTX decoder is DECODE=2's, checked against DECODE=1 in tests/test_mxfp4_moe_kernels.py).
STACKED_TILES = [stacked(64), stacked(128), stacked(64, split_k=2), stacked(128, split_k=2), stacked(64, decode=2),
                 stacked(128, split_k=2, decode=2)]
IDS = ["64", "128", "64-split2", "128-split2", "64-decode2", "128-split2-decode2"]


@pytest.mark.parametrize("config", STACKED_TILES, ids=IDS)
@pytest.mark.parametrize("case", ["gptoss-bfloat16-T5", "gptoss-T37-skewed-bf16-weights"])
def test_stacked_tma_tiles_match_the_reference(case, config, seed, tmp_path):
    """The selftest layers whose gate and up rows are interleaved (I = 64: one whole box of 2 * BLOCK_N rows at
    BLOCK_N 64, a half-empty one at 128, zeros past the last row), 5 tokens and 37 skewed ones (several row blocks
    for expert 0)."""
    args = case_args(case, seed)
    assert args[10], "gate and up rows interleaved"
    check_against_reference(args, run_triton(args, config, tmp_path))


@pytest.mark.parametrize("config", STACKED_TILES[:4], ids=IDS[:4])
def test_stacked_tma_tiles_over_several_k_tiles_with_tails(config, seed, tmp_path):
    """H = 288, I = 160: whole 128-column K tiles, a partial last one (K tails), partial row blocks and a partial
    last box of gate/up rows, a NaN scale in one down-weight group (the down GEMM is the plain SWAP_AB TMA one)."""
    args = list(mxfp4_moe.random_moe_args(torch.device(DEVICE), torch.Generator().manual_seed(seed), tokens=9,
                                          hidden=288, inter=160, experts=3, top_k=2))
    scales = args[7].clone()
    scales[1, 5, 4] = 255  # expert 1, output column 5, columns 128..159 of the down GEMM's reduction
    args[7] = scales
    check_against_reference_with_nan_column(args, run_triton(args, config, tmp_path), column=5, expert=1,
                                            topk_ids=args[1])


@pytest.mark.parametrize("config", [stacked(64), stacked(128, split_k=2)], ids=["64", "128-split2"])
def test_stacked_tma_gate_up_nan_scale_reaches_its_tokens_only(config, seed, tmp_path):
    """A NaN scale in one up row of one expert (the stacked operand's row 161: column 80's up row): that column of
    the activation is NaN, so every output of the tokens routed there is; the others match the reference."""
    check_gate_up_nan_scale_reaches_its_tokens_only(config, seed, tmp_path)


def test_stacked_tma_tile_on_weights_off_16_byte_alignment_runs_by_plain_loads(seed, tmp_path):
    """Weights 8 bytes off 16-byte alignment: the same tile without TMA, SWAP_AB and TMA_STACKED."""
    args = list(case_args("gptoss-bfloat16-T5", seed))
    for index in (3, 6):  # w13_blocks, w2_blocks
        blocks = args[index]
        shifted = torch.empty(blocks.numel() + 8, dtype=blocks.dtype, device=blocks.device)[8:].view(blocks.shape)
        shifted.copy_(blocks)
        args[index] = shifted
        assert shifted.data_ptr() % mxfp4_moe.TMA_ALIGNMENT != 0
    assert "TMA_STACKED" not in dict(mxfp4_moe._plain_loads(stacked(64)).params)
    check_against_reference(args, run_triton(args, stacked(64), tmp_path))


@pytest.mark.parametrize("case", ["gptoss-bfloat16-T5", "silu-concat-nobias-T37-skewed", "gptoss-float32-T5"])
def test_stacked_tma_tiles_offered_where_they_apply_and_untuned_for_decode(case):
    """Offered (SWAP_AB, TMA, 16 token rows; DECODE=2 too where Triton has inline assembly) where the profile's
    Triton has tensor descriptors and the gate/up rows are interleaved, with bf16 activations; legal there; a
    decode bucket's untuned choice exactly where one has the bucket's split (with DECODE=2 where offered), never a
    prefill bucket's."""
    spec = mxfp4_moe.spec_from_args(*case_args(case, 0)[:11])
    for profile in PROFILES.values():
        configs = mxfp4_moe.triton_configs(spec, profile)
        offered = [c for c in configs if dict(c.params).get("TMA_STACKED")]
        applies = profile.triton_tensor_descriptors and spec.interleaved and spec.hidden_dtype == torch.bfloat16
        assert bool(offered) == applies, (profile.name, case)
        assert all(c["BLOCK_M"] == 16 and dict(c.params)["SWAP_AB"] and dict(c.params)["TMA"] for c in offered)
        if not offered:
            continue
        decoders = {dict(c.params).get("DECODE", 1) for c in offered}
        assert decoders == ({1, 2} if profile.triton_inline_asm else {1}), profile.name
        legal, _ = legal_configs(mxfp4_moe, "triton", spec, profile)
        if profile is SM_90:
            assert all(c in legal for c in offered)
        for bucket in (1, 8, 64, 4096):
            tier, default = mxfp4_moe.configs_for_bucket(spec, profile, bucket, legal, legal[0])
            decode = mxfp4_moe.rows_per_expert(spec, bucket) <= mxfp4_moe.DECODE_MAX_ROWS_PER_EXPERT
            fits = any(dict(c.params).get("TMA_STACKED") and c["SPLIT_K"] == mxfp4_moe._default_split_k(spec, bucket)
                       for c in tier)
            stacked = dict(default.params).get("TMA_STACKED", 0)
            assert bool(stacked) == (decode and profile.bulk_tensor_copies and fits), (profile.name, bucket)
            if stacked:
                assert dict(default.params).get("DECODE", 1) == max(decoders), (profile.name, bucket)
            if decode:
                assert any(dict(c.params).get("TMA_STACKED") for c in tier), (profile.name, bucket)


def _sass_toolchain() -> bool:
    """Triton's ptxas and nvdisasm (its CUDA backend's bin/), which --sass runs."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return all(os.access(bin_dir / tool, os.X_OK) for tool in ("ptxas", "nvdisasm"))


DECODE_DEFAULT = "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3"


def test_stacked_tma_tiles_cut_the_decode_k_step_per_weight_byte(tmp_path):
    """gpt-oss-120b's decode GEMMs compiled for sm_90: the untuned T=8 tile (SWAP_AB 16 x 64 by TMA, gate/up K step
    711 SASS instructions a warp for 128 weight rows, waits 3, 3, 3, 3; down 389 for 64 rows) against TMA_STACKED.
    Per packed weight byte of a K step (instructions x warps / bytes), the stacked gate/up step is at least 8%
    shorter (636; with DECODE=2 at least 15%: 580), keeps one wgmma group in flight (waits of depth 1, not
    serialized) and spills nothing; at BLOCK_N 128 (128 weight rows a program in the down GEMM, as triton_kernels'
    tile) the down step is at least 15% shorter per byte than the default's. triton_kernels' _matmul_ogs at the same
    shape (16 x 128 x 128, 4 warps, HOPPER_VALUE): 450 a warp for 128 rows, 0.22 a byte."""
    if not _sass_toolchain():
        pytest.skip("Triton's ptxas / nvdisasm (its CUDA backend) are not installed")
    configs = {"default": DECODE_DEFAULT,
               "stacked": DECODE_DEFAULT.replace("SWAP_AB=1", "SWAP_AB=1,TMA_STACKED=1"),
               "stacked_decode_2": DECODE_DEFAULT.replace("SWAP_AB=1", "SWAP_AB=1,TMA_STACKED=1,DECODE=2"),
               "stacked_128": DECODE_DEFAULT.replace("BLOCK_N=64", "BLOCK_N=128").replace("SWAP_AB=1",
                                                                                         "SWAP_AB=1,TMA_STACKED=1")}
    results = gpt_oss_gemm_sass(tmp_path, **configs)
    if not SASS_TABLES_TRITON:
        pytest.skip("the counts were read from Triton 3.9's SASS")

    def per_byte(label, name):
        profile = results[label]["profiles"][name]
        block_n = 128 if label == "stacked_128" else 64
        rows = 2 * block_n if name == "moe_gate_up_kernel" else block_n
        return profile["loop"]["instructions"] * 4 / (rows * 64)  # 4 warps; 64 packed bytes a row and step

    gate_up = {label: per_byte(label, "moe_gate_up_kernel") for label in configs}
    down = {label: per_byte(label, "moe_down_kernel") for label in configs}
    assert gate_up["stacked"] <= 0.92 * gate_up["default"], gate_up
    assert gate_up["stacked_decode_2"] <= 0.85 * gate_up["default"], gate_up
    assert down["stacked_128"] <= 0.85 * down["default"], down
    for label in configs:
        for name, profile in results[label]["profiles"].items():
            assert profile["spill_bytes"] == [0, 0], (label, name, profile["spill_bytes"])
            assert not profile["wgmma_serialized"], (label, name)
            assert min(profile["loop"]["waits"]) >= 1, (label, name, profile["loop"]["waits"])
            rows = (2 if name == "moe_gate_up_kernel" else 1) * (128 if label == "stacked_128" else 64)
            assert profile["loop"]["mma_shapes"] == {"HGMMA.64x16x16.F32.BF16": rows // 64 * 8}, (label, name)


@pytest.mark.parametrize("block_n", [64, 128])
def test_stacked_tma_tile_gives_the_unstacked_tiles_bits(block_n, seed, tmp_path):
    """Stacking changes which rows share an MMA operand, not any row's products or their order: the layer's output
    is the two-accumulator TMA tile's bit for bit (H = 288, I = 160: several K tiles, tails, partial boxes)."""
    args = mxfp4_moe.random_moe_args(torch.device(DEVICE), torch.Generator().manual_seed(seed), tokens=9, hidden=288,
                                     inter=160, experts=3, top_k=2)
    unstacked = KernelConfig.make(num_warps=4, num_stages=3, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, WORKSPACE=0,
                                  SPLIT_K=1, SWAP_AB=1, TMA=1)
    expected = run_triton(args, unstacked, tmp_path).clone()
    assert torch.equal(run_triton(args, stacked(block_n), tmp_path), expected)


_TRITON_KERNELS_SASS = """
import json, os, sys
sys.path.insert(0, os.path.join(os.environ["DZC_ROOT"], "tools"))
import diagnose_mxfp4_moe_kernels as tool

flags, profiles = tool.triton_kernels_static_profiles("gpt-oss-120b", 8)
print("RESULTS " + json.dumps(dict(flags=flags, profiles=profiles)))
"""


def test_triton_kernels_decode_k_step_beside_dzc(tmp_path):
    """triton_kernels' matmul_ogs at gpt-oss-120b T=8 compiled for sm_90 on this host (--sass-triton-kernels; skipped
    without .triton-kernels or Triton's ptxas / nvdisasm): its opt flags pick 16 x 128 x 128 tiles on 4 warps, each
    GEMM's K step is 16 HGMMA.64x16x16 with the weights decoded in registers (no shared-memory store of them) and no
    spill; per packed weight byte it issues under 0.25 instructions, where dzc's untuned tile issues over 1.5x that
    (gate/up) and TMA_STACKED + DECODE=2 at BLOCK_N 128 under 1.25x (docs/mxfp4_moe_kernels.md)."""
    from conftest import run_ahead_of_time_script

    root = Path(__file__).resolve().parents[1]
    if not (root / ".triton-kernels" / "triton_kernels" / "__init__.py").is_file():
        pytest.skip("no .triton-kernels (bash tools/fetch_triton_kernels.sh copies it)")
    if not _sass_toolchain():
        pytest.skip("Triton's ptxas / nvdisasm (its CUDA backend) are not installed")
    result = run_ahead_of_time_script(_TRITON_KERNELS_SASS, tmp_path, DZC_ROOT=str(root))
    assert all("block_m=16, block_n=128, block_k=128, num_warps=4" in f for f in result["flags"]), result["flags"]
    assert sorted(result["profiles"]) == ["down _matmul_ogs", "gate/up _matmul_ogs"]
    (tmp_path / "dzc").mkdir()
    dzc = gpt_oss_gemm_sass(tmp_path / "dzc", default=DECODE_DEFAULT, best=DECODE_DEFAULT.replace(
        "BLOCK_N=64", "BLOCK_N=128").replace("SWAP_AB=1", "SWAP_AB=1,TMA_STACKED=1,DECODE=2"))
    if not SASS_TABLES_TRITON:
        pytest.skip("the counts were read from Triton 3.9's SASS")
    for name, profile in result["profiles"].items():
        loop = profile["loop"]
        assert loop["mma_shapes"] == {"HGMMA.64x16x16.F32.BF16": 16}, name
        assert profile["spill_bytes"] == [0, 0] and "STS" not in loop["counts"], name
        tk_per_byte = loop["instructions"] * 4 / (128 * 64)
        assert tk_per_byte < 0.25, (name, tk_per_byte)
        kernel = "moe_gate_up_kernel" if name.startswith("gate/up") else "moe_down_kernel"
        rows = {"default": 64, "best": 128} if kernel == "moe_down_kernel" else {"default": 128, "best": 256}
        per_byte = {label: dzc[label]["profiles"][kernel]["loop"]["instructions"] * 4 / (rows[label] * 64)
                    for label in rows}
        assert per_byte["default"] > 1.5 * tk_per_byte, (name, per_byte, tk_per_byte)
        if kernel == "moe_gate_up_kernel":
            assert per_byte["best"] < 1.25 * tk_per_byte, (name, per_byte, tk_per_byte)
        else:
            assert per_byte["best"] < 1.4 * tk_per_byte, (name, per_byte, tk_per_byte)
