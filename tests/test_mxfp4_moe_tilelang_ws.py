"""The warp-specialized TileLang W4A16 prefill form of dzc's MXFP4 MoE GEMMs (WARP_SPECIALIZED=1; issue 15), read
statically, no GPU.

TileLang's untuned choice at prefill sizes (from 128 rows an expert): its GPU numerics passed in session 40, and on an
H100 at gpt-oss-120b T=8192 its 128 x 256 4-stage tile took 8730 µs against TileLang's plain tile's 125316 (the
Triton default: 5287). Offered on sm_90 for bf16 activations with K multiples of its 64-wide step, refused with
reasons elsewhere. Its decoder's bit arithmetic,
emulated here, is exact against dzc.mxfp4.dequantize for every byte and scale. Lowered for sm_90a at gpt-oss-120b's
shape, both GEMMs have the three roles (setmaxnreg), the ring's mbarriers and wgmma from shared memory; nvcc
compiles them with no spills, and in the SASS the producer stores decoded weights as STS.128 only (no 16-bit
stores) while the consumers issue HGMMA. The untuned kernel's CUDA is what the template gives without this form.
GPU numerics: tests/test_mxfp4_moe_kernels.py::test_tilelang_on_gpu_every_selftest_case[warp_specialized].
"""

import collections
import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from dzc import mxfp4
from dzc.targets import mxfp4_moe, tilelang_codegen
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90

import sass_tools

GPT_OSS = mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
                                 "clamped_swiglu", True)
requires_tilelang = pytest.mark.skipif(not tilelang_codegen.installed_target_kinds(), reason="no TileLang")


def _ws_configs(spec=GPT_OSS, profile=SM_90):
    return [c for c in mxfp4_moe.tilelang_configs(spec, profile) if mxfp4_moe.warp_specialized(c)]


def _ws_config(block_n, stages):
    [config] = [c for c in _ws_configs() if (c["BLOCK_N"], c["NUM_STAGES"]) == (block_n, stages)]
    return config


# ---------------------------------------------------------------------------------------------------------
# Where the knob applies (no lowering)


def test_offered_on_hopper_for_bf16_and_the_untuned_choice_at_prefill_sizes():
    legal, _ = legal_configs(mxfp4_moe, "tilelang", GPT_OSS, SM_90)
    configs = _ws_configs()
    assert sorted((c["BLOCK_N"], c["NUM_STAGES"]) for c in configs) == [(128, 2), (128, 4), (256, 2), (256, 4)]
    for config in configs:
        assert config in legal
        assert (config["BLOCK_M"], config["BLOCK_K"], config["THREADS"], config.num_warps) == (128, 64, 384, 12)
        assert mxfp4_moe.tilelang_shared_memory_bytes(GPT_OSS, config) <= SM_90.shared_memory_per_block
        assert "warp-specialized" in mxfp4_moe.describe_config(config)
    default = mxfp4_moe.tilelang_default_config(GPT_OSS, SM_90)
    assert not mxfp4_moe.warp_specialized(default)
    for bucket in (1, 64, 1024):  # up to 32 rows an expert: not measured, the plain tiles
        _, chosen = mxfp4_moe.configs_for_bucket(GPT_OSS, SM_90, bucket, legal, default)
        assert not mxfp4_moe.warp_specialized(chosen), bucket
    for bucket in (4096, 8192, 1 << 16):  # from 128 rows an expert: the widest, deepest warp-specialized tile
        _, chosen = mxfp4_moe.configs_for_bucket(GPT_OSS, SM_90, bucket, legal, default)
        assert chosen == _ws_config(256, 4), (bucket, chosen)
    assert not mxfp4_moe.warp_specialization_problems(GPT_OSS, SM_90)
    # Triton's configs never carry the knob.
    assert not any(mxfp4_moe.warp_specialized(c) for c in mxfp4_moe.triton_configs(GPT_OSS, SM_90))


