"""dzc-selftest: the dry run passes for CUDA and MUSA targets on a machine without a GPU, reports what it compiled
and what it could not (and why); asked for a device that is not here, it says what is missing and exits non-zero.
The device mode over a test double of torch.musa is in tests/test_musa_runtime.py; on the H200,
tools/gpu_musa_validation.sh runs `dzc-selftest --target cuda`."""

from __future__ import annotations

import json

import torch

from dzc import selftest
from dzc.targets import KERNEL_FAMILIES


def _dry_run(target: str, tmp_path, *options: str) -> dict:
    out = tmp_path / "selftest.json"
    assert selftest.main(["--target", target, "--dry-run", "--quick", "--json", str(out), "--seed", "7",
                          "--cache-dir", str(tmp_path / "cache"), *options]) == 0
    return json.loads(out.read_text())


def _check_common(report: dict, profile_name: str, codegens=("tilelang", "triton")) -> list[dict]:
    assert report["target"] == profile_name and report["dry_run"] is True and report["ok"] is True
    environment = report["environment"]
    for field in ("torch", "triton_flavour", "triton_version", "tilelang", "tilelang_targets"):
        assert environment[field], field
    assert "device" not in environment, "a dry run touches no device"
    tested = {e["family"] for e in report["results"] if e["status"] != selftest.NO_CASES}
    untested = set(report["families_without_cases"])
    assert tested | untested == set(KERNEL_FAMILIES) and not tested & untested
    assert "add_rms_norm" in tested
    entries = [e for e in report["results"] if e["family"] == "add_rms_norm"]
    assert {e["codegen"] for e in entries} == set(codegens)
    for entry in entries:
        assert entry["status"] == "checked", entry
        assert entry["static_problems"] == [] and entry["configs_legal"] > 0, entry
        assert entry["kernel_id"].startswith(f"add_rms_norm.{entry['codegen']}.")
    # --quick compiles each family's first case per code generator; the rest are generated and checked only.
    compiled = [e for e in entries if not e["compile"]["target"]["status"].startswith("skipped")]
    assert sorted(e["codegen"] for e in compiled) == sorted(codegens)
    for entry in report["results"]:
        if entry["status"] == selftest.UNSUPPORTED:  # a codegen with no kernel for the case's spec: said so
            # TileLang's MoE takes bf16/fp16 activations (targets.mxfp4_moe.tilelang_supports); TileLang has no
            # sparse attention over the FP8 latent cache (Triton takes it).
            assert entry["codegen"] == "tilelang" and (
                (entry["family"] == "mxfp4_moe" and "float32" in entry["case"])
                or (entry["family"] == "sparse_attention" and "fp8" in entry["case"])
                # TileLang's indexer takes heads in multiples of 16 (the cases have 8; dsa_indexer.tilelang_supports)
                or entry["family"] == "dsa_indexer"), entry
        elif entry["status"] != selftest.NO_CASES:
            assert entry["status"] == "checked" and entry["static_problems"] == [], entry
    return compiled


def test_dry_run_for_cuda_compiles_triton_and_lowers_tilelang(tmp_path):
    """Triton for every family; TileLang lowering (seconds to minutes per kernel family on the CI machine) for
    add_rms_norm here; each family's own tests lower its TileLang kernels, and the full dry run is
    `dzc-selftest --target cuda --dry-run`."""
    entries = _check_common(_dry_run("cuda", tmp_path / "triton", "--codegen", "triton"), "cuda:sm_90", ("triton",))
    tilelang = _dry_run("cuda", tmp_path / "tilelang", "--codegen", "tilelang", "--family", "add_rms_norm")
    assert tilelang["ok"] and {e["family"] for e in tilelang["results"]} == {"add_rms_norm"}
    entries += [e for e in tilelang["results"] if not e["compile"]["target"]["status"].startswith("skipped")]
    for entry in entries:
        compiled = entry["compile"]["target"]
        if entry["codegen"] == "triton":
            assert compiled["status"] == "compiled", entry
            assert 0 <= compiled["shared"] <= compiled["shared_limit"] == 227 * 1024, entry
            assert "cuda_proxy" not in entry["compile"]
        else:
            assert compiled["status"] == "lowered to device source", entry
            assert all(lines > 10 for lines in compiled["device_source_lines"].values()), entry


def test_dry_run_for_musa_checks_everything_and_says_what_it_could_not_compile(tmp_path):
    entries = _check_common(_dry_run("musa", tmp_path), "musa:mp_31")
    for entry in entries:
        if entry["status"] == selftest.UNSUPPORTED:  # no kernel for the case's spec (TileLang, FP8 latent cache)
            continue
        compiled = entry["compile"]["target"]
        assert compiled["status"] == "not compiled here", entry
        if entry["codegen"] == "triton":
            assert "triton.backends.mtgpu" in compiled["why"] and "upstream" in compiled["why"], compiled
            # The same source for sm_90 with the same threads per block, against the MUSA limit.
            proxy = entry["compile"]["cuda_proxy"]
            assert proxy["status"] == "compiled" and proxy["shared"] <= proxy["shared_limit"] == 192 * 1024
        else:
            assert "tilelang_musa" in compiled["why"], compiled


def test_without_the_device_it_names_what_is_missing_and_fails(capsys, monkeypatch):
    monkeypatch.delattr(torch, "musa", raising=False)
    assert selftest.main(["--target", "musa"]) == 2
    message = capsys.readouterr().err
    assert "torch_musa" in message and "MUSA build of Triton" in message and "--dry-run" in message
    if not torch.cuda.is_available():
        assert selftest.main(["--target", "cuda:sm_80"]) == 2
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_output_comparison_catches_wrong_and_unwritten_values():
    expected = (torch.randn(4, 8).bfloat16(), torch.arange(5))
    assert selftest.compare_outputs(expected, expected, selftest.DEFAULT_TOLERANCES)["ok"]
    shifted = (expected[0] + 0.25, expected[1])
    assert "beyond atol" in selftest.compare_outputs(shifted, expected, selftest.DEFAULT_TOLERANCES)["why"]
    unwritten = (torch.full_like(expected[0], float("nan")), expected[1])
    assert "NaN" in selftest.compare_outputs(unwritten, expected, selftest.DEFAULT_TOLERANCES)["why"]
    wrong_index = (expected[0], expected[1].flip(0))
    assert "differ" in selftest.compare_outputs(wrong_index, expected, selftest.DEFAULT_TOLERANCES)["why"]
    upcast = selftest.compare_outputs((expected[0].float(), expected[1]), expected, selftest.DEFAULT_TOLERANCES)
    assert not upcast["ok"] and "torch.float32" in upcast["why"] and "torch.bfloat16" in upcast["why"]
