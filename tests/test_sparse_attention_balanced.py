"""BALANCED=1, the warp-specialized TileLang sparse attention's consumers split as in FlashMLA's Hopper sparse prefill
(csrc/sm90/prefill/sparse): consumer c computes S = Q K^T and the softmax of stage c of every tile pair, the two
meet once a pair on the rows' new maximum, and each takes half of Dv of both tiles' P V, P in its tile's RoPE
columns. Read statically, no GPU: where the knob is offered and refused (with reasons), that it stays a tuning
candidate (never the untuned choice: no faster at prefill on an H100, session 40), its lowering for sm_90a (the
max exchange, P over the RoPE columns fenced before its barrier), ptxas without spills, and each consumer loop's
SASS against the untuned kernel's (half the score wgmma and softmax each, instead of all in consumer 0). GPU
numerics: the balanced-* cases of tests/test_dsa_kernels.py::test_warp_specialized_sparse_attention_on_gpu."""

import collections
import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from dzc.targets import sparse_attention, tilelang_codegen
from dzc.targets.profiles import SM_80, SM_90

import sass_tools

DSA_V32 = dict(topk=2048, page_size=64)
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)


def _balanced(config) -> bool:
    return bool(dict(config.params).get("BALANCED"))


def _ws_configs(spec, profile=SM_90):
    return [c for c in sparse_attention.tilelang_configs(spec, profile) if dict(c.params).get("WARP_SPECIALIZED")]


def _config(spec, splits, balanced):
    [config] = [c for c in _ws_configs(spec) if c["SPLITS"] == splits and _balanced(c) == balanced
                and not dict(c.params).get("ROW_ADDRESS")]
    return config


def test_balanced_is_offered_for_the_bf16_cache_on_sm90_only():
    """Beside every split count of the bf16 cache (128 heads, and 16: one padded block), never the untuned choice,
    refused with its reasons for the FP8 cache, a RoPE part that is not one tile's rows wide,
    and a target without the warp-specialized kernel."""
    for heads in (16, 128):
        spec = dataclasses.replace(MLA, heads=heads)
        assert not sparse_attention.balanced_problems(spec, SM_90), heads
        assert {c["SPLITS"] for c in _ws_configs(spec) if _balanced(c)} == {0, 1, 4, 16}, heads
        assert all(set(dict(c.params)) >= {"WARP_SPECIALIZED", "BALANCED"} and "ROW_ADDRESS" not in dict(c.params)
                   for c in _ws_configs(spec) if _balanced(c))
        assert not _balanced(sparse_attention.tilelang_default_config(spec, SM_90)), heads
    # No P tile: 8 KiB less shared memory than the untuned kernel, plus the maxima, sums and 2 mbarriers.
    untuned, balanced = _config(MLA, 0, False), _config(MLA, 0, True)
    saved = (sparse_attention.tilelang_shared_memory_bytes(MLA, untuned)
             - sparse_attention.tilelang_shared_memory_bytes(MLA, balanced))
    assert saved == 64 * 64 * 2 - (6 * 4 * 64 + 16), saved

    refused = {
        "FP8": (dataclasses.replace(MLA, fp8_cache=True), SM_90, "the FP8 reader's producer"),
        "RoPE 128": (dataclasses.replace(MLA, d_qk=640), SM_90, "Dqk - Dv = 128 is not 64"),
        "sm_80": (MLA, SM_80, "does not fit"),
    }
    for name, (spec, profile, reason) in refused.items():
        problems = sparse_attention.balanced_problems(spec, profile)
        assert any(reason in p for p in problems), (name, problems)
        assert not any(_balanced(c) for c in sparse_attention.tilelang_configs(spec, profile)), name


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """name -> (config, CUDA source, workdir) of the 128-head prefill kernel, untuned and BALANCED=1, and of the
    16-head 16-split BALANCED=1 decode kernel (TileLang's lowering is the slow part: once for the module)."""
    out = {}
    for name, spec, splits, balanced in (("untuned", MLA, 0, False), ("balanced", MLA, 0, True),
                                         ("balanced-16h-16", dataclasses.replace(MLA, heads=16), 16, True)):
        workdir = tmp_path_factory.mktemp(name)
        path = workdir / "sparse_attention_tilelang.py"
        path.write_text(sparse_attention.tilelang_source(spec, SM_90))
        config = _config(spec, splits, balanced)
        source = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME, config, SM_90)
        out[name] = (config, source, workdir)
    return out


