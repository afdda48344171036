"""dzc.mxfp4: the OCP MX format bit for bit against ml_dtypes (and torch's e8m0), the gpt-oss checkpoint layout read
from safetensors under both namings, the errors on malformed tensors, and experts modules held in MXFP4."""

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dzc import mxfp4
from dzc.models.gpt_oss_hf import build_tiny_gpt_oss
from dzc.models.moe import CONFIGS, MoEBlock, build_moe


def _weights_with_edge_cases(generator) -> torch.Tensor:
    """[24, 64] fp32: blocks of random magnitudes, exact rounding ties, zeros, negative zeros, tiny values."""
    rows = torch.randn(24, 64, generator=generator)
    rows *= torch.exp2(torch.randint(-30, 30, (24, 2, 1), generator=generator).float()).repeat_interleave(32, 1) \
        .reshape(24, 64)
    # Ties of E2M1 rounding at scale 1 (amax 6 -> shared exponent 0): each midpoint and its negation.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 7.99, 0.1, 0.0])
    rows[0, :32] = torch.cat([ties, -ties, ties[:8]])
    rows[1, :32] = 0.0
    rows[1, 32:] = -0.0
    rows[2, :32] = rows[2, :32] * 1e-38  # below 2^-125: the shared exponent clamps at -127
    rows[3, :32] = torch.randn(32, generator=generator) * 1e30  # huge but finite: without the row's random scale
    return rows


def _ml_dtypes_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The spec's quantization with ml_dtypes doing the conversions (independent of dzc.mxfp4's arithmetic)."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    _, exponent = np.frexp(amax)
    shared = np.where(amax > 0, exponent - 1 - 2, -127).clip(-127, 127)
    scale = np.ldexp(1.0, shared)
    scale_bytes = scale.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    elements = np.clip(blocks / scale[..., None], -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return elements, scale_bytes


def _nibbles(blocks: torch.Tensor) -> torch.Tensor:
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)


def test_quantize_matches_ml_dtypes_bit_for_bit(seed):
    w = _weights_with_edge_cases(torch.Generator().manual_seed(seed))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (24, 2, 16) and scales.shape == (24, 2)
    codes, scale_bytes = _ml_dtypes_quantize(w.numpy())
    assert torch.equal(_nibbles(blocks), torch.from_numpy(codes))
    assert torch.equal(scales, torch.from_numpy(scale_bytes))
    # torch's own e8m0 dtype encodes the same scales (2^e is exact, so no rounding mode is involved).
    shared = scales.float() - 127
    assert torch.equal(torch.exp2(shared).to(torch.float8_e8m0fnu).view(torch.uint8), scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_of_half_inputs_matches_their_fp32_value(dtype, seed):
    w = torch.randn(8, 96).to(dtype)
    for got, want in zip(mxfp4.quantize(w), mxfp4.quantize(w.float())):
        assert torch.equal(got, want)


def test_dequantize_matches_ml_dtypes_bit_for_bit(seed):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 255, (3, 5, 4), dtype=torch.uint8, generator=generator)  # 0xFF (NaN) excluded
    scales[0, 0, :3] = torch.tensor([0, 254, 127], dtype=torch.uint8)  # 2^-127 (fp32 subnormal), 2^127, 1
    elements = _nibbles(blocks).numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale_values = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert np.array_equal(scales.view(torch.float8_e8m0fnu).double().numpy(), scale_values)  # torch agrees
    expected = torch.from_numpy(elements * scale_values[..., None]).reshape(3, 5, 128)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), expected.float())  # overflow -> inf alike
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16), expected.float().bfloat16())
    assert torch.equal(torch.ops.dzc.mxfp4_dequantize(blocks, scales, torch.bfloat16),
                       mxfp4.dequantize(blocks, scales, torch.bfloat16))


def test_nan_scale_dequantizes_to_nan():
    blocks = torch.full((1, 1, 16), 0x21, dtype=torch.uint8)
    values = mxfp4.dequantize(blocks, torch.tensor([[0xFF]], dtype=torch.uint8), torch.float32)
    assert values.isnan().all()


