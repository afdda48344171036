"""LONGEST_FIRST=1 of the warp-specialized varlen attention kernel (issue 14, session 47): its grid takes the
segments longest first (an order the launch computes on the device), so that a pack's longest images do not fill
the last wave; the untuned choice where the longest segment is over 2048 tokens (1.02-1.06x on an H100). Where it
is offered and chosen, the order it is given, its lowering for sm_90a (no GPU), and its GPU numerics (here, and
test_kernels_ignore_nan_and_inf_in_other_segments's "d80-bf16-longest-first" case in
tests/test_varlen_attention_kernels.py)."""

from __future__ import annotations

import re

import pytest
import torch

from dzc import config
from dzc.targets import TARGETS, tilelang_codegen
from dzc.targets import varlen_attention as family
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import unvalidated_reason
from dzc.targets.profiles import SM_90

BF16, FP32 = torch.bfloat16, torch.float32


def _params(config):
    return dict(config.params)


def _twin(config):
    return KernelConfig.make(config.num_warps, config.num_stages, **_params(config), LONGEST_FIRST=1)


def test_offered_beside_the_warp_specialized_kernels_of_128_and_176_key_blocks():
    """A twin of each warp-specialized config with 128- or 176-key blocks (ping-pong or not, split columns where
    the head dim has them; not of OVERLAP=1's), in users' tuning since its GPU numerics passed; none on targets
    without the warp-specialized kernel."""
    for head_dim in (72, 80, 128):
        for rope in (None, torch.float32):
            spec = family.make_spec(head_dim, BF16, rope)
            configs = family.tilelang_configs(spec, SM_90)
            twins = [c for c in configs if _params(c).get("LONGEST_FIRST")]
            base = [c for c in configs if _params(c).get("WARP_SPECIALIZED") and c["BLOCK_N"] >= 128
                    and not _params(c).get("OVERLAP") and not _params(c).get("LONGEST_FIRST")]
            assert len(base) == (4 if head_dim == 128 else 6)
            assert twins == [_twin(c) for c in base]
            default = family.tilelang_default_config(spec, SM_90)
            assert not _params(default).get("LONGEST_FIRST") and _twin(default) in twins
            assert all(unvalidated_reason(family, c) is None for c in twins)
            for name in ("cuda:sm_80", "musa:mp_22", "musa:mp_31"):
                assert not any(_params(c).get("LONGEST_FIRST")
                               for c in family.tilelang_configs(spec, TARGETS[name].profile))


