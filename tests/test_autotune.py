"""Autotuning: the tuning database is hit by a second compile, survives corruption and concurrent writers, and a
config that fails is skipped rather than fatal."""

import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (assert_add_rms_norm_matches_eager, assert_close_for_dtype, assert_hf_rms_norm_output_close,
                      compile_tuned_and_check)

import dzc
from dzc.autotune import FORMAT_VERSION, ExternalCandidate, TuningDatabase, tune
from dzc import lowering
from dzc.lowering import Execution, KernelTable
from dzc.models.decoder import AddRMSNorm
from dzc.ops.add_rms_norm import add_rms_norm_reference
from dzc.report import CompileReport, CompileTimer
from dzc.targets import INTERPRETER, TARGETS, add_rms_norm, tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import agreement_check


TOKENS = (3, 9)  # token buckets 4 and 16


def _compile_and_check(model, cache_dir):
    """Compile with tuning on, run every token count, check against eager; returns the report."""
    compiled, _ = compile_tuned_and_check(model, cache_dir, TOKENS)
    report = compiled.report
    assert len(report.kernels) == 1
    return report


def _tuned(report) -> dict:
    [kernel] = report.kernels
    assert sorted(kernel.tuned) == [4, 16], kernel.tuned
    return kernel.tuned


def _read_database(path) -> dict:
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT_VERSION
    assert isinstance(data["entries"], dict)
    return data["entries"]


def test_second_compile_is_a_tuning_database_hit(tmp_path, seed):
    cache = tmp_path / "cache"
    model = AddRMSNorm().bfloat16()

    first = _tuned(_compile_and_check(model, cache))
    for bucket, entry in first.items():
        assert entry["from_cache"] is False, (bucket, entry)
        assert entry["how"] != "tuning database" and entry["how"].startswith("timed"), (bucket, entry)
    entries = _read_database(cache / "tuning.json")
    assert sorted(e["key"]["token_bucket"] for e in entries.values()) == [4, 16]

    second = _tuned(_compile_and_check(model, cache))
    for bucket, entry in second.items():
        assert entry["from_cache"] is True, (bucket, entry)
        assert entry["how"] == "tuning database", (bucket, entry)
        assert entry["config"] == first[bucket]["config"], "the database should give back the tuned winner"
    assert _read_database(cache / "tuning.json") == entries, "a database hit must not rewrite the database"


def test_corrupt_database_is_set_aside_and_rebuilt(tmp_path, seed):
    cache = tmp_path / "cache"
    cache.mkdir()
    database = cache / "tuning.json"
    garbage = "{this is not json"
    database.write_text(garbage)

    with pytest.warns(RuntimeWarning, match=re.escape(str(database))):
        report = _compile_and_check(AddRMSNorm().bfloat16(), cache)

    aside = cache / "tuning.json.corrupt"
    assert aside.read_text() == garbage
    for entry in _tuned(report).values():
        assert entry["from_cache"] is False and entry["how"].startswith("timed")
    entries = _read_database(database)
    assert sorted(e["key"]["token_bucket"] for e in entries.values()) == [4, 16]


@pytest.mark.parametrize("content", ["[1, 2, 3]", "42", '{"format": 999, "entries": {}}', '{"format": 1}', ""])
def test_unreadable_database_contents_warn_and_start_over(tmp_path, content):
    path = tmp_path / "tuning.json"
    path.write_text(content)
    key = {"op": "x", "token_bucket": 4}
    with pytest.warns(RuntimeWarning, match=re.escape(str(path))):
        assert TuningDatabase(path).lookup(key) is None
    assert (tmp_path / "tuning.json.corrupt").read_text() == content
    TuningDatabase(path).store(key, {"config": KernelConfig.make(num_warps=2, ROWS=1).to_json()})
    assert list(_read_database(path)) == [TuningDatabase.key_string(key)]


