"""Host-side device calls, behind one small interface that each vendor implements.

Everything dzc does on the host for a device goes through a DeviceRuntime: is it present, which torch device a
kernel runs on ("cuda:N", "musa:N"), its name and multiprocessor count, the current stream, synchronise, launch
under the device's guard, time a kernel with the vendor's events, and the facts a tuning result depends on. The
MUSA target therefore never touches torch.cuda, and the CPU path (Triton's interpreter) is just another runtime.

CUDA and MUSA share one implementation (AcceleratorRuntime): torch_musa's `torch.musa` module mirrors
`torch.cuda` (device, synchronize, Event, current_stream, get_device_properties; ../shared/reference/musa.md §2),
so the vendor's module is looked up by its device type and every call goes through it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

# Bytes written between timed calls so that each call starts with a cold L2 (both vendors' L2 caches are far
# smaller; Triton's do_bench and MUSA Triton's musa_testing.do_bench flush 256 MB the same way).
_L2_FLUSH_BYTES = 256 * 1024 * 1024
# Event timing: calls made before timing, and the time budget that sets how many calls are timed.
_WARMUP_CALLS = 3
_TIMING_BUDGET_S = 0.02
_MIN_TIMED_CALLS, _MAX_TIMED_CALLS = 5, 100


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_versions() -> dict[str, str | None]:
    """Versions of the kernel DSLs as installed (Triton with its flavour, TileLang): tuning results depend on
    them. Read from package metadata, so TileLang is not imported (that takes seconds)."""
    from dzc.targets import musa_triton

    flavour = musa_triton.detect_flavour()
    return {"triton": f"{flavour.version} ({flavour.name})",
            "tilelang": _package_version("tilelang") or _package_version("tilelang_musa")}


class DeviceRuntime:
    device_type: str  # torch device type of the tensors it runs on
    runs_tilelang: bool  # whether TileLang kernels can execute here
    interpreted: bool  # Triton kernels run through TRITON_INTERPRET

    def is_available(self) -> bool:
        raise NotImplementedError

    def check_available(self) -> None:
        """Raise with what is missing if kernels cannot run here."""

    def device(self, index: int | None = None) -> torch.device:
        """The torch device kernels run on ("cuda:0", "musa:0"); None = the current device."""
        raise NotImplementedError

    def device_name(self, device: torch.device) -> str:
        raise NotImplementedError

    def multiprocessor_count(self, device: torch.device) -> int:
        """SMs (CUDA) / MPs (MUSA): a device fact, not a profile fact (boards of one arch differ)."""
        raise NotImplementedError

    def current_stream(self, device: torch.device):
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        raise NotImplementedError

    def launch(self, fn: Callable[[], object], device: torch.device):
        """Call fn with `device` current, so that kernels it launches go to that device's current stream."""
        raise NotImplementedError

    def bench(self, fn: Callable[[], object], device: torch.device) -> float:
        """Median seconds per call of fn (after a warm-up)."""
        raise NotImplementedError

    def inductor_available(self) -> bool:
        """Whether torch.compile's Inductor can compile graphs for this device type."""
        raise NotImplementedError

    def describe(self, device: torch.device) -> dict:
        """What a report needs to say where something ran: device, arch, multiprocessors, toolkit and versions."""
        raise NotImplementedError

    def tuning_identity(self, device: torch.device) -> dict:
        """The facts a tuning result depends on; part of every tuning-database key. A result measured on another
        arch, multiprocessor count, toolkit or DSL version is not reused."""
        facts = self.describe(device)
        return {name: facts[name] for name in ("device_type", "device", "arch", "multiprocessors", "toolkit",
                                               "triton", "tilelang")}


class AcceleratorRuntime(DeviceRuntime):
    """A vendor whose torch module (torch.<device_type>) follows torch.cuda's API."""

    runs_tilelang = True
    interpreted = False
    arch_prefix: str  # "sm_" | "mp_": arch names are prefix + major + minor

    @property
    def module(self) -> ModuleType:
        """torch.cuda / torch.musa: the only place this runtime reaches the vendor."""
        return getattr(torch, self.device_type)

    def is_available(self) -> bool:
        module = getattr(torch, self.device_type, None)
        return module is not None and module.is_available()

    def _index(self, device: torch.device) -> int:
        return device.index if device.index is not None else self.module.current_device()

    def device(self, index=None):
        return torch.device(self.device_type, self.module.current_device() if index is None else index)

    def device_name(self, device):
        return self.module.get_device_name(self._index(device))

    def multiprocessor_count(self, device):
        return self.module.get_device_properties(self._index(device)).multi_processor_count

    def arch(self, device: torch.device) -> str:
        major, minor = self.module.get_device_capability(self._index(device))
        return f"{self.arch_prefix}{major}{minor}"

    def current_stream(self, device):
        return self.module.current_stream(self._index(device))

    def synchronize(self, device):
        self.module.synchronize(self._index(device))

    def launch(self, fn, device):
        with self.module.device(self._index(device)):
            return fn()

    def event_bench(self, fn: Callable[[], object], device: torch.device) -> float:
        """Median seconds per call from the vendor's timing events on the current stream, L2 flushed before
        each call. The number of timed calls fits a ~20 ms budget."""
        index = self._index(device)
        with self.module.device(index):
            flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if device.type != "cpu" else None
            for _ in range(_WARMUP_CALLS):
                fn()
            self.module.synchronize(index)
            start = time.perf_counter()
            fn()
            self.module.synchronize(index)
            estimate = max(time.perf_counter() - start, 1e-7)
            calls = int(min(max(_TIMING_BUDGET_S / estimate, _MIN_TIMED_CALLS), _MAX_TIMED_CALLS))
            pairs = []
            for _ in range(calls):
                if flush is not None:
                    flush.zero_()
                begin, end = self.module.Event(enable_timing=True), self.module.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                pairs.append((begin, end))
            self.module.synchronize(index)
        return statistics.median(begin.elapsed_time(end) for begin, end in pairs) * 1e-3

    def toolkit_version(self) -> str | None:
        return getattr(torch.version, self.device_type, None)

    def describe(self, device):
        index = self._index(device)
        return {
            "device_type": self.device_type, "device": self.device_name(device), "device_index": index,
            "arch": self.arch(device), "multiprocessors": self.multiprocessor_count(device),
            "toolkit": self.toolkit_version(), "torch": torch.__version__, **dsl_versions(),
        }


