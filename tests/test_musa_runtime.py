"""dzc's MUSA runtime layer (targets/device_runtime.MusaRuntime) end to end against a test double of torch.musa:
device strings, current stream, events, synchronize, launch, and a generated kernel tuned and launched through it.

The double (tests/musa_runtime_double.py) delegates to the CPU here (Triton kernels run in its interpreter) and to
CUDA under the gpu marker. It is never reported as a MUSA run. On the CPU, torch.cuda is replaced with a module
that fails on any use while dzc's runtime layer runs (runtime calls, kernel launch and tuning; not torch's own
tracing, which probes torch.cuda itself), so the MUSA path provably never touches it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import musa_runtime_double
from dzc.lowering import Execution
from dzc.ops import OPS
from dzc.options import CompileOptions
from dzc.selftest import DEFAULT_TOLERANCES, compare_outputs, lower_op, run_selftest
from dzc.targets import TARGETS, musa_triton, triton_codegen
from dzc.targets.device_runtime import MusaRuntime


class _ForbiddenModule(types.ModuleType):
    """Stands in for torch.cuda: any attribute use is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"the MUSA runtime path touched torch.cuda.{name}")


@contextlib.contextmanager
def cuda_forbidden():
    """torch.cuda fails on any use inside the block (on a GPU machine the CUDA-backed double needs it)."""
    if torch.cuda.is_available():
        yield
        return
    real = torch.cuda
    torch.cuda = _ForbiddenModule("torch.cuda (forbidden here)")
    try:
        yield
    finally:
        torch.cuda = real


