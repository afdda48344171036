"""dzc.compile selects dzc's attention implementation on transformers models (dzc/hf_attention.py): a vision
tower compiled unchanged runs its packed attention as dzc.varlen_attention, text models compute what their own
implementation does, the user's setting comes back when CompileOptions.hf_attention asks, and packed calls the op
does not express run the base implementation per segment or are refused, never guessed."""

import copy
import gc
import os
from dataclasses import replace

import pytest
import torch
from test_vision_models import _tiny_qwen2_5_vl_vision_tower
from torch.utils._python_dispatch import TorchDispatchMode

import dzc
from dzc import hf_attention

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _vision_tower():
    return _tiny_qwen2_5_vl_vision_tower(attn_implementation=None)  # transformers' default implementation


def _text_model(config_class="LlamaConfig", model_class="LlamaForCausalLM", **extra):
    config = getattr(transformers, config_class)(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def test_vision_tower_compiled_unchanged_runs_varlen_attention(options):
    eager = _vision_tower()
    assert eager.config._attn_implementation == "sdpa"
    model = copy.deepcopy(eager)
    compiled = dzc.compile(model, "cuda", options)  # no helper, no precomputed inputs: as a user would
    assert model.config._attn_implementation == hf_attention.NAMES["sdpa"]
    for seed, grids in enumerate(([[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [1, 2, 2], [1, 4, 4]])):
        grid_thw = torch.tensor(grids)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 2,
                             generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected = eager(pixels, grid_thw)
        actual = compiled(pixels, grid_thw)
        torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    report = compiled.report
    # The op came from dzc's attention function (HF's packed call), not from a graph pattern over a split loop.
    sites = report.pass_sites["fuse_vision_attention"]
    assert sites and all("varlen_attention_forward" in site for site in sites), sites
    assert "varlen_attention" in {k.op for k in report.kernels}
    lowered = "\n".join(dict(g.stages).get("lowered", "") for g in report.graphs)
    assert lowered.count("dzc.varlen_attention") >= 2  # both blocks: window and full attention


@pytest.mark.parametrize("mode", ["compiled", "calls"])
def test_text_model_matches_eager_and_user_setting_comes_back(mode, options, seed):
    eager = _text_model()
    model = copy.deepcopy(eager)
    compiled = dzc.compile(model, "cuda", replace(options, hf_attention=mode))
    assert [c for c, _ in compiled.hf_attention.configs] == [model.config]
    ids = torch.randint(3, 96, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the mask path, not only is_causal
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask).logits
    actual = compiled(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert compiled.report.compiles >= 1 and not compiled.report.eager_runs
    if mode == "calls":  # dzc's during the call only: the model called directly runs the user's setting
        assert model.config._attn_implementation == "sdpa"
        actual = compiled(input_ids=ids, attention_mask=mask).logits  # the guards still hold: no recompile
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        assert compiled.report.recompiles == 0
    else:  # dzc's while the compiled model lives, the user's again once it is gone
        assert model.config._attn_implementation == hf_attention.NAMES["sdpa"]
        del compiled
        gc.collect()
        assert model.config._attn_implementation == "sdpa"


def test_off_and_user_choices_are_left_alone(options):
    model = _text_model()
    compiled = dzc.compile(model, "cuda", replace(options, hf_attention="off"))
    assert compiled.hf_attention is None and model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "flex_attention"
    compiled = dzc.compile(model, "cuda", options)
    assert not compiled.hf_attention.configs and "flex_attention" in compiled.hf_attention.left[0]
    assert model.config._attn_implementation == "flex_attention"
    with pytest.raises(ValueError, match="hf_attention"):
        dzc.CompileOptions(hf_attention="always")


def test_sliding_window_text_model_falls_back_and_matches(options, seed):
    """Mistral with a window shorter than the sequence: the window lives in the base's mask (sdpa ignores the
    sliding_window argument), so dzc's implementation hands the call to sdpa with that mask."""
    eager = _text_model("MistralConfig", "MistralForCausalLM", sliding_window=4)
    model = copy.deepcopy(eager)
    compiled = dzc.compile(model, "cuda", options)
    ids = torch.randint(3, 96, (1, 11))
    with torch.no_grad():
        expected = eager(input_ids=ids).logits
        no_window = _text_model("MistralConfig", "MistralForCausalLM", sliding_window=None)(input_ids=ids).logits
    assert (no_window - expected).abs().max() > 1e-3, "the window must change the answer for this test to mean it"
    torch.testing.assert_close(compiled(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


class _OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


class _Attention(torch.nn.Module):
    is_causal = False
    num_key_value_groups = 1


def _segments_reference(query, key, value, cu_seqlens, scaling, is_causal=False):
    bounds = cu_seqlens.tolist()
    pieces = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scale=scaling, is_causal=is_causal)
        for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_calls_op_per_segment_or_refusal(dtype, seed):
    """The registered function itself (eager: the op runs its reference): plain packed calls are the op, a causal
    packed call is sdpa per segment, a packed call with a window has no per-segment form and is refused."""
    hf_attention.register()
    function = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[hf_attention.NAMES["sdpa"]]
    query, key, value = (torch.randn(1, 2, 11, 8, dtype=dtype) for _ in range(3))
    cu_seqlens = torch.tensor([0, 3, 9, 11], dtype=torch.int32)
    packed = dict(scaling=0.3, dropout=0.0, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                  max_length_q=6, max_length_k=6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with _OpsSeen() as seen:
        out, _ = function(_Attention(), query, key, value, None, is_causal=False, **packed)
    assert "dzc.varlen_attention.default" in seen.ops, "the plain packed call must be dzc.varlen_attention"
    torch.testing.assert_close(out, _segments_reference(query, key, value, cu_seqlens, 0.3), **tol)

    out, _ = function(_Attention(), query, key, value, None, is_causal=True, **packed)
    torch.testing.assert_close(out, _segments_reference(query, key, value, cu_seqlens, 0.3, is_causal=True), **tol)
    assert hf_attention.varlen_refusal(query, key, value, None, {**packed, "is_causal": True}) == "causal attention"

    with pytest.raises(ValueError, match="sliding_window"):
        function(_Attention(), query, key, value, None, sliding_window=4, **packed)


def test_a_model_that_branches_on_the_implementation_name_is_left_alone(options):
    """HF DeepseekV32 applies its top-k mask only when `_attn_implementation in ("eager", "sdpa")`; under
    another name it hands the indices to the attention function instead, which would compute dense attention.
    dzc leaves such a config alone (saying where the code compares the name), and its sparse fusion fires."""
    from dzc.models.dsa import build_hf_deepseek_v32

    model, (tokens,) = build_hf_deepseek_v32(attn_implementation="eager")
    compiled = dzc.compile(model, "cuda", options)
    with torch.no_grad():
        actual, expected = compiled(tokens).logits, model(tokens).logits
    assert model.config._attn_implementation == "eager"
    assert not compiled.hf_attention.configs
    [left] = compiled.hf_attention.left
    assert "DeepseekV32Config" in left and "modeling_deepseek_v32" in left, left
    assert compiled.report.passes["fuse_sparse_attention"] == 1
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["compiled", "calls"])
def test_a_packed_call_dzc_cannot_compute_gives_the_model_its_own_attention_back(mode, options, seed):
    """A model whose packed call carries a sliding window (no per-segment or varlen form): the call is not an
    error; dzc puts the model's own implementation back, calls again, matches the model uncompiled, and says so."""
    from hf_packed_window import build

    eager = build(seed)
    model = copy.deepcopy(eager)
    compiled = dzc.compile(model, "cuda", replace(options, hf_attention=mode))
    if mode == "compiled":
        assert model.config._attn_implementation == hf_attention.NAMES["sdpa"]
    hidden = torch.randn(11, 16, generator=torch.Generator().manual_seed(seed))
    cu_seqlens = torch.tensor([0, 3, 9, 11], dtype=torch.int32)
    with torch.no_grad():
        expected = eager(hidden, cu_seqlens)
    with pytest.warns(RuntimeWarning, match="attention implementation was put back"):
        actual = compiled(hidden, cu_seqlens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert "sliding_window" in compiled.report.attention_given_back
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(compiled(hidden, cu_seqlens), expected, atol=1e-5, rtol=1e-5)  # no second refusal
    assert "attention given back" in str(compiled.report)