class CudaRuntime(AcceleratorRuntime):
    device_type = "cuda"
    arch_prefix = "sm_"

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("target 'cuda' needs an NVIDIA GPU, but torch.cuda.is_available() is False (a CPU "
                               "build of torch, or no visible device)")

    def bench(self, fn, device):
        import triton.testing

        with torch.cuda.device(device):
            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e-3

    def inductor_available(self) -> bool:
        return True

    def describe(self, device):
        return {**super().describe(device), "driver": _nvidia_driver_version()}


def _nvidia_driver_version() -> str | None:
    """The kernel driver's version (nvidia-smi's "Driver Version"), from the proc file the driver publishes."""
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return None
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


class MusaRuntime(AcceleratorRuntime):
    """torch_musa: musa:N devices, torch.musa streams, events and synchronize; never torch.cuda."""

    device_type = "musa"
    arch_prefix = "mp_"

    def check_available(self) -> None:
        from dzc.targets import musa_triton

        if not self.is_available():
            raise RuntimeError(
                "target 'musa' needs a Moore Threads GPU with torch_musa installed (import torch_musa; "
                "torch.musa.is_available()) and a MUSA build of Triton (the vendor's triton with backend "
                "'mtgpu', or FlagTree's 'mthreads'); neither is present. dzc-dump --target musa still shows "
                "the generated MUSA code.")
        flavour = musa_triton.detect_flavour()
        if not flavour.targets_musa:
            raise RuntimeError(
                f"target 'musa': torch.musa is available, but the installed Triton ({flavour.name} "
                f"{flavour.version}) has no MUSA backend; install a MUSA build of Triton (the vendor's triton "
                f"with triton.backends.mtgpu, or FlagTree's triton.backends.mthreads), which replaces it.")

    def bench(self, fn, device):
        return self.event_bench(fn, device)

    def provider(self) -> str:
        """The module behind torch.musa: 'torch_musa' on a real installation (torch_musa sets torch.musa to
        itself). Anything else (a test double) must never be reported as a MUSA run."""
        return getattr(self.module, "__name__", type(self.module).__name__)

    def is_real_torch_musa(self) -> bool:
        return self.provider() == "torch_musa"

    def inductor_available(self) -> bool:
        """torch_musa registers Inductor's MUSA scheduling and wrapper codegen for device 'musa' when imported
        (register_backend_for_device; musa.md §2); without that registration Inductor cannot compile for it."""
        from torch._inductor.codegen.common import get_scheduling_for_device

        return get_scheduling_for_device(self.device_type) is not None

    def describe(self, device):
        return {**super().describe(device), "torch_musa": _package_version("torch_musa"),
                "torch_musa_provider": self.provider(), "real_musa_run": self.is_real_torch_musa()}


class InterpreterRuntime(DeviceRuntime):
    """CPU tensors: Triton kernels run through Triton's interpreter; timing uses a CPU clock."""

    device_type = "cpu"
    runs_tilelang = False  # TileLang has no interpreter: its GPU kernels only lower to source here
    interpreted = True

    def is_available(self) -> bool:
        return True

    def device(self, index=None):
        return torch.device("cpu")

    def device_name(self, device):
        return "cpu (triton interpreter)"

    def multiprocessor_count(self, device):
        return os.cpu_count() or 1

    def current_stream(self, device):
        return None  # CPU work is synchronous

    def synchronize(self, device):
        pass

    def launch(self, fn, device):
        return fn()

    def bench(self, fn, device):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def inductor_available(self) -> bool:
        return True

    def describe(self, device):
        return {"device_type": "cpu", "device": self.device_name(device), "device_index": None,
                "arch": f"triton-interpreter ({platform.machine()})",
                "multiprocessors": self.multiprocessor_count(device),
                "toolkit": None, "torch": torch.__version__, **dsl_versions()}

