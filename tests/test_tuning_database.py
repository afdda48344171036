"""The shipped tuning database: dzc-tune's export round-trips into CompileOptions(tuning_db=...) and DZC_TUNING_DB,
is refused whole on a device it was not tuned on, and external candidates (a vendor library's kernel) are timed
like configs and win only when faster."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager
from torch import nn

import dzc
from dzc import config
from dzc.autotune import (ExternalCandidate, ShippedTuningDatabase, TuningDatabase, TuningDatabaseError,
                          TuningDatabaseMismatch, open_database, tune)
from dzc.models.decoder import HFRMSNorm
from dzc.targets import INTERPRETER, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.tune import main as tune_main
from dzc.tune import tune_model


class HFAddNorm(nn.Module):
    """dzc.models.decoder.AddRMSNorm(64) with a forward of its own: Dynamo keeps compiled graphs per code object,
    and every dzc.compile is a new backend, so on a torch.compile without isolate_recompiles (dzc.api) a class
    compiled in many tests reaches Dynamo's recompile limit and then runs eagerly (the refusal tests below would
    then see no tuning database at all)."""

    def __init__(self, hidden=64):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)  # ones would hide a missing weight multiply

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


def _model_and_inputs():
    """Fresh random weights and rows (the seed fixture seeds them); the tuning key depends only on the spec."""
    return HFAddNorm().bfloat16(), tuple(torch.randn(5, 64).bfloat16() for _ in range(2))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A database dzc-tune's tune_model exported after tuning a residual add + RMSNorm on this machine (Triton's
    interpreter on the CPU: its runtime is the device here)."""
    if not triton_codegen.interpreting():
        pytest.skip("tunes on CPU tensors, which run Triton kernels only through the interpreter (no GPU here)")
    tmp_path = tmp_path_factory.mktemp("shipped")
    model, inputs = _model_and_inputs()
    out = tmp_path / "shipped.json"
    summary = tune_model(model, [inputs], "cuda", out, runtime=INTERPRETER, device=torch.device("cpu"),
                         model_name="add_norm", cache_dir=str(tmp_path / "tuning-cache"))
    assert summary["entries"] == 1
    return out, summary


def _tuned_entries(compiled) -> list[dict]:
    return [entry for kernel in compiled.report.kernels for entry in kernel.tuned.values()]


def test_export_round_trips_through_tuning_db_and_the_environment(shipped, tmp_path, seed):
    out, summary = shipped
    data = json.loads(out.read_text())
    assert data["kind"] == ShippedTuningDatabase.KIND and data["model"] == "add_norm"
    assert data["device"] == INTERPRETER.tuning_identity(torch.device("cpu"))
    assert data["device"]["arch"].startswith("triton-interpreter") and data["device"]["multiprocessors"] >= 1
    tuned_configs = {entry["config"] for buckets in summary["kernels"].values() for entry in buckets.values()}
    shipped_configs = {str(KernelConfig.from_json(e["config"])) for e in data["entries"].values()}
    assert shipped_configs == tuned_configs

    model, inputs = _model_and_inputs()
    for how in ("option", "environment"):
        cache = tmp_path / f"fresh-{how}"
        options = dzc.CompileOptions(cache_dir=str(cache), autotune=True,
                                     tuning_db=str(out) if how == "option" else None)
        with config.scope(DZC_TUNING_DB=str(out) if how == "environment" else ""):
            compiled = dzc.compile(model, "cuda", options)
            y, h = compiled(*inputs)
        assert compiled.report.passes.get("fuse_residual_norm") == 1
        assert_add_rms_norm_matches_eager(model, *inputs, y, h)
        entries = _tuned_entries(compiled)
        assert entries and all(e["how"] == f"shipped tuning database {out}" for e in entries), entries
        assert {e["config"] for e in entries} <= tuned_configs
        assert not (cache / "tuning.json").exists(), "nothing was timed, so the local database stays empty"


@pytest.mark.parametrize("field, value", [("arch", "mp_31"), ("multiprocessors", 12345), ("triton", "3.2.0 (mtgpu)")])
def test_a_database_from_another_device_is_refused_whole(shipped, tmp_path, seed, field, value):
    out, _ = shipped
    data = json.loads(out.read_text())
    here = data["device"][field]
    data["device"][field] = value
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(data))
    model, inputs = _model_and_inputs()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / "c"), autotune=True,
                                                             tuning_db=str(foreign)))
    with pytest.raises(TuningDatabaseMismatch) as err:
        compiled(*inputs)
    message = str(err.value)
    assert str(foreign) in message and str(value) in message and str(here) in message, message
    if field == "arch":
        assert "another arch" in message


def test_malformed_shipped_databases_are_clear_errors(tmp_path):
    with pytest.raises(TuningDatabaseError, match="does not exist"):
        open_database(tmp_path, str(tmp_path / "missing.json"))
    local = tmp_path / "tuning.json"
    TuningDatabase(local).store({"op": "x"}, {"config": KernelConfig.make(ROWS=1).to_json()})
    with pytest.raises(TuningDatabaseError, match="not a shipped tuning database"):
        open_database(tmp_path, str(local))
    (tmp_path / "text.json").write_text("{not json")
    with pytest.raises(TuningDatabaseError, match="is not JSON"):
        open_database(tmp_path, str(tmp_path / "text.json"))
    assert open_database(tmp_path, None).shipped is None


