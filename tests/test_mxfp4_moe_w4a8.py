"""W4A8 MXFP4 MoE (dzc.mxfp4_moe_w4a8, CompileOptions.moe_fp8_activations): the op's E4M3 rounding against torch's
own float8 casts, the conversion kernels bit for bit against it, the whole layer against the op's reference, the
configs on every profile, the sm_90 compile (FP8 wgmma), and the quantize_moe_activations rewrite with its refusal.

On CPU the Triton kernels run through the interpreter: FP8 dots are exact there, its fp32 -> fp8 casts are not
(which is why the kernels round to E4M3 with fp32 adds and integer arithmetic), and its fp32 -> bf16 casts
truncate. Inputs are fresh seeded random layers; outputs are NaN-poisoned before every launch.
"""

import dataclasses
import textwrap

import pytest
import torch
from conftest import SASS_TABLES_TRITON, gpt_oss_gemm_sass, run_ahead_of_time_script

import dzc
from dzc import mxfp4
from dzc.models.moe import CONFIGS, build_moe
from dzc.ops.mxfp4_moe import (FP8_GROUP, _fp8_matmul, _fp8_weight_matmul, glu_activation, mxfp4_moe_reference,
                               mxfp4_moe_w4a8_reference, mxfp4_to_e4m3, quantize_e4m3_groups)
from dzc.targets import TARGETS, mxfp4_moe, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE
DECODE = KernelConfig.make(4, 2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1)
PREFILL = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1)
# The gate/up GEMM's gate and up rows stacked into one MMA a step (FP8_STACKED), and the same tile without.
STACKED = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1, FP8_STACKED=1)
UNSTACKED = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1)
# W4A8 online (tests/test_mxfp4_moe_w4a8_online.py): the weights converted to E4M3 inside the GEMMs.
ONLINE = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=1, FP8=1)
ONLINE_STACKED = KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=1, FP8=1,
                                   FP8_STACKED=1)


def _w4a8_spec(args) -> mxfp4_moe.MXFP4MoESpec:
    return mxfp4_moe.spec_from_args(*args[:11], fp8_activations=True)


def _kernels(spec, tmp_path):
    path = tmp_path / f"mxfp4_moe_w4a8_{abs(hash(spec))}.py"
    path.write_text(mxfp4_moe.triton_source(spec, SM_90))
    return triton_codegen.load(mxfp4_moe, path, spec, SM_90)


def _random_args(seed: int, **changes):
    shape = dict(tokens=9, hidden=160, inter=96, experts=4, top_k=2) | changes
    return mxfp4_moe.random_moe_args(torch.device(DEVICE), torch.Generator().manual_seed(seed), **shape)


# ---------------------------------------------------------------------------------------------------------
# The op's rounding


