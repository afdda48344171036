"""The warp-specialized prefill form of dzc's TileLang FP8 indexer (WARP_SPECIALIZED=1; issue 14).

A tuning candidate, never the untuned choice (it has not run on a GPU). CPU: where it is offered and where it is
refused (plain reasons: no wgmma / async proxy, not the FP8 cache, too many heads for one MMA's N); lowered for sm_90a
its CUDA source has the three roles (setmaxnreg up for the two consumer warpgroups, down for the producer), the
ring's mbarriers (cp.async completing k_ready, the consumers freeing k_free), one e4m3 × e4m3 wgmma a consumer
tile; nvcc compiles it with no spills. GPU (marked gpu): 2 and 4 rows a program against the op's plain-torch
reference on seeded ragged batches (decode rows, causal prefill rows at sequence boundaries, contexts ending
mid-tile) in shuffled pages of 16 to 128 tokens, with NaN-poisoned outputs.
"""

import re
import shutil

import pytest
import torch

from dzc.ops.dsa import dsa_indexer_reference
from dzc.targets import dsa_cases, dsa_indexer, tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90

FP8 = dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True)
BF16 = dsa_indexer.DsaIndexerSpec(64, 128, torch.bfloat16, False)
requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _ws_configs(spec=FP8, profile=SM_90) -> list[KernelConfig]:
    return [c for c in dsa_indexer.tilelang_configs(spec, profile) if dsa_indexer.warp_specialized(c)]


def _ws_config(rows: int = 2) -> KernelConfig:
    [config] = [c for c in _ws_configs() if c["ROWS"] == rows]
    return config


def _with_page_size(config: KernelConfig, page_size: int) -> KernelConfig:
    return KernelConfig.make(num_warps=config.num_warps, num_stages=config.num_stages, **dict(config.params),
                             PAGE_SIZE=page_size)


# ---------------------------------------------------------------------------------------------------------
# Where the knob applies (no lowering)


def test_offered_on_hopper_for_the_fp8_cache_and_never_the_untuned_choice():
    legal, _ = legal_configs(dsa_indexer, "tilelang", FP8, SM_90)
    assert [c["ROWS"] for c in _ws_configs()] == [2, 4]
    for config in _ws_configs():
        assert config in legal
        assert (config["THREADS"], config["BLOCK_N"], config.num_warps) == (256, 128, 12)
        assert config["STAGES"] % 2 == 0 and config["STAGES"] >= 3  # a stage always serves the same consumer
        assert dsa_indexer.tilelang_shared_memory_bytes(FP8, config) <= SM_90.shared_memory_per_block
    assert not dsa_indexer.warp_specialized(dsa_indexer.tilelang_default_config(FP8, SM_90))
    for bucket in (1 << 16, 1 << 20, 1 << 23):
        _, chosen = dsa_indexer.configs_for_bucket(FP8, SM_90, bucket, legal,
                                                   dsa_indexer.tilelang_default_config(FP8, SM_90))
        assert not dsa_indexer.warp_specialized(chosen), bucket
    assert not dsa_indexer.warp_specialization_problems(FP8, SM_90)