def test_autotune_off_runs_the_family_default_config(tmp_path, seed):
    """CompileOptions.autotune=False: "every kernel runs its family's default config" (dzc/options.py), which for
    Triton is add_rms_norm.triton_default_config. hidden 2880 is a size where that differs from the first config
    of the tuning space."""
    from dzc.targets import add_rms_norm, resolve_target

    hidden = 2880
    model = AddRMSNorm(hidden).bfloat16()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False))
    x, residual = torch.randn(2, hidden).bfloat16(), torch.randn(2, hidden).bfloat16()
    y, h = compiled(x, residual)
    assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    [kernel] = compiled.report.kernels
    spec = add_rms_norm.AddRmsNormSpec(hidden, *[torch.bfloat16] * 5, False, True)
    default = add_rms_norm.triton_default_config(spec, resolve_target("cuda").profile)
    assert kernel.tuned[2]["how"] == "untuned default"
    assert kernel.tuned[2]["config"] == str(default)
    assert not (tmp_path / "tuning.json").exists(), "no tuning, no database"


def test_default_options_do_not_tune_under_the_interpreter(tmp_path, seed):
    """CompileOptions.autotune=None (the default): kernels run by Triton's CPU interpreter (CPU tensors, on any
    machine) take the untuned default config, since timings there say nothing of a GPU."""
    hidden = 2880
    model = AddRMSNorm(hidden).bfloat16()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path)))
    x, residual = torch.randn(2, hidden).bfloat16(), torch.randn(2, hidden).bfloat16()
    y, h = compiled(x, residual)
    assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    [kernel] = compiled.report.kernels
    assert kernel.tuned[2]["how"] == "untuned default"
    assert not (tmp_path / "tuning.json").exists(), "no tuning, no database"


# ---------------------------------------------------------------------------------------------------------
# Concurrent writers

_STORE_WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from dzc.autotune import TuningDatabase

    path, worker, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    (path.parent / f"ready.{worker}").touch()
    deadline = time.time() + 120
    while not (path.parent / "go").exists():  # start storing together with the other workers
        if time.time() > deadline:
            sys.exit("no go signal")
        time.sleep(0.005)
    database = TuningDatabase(path)
    for i in range(count):
        key = {"worker": worker, "i": i, "token_bucket": 1 << (i % 8)}
        database.store(key, {"config": {"params": {"ROWS": 1}, "num_warps": worker + 1, "num_stages": 1},
                             "seconds_per_call": 1e-6 * i})
    print("stored", count)
""")


def _subprocess_env():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env.pop("DZC_DUMP_DIR", None)
    env.pop("DZC_DEBUG", None)
    return env


def test_concurrent_stores_from_several_processes_keep_every_key(tmp_path):
    workers, count = 3, 30
    path = tmp_path / "db" / "tuning.json"
    path.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _STORE_WORKER, str(path), str(w), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env(),
                              cwd=tmp_path)
             for w in range(workers)]
    try:
        deadline = time.time() + 120
        while not all((path.parent / f"ready.{w}").exists() for w in range(workers)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            assert time.time() < deadline, "workers did not start"
            time.sleep(0.01)
        (path.parent / "go").touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert f"stored {count}" in out

    entries = _read_database(path)
    expected = {TuningDatabase.key_string({"worker": w, "i": i, "token_bucket": 1 << (i % 8)})
                for w in range(workers) for i in range(count)}
    assert set(entries) == expected, f"lost {len(expected - set(entries))} of {len(expected)} keys"
    for key_text, entry in entries.items():
        key = json.loads(key_text)
        assert entry["key"] == key and entry["config"]["num_warps"] == key["worker"] + 1
    # Every writer replaced the file atomically: no temporary files are left behind.
    assert sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")) == []
    # And a fresh reader sees every key.
    database = TuningDatabase(path)
    assert all(database.lookup(json.loads(k)) is not None for k in expected)


_COMPILE_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import dzc
    from dzc.models.decoder import AddRMSNorm

    torch.manual_seed(int(sys.argv[2]))
    model = AddRMSNorm().bfloat16()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=sys.argv[1], autotune=True))
    for tokens in (3, 9):
        x, residual = torch.randn(tokens, 64).bfloat16(), torch.randn(tokens, 64).bfloat16()
        y, h = compiled(x, residual)
        with torch.no_grad():
            ey, eh = model(x, residual)
        torch.testing.assert_close(h, eh, atol=0, rtol=2**-7)
        torch.testing.assert_close(y, ey, atol=1e-2, rtol=2**-6)
    [kernel] = compiled.report.kernels
    print("TUNED", json.dumps({str(k): v for k, v in kernel.tuned.items()}))
""")