# CPU tensors run generated Triton kernels only through the interpreter, which is on where no GPU is (conftest);
# on a GPU machine test_runtime_layer_over_the_cuda_double covers the same path.
needs_interpreter = pytest.mark.skipif(not triton_codegen.interpreting(),
                                       reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.fixture
def cpu_double(monkeypatch):
    return musa_runtime_double.install(monkeypatch, "cpu")


def _count_events(monkeypatch, double) -> list:
    """Make double.Event record every event it creates (the double's own class, unchanged otherwise)."""
    created = []
    base = double.Event

    def event(*args, **kwargs):
        created.append(base(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr(double, "Event", event)
    return created


def test_without_torch_musa_the_runtime_says_what_is_missing(monkeypatch):
    monkeypatch.delattr(torch, "musa", raising=False)
    runtime = MusaRuntime()
    assert not runtime.is_available()
    with pytest.raises(RuntimeError) as err:
        runtime.check_available()
    assert "torch_musa" in str(err.value) and "MUSA build of Triton" in str(err.value)


def test_torch_musa_without_a_musa_triton_is_refused(cpu_double):
    """torch.musa alone is not enough: the installed Triton must have a MUSA backend (here it is upstream)."""
    assert musa_triton.detect_flavour().name == "upstream"
    with pytest.raises(RuntimeError, match="has no MUSA backend") as err:
        MusaRuntime().check_available()
    assert "triton.backends.mtgpu" in str(err.value) and "triton.backends.mthreads" in str(err.value)


def test_device_strings_streams_sync_and_facts_go_through_torch_musa(cpu_double):
    with cuda_forbidden():
        _check_device_strings_streams_sync_and_facts(cpu_double)


def _check_device_strings_streams_sync_and_facts(cpu_double):
    runtime = MusaRuntime()
    assert runtime.is_available()
    cpu = torch.device("cpu")  # the double keeps tensors on its backing device
    assert runtime.current_stream(cpu) is cpu_double.current_stream()
    runtime.synchronize(cpu)
    assert runtime.device_name(cpu) == "cpu"
    assert runtime.multiprocessor_count(cpu) == (os.cpu_count() or 1)
    assert runtime.arch(cpu) == "mp_00", "the backing device's capability, never an invented MUSA one"
    assert runtime.launch(lambda: 41 + 1, cpu) == 42
    facts = runtime.describe(cpu)
    assert facts["real_musa_run"] is False and facts["torch_musa_provider"] == musa_runtime_double.NAME
    assert facts["device_type"] == "musa" and facts["triton"].endswith("(upstream)")
    assert set(runtime.tuning_identity(cpu)) == {"device_type", "device", "arch", "multiprocessors", "toolkit",
                                                 "triton", "tilelang"}


def test_unfused_ops_fall_back_to_eager_without_torch_musas_inductor_backend(cpu_double):
    """torch_musa registers Inductor's MUSA backend when imported; the double (like a torch without torch_musa)
    registers none, so dzc runs the unfused rest of a MUSA graph eagerly (dzc/capture.py)."""
    assert MusaRuntime().inductor_available() is False


_DEVICE_STRINGS = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import musa_runtime_double
import dzc
from dzc.targets.device_runtime import MusaRuntime

torch.musa = musa_runtime_double.make("cpu")
musa_runtime_double.name_privateuse1_musa()
runtime = MusaRuntime()
assert runtime.device(0) == torch.device("musa", 0) and str(runtime.device(0)) == "musa:0"
assert str(runtime.device(1)) == "musa:1"
assert runtime.device() == torch.device("musa:0"), "None = torch.musa.current_device()"
print("OK")
"""


def test_device_strings_are_musa_n():
    """In a process of its own: naming PrivateUse1 "musa" (as torch_musa does) cannot be undone."""
    proc = subprocess.run([sys.executable, "-c", _DEVICE_STRINGS, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_bench_times_with_torch_musa_events(cpu_double, monkeypatch):
    created = _count_events(monkeypatch, cpu_double)
    runtime = MusaRuntime()
    with cuda_forbidden():
        seconds = runtime.bench(lambda: time.sleep(0.002), torch.device("cpu"))
    assert 0.002 <= seconds < 0.05, seconds
    assert len(created) >= 2 * 5 and all(e.enable_timing for e in created)


def _lower_and_run(runtime, device, profile_name, tmp_path, seed, autotune):
    """Lower add_rms_norm for a MUSA profile, bind it to `runtime`, run it on small random bf16 rows (tuning times
    every config, in Triton's interpreter on the CPU)."""
    target = TARGETS[profile_name]
    generator = torch.Generator(device=device).manual_seed(seed)
    x, residual = (torch.randn(3, 64, generator=generator, device=device).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=generator, device=device)).bfloat16()
    args = (x, residual, weight, 1e-6, False, True, torch.bfloat16, torch.bfloat16)
    options = CompileOptions(codegen="triton", autotune=autotune, cache_dir=str(tmp_path / "cache"))
    record, _ = lower_op("add_rms_norm", args, target, options, Execution(runtime))
    op, reference = OPS["add_rms_norm"]
    with cuda_forbidden():  # the first call tunes: every config is timed through the runtime
        actual = runtime.launch(lambda: op(*args, kernel_id=record.kernel_id), device)
        runtime.synchronize(device)
    outcome = compare_outputs(actual, reference(*args), DEFAULT_TOLERANCES)
    assert outcome["ok"], outcome
    return record


@needs_interpreter
@pytest.mark.parametrize("profile_name", ["musa:mp_22", "musa:mp_31"])
def test_generated_kernel_tunes_and_launches_through_the_musa_runtime(seed, cpu_double, monkeypatch, tmp_path,
                                                                      profile_name):
    created = _count_events(monkeypatch, cpu_double)
    record = _lower_and_run(MusaRuntime(), torch.device("cpu"), profile_name, tmp_path, seed, autotune=True)
    [(bucket, tuned)] = record.tuned.items()
    assert tuned["how"].startswith("timed"), tuned
    assert len(created) > 0, "tuning timings must come from torch.musa.Event"
    database = (tmp_path / "cache" / "tuning.json").read_text()
    assert '"device_type": "musa"' in database and '"arch": "mp_00"' in database
    assert f'"profile": "{profile_name}"' in database


@needs_interpreter
def test_selftest_over_the_double_is_not_reported_as_a_musa_run(cpu_double, tmp_path):
    report = run_selftest("musa:mp_31", dry_run=False, runtime=MusaRuntime(), device=torch.device("cpu"),
                          families=["add_rms_norm"], tune=False, seed=1, cache_dir=str(tmp_path))
    assert report["environment"]["device"]["real_musa_run"] is False
    assert report["environment"]["device"]["torch_musa_provider"] == musa_runtime_double.NAME
    by_codegen = {}
    for entry in report["results"]:
        by_codegen.setdefault(entry["codegen"], []).append(entry)
    assert by_codegen["triton"] and all(e["status"] == "passed" for e in by_codegen["triton"]), by_codegen["triton"]
    assert all(e["numerics"]["ok"] and e["timing"]["dzc_us"] > 0 for e in by_codegen["triton"])
    for entry in by_codegen["tilelang"]:
        assert entry["status"] == "unavailable" and "tilelang_musa" in entry["why"], entry
    assert report["ok"]


@pytest.mark.gpu
def test_runtime_layer_over_the_cuda_double(monkeypatch, tmp_path, seed):
    """On a CUDA GPU: the double delegates to torch.cuda; tensors live on cuda:0."""
    double = musa_runtime_double.install(monkeypatch, "cuda")
    runtime = MusaRuntime()
    cuda = torch.device("cuda", 0)
    side = double.Stream()
    with double.stream(side):
        assert runtime.current_stream(cuda) == side, "the current stream is torch.musa's"
    assert runtime.multiprocessor_count(cuda) == torch.cuda.get_device_properties(0).multi_processor_count
    assert runtime.arch(cuda) == "mp_%d%d" % torch.cuda.get_device_capability(0)
    created = _count_events(monkeypatch, double)
    seconds = runtime.bench(lambda: torch.empty(1 << 24, device=cuda).fill_(1.0), cuda)
    assert 0 < seconds < 0.01 and len(created) >= 10
    for profile_name in ("musa:mp_22", "musa:mp_31"):
        record = _lower_and_run(runtime, cuda, profile_name, tmp_path / profile_name, seed, autotune=True)
        assert next(iter(record.tuned.values()))["how"].startswith("timed")
    assert runtime.describe(cuda)["real_musa_run"] is False
