"""Tuning candidates whose kernels have not run on a GPU yet (each family's UNVALIDATED list) stay out of users'
tuning: a kernel that hangs never returns to the tuner, and one that faults leaves the process's CUDA context
unusable, which the tuner's agreement check cannot catch. DZC_TUNE_UNVALIDATED=1 (dzc's GPU campaigns) times them;
the untuned default is never one; the report says what was left out."""

import dataclasses

import pytest
import torch

from dzc import config, lowering
from dzc.autotune import TuningDatabase
from dzc.lowering import Execution, KernelTable
from dzc.ops.add_rms_norm import add_rms_norm_reference
from dzc.report import CompileReport, CompileTimer
from dzc.targets import (INTERPRETER, TARGETS, add_rms_norm, dsa_indexer, dsa_topk, mxfp4_moe, sparse_attention,
                         varlen_attention)
from dzc.targets.launch import legal_configs, tuning_candidates, unvalidated_reason
from dzc.targets.profiles import SM_90

from conftest import assert_close_for_dtype

_MOE = mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
                              "clamped_swiglu", True)
# (family, codegen, spec): each declared entry must name configs that these real config spaces offer on sm_90.
FAMILIES = (
    (sparse_attention, "tilelang", sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False,
                                                                        topk=2048, page_size=64, fp8_cache=True)),
    (sparse_attention, "tilelang", sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False,
                                                                        topk=2048, page_size=64)),  # BALANCED
    (dsa_indexer, "tilelang", dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True)),
    (mxfp4_moe, "triton", _MOE),
    (mxfp4_moe, "triton", dataclasses.replace(_MOE, fp8_activations=True)),
    (mxfp4_moe, "tilelang", _MOE),  # WARP_SPECIALIZED
    (varlen_attention, "tilelang", varlen_attention.make_spec(128, torch.bfloat16, None)),
    (dsa_topk, "tilelang", dsa_topk.DsaTopkSpec()),
)


def test_each_entry_names_offered_candidates_and_never_a_default():
    """Every UNVALIDATED entry matches some legal sm_90 config of a real spec (a misspelt knob would match none and
    gate nothing), and no untuned default (nor a token bucket's) is one."""
    matched = {family.__name__: set() for family, _, _ in FAMILIES}
    for family, codegen, spec in FAMILIES:
        legal, _ = legal_configs(family, codegen, spec, SM_90)
        default = getattr(family, f"{codegen}_default_config")(spec, SM_90)
        assert unvalidated_reason(family, default) is None, (family.__name__, default)
        narrow = getattr(family, "configs_for_bucket", None)
        for bucket in (1, 8, 64, 4096, 1 << 16, 1 << 22) if narrow else ():
            _, bucket_default = narrow(spec, SM_90, bucket, legal, default)
            assert unvalidated_reason(family, bucket_default) is None, (family.__name__, bucket, bucket_default)
        for candidate in legal:
            why = unvalidated_reason(family, candidate)
            if why is not None:
                matched[family.__name__].add(why)
    for family, _, _ in FAMILIES:
        assert len(matched[family.__name__]) == len(family.UNVALIDATED), (family.__name__, matched)


def test_left_out_unless_asked_for(monkeypatch):
    family, codegen, spec = FAMILIES[0]
    # An entry of the test's own (the FP8 cache's CLUSTER=2 passed its GPU numerics in session 39): the gate, not
    # the list of the day, is under test here.
    monkeypatch.setattr(family, "UNVALIDATED", (({"CLUSTER": 2}, "declared by this test"),))
    legal, _ = legal_configs(family, codegen, spec, SM_90)
    default = family.tilelang_default_config(spec, SM_90)
    cluster = [c for c in legal if dict(c.params).get("CLUSTER") == 2]
    assert cluster
    with config.scope(DZC_TUNE_UNVALIDATED="0"):
        kept, left_out = tuning_candidates(family, legal, default)
    assert not any(c in kept for c in cluster) and len(kept) == len(legal) - len(cluster)
    [(why, count)] = left_out.items()
    assert why.startswith("CLUSTER=2: ") and count == len(cluster)
    with config.scope(DZC_TUNE_UNVALIDATED="1"):
        assert tuning_candidates(family, legal, default) == (legal, {})
    with config.scope(DZC_TUNE_UNVALIDATED="yes"), pytest.raises(config.ConfigError, match="DZC_TUNE_UNVALIDATED"):
        tuning_candidates(family, legal, default)


_NORM = add_rms_norm.AddRmsNormSpec(64, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                                    torch.bfloat16, sum_in_fp32=False, cast_before_weight=True)


def _tuned_kernel(tmp_path, name):
    return lowering.alternative_kernel("add_rms_norm", _NORM, "triton", TARGETS["cuda:sm_90"],
                                       Execution(INTERPRETER), KernelTable(), "cpu", tmp_path / name,
                                       TuningDatabase(tmp_path / f"{name}.json"), CompileTimer())


@pytest.mark.parametrize("unvalidated", ["0", "1"])
def test_tuning_never_launches_them(tmp_path, seed, monkeypatch, unvalidated):
    """A real kernel tuned on the interpreter, with its 16-row configs declared unvalidated: they are never
    launched (nor recorded as failures) unless DZC_TUNE_UNVALIDATED=1, the result still matches the op's
    reference, and the report says how many were left out and why."""
    monkeypatch.setattr(add_rms_norm, "UNVALIDATED", (({"ROWS": 16}, "declared by this test"),), raising=False)
    launched = []
    real_launch = add_rms_norm.triton_launch

    def recording_launch(kernel, config, *args):
        launched.append(config)
        return real_launch(kernel, config, *args)

    monkeypatch.setattr(add_rms_norm, "triton_launch", recording_launch)
    with config.scope(DZC_TUNE_UNVALIDATED=unvalidated):
        kernel = _tuned_kernel(tmp_path, f"k{unvalidated}")
        x, residual, weight = (torch.randn(*shape).bfloat16() for shape in ((9, 64), (9, 64), (64,)))
        _, h = kernel(x, residual, weight, 1e-6)
    _, expected_h = add_rms_norm_reference(x, residual, weight, 1e-6, False, True, torch.bfloat16, torch.bfloat16)
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)  # the interpreter truncates the sum's cast
    sixteen = {c for c in legal_configs(add_rms_norm, "triton", _NORM, SM_90)[0] if c["ROWS"] == 16}
    assert len(sixteen) == 4
    entry = kernel.record.tuned[16]
    assert entry["how"] != "untuned default" and entry["failed_configs"] == 0, entry
    report = CompileReport("cuda:sm_90", "autotune")
    report.kernels.append(kernel.record)
    if unvalidated == "1":
        assert sixteen <= set(launched) and kernel.record.configs_unvalidated == {}
        assert "left out of tuning" not in str(report)
    else:
        assert not sixteen & set(launched), launched
        assert kernel.record.configs_unvalidated == {"ROWS=16: declared by this test": 4}
        assert ("left out of tuning: 4 config(s) with ROWS=16: declared by this test (DZC_TUNE_UNVALIDATED=1 times "
                "them)") in str(report)


def test_an_unvalidated_default_is_an_error(tmp_path, monkeypatch):
    """A family whose untuned choice has not run on a GPU is a bug in that family, said at once."""
    monkeypatch.setattr(add_rms_norm, "UNVALIDATED", (({"ROWS": 1}, "declared by this test"),), raising=False)
    with pytest.raises(AssertionError, match="untuned default BLOCK=64 ROWS=1 .* has not run on a GPU"):
        _tuned_kernel(tmp_path, "k")