def test_concurrent_compiles_share_one_cache_dir(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_WORKER, str(cache), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env(),
                              cwd=tmp_path)
             for seed in (1, 2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    tuned = []
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
        [line] = [line for line in out.splitlines() if line.startswith("TUNED ")]
        tuned.append(json.loads(line.removeprefix("TUNED ")))
    for entries in tuned:
        assert sorted(entries) == ["16", "4"]
    entries = _read_database(cache / "tuning.json")
    assert sorted(e["key"]["token_bucket"] for e in entries.values()) == [4, 16]
    assert not (cache / "tuning.json.corrupt").exists()
    # Both processes generated the same kernel source under the same name.
    kernels = sorted((cache / "kernels").iterdir())
    assert len(kernels) == 1 and "def add_rms_norm_kernel" in kernels[0].read_text()


# ---------------------------------------------------------------------------------------------------------
# tune() itself


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def autotune_log():
    logger = logging.getLogger("dzc.autotune")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


CONFIGS = [KernelConfig.make(num_warps=w, num_stages=1, ROWS=r, BLOCK=64) for w, r in ((1, 1), (2, 4), (4, 8))]
KEY = {"op": "add_rms_norm", "spec": "test", "token_bucket": 16}


def test_a_failing_config_is_skipped_and_logged(tmp_path, autotune_log):
    bad = CONFIGS[0]
    seconds = {CONFIGS[0]: 1e-7, CONFIGS[1]: 3e-6, CONFIGS[2]: 2e-6}  # the failing one would be fastest
    ran = []

    def run(cfg):
        ran.append(cfg)
        if cfg == bad:
            raise ValueError("out of resources: shared memory\nsecond line")
        return seconds[cfg]

    database = TuningDatabase(tmp_path / "tuning.json")
    result = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(), database=database)
    assert result.config == CONFIGS[2]
    assert result.from_cache is False
    assert result.failures == {str(bad): "ValueError: out of resources: shared memory"}
    assert result.timings == {str(CONFIGS[1]): 3e-6, str(CONFIGS[2]): 2e-6}
    assert ran == CONFIGS
    assert any(str(bad) in m and "out of resources" in m for m in autotune_log), autotune_log

    record = database.lookup(KEY)
    assert KernelConfig.from_json(record["config"]) == CONFIGS[2]
    assert record["configs_tried"] == 3 and record["configs_failed"] == 1

    # Known key: the database answers, nothing runs.
    ran.clear()
    again = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(),
                 database=TuningDatabase(tmp_path / "tuning.json"))
    assert again.config == CONFIGS[2] and again.from_cache is True and ran == []


def test_a_config_whose_outputs_disagree_is_skipped_even_when_fastest(tmp_path, autotune_log):
    """check=agreement_check: outputs are compared with the first config's; rounding passes, a wrong result (or NaN
    where there was none) is a failure with its reason, whatever its speed."""
    generator = torch.Generator().manual_seed(0)
    right = torch.randn(16, 64, generator=generator)
    rounded = right.bfloat16().float()  # what another tiling's rounding looks like
    written = {CONFIGS[0]: right, CONFIGS[1]: right + 0.5, CONFIGS[2]: rounded}
    seconds = {CONFIGS[0]: 3e-6, CONFIGS[1]: 1e-7, CONFIGS[2]: 2e-6}
    out = torch.full((16, 64), float("nan"))

    def run(cfg):
        out.copy_(written[cfg])
        return seconds[cfg]

    result = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(),
                  database=TuningDatabase(tmp_path / "tuning.json"), check=agreement_check((out,))[0])
    assert result.config == CONFIGS[2]
    assert list(result.failures) == [str(CONFIGS[1])]
    assert result.failures[str(CONFIGS[1])].startswith("wrong result: max difference 0.5")
    assert any("wrong result" in m for m in autotune_log), autotune_log

    written[CONFIGS[1]] = right.masked_fill(right > 2, float("nan"))
    result = tune("k[tokens<=16]", {**KEY, "token_bucket": 32}, CONFIGS, run=run, bench=lambda fn: fn(),
                  database=TuningDatabase(tmp_path / "tuning.json"), check=agreement_check((out,))[0])
    assert result.config == CONFIGS[2] and "NaN or infinite" in result.failures[str(CONFIGS[1])]


