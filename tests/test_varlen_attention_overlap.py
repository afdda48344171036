"""OVERLAP=1 of the warp-specialized varlen attention kernel (issue 14, session 38): where it is offered, and its
SASS for sm_90a at head dim 128 beside the untuned choice's (nvcc + cuobjdump, no GPU). Its GPU numerics are cases
of tests/test_varlen_attention_kernels.py (test_tilelang_on_gpu takes every warp-specialized config,
test_kernels_ignore_nan_and_inf_in_other_segments its "d128-bf16-overlap" case)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import sass_tools
import torch

from dzc.targets import TARGETS, tilelang_codegen
from dzc.targets import varlen_attention as family
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.profiles import SM_90

BF16 = torch.bfloat16


def _params(config):
    return dict(config.params)


def test_overlap_offered_on_sm_90_warp_specialized_128_key_blocks_only():
    """Beside each warp-specialized config with 128-key blocks (ping-pong or not, split columns where the head dim
    has them), never the untuned choice; refused with a reason on the pipelined kernel and on targets without the
    warp-specialized kernel."""
    for head_dim in (72, 80, 128):
        for rope in (None, torch.float32):
            spec = family.make_spec(head_dim, BF16, rope)
            configs = family.tilelang_configs(spec, SM_90)
            overlapped = [c for c in configs if _params(c).get("OVERLAP")]
            base = [c for c in configs if _params(c).get("WARP_SPECIALIZED") and c["BLOCK_N"] == 128
                    and not _params(c).get("OVERLAP") and not _params(c).get("LONGEST_FIRST")]
            assert len(base) == (2 if head_dim == 128 else 4)
            assert [{k: v for k, v in _params(c).items() if k != "OVERLAP"} for c in overlapped] == \
                [_params(c) for c in base]
            assert not _params(family.tilelang_default_config(spec, SM_90)).get("OVERLAP")
            assert all(family.overlap_problem(spec, SM_90, c) is None for c in overlapped)
            pipelined = next(c for c in configs if not _params(c).get("WARP_SPECIALIZED"))
            with_overlap = KernelConfig.make(pipelined.num_warps, pipelined.num_stages, **_params(pipelined),
                                             OVERLAP=1)
            assert "WARP_SPECIALIZED=1" in family.overlap_problem(spec, SM_90, with_overlap)
            for name in ("cuda:sm_80", "musa:mp_22", "musa:mp_31"):
                profile = TARGETS[name].profile
                assert not any(_params(c).get("OVERLAP") for c in family.tilelang_configs(spec, profile))
                assert "no warp-specialized kernel" in family.overlap_problem(spec, profile, overlapped[0])


def test_the_pipelined_kernel_refuses_overlap(tmp_path):
    """The template's factory refuses OVERLAP=1 without the warp-specialized kernel (TileLang schedules the
    pipelined one itself) rather than building it unchanged."""
    if tilelang_codegen.import_problem():
        pytest.skip(tilelang_codegen.import_problem())
    spec = family.make_spec(128, BF16, None)
    pipelined = next(c for c in family.tilelang_configs(spec, SM_90) if not _params(c).get("WARP_SPECIALIZED"))
    path = tmp_path / "varlen_attention_tilelang.py"
    path.write_text(family.tilelang_source(spec, SM_90))
    with pytest.raises(ValueError, match="WARP_SPECIALIZED=1"):
        tilelang_codegen.build_prim_func(path, family.TILELANG_FACTORY_NAME,
                                         KernelConfig.make(pipelined.num_warps, pipelined.num_stages,
                                                           **_params(pipelined), OVERLAP=1))


def _consumer_loop_regions(sass: str) -> list[dict[str, int]]:
    """For each consumer key-block loop (a backward branch over a `WARPGROUP.DEPBAR.LE gsb0, 0x1` or 0x2): counts of
    MUFU.EX2, FMNMX, FADD and FMUL in its parts: `issue`, from the start to the last WARPGROUP.ARRIVE (S's MMA
    issued, P V's not yet); `under`, from the `DEPBAR.LE gsb0, 0x1` (S ready, P V of the previous block in flight)
    to the loop's `DEPBAR.LE gsb0, 0x0`; `after`, from that wait on (no MMA of the warpgroup in flight)."""
    instructions = [(int(a, 16), text.strip()) for a, text in
                    re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in instructions:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= address:
            continue
        body = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
        waits = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR.LE")]
        if len(waits) != 2 or body[waits[0]].endswith("0x0"):
            continue

        def count(part, opcode):
            return sum(re.sub(r"^@!?U?P\w+\s+", "", t).startswith(opcode) for t in part)
        arrives = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.ARRIVE")]
        parts = (("issue", body[:arrives[-1]]), ("under", body[waits[0]:waits[1]]), ("after", body[waits[1]:]))
        loops.append({f"{where}_{op}": count(part, op) for where, part in parts
                      for op in ("MUFU.EX2", "FMNMX", "FADD", "FMUL")} | {"HGMMA": count(body, "HGMMA")})
    return loops


@pytest.fixture(scope="module")
def sass_128(tmp_path_factory):
    """SASS and ptxas reports of the untuned choice and its OVERLAP=1 twin, at head dim 128 (two lowerings and nvcc
    compiles, ~15 s each)."""
    if tilelang_codegen.import_problem():
        pytest.skip(tilelang_codegen.import_problem())
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    cuobjdump = sass_tools.cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's)")
    spec = family.make_spec(128, BF16, None)
    default = family.tilelang_default_config(spec, SM_90)
    overlapped = KernelConfig.make(default.num_warps, default.num_stages, **_params(default), OVERLAP=1)
    assert overlapped in family.tilelang_configs(spec, SM_90)
    results = {}
    for name, config in (("default", default), ("overlap", overlapped)):
        work = tmp_path_factory.mktemp(name)
        path = work / "varlen_attention_tilelang.py"
        path.write_text(family.tilelang_source(spec, SM_90))
        cuda = tilelang_codegen.lower_to_device_source(path, family.TILELANG_FACTORY_NAME, config, SM_90)
        report = tilelang_codegen.ptxas_report(cuda, SM_90, work / "nvcc", fast_math=True)
        [obj] = (work / "nvcc").glob("*.o")
        sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        results[name] = (cuda, report, sass)
    return results


def test_overlap_keeps_the_softmax_under_the_previous_blocks_mma(sass_128):
    """The untuned kernel's loop: S and P V issued (16 HGMMA 64x128x16), then `DEPBAR.LE gsb0, 0x1` (S ready), but
    the whole softmax (row max FMNMX, MUFU.EX2, row sums FADD) and O's rescale (64 FMUL) after `DEPBAR.LE gsb0,
    0x0`, i.e. after P V is done. OVERLAP=1: the softmax between the two waits (twice: the mask's two branches), the
    rescale between S's issue and P V's; after the last wait only P's conversion."""
    (default,) = _consumer_loop_regions(sass_128["default"][2])
    (overlap,) = _consumer_loop_regions(sass_128["overlap"][2])
    assert default["HGMMA"] == overlap["HGMMA"] == 16
    assert default["under_MUFU.EX2"] == 0 and default["after_MUFU.EX2"] >= 64, default
    assert default["after_FMNMX"] >= 64 and default["after_FADD"] >= 64, default
    assert overlap["under_MUFU.EX2"] >= 2 * 64 and overlap["after_MUFU.EX2"] == 0, overlap
    assert overlap["under_FMNMX"] >= 2 * 64 and overlap["after_FMNMX"] == 0, overlap
    assert overlap["under_FADD"] >= 2 * 64 and overlap["after_FADD"] == 0, overlap
    assert default["issue_FMUL"] == 0 and default["after_FMUL"] >= 64, default
    assert overlap["issue_FMUL"] >= 64 and overlap["after_FMUL"] == 0, overlap


def test_overlap_compiles_without_more_registers_or_spills(sass_128):
    """The consumers' registers and the spills (the producer's 4 bytes in 24 registers at head dim 128, as the
    untuned kernel has them) stay as they were."""
    def numbers(report):
        registers = int(re.search(r"Used (\d+) registers", report).group(1))
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
        return registers, spills
    assert numbers(sass_128["overlap"][1]) == numbers(sass_128["default"][1])
    assert max(numbers(sass_128["overlap"][1])[1]) <= 4
    cuda = sass_128["overlap"][0]
    assert "wait_wgmma<1>" in cuda and "tl::warpgroup_reg_alloc<240>" in cuda
