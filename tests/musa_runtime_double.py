"""A test double of torch_musa's `torch.musa` module, for running dzc's MUSA runtime layer without a MUSA card.

Installed only by tests and tools (never by dzc): `install(monkeypatch, backing)` puts it at `torch.musa`. Its
functions have torch_musa's names and signatures (../shared/reference/musa.md §2: is_available, device_count,
current_device, set_device, device, synchronize, get_device_name, get_device_capability, get_device_properties,
Stream, Event, current_stream, default_stream, stream) and delegate to torch.cuda ("cuda" backing: tensors stay
on the CUDA device, kernels run there) or to the CPU ("cpu" backing: streams are trivial, events read a clock,
Triton kernels run in its interpreter). Device facts (name, capability, multiprocessor count) are the backing
device's, never invented MUSA ones.

dzc tells it apart from torch_musa: torch_musa installs itself as torch.musa, so torch.musa.__name__ is
"torch_musa"; this module's name is not, and MusaRuntime.describe() reports real_musa_run = False for it.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch

NAME = "musa_runtime_double"


def _cuda_double() -> types.ModuleType:
    cuda = torch.cuda
    double = types.ModuleType(NAME, "torch.musa test double delegating to torch.cuda")
    for name in ("is_available", "device_count", "current_device", "set_device", "device", "synchronize",
                 "get_device_name", "get_device_capability", "get_device_properties", "Stream", "Event",
                 "current_stream", "default_stream", "stream"):
        setattr(double, name, getattr(cuda, name))
    return double


class _CpuStream:
    """CPU work is synchronous: a stream has nothing to wait for."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Records a clock reading; CPU work is synchronous, so that is when the preceding work ended."""

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing
        self.when: float | None = None

    def record(self, stream=None) -> None:
        self.when = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return self.when is not None

    def elapsed_time(self, end: "_CpuEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Events must be created with enable_timing=True to time them")
        if self.when is None or end.when is None:
            raise RuntimeError("elapsed_time of an event that was not recorded")
        return (end.when - self.when) * 1e3  # milliseconds, as torch.musa.Event returns


def _cpu_double() -> types.ModuleType:
    double = types.ModuleType(NAME, "torch.musa test double on the CPU")
    stream = _CpuStream()
    properties = types.SimpleNamespace(name="cpu", major=0, minor=0, multi_processor_count=os.cpu_count() or 1,
                                       total_memory=0, is_integrated=True, is_multi_gpu_board=False)
    double.is_available = lambda: True
    double.device_count = lambda: 1
    double.current_device = lambda: 0
    double.set_device = lambda device: None
    double.device = lambda device: contextlib.nullcontext()
    double.synchronize = lambda device=None: None
    double.get_device_name = lambda device=None: "cpu"
    double.get_device_capability = lambda device=None: (0, 0)
    double.get_device_properties = lambda device=None: properties
    double.Stream = _CpuStream
    double.Event = _CpuEvent
    double.current_stream = lambda device=None: stream
    double.default_stream = lambda device=None: stream
    double.stream = lambda s: contextlib.nullcontext()
    return double


def make(backing: str) -> types.ModuleType:
    """The double over "cuda" or "cpu"."""
    if backing == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA-backed torch.musa double needs a CUDA GPU")
        return _cuda_double()
    if backing == "cpu":
        return _cpu_double()
    raise ValueError(f"backing must be 'cuda' or 'cpu', not {backing!r}")


def install(monkeypatch, backing: str) -> types.ModuleType:
    """Put the double at torch.musa for one test; monkeypatch undoes it."""
    double = make(backing)
    monkeypatch.setattr(torch, "musa", double, raising=False)
    return double


def name_privateuse1_musa() -> None:
    """Make "musa:N" device strings parse, as torch_musa does (PrivateUse1 renamed "musa").

    Process-wide and irreversible, and afterwards Dynamo expects a torch.musa module for good: call it only in a
    process of its own. It registers no kernels, so nothing can allocate "musa" tensors.
    """
    torch.utils.rename_privateuse1_backend("musa")