def test_loading_builds_every_buckets_untuned_choice_ahead():
    """tilelang_codegen.load starts building the untuned choice of every token bucket, decode's first: the plain
    16- and 64-row tiles and the prefill's warp-specialized one, each once; on sm_80 (no warp specialization) the
    plain tiles only."""
    assert mxfp4_moe.tilelang_prebuilt_configs(GPT_OSS, SM_90) == [
        mxfp4_moe.configs_for_bucket(GPT_OSS, SM_90, bucket, mxfp4_moe.tilelang_configs(GPT_OSS, SM_90),
                                     mxfp4_moe.tilelang_default_config(GPT_OSS, SM_90))[1]
        for bucket in (1, 1024, 4096)]
    prebuilt = mxfp4_moe.tilelang_prebuilt_configs(GPT_OSS, SM_90)
    assert prebuilt[0] == mxfp4_moe.tilelang_default_config(GPT_OSS, SM_90) and prebuilt[-1] == _ws_config(256, 4)
    assert [c["BLOCK_M"] for c in prebuilt[:2]] == [16, 64]
    sm_80 = mxfp4_moe.tilelang_prebuilt_configs(GPT_OSS, SM_80)
    assert sm_80[0] == mxfp4_moe.tilelang_default_config(GPT_OSS, SM_80) and len(set(sm_80)) == len(sm_80)
    assert not any(mxfp4_moe.warp_specialized(c) for c in sm_80)


