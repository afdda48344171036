"""The warp-specialized TileLang sparse attention (MLA, DeepSeek-V3.2's shape) read statically, no GPU: its
ROW_ADDRESS tuning candidate (the producer's 16-byte copies of a gathered token from one 64-bit address at immediate
offsets) is offered beside each split count of the bf16 cache, never as the untuned choice (timed 0.97x the untuned
kernel on the H200, 1.03x on an H100: the tuner decides), and lowers for sm_90a:
its copies read the cache through the chunk-window view with one bounds check a row, ptxas (CUDA 13, fast math)
spills nothing, and the SASS copies use immediate offsets, as the public sparse_mla_fwd_pipelined's do (the plain
page/slot addressing: none). GPU numerics: tests/test_dsa_kernels.py::test_warp_specialized_sparse_attention_on_gpu
(the row-address cases)."""

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from dzc.targets import sparse_attention, tilelang_codegen
from dzc.targets.profiles import SM_90

import sass_tools

DSA_V32 = dict(topk=2048, page_size=64)
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)


def _row_address(config) -> bool:
    return bool(dict(config.params).get("ROW_ADDRESS"))


def _ws_config(spec, splits, row_address):
    [config] = [c for c in sparse_attention.tilelang_configs(spec, SM_90)
                if dict(c.params).get("WARP_SPECIALIZED") and c["SPLITS"] == splits and _row_address(c) == row_address
                and not dict(c.params).get("BALANCED")]  # BALANCED: tests/test_sparse_attention_balanced.py
    return config


def test_row_address_is_a_bf16_tuning_candidate_only():
    """Beside every split count of the bf16 cache's warp-specialized configs (16-head padded blocks too), not for
    the FP8 cache (its producer's address math is a small part of its dequantizing loop), and never the untuned
    choice (which of the two is faster depends on the card: docs/results/sparse_attention_warp_specialized_h200.md)."""
    for heads in (16, 128):
        spec = dataclasses.replace(MLA, heads=heads)
        configs = [c for c in sparse_attention.tilelang_configs(spec, SM_90)
                   if dict(c.params).get("WARP_SPECIALIZED") and not dict(c.params).get("BALANCED")]
        assert {c["SPLITS"] for c in configs if _row_address(c)} == {0, 1, 4, 16}, heads
        assert len(configs) == 8, heads
        assert not _row_address(sparse_attention.tilelang_default_config(spec, SM_90)), heads
    fp8 = dataclasses.replace(MLA, fp8_cache=True)
    assert not any(_row_address(c) for c in sparse_attention.tilelang_configs(fp8, SM_90))


def test_row_address_prefill_lowers_and_compiles_for_sm90a(tmp_path):
    """The 128-head prefill kernel with ROW_ADDRESS: every copy reads k_chunks at a 64-bit offset, chunk x 8 + 64u,
    guarded by the chunk's bounds only; ptxas spills nothing (consumer 0 still at 248 registers); in its SASS at least
    8 of each token's 9 copies take an immediate offset from the first's address."""
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(MLA, SM_90))
    source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME,
                                                     _ws_config(MLA, 0, True), SM_90)
    assert "tl::warpgroup_reg_alloc<248>" in source and "wgmma" in source
    copies = re.findall(r"cp_async_gs_conditional<16>\((.*)\);", source)
    assert len(copies) == 1, copies  # the unrolled loop's one statement
    assert "k_chunks[((((int64_t)u) * (int64_t)64) + (chunk_local[r_2] * (int64_t)8))]" in copies[0], copies[0]
    guard = copies[0].rsplit("])), ", 1)[1]
    assert "chunk_local[r_2]" in guard and "u)" not in guard, guard  # one check a row, none a copy
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path / "nvcc", fast_math=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(stores == loads == "0" for stores, loads in spills), report
    cuobjdump = sass_tools.cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's)")
    [obj] = (tmp_path / "nvcc").glob("*.o")
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    copies = re.findall(r"LDGSTS\.E\.BYPASS\.128 \[[^]]*\], desc\[\w+\]\[(R\d+\.64)(\+0x[0-9a-f]+)?\]", sass)
    assert len(copies) >= 72, len(copies)  # 4 rows x 9 copies, 2 stages, in the producer's loop
    assert sum(bool(offset) for _, offset in copies) >= 8 * len(copies) // 9 - 1, copies


def test_row_address_padded_decode_split_lowers_for_sm90a(tmp_path):
    """16 heads (one zero-padded head block) in the 16-split decode kernel: the same chunk reads."""
    spec = dataclasses.replace(MLA, heads=16)
    path = tmp_path / "sparse_attention_tilelang.py"
    path.write_text(sparse_attention.tilelang_source(spec, SM_90))
    source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME,
                                                     _ws_config(spec, 16, True), SM_90)
    assert "k_chunks[" in source and "wgmma" in source and "tma_load(q_desc" not in source
