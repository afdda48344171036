"""Test setup: Triton's interpreter on machines without a GPU, seeded inputs that print their seed, and a fresh
cache directory per test so that tuning-database state never leaks between tests."""

import os

import torch

# Must happen before Triton is imported (its library functions are @triton.jit too); dzc/__init__ does the same,
# but pytest plugins may import torch._dynamo (and so Triton) before dzc.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import dzc  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def seed(request):
    """A fresh seed per test, printed in the failure report (`seed = ...` in the locals) and seeding torch."""
    value = int(os.environ.get("DZC_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(value)
    print(f"seed = {value} (rerun with DZC_TEST_SEED={value})")
    return value


@pytest.fixture
def options(tmp_path):
    """CompileOptions with a private cache dir and no tuning (tuning has its own tests)."""
    return dzc.CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False)


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """Size of one bf16 unit in the last place at each value's magnitude (8 significant bits)."""
    values = values.float().abs()
    return torch.where(values == 0, torch.tensor(2.0**-133), 2.0 ** (torch.floor(torch.log2(values)) - 7))


def bf16_ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place, measured at the expected value's magnitude."""
    return (actual.float() - expected.float()).abs() / bf16_ulp(expected)


def assert_close_for_dtype(actual: torch.Tensor, expected: torch.Tensor, max_bf16_ulps: float = 1.0):
    """fp32/fp16: tight tolerances; bf16: at most `max_bf16_ulps` units in the last place."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert not actual.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    if actual.dtype == torch.bfloat16:
        worst = bf16_ulps(actual, expected).max().item()
        assert worst <= max_bf16_ulps, f"{worst} bf16 ulps apart"
    else:
        tol = {torch.float32: 1e-5, torch.float16: 1e-3}[actual.dtype]
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def run_ahead_of_time_script(script: str, tmp_path, timeout: int = 600, **env) -> list:
    """Run `script` with argv[1] = tmp_path in a fresh Python with Triton's interpreter off (set explicitly: dzc
    must not turn it on over it), as compiling for a GPU without one needs; extra environment variables from
    `env`. The script prints one line `RESULTS <json>`; returns the parsed JSON."""
    environment = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), **env)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env=environment, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def compile_tuned_and_check(model, cache_dir, tokens_list):
    """dzc.compile(model) for cuda (the Triton interpreter on CPU tensors) with tuning on, a bf16 AddRMSNorm-style
    model (x, residual -> y, h) of hidden 64 run at each token count and checked against eager, the fusion
    asserted from the report. Returns the compiled model and the last call's inputs."""
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(cache_dir), autotune=True))
    for tokens in tokens_list:
        x, residual = torch.randn(tokens, 64).bfloat16(), torch.randn(tokens, 64).bfloat16()
        y, h = compiled(x, residual)
        with torch.no_grad():
            expected_y, expected_h = model(x, residual)
        assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
        torch.testing.assert_close(y, expected_y, atol=1e-2, rtol=2**-6)
    assert compiled.report.fired() == {"fuse_residual_norm": 1}
    return compiled, (x, residual)
