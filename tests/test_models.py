"""Whole models through dzc.compile: the fusion fires where it should, outputs match eager, and a new sequence
length does not recompile."""

import pytest
import torch

import dzc
from dzc.models import MODELS, build_model

# Per-dtype tolerance on logits: the fused kernel rounds like eager, but its fp32 reduction order differs, and a
# one-ulp bf16 difference in a norm output is amplified by the layers after it.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.25e-1}


# The decoder stacks (token ids in, logits out); the DSA models have their own tests (test_dsa_models.py).
DECODERS = sorted(name for name in MODELS if "decoder" in name)


@pytest.mark.parametrize("name", DECODERS)
def test_reference_model_fuses_and_matches_eager(name, options):
    model, (tokens,) = build_model(name)
    compiled = dzc.compile(model, "cuda", options)
    lengths = (16, 5, 23, 40, 9)
    for seq in lengths:
        tokens = torch.randint(0, 256, (2, seq))
        expected = model(tokens)
        actual = compiled(tokens)
        tol = TOLERANCE[expected.dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    report = compiled.report
    # 2 layers: the residual add before each layer's second norm, and into the next layer's first norm / the
    # final norm; the first norm has no residual add before it.
    assert report.fired() == {"fuse_residual_norm": 4}
    assert [reason for _, reason in report.refusals["fuse_residual_norm"]] == ["no residual add feeds this norm"]
    assert report.compiles == 1 and report.recompiles == 0, f"{len(lengths)} lengths recompiled"
    assert report.graphs[0].dynamic_sizes, "the token dimensions should be symbolic"
    lowered = dict(report.graphs[0].stages)["lowered"]
    assert lowered.count("kernel_id='add_rms_norm.triton.") == 4
    assert "aten.rsqrt" in lowered  # the first norm (no residual) stays with the fallback


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)  # ones would hide a missing weight multiply
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_llama_fuses_and_matches_eager(dtype, options):
    model = _tiny_llama().to(dtype)
    compiled = dzc.compile(model, "cuda", options)
    for seq in (12, 20):
        ids = torch.randint(0, 128, (1, seq))
        expected = model(input_ids=ids).logits
        actual = compiled(input_ids=ids).logits
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    report = compiled.report
    assert report.passes["fuse_residual_norm"] == 4
    assert report.recompiles == 0
    assert all(k.op == "add_rms_norm" and k.codegen == "triton" for k in report.kernels)


def test_inductor_fallback_runs_the_unfused_ops(tmp_path):
    """fallback='inductor' hands the rewritten graph to Inductor (C++ on CPU) with the dzc op kept opaque."""
    model, (tokens,) = build_model("llama_decoder_fp32")
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False, fallback="inductor")
    compiled = dzc.compile(model, "cuda", options)
    torch.testing.assert_close(compiled(tokens), model(tokens), atol=1e-4, rtol=1e-4)
    assert compiled.report.fired() == {"fuse_residual_norm": 4}
    assert compiled.report.graphs[0].fallback == "inductor"
