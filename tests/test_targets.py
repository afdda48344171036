"""Targets: the target table, config legality on every profile (MUSA included), MUSA code generated but never run
on a machine without a MUSA GPU, ahead-of-time Triton compilation for CUDA profiles, and unsupported devices."""

import itertools
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_ahead_of_time_script

import dzc
from dzc.capture import _execution_for
from dzc.models.decoder import AddRMSNorm
from dzc.runtime import NotRunnableError
from dzc.targets import TARGETS, add_rms_norm, resolve_target, triton_codegen
from dzc.targets.launch import legal_configs
from dzc.targets.legality import config_problems
from dzc.targets.profiles import MP_22


def _bf16(*shape):
    return torch.randn(*shape).bfloat16()


# ---------------------------------------------------------------------------------------------------------
# Target names


def test_unknown_target_names_the_valid_ones():
    with pytest.raises(ValueError) as err:
        dzc.compile(AddRMSNorm(), target="rocm")
    message = str(err.value)
    assert "'rocm'" in message
    for valid in ("cuda", "musa", "cuda:sm_90", "cuda:sm_80", "musa:mp_22", "musa:mp_31"):
        assert valid in message, (valid, message)


@pytest.mark.parametrize("name, profile", [("cuda", "cuda:sm_90"), ("musa", "musa:mp_31"),
                                           ("cuda:sm_80", "cuda:sm_80"), ("musa:mp_22", "musa:mp_22")])
def test_vendor_names_resolve_to_profiles(name, profile):
    assert resolve_target(name).profile.name == profile
    assert resolve_target(name).name == profile


# ---------------------------------------------------------------------------------------------------------
# Config legality


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HIDDENS = (64, 2880, 7168)


def _spec(hidden, dtype):
    return add_rms_norm.AddRmsNormSpec(hidden, dtype, dtype, dtype, dtype, dtype, False, True)


def _triton_problems(profile, spec, config):
    return config_problems(profile, threads=config.num_warps * profile.warp_size, num_warps=config.num_warps,
                           shared_memory_bytes=add_rms_norm.triton_shared_memory_bytes(spec, config),
                           dtypes=spec.dtypes)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_emitted_triton_config_is_legal(name):
    profile = TARGETS[name].profile
    for hidden, dtype in itertools.product(HIDDENS, DTYPES):
        spec = _spec(hidden, dtype)
        legal, illegal = legal_configs(add_rms_norm, "triton", spec, profile)
        emitted = add_rms_norm.triton_configs(spec, profile)
        assert legal, (name, spec.describe())
        assert len(legal) + illegal == len(emitted)
        for config in legal:
            where = (name, spec.describe(), str(config))
            assert _triton_problems(profile, spec, config) == [], where
            # The same facts, checked independently of config_problems.
            threads = config.num_warps * profile.warp_size
            assert threads <= profile.max_threads_per_block, where
            assert config.num_warps <= profile.max_num_warps, where
            assert config.num_warps & (config.num_warps - 1) == 0, where
            assert add_rms_norm.triton_shared_memory_bytes(spec, config) <= profile.shared_memory_per_block, where
            assert config["BLOCK"] >= hidden, where
        # What legal_configs dropped is exactly what config_problems rejects.
        dropped = [c for c in emitted if c not in legal]
        assert len(dropped) == illegal
        assert all(_triton_problems(profile, spec, c) for c in dropped), (name, spec.describe())
        # The untuned default must be one the tuner could also have picked.
        assert add_rms_norm.triton_default_config(spec, profile) in legal, (name, spec.describe())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_emitted_tilelang_config_is_legal(name):
    profile = TARGETS[name].profile
    for hidden, dtype in itertools.product(HIDDENS, DTYPES):
        spec = _spec(hidden, dtype)
        legal, _ = legal_configs(add_rms_norm, "tilelang", spec, profile)
        assert legal, (name, spec.describe())
        for config in legal:
            assert config_problems(profile, threads=config["THREADS"], num_warps=None,
                                   shared_memory_bytes=add_rms_norm.tilelang_shared_memory_bytes(spec, config),
                                   dtypes=spec.dtypes) == [], (name, spec.describe(), str(config))
            assert config["THREADS"] == config.num_warps * profile.warp_size


