"""Whole models through dzc.compile: the fusion fires where it should, outputs match eager, and a new sequence
length does not recompile."""

import dataclasses

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager

import dzc
from dzc.models import MODELS, build_model
from dzc.models.decoder import AddRMSNorm

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
    # canonicalize_graph merges the DeepSeek decoder's two upcasts of the embeddings (its first norm's and its
    # first residual add's).
    canonical = {"canonicalize_graph": 1} if name == "deepseek_decoder" else {}
    assert report.fired() == {**canonical, "fuse_residual_norm": 4}
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


@pytest.mark.skipif(not dzc.api._OWN_RECOMPILE_BUDGET, reason="this torch.compile has no isolate_recompiles")
def test_one_compile_per_layer_never_runs_eagerly(options, seed):
    """A serving stack that compiles each decoder layer on its own: more dzc.compile calls of one forward than
    Dynamo's recompile limit allows entries in a shared cache (each new backend fails the backend guard) still
    all get dzc's graph, because each compile keeps its own cache."""
    torch._dynamo.reset()
    layers = [AddRMSNorm(64).bfloat16() for _ in range(torch._dynamo.config.recompile_limit + 2)]
    for layer in layers:
        with torch.no_grad():
            layer.norm.weight.normal_(1.0, 0.1)
        compiled = dzc.compile(layer, "cuda", options)
        x, residual = torch.randn(7, 64).bfloat16(), torch.randn(7, 64).bfloat16()
        y, h = compiled(x, residual)
        assert compiled.report.fired() == {"fuse_residual_norm": 1} and not compiled.report.eager_runs
        assert_add_rms_norm_matches_eager(layer, x, residual, y, h)


def test_a_reached_recompile_limit_is_reported_and_warned(options, seed):
    """Past Dynamo's recompile limit a call runs eagerly, which Dynamo only logs: the report records it, with the
    limit's name, and dzc.compile warns, so a benchmark or server does not silently run without dzc."""
    torch._dynamo.reset()
    model = AddRMSNorm(64).bfloat16()
    static = dataclasses.replace(options, dynamic_tokens=False)  # each token count is a new graph
    compiled = dzc.compile(model, "cuda", static)
    other = dzc.compile(AddRMSNorm(64).bfloat16(), "cuda", options)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16())
        x, residual = torch.randn(6, 64).bfloat16(), torch.randn(6, 64).bfloat16()
        with pytest.warns(RuntimeWarning, match=r"torch\._dynamo\.config\.recompile_limit \(1\).*eagerly"):
            y, h = compiled(x, residual)
    expected_y, expected_h = model(x, residual)
    assert torch.equal(y, expected_y) and torch.equal(h, expected_h)  # the eager model itself ran
    report = compiled.report
    assert report.compiles == 1 and len(report.eager_runs) == 1
    assert "NOT COMPILED: Dynamo reached torch._dynamo.config.recompile_limit" in str(report)
    assert report.to_json()["eager_runs"] == report.eager_runs
    # A model compiled before the limit was reached and first called after it does not take the other one's
    # eager run for its own (Dynamo counts per process).
    other(x, residual)
    assert other.report.fired() == {"fuse_residual_norm": 1} and not other.report.eager_runs
