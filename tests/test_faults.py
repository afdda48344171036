"""Faults around a compile: a tuning run killed mid-write, a config that fails to compile, a cache directory that
cannot be written (read-only, disk full). In each case the compile still succeeds, matches eager, and the report
says what happened. (Two processes tuning the same key at once: tests/test_autotune.py's concurrent tests.)

Where the machine lets the test mount a filesystem (root in a container that allows it), the read-only and the
full cache are real tmpfs mounts; elsewhere the read-only cache is a directory without write permission and the
full disk is an OSError(ENOSPC) raised by the rename that finishes each write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import compile_tuned_and_check

import dzc
from dzc.models.decoder import AddRMSNorm
from dzc.targets import add_rms_norm, resolve_target
from dzc.targets.launch import legal_configs

TOKENS = (3, 9)  # token buckets 4 and 16


def _entries(report) -> dict:
    [kernel] = report.kernels
    assert sorted(kernel.tuned) == [4, 16], kernel.tuned
    return kernel.tuned


def _subprocess_env():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    for knob in ("DZC_DUMP_DIR", "DZC_DEBUG", "DZC_TUNING_DB"):
        env.pop(knob, None)
    return env


# ---------------------------------------------------------------------------------------------------------
# kill -9 while the tuning database is being written

_KILLED_WRITER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import dzc
    from dzc.models.decoder import AddRMSNorm

    cache, ready = sys.argv[1], sys.argv[2]
    model = AddRMSNorm().bfloat16()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=cache, autotune=True))
    compiled(torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16())  # bucket 4: tuned and stored

    def write_half_then_hang(obj, f, **kwargs):  # the next store dies halfway through writing the file
        text = json.dumps(obj, **kwargs)
        f.write(text[:len(text) // 2])
        f.flush()
        os.fsync(f.fileno())
        open(ready, "w").close()
        time.sleep(600)

    json.dump = write_half_then_hang
    compiled(torch.randn(9, 64).bfloat16(), torch.randn(9, 64).bfloat16())  # bucket 16: killed while storing
""")


def test_a_tune_killed_while_writing_the_database_leaves_it_whole(tmp_path, seed):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(cache), str(ready)], env=_subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 300
        while not ready.exists():
            assert child.poll() is None, child.communicate()[1][-4000:]
            assert time.time() < deadline, "the child never reached the write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL

    data = json.loads((cache / "tuning.json").read_text())  # whole: the half-written file was a temporary one
    assert [e["key"]["token_bucket"] for e in data["entries"].values()] == [4]
    compiled, _ = compile_tuned_and_check(AddRMSNorm().bfloat16(), cache, TOKENS)
    tuned = _entries(compiled.report)
    assert tuned[4]["from_cache"] and tuned[4]["how"] == "tuning database", tuned[4]
    assert not tuned[16]["from_cache"] and tuned[16]["how"].startswith("timed"), tuned[16]
    assert not (cache / "tuning.json.corrupt").exists()


# ---------------------------------------------------------------------------------------------------------
# One config fails to compile


def test_a_config_that_fails_to_compile_is_skipped_and_reported(tmp_path, seed, monkeypatch):
    spec = add_rms_norm.AddRmsNormSpec(64, *[torch.bfloat16] * 5, False, True)
    profile = resolve_target("cuda").profile
    legal, _ = legal_configs(add_rms_norm, "triton", spec, profile)
    default = add_rms_norm.triton_default_config(spec, profile)
    broken = next(c for c in legal if c != default)
    real_launch = add_rms_norm.triton_launch

    def launch(kernel, config, *args):
        if config == broken:
            raise RuntimeError("out of resources: shared memory, Required: 262144, Hardware limit: 232448")
        return real_launch(kernel, config, *args)

    monkeypatch.setattr(add_rms_norm, "triton_launch", launch)
    compiled, _ = compile_tuned_and_check(AddRMSNorm().bfloat16(), tmp_path, TOKENS)
    for bucket, entry in _entries(compiled.report).items():
        assert entry["config"] != str(broken) and entry["failed_configs"] == 1, (bucket, entry)
        assert entry["failures"] == {str(broken): "RuntimeError: out of resources: shared memory, Required: "
                                                  "262144, Hardware limit: 232448"}, entry
    assert f"skipped {broken}: RuntimeError: out of resources" in str(compiled.report)


# ---------------------------------------------------------------------------------------------------------
# A cache directory that cannot be written


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` with `options` (yields True), or nothing (yields False) where mounting is not
    allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _check_unwritable_cache_report(compiled, cache: Path):
    [kernel] = compiled.report.kernels
    assert kernel.notes and f"cache directory {cache / 'kernels'} not writable" in kernel.notes[0], kernel.notes
    assert not kernel.source_path.startswith(str(cache)), kernel.source_path
    for bucket, entry in _entries(compiled.report).items():
        assert entry["how"].startswith("timed") and f"not saved to {cache / 'tuning.json'}" in entry["how"], entry
    assert "note: cache directory" in str(compiled.report)


def test_a_read_only_cache_dir_costs_only_the_cache(tmp_path, seed):
    cache = tmp_path / "cache"
    with _tmpfs(cache, "size=1m,ro") as mounted:
        if not mounted:
            if os.geteuid() == 0:
                pytest.skip("root ignores permissions and this machine does not allow a read-only mount")
            cache.chmod(0o555)
        try:
            with pytest.warns(RuntimeWarning, match="not writable"):
                compiled, _ = compile_tuned_and_check(AddRMSNorm().bfloat16(), cache, TOKENS)
        finally:
            if not mounted:
                cache.chmod(0o755)
        _check_unwritable_cache_report(compiled, cache)
        assert list(cache.iterdir()) == []


def test_a_full_disk_under_the_cache_costs_only_the_cache(tmp_path, seed, monkeypatch):
    cache = tmp_path / "cache"
    with _tmpfs(cache, "size=64k") as mounted:
        if mounted:  # fill it: every later write or new file in it fails with ENOSPC
            with open(cache / "filler", "wb", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 4096)
        else:
            real_replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if str(dst).startswith(str(cache)):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
                return real_replace(src, dst, *args, **kwargs)

            monkeypatch.setattr(os, "replace", replace)
        with pytest.warns(RuntimeWarning, match="not writable"):
            compiled, _ = compile_tuned_and_check(AddRMSNorm().bfloat16(), cache, TOKENS)
        _check_unwritable_cache_report(compiled, cache)
        assert "No space left on device" in compiled.report.kernels[0].notes[0]
        assert not (cache / "tuning.json").exists()
        assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")], "partial files must not stay behind"