def test_balanced_lowers_for_sm90a(lowered):
    """Both consumers at 216 registers (the producer at 72: 504 x 128 in all); each its own tile's S (its stage's
    valid flags and K), a max exchange and a P announcement a pair (bar_max, bar_p: 256 arrivals), P written over
    its stage's RoPE columns (bf16 elements 32768 + 36864 x stage: the ring's [stage, 64-column block, row, 64]) and
    fenced for the async proxy before bar_p, its own P V issued before the wait on bar_p and the other's after,
    both asynchronous; no P tile and no factor in shared memory."""
    _, source, _ = lowered["balanced"]
    assert source.count("tl::warpgroup_reg_alloc<216>();") == 2 and "reg_alloc<248>" not in source
    assert "tl::warpgroup_reg_dealloc<72>();" in source
    assert "bar_k_ready[0].wait(" in source and "bar_k_ready[1].wait(" in source
    assert "probs" not in source and "factor_shared" not in source
    for consumer in (0, 1):
        start = source.index(f"bar_k_ready[{consumer}].wait(")
        body = source[start:source.index("sum_pair[", start)]
        assert body.count("bar_max[0].arrive();") == 1 and body.count("bar_max[0].wait(") == 1
        assert body.count("bar_p[0].arrive();") == 1 and body.count("bar_p[0].wait(") == 1
        fence = body.index("tl::fence_proxy_async();")
        p_store = body.rindex("((bfloat16_t*)kv_shared) + ", 0, fence)
        assert p_store < fence < body.index("bar_p[0].arrive();")
        # Consumer 1's (threadIdx.x >> 5) x 1024 carries 4096 of its 36864 + 32768.
        assert f"+ {32768 + (36864 - 4096) * consumer}))" in body[p_store:fence], body[p_store:fence]
        # Its own P first (from its stage's RoPE columns), then the other's after bar_p.
        local = body.index(f"(char*)(&(((bfloat16_t*)kv_shared)[0])) + {65536 + 73728 * consumer})")
        remote = body.index(f"(char*)(&(((bfloat16_t*)kv_shared)[0])) + {65536 + 73728 * (1 - consumer)})")
        assert local < body.index("bar_p[0].wait(") < remote
        # Both P V asynchronous, back to back: its own stage freed when the first group retires, the other's after.
        wait_one = body.index("tl::wait_wgmma<1>();")
        assert remote < wait_one < body.index(f"bar_k_free[{consumer}].arrive();") < body.index(
            "tl::wait_wgmma<0>();", wait_one) < body.index(f"bar_k_free[{1 - consumer}].arrive();")
    _, decode, _ = lowered["balanced-16h-16"]
    assert "tma_load(q_desc" not in decode and decode.count("reg_alloc<216>") == 2 and "lse[" in decode


# A 384-thread block (one a multiple of 8 registers a thread, 65536 an SM) launches at 168 registers a thread.
LAUNCH_NREG = 65536 // 384 // 8 * 8


def _setmaxnreg(source: str) -> list[int]:
    """The warpgroups' setmaxnreg counts in the CUDA source: consumer 0, consumer 1, the producer (its branches'
    order)."""
    return [int(n) for n in re.findall(r"tl::warpgroup_reg_(?:alloc|dealloc)<(\d+)>\(\);", source)]


def test_setmaxnreg_stays_within_the_blocks_registers(lowered):
    """setmaxnreg moves registers only within the block's own allocation (168 a thread x 384): a setmaxnreg.inc
    (SASS: USETMAXREG.TRY_ALLOC, retried in a loop) waits until the other warpgroups' setmaxnreg.dec freed enough.
    So the three warpgroups' counts add up to at most 3 x 168 = 504. BALANCED=1 at 216 / 216 / 80 (512) hung on its
    first GPU run (session 39, H100): the producer's 88 x 128 freed registers fall short of the consumers' 2 x 48 x
    128, so a consumer warp's setmaxnreg.inc never returns. 216 / 216 / 72 as FlashMLA's sparse prefill; untuned
    248 / 168 / 80."""
    for name, (_, source, _) in lowered.items():
        counts = _setmaxnreg(source)
        assert len(counts) == 3 and sum(counts) <= 3 * LAUNCH_NREG, (name, counts)
    assert _setmaxnreg(lowered["untuned"][1]) == [248, 168, 80]
    assert _setmaxnreg(lowered["balanced"][1]) == _setmaxnreg(lowered["balanced-16h-16"][1]) == [216, 216, 72]


