"""Run-time side of compiled graphs: the table of loaded kernels, and CUDA-graph replay for small token counts.

Lowered dzc op nodes name their kernel by id (`kernel_id='add_rms_norm.triton.3f2a9c01'`); the op looks the id up
here. Ids are hashes of the generated source and profile, so a graph printed in one process names the same
kernels as in another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

_KERNELS: dict[str, Callable] = {}


class NotRunnableError(RuntimeError):
    """A compiled graph reached a kernel that was generated but cannot execute in this process (no device for
    the target, or a codegen that cannot run on these tensors)."""


def register_kernel(kernel_id: str, kernel: Callable) -> None:
    _KERNELS[kernel_id] = kernel


def launch(kernel_id: str, *args):
    try:
        kernel = _KERNELS[kernel_id]
    except KeyError:
        raise RuntimeError(f"dzc kernel {kernel_id!r} is not loaded in this process; compile the model with "
                           f"dzc.compile here (graphs name kernels, they do not carry them)") from None
    return kernel(*args)


def direct_launcher(kernel_id: str) -> Callable:
    """A plain function calling the kernel, for graphs that call kernels without going through the op."""
    kernel = _KERNELS[kernel_id]

    def launch_kernel(*args):
        return kernel(*args)

    launch_kernel.__name__ = launch_kernel.__qualname__ = "dzc_" + kernel_id.replace(".", "_")
    return launch_kernel


class CudaGraphRunner:
    """Replays one CUDA graph per input shape, for calls whose token count is small.

    Small calls are bound by launch overhead; a graph replay costs one launch. Inputs are copied into the
    graph's static buffers, and outputs are cloned out so that a later call cannot overwrite what the caller
    holds (the clone costs one small copy per output, which is what keeps this path honest).
    """

    MAX_GRAPHS = 32  # distinct small shapes kept; the least recently used graph is dropped beyond that

    def __init__(self, fn: Callable, max_tokens: int):
        self.fn = fn
        self.max_tokens = max_tokens
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def tokens(args) -> int:
        """Rows of the largest activation input: the product of all but the last dim of each tensor argument
        that is not a parameter (parameters are captured in place and never copied)."""
        rows = 0
        for a in args:
            if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.dim() > 1:
                rows = max(rows, a.numel() // a.shape[-1])
        return rows

    def __call__(self, *args):
        if self.tokens(args) > self.max_tokens or torch.cuda.is_current_stream_capturing():
            return self.fn(*args)
        key = tuple((a.shape, a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(args)
            self.graphs[key] = entry
            if len(self.graphs) > self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        graph, static_inputs, static_outputs = entry
        # Parameters were captured in place: only inputs at another address than at capture are copied.
        tensors = [(s, a) for s, a in zip(static_inputs, args)
                   if isinstance(a, torch.Tensor) and a.data_ptr() != s.data_ptr()]
        if tensors:
            torch._foreach_copy_([s for s, _ in tensors], [a for _, a in tensors])
        graph.replay()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in static_outputs]

    def _capture(self, args):
        static_inputs = [a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) else a
                         for a in args]
        # Warm up on a side stream: first calls tune kernels and allocate, neither of which may be captured.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_outputs = self.fn(*static_inputs)
        return graph, static_inputs, static_outputs
