"""CLUSTER=2, the warp-specialized TileLang sparse attention's two-CTA "crossover" over the FP8 latent cache
(FlashMLA's design, issue 14): the two 64-head blocks of a query row run as one thread block cluster, each producer
dequantizes half of every KV tile's rows and copies them into both CTAs' rings (SM-to-SM bulk copies that complete
the peer's k_ready barrier), and a stage is rewritten only once both CTAs' consumers freed it. Static here (no GPU):
where it is offered and refused, that it lowers for sm_90a with the cluster launch and the DSMEM copies and
barriers, that ptxas spills nothing, and the producer loop's SASS against the untuned FP8 decode kernel's. Its GPU
numerics are tests/test_dsa_kernels.py::test_warp_specialized_sparse_attention_on_gpu's cluster cases (campaign step
s37-fp8-cluster)."""

import collections
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dzc.targets import sparse_attention, tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import config_problems, tilelang_config_legal
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90

import sass_tools

DSA_V32 = dict(topk=2048, page_size=64)
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)
FP8 = dataclasses.replace(MLA, fp8_cache=True)


def _cluster(config) -> int:
    return dict(config.params).get("CLUSTER", 0)


def _cluster_config(spec, splits):
    [config] = [c for c in sparse_attention.tilelang_configs(spec, SM_90) if _cluster(c) and c["SPLITS"] == splits]
    return config


def _untuned_fp8(splits):
    """The untuned FP8 choice (interleaved order, no cluster) with `splits` splits."""
    default = sparse_attention.tilelang_default_config(FP8, SM_90)
    return KernelConfig.make(default.num_warps, default.num_stages, **{**dict(default.params), "SPLITS": splits})


def producer_loop_sass(cuobjdump: str, obj: Path) -> list[str]:
    """The SASS of the warp-specialized kernel's producer loop (a stage pair): the longest loop (a backward branch
    to a target after it) between the producer's setmaxnreg.dec and the next setmaxnreg (its warpgroup's code ends
    there; the spin loops of barrier waits sit past the kernel's end, so they are not counted)."""
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    instructions = [(int(m.group(1), 16), m.group(2).strip()) for m in
                    (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    start = next(a for a, text in instructions if "USETMAXREG.DEALLOC" in text)
    end = next(a for a, text in instructions if a > start and "USETMAXREG" in text)
    longest: list[str] = []
    for address, text in instructions:
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if branch and start < int(branch.group(1), 16) < address < end:
            body = [t for a, t in instructions if int(branch.group(1), 16) <= a <= address]
            longest = max(longest, body, key=len)
    return longest


def _opcodes(body: list[str]) -> collections.Counter:
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in body)


def test_cluster_is_an_fp8_tuning_candidate_only():
    """Beside every split count of the FP8 cache's warp-specialized configs at 128 and 256 heads (with the interleaved
    order it extends), never for the bf16 cache or fewer heads, and never the untuned choice (not run on a GPU)."""
    for heads in (128, 256):
        spec = dataclasses.replace(FP8, heads=heads)
        configs = [c for c in sparse_attention.tilelang_configs(spec, SM_90) if _cluster(c)]
        assert {c["SPLITS"] for c in configs} == {0, 1, 4, 16}, heads
        assert all(_cluster(c) == 2 and dict(c.params).get("FP8_INTERLEAVED") == 1 for c in configs), heads
        assert not _cluster(sparse_attention.tilelang_default_config(spec, SM_90)), heads
    for spec in (MLA, dataclasses.replace(FP8, heads=64), dataclasses.replace(FP8, heads=16),
                 dataclasses.replace(FP8, heads=192)):
        assert not any(_cluster(c) for c in sparse_attention.tilelang_configs(spec, SM_90)), spec.describe()


def test_cluster_legality_refuses_it_with_reasons():
    """Each case where the knob does not apply says why: the bf16 cache, heads not a multiple of 128, a profile
    without thread block clusters (sm_80, every MUSA profile); the profile check is legality's too, for any config
    that names CLUSTER."""
    assert sparse_attention.fp8_cluster_problems(FP8, SM_90) == []
    assert "not FP8" in " ".join(sparse_attention.fp8_cluster_problems(MLA, SM_90))
    assert "not a multiple of 128" in " ".join(sparse_attention.fp8_cluster_problems(
        dataclasses.replace(FP8, heads=64), SM_90))
    assert SM_90.thread_block_clusters and not SM_80.thread_block_clusters
    for profile in (SM_80, MP_22, MP_31):
        assert not profile.thread_block_clusters, profile.name
        problems = sparse_attention.fp8_cluster_problems(FP8, profile)
        assert any("thread block clusters" in p and profile.name in p for p in problems), (profile.name, problems)
        assert not any(_cluster(c) for c in sparse_attention.tilelang_configs(FP8, profile)), profile.name
    config = _cluster_config(FP8, 1)
    shared = sparse_attention.tilelang_shared_memory_bytes(FP8, config)
    assert tilelang_config_legal(SM_90, config, shared, FP8.dtypes)
    for profile in (SM_80, MP_31):
        problems = config_problems(profile, threads=384, num_warps=None, shared_memory_bytes=0, dtypes=(),
                                   cluster_size=2)
        assert problems == [f"thread block clusters of 2: {profile.arch} has none"], problems
        assert not tilelang_config_legal(profile, config, 0, ())
    assert config_problems(SM_80, threads=384, num_warps=None, shared_memory_bytes=0, dtypes=()) == []


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """(config, TileLang artifact) of the CLUSTER=2 prefill / 1-split kernel and its 16-split decode kernel, and the
    untuned FP8 kernel's, lowered once for the module."""
    path = tmp_path_factory.mktemp("fp8_cluster") / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(FP8, SM_90))
    configs = {"cluster": _cluster_config(FP8, 0), "cluster-16": _cluster_config(FP8, 16), "untuned": _untuned_fp8(0)}
    return {name: (config, tilelang_codegen.lower(path, sparse_attention.TILELANG_FACTORY_NAME, config, SM_90))
            for name, config in configs.items()}