def _loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (a backward branch's range) of 300+ instructions, smallest first. The
    mbarrier try-wait retries that ptxas puts past the last EXIT branch back into the code too: not loops."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in
                    re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {address: i for i, (address, _) in enumerate(instructions)}
    last_exit = max(i for i, (_, text) in enumerate(instructions) if text.strip() == "EXIT")
    loops = []
    for i, (address, text) in enumerate(instructions[:last_exit]):
        target = re.search(r"\bBRA 0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in at:
            body = instructions[at[int(target.group(1), 16)]:i + 1]
            if len(body) >= 300:
                loops.append(collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split(" ")[0] for _, t in body))
    return sorted(loops, key=lambda c: sum(c.values()))


def _consumer_loops(sass: str) -> list[collections.Counter]:
    """The consumer loops (a stage pair each): the smallest loops holding HGMMA, one per consumer warpgroup."""
    loops = [c for c in _loops(sass) if any(op.startswith("HGMMA") for op in c)]
    return loops[:2]


@pytest.fixture(scope="module")
def compiled(lowered):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    cuobjdump = sass_tools.cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's)")
    out = {}
    for name, (_, source, workdir) in lowered.items():
        report = tilelang_codegen.ptxas_report(source, SM_90, workdir / "nvcc", fast_math=True)
        [obj] = (workdir / "nvcc").glob("*.o")
        sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        out[name] = (report, sass)
    return out


def test_balanced_compiles_without_spills(compiled, lowered):
    """ptxas (CUDA 13, sm_90a, fast math): no spills in the BALANCED prefill and 16-split kernels at 216 registers a
    consumer thread and 72 a producer thread. Every kernel launches at 168 registers a thread (the pool setmaxnreg
    draws from: test_setmaxnreg_stays_within_the_blocks_registers), and its SASS register moves (USETMAXREG) are
    its source's setmaxnreg, within 3 x 168."""
    for name in ("balanced", "balanced-16h-16"):
        report, _ = compiled[name]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(stores == loads == "0" for stores, loads in spills), (name, report)
    for name, (report, sass) in compiled.items():
        assert re.findall(r"Used (\d+) registers", report) == [str(LAUNCH_NREG)], (name, report)
        moves = [int(n, 16) for n in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d+, )?0x([0-9a-f]+) ;", sass)]
        assert sorted(moves) == sorted(_setmaxnreg(lowered[name][1])), (name, moves)


def test_balanced_consumers_share_the_score_gemm_and_softmax(compiled):
    """A consumer loop (a stage pair) of the untuned kernel: consumer 0 72 HGMMA.64x64x16 (both tiles' S) + 8
    HGMMA.64x256x16 and 68 MUFU.EX2, consumer 1 only its 8 HGMMA.64x256x16. With BALANCED=1 each consumer has 36 + 8
    and 34 MUFU.EX2 (its own tile's S and softmax, half of both tiles' P V), 3 wgmma waits (S; then, with both P V
    issued, down to one group and to none) and about half the untuned consumer 0's instructions."""
    untuned = _consumer_loops(compiled["untuned"][1])
    balanced = _consumer_loops(compiled["balanced"][1])
    assert [(c["HGMMA.64x64x16.F32.BF16"], c["HGMMA.64x256x16.F32.BF16"], c["MUFU.EX2"]) for c in untuned] == [
        (0, 8, 0), (72, 8, 68)], untuned
    assert [(c["HGMMA.64x64x16.F32.BF16"], c["HGMMA.64x256x16.F32.BF16"], c["MUFU.EX2"]) for c in balanced] == [
        (36, 8, 34), (36, 8, 34)], balanced
    assert [c["WARPGROUP.DEPBAR.LE"] for c in balanced] == [3, 3], balanced
    # The two P V groups in flight together: one wait down to 1 group a consumer (none in the untuned kernel).
    assert compiled["balanced"][1].count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 2
    assert compiled["untuned"][1].count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 0
    assert [c["WARPGROUP.DEPBAR.LE"] for c in untuned] == [2, 4], untuned
    busiest_untuned = sum(untuned[1].values())
    assert all(sum(c.values()) < 0.6 * busiest_untuned for c in balanced), (balanced, busiest_untuned)