def test_round_trip(seed):
    w = torch.randn(16, 128) * 3
    blocks, scales = mxfp4.quantize(w)
    values = mxfp4.dequantize(blocks, scales, torch.float32)
    # Each element is within half a step of the E2M1 grid at its block's scale, or saturated at 6 * scale.
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((w - values).abs() <= torch.maximum(scale, (w.abs() - 6 * scale).clamp(min=0)) + 1e-12).all()
    # Representable weights come back unchanged, bytes included when each block reaches 4 or 6 (a full binade).
    again = mxfp4.quantize(values)
    assert torch.equal(mxfp4.dequantize(*again, torch.float32), values)
    top = (_nibbles(blocks) & 7).amax(-1) >= 6
    assert top.any() and torch.equal(again[1][top], scales[top]) and torch.equal(again[0][top], blocks[top])


def test_quantize_rejects_bad_weights():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        mxfp4.quantize(torch.tensor([[float("nan")] * 32]))
    with pytest.raises(TypeError, match="int32"):
        mxfp4.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not match blocks"):
        mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


def test_dequantize_op_opcheck():
    blocks = torch.randint(0, 256, (2, 4, 2, 16), dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 4, 2), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.dzc.mxfp4_dequantize.default, (blocks, scales, torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss checkpoints

E, H, I = 4, 64, 32


def _layer_tensors(generator):
    gate_up = mxfp4.MXFP4Weight.from_float(torch.randn(E, 2 * I, H, generator=generator))
    down = mxfp4.MXFP4Weight.from_float(torch.randn(E, H, I, generator=generator))
    return gate_up, down, torch.randn(E, 2 * I, generator=generator).bfloat16(), \
        torch.randn(E, H, generator=generator).bfloat16()


def _checkpoint(path, naming: str, layers=2, flat_blocks=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for layer in range(layers):
        gate_up, down, b13, b2 = _layer_tensors(generator)
        expected[layer] = (gate_up, down, b13, b2)

        def blocks(w):
            return w.blocks.flatten(-2) if flat_blocks else w.blocks

        if naming == "original":
            prefix = f"block.{layer}.mlp."
            tensors |= {prefix + "mlp1_weight.blocks": blocks(gate_up), prefix + "mlp1_weight.scales": gate_up.scales,
                        prefix + "mlp2_weight.blocks": blocks(down), prefix + "mlp2_weight.scales": down.scales,
                        prefix + "mlp1_bias": b13, prefix + "mlp2_bias": b2}
        else:
            prefix = f"model.layers.{layer}.mlp.experts."
            tensors |= {prefix + "gate_up_proj_blocks": blocks(gate_up), prefix + "gate_up_proj_scales": gate_up.scales,
                        prefix + "down_proj_blocks": blocks(down), prefix + "down_proj_scales": down.scales,
                        prefix + "gate_up_proj_bias": b13, prefix + "down_proj_bias": b2}
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(H)  # not an expert tensor: ignored
    save_file(tensors, str(path))
    return tensors, expected


@pytest.mark.parametrize("naming,flat", [("original", False), ("hf", False), ("hf", True)])
def test_reads_gpt_oss_layout(tmp_path, naming, flat):
    path = tmp_path / "model.safetensors"
    _, expected = _checkpoint(path, naming, flat_blocks=flat)
    layers = mxfp4.read_gpt_oss_experts(path)
    assert sorted(layers) == [0, 1]
    for layer, (gate_up, down, b13, b2) in expected.items():
        experts = layers[layer]
        assert experts.interleaved
        assert experts.gate_up.shape == (E, 2 * I, H) and experts.down.shape == (E, H, I)
        assert torch.equal(experts.gate_up.blocks, gate_up.blocks) and torch.equal(experts.gate_up.scales,
                                                                                  gate_up.scales)
        assert torch.equal(experts.down.blocks, down.blocks) and torch.equal(experts.down.scales, down.scales)
        assert torch.equal(experts.gate_up_bias, b13) and torch.equal(experts.down_bias, b2)


def _malformed(tmp_path, edit):
    path = tmp_path / "bad.safetensors"
    tensors, _ = _checkpoint(path, "original", layers=1)
    edit(tensors)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"block.0.mlp.mlp1_weight.blocks": t["block.0.mlp.mlp1_weight.blocks"][..., :8].clone()}),
     r"block\.0\.mlp\.mlp1_weight\.blocks: expected MXFP4 blocks \[E, N, K/32, 16\]"),
    (lambda t: t.update({"block.0.mlp.mlp2_weight.blocks": torch.zeros(E, H, 24, dtype=torch.uint8)}),
     r"block\.0\.mlp\.mlp2_weight\.blocks: K = 48 .* not a multiple of 32"),
    (lambda t: t.pop("block.0.mlp.mlp2_weight.scales"),
     r"block\.0\.mlp\.mlp2_weight\.blocks: its scales tensor block\.0\.mlp\.mlp2_weight\.scales is missing"),
    (lambda t: t["block.0.mlp.mlp1_weight.scales"].view(-1)[7:9].fill_(0xFF),
     r"block\.0\.mlp\.mlp1_weight\.scales: 2 NaN scales \(0xFF\), first at index \(0, 3, 1\)"),
    (lambda t: t.update({"block.0.mlp.mlp1_weight.scales": t["block.0.mlp.mlp1_weight.scales"][:, :-1].clone()}),
     r"block\.0\.mlp\.mlp1_weight\.scales: shape \(4, 63, 2\) does not match its blocks"),
    (lambda t: t.update({"block.0.mlp.mlp2_bias": torch.zeros(E, H + 1)}),
     r"block\.0\.mlp\.mlp2_bias: a torch.float32 bias of shape \(4, 65\), expected a floating \[4, 64\]"),
    (lambda t: t.update({"block.0.mlp.mlp2_weight.blocks": t["block.0.mlp.mlp2_weight.blocks"][:, :32].clone(),
                         "block.0.mlp.mlp2_weight.scales": t["block.0.mlp.mlp2_weight.scales"][:, :32].clone(),
                         "block.0.mlp.mlp2_bias": t["block.0.mlp.mlp2_bias"][:, :32].clone()}),
     r"layer 0 experts \(.*block\.0\.mlp\.mlp2_weight\.blocks.*\): down weight \(4, 32, 32\) does not match "
     r"gate_up \(4, 64, 64\)"),
])
def test_malformed_checkpoint_tensors_are_named(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        mxfp4.read_gpt_oss_experts(_malformed(tmp_path, edit))


# ---------------------------------------------------------------------------------------------------------------
# Experts modules in MXFP4

def test_quantize_experts_on_the_reference_moe(seed):
    cfg = CONFIGS["tiny-gptoss"]
    block = build_moe(cfg, torch.float32, weight_format="bf16", seed=seed)
    gate_up, down = block.experts.gate_up_weight.detach().clone(), block.experts.down_weight.detach().clone()
    x = torch.randn(7, cfg.hidden)
    assert mxfp4.quantize_experts(block) == ["experts"]
    names = dict(block.named_parameters()) | dict(block.named_buffers())
    assert "experts.gate_up_weight" not in names and "experts.down_weight" not in names
    assert names["experts.gate_up_blocks"].dtype == torch.uint8
    # The quantized block computes what the float block computes with the dequantized weights.
    twin = build_moe(cfg, torch.float32, weight_format="bf16", seed=seed)
    with torch.no_grad():
        twin.experts.gate_up_weight.copy_(mxfp4.dequantize(*mxfp4.quantize(gate_up), torch.float32))
        twin.experts.down_weight.copy_(mxfp4.dequantize(*mxfp4.quantize(down), torch.float32))
        torch.testing.assert_close(block(x), twin(x), atol=0, rtol=0)


def test_quantize_experts_on_hf_gpt_oss():
    model = build_tiny_gpt_oss(torch.float32, mxfp4_experts=False)
    twin = build_tiny_gpt_oss(torch.float32, mxfp4_experts=False)
    ids = torch.randint(0, 128, (1, 9))
    assert mxfp4.quantize_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    assert "gate_up_proj" not in dict(experts.named_parameters())
    assert experts.gate_up_proj_blocks.shape == (E, 2 * I, H // 32, 16)  # gpt-oss layout: [E, out, in]
    with torch.no_grad():
        for layer, twin_layer in zip(model.model.layers, twin.model.layers):
            # transformers keeps [E, in, out]; the property hands out the dequantized weight in that layout
            assert layer.mlp.experts.gate_up_proj.shape == twin_layer.mlp.experts.gate_up_proj.shape
            twin_layer.mlp.experts.gate_up_proj.copy_(layer.mlp.experts.gate_up_proj)
            twin_layer.mlp.experts.down_proj.copy_(layer.mlp.experts.down_proj)
        # Same values; only the memory layout of the weights differs (a transposed view), hence the GEMM path.
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, atol=1e-6, rtol=1e-5)
    # A cast of the model: the packed buffers stay uint8, the weights dequantize to the new dtype.
    blocks = experts.gate_up_proj_blocks.clone()
    model.to(torch.bfloat16)
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and torch.equal(experts.gate_up_proj_blocks, blocks)
    assert experts.mxfp4_compute_dtype == torch.bfloat16 and experts.down_proj.dtype == torch.bfloat16
    model.float()
    assert experts.gate_up_proj.dtype == torch.float32


def test_load_experts_from_checkpoint_into_modules(tmp_path):
    path = tmp_path / "model.safetensors"
    _, expected = _checkpoint(path, "hf", layers=2)
    layers = mxfp4.read_gpt_oss_experts(path)
    model = build_tiny_gpt_oss(torch.bfloat16, mxfp4_experts=False)
    for index, layer in enumerate(model.model.layers):
        mxfp4.load_experts(layer.mlp.experts, layers[index])
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.down_proj_blocks, expected[1][1].blocks)
    assert torch.equal(experts.gate_up_proj_bias, expected[1][2])
    assert torch.equal(experts.down_proj, mxfp4.dequantize(expected[1][1].blocks, expected[1][1].scales).mT)
    assert model(torch.randint(0, 128, (1, 5))).logits.isfinite().all()

    block = MoEBlock(CONFIGS["tiny-gptoss"], torch.bfloat16)
    mxfp4.load_experts(block.experts, layers[0])
    assert block.experts.weight_format == "mxfp4" and torch.equal(block.experts.gate_up_scales,
                                                                  expected[0][0].scales)
    with pytest.raises(ValueError, match="does not fit"):
        mxfp4.load_experts(MoEBlock(CONFIGS["tiny-deepseek"], torch.bfloat16).experts, layers[0])