def test_an_external_candidate_whose_results_disagree_is_skipped_even_when_fastest(tmp_path, autotune_log):
    """check_external: what an external candidate (another library's kernel, or dzc's kernel from another codegen)
    returns is compared with the results the first config wrote, as configs' outputs are."""
    generator = torch.Generator().manual_seed(1)
    right = torch.randn(16, 64, generator=generator)
    out = torch.full((16, 64), float("nan"))
    results = out.view(4, 4, 64)  # the op's results: a view of what the kernel writes

    def run(cfg):
        out.copy_(right)

    returned = {"wrong": right.view(4, 4, 64) * 1.5, "rounded": right.bfloat16().float().view(4, 4, 64),
                "misshapen": right}
    externals = [ExternalCandidate(name, lambda name=name: returned[name]) for name in returned]
    check, check_external = agreement_check((out,), results)
    seconds = iter([3e-6] * len(CONFIGS) + [1e-7] * len(externals))  # candidates run in order: every external faster
    result = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: (fn(), next(seconds))[1],
                  database=TuningDatabase(tmp_path / "tuning.json"), externals=externals,
                  run_external=lambda candidate: candidate.fn(), check=check, check_external=check_external)
    assert result.failures["external wrong"].startswith("wrong result: max difference"), result.failures
    assert result.failures["external misshapen"].startswith("wrong result: returned [(16, 64)]"), result.failures
    assert "external rounded" not in result.failures and result.external is not None
    assert result.external.name == "rounded"


def test_a_kernel_from_another_codegen_is_a_tuning_candidate(tmp_path, seed):
    """Codegen "auto" with tuning: lowering offers the op's kernels from its other usable codegens to the chosen
    kernel's tuner as "dzc.<codegen>" candidates, each tuned on its own first, checked like configs, recorded in the
    report, and launched for the buckets they win. Without a GPU only Triton runs, so the alternative here is a
    second Triton kernel of the op, built the way lowering builds one."""
    # HF's spelling: the norm reads the bf16 sum and rounds before the weight multiply.
    spec = add_rms_norm.AddRmsNormSpec(64, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                                       torch.bfloat16, sum_in_fp32=False, cast_before_weight=True)
    target, execution, table = TARGETS["cuda:sm_90"], Execution(INTERPRETER), KernelTable()

    def build(database_name, *alternatives):
        # Each its own database: two kernels of one source share a tuning key (another codegen's would not).
        return lowering.alternative_kernel("add_rms_norm", spec, "triton", target, execution, table, "cpu",
                                           tmp_path / "kernels", TuningDatabase(tmp_path / database_name),
                                           CompileTimer(), alternatives)

    alternative = build("alternative.json")
    kernel = build("tuning.json", alternative)
    assert kernel.record.external_candidates == ["dzc.triton"]
    assert kernel.record.alternatives == [alternative.record]
    for tokens in TOKENS:
        x, residual, weight = (torch.randn(n, 64).bfloat16() for n in (tokens, tokens, 1))
        y, h = kernel(x, residual, weight[0], 1e-6)
        _, expected_h = add_rms_norm_reference(x, residual, weight[0], 1e-6, False, True, torch.bfloat16,
                                               torch.bfloat16)
        assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)  # the interpreter truncates the sum's cast
        expected_y, _ = add_rms_norm_reference(h, torch.zeros_like(h), weight[0], 1e-6, False, True, torch.bfloat16,
                                               torch.bfloat16)
        assert_hf_rms_norm_output_close(y, h, weight[0], 1e-6, expected_y)
    for bucket in (4, 16):
        entry = kernel.record.tuned[bucket]
        assert entry["how"].startswith("timed") and entry["external"] in (None, "dzc.triton"), entry
        assert "external dzc.triton" not in entry["external_failures"], entry
        # The alternative picked its own config for the bucket before it was timed as a whole.
        assert alternative.record.tuned[bucket]["how"].startswith("timed"), alternative.record.tuned
    text = str(CompileReport("cuda:sm_90", "codegen=auto", kernels=[kernel.record]))
    assert f"candidate dzc.triton: {alternative.record.kernel_id}" in text and "tokens <= 16" in text, text

    # A later process (new kernels, the same databases): the primary's entry answers, and the alternative runs
    # only where it won.
    winner = kernel.record.tuned[4]["external"]
    alternative = build("alternative.json")
    kernel = build("tuning.json", alternative)
    x, residual, weight = (torch.randn(n, 64).bfloat16() for n in (3, 3, 1))
    kernel(x, residual, weight[0], 1e-6)
    assert kernel.record.tuned[4]["from_cache"] and kernel.record.tuned[4]["external"] == winner
    assert sorted(alternative.record.tuned) == ([4] if winner else []), (winner, alternative.record.tuned)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_codegen_tunes_across_codegens_on_gpu(tmp_path, seed):
    """On a GPU with TileLang, dzc.compile with codegen "auto" and tuning offers add_rms_norm's TileLang kernel (its
    untuned default) to its Triton kernel's tuner: timed and checked like a config, shown in the report, and the
    compiled model matches eager whichever wins."""
    if tilelang_codegen.import_problem() is not None:
        pytest.skip(f"TileLang is not importable: {tilelang_codegen.import_problem()}")
    model = AddRMSNorm().bfloat16().cuda()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=True))
    for tokens in (3, 300):
        x, residual = (torch.randn(tokens, 64, device="cuda").bfloat16() for _ in range(2))
        y, h = compiled(x, residual)
        assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    assert compiled.report.fired() == {"fuse_residual_norm": 1}
    [kernel] = compiled.report.kernels
    assert kernel.codegen == "triton" and [a.codegen for a in kernel.alternatives] == ["tilelang"], kernel
    assert sorted(kernel.tuned) == [4, 512] and sorted(kernel.alternatives[0].tuned) == [4, 512]
    for bucket, entry in kernel.tuned.items():
        assert entry["external"] in (None, "dzc.tilelang"), entry
        assert "external dzc.tilelang" not in entry["external_failures"], entry
        assert kernel.alternatives[0].tuned[bucket]["how"] == "untuned default"
    assert "candidate dzc.tilelang" in str(compiled.report)