@pytest.mark.parametrize("profile", [SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_refused_without_wgmma_or_warp_specialization(profile):
    problems = dsa_indexer.warp_specialization_problems(FP8, profile)
    assert any("wgmma" in p for p in problems), problems
    assert any("warp-specialized lowering" in p for p in problems), problems
    assert not any(dsa_indexer.warp_specialized(c) for c in dsa_indexer.tilelang_configs(FP8, profile))


def test_refused_for_specs_it_does_not_take():
    import dataclasses

    assert any("FP8 cache" in p for p in dsa_indexer.warp_specialization_problems(BF16, SM_90))
    assert not any(dsa_indexer.warp_specialized(c) for c in dsa_indexer.tilelang_configs(BF16, SM_90))
    many_heads = dataclasses.replace(FP8, heads=256)
    assert any("one wgmma's N" in p for p in dsa_indexer.warp_specialization_problems(many_heads, SM_90))
    assert not any(dsa_indexer.warp_specialized(c) for c in dsa_indexer.tilelang_configs(many_heads, SM_90))
    # 128 heads: only 2 rows fit one wgmma's N.
    assert [c["ROWS"] for c in _ws_configs(dataclasses.replace(FP8, heads=128))] == [2]
    narrow = dataclasses.replace(FP8, head_dim=64)
    assert any("head_dim" in p for p in dsa_indexer.warp_specialization_problems(narrow, SM_90))


def test_span_is_in_tile_pairs():
    """Decode splits the context in BLOCK_N (128-key) pairs, at least _MIN_TILES_PER_PROGRAM of them; prefill
    rows get the whole context."""
    config = _ws_config()
    assert dsa_indexer.span_tiles(4096, 8192, config, 132) == 8192 // 128
    tiles = dsa_indexer.span_tiles(2, 32768, config, 132)
    assert tiles >= 2 and tiles * 128 < 32768


# ---------------------------------------------------------------------------------------------------------
# Lowered to CUDA for sm_90a, compiled by nvcc


# (rows, page size): 2 rows over DeepSeek's 64-token pages and over 16-token ones (a tile spans four pages), 4 rows.
LOWERED = ((2, 64), (2, 16), (4, 64))


@pytest.fixture(scope="module")
def lowered_ws(tmp_path_factory):
    """(rows, page size) -> the WARP_SPECIALIZED=1 kernel's CUDA source."""
    directory = tmp_path_factory.mktemp("dsa_indexer_ws")
    path = directory / "dsa_indexer_fp8.py"
    path.write_text(dsa_indexer.tilelang_source(FP8, SM_90))
    return {(rows, page_size): tilelang_codegen.lower_to_device_source(
        path, dsa_indexer.TILELANG_FACTORY_NAME, _with_page_size(_ws_config(rows), page_size), SM_90)
        for rows, page_size in LOWERED}


def test_lowered_kernel_has_the_roles_the_ring_and_wgmma(lowered_ws):
    for (rows, page_size), source in lowered_ws.items():
        assert "__launch_bounds__(384, 1)" in source, (rows, page_size)
        # Two consumer warpgroups raise their registers, the producer lowers its own (3 · 168 in all).
        assert len(re.findall(r"warpgroup_reg_alloc<216>", source)) == 2, (rows, page_size)
        assert len(re.findall(r"warpgroup_reg_dealloc<72>", source)) == 1, (rows, page_size)
        # The ring: 4 stages, k_ready completed by the producer's cp.async (one arrival a producer thread), k_free
        # by the consumer that owns the stage.
        assert "bar_k_ready[3].init(128)" in source and "bar_k_free[3].init(128)" in source, (rows, page_size)
        assert "mbarrier_cp_async_arrive_noinc(bar_k_ready[" in source, (rows, page_size)
        assert source.count("cp_async_gs_conditional<16>") == 1 and "cp_async_gs_conditional<4>" in source
        assert len(re.findall(r"bar_k_free\[[^\]]+\]\.arrive\(\)", source)) == 2, (rows, page_size)
        assert len(re.findall(r"bar_k_ready\[[^\]]+\]\.wait\(", source)) == 2, (rows, page_size)
        # One 64-key × rows·64-column FP8 wgmma a consumer tile (4 K steps of 32), each consumer its own, waited on
        # before its epilogue; no chunked cp.async pipeline (no commit groups to drain).
        wgmma = re.findall(r"wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, "
                           rf"tl::DataType::kFloat32, 64, {rows * 64}, 32,", source)
        assert len(wgmma) == 2, (rows, page_size)
        assert source.count("tl::wait_wgmma<0>()") == 2, (rows, page_size)
        assert "cp_async_commit" not in source and "cp_async_wait" not in source, (rows, page_size)


@requires_nvcc
def test_compiles_for_sm90a_without_spills(lowered_ws, tmp_path):
    for (rows, page_size), source in lowered_ws.items():
        report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path / f"nvcc{rows}-{page_size}")
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(stores == loads == "0" for stores, loads in spills), report
        [registers] = map(int, re.findall(r"Used (\d+) registers", report))
        assert registers * 384 <= 65536, report


# ---------------------------------------------------------------------------------------------------------
# GPU: against the op's reference

# (seq_lens, queries per sequence, max_context): decode rows (programs of rows of two sequences), prefill rows at
# sequence boundaries, contexts that end mid-tile (37, 130, 1000, 1500: not multiples of 64), a context wider than
# every sequence, and long causal prefill (an odd number of tiles, so the last tile is consumer 0's).
GPU_CASES = {
    "decode": ([37, 200, 5, 64, 1000], [1, 2, 1, 1, 2], None),
    "prefill": ([37, 130, 5], [6, 10, 3], 150),
    "wide-context": ([90, 140], [2, 3], 600),
    "narrow-context": ([90, 1400], [2, 5], 1000),
    "long-prefill": ([1500, 700], [700, 300], None),
    "deepseek-chunk": ([4100], [257], None),
}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa_indexer_ws_gpu") / "dsa_indexer_fp8.py"
    path.write_text(dsa_indexer.tilelang_source(FP8, SM_90))
    return tilelang_codegen.load(dsa_indexer, path, FP8, SM_90)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, page_size", [(2, 16), (2, 32), (2, 64), (2, 128), (4, 16), (4, 64)])
def test_warp_specialized_matches_reference_on_gpu(rows, page_size, kernels, seed):
    """Each (rows, page size) is its own build (30-60 s on the H200's host): 4 rows over two page sizes only."""
    config = _ws_config(rows)
    for case, (seq_lens, per_seq, max_context) in GPU_CASES.items():
        args = dsa_cases.indexer_args(seq_lens, per_seq, heads=FP8.heads, head_dim=FP8.head_dim, fp8=True,
                                      page_size=page_size, device="cuda",
                                      generator=torch.Generator().manual_seed(seed), max_context=max_context,
                                      dtype=torch.bfloat16, fp8_q=True)
        inputs, outputs, _, logits = dsa_indexer.prepare(FP8, *args)
        for out in outputs:
            out.fill_(float("nan"))
        dsa_indexer.tilelang_launch(kernels, config, *inputs, *outputs)
        torch.cuda.synchronize()
        expected = dsa_indexer_reference(*args)
        what = f"{case} page {page_size} {config}"
        assert not logits.isnan().any(), f"{what}: unwritten or NaN logits"
        assert torch.equal(logits.isinf(), expected.isinf()), f"{what}: −inf (masked) columns differ"
        assert not (logits == float("inf")).any(), what
        scale = expected[expected.isfinite()].abs().max()
        torch.testing.assert_close(logits, expected, atol=2**-10 * scale, rtol=2**-10, msg=lambda m: f"{what}: {m}")
