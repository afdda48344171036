"""Packaging and front ends: imports go through the dzc package, every DZC_* variable is a declared knob, dzc-dump
works on a machine without a GPU, and torch.compile(backend="dzc") is registered."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from prewarmed_cli import Job
from prewarmed_cli import run as run_prewarmed

import dzc  # noqa: F401  (registers backend="dzc")
from dzc import config
from dzc.models.decoder import AddRMSNorm
from dzc.pipeline import build_pipeline
from dzc.targets import resolve_target

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("dzc", "passes", "targets", "models", "tests", "tools")
PACKAGE_DIRS = ("dzc", "passes", "targets", "models")


def _python_files(dirs):
    for name in dirs:
        directory = ROOT / name
        if directory.is_dir():
            yield from sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------------------------------------
# Static checks


def test_subpackages_are_imported_through_dzc():
    """passes/, targets/ and models/ install as dzc.passes, dzc.targets, dzc.models; a top-level import of them
    works only from the repository root and breaks once installed."""
    top_level = re.compile(r"^\s*(import|from)\s+(passes|targets|models)\b")
    dynamic = re.compile(r"""import_module\(\s*["'](passes|targets|models)\b""")
    offending = []
    files = list(_python_files(SOURCE_DIRS))
    assert len(files) > 10, "the scan found too few files: is ROOT right?"
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if top_level.match(line) or dynamic.search(line):
                offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offending, "import these as dzc.<package>:\n" + "\n".join(offending)


def test_every_dzc_environment_variable_is_a_declared_knob():
    declared = {knob.env for knob in config.KNOBS}
    # Every Knob that config.py defines is in KNOBS (so scope() and the docs know it), once.
    defined = [value for value in vars(config).values() if isinstance(value, config.Knob)]
    assert {k.env for k in defined} == declared
    assert len(config.KNOBS) == len(declared), "a knob is declared twice"
    assert all(name.startswith("DZC_") for name in declared)

    name = re.compile(r"\bDZC_[A-Z0-9_]+")
    config_py = ROOT / "dzc" / "config.py"
    templates = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.tmpl"))]
    undeclared = []
    for path in list(_python_files(PACKAGE_DIRS)) + templates:
        if path == config_py:
            continue  # its docs name knobs; its declarations are checked above
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for used in name.findall(line):
                if used.rstrip("_") not in declared:
                    undeclared.append(f"{path.relative_to(ROOT)}:{number}: {used}")
    assert not undeclared, f"not in dzc/config.py KNOBS ({sorted(declared)}):\n" + "\n".join(undeclared)


# ---------------------------------------------------------------------------------------------------------
# dzc-dump


def _env():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    for knob in ("DZC_DUMP_DIR", "DZC_DEBUG", "DZC_AUTOTUNE_LOG"):
        env.pop(knob, None)
    return env


DUMPS = {
    "list": ["--list-models"],
    "kernels": ["llama_decoder", "--target", "musa", "--kernels"],
    "capture": ["llama_decoder", "--target", "musa", "--after", "capture"],
    "json": ["llama_decoder", "--target", "musa", "--json"],
    "bad_after": ["llama_decoder", "--target", "musa", "--after", "nosuchpass"],
    "moe_fp8": ["moe_mxfp4", "--target", "musa:mp_31", "--moe-fp8", "--json"],
    "moe_fp8_mp_22": ["moe_mxfp4", "--target", "musa:mp_22", "--moe-fp8", "--json"],
    "missing_model": ["missing_model"],
    "missing_module": ["pkg.mod:missing"],
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Runs every dzc-dump command line once, `python -m dzc.dump ...`, each in its own process (forked from one
    that has imported torch and dzc: tests/prewarmed_cli.py), several at a time."""
    jobs, caches = {}, {}
    for key, args in DUMPS.items():
        caches[key] = cache = tmp_path_factory.mktemp(f"dump_{key}")
        argv = ["-m", "dzc.dump", *args]
        if key != "list":
            argv += ["--cache-dir", str(cache / "cache")]
        jobs[key] = Job(argv, cwd=str(cache), env={"DZC_CACHE_DIR": str(cache / "env-cache")})
    results = run_prewarmed(jobs, env=_env(), timeout=600)
    for key, result in results.items():
        result.cache = caches[key]
    return results


def _ok(result):
    assert result.returncode == 0, f"{' '.join(result.args)}\n{result.stderr[-6000:]}"
    return result.stdout


def test_dump_lists_the_models(dumps):
    listed = [line.split()[0] for line in _ok(dumps["list"]).splitlines() if line.strip()]
    assert "llama_decoder" in listed and "deepseek_decoder" in listed
    assert listed == sorted(listed)


def test_dump_musa_kernels_without_a_musa_gpu(dumps):
    result = dumps["kernels"]
    out = _ok(result)
    assert "fuse_residual_norm: 4 rewrite(s)" in out
    assert "dzc.add_rms_norm" in out
    assert "musa:mp_31" in out
    assert "import triton" in out
    assert "not run" in out
    assert "==== kernel add_rms_norm.triton." in out
    # The sources went to --cache-dir, not $DZC_CACHE_DIR.
    assert list((result.cache / "cache" / "kernels").glob("add_rms_norm_triton_*.py"))
    assert not (result.cache / "env-cache").exists()


def test_dump_after_capture_prints_only_the_captured_graph(dumps):
    out = _ok(dumps["capture"])
    assert out.count("==== graph ") == 1
    assert "# captured by Dynamo + AOTAutograd" in out
    assert "# built by" not in out and "# lowered for" not in out
    assert "dzc.add_rms_norm" not in out, "the captured graph has no dzc op yet"
    assert "aten.rsqrt" in out
    assert "import triton" not in out, "no --kernels: no kernel sources"


def test_dump_json(dumps):
    data = json.loads(_ok(dumps["json"]))
    assert {k: n for k, n in data["report"]["passes"].items() if n} == {"fuse_residual_norm": 4}
    assert data["report"]["target"] == "musa:mp_31"
    assert data["run"].startswith("compiled, not run")
    # Nested compile regions (on by default): the passes rewrite the layers' shared body once, then run over the
    # graph with the body inlined at each call.
    assert data["report"]["nested_regions"] == "layers: 2 x HFLayer"
    passes = [p.__name__ for p in build_pipeline(resolve_target("musa"))]
    assert [s["stage"] for s in data["stages"]] == ["capture", *(f"repeated_subgraph0.{p}" for p in passes),
                                                    "inline_regions", *passes, "lowered"]
    assert data["kernels"] == {}
    [kernel] = data["report"]["kernels"]
    assert kernel["uses"] == 4 and kernel["profile"] == "musa:mp_31"


def test_dump_moe_fp8_shows_the_w4a8_rewrite_where_the_profile_has_fp8(dumps):
    mp_31 = json.loads(_ok(dumps["moe_fp8"]))
    assert mp_31["report"]["passes"]["quantize_moe_activations"] == 1
    assert [k["op"] for k in mp_31["report"]["kernels"]] == ["mxfp4_moe_w4a8"]
    mp_22 = json.loads(_ok(dumps["moe_fp8_mp_22"]))
    assert mp_22["report"]["passes"]["quantize_moe_activations"] == 0
    [(_, reason)] = mp_22["report"]["refusals"]["quantize_moe_activations"]
    assert "no native FP8" in reason
    assert [k["op"] for k in mp_22["report"]["kernels"]] == ["mxfp4_moe"]


def test_dump_after_an_unknown_stage_lists_the_stages(dumps):
    result = dumps["bad_after"]
    assert result.returncode != 0
    assert "nosuchpass" in result.stderr
    for stage in ("capture", "fuse_residual_norm", "lowered"):
        assert stage in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("key, expected", [("missing_model", "unknown model 'missing_model'"),
                                           ("missing_module", "no module named 'pkg'")])
def test_dump_of_a_model_that_is_not_there_is_one_line(dumps, key, expected):
    result = dumps[key]
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [result.stderr.strip()] and expected in result.stderr, result.stderr
    assert result.stderr.startswith("dzc-dump: error: ")


# ---------------------------------------------------------------------------------------------------------
# Mistakes on the command line and in the environment: one line naming the mistake, exit status 2


def _cli_mains():
    from dzc.dump import main as dump_main
    from dzc.selftest import main as selftest_main
    from dzc.tune import main as tune_main
    return {"dzc-dump": dump_main, "dzc-tune": tune_main, "dzc-selftest": selftest_main}


CLI_MISTAKES = [
    ("dzc-dump", ["missing_model"], "unknown model 'missing_model'"),
    ("dzc-dump", ["dzc.models:missing"], "module 'dzc.models' has no 'missing'"),
    ("dzc-dump", ["os:getcwd"], "its factory returned str"),
    ("dzc-dump", ["llama_decoder", "--target", "rocm"], "unknown dzc target 'rocm'"),
    ("dzc-tune", ["missing_model", "--out", "db.json"], "unknown model 'missing_model'"),
    ("dzc-tune", ["pkg.mod:missing", "--out", "db.json"], "no module named 'pkg'"),
    ("dzc-tune", ["llama_decoder", "--target", "rocm", "--out", "db.json"], "unknown dzc target 'rocm'"),
    ("dzc-selftest", ["--target", "rocm", "--dry-run"], "unknown dzc target 'rocm'"),
]


@pytest.mark.parametrize("prog, argv, expected", CLI_MISTAKES, ids=[" ".join(m[:2][1]) for m in CLI_MISTAKES])
def test_cli_mistakes_are_one_line_and_exit_2(prog, argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _cli_mains()[prog](argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{prog}: error: " + err.strip().removeprefix(f"{prog}: error: ")], err
    assert expected in err, err
    assert not (tmp_path / "db.json").exists()


@pytest.mark.parametrize("knob, value, accepted", [
    ("DZC_DEBUG", "yes", "0, 1, 2 or 3"), ("DZC_AUTOTUNE_LOG", "on", "0 or 1"),
    ("DZC_TUNING_DB", "/no/such/db.json", "dzc-tune --out"), ("DZC_CACHE_DIR", "", "a directory path"),
])
def test_every_knob_value_is_checked_when_dzc_compile_is_called(knob, value, accepted, capsys):
    """A value a knob does not accept is a ConfigError from dzc.compile itself (not at the first call, inside
    Dynamo), naming the variable, the value and what is accepted; the CLIs print it as their one line."""
    with config.scope(**{knob: value}):
        with pytest.raises(config.ConfigError) as err:
            dzc.compile(AddRMSNorm(), "cuda", dzc.CompileOptions())
        assert f"{knob}={value!r}" in str(err.value) and accepted in str(err.value), str(err.value)
        assert _cli_mains()["dzc-dump"](["llama_decoder"]) == 2
    assert capsys.readouterr().err.strip() == f"dzc-dump: error: {str(err.value).removeprefix('dzc: ')}"


def test_every_knob_declares_what_it_accepts():
    for knob in config.KNOBS:
        assert knob.check is not None and knob.accepts != "any value", knob.env
        with config.scope(**{knob.env: knob.default}):
            config.validate()


def test_a_musa_target_on_cpu_tensors_is_a_short_error(tmp_path, seed):
    """Compiled for MUSA, called on CPU tensors without a MUSA device: the NotRunnableError says why, raised from
    dzc.compile's call, not from the kernel ~18 frames down in Dynamo and AOTAutograd."""
    from dzc.runtime import NotRunnableError

    compiled = dzc.compile(AddRMSNorm(), "musa", dzc.CompileOptions(cache_dir=str(tmp_path)))
    with pytest.raises(NotRunnableError, match="cannot run here") as err:
        compiled(torch.randn(3, 64), torch.randn(3, 64))
    frames = [entry.frame.code.name for entry in err.traceback]
    assert len(frames) <= 3, frames  # this test, CompiledModel.__call__
    assert compiled.report.fired() == {"fuse_residual_norm": 1}, "it compiled; only running is refused"


# ---------------------------------------------------------------------------------------------------------
# torch.compile(backend="dzc")


def test_torch_compile_backend_name(tmp_path, monkeypatch, seed):
    from torch._dynamo.backends.registry import lookup_backend

    monkeypatch.setenv("DZC_CACHE_DIR", str(tmp_path / "cache"))  # the registered backend uses default options
    assert "dzc" in torch._dynamo.list_backends()
    torch._dynamo.reset()  # AddRMSNorm.forward may sit in Dynamo's cache, compiled by another test's backend
    registered = lookup_backend("dzc")
    rewrites_before = registered.report.passes.get("fuse_residual_norm", 0)

    model = AddRMSNorm().float()
    compiled = torch.compile(model, backend="dzc")
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        y, h = compiled(x, residual)
        expected_y, expected_h = model(x, residual)
    torch.testing.assert_close(h, expected_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)
    assert registered.report.passes["fuse_residual_norm"] == rewrites_before + 1
    assert registered.report.target == "cuda:sm_90"
    assert list((tmp_path / "cache" / "kernels").glob("add_rms_norm_triton_*.py"))