def test_compiled_kernels_keep_only_configs_that_agree_with_the_default(tmp_path, seed, monkeypatch):
    """Through dzc.compile: every config but the untuned default writes a wrong output (the real kernel runs, then
    its output is shifted, as a miscompiled tiling would leave it). The tuner times the default first, skips every
    other config as a wrong result, and the compiled model still matches eager."""
    model = AddRMSNorm().bfloat16()
    untuned = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / "untuned"), autotune=False))
    untuned(torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16())
    [untuned_kernel] = untuned.report.kernels
    default = untuned_kernel.tuned[4]["config"]
    real_launch = add_rms_norm.triton_launch

    def launch_wrong_unless_default(kernel, config, x, residual, weight, eps, y, h):
        real_launch(kernel, config, x, residual, weight, eps, y, h)
        if str(config) != default:
            y.add_(1.0)

    monkeypatch.setattr(add_rms_norm, "triton_launch", launch_wrong_unless_default)
    compiled, _ = compile_tuned_and_check(model, tmp_path / "tuned", TOKENS)
    [kernel] = compiled.report.kernels
    legal = kernel.configs_considered - kernel.configs_illegal
    assert legal > 1
    for bucket, entry in _tuned(compiled.report).items():
        assert entry["config"] == default, (bucket, entry)
        assert entry["failed_configs"] == legal - 1, (bucket, entry)


def test_every_config_failing_raises(tmp_path, autotune_log):
    def run(cfg):
        raise RuntimeError(f"cannot compile {cfg}")

    database = TuningDatabase(tmp_path / "tuning.json")
    with pytest.raises(RuntimeError, match="every config of k\\[tokens<=16\\] failed"):
        tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(), database=database)
    assert len([m for m in autotune_log if "failed" in m]) == len(CONFIGS)
    assert database.lookup(KEY) is None
    assert not (tmp_path / "tuning.json").exists(), "a failed tuning run must not store anything"