def test_pruning_removes_wide_warps_on_mp_22():
    """QY2 warps are 128 lanes: the generic space offers num_warps 16 for large rows, which mp_22 rejects."""
    assert MP_22.warp_size == 128 and MP_22.max_num_warps == 8
    total_illegal = 0
    for hidden, dtype in itertools.product(HIDDENS, DTYPES):
        spec = _spec(hidden, dtype)
        legal, illegal = legal_configs(add_rms_norm, "triton", spec, MP_22)
        if hidden >= 2880:
            assert illegal > 0, spec.describe()
        total_illegal += illegal
        for config in legal:
            assert config.num_warps * 128 <= 1024, str(config)
            assert config.num_warps <= 8, str(config)
        dropped = [c for c in add_rms_norm.triton_configs(spec, MP_22) if c not in legal]
        assert all(c.num_warps * 128 > 1024 for c in dropped), [str(c) for c in dropped]
    assert total_illegal > 0
    # The same space on a 32-lane profile keeps those warp counts.
    spec = _spec(7168, torch.bfloat16)
    _, illegal_sm90 = legal_configs(add_rms_norm, "triton", spec, TARGETS["cuda:sm_90"].profile)
    assert illegal_sm90 == 0


def test_config_problems_reports_each_violation():
    problems = config_problems(MP_22, threads=16 * 128, num_warps=16, shared_memory_bytes=80 * 1024,
                               dtypes=(torch.bfloat16, torch.float8_e4m3fn))
    text = "\n".join(problems)
    assert "2048 threads > 1024" in text
    assert "num_warps=16 > 8" in text
    assert "shared memory" in text
    assert "float8_e4m3fn" in text
    assert config_problems(MP_22, threads=3 * 128, num_warps=3, shared_memory_bytes=0, dtypes=()) == [
        "num_warps=3 is not a power of two"]
    assert config_problems(MP_22, threads=8 * 128, num_warps=8, shared_memory_bytes=1024,
                           dtypes=(torch.bfloat16,)) == []


# ---------------------------------------------------------------------------------------------------------
# MUSA: generated, not run


@pytest.mark.parametrize("target, profile", [("musa", "musa:mp_31"), ("musa:mp_22", "musa:mp_22")])
def test_musa_target_on_cpu_generates_but_does_not_run(target, profile, options):
    compiled = dzc.compile(AddRMSNorm().bfloat16(), target=target, options=options)
    with pytest.raises(NotRunnableError) as err:
        compiled(_bf16(3, 64), _bf16(3, 64))
    message = str(err.value)
    assert "torch_musa" in message, message
    assert "MUSA build of Triton" in message, message

    report = compiled.report
    assert report.target == profile
    assert report.fired() == {"fuse_residual_norm": 1}
    [graph] = report.graphs
    assert graph.execution == "not runnable here"
    assert "torch_musa" in graph.not_runnable_reason
    [kernel] = report.kernels
    assert kernel.op == "add_rms_norm" and kernel.codegen == "triton" and kernel.profile == profile
    assert kernel.execution.startswith("not runnable here")
    source = Path(kernel.source_path)
    assert source.is_file() and source.is_relative_to(options.resolved_cache_dir())
    text = source.read_text()
    assert f"profile {profile}" in text and "@triton.jit" in text
    assert kernel.kernel_id in dict(graph.stages)["lowered"]
    assert kernel.tuned == {}, "nothing ran, so nothing was tuned"


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time Triton compilation for CUDA profiles, no GPU needed


def test_ahead_of_time_compile_refuses_while_interpreting(tmp_path):
    assert triton_codegen.interpreting(), "tests/conftest.py turns the interpreter on without a GPU"
    spec = _spec(64, torch.bfloat16)
    profile = TARGETS["cuda:sm_90"].profile
    path = tmp_path / "kernel.py"
    path.write_text(add_rms_norm.triton_source(spec, profile))
    config = add_rms_norm.triton_default_config(spec, profile)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_codegen.compile_ahead_of_time(path, add_rms_norm.TRITON_KERNEL_NAME,
                                             *add_rms_norm.triton_signature(spec, config),
                                             num_warps=config.num_warps, profile=profile)


