"""CUDA-graph replay of small calls (dzc.runtime.CudaGraphRunner, above Dynamo): same results as the guarded path,
inputs copied only when they changed, in-place-mutating calls never replayed, outputs owned by the caller."""

from __future__ import annotations

import pytest
import torch

import dzc
from dzc.models.decoder import AddRMSNorm, HFRMSNorm
from test_cuda_graph_eligibility import KeepPositive, ScaleByHostValue

pytestmark = pytest.mark.gpu


class AddNormInPlace(torch.nn.Module):
    """Writes its residual input in place (as a cache update would)."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)

    def forward(self, x, residual):
        residual.add_(x)
        return self.norm(residual)


def _model(cls, hidden, seed):
    torch.manual_seed(seed)
    model = cls(hidden).cuda().bfloat16()
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.1)
    return model


def _inputs(tokens, hidden):
    return (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16))


def test_replay_matches_guarded_path_and_sees_new_values(seed, tmp_path):
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=64))
    x, r = _inputs(8, 256)
    with torch.no_grad():
        for step in range(4):
            expected = model(x, r)
            actual = compiled(x, r)
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)
            if step == 1:
                x.mul_(-2.0)  # same tensor, new values: the version counter says copy it in again
            if step == 2:
                x, r = _inputs(8, 256)  # other tensors, same signature: replayed, copied in
    assert len(compiled._cuda_graphs.graphs) == 1
    first, second = compiled(x, r)[0], compiled(x, r)[0]
    assert first.data_ptr() != second.data_ptr()  # outputs are copies the caller owns


def test_reuse_outputs_returns_the_graph_buffers(seed, tmp_path):
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_reuse_outputs=True))
    x, r = _inputs(4, 256)
    compiled(x, r)
    first = compiled(x, r)[0]
    x2, r2 = _inputs(4, 256)
    second = compiled(x2, r2)[0]
    assert first.data_ptr() == second.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(second, model(x2, r2)[0], atol=0.02, rtol=0.02)


def test_calls_that_mutate_inputs_are_not_replayed(seed, tmp_path):
    model = _model(AddNormInPlace, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    x, r = _inputs(4, 256)
    expected_r = r.clone()
    for _ in range(3):
        compiled(x, r)
        expected_r += x
    torch.testing.assert_close(r, expected_r, atol=0.05, rtol=0.02)
    assert list(compiled._cuda_graphs.graphs.values()) == [None]


def test_large_calls_take_the_guarded_path(seed, tmp_path):
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=16))
    x, r = _inputs(64, 256)
    compiled(x, r)
    compiled(x, r)
    assert not compiled._cuda_graphs.graphs


def test_a_host_read_kept_on_the_device_replays_with_fresh_values(seed, tmp_path):
    compiled = dzc.compile(ScaleByHostValue(), "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    for step in range(3):  # new values each call: a replay that baked in the first call's amax would be wrong
        x = torch.randn(4, 64, device="cuda") * (step + 1)
        torch.testing.assert_close(compiled(x), x * x.abs().amax().item())
    assert [graph is not None for graph in compiled._cuda_graphs.graphs.values()] == [True]


def test_calls_with_host_syncs_run_without_cuda_graphs(seed, tmp_path):
    """The report names the op that makes the host wait; the runner never tries to capture such calls (a failed
    capture leaves the CUDA RNG state mid-capture: seen on the H200, the next randn raised)."""
    compiled = dzc.compile(KeepPositive(), "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda")
        torch.testing.assert_close(compiled(x), x[x > 0] * 2)
    assert compiled.report.graphs[0].host_syncs == ["aten.index.Tensor"]
    assert not compiled._cuda_graphs.graphs
