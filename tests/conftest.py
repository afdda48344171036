"""Test setup: Triton's interpreter on machines without a GPU, seeded inputs that print their seed, and a fresh
cache directory per test so that tuning-database state never leaks between tests."""

import os

import torch

# Must happen before Triton is imported (its library functions are @triton.jit too); dzc/__init__ does the same,
# but pytest plugins may import torch._dynamo (and so Triton) before dzc.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

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