@pytest.mark.parametrize("profile", [SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_refused_without_wgmma_or_warp_specialization(profile):
    problems = mxfp4_moe.warp_specialization_problems(GPT_OSS, profile)
    assert any("wgmma" in p for p in problems), problems
    assert any("warp-specialized lowering" in p for p in problems), problems
    assert not _ws_configs(profile=profile)


def test_refused_for_specs_it_does_not_take():
    fp16 = dataclasses.replace(GPT_OSS, hidden_dtype=torch.float16)
    assert any("not bf16" in p for p in mxfp4_moe.warp_specialization_problems(fp16, SM_90))
    assert not _ws_configs(fp16)
    fp32 = dataclasses.replace(GPT_OSS, hidden_dtype=torch.float32)
    assert any("no TileLang" in p for p in mxfp4_moe.warp_specialization_problems(fp32, SM_90))
    w4a8 = dataclasses.replace(GPT_OSS, fp8_activations=True)
    assert mxfp4_moe.warp_specialization_problems(w4a8, SM_90) and not _ws_configs(w4a8)
    for field in ("hidden", "inter"):
        tail = dataclasses.replace(GPT_OSS, **{field: 2880 + 32})
        assert any("no K tail" in p for p in mxfp4_moe.warp_specialization_problems(tail, SM_90)), field
        assert not _ws_configs(tail), field
    # N tails are taken: weight rows past N decode as zeros, their outputs are not stored.
    assert _ws_configs(dataclasses.replace(GPT_OSS, inter=2880 + 64))


# ---------------------------------------------------------------------------------------------------------
# The decoder's arithmetic, emulated bit for bit against the reference (every packed byte x every scale)


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _emulated_decode(codes_even: torch.Tensor, codes_odd: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dzc_mxfp4_decode32 on one byte's pair of codes: t = [even, 0, odd, 0] (the byte permute), bits =
    (t * 0x1040) & 0x81C081C0, then (s <= 128 or 0xFF) one bf16 multiply by 2^(s - 1) (NaN for 0xFF), else two, by
    2^126 and by 2^(s - 127)."""
    t = codes_even + (codes_odd << 16)
    bits = (t * 0x1040) & 0x81C081C0
    one = (scale <= 128) | (scale == 255)
    first = torch.where(scale == 255, 0x7FC0, (scale + 126) << 7)
    values = []
    for half in (bits & 0xFFFF, bits >> 16):
        single = _bf16(half) * _bf16(first)
        double = (_bf16(half) * _bf16(torch.tensor(0x7E80))) * _bf16(scale << 7)
        values.append(torch.where(one, single, double).to(torch.float32))
    return torch.stack(values, dim=-1)


def test_decoder_bits_match_the_reference_for_every_byte_and_scale():
    source = mxfp4_moe.tilelang_source(GPT_OSS, SM_90)
    for constant in ("0x1040u", "0x81C081C0u", "0x7E807E80u", "(scale + 126u) << 7", "scale <= 128u || scale == 255u",
                     "0x7FC0u", "scale << 7", "0x8080u | j | ((4 + j) << 8)"):
        assert constant in source, constant  # the emulation's constants are the kernel's
    byte = torch.arange(256, dtype=torch.int64).repeat_interleave(256)
    scale = torch.arange(256, dtype=torch.int64).repeat(256)
    got = _emulated_decode(byte & 0xF, byte >> 4, scale)
    blocks = byte.to(torch.uint8).reshape(-1, 1).expand(-1, 16).reshape(-1, 1, 16)
    expected = mxfp4.dequantize(blocks, scale.to(torch.uint8).reshape(-1, 1), torch.bfloat16).float()
    expected = expected.reshape(-1, 32)[:, :2]
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())


def _permute(x: torch.Tensor, y: torch.Tensor, selector: int, ptx: bool) -> torch.Tensor:
    """Byte n of the result: byte (nibble n of `selector`) & 7 of y:x. PTX's prmt.b32 (default mode) replicates
    that byte's sign where the nibble's msb is set; CUDA's __byte_perm uses only each nibble's low 3 bits (nvcc
    compiles __byte_perm(a, b, 0x8584) to prmt with 0x0504)."""
    source = torch.stack([(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)])
    result = torch.zeros_like(x)
    for n in range(4):
        nibble = (selector >> (4 * n)) & 0xF
        byte = source[nibble & 7]
        if ptx and nibble & 8:
            byte = torch.where(byte >= 0x80, 0xFF, 0)
        result |= byte << (8 * n)
    return result


def _emulated_group(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dzc_mxfp4_decode32 as its source reads, on groups [G, 16] (bytes) x scales [G]: 32 values a group in the
    order of its four 16-byte stores; the byte permute as the primitive the source calls computes it."""
    source = mxfp4_moe.tilelang_source(GPT_OSS, SM_90)
    [(name, selector)] = re.findall(r"const unsigned int t = (\w+)\(even, odd, ([^;]*)\);", source)
    if name == "__byte_perm":
        ptx = False
    else:
        body = re.search(name + r"\([^)]*\) \{(.*?)\n\}", source, re.S)
        assert body and 'asm("prmt.b32 %0, %1, %2, %3;"' in body.group(1), name
        ptx = True
    words = packed.to(torch.int64).reshape(-1, 4, 4)
    words = sum(words[..., i] << (8 * i) for i in range(4))  # [G, 4] little-endian 32-bit words
    one = (scale <= 128) | (scale == 255)
    first = torch.where(scale == 255, 0x7FC0, (scale + 126) << 7)[:, None]
    values = torch.empty(packed.shape[0], 4, 4, 2)
    even, odd = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
    for j in range(4):
        t = _permute(even, odd, eval(selector.replace("u", ""), {"j": j}), ptx)
        bits = (t * 0x1040) & 0x81C081C0
        for h, half in enumerate((bits & 0xFFFF, (bits >> 16) & 0xFFFF)):
            single = _bf16(half) * _bf16(first)
            double = (_bf16(half) * _bf16(torch.tensor(0x7E80))) * _bf16(scale[:, None] << 7)
            values[:, :, j, h] = torch.where(one[:, None], single, double).to(torch.float32)
    return values.reshape(-1, 32)  # word w, pair j, half h: value 8 w + 2 j + h


def test_decoded_groups_match_the_reference_with_the_permute_the_source_calls():
    """Whole 16-byte groups (random bytes, every scale), through the byte permute as compiled: with CUDA's
    __byte_perm (before session 39) the "zero" bytes of [even, 0, odd, 0] were even's byte 0 (88.9% of the first
    GPU run's outputs mismatched); PTX prmt's sign-replicating selectors give zeros."""
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (1024, 16), generator=generator, dtype=torch.int64)
    scale = torch.arange(256, dtype=torch.int64).repeat(4)
    got = _emulated_group(packed, scale)
    expected = mxfp4.dequantize(packed.to(torch.uint8)[:, None], scale.to(torch.uint8)[:, None],
                                torch.bfloat16).float().reshape(-1, 32)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())


def test_permute_emulation_matches_nvcc():
    """The two semantics _permute models: __byte_perm drops each selector nibble's msb, prmt.b32 keeps it."""
    x, y = torch.tensor([0x8F0E8D0C]), torch.tensor([0x0B0A0908])
    assert _permute(x, y, 0x9584, ptx=False).item() == 0x8D090C08  # as selector 0x1504
    assert _permute(x, y, 0x9584, ptx=True).item() == 0xFF090008  # x's bytes 0 (0x0C) and 1 (0x8D): their signs
    # The decoder's j = 0 selector: [x byte 0, 0, y byte 0, 0] from prmt; __byte_perm repeats x's byte 0.
    assert _permute(x, y, 0x8480, ptx=True).item() == 0x0008000C
    assert _permute(x, y, 0x8480, ptx=False).item() == 0x0C080C0C


# ---------------------------------------------------------------------------------------------------------
# Lowered to CUDA for sm_90a at gpt-oss-120b's shape, compiled by nvcc


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """gemm -> the WARP_SPECIALIZED=1 BLOCK_N=256, 4-stage kernel's CUDA source, and the work directory."""
    directory = tmp_path_factory.mktemp("mxfp4_moe_ws")
    path = directory / "mxfp4_moe_tilelang.py"
    path.write_text(mxfp4_moe.tilelang_source(GPT_OSS, SM_90))
    configs = mxfp4_moe.tilelang_kernel_configs(GPT_OSS, _ws_config(256, 4))
    return {gemm: tilelang_codegen.lower_to_device_source(path, mxfp4_moe.TILELANG_FACTORY_NAME, config, SM_90)
            for gemm, config in enumerate(configs.values())}, directory


@requires_tilelang
def test_lowered_kernels_have_the_roles_the_ring_and_wgmma(lowered):
    sources, _ = lowered
    for gemm, source in sources.items():
        assert "__launch_bounds__(384, 1)" in source, gemm
        # Two consumer warpgroups raise their registers, the producer lowers its own (2 * 200 + 96 <= 3 * 168).
        assert source.count("tl::warpgroup_reg_alloc<200>()") == 2, gemm
        assert source.count("tl::warpgroup_reg_dealloc<96>()") == 1, gemm
        assert "w_full[3].init(256)" in source and "w_empty[3].init(256)" in source, gemm
        assert source.count("tl::mbarrier_cp_async_arrive_noinc(w_full[") == 1, gemm
        assert source.count("cp_async_gs_conditional<16>") == 1, gemm  # one 16-byte copy a row and 8 columns
        assert "cp_async_commit" not in source and "cp_async_wait" not in source, gemm
        assert source.count("dzc_mxfp4_decode32((") == 1, gemm
        assert len(re.findall(r"w_full\[[^\]]+\]\.arrive\(\)", source)) == 1, gemm
        assert len(re.findall(r"w_empty\[[^\]]+\]\.arrive\(\)", source)) == 4, gemm  # in and after each K loop
        assert source.count("tl::fence_proxy_async()") == 3, gemm
        assert source.count("__syncthreads()") == 1, gemm  # after the barriers' init only: none in a role
    # gate/up: two 64 x 128 wgmma a step a consumer (gate rows, then up rows); down: one 64 x 256.
    shape = r"wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, {}, 16,"
    assert len(re.findall(shape.format(128), sources[0])) == 4 and "tl::wait_wgmma<2>()" in sources[0]
    assert len(re.findall(shape.format(256), sources[1])) == 2 and "tl::wait_wgmma<1>()" in sources[1]


def _producer_step(sass: str) -> collections.Counter:
    """Opcodes the producer's K step executes from its cp.async arrival to its w_full arrival (decode and stores)
    where every scale is at most 2 (s <= 128): each group's conditional branch to its one-multiply decode skips the
    two-multiply one."""
    rows = []
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            words = found.group(2).split()
            rows.append((int(found.group(1), 16), words[1] if words[0].startswith("@") else words[0], words))
    start = next(i for i, (_, op, _) in enumerate(rows) if op.startswith("ARRIVES.LDGSTSBAR"))
    end = next(i for i in range(start, len(rows)) if rows[i][1].startswith("SYNCS.ARRIVE"))
    executed, skip_to = [], None
    for address, op, words in rows[start:end + 1]:
        if skip_to is not None and address < skip_to:
            continue
        skip_to = None
        executed.append(op)
        if op == "BRA" and words[0].startswith("@") and words[0] != "@!PT":
            skip_to = int(words[-1], 16)
    return collections.Counter(executed)


@requires_tilelang
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_compiles_for_sm90a_without_spills_with_vector_stores_and_hgmma(lowered):
    sources, directory = lowered
    cuobjdump = sass_tools.cuobjdump()
    for gemm, source in sources.items():
        report = tilelang_codegen.ptxas_report(source, SM_90, directory / f"nvcc{gemm}")
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(stores == loads == "0" for stores, loads in spills), report
        [registers] = map(int, re.findall(r"Used (\d+) registers", report))
        assert registers * 384 <= 65536, report
        if cuobjdump is None:
            continue
        [obj] = (directory / f"nvcc{gemm}").glob("*.o")
        sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        producer = sass.split("USETMAXREG.DEALLOC", 1)[1].split("USETMAXREG.TRY_ALLOC", 1)[0]
        consumers = sass.split("USETMAXREG.TRY_ALLOC", 1)[1]
        # The producer: 4 groups of 32 values a K step, each stored as four 16-byte vectors; no 16-bit (or other
        # narrow) shared stores anywhere; bf16x2 multiplies only in the producer: one a pair of values, two where
        # the scale is past 2 (each group's decode is there twice: 64 + 128).
        assert len(re.findall(r"\bSTS\.128\b", producer)) == 16, gemm
        assert not re.findall(r"\bSTS(\.U16|\.16|\.U8|\.S16|\.64)?\s", sass), gemm
        assert len(re.findall(r"\bHMUL2\.BF16", producer)) == 192 == len(re.findall(r"\bHMUL2\.BF16", sass)), gemm
        assert "LDGSTS.E.BYPASS.128" in producer and "HGMMA" not in producer, gemm
        # The byte permutes keep their sign-replicating (zero) selectors: 0x8480 | 0x101 j ([even j, 0, odd j, 0]);
        # __byte_perm had compiled to 0x0400 | 0x101 j (bytes 1 and 3 even's byte 0: the first GPU run's error).
        selectors = re.findall(r"\bPRMT R\d+, R\d+, (0x[0-9a-f]+), R\d+", producer)
        assert {f"0x{0x8480 + 0x101 * j:x}" for j in range(4)} <= set(selectors), (gemm, collections.Counter(selectors))
        assert not {f"0x{0x400 + 0x101 * j:x}" for j in range(4)} & set(selectors), gemm
        step = _producer_step(sass)
        decode = sum(n for op, n in step.items() if op.split(".")[0] in ("PRMT", "IMAD", "LOP3", "HMUL2", "SHF"))
        hmul2 = sum(n for op, n in step.items() if op.startswith("HMUL2.BF16"))
        # 128 values a thread a step: 64 HMUL2, about 2.5 ALU instructions a value, 3.2 with the stores.
        assert step["STS.128"] == 16 and hmul2 == 64 and decode <= 3 * 128, (gemm, step)
        # The consumers: wgmma (HGMMA) from shared memory, 64 x 128 (gate/up) or 64 x 256 (down).
        hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16", consumers)
        assert hgmma and set(hgmma) == {"128" if gemm == 0 else "256"}, (gemm, hgmma)
        # One step's wgmma group (two for gate/up) left in flight when the previous stage is freed.
        assert f"WARPGROUP.DEPBAR.LE gsb0, 0x{2 - gemm}" in consumers, gemm