# ---------------------------------------------------------------------------------------------------------------
# The op's contract (its kernels are tested against this reference in the kernel family's tests)

def _op_args(tokens=5, k=2):
    block = build_moe(CONFIGS["tiny-gptoss"], torch.bfloat16)
    experts = block.experts
    ids = torch.randint(0, E, (tokens, k))
    return (torch.randn(tokens, H).bfloat16(), ids, torch.rand(tokens, k).bfloat16(), experts.gate_up_blocks,
            experts.gate_up_scales, experts.gate_up_bias, experts.down_blocks, experts.down_scales, experts.down_bias,
            "clamped_swiglu", True, 1.702, 7.0)


def test_mxfp4_moe_op_fake_matches_reference(seed):
    torch.library.opcheck(torch.ops.dzc.mxfp4_moe.default, _op_args(), test_utils=("test_schema", "test_faketensor"))


def test_mxfp4_moe_reference_rejects_bad_arguments(seed):
    from dzc.ops.mxfp4_moe import mxfp4_moe_reference

    args = list(_op_args())
    args[1] = args[1].clone()
    args[1][2, 1] = E  # an expert id out of range
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\): \[4\]"):
        mxfp4_moe_reference(*args)
    args = list(_op_args())
    args[0] = torch.randn(5, H + 32).bfloat16()
    with pytest.raises(ValueError, match="w13 reduces over K = 64 but hidden has H = 96"):
        mxfp4_moe_reference(*args)
    args = list(_op_args())
    args[9] = "gelu_glu"
    with pytest.raises(ValueError, match="activation 'gelu_glu' is not one of"):
        mxfp4_moe_reference(*args)