def test_activation_groups_take_the_smallest_power_of_two_scale(seed):
    x = torch.randn(6, 300) * torch.exp2(torch.randint(-30, 30, (6, 1)).float())
    x[1] = 0.0
    x[2, :128] = 448.0 * 2.0**-3  # exactly at a scale boundary: 2^-3, values exact
    x[2, 128:256] = 448.0 * 2.0**-3 * (1 + 2**-20)  # just above it: 2^-2
    values, scales = quantize_e4m3_groups(x)
    assert scales.shape == (6, 3)
    assert scales[1].eq(1.0).all() and values[1].eq(0).all()
    assert scales[2, 0] == 2.0**-3 and values[2, :128].eq(448.0).all()
    assert scales[2, 1] == 2.0**-2
    assert torch.equal(values, values.to(torch.float8_e4m3fn).float()), "values must be E4M3 numbers"
    groups = torch.nn.functional.pad(x, (0, 84)).reshape(6, 3, FP8_GROUP).abs().amax(-1)
    live = groups > 0
    # amax <= 448 * scale < 2 * amax: the smallest power of two that fits.
    assert (groups[live] <= 448 * scales[live]).all() and (448 * scales[live] < 2 * groups[live]).all()
    dequantized = values * scales.repeat_interleave(FP8_GROUP, dim=1)[:, :300]
    assert ((dequantized - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * scales.repeat_interleave(FP8_GROUP, 1)[:, :300]
            ).all(), "E4M3 keeps 3 mantissa bits (half a step: 2^-4 relative) above its subnormals"


def test_weights_convert_exactly_where_the_block_spread_allows(seed):
    w = torch.randn(8, 256)
    blocks, scales = mxfp4.quantize(w)
    values, block_scales = mxfp4_to_e4m3(blocks, scales)
    assert block_scales.shape == (8, 2)
    exact = mxfp4.dequantize(blocks, scales, torch.float32)
    spread = scales.int().reshape(8, 2, 4)
    narrow = (spread.amax(-1) - spread.amin(-1) <= 8).repeat_interleave(FP8_GROUP, dim=1)
    assert torch.equal((values * block_scales.repeat_interleave(FP8_GROUP, 1))[narrow], exact[narrow])
    # A group 12 binades below its block's largest keeps only what E4M3's subnormals hold.
    scales[0, 1] = scales[0, 0] - 12
    values, block_scales = mxfp4_to_e4m3(blocks, scales)
    small = mxfp4.dequantize(blocks, scales, torch.float32)[0, 32:64] / block_scales[0, 0]
    assert torch.equal(values[0, 32:64], small.to(torch.float8_e4m3fn).float())
    scales[3, 5] = 0xFF
    _, block_scales = mxfp4_to_e4m3(blocks, scales)
    assert block_scales[3, 1].isnan() and not block_scales[3, 0].isnan() and not block_scales[:3].isnan().any()


def test_w4a8_reference_is_close_to_w4a16_but_not_equal(seed):
    args = _random_args(seed, dtype=torch.float32, tokens=128, experts=2)  # 128 rows per expert: FP8 applies
    w4a16, w4a8 = mxfp4_moe_reference(*args), mxfp4_moe_w4a8_reference(*args)
    scale = w4a16.abs().max()
    assert (w4a8 - w4a16).abs().max() <= 2**-3 * scale, "FP8 activations keep 3 mantissa bits"
    assert (w4a8 - w4a16).abs().max() > 2**-12 * scale, "the reference must quantize the activations"


def test_decode_sizes_are_w4a16(seed, tmp_path):
    """Below 128 rows per expert the op is dzc.mxfp4_moe (its reference and its kernels, whichever config the
    tuner hands the launch): 127 rows per expert in the reference, 9 tokens through an FP8 config."""
    args = _random_args(seed, dtype=torch.float32, tokens=127, experts=2)
    torch.testing.assert_close(mxfp4_moe_w4a8_reference(*args), mxfp4_moe_reference(*args), rtol=0, atol=0)
    args = _random_args(seed)
    spec = _w4a8_spec(args)
    inputs, (out,), _, _ = mxfp4_moe.prepare(spec, *args)
    assert inputs[-1] is False, "9 tokens over 4 experts must not quantize"
    out.fill_(float("nan"))
    mxfp4_moe.triton_launch(_kernels(spec, tmp_path), PREFILL, *inputs, out)
    expected = mxfp4_moe_reference(*args).float()
    scale = expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= 2**-7 * scale  # bf16: two roundings, as W4A16's tests


def test_prefill_untuned_choice_is_the_measured_stacked_64_row_tile():
    """At prefill sizes the W4A8 op's untuned choice is the tile measured fastest (gpt-oss-120b T=8192): 64 x 64
    with gate and up stacked (H200, session 35: 1.15x the 128 x 64 one that was the choice before), converting its
    weights online (H100, session 40: 7528 µs against the same tile's workspace path's 15102); at decode sizes a
    W4A16 online tile."""
    from dzc.targets.launch import legal_configs
    from dzc.targets.profiles import SM_90

    spec = dataclasses.replace(_w4a8_spec(_random_args(0)), hidden=2880, inter=2880, experts=128)
    legal, _ = legal_configs(mxfp4_moe, "triton", spec, SM_90)
    _, prefill = mxfp4_moe.configs_for_bucket(spec, SM_90, mxfp4_moe.token_bucket(8192), legal, legal[0])
    assert prefill == dataclasses.replace(STACKED, params=tuple(
        (name, 0 if name == "WORKSPACE" else value) for name, value in STACKED.params)), prefill
    _, decode = mxfp4_moe.configs_for_bucket(spec, SM_90, mxfp4_moe.token_bucket(8), legal, legal[0])
    assert "FP8" not in dict(decode.params)


# ---------------------------------------------------------------------------------------------------------
# Conversion kernels, bit for bit


@pytest.mark.parametrize("reorder", [False, True], ids=["in-order", "nibble-order"])
def test_quantize_kernel_matches_reference_bits(reorder, seed, tmp_path):
    args = _random_args(seed)
    kernels = _kernels(_w4a8_spec(args), tmp_path)
    rows, k = 7, 160  # a full group and a 32-column tail
    x = (torch.randn(rows, k) * torch.exp2(torch.randint(-20, 20, (rows, 1)).float())).to(DEVICE)
    x[1] = 0.0
    x[2, :] *= 2.0**-125  # amax below fp32's normal range: the scale stays 2^-126
    x[3, 5] = float("nan")
    x[4, 140] = float("inf")
    x[5] = torch.randint(-64, 64, (k,)).float() * 0.25  # many values exactly on E4M3 rounding ties after scaling
    # Row blocks of 4, the second one partial; one row more in every buffer, which the kernel is not given: it
    # must stay as it is.
    x = torch.cat([x, torch.randn(1, k, device=DEVICE)])
    out = torch.full((rows + 1, k), 0x7F, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((rows + 1, 2), -1.0, device=DEVICE)
    kernels["moe_quantize_e4m3_kernel"][(2, 2)](x, out, scales, x.stride(0), rows, K=k, ROWS=4, REORDER=reorder)
    assert (out[rows] == 0x7F).all() and (scales[rows] == -1.0).all(), "a row past the last was written"
    x, out, scales = x[:rows], out[:rows], scales[:rows]
    columns = torch.arange(k)
    order = columns // 32 * 32 + columns % 16 * 2 + columns % 32 // 16 if reorder else columns
    values, expected_scales = quantize_e4m3_groups(x[:, order.to(DEVICE)].cpu())
    finite = ~expected_scales.isnan()
    assert torch.equal(scales.cpu()[finite], expected_scales[finite]), "power-of-two scales differ"
    assert scales.cpu()[~finite].isnan().all() and (~finite).sum() == 2, "a group with NaN or inf gets a NaN scale"
    kernel_values = out.cpu().view(torch.float8_e4m3fn).float()
    good = finite.repeat_interleave(FP8_GROUP, dim=1)[:, :k]
    assert torch.equal(kernel_values[good], values[good]), "E4M3 bytes differ from torch's round-to-nearest-even"


def test_weight_conversion_kernel_matches_reference_bits(seed, tmp_path):
    experts, n, k = 3, 40, 160  # row blocks past N, a 32-column tail group
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, generator=generator)
    # Exponent spreads inside a block wide enough that E4M3's subnormals round, scale bytes 0 and 1, a NaN.
    scales = torch.randint(100, 140, (experts, n, k // 32), dtype=torch.uint8, generator=generator)
    scales[0, 0, :] = torch.tensor([0, 1, 127, 140, 3], dtype=torch.uint8)
    scales[2, 7, 4] = 0xFF
    counts = torch.tensor([5, 0, 2, 0], dtype=torch.int32)  # expert 1 inactive: its slot is never written
    slots = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    ws = torch.full((2, n, k), 0x7F, dtype=torch.uint8)
    ws_scales = torch.full((2, n, 2), -1.0)
    args = _random_args(seed)
    kernels = _kernels(_w4a8_spec(args), tmp_path)
    on = [t.to(DEVICE) for t in (blocks, scales, counts, slots, ws, ws_scales)]
    kernels["mxfp4_to_e4m3_experts_kernel"][(experts, -(-n // 32), 2)](*on, N=n, K=k, BLOCK_N=32)
    ws, ws_scales = on[4].cpu(), on[5].cpu()
    columns = torch.arange(k)
    nibble_order = columns // 32 * 32 + columns % 16 * 2 + columns % 32 // 16  # position -> column
    for expert, slot in ((0, 0), (2, 1)):
        values, block_scales = mxfp4_to_e4m3(blocks[expert], scales[expert])
        assert torch.equal(ws[slot].view(torch.float8_e4m3fn).float(), values[:, nibble_order]), expert
        torch.testing.assert_close(ws_scales[slot], block_scales, atol=0, rtol=0, equal_nan=True, msg=str(expert))
    assert ws_scales[1, 7, 1].isnan()


# ---------------------------------------------------------------------------------------------------------
# The whole layer


# Prefill sizes (at least 128 rows per expert: FP8 applies), one with a dominant expert.
W4A8_CASES = [("float32", dict(dtype=torch.float32, tokens=128, experts=2), DECODE),
              ("float32-T200-skewed", dict(dtype=torch.float32, tokens=200, experts=3, skew=3.0), PREFILL),
              ("bfloat16-silu-nobias", dict(tokens=128, experts=2, activation="silu_glu", interleaved=False,
                                            bias=False), PREFILL),
              ("float32-T200-skewed-stacked", dict(dtype=torch.float32, tokens=200, experts=3, skew=3.0), STACKED),
              ("float32-T200-skewed-online", dict(dtype=torch.float32, tokens=200, experts=3, skew=3.0), ONLINE),
              ("bfloat16-silu-nobias-online-stacked", dict(tokens=128, experts=2, activation="silu_glu",
                                                           interleaved=False, bias=False), ONLINE_STACKED)]


class _FirstArguments:
    """One kernel of a loaded module, launched as usual, recording each launch's first argument (the W4A8 launch
    quantizes x, then the activation: the second launch's argument is the kernel's act)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(args[0])
            return self.kernel[grid](*args, **kwargs)
        return launch


def _routed_reference(args, sorted_pairs, act=None):
    """The reference layer split at its activation, for the pairs in routing order: (act [P, I] fp32 rounded to
    hidden's dtype, pair outputs [P, H] of the down GEMM on `act` (the reference's own when None), and the same
    down GEMM over absolute values (the scale of its rounding: FP8 tensor cores sum with fewer bits than fp32)."""
    hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias = args[:9]
    activation, interleaved, alpha, limit = args[9:13]
    pairs = sorted_pairs.long().cpu()
    experts = topk_ids.reshape(-1).long().cpu()[pairs]
    weights = topk_weights.reshape(-1).float().cpu()[pairs]
    x = hidden.float().cpu()[pairs // topk_ids.shape[1]]
    own_act = act is None
    act = torch.empty(len(pairs), w13_scales.shape[1] // 2) if own_act else act
    out, magnitude = torch.empty(len(pairs), x.shape[1]), torch.empty(len(pairs), x.shape[1])
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().squeeze(1)
        if own_act:
            gate_up = _fp8_weight_matmul(x[rows], w13_blocks[e].cpu(), w13_scales[e].cpu())
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].float().cpu()
            act[rows] = glu_activation(gate_up, activation, interleaved, alpha, limit).to(hidden.dtype).float()
        a_values, a_scales = quantize_e4m3_groups(act[rows])
        w_values, w_scales = mxfp4_to_e4m3(w2_blocks[e].cpu(), w2_scales[e].cpu())
        y = _fp8_matmul(a_values, a_scales, w_values, w_scales)
        if w2_bias is not None:
            y = y + w2_bias[e].float().cpu()
        out[rows] = y * weights[rows, None]
        magnitude[rows] = _fp8_matmul(a_values.abs(), a_scales, w_values.abs(), w_scales) * weights[rows, None].abs()
    return act, out, magnitude


@pytest.mark.parametrize("name, changes, config", W4A8_CASES, ids=[c[0] for c in W4A8_CASES])
def test_w4a8_layer_matches_reference(name, changes, config, seed, tmp_path):
    """Each GEMM judged on its own, from the kernels' own activation (recorded at its quantization):
    - gate/up: the kernels' act against the reference's, within a rounding of act's dtype plus the GEMM's
      summation (fp32 order on a CPU; FP8 tensor cores sum each 128-column step with fewer bits, 2026-12-01 on
      the H200: 6e-5 of the act's scale);
    - down: the layer's output against the reference's down GEMM and combine fed the kernels' act, within 2^-8
      of the sum of the absolute products plus one rounding of the output: Hopper's FP8 tensor cores keep about
      14 bits while they sum (DeepSeek-V3's report), and one output of 5920 missed a 2^-12 bound by 4x on the
      H200 (2026-12-01). A wrong operand, scale or column moves outputs by the whole magnitude. An act
      one ulp from the reference's may quantize to the neighbouring E4M3 value: judged against the reference's
      act, that moves outputs by a few E4M3 steps of a product, which no fixed tolerance tells from a wrong
      kernel (the first GPU run failed a 2^-14 bound that way).
    The operands are the reference's bit for bit (tests above); the checks must tell W4A8 from W4A16."""
    args = _random_args(seed, **changes)
    spec = _w4a8_spec(args)
    kernels = dict(_kernels(spec, tmp_path))
    recorder = kernels["moe_quantize_e4m3_kernel"] = _FirstArguments(kernels["moe_quantize_e4m3_kernel"])
    inputs, (out,), _, result = mxfp4_moe.prepare(spec, *args)
    out.fill_(float("nan"))
    mxfp4_moe.triton_launch(kernels, config, *inputs, out)
    assert not out.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    columns = torch.arange(spec.inter)
    act = recorder.seen[1].float().cpu()[:, columns // 32 * 32 + columns % 2 * 16 + columns % 32 // 2]
    sorted_pairs = mxfp4_moe.route(args[1].reshape(-1), spec.experts, config["BLOCK_M"]).sorted_pairs
    expected_act, _, _ = _routed_reference(args, sorted_pairs)
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[spec.hidden_dtype]
    act_error = (act - expected_act).abs().max().item()
    act_limit = ulp * expected_act.abs().max().item() + 2**-12 * expected_act.abs().max().item()
    assert act_error <= act_limit, f"gate/up: act {act_error:.3g} from the reference's (limit {act_limit:.3g})"

    _, pair_out, magnitude = _routed_reference(args, sorted_pairs, act)
    top_k = args[1].shape[1]
    order = torch.argsort(sorted_pairs.long().cpu())  # pair outputs back in pair order, then summed per token
    expected = pair_out[order].reshape(-1, top_k, spec.hidden).sum(1)
    bound = 2**-8 * magnitude[order].reshape(-1, top_k, spec.hidden).sum(1) + ulp * expected.abs() + 1e-30
    error = (out.float().cpu() - expected).abs()
    assert (error <= bound).all(), f"down: {error.max().item():.3g} past its bound at {(error > bound).sum()} outputs"
    w4a16 = mxfp4_moe_reference(*args).float().cpu()
    assert ((w4a16 - expected).abs() > bound).any(), "the check must tell W4A8 from W4A16"


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_stacked_gate_up_gives_the_unstacked_tiles_bits(interleaved, seed, tmp_path):
    """FP8_STACKED multiplies gate and up rows in one MMA and scales the product in the same order: the layer's
    output is the unstacked tile's bit for bit (FP8 dots are exact in the interpreter), with I = 96 leaving the
    second column block's stacked rows half masked and H = 160 a partial last scale group (the scales loaded a
    step ahead read past K there: masked). A NaN activation group reaches the same outputs through both."""
    args = list(_random_args(seed, tokens=128, experts=2, interleaved=interleaved))
    args[0] = args[0].clone()
    args[0][3, 140] = float("nan")  # token 3's second scale group of x: NaN scale
    spec = _w4a8_spec(args)
    kernels = _kernels(spec, tmp_path)
    outs = []
    for config in (STACKED, UNSTACKED):
        inputs, (out,), _, _ = mxfp4_moe.prepare(spec, *args)
        out.fill_(float("nan") if config is UNSTACKED else 7.0)  # poisoned, differently for each
        mxfp4_moe.triton_launch(kernels, config, *inputs, out)
        outs.append(out.clone())
    assert outs[0][3].isnan().all() and not outs[0][torch.arange(128) != 3].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0, equal_nan=True)
    assert "gate and up as one MMA" in mxfp4_moe.describe_config(STACKED)


# ---------------------------------------------------------------------------------------------------------
# Configs and the sm_90 compile


def test_fp8_configs_only_where_e4m3_is_native():
    spec = dataclasses.replace(mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32,
                                                      torch.bfloat16, torch.bfloat16, "clamped_swiglu", True),
                               fp8_activations=True)
    for name, target in TARGETS.items():
        legal, illegal = legal_configs(mxfp4_moe, "triton", spec, target.profile)
        if target.profile.supports_dtype(torch.float8_e4m3fn):
            fp8 = [c for c in legal if dict(c.params).get("FP8", 0)]
            assert fp8 and all(c["BLOCK_K"] == FP8_GROUP for c in fp8), name
            # Decode sizes (gpt-oss-120b: 1 and 64 tokens are under 128 rows per expert) run W4A16 online,
            # prefill (8192 tokens: 256 rows per expert) W4A8 only.
            for bucket, path, flag in ((1, "online", 0), (64, "online", 0), (8192, "W4A8", 1)):
                tier, default = mxfp4_moe.configs_for_bucket(spec, target.profile, bucket, legal, legal[0])
                assert default in tier and mxfp4_moe.describe_config(default).startswith(path), (name, bucket)
                # The stacked gate/up at prefill (measured 1.15x, session 35): the untuned choice there only
                assert dict(default.params).get("FP8_STACKED", 0) == flag, (name, bucket)
                assert all(dict(c.params).get("FP8", 0) == flag for c in tier), (name, bucket)
        else:
            assert not legal and illegal, f"{name} has no native E4M3 and must get no W4A8 config"
        assert not legal_configs(mxfp4_moe, "tilelang", spec, target.profile)[0], "W4A8 is Triton-only"


_AOT_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import dzc
    from dzc.targets import mxfp4_moe as family, triton_codegen
    from dzc.targets.kernel_config import KernelConfig
    from dzc.targets.profiles import SM_90

    spec = family.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
                               "clamped_swiglu", True, fp8_activations=True)
    path = Path(sys.argv[1]) / "w4a8.py"
    path.write_text(family.triton_source(spec, SM_90))
    kernels = triton_codegen.load(family, path, spec, SM_90)
    jobs = [(config, name, signature, constexprs, own_warps)
            for config in (KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1, FP8=1),
                           KernelConfig.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, WORKSPACE=1, SPLIT_K=1,
                                             FP8=1))
            for name, (signature, constexprs, *own_warps) in family.triton_signatures(spec, config).items()]

    def compile_job(index):
        config, name, signature, constexprs, own_warps = jobs[index]
        names = list(signature)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
        fn = getattr(kernels[name], "fn", kernels[name])
        kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": own_warps[0] if own_warps else config.num_warps,
                                         "num_stages": config.num_stages})
        ptx = kernel.asm["ptx"]
        return dict(label=f"{config}/{name}", shared=kernel.metadata.shared,
                    estimate=family.triton_shared_memory_bytes(spec, config),
                    fp8_wgmma=bool(re.search(r"wgmma[.a-z_]*[.]m64n[0-9]+k32[.]f32[.]e4m3[.]e4m3", ptx)),
                    rounding_adds="sub.f32" in ptx, lookups="prmt.b32" in ptx)

    # Compiled by two processes forked from this one (the kernels live in its memory): the CI machine's two cores.
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(compile_job, range(len(jobs)), chunksize=1)
    print("RESULTS " + json.dumps(results))
""")


def test_w4a8_kernels_compile_for_sm_90_with_fp8_wgmma(tmp_path):
    results = run_ahead_of_time_script(_AOT_SCRIPT, tmp_path)
    assert len(results) == 8, [r["label"] for r in results]
    for r in results:
        if r["label"].endswith(("gate_up_kernel", "down_kernel")):
            assert r["fp8_wgmma"], f"{r['label']}: the GEMM does not multiply E4M3 on the tensor cores"
            assert r["shared"] <= r["estimate"], r
        elif r["label"].endswith("mxfp4_to_e4m3_experts_kernel"):  # the online GEMMs' byte-permute lookup, no
            assert r["lookups"] and not r["rounding_adds"], r         # value rounded one at a time
        else:  # the E4M3 rounding's add-and-subtract survived compilation (nothing reassociated it away)
            assert r["rounding_adds"], r


# The W4A8 tile tuned at gpt-oss-120b T=8192 on the H200 (session 25).
W4A8_PREFILL_PICK = "BLOCK_M=64,BLOCK_N=64,BLOCK_K=128,WORKSPACE=1,SPLIT_K=1,FP8=1,num_warps=4,num_stages=3"


@pytest.fixture(scope="module")
def w4a8_prefill_pick_sass(tmp_path_factory):
    """stacked -> (gpt_oss_gemm_sass's profiles of the pick, with FP8_STACKED where `stacked`; its shared-memory
    estimate): both tiles compiled in one process (one each per test before, ~5 s of start-up)."""
    results = gpt_oss_gemm_sass(tmp_path_factory.mktemp("w4a8_sass"), plain=W4A8_PREFILL_PICK,
                                stacked=W4A8_PREFILL_PICK.replace("FP8=1", "FP8=1,FP8_STACKED=1"))
    return {stacked: (results[label]["profiles"], results[label]["shared_estimate"])
            for stacked, label in ((False, "plain"), (True, "stacked"))}


def test_w4a8_prefill_tile_k_loops_read_statically(w4a8_prefill_pick_sass):
    """The W4A8 tile tuned at gpt-oss-120b T=8192 on the H200 (64 x 64, 4 warps, 3 stages), compiled for sm_90 and read
    by `tools/diagnose_mxfp4_moe_kernels.py --sass` (docs/mxfp4_moe_kernels.md, static diagnosis): each K loop is
    found, multiplies E4M3 by wgmma, does not touch local memory and uses at most the shared memory the family
    estimates. Each step waits for its own wgmma before scaling the product (the per-128-column promotion): waits
    of depth 0, one per dot (gate and up, then down); a change that keeps MMAs in flight across that step changes
    this test on purpose. Shapes, spills and waits are checked with Triton 3.9+ (the doc's table); older ones may
    differ."""
    profiles, estimate = w4a8_prefill_pick_sass[False]
    waits = {"moe_gate_up_kernel": [0, 0], "moe_down_kernel": [0]}
    for name, profile in profiles.items():
        loop = profile["loop"]
        assert loop, f"{name}: no K loop found in the SASS"
        shapes = loop["mma_shapes"]
        assert shapes and all(s.startswith("QGMMA.") and s.endswith(".E4M3.E4M3") for s in shapes), (name, shapes)
        assert profile["shared"] <= estimate, (name, profile["shared"], estimate)
        if SASS_TABLES_TRITON:
            assert set(loop["mma_shapes"]) == {"QGMMA.64x64x32.F32.E4M3.E4M3"}, (name, loop["mma_shapes"])
            assert loop["spill_accesses_in_loop"] == 0 and profile["spill_bytes"] == [0, 0], (name, profile)
            assert loop["waits"] == waits[name], (name, loop["waits"])


def test_w4a8_stacked_gate_up_waits_once_a_step_statically(w4a8_prefill_pick_sass):
    """The same tile with FP8_STACKED (gpt-oss-120b, 64 x 64, 4 warps, 3 stages), read the same way: its gate/up K
    step issues one wgmma group (gate and up rows as one 64 x 128 MMA) and waits for it once, where the unstacked
    step waits twice (test above); its scale loads, a step ahead, go through the pipeliner's asynchronous copies
    (a few plain global loads a step are left, not the unstacked step's 34), and nothing spills. Each wait still
    leaves no wgmma in flight: Triton issues a dot whose product is used in its own step synchronously (keeping
    the product a step longer, to scale it after the next step's MMAs, made it no less synchronous and stopped the
    loads' pipelining: docs/mxfp4_moe_kernels.md). Checked with Triton 3.9+."""
    profiles, estimate = w4a8_prefill_pick_sass[True]
    profile = profiles["moe_gate_up_kernel"]
    loop = profile["loop"]
    assert loop and all(s.startswith("QGMMA.") for s in loop["mma_shapes"]), profile
    assert profile["shared"] <= estimate, (profile["shared"], estimate)
    if SASS_TABLES_TRITON:
        assert loop["mma_shapes"] == {"QGMMA.64x128x32.F32.E4M3.E4M3": 4}, loop["mma_shapes"]
        assert loop["waits"] == [0], loop["waits"]
        assert loop["counts"].get("LDG", 0) <= 4 and loop["counts"].get("LDGSTS", 0) >= 8, loop["counts"]
        assert loop["spill_accesses_in_loop"] == 0 and profile["spill_bytes"] == [0, 0], profile
        assert loop["instructions"] < 300, loop["instructions"]  # 390 unstacked (docs/mxfp4_moe_kernels.md)


# ---------------------------------------------------------------------------------------------------------
# The rewrite, through dzc.compile


def _model():
    torch._dynamo.reset()  # other tests compiled the reference MoE's forward: start from no cached graphs
    return build_moe(dataclasses.replace(CONFIGS["tiny-deepseek"], experts=4, top_k=2, shared_expert=False,
                                         expert_loop="gathered_bmm"), torch.bfloat16, "mxfp4").to(DEVICE)


def test_option_rewrites_the_fused_layer_into_w4a8(tmp_path, seed):
    model = _model()
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False, moe_fp8_activations=True)
    compiled = dzc.compile(model, "cuda", options)
    x = torch.randn(5, 64, device=DEVICE).bfloat16()
    out = compiled(x)
    assert compiled.report.fired() == {"fuse_mxfp4_experts": 1, "quantize_moe_activations": 1}
    stages = dict(compiled.report.graphs[0].stages)
    before, after = stages["fuse_mxfp4_experts"], stages["quantize_moe_activations"]
    assert after == before.replace("# built by fuse_mxfp4_experts", "# built by quantize_moe_activations").replace(
        "dzc.mxfp4_moe.default(", "dzc.mxfp4_moe_w4a8.default("), "only the op changes"
    assert "dzc.mxfp4_moe_w4a8.default(" in after and "dzc.mxfp4_moe.default(" not in after
    expected = model(x).float()
    assert (out.float() - expected).abs().max() <= 2**-3 * expected.abs().max(), "W4A8 strays from the layer"
    # 256 tokens over 4 experts, top-2: 128 rows per expert, a prefill size (W4A8); 5 tokens decode (W4A16 online).
    prefill = torch.randn(256, 64, device=DEVICE).bfloat16()
    expected = model(prefill).float()
    assert (compiled(prefill).float() - expected).abs().max() <= 2**-3 * expected.abs().max()
    [kernel] = compiled.report.kernels
    assert kernel.op == "mxfp4_moe_w4a8" and kernel.codegen == "triton"
    paths = {bucket: entry["path"] for bucket, entry in kernel.tuned.items()}
    assert len(paths) == 2 and sorted(p.split()[0] for p in paths.values()) == ["W4A8", "online"], paths
    # Off by default: the same model keeps the W4A16 op.
    default = dzc.compile(model, "cuda", dataclasses.replace(options, moe_fp8_activations=False))
    default(x)
    assert default.report.fired() == {"fuse_mxfp4_experts": 1}
    assert [k.op for k in default.report.kernels] == ["mxfp4_moe"]


def test_refuses_on_profiles_without_fp8(tmp_path, seed):
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False, moe_fp8_activations=True)
    compiled = dzc.compile(_model(), "cuda:sm_80", options)
    compiled(torch.randn(3, 64, device=DEVICE).bfloat16())
    assert compiled.report.fired() == {"fuse_mxfp4_experts": 1}
    [(where, reason)] = compiled.report.refusals["quantize_moe_activations"]
    assert "sm_80 has no native FP8" in reason
    assert [k.op for k in compiled.report.kernels] == ["mxfp4_moe"]


_ROUNDING_PROBE = '''

@triton.jit
def rounding_probe(bits_ptr, out_ptr, N: tl.constexpr):
    bits = tl.load(bits_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), _rounded(bits.to(tl.float32, bitcast=True), out_ptr.dtype.element_ty))
'''


def test_activation_rounding_keeps_every_nan_payload_a_nan(seed, tmp_path):
    """The activations' bf16 rounding (integer arithmetic) on fp32 NaNs of any payload: the GPU computes NaN as
    0x7FFFFFFF, which the rounding's carry turned into -0.0 (a NaN weight scale vanished from the layer's output
    on the H200, found by tools/fuzz.py). Finite values and infinities: torch's round-to-nearest-even, bit for bit."""
    spec = _w4a8_spec(_random_args(seed))
    path = tmp_path / "rounding_probe.py"
    path.write_text(mxfp4_moe.triton_source(spec, SM_90) + _ROUNDING_PROBE)
    probe = triton_codegen.load_kernel(path, "rounding_probe")
    specials = [0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, -0x3FFFFF, 0x7F800000, -0x800000, 0x7F7FFFFF, 0x00010000]
    finite = torch.randn(64 - len(specials)) * torch.exp2(torch.randint(-60, 60, (64 - len(specials),)).float())
    bits = torch.cat([torch.tensor(specials, dtype=torch.int32), finite.view(torch.int32)]).to(DEVICE)
    out = torch.full((64,), 1.0, dtype=torch.bfloat16, device=DEVICE)
    probe[(1,)](bits, out, N=64)
    values = bits.view(torch.float32)
    assert torch.equal(out.isnan(), values.isnan()), out[:len(specials)]
    expected = values.bfloat16()
    assert torch.equal(out[~values.isnan()].view(torch.int16), expected[~values.isnan()].view(torch.int16))