def test_a_malformed_entry_in_a_well_formed_database_is_not_fatal(tmp_path):
    """A hand-edited entry (here: its config removed) must not crash the call that looks it up: the entry is
    unusable, so the kernel is tuned again (or the file set aside, like any other corrupt database)."""
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": FORMAT_VERSION, "entries": {
        TuningDatabase.key_string(KEY): {"key": KEY, "seconds_per_call": 1e-6}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = tune("k[tokens<=16]", KEY, CONFIGS, run=lambda cfg: 1e-6 * cfg.num_warps, bench=lambda fn: fn(),
                      database=TuningDatabase(path))
    assert result.config == CONFIGS[0] and result.from_cache is False


# ---------------------------------------------------------------------------------------------------------
# Stale entries: a stored config is used only while it is legal, and the key names what decides legality


def test_a_stored_config_that_is_no_longer_legal_is_ignored_and_retuned(tmp_path):
    """An entry whose config is not among today's legal configs (the space shrank, a legality rule was added,
    a database came from another dzc) is ignored: the kernel is tuned again, the result says why, and the entry is
    replaced with a legal config."""
    path = tmp_path / "tuning.json"
    pruned = KernelConfig.make(num_warps=32, num_stages=1, ROWS=16, BLOCK=64)  # legal once, not in CONFIGS now
    TuningDatabase(path).store(KEY, {"config": pruned.to_json(), "seconds_per_call": 1e-9})
    ran = []

    def run(cfg):
        ran.append(cfg)
        return 1e-6 * cfg.num_warps

    with pytest.warns(RuntimeWarning, match="not a legal config now"):
        result = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(), database=TuningDatabase(path))
    assert result.from_cache is False and result.config == CONFIGS[0] and ran == CONFIGS
    assert str(pruned) in result.how and "not a legal config now" in result.how, result.how
    assert KernelConfig.from_json(TuningDatabase(path).lookup(KEY)["config"]) == CONFIGS[0]

    ran.clear()
    again = tune("k[tokens<=16]", KEY, CONFIGS, run=run, bench=lambda fn: fn(), database=TuningDatabase(path))
    assert again.from_cache and again.config == CONFIGS[0] and again.how == "tuning database" and ran == []


def test_compiled_kernels_retune_over_an_entry_whose_config_is_illegal(tmp_path, seed):
    """Through dzc.compile: entries of a real tuning database (keyed by the family's config fingerprint) rewritten
    to a config the profile forbids (64 warps = 2048 threads on sm_90) are ignored; the kernel retunes, matches
    eager, and the report says why."""
    from dzc.autotune import config_fingerprint
    from dzc.targets import triton_codegen

    cache = tmp_path / "cache"
    model = AddRMSNorm().bfloat16()
    _compile_and_check(model, cache)
    path = cache / "tuning.json"
    data = json.loads(path.read_text())
    fingerprint = config_fingerprint(add_rms_norm, triton_codegen)
    assert all(e["key"]["config_fingerprint"] == fingerprint for e in data["entries"].values())
    illegal = KernelConfig.make(num_warps=64, num_stages=1, ROWS=1)
    for entry in data["entries"].values():
        entry["config"] = illegal.to_json()
    path.write_text(json.dumps(data))

    with pytest.warns(RuntimeWarning, match="not a legal config now"):
        report = _compile_and_check(model, cache)
    for bucket, entry in _tuned(report).items():
        assert entry["from_cache"] is False and entry["config"] != str(illegal), (bucket, entry)
        assert f"ignored the tuning database's config {illegal}: not a legal config now" in entry["how"], entry
    assert all(e["config"] != illegal.to_json() for e in _read_database(path).values())
    assert "not a legal config now" in str(report)


def _module_copy(module, directory, edit=lambda text: text):
    """`module` executed again from an (edited) copy of its source in `directory`, under the same name."""
    import types

    source = Path(module.__file__).read_text()
    copy = directory / Path(module.__file__).name
    copy.write_text(edit(source))
    clone = types.ModuleType(module.__name__)
    clone.__file__ = str(copy)
    exec(compile(copy.read_text(), str(copy), "exec"), vars(clone))
    return clone


