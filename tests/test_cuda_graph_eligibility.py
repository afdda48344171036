"""Which calls may go through CUDA graphs, decided without a GPU: the host syncs the compile report names for a
graph, and the tokens CudaGraphRunner counts for a call (on the CPU; the graphs here hold no dzc kernel)."""

import torch

import dzc
from dzc.runtime import call_tokens, flatten_call


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


def test_cuda_graph_runner_counts_activation_rows_as_tokens():
    """A paged decode step: 8 sequences' hidden states beside a block table of 8 x 64 pages and positions. The
    tokens are the 8 rows, not the table's 512 entries (which would keep every decode step off CUDA graphs); with
    token ids only, the ids' 64, not the table's 512 either."""
    hidden, table, positions = torch.empty(8, 1, 32), torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, 1)
    assert call_tokens(flatten_call((hidden, table, positions.long(), 0.5, None), {}).inputs) == 8
    assert call_tokens([torch.zeros(4, 16, dtype=torch.long), table]) == 64  # ids only: the ids' elements
    assert call_tokens([torch.empty(0, 0)]) == 0


def test_small_calls_on_cpu_tensors_run_without_the_runner(tmp_path):
    """A "cuda"-target model called on CPU tensors (the interpreter) after its first compile: the runner hands
    every call to the compiled model without touching CUDA, which a CPU-only torch has not got."""
    compiled = dzc.compile(ScaleByHostValue(), "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    for seed in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(x), x * x.abs().amax())
    assert not compiled._cuda_graphs.graphs
