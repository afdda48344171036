"""Run-time side of compiled models: the table of loaded kernels, and CUDA-graph replay for small token counts.

Lowered dzc op nodes name their kernel by id (`kernel_id='add_rms_norm.triton.3f2a9c01'`); the op looks the id up
here. Ids are hashes of the generated source and profile, so a graph printed in one process names the same
kernels as in another.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

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
    """Replays one CUDA graph per input signature for calls with few tokens, above Dynamo (dzc.compile's wrapper).

    Small calls are bound by host time: Dynamo's guards, AOTAutograd's wrappers and one launch per kernel cost
    far more than the GPU work. A replay costs one graph launch. It skips the guards, so the contract (the one
    serving engines' CUDA graphs have) is: parameters and module attributes are frozen once a shape has been
    captured (in-place weight updates are seen; reassigned parameters are not: call `reset()` or compile again).
    The graph's input buffers are its own: an argument is copied in unless it is the same tensor, unmodified
    (same version counter), as at the previous replay. Outputs are cloned out unless `reuse_outputs`, where the
    returned tensors are the graph's buffers and the next replay of that shape overwrites them (a decode loop
    that consumes each step's output first).
    Calls it cannot key (keyword or non-tensor unhashable arguments) or with more tokens go to `fn` unchanged.
    """

    MAX_GRAPHS = 32  # distinct small signatures kept; the least recently used graph is dropped beyond that

    def __init__(self, fn: Callable, max_tokens: int, reuse_outputs: bool):
        self.fn = fn
        self.max_tokens = max_tokens
        self.reuse_outputs = reuse_outputs
        self.graphs: OrderedDict[tuple, _CapturedGraph] = OrderedDict()
        self.pool = None

    @staticmethod
    def tokens(args) -> int:
        """Tokens of the call: rows (all dims but the last) of the largest floating input, the activations;
        integer inputs beside them (block tables, positions, cache slots) are not tokens. A call with integer
        inputs only (token ids) counts the elements of the largest."""
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
        rows = [a.numel() // max(a.shape[-1], 1) for a in tensors if a.is_floating_point()]
        if rows:
            return max(rows)
        return max((a.numel() for a in tensors), default=0)

    def reset(self) -> None:
        self.graphs.clear()

    def __call__(self, *args):
        # The token count first: large calls (prefill) need no key. The key before asking CUDA about capture:
        # it is None for tensors on other devices, and a CPU-only torch cannot answer that question.
        if self.tokens(args) > self.max_tokens:
            return self.fn(*args)
        key = self._key(args)
        if key is None or torch.cuda.is_current_stream_capturing():
            return self.fn(*args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
            if len(self.graphs) > self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        graph = self.graphs[key]
        return self.fn(*args) if graph is None else graph.replay(args, self.reuse_outputs)

    @staticmethod
    def _key(args) -> tuple | None:
        key = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type != "cuda":
                    return None
                key.append((a.shape, a.dtype, a.stride(), a.device))
            elif isinstance(a, (int, float, bool, str, type(None))):
                key.append(a)
            else:
                return None
        return tuple(key)

    def _capture(self, args) -> "_CapturedGraph | None":
        """The graph for this signature, or None when the call cannot be replayed, so that such calls always run
        `fn`: it mutates an input (a cache written in place: a replay would write the graph's copy, not the
        caller's tensor), or it cannot be captured (it waits on the GPU for a value, e.g. a data-dependent size)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        versions = [a._version for a in static_inputs if isinstance(a, torch.Tensor)]
        # Warm up on a side stream: first calls compile, tune kernels and allocate, none of which may be captured.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        if versions != [a._version for a in static_inputs if isinstance(a, torch.Tensor)]:
            return None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.fn(*static_inputs)
        except RuntimeError as error:  # the call syncs with the host (.item(), data-dependent sizes): not capturable
            warnings.warn(f"dzc: calls of this signature run without a CUDA graph: capture failed ({error})",
                          stacklevel=3)
            return None
        return _CapturedGraph(graph, static_inputs, outputs)


class _CapturedGraph:
    def __init__(self, graph, static_inputs: list, outputs):
        self.graph = graph
        self.static_inputs = static_inputs
        self.flat_outputs, self.output_spec = pytree.tree_flatten(outputs)
        # Per tensor input: the argument last copied in and its version counter then.
        self.copied_from: list = [None] * len(static_inputs)

    def replay(self, args, reuse_outputs: bool):
        targets, sources = [], []
        for i, (static, a) in enumerate(zip(self.static_inputs, args)):
            if not isinstance(a, torch.Tensor):
                continue
            last = self.copied_from[i]
            if last is None or last[0] is not a or last[1] != a._version:
                targets.append(static)
                sources.append(a)
                self.copied_from[i] = (a, a._version)
        if targets:
            torch._foreach_copy_(targets, sources)
        self.graph.replay()
        if reuse_outputs:
            flat = self.flat_outputs
        else:
            flat = [o.clone() if isinstance(o, torch.Tensor) else o for o in self.flat_outputs]
        return pytree.tree_unflatten(flat, self.output_spec)
