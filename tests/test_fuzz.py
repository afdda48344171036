"""tools/fuzz.py in CI: the --quick run (tiny shapes, Triton through the interpreter on CPU) finds no mismatch and
no crash on a fresh seed, and its table lists every op that has kernels (a new op cannot be skipped silently);
its comparison tells wrong answers from right ones."""

import importlib.util
import subprocess
import sys
from pathlib import Path

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
    # Overflowing sums (Case.overflows): inf or NaN by summation order, but never a finite number there.
    overflowed = torch.tensor([float("inf"), float("nan"), 2.0])
    assert fuzz.compare(torch.tensor([float("nan"), float("inf"), 2.0]), overflowed, [(1e-3, 0.0)], True) is None
    assert fuzz.compare(torch.tensor([float("nan"), float("inf"), 2.0]), overflowed, [(1e-3, 0.0)]) is not None
    for wrong in ([1.0, float("nan"), 2.0], [float("inf"), float("nan"), float("nan")]):
        assert fuzz.compare(torch.tensor(wrong), overflowed, [(1e-3, 0.0)], True) is not None, wrong
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


def test_overflowing_moe_sum_matches_in_either_order(tmp_path):
    """Seed 1151955725's case 6 (CI, session 10): a 2^126 MXFP4 scale makes products of both signs overflow, so
    the kernel's summation gives NaN where the reference's CPU matrix product gives inf. Both are right; a finite
    value there would not be."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--quick", "--ops", "mxfp4_moe",
                           "--codegens", "triton", "--seed", "1151955725", "--only", "6",
                           "--out", str(tmp_path / "fuzz.md")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    rows = _table_rows((tmp_path / "fuzz.md").read_text())
    assert rows[("mxfp4_moe", "triton")]["match"] == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