def test_cluster_kernel_lowers_for_sm90a(lowered):
    """The kernel launches as 2-CTA clusters (the device function's cluster_dims, which TileLang's launcher turns
    into cuLaunchKernelEx's cluster attribute); each producer copies its half tile into the peer's ring as 9 bulk
    SM-to-SM copies of 4 KiB (one per 64-column block) completing the peer's k_ready; both consumers arrive on the
    peer's k_free through mapa, once a warp; the barriers count both CTAs (k_ready: 128 local threads + the peer's
    9 copies; k_free: 256 local threads + 8 remote warps); the cluster synchronizes after their init and before
    exiting. The untuned FP8 kernel has none of it."""
    for name in ("cluster", "cluster-16"):
        config, artifact = lowered[name]
        [function] = artifact.device_mod.functions.values()
        assert [int(d) for d in function.attrs["cluster_dims"]] == [2, 1, 1], name
        assert "tir.cluster_dim_x" in [str(p) for p in function.attrs["tirx.kernel_launch_params"]], name
        source = artifact.kernel_source
        copies = re.findall(r"tl::tma_store_cluster\((.*)\);", source)
        assert len(copies) == 1, copies  # one statement of an unrolled loop over the 9 column blocks
        assert "(int)((1 - (((int)blockIdx.x) & 1)))" in copies[0] and "(uint32_t)(4096)" in copies[0], copies
        assert "bar_k_ready[stage" in copies[0], copies
        assert re.search(r"for \(int (u_\d+) = 0; \1 < 9; \+\+\1\) \{\s*tl::tma_store_cluster", source), name
        assert len(re.findall(
            r"bar_k_free\[stage_?\d*\]\.arrive\(\(1 - \(\(\(int\)blockIdx\.x\) & 1\)\)\);", source)) == 2, name
        for stage in (0, 1):
            assert f"bar_k_ready[{stage}].init(137);" in source and f"bar_k_free[{stage}].init(264);" in source
        assert source.count("tl::cluster_sync();") == 2, name
        assert source.index("tl::fence_barrier_init();") < source.index("tl::cluster_sync();")
        assert source.rindex("tl::cluster_sync();") > source.rindex(".arrive("), name  # the last statement
    _, untuned = lowered["untuned"]
    [function] = untuned.device_mod.functions.values()
    assert "cluster_dims" not in function.attrs
    assert "cluster" not in untuned.kernel_source.replace("tl_templates/cuda/cluster.h", "")


def test_cluster_kernel_compiles_without_spills(lowered, tmp_path):
    """ptxas (CUDA 13, sm_90a, fast math): no spills in either CLUSTER=2 kernel. The producer loop (a stage pair)
    against the untuned FP8 kernel's: half the e4m3 unpacks and bf16 packs (each token dequantized once per 128
    heads), under 70% of its instructions (2026-12-05: 1617 against 2618), 18 bulk copies (UBLKCP)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    objects = {}
    for name, (_, artifact) in lowered.items():
        workdir = tmp_path / name
        obj, report = tilelang_codegen._nvcc(artifact.kernel_source, SM_90, workdir, True, ("-Xptxas", "-v"))
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(stores == loads == "0" for stores, loads in spills), (name, report)
        objects[name] = obj
    cuobjdump = sass_tools.cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump")
    cluster = producer_loop_sass(cuobjdump, objects["cluster"])
    untuned = producer_loop_sass(cuobjdump, objects["untuned"])
    ops, base = _opcodes(cluster), _opcodes(untuned)
    assert base["F2FP.F16.E4M3.UNPACK_B"] and ops["F2FP.F16.E4M3.UNPACK_B"] * 2 == base["F2FP.F16.E4M3.UNPACK_B"]
    assert ops["F2FP.BF16.F32.PACK_AB"] * 2 == base["F2FP.BF16.F32.PACK_AB"]
    assert ops["UBLKCP.S.S"] == 18 and not base["UBLKCP.S.S"]
    assert len(cluster) < 0.7 * len(untuned), (len(cluster), len(untuned))

