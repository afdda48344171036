"""Vision encoders through dzc.compile: the reference encoders (models/vision.py) and transformers' Qwen2.5-VL
vision tower. Packed attention becomes dzc.varlen_attention, residual + norm (RMSNorm and LayerNorm) fuse,
outputs match eager, and requests with other image counts and sizes reuse the one graph."""

import copy
from dataclasses import replace

import pytest
import torch

import dzc
from dzc.models.vision import TINY_MOONVIT, TINY_QWEN_VISION, build_vision_encoder, pack_images

# Packs of (rows, columns) patches: other image counts (1 to 3) and sizes, one image alone (with two 4x4-patch
# windows). Small: the norm kernels run one program per token through Triton's interpreter.
PACKS = ([(2, 2), (2, 4)], [(2, 4), (2, 2), (4, 2)], [(4, 8)])


def _check_packs(model, compiled, cfg, packs, tol=1e-4):
    for grids in packs:
        pack = pack_images(grids, cfg, generator=torch.Generator().manual_seed(len(grids)))
        expected = model(*pack.inputs())
        torch.testing.assert_close(compiled(*pack.inputs()), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("cfg", [TINY_QWEN_VISION, replace(TINY_MOONVIT, sdpa=False)],
                         ids=["qwen2.5-vl-rmsnorm-windows-sdpa", "moonvit-layernorm-eager"])
def test_reference_encoder_one_graph_for_any_pack(cfg, options):
    cfg = replace(cfg, attention="mask")
    model = build_vision_encoder(cfg)
    compiled = dzc.compile(model, "cuda", options)
    _check_packs(model, compiled, cfg, PACKS)
    report = compiled.report
    assert report.compiles == 1 and report.recompiles == 0, "another image count or size recompiled"
    assert report.passes["fuse_vision_attention"] == cfg.layers
    # Residual adds: into each block's second norm, and into the next block's first norm or the merger's norm.
    assert report.passes["fuse_residual_norm"] == 2 * cfg.layers
    lowered = dict(report.graphs[0].stages)["lowered"]
    assert lowered.count("dzc.varlen_attention") == cfg.layers
    norm_op = "dzc.add_rms_norm" if cfg.norm == "rms" else "dzc.add_layer_norm"
    assert lowered.count(norm_op) == 2 * cfg.layers
    assert "aten.bmm" not in lowered and "searchsorted" not in lowered
    assert {k.op for k in report.kernels} >= {"varlen_attention"}


def test_split_spelling_fuses_and_compiles_once_per_image_count(options):
    """The per-image Python loop is unrolled by Dynamo: image sizes vary freely (unbacked lengths), while another
    image count is another graph (docs/vision.md: the mask spelling and HF's attention interface avoid that)."""
    cfg = replace(TINY_QWEN_VISION, attention="split", layers=1, full_attention_layers=(0,))
    model = build_vision_encoder(cfg)
    compiled = dzc.compile(model, "cuda", options)
    _check_packs(model, compiled, cfg, ([(2, 2), (2, 4)], [(4, 4), (2, 2)]))
    report = compiled.report
    assert report.compiles == 1, "other sizes, same image count: no recompile"
    assert report.passes["fuse_vision_attention"] == 1
    assert not report.refusals["fuse_vision_attention"]


def _tiny_qwen2_5_vl_vision_tower(attn_implementation: str | None = "sdpa"):
    """HF Qwen2.5-VL's vision tower, tiny, norms' weights drawn around 1; attn_implementation None: transformers'
    default."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = transformers.Qwen2_5_VLConfig().vision_config.__class__(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2, temporal_patch_size=1,
        window_size=8, out_hidden_size=24, fullatt_block_indexes=[1], in_channels=3)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.normal_(1.0, 0.1)  # ones would hide a missing weight multiply
    return model


def test_hf_qwen2_5_vl_vision_tower_compiles_once_and_matches_eager(options):
    from dzc.hf_attention import qwen2_5_vl_vision_inputs, use_dzc_attention

    eager = _tiny_qwen2_5_vl_vision_tower()  # HF's own SDPA path: split per image, one attention each
    model = copy.deepcopy(eager)
    use_dzc_attention(model)
    compiled = dzc.compile(model, "cuda", options)
    for grids in ([[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [1, 2, 2], [1, 2, 2]], [[1, 4, 8]]):
        grid_thw = torch.tensor(grids)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 2)
        with torch.no_grad():
            expected = eager(pixels, grid_thw)
        actual = compiled(pixels, grid_thw, **qwen2_5_vl_vision_inputs(model.config, grid_thw))
        torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    report = compiled.report
    assert report.compiles == 1 and report.recompiles == 0 and not report.graph_breaks
    # dzc's attention function called the op; the pass folded HF's rotary embedding into it in every block.
    sites = report.pass_sites["fuse_vision_attention"]
    assert len(sites) == 2 and all(s.endswith("(varlen_attention_forward) (rotary folded)") for s in sites)
    assert report.passes["fuse_residual_norm"] == 4
    lowered = dict(report.graphs[0].stages)["lowered"]
    ops = [line for line in lowered.splitlines() if "dzc.varlen_attention" in line]
    assert len(ops) == 2 and all("None" not in op and "kernel_id='varlen_attention." in op for op in ops)


def test_hf_qwen2_5_vl_vision_tower_unchanged_stops_recompiling_after_warm_up(options):
    """No helper, no precomputed kwargs: transformers' size helpers (vision_utils) run eagerly and their results
    are dynamic from the first graph on, so a new image count or size does not recompile; the one recompile is the
    first pack whose longest image differs (the third: max_seqlen, an int, is a constant until it changes)."""
    eager = _tiny_qwen2_5_vl_vision_tower()
    model = copy.deepcopy(eager)
    compiled = dzc.compile(model, "cuda", options)
    assert any(name.endswith(".get_vision_position_ids") for name in compiled.hf_attention.eager_helpers)
    packs = ([[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [1, 2, 2], [1, 2, 2]], [[1, 4, 4]],
             [[1, 2, 2], [1, 6, 2], [1, 2, 4], [1, 4, 4]], [[1, 8, 4], [1, 2, 2], [1, 2, 6], [1, 4, 2], [1, 2, 2]])
    compiles = []
    for grids in packs:
        grid_thw = torch.tensor(grids)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 2)
        with torch.no_grad():
            expected = eager(pixels, grid_thw)
            actual = compiled(pixels, grid_thw)
        torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
        compiles.append(compiled.report.compiles)
    assert compiles == [1, 1, 2, 2, 2] and compiled.report.recompiles == 1, compiles
    assert compiled.report.passes["fuse_vision_attention"] >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["mask", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_encoder_on_gpu_fuses_fused_sdpa_ops(attention, dtype, tmp_path):
    """On CUDA, capture keeps SDPA as a fused op (efficient / flash / cuDNN attention) instead of decomposing it:
    the pass must recognise those too. Full-size head dim (80) and real kernels."""
    cfg = replace(TINY_QWEN_VISION, hidden=160, heads=2, attention=attention)
    model = build_vision_encoder(cfg, dtype).cuda()
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False)
    compiled = dzc.compile(model, "cuda", options)
    packs = PACKS if attention == "mask" else PACKS[:1]
    for grids in packs:
        pack = pack_images(grids, cfg, dtype, generator=torch.Generator().manual_seed(len(grids)))
        inputs = [t.cuda() for t in pack.inputs()]
        with torch.no_grad():
            expected = model(*inputs)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(compiled(*inputs).float(), expected.float(), atol=tol, rtol=tol)
    report = compiled.report
    assert report.passes["fuse_vision_attention"] == cfg.layers, report.refusals["fuse_vision_attention"]
    assert report.compiles == 1
