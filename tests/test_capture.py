"""Capture robustness: graph breaks counted per compiled model, a capture that fails with dzc's capture settings
retried without them, dzc's own errors raised as themselves, op instances no kernel takes run their reference,
and each compiled model has its own kernels."""

import dataclasses
import inspect

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager
from torch import nn

import dzc
import dzc.pipeline
from dzc.models.decoder import AddRMSNorm
from dzc.models.vision import TINY_MOONVIT, build_vision_encoder, pack_images


class _DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 0:
            h = h * 2
        return self.b(h)


def test_a_data_dependent_branch_is_counted_as_a_graph_break(options, seed):
    torch._dynamo.reset()
    model = _DataDependentBranch()
    compiled = dzc.compile(model, "cuda", options)
    x = torch.randn(6, 16)
    torch.testing.assert_close(compiled(x), model(x))
    report = compiled.report
    [reason] = report.graph_breaks
    lines, first = inspect.getsourcelines(_DataDependentBranch.forward)
    branch = first + next(i for i, line in enumerate(lines) if "if h.sum().item()" in line)
    assert f"test_capture.py:{branch}" in reason, reason  # the model line of the break
    assert report.compiles == 2 and "graph breaks: 1" in str(report)


def _window_count(x, grid):
    """The number of windows from sizes read off a tensor: with .tolist() captured as unbacked sizes, the length of
    the second .tolist() needs a guard on them (the failure HF Qwen2.5-VL's vision tower hits in its window index),
    which Dynamo cannot take; torch.compile's default settings break the graph at the first .tolist() instead."""
    h, w = grid.tolist()
    windows = torch.arange((h // 2) * (w // 2)) * 2
    return x * len(windows.tolist())


def test_captures_run_without_the_fake_tensor_cache(options, seed):
    """dzc.compile turns Dynamo's fake-tensor cache off (dzc.api: on per-expert loops it cost more than it saved);
    the data-dependent branch above still compiles to the model's values with it off."""
    torch._dynamo.reset()
    model = _DataDependentBranch()
    compiled = dzc.compile(model, "cuda", options)
    assert torch._dynamo.config.fake_tensor_cache_enabled is False
    x = torch.randn(6, 16)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_capture_that_fails_with_dzc_settings_is_retried_without_them(options):
    torch._dynamo.reset()
    compiled = dzc.compile(_window_count, "cuda", options)
    x = torch.randn(10, 8)
    with pytest.warns(RuntimeWarning, match="capture failed with capture_scalar_outputs.*retried without them"):
        assert torch.equal(compiled(x, torch.tensor([4, 6])), x * 6)
    assert torch.equal(compiled(x, torch.tensor([8, 6])), x * 12)
    report = compiled.report
    [retry] = report.capture_retries
    assert "GuardOnDataDependentSymNode" in retry and "capture retried: " in str(report)
    assert report.graph_breaks, "without scalar capture, .tolist() breaks the graph"


def test_dzc_errors_are_not_wrapped_in_backend_compiler_failed(options):
    compiled = dzc.compile(AddRMSNorm().to("meta"), target="cuda", options=options)
    with pytest.raises(ValueError, match="cannot run on meta tensors") as err:
        compiled(torch.randn(3, 64, device="meta"), torch.randn(3, 64, device="meta"))
    assert not isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)
    assert "report a bug to PyTorch" not in str(err.value)


def test_an_op_instance_no_kernel_takes_runs_its_reference(options, seed):
    """Head dim 8: fuse_vision_attention rewrites the attention (the op means the same at any head dim), no
    varlen_attention kernel takes it (16..256); the op's reference runs it and the report says why."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(TINY_MOONVIT, heads=4)
    assert cfg.head_dim == 8
    model = build_vision_encoder(cfg)
    inputs = pack_images([(2, 2), (2, 4)], cfg).inputs()
    compiled = dzc.compile(model, "cuda", options)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    report = compiled.report
    assert report.fired()["fuse_vision_attention"] >= 1
    [fallback] = report.reference_fallbacks
    assert fallback.op == "varlen_attention" and "head dims 16..256, got 8" in fallback.execution
    assert "kernel_id=''" in dict(report.graphs[0].stages)["lowered"]


def test_each_compiled_model_has_its_own_kernels(tmp_path, seed):
    """Two models compiled with different tuning options: each runs its own kernel with its own options, and each
    report records its own tuning (one process-wide table let the second model's kernel replace the first's)."""
    torch._dynamo.reset()
    tuned_model, untuned_model = AddRMSNorm(64).bfloat16(), AddRMSNorm(64).bfloat16()
    tuned = dzc.compile(tuned_model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / "a"), autotune=True))
    untuned = dzc.compile(untuned_model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / "b"), autotune=False))

    def call(compiled, model, tokens):
        x, residual = torch.randn(tokens, 64).bfloat16(), torch.randn(tokens, 64).bfloat16()
        y, h = compiled(x, residual)
        assert_add_rms_norm_matches_eager(model, x, residual, y, h)

    call(tuned, tuned_model, 5)
    call(untuned, untuned_model, 5)
    call(tuned, tuned_model, 40)  # a new token bucket, tuned after the other model compiled the same source
    call(untuned, untuned_model, 40)
    [mine], [theirs] = tuned.report.kernels, untuned.report.kernels
    assert mine.kernel_id != theirs.kernel_id
    assert mine.kernel_id in dict(tuned.report.graphs[0].stages)["lowered"]
    assert sorted(mine.tuned) == sorted(theirs.tuned) == [8, 64]
    assert all(entry["how"] != "untuned default" for entry in mine.tuned.values()), mine.tuned
    assert all(entry["how"] == "untuned default" for entry in theirs.tuned.values()), theirs.tuned


@pytest.mark.parametrize("knob", ["paused", "on"])
def test_the_garbage_collector_waits_while_dynamo_compiles(options, seed, monkeypatch, knob):
    """dzc.compile pauses Python's cyclic garbage collector around Dynamo's compiles (dzc.api), the passes inside
    them, unless DZC_COMPILE_GC=on; it runs again after, and a collector the user turned off stays off."""
    import gc

    from dzc import config

    torch._dynamo.reset()
    seen = []

    def fuse_residual_norm(graph, real=dzc.pipeline.fuse_residual_norm):
        seen.append(gc.isenabled())
        return real(graph)

    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", fuse_residual_norm)
    model = AddRMSNorm(64)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    with config.scope(DZC_COMPILE_GC=knob):
        compiled = dzc.compile(model, "cuda", options)
        y, h = compiled(x, residual)
        assert seen == [knob == "on"] and gc.isenabled()
        assert compiled.report.fired() == {"fuse_residual_norm": 1}
        torch.testing.assert_close((y, h), model(x, residual))
        gc.disable()
        try:
            compiled(torch.randn(2, 7, 64), torch.randn(2, 7, 64))  # another rank: compiled again
            assert len(seen) == 2 and not gc.isenabled()
        finally:
            gc.enable()


def test_a_pass_that_fails_costs_its_fusion_not_the_compile(options, seed, monkeypatch):
    torch._dynamo.reset()

    def fuse_residual_norm(graph):
        raise IndexError("a structure the matcher did not expect")

    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", fuse_residual_norm)
    model = AddRMSNorm(64)
    compiled = dzc.compile(model, "cuda", options)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    # The report says where the pass raised, for the bug report.
    with pytest.warns(RuntimeWarning, match=r"fuse_residual_norm: the pass failed .IndexError: a structure the "
                      r"matcher did not expect at tests/test_capture.py:\d+ .fuse_residual_norm.\)"):
        y, h = compiled(x, residual)
    expected_y, expected_h = model(x, residual)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(h, expected_h)
    [(site, why)] = compiled.report.refusals["fuse_residual_norm"]
    assert "a structure the matcher did not expect" in why and not compiled.report.fired()
