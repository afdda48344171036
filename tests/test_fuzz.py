"""tools/fuzz.py in CI: the --quick run (tiny shapes, Triton through the interpreter on CPU) finds no mismatch and
no crash on a fresh seed, and its table lists every op that has kernels (a new op cannot be skipped silently);
its comparison tells wrong answers from right ones."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dzc.targets import KERNEL_FAMILIES

ROOT = Path(__file__).resolve().parents[1]


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("dzc_fuzz_tool", ROOT / "tools" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _table_rows(markdown: str) -> dict[tuple[str, str], dict[str, int]]:
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[2].isdigit():
            rows[(cells[0], cells[1])] = dict(zip(("cases", "match", "fallback", "clear-error", "mismatch", "crash"),
                                                  map(int, cells[2:8])))
    return rows


def test_quick_fuzz_finds_no_mismatch_or_crash(tmp_path, seed):
    out = tmp_path / "fuzz.md"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--quick", "--seed", str(seed),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    markdown = out.read_text()
    rows = _table_rows(markdown)
    assert {op for op, _ in rows} == set(KERNEL_FAMILIES), markdown
    for (op, codegen), counts in rows.items():
        assert counts["cases"] > 0, f"{op}/{codegen} ran no case:\n{markdown}"
        assert counts["mismatch"] == 0 and counts["crash"] == 0, markdown
    # Most cases must test a kernel: a generator whose cases all fall back would test nothing.
    for op in KERNEL_FAMILIES:
        counts = rows[(op, "triton")]
        assert counts["match"] >= counts["cases"] // 2, f"{op}: too few cases ran a kernel\n{markdown}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_compare_tells_wrong_answers_from_right_ones():
    fuzz = _fuzz_module()
    expected = torch.tensor([1.0, float("nan"), -float("inf"), 2.0])
    assert fuzz.compare(expected.clone(), expected, [(1e-3, 0.0)]) is None
    assert fuzz.compare(expected + torch.tensor([5e-4, 0, 0, 0]), expected, [(1e-3, 0.0)]) is None
    for wrong in ([1.0, 0.0, -float("inf"), 2.0],            # a number where the reference is NaN
                  [1.0, float("nan"), float("inf"), 2.0],     # the wrong infinity
                  [float("nan"), float("nan"), -float("inf"), 2.0],  # an unwritten (poisoned) element
                  [1.0, float("nan"), -float("inf"), 2.01]):  # past the tolerance
        assert fuzz.compare(torch.tensor(wrong), expected, [(1e-3, 0.0)]) is not None, wrong
    # Sums whose value depends on their order (Case.order_dependent): not compared there, still everywhere else.
    overflowed = torch.tensor([float("inf"), 0.5, float("nan"), 2.0])
    free = torch.tensor([True, True, False, False])
    for right in ([float("nan"), 3.0, float("nan"), 2.0], [-float("inf"), float("nan"), float("nan"), 2.0]):
        assert fuzz.compare(torch.tensor(right), overflowed, [(1e-3, 0.0)], free) is None, right
        assert fuzz.compare(torch.tensor(right), overflowed, [(1e-3, 0.0)]) is not None, right
    for wrong in ([float("nan"), 3.0, float("inf"), 2.0], [float("nan"), 3.0, float("nan"), float("nan")],
                  [float("nan"), 3.0, float("nan"), 2.5]):
        assert fuzz.compare(torch.tensor(wrong), overflowed, [(1e-3, 0.0)], free) is not None, wrong
    indices = torch.tensor([[0, 3, -1]], dtype=torch.int32)
    assert fuzz.compare(indices.clone(), indices, [(0.0, 0.0)]) is None
    assert fuzz.compare(torch.tensor([[0, 4, -1]], dtype=torch.int32), indices, [(0.0, 0.0)]) is not None
    assert fuzz.compare(indices.to(torch.int64), indices, [(0.0, 0.0)]) is not None


def test_every_op_with_kernels_has_a_generator():
    assert set(_fuzz_module().GENERATORS) == set(KERNEL_FAMILIES)


def test_the_plan_runs_in_rounds_over_every_op():
    """A time-limited run covers every op: case i of every op and codegen comes before case i + 1 of any."""
    import argparse

    fuzz = _fuzz_module()
    ops = sorted(KERNEL_FAMILIES)
    plan = fuzz.make_plan(argparse.Namespace(ops=ops, codegens=["triton"], only=None, cases=3), torch.device("cpu"))
    assert len(plan) == 3 * len(ops)
    assert [index for _, _, index in plan] == sorted(index for _, _, index in plan)
    assert [op for op, _, _ in plan[: len(ops)]] == ops


@pytest.mark.parametrize("seed, case", [
    # CI, session 10: products of both signs overflow; the kernel's sum gives NaN, the reference's inf.
    (1151955725, 6),
    # CI, session 40: the reference's sum overflows to inf, which clamped SwiGLU's clamp turns into a finite
    # number; the kernel's split-K sum gives NaN there. Both are right.
    (1481504256, 5),
])
def test_overflowing_moe_sum_matches_in_either_order(tmp_path, seed, case):
    """A 2^126 MXFP4 scale makes a token's sums overflow fp32 by the order they are added in: that token's outputs
    are not compared (Case.order_dependent); the other tokens' still are."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--quick", "--ops", "mxfp4_moe",
                           "--codegens", "triton", "--seed", str(seed), "--only", str(case),
                           "--out", str(tmp_path / "fuzz.md")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    rows = _table_rows((tmp_path / "fuzz.md").read_text())
    assert rows[("mxfp4_moe", "triton")]["match"] == 1, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_order_dependent_moe_outputs_are_the_overflowing_tokens_only():
    """Session 40's case: expert 1's gate row 98 has a 2^126 scale; tokens 0-3 use expert 1, token 4 expert 2."""
    fuzz = _fuzz_module()
    rng, srng, g = fuzz.case_rng(1481504256, "mxfp4_moe", "triton", 5, True)
    case = fuzz.GENERATORS["mxfp4_moe"](rng, srng, g, fuzz.QUICK, torch.device("cpu"))
    free = case.order_dependent(case.args)
    assert free[:4].all() and not free[4].any()
    # Without the extreme scales nothing is order-dependent.
    args = list(case.args)
    args[4] = args[4].clone().clamp(max=0x80)
    assert not case.order_dependent(tuple(args)).any()