@pytest.mark.parametrize("how", ["option", "environment"])
@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("{not json", "is not JSON")])
def test_a_missing_or_malformed_tuning_db_fails_dzc_compile_itself(tmp_path, how, content, problem):
    """Checked by dzc.compile, not at the first call (where Dynamo would wrap it in BackendCompilerFailed), with
    the file, the problem and where it was named."""
    path = tmp_path / "db.json"
    if content is not None:
        path.write_text(content)
    options = dzc.CompileOptions(cache_dir=str(tmp_path / "c"), autotune=True,
                                 tuning_db=str(path) if how == "option" else None)
    if how == "environment" and content is None:  # the knob's own check: DZC_TUNING_DB must name a file
        problem = "DZC_TUNING_DB=.* is not accepted \\(no such file\\)"
    with config.scope(DZC_TUNING_DB=str(path) if how == "environment" else ""):
        with pytest.raises(ValueError, match=problem) as err:
            dzc.compile(HFAddNorm(), "cuda", options)
    assert str(path) in str(err.value)
    if "accepted" not in str(err.value):
        assert isinstance(err.value, TuningDatabaseError)
        assert ("CompileOptions.tuning_db" if how == "option" else "DZC_TUNING_DB") in str(err.value)


def test_dzc_tune_without_the_device_names_what_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(torch, "musa", raising=False)
    assert tune_main(["llama_decoder", "--target", "musa", "--out", str(tmp_path / "db.json")]) == 2
    assert "torch_musa" in capsys.readouterr().err
    assert not (tmp_path / "db.json").exists()


def _sleeper(seconds: float):
    def run(*_):
        time.sleep(seconds)
    return run


def test_external_candidates_are_timed_like_configs_and_kept_as_an_option(tmp_path):
    """A faster external candidate wins and is recorded by name; a process without it installed falls back to
    the best config from the same record; a slower one never wins."""
    configs = [KernelConfig.make(num_warps=w, ROWS=1) for w in (1, 2)]
    run = {configs[0]: _sleeper(0.004), configs[1]: _sleeper(0.012)}
    fast = ExternalCandidate("vendor.fast_kernel", _sleeper(0.0002))
    database = TuningDatabase(tmp_path / "tuning.json")
    bench = lambda fn: INTERPRETER.bench(fn, torch.device("cpu"))  # noqa: E731

    result = tune("op", {"k": 1}, configs, lambda c: run[c](), bench, database, externals=[fast],
                  run_external=lambda e: e.fn())
    assert result.external == fast and result.config == configs[0]
    assert set(result.timings) == {str(configs[0]), str(configs[1]), "external vendor.fast_kernel"}
    again = tune("op", {"k": 1}, configs, lambda c: run[c](), bench, database, externals=[fast],
                 run_external=lambda e: e.fn())
    assert again.from_cache and again.external == fast
    without = tune("op", {"k": 1}, configs, lambda c: run[c](), bench, database)
    assert without.from_cache and without.external is None and without.config == configs[0]

    slow = ExternalCandidate("vendor.slow_kernel", _sleeper(0.04))
    lost = tune("op", {"k": 2}, configs, lambda c: run[c](), bench, database, externals=[slow],
                run_external=lambda e: e.fn())
    assert lost.external is None and lost.config == configs[0]
    record = database.lookup({"k": 2})
    assert record["external"] is None and record["external_seconds_per_call"] > record["seconds_per_call"]


def test_a_shipped_config_that_is_no_longer_legal_is_ignored_retuned_and_reported(shipped, tmp_path, seed):
    """A shipped database is read-only: an entry whose config is not legal now (made by a dzc with another config
    space) is ignored, the kernel is tuned into the local database, and every later compile, which takes the
    local entry, still says that the shipped one was ignored."""
    out, _ = shipped
    data = json.loads(out.read_text())
    illegal = KernelConfig.make(num_warps=64, ROWS=1)  # 2048 threads: over sm_90's limit
    for entry in data["entries"].values():
        entry["config"] = illegal.to_json()
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(data))
    model, inputs = _model_and_inputs()
    cache = tmp_path / "cache"
    for attempt in ("retuned", "local"):
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(cache), autotune=True,
                                                                 tuning_db=str(stale)))
        with pytest.warns(RuntimeWarning, match="not a legal config now"):
            y, h = compiled(*inputs)
        assert_add_rms_norm_matches_eager(model, *inputs, y, h)
        entries = _tuned_entries(compiled)
        assert entries, attempt
        for entry in entries:
            assert entry["config"] != str(illegal), (attempt, entry)
            assert f"ignored the shipped tuning database {stale}'s config {illegal}" in entry["how"], entry
            assert entry["from_cache"] is (attempt == "local"), (attempt, entry)
        assert (cache / "tuning.json").exists()