def test_the_tuning_key_changes_with_the_config_space_legality_and_templates(tmp_path, monkeypatch):
    """The key's config_fingerprint covers what the generated-source hash does not: the family's config space and
    launch code, the legality rules and the templates. An unedited copy of the family keeps the fingerprint."""
    import shutil

    from dzc import targets
    from dzc.autotune import config_fingerprint
    from dzc.targets import legality, triton_codegen

    def fingerprint(family):
        config_fingerprint.cache_clear()
        return config_fingerprint(family, triton_codegen)

    real = fingerprint(add_rms_norm)
    shutil.copytree(add_rms_norm.TEMPLATES, tmp_path / "templates")
    assert fingerprint(_module_copy(add_rms_norm, tmp_path)) == real
    assert "def triton_configs(" in Path(add_rms_norm.__file__).read_text()
    space = _module_copy(add_rms_norm, tmp_path, lambda t: t.replace("def triton_configs(", "def triton_configs(\n"))
    assert fingerprint(space) != real

    copy = _module_copy(add_rms_norm, tmp_path)
    template = tmp_path / "templates" / "add_rms_norm.triton.py.tmpl"
    template.write_text(template.read_text() + "\n# a changed template\n")
    assert fingerprint(copy) != real

    (tmp_path / "legality").mkdir()
    stricter = _module_copy(legality, tmp_path / "legality", lambda t: t + "\nMAX_THREADS_SEEN = 512\n")
    monkeypatch.setattr(targets, "legality", stricter)
    monkeypatch.setitem(sys.modules, legality.__name__, stricter)
    assert fingerprint(add_rms_norm) != real
    monkeypatch.undo()
    assert fingerprint(add_rms_norm) == real



def test_top_k_candidates_agree_on_their_selected_logits_exactly():
    """Integer results (top-k positions) are compared through the family's agreement_values: each row's selected
    logits, sorted, exactly. Another position of a tied logit agrees; a position swapped for the next-best logit
    (close in value: no tolerance would tell) disagrees, and so does a -1 where a -inf logit was selected."""
    from dzc.targets import dsa_topk

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 64, generator=generator)
    logits[0, 7] = logits[0, 9] = 5.0  # a tie among the selected
    logits[3, :] = float("-inf")
    logits[3, :2] = 1.0
    lengths = torch.tensor([64, 64, 64, 3], dtype=torch.int32)
    inputs = (logits, lengths, 8)
    right = logits.topk(8, dim=1).indices.int()
    right[3, 3:] = -1  # a row of 3 keys: 3 selected (one of them -inf), the rest -1
    right[3, :3] = torch.tensor([0, 1, 2])
    tie_swapped = right.clone()
    tie_swapped[0] = torch.where(right[0] == 7, 9, torch.where(right[0] == 9, 7, right[0]))
    next_best = right.clone()
    ranked = logits[1].argsort(descending=True)
    next_best[1, right[1].tolist().index(ranked[7].item())] = ranked[8]  # the 8th-best swapped for the 9th
    dropped_inf = right.clone()
    dropped_inf[3, 2] = -1
    out = torch.empty_like(right)
    check, check_external = agreement_check((out,), out, functools.partial(dsa_topk.agreement_values, inputs))
    for config, written in zip(CONFIGS, (right, tie_swapped)):
        out.copy_(written)
        assert check(config) is None
    out.copy_(next_best)
    assert "1 values in 1 rows differ" in check(CONFIGS[2])
    assert "differ" in check_external(dropped_inf)
    assert check_external(tie_swapped.flip(1)) is None  # the same positions in another order


def test_every_family_with_integer_results_says_what_the_tuner_compares():
    """The agreement check compares floating results as they are; a family whose results hold integers (positions,
    whose ties may differ between right answers) must give agreement_values, or its candidates go unchecked."""
    from dzc.ops import OPS
    from dzc.targets import KERNEL_FAMILIES
    from dzc.targets.profiles import SM_90

    checked = set()
    for op, family in KERNEL_FAMILIES.items():
        if family in checked:  # mxfp4_moe_w4a8: the MoE family's cases are mxfp4_moe's
            continue
        checked.add(family)
        [(_name, build), *_] = family.selftest_cases(SM_90)
        results = OPS[op][1](*build(torch.device("cpu"), torch.Generator().manual_seed(0)))
        integers = [r for r in (results if isinstance(results, (tuple, list)) else (results,))
                    if isinstance(r, torch.Tensor) and not r.is_floating_point()]
        assert not integers or hasattr(family, "agreement_values"), op
    assert len(checked) == len(set(KERNEL_FAMILIES.values()))
