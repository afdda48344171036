"""The compile report's coverage (dzc/coverage.py): FLOPs and bytes in dzc kernels vs the fallback, the largest
unfused ops with their source line, and near-misses joined to the reasons the passes recorded."""

import pytest
import torch

import dzc
from dzc import mxfp4
from dzc.coverage import graph_coverage

TOKENS, HIDDEN, OUT = 6, 64, 48


def _rms_norm(h, weight, eps=1e-6):
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


class NormThenProject(torch.nn.Module):
    """Residual add + RMSNorm (fused into dzc.add_rms_norm), then a projection (left to the fallback)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1 + 1)
        self.proj = torch.nn.Parameter(torch.randn(OUT, HIDDEN))

    def forward(self, x, residual):
        h = x + residual
        return _rms_norm(h, self.weight) @ self.proj.t(), h


def test_shares_count_the_fused_norm_in_dzc_and_the_matmul_in_the_fallback(options, seed):
    compiled = dzc.compile(NormThenProject(), "cuda", options)
    x, residual = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    compiled(x, residual)
    report = compiled.report
    assert report.fired() == {"fuse_residual_norm": 1}
    (graph,) = report.coverage.graphs
    assert graph.compile_id == report.graphs[0].compile_id and report.graphs[0].coverage is graph
    elements, fp32 = TOKENS * HIDDEN, 4
    # The norm's meaning: add, square, sum, scale, weight per element; it reads x, residual, weight, writes y, h.
    assert graph.dzc_flops == 5 * elements
    assert graph.dzc_bytes == (4 * elements + HIDDEN) * fp32
    # The projection: torch's registered mm formula, 2 * M * N * K, at the line that wrote it.
    largest = graph.largest_unfused[0]
    assert largest.op == "aten.mm.default" and largest.count == 1
    assert largest.flops == 2 * TOKENS * HIDDEN * OUT
    assert largest.bytes == (elements + OUT * HIDDEN + TOKENS * OUT) * fp32
    assert largest.where.startswith("test_coverage.py:") and "self.proj.t()" in largest.source
    assert graph.fallback_flops == sum(op.flops for op in graph.largest_unfused)
    assert graph.flop_share == pytest.approx(5 * elements / (5 * elements + 2 * TOKENS * HIDDEN * OUT))
    assert 0 < graph.byte_share < 1 and report.coverage.flop_share == graph.flop_share
    assert not graph.near_misses and not graph.uncosted
    assert "in dzc kernels: 5% of" in str(report)  # the summary line under the graph
    assert str(report.coverage).startswith("dzc coverage: 5% of FLOPs")
    assert report.to_json()["graphs"][0]["coverage"]["dzc_flops"] == 5 * elements


class BroadcastResidualNorm(torch.nn.Module):
    """A norm after an add that broadcasts: fuse_residual_norm refuses it (the fused op adds two [T, H] rows)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1 + 1)

    def forward(self, x, residual):
        return _rms_norm(x + residual[0], self.weight)


def test_a_refused_residual_norm_is_a_near_miss_with_the_pass_reason(options, seed):
    compiled = dzc.compile(BroadcastResidualNorm(), "cuda", options)
    compiled(torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN))
    report = compiled.report
    assert not report.fired()
    ((where, why),) = report.refusals["fuse_residual_norm"]
    (miss,) = report.coverage.near_misses
    assert miss.kind == "residual norm" and miss.where == where and miss.count == 1
    assert miss.reasons == [f"fuse_residual_norm: {why}"]
    assert report.coverage.flop_share == 0 and report.coverage.byte_share == 0


class Attention(torch.nn.Module):
    """Dense causal attention spelled out: no dzc pass claims it, and none records why."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return probs @ v


def test_an_attention_no_pass_claims_is_a_near_miss_saying_so(options, seed):
    compiled = dzc.compile(Attention(), "cuda", options)
    q, k, v = (torch.randn(2, 4, TOKENS, 16) for _ in range(3))
    torch.testing.assert_close(compiled(q, k, v), Attention()(q, k, v))
    (miss,) = compiled.report.coverage.near_misses
    assert miss.kind == "attention" and miss.where.startswith("test_coverage.py:")
    assert len(miss.reasons) == 1 and "no pass recorded a reason" in miss.reasons[0]
    # Both matmuls (q k^T and p v) are the largest unfused ops: 2 * B * H * T * T * D each.
    largest = compiled.report.coverage.graphs[0].largest_unfused[:2]
    assert [op.flops for op in largest] == [2 * 2 * 4 * TOKENS**2 * 16] * 2


class DequantizedExpert(torch.nn.Module):
    """An MXFP4 weight dequantized and used by one plain matmul: no MoE expert computation to fuse."""

    def __init__(self):
        super().__init__()
        blocks, scales = mxfp4.quantize(torch.randn(OUT, HIDDEN))
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)

    def forward(self, x):
        return x @ torch.ops.dzc.mxfp4_dequantize(self.blocks, self.scales, x.dtype).t()


def test_a_weight_left_dequantized_is_an_experts_near_miss(options, seed):
    compiled = dzc.compile(DequantizedExpert(), "cuda", options)
    compiled(torch.randn(TOKENS, HIDDEN))
    report = compiled.report
    ((where, why),) = report.refusals["fuse_mxfp4_experts"]
    (miss,) = report.coverage.near_misses
    assert (miss.kind, miss.where, miss.reasons) == ("MXFP4 experts", where, [f"fuse_mxfp4_experts: {why}"])
    # mxfp4_dequantize has no kernel: it counts as fallback (its plain-torch implementation runs).
    assert report.coverage.flop_share == 0


class SelectRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(HIDDEN, OUT))

    def forward(self, x):
        return x[(x[:, 0] > 0).nonzero().squeeze(-1)] @ self.proj


def test_data_dependent_sizes_count_as_the_tokens_and_are_said_to_be_estimated(options, seed):
    """The rows nonzero selects are known only at run time: they count as the graph's token count (the largest
    dynamic input size, here x's rows), and the coverage says which sizes it estimated."""
    model = SelectRows()
    compiled = dzc.compile(model, "cuda", options)
    x = torch.randn(TOKENS, HIDDEN)
    torch.testing.assert_close(compiled(x), model(x))
    (graph,) = compiled.report.coverage.graphs
    assert graph.estimated, "the unbacked row count should be listed as estimated"
    (mm,) = [op for op in graph.largest_unfused if op.op == "aten.mm.default"]
    assert mm.flops == 2 * TOKENS * HIDDEN * OUT
    assert "sizes known only at run time counted as estimated" in str(compiled.report.coverage)


def test_an_op_that_cannot_be_costed_is_listed_not_raised():
    """Coverage is a statistic: an op whose cost formula does not fit counts as 0 and is named."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(TOKENS, HIDDEN, device="meta")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, x))  # [T, H] @ [T, H]: no valid shape
    mm.meta["val"] = torch.empty(TOKENS, HIDDEN, device="meta")
    graph.output(mm)
    coverage = graph_coverage(graph)
    assert coverage.fallback_flops == 0 and len(coverage.uncosted) == 1
    assert coverage.uncosted[0].startswith("aten.mm.default")


def test_dump_coverage_prints_the_coverage(tmp_path, capsys):
    from dzc import dump

    assert dump.main(["llama_decoder_fp32", "--coverage", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dzc coverage: ") and "largest unfused ops" in out and "model: ran" in out
    assert "near-misses" in out and "attention" in out  # its dense causal attention: no pass claims it
    assert "==== graph" not in out  # only the coverage, not the stages
