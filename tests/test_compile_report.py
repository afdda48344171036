"""What the compile report says about a graph's host syncs (CPU: the interpreter runs the graphs)."""

import torch

import dzc


class KeepPositive(torch.nn.Module):
    """Boolean-mask indexing: the output size is data-dependent (the host waits for nonzero's count)."""

    def forward(self, x):
        return x[x > 0] * 2


class ScaleByHostValue(torch.nn.Module):
    """.item() only to multiply by it: captured with scalar outputs, the value stays on the device."""

    def forward(self, x):
        return x * x.abs().amax().item()


def test_report_names_the_ops_the_host_waits_for(tmp_path):
    options = dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager")
    syncing, device_only = (dzc.compile(model, "cuda", options) for model in (KeepPositive(), ScaleByHostValue()))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(syncing(x), x[x > 0] * 2)
    torch.testing.assert_close(device_only(x), x * x.abs().amax())
    assert syncing.report.graphs[0].host_syncs == ["aten.index.Tensor"]
    assert "host syncs (calls run without CUDA graphs): aten.index.Tensor" in str(syncing.report)
    assert device_only.report.graphs[0].host_syncs == []
