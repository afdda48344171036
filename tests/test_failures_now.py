"""conftest's DZC_TEST_FAILURES_NOW=1: a failed test's report, with its captured output (the seed), reaches stderr
as the test fails, so that a GPU campaign part cut by its time limit still shows why (tools/gpu_campaign.sh sets
it); without it stderr stays quiet and the report is pytest's own, at the end."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _run_failing_test(tmp_path, failures_now: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_fails.py").write_text("def test_fails(seed):\n    assert seed < 0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("DZC_TEST_FAILURES_NOW", None)
    if failures_now:
        env["DZC_TEST_FAILURES_NOW"] = "1"
    # this suite's conftest as a plugin, over a test file outside the suite
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:logging", "-p", "no:cacheprovider",
                           "-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_fails.py")],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_failure_reaches_stderr_as_it_happens_with_its_seed(tmp_path):
    result = _run_failing_test(tmp_path, failures_now=True)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "=== FAILED test_fails.py::test_fails (call)" in result.stderr, result.stderr[-2000:]
    assert "AssertionError" in result.stderr and "rerun with DZC_TEST_SEED=" in result.stderr


def test_without_the_knob_stderr_has_no_report(tmp_path):
    result = _run_failing_test(tmp_path, failures_now=False)
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-2000:]
    assert "=== FAILED" not in result.stderr, result.stderr[-2000:]