def test_untuned_choice_of_long_segments_and_what_loading_builds_ahead():
    """From the 4096 bucket of the longest segment on (max_seqlen over 2048: images), TileLang's untuned choice is
    its default's twin; below (window layers), the default. Triton's untuned choice, and TileLang's on targets
    without the warp-specialized kernel, stay the default at every size. tilelang_codegen.load starts building
    both untuned choices (the default first)."""
    for head_dim, rope in ((72, None), (80, torch.float32), (128, None)):
        spec = family.make_spec(head_dim, BF16, rope)
        for name in ("cuda:sm_90", "cuda:sm_80", "musa:mp_31"):
            profile = TARGETS[name].profile
            for codegen in ("tilelang", "triton"):
                configs = getattr(family, f"{codegen}_configs")(spec, profile)
                default = getattr(family, f"{codegen}_default_config")(spec, profile)
                for bucket in (64, 2048, 4096, 16384, 1 << 20):
                    kept, chosen = family.configs_for_bucket(spec, profile, bucket, configs, default)
                    assert kept == configs
                    wanted = _twin(default) if (codegen, name) == ("tilelang", "cuda:sm_90") and bucket >= 4096 \
                        else default
                    assert chosen == wanted, (head_dim, name, codegen, bucket)
        default = family.tilelang_default_config(spec, SM_90)
        assert family.tilelang_prebuilt_configs(spec, SM_90) == [default, _twin(default)]
        sm_80 = TARGETS["cuda:sm_80"].profile
        assert family.tilelang_prebuilt_configs(spec, sm_80) == [family.tilelang_default_config(spec, sm_80)]
    assert [family.token_bucket(n) for n in (2048, 2049, 9216)] == [2048, 4096, 16384]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segment_order_is_every_segment_longest_first(seed):
    """A permutation of the segments (empty ones included), by length, longest first, as int32 on the device of
    cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3000, (17,), generator=generator)
    lengths[torch.randint(0, 17, (3,), generator=generator)] = 0
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    order = family.segments_longest_first(cu_seqlens)
    assert order.dtype == torch.int32 and order.device == cu_seqlens.device
    assert sorted(order.tolist()) == list(range(17))
    ordered = lengths[order.long()]
    assert (ordered[:-1] >= ordered[1:]).all(), ordered


def test_the_pipelined_kernel_refuses_it(tmp_path):
    """The template's factory refuses LONGEST_FIRST=1 without the warp-specialized kernel rather than building the
    pipelined one unchanged (its launch would pass an argument the kernel does not take)."""
    if tilelang_codegen.import_problem():
        pytest.skip(tilelang_codegen.import_problem())
    spec = family.make_spec(80, BF16, None)
    pipelined = next(c for c in family.tilelang_configs(spec, SM_90) if not _params(c).get("WARP_SPECIALIZED"))
    path = tmp_path / "varlen_attention_tilelang.py"
    path.write_text(family.tilelang_source(spec, SM_90))
    with pytest.raises(ValueError, match="LONGEST_FIRST=1 is a knob of the warp-specialized kernel"):
        tilelang_codegen.build_prim_func(path, family.TILELANG_FACTORY_NAME, _twin(pipelined))


def test_lowers_for_sm_90_reading_its_segment_by_rank(tmp_path):
    """Head dim 72's untuned choice (split columns, ping-pong) and its twin: the twin takes segment_order, reads its
    segment at the grid's slowest index (blockIdx.z) and its head at blockIdx.y, and otherwise runs the same
    program; the untuned choice's kernel does not take segment_order. (tests/test_setmaxnreg_pool.py compiles the
    twin with nvcc: its representative of this role layout.)"""
    if tilelang_codegen.import_problem():
        pytest.skip(tilelang_codegen.import_problem())
    spec = family.make_spec(72, BF16, None)
    default = family.tilelang_default_config(spec, SM_90)
    assert _params(default).get("SPLIT_COLUMNS") and _params(default).get("PINGPONG")
    path = tmp_path / "varlen_attention_tilelang.py"
    path.write_text(family.tilelang_source(spec, SM_90))
    plain, twin = (tilelang_codegen.lower_to_device_source(path, family.TILELANG_FACTORY_NAME, c, SM_90)
                   for c in (default, _twin(default)))
    assert "segment_order" not in plain
    assert re.search(r"const int\* __restrict__ segment_order", twin)
    assert re.search(r"int segment = segment_order\[\(\(int64_t\)\(\(int\)blockIdx\.z\)\)\];", twin)
    assert "cu_seqlens[((int64_t)((int)blockIdx.y))]" in plain  # the untuned choice: segment = blockIdx.y

    def steps(cuda):  # the program's MMAs, copies and barrier waits and arrivals, in order
        return re.findall(r"tl::wgmma_\w+|tl::tma_load|tl::wait_wgmma|\w+\[[^\]]*\]\.(?:wait|arrive)\(", cuda)
    assert len(steps(plain)) > 20 and steps(twin) == steps(plain)


@pytest.mark.gpu
def test_twins_match_the_reference_on_gpu(seed, tmp_path):
    """The untuned choice's twin on every GPU case of the kernel tests (head dims 72, 80 and 128, both 16-bit
    dtypes, RoPE or not: lengths 1, 1000, 0, 257, 4096, ... in no order of length, an empty segment included),
    with max_seqlen true and far below the longest segment (blocks stride on); outputs poisoned. The twins build
    in parallel (child processes) first."""
    from test_varlen_attention_kernels import GPU_CASES, assert_attention_close, make_pack, spec_for

    from dzc.ops.varlen_attention import varlen_attention_reference

    built = []
    for case_id, case in GPU_CASES.items():
        spec = spec_for(case)
        path = tmp_path / f"varlen_attention_tilelang_{case_id}.py"
        path.write_text(family.tilelang_source(spec, SM_90))
        kernels = tilelang_codegen.load(family, path, spec, SM_90)
        twin = _twin(family.tilelang_default_config(spec, SM_90))
        kernels.prebuild(tilelang_codegen.factory_configs(family, spec, twin).values())
        built.append((case_id, case, spec, kernels, twin))
    for case_id, case, spec, kernels, twin in built:
        args = make_pack(case, seed, strided=True)
        expected = varlen_attention_reference(*args)
        for max_seqlen in (args[4], 64):
            inputs, (out,), _work, result = family.prepare(spec, *args[:4], max_seqlen, *args[5:])
            out.fill_(float("nan"))
            family.tilelang_launch(kernels, twin, *inputs, out)
            assert_attention_close(result, expected, args[2], args[3],
                                   f"{case_id} {twin} max_seqlen={max_seqlen} seed={seed}")


# ---------------------------------------------------------------------------------------------------------
# Triton (the portable path, MUSA's): the same order by its block search (session 51; GPU numerics passed on an
# H100 in session 52)


def test_triton_twins_offered_for_vision_attention_and_in_users_tuning():
    """Vision specs' Triton configs of 64+ query rows each come with a LONGEST_FIRST=1 twin; text decoders' get none
    (causal segments of a batch: the order gains least). The twins are in users' tuning since their GPU numerics
    passed (session 52), never the untuned choice."""
    from dzc.targets.launch import tuning_candidates

    for head_dim, rope in ((72, None), (80, torch.float32), (128, None)):
        spec = family.make_spec(head_dim, BF16, rope)
        configs = family.triton_configs(spec, SM_90)
        twins = [c for c in configs if _params(c).get("LONGEST_FIRST")]
        base = [c for c in configs if not _params(c).get("LONGEST_FIRST")]
        assert twins == [_twin(c) for c in base if c["BLOCK_M"] >= 64] and twins
        default = family.triton_default_config(spec, SM_90)
        assert not _params(default).get("LONGEST_FIRST")
        with config.scope(DZC_TUNE_UNVALIDATED="0"):
            kept, left_out = tuning_candidates(family, configs, default)
        assert kept == configs and not left_out
    decoder = family.make_spec(64, BF16, None, causal=True, sinks=True, grouped=True, own_keys=True)
    assert not any(_params(c).get("LONGEST_FIRST") for c in family.triton_configs(decoder, SM_90))


@pytest.mark.anydevice
def test_triton_twin_gives_its_tiles_bits_in_any_order_of_segments(seed, tmp_path):
    """The twin of the untuned choice and of the smallest 64-row tile, on a pack of 150 segments (more than one
    chunk of the block search) of lengths in no order, empty ones and two long ones among them: every output row
    written (NaN-poisoned), within the reference's tolerance, and the same bits as the tile in segment order (each
    block computes what it did; only which program takes it changes). (Triton's grid comes from the shapes, not
    from max_seqlen.)"""
    from test_varlen_attention_kernels import DEVICE, assert_attention_close, launch_triton, make_pack

    from dzc.ops.varlen_attention import varlen_attention_reference
    from dzc.targets import triton_codegen

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 12, (150,), generator=generator)
    lengths[torch.randint(0, 150, (2,), generator=generator)] = torch.tensor([97, 150])
    case = (tuple(lengths.tolist()), 1, 16, FP32, False)
    spec = family.make_spec(16, FP32, None)
    args = make_pack(case, seed)
    expected = varlen_attention_reference(*args)
    path = tmp_path / "varlen_attention_triton.py"
    path.write_text(family.triton_source(spec, SM_90))
    kernel = triton_codegen.load(family, path, spec, SM_90)
    tiles = [family.triton_default_config(spec, SM_90),
             min((c for c in family.triton_configs(spec, SM_90) if c["BLOCK_M"] == 64 and not _params(c).get(
                 "LONGEST_FIRST")), key=lambda c: (c["BLOCK_N"], c.num_stages))]
    for tile in tiles:
        plain = launch_triton(kernel, spec, tile, args)
        twin = launch_triton(kernel, spec, _twin(tile), args)
        assert_attention_close(twin, expected, args[2], args[3], f"{_twin(tile)} {DEVICE} seed={seed}")
        assert torch.equal(twin, plain), f"{_twin(tile)} seed={seed}"