def test_import_turns_the_interpreter_on_only_when_unset(monkeypatch):
    """dzc/__init__ picks the interpreter when Triton is not imported yet and there is no GPU, unless the user
    set TRITON_INTERPRET (which is how the ahead-of-time test below keeps it off)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: dzc leaves the interpreter off")
    monkeypatch.delitem(sys.modules, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dzc._select_triton_interpreter()
    assert os.environ["TRITON_INTERPRET"] == "0"
    monkeypatch.delenv("TRITON_INTERPRET")
    dzc._select_triton_interpreter()
    assert os.environ["TRITON_INTERPRET"] == "1"


_AOT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    import torch
    import dzc
    from dzc.targets import add_rms_norm as family, triton_codegen
    from dzc.targets.launch import legal_configs
    from dzc.targets.profiles import SM_80, SM_90

    assert os.environ["TRITON_INTERPRET"] == "0", os.environ["TRITON_INTERPRET"]
    assert not triton_codegen.interpreting()
    out = Path(sys.argv[1])
    results = []
    # (profile, hidden, which config): the default config and the widest legal one.
    for profile, hidden, which in ((SM_90, 2880, "default"), (SM_90, 2880, "last"), (SM_90, 7168, "default"),
                                   (SM_80, 7168, "last")):
        spec = family.AddRmsNormSpec(hidden, *[torch.bfloat16] * 5, False, True)
        legal, _ = legal_configs(family, "triton", spec, profile)
        config = family.triton_default_config(spec, profile) if which == "default" else legal[-1]
        path = out / f"add_rms_norm_{profile.arch}_{hidden}.py"
        path.write_text(family.triton_source(spec, profile))
        kernel = triton_codegen.compile_ahead_of_time(path, family.TRITON_KERNEL_NAME,
                                                      *family.triton_signature(spec, config),
                                                      num_warps=config.num_warps, profile=profile)
        results.append(dict(profile=profile.name, hidden=hidden, config=str(config), legal=config in legal,
                            num_warps=config.num_warps, estimate=family.triton_shared_memory_bytes(spec, config),
                            limit=profile.shared_memory_per_block, shared=kernel.metadata.shared,
                            compiled_warps=kernel.metadata.num_warps, arch=kernel.metadata.target.arch,
                            warp_size=kernel.metadata.target.warp_size, asm=sorted(kernel.asm),
                            ptx_target=".target sm_%d" % profile.compute_capability in kernel.asm["ptx"]))
    print("RESULTS " + json.dumps(results))
""")


def test_triton_kernels_compile_ahead_of_time_for_cuda_profiles(tmp_path):
    results = run_ahead_of_time_script(_AOT_SCRIPT, tmp_path, timeout=300, TRITON_DEFAULT_FP_FUSION="1")
    assert len(results) == 4
    for r in results:
        assert r["legal"], r
        assert "ptx" in r["asm"] and r["ptx_target"], r
        assert r["compiled_warps"] == r["num_warps"], r
        assert r["arch"] == {"cuda:sm_90": 90, "cuda:sm_80": 80}[r["profile"]] and r["warp_size"] == 32, r
        assert r["shared"] <= r["limit"], r
        # The legality check's shared-memory estimate must not undercount what Triton allocates.
        assert r["shared"] <= r["estimate"], r


# ---------------------------------------------------------------------------------------------------------
# Unsupported devices


@pytest.mark.parametrize("name", ["cuda", "musa", "musa:mp_22"])
def test_unsupported_device_type_is_a_value_error(name):
    target = resolve_target(name)
    with pytest.raises(ValueError, match="meta tensors") as err:
        _execution_for(target, torch.device("meta"))
    assert target.profile.torch_device_type in str(err.value)
    assert target.name in str(err.value)


def test_meta_inputs_through_compile_name_the_device_type(options):
    compiled = dzc.compile(AddRMSNorm().to("meta"), target="cuda", options=options)
    with pytest.raises(Exception) as err:
        compiled(torch.randn(3, 64, device="meta"), torch.randn(3, 64, device="meta"))
    # Dynamo wraps a backend's exception in BackendCompilerFailed; the ValueError is its inner exception.
    inner = getattr(err.value, "inner_exception", err.value)
    assert isinstance(inner, ValueError), repr(err.value)
    assert "meta tensors" in str(inner) and "meta tensors" in str(err.value)
