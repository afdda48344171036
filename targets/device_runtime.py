"""Host-side device calls, behind one small interface that each vendor implements.

Everything dzc does on the host for a device (is it present, its name, synchronise, time a kernel) goes through
a DeviceRuntime, so the MUSA target never touches torch.cuda and the CPU path (Triton's interpreter) is just
another runtime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class DeviceRuntime:
    device_type: str  # torch device type of the tensors it runs on
    runs_tilelang: bool  # whether TileLang kernels can execute here
    interpreted: bool  # Triton kernels run through TRITON_INTERPRET

    def check_available(self) -> None:
        """Raise with what is missing if kernels cannot run here."""

    def device_name(self, device: torch.device) -> str:
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        raise NotImplementedError

    def bench(self, fn: Callable[[], object], device: torch.device) -> float:
        """Median seconds per call of fn (after a warm-up)."""
        raise NotImplementedError


class CudaRuntime(DeviceRuntime):
    device_type = "cuda"
    runs_tilelang = True
    interpreted = False

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("target 'cuda' got CUDA tensors but torch.cuda.is_available() is False")

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def bench(self, fn, device):
        import triton.testing

        with torch.cuda.device(device):
            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e-3


class MusaRuntime(DeviceRuntime):
    """torch_musa: musa:N devices, torch.musa events and synchronize; never torch.cuda."""

    device_type = "musa"
    runs_tilelang = True
    interpreted = False

    def check_available(self) -> None:
        musa = getattr(torch, "musa", None)
        if musa is None or not musa.is_available():
            raise RuntimeError(
                "target 'musa' needs a Moore Threads GPU with torch_musa installed (import torch_musa; "
                "torch.musa.is_available()) and a MUSA build of Triton (the vendor's triton with backend "
                "'mtgpu', or FlagTree's 'mthreads'); neither is present. dzc-dump --target musa still shows "
                "the generated MUSA code.")

    def device_name(self, device):
        return torch.musa.get_device_name(device)

    def synchronize(self, device):
        torch.musa.synchronize(device)

    def bench(self, fn, device):
        fn()
        torch.musa.synchronize(device)
        times = []
        for _ in range(10):
            start, end = torch.musa.Event(enable_timing=True), torch.musa.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times)


class InterpreterRuntime(DeviceRuntime):
    """CPU tensors: Triton kernels run through Triton's interpreter; timing uses a CPU clock."""

    device_type = "cpu"
    runs_tilelang = False  # TileLang has no interpreter: its GPU kernels only lower to source here
    interpreted = True

    def device_name(self, device):
        return "cpu (triton interpreter)"

    def synchronize(self, device):
        pass

    def bench(self, fn, device):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
