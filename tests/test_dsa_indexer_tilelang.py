"""The TileLang kernel of dzc.dsa_indexer (targets/templates/dsa_indexer.tilelang.py.tmpl).

CPU: which specs get configs (FP8 × FP8 and bf16/fp16 × same; the FP8 cache with a float q and fp32 caches are
Triton's, and lowering then picks Triton), the configs' legality and shared-memory estimate, the launch's split of
the context; the kernel is lowered to CUDA for sm_90a (TileLang has no CPU interpreter): the key tiles run on
wgmma (FP8 e4m3 × e4m3 with fp32 accumulation; bf16 for the bf16 cache), their copies are cp.async issued by the
pipelined loop, every global offset into the cache, the block table and the logits is computed in 64 bits, and
nvcc compiles the source. GPU (marked gpu): every config against the op's reference on seeded ragged batches in
shuffled pages (page sizes 16, 32, 64; decode rows, causal prefill rows, rows of several sequences in one
program, a context wider than every sequence), with NaN-poisoned outputs, and the op through dzc's lowering.
"""

import re
import shutil

import pytest
import torch

from dzc.lowering import PREFERRED_CODEGENS, Execution, choose_codegen
from dzc.ops.dsa import dsa_indexer_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import TARGETS, dsa_cases, dsa_indexer, tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90
from test_tilelang_long_context import global_offsets, narrow_accesses

FP8 = dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True)  # DeepSeek-V3.2's indexer, FP8 cache
BF16 = dsa_indexer.DsaIndexerSpec(64, 128, torch.bfloat16, False)
requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _with_page_size(config: KernelConfig, page_size: int) -> KernelConfig:
    """What the launcher compiles: the config with the cache's page size (a template constant)."""
    return KernelConfig.make(num_warps=config.num_warps, num_stages=config.num_stages, **dict(config.params),
                             PAGE_SIZE=page_size)


def _config(threads: int, block_n: int, rows: int, stages: int) -> KernelConfig:
    return next(c for c in dsa_indexer.tilelang_configs(FP8, SM_90)
                if (c["THREADS"], c["BLOCK_N"], c["ROWS"], c["STAGES"]) == (threads, block_n, rows, stages))


# ---------------------------------------------------------------------------------------------------------
# Specs, configs, legality (no lowering)


def test_tilelang_configs_only_for_specs_the_template_takes():
    assert dsa_indexer.tilelang_configs(FP8, SM_90) and dsa_indexer.tilelang_configs(BF16, SM_90)
    assert dsa_indexer.tilelang_configs(dataclass_replace(BF16, q_dtype=torch.float16), SM_90)
    for spec in (dataclass_replace(FP8, q_dtype=torch.bfloat16),  # FP8 cache, float q: keys widened (Triton)
                 dataclass_replace(BF16, q_dtype=torch.float32),  # fp32 cache: multiplied in full precision
                 dataclass_replace(FP8, heads=8),  # too few heads for the MMA's N
                 dataclass_replace(FP8, head_dim=48)):  # not a multiple of an FP8 MMA's K step
        assert not dsa_indexer.tilelang_supports(spec), spec
        assert dsa_indexer.tilelang_configs(spec, SM_90) == [], spec
        with pytest.raises(ValueError, match="Triton serves it"):
            dsa_indexer.tilelang_source(spec, SM_90)
    # FP8 needs a profile with e4m3; the bf16 cache gets configs everywhere, within mp_22's 72 KiB.
    assert not legal_configs(dsa_indexer, "tilelang", FP8, SM_80)[0]
    assert not legal_configs(dsa_indexer, "tilelang", FP8, MP_22)[0]
    assert legal_configs(dsa_indexer, "tilelang", FP8, MP_31)[0]
    assert legal_configs(dsa_indexer, "tilelang", BF16, MP_22)[0]


def dataclass_replace(spec, **changes):
    import dataclasses

    return dataclasses.replace(spec, **changes)


@pytest.mark.parametrize("profile", [SM_90, SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_tilelang_configs_are_legal_shapes(profile):
    """rows·heads fills at most one MMA N (256), at most 128 fp32 accumulators a thread, 16 keys a warp; the
    default is among the legal configs."""
    for spec in (FP8, BF16):
        legal, _ = legal_configs(dsa_indexer, "tilelang", spec, profile)
        if not legal:
            continue
        assert dsa_indexer.tilelang_default_config(spec, profile) in legal
        for config in legal:
            threads, block_n, rows = config["THREADS"], config["BLOCK_N"], config["ROWS"]
            assert rows * spec.heads <= 256 and block_n * rows * spec.heads // threads <= 128, str(config)
            assert block_n % (16 * (threads // 32)) == 0, str(config)
            assert dsa_indexer.tilelang_shared_memory_bytes(spec, config) <= profile.shared_memory_per_block


def test_auto_codegen_falls_back_to_triton_without_tilelang_configs(monkeypatch):
    """With TileLang first (as the H200 run may decide), a spec without TileLang configs (the FP8 cache with a bf16
    q) still lowers to Triton, and the FP8 × FP8 spec to TileLang where it can run."""
    from dzc.targets.device_runtime import CudaRuntime

    monkeypatch.setitem(PREFERRED_CODEGENS, "dsa_indexer", ("tilelang", "triton"))
    gpu, auto = Execution(CudaRuntime()), CompileOptions()
    assert choose_codegen("dsa_indexer", auto, gpu, dataclass_replace(FP8, q_dtype=torch.bfloat16), SM_90) == "triton"
    expected = "tilelang" if tilelang_codegen.import_problem() is None else "triton"
    assert choose_codegen("dsa_indexer", auto, gpu, FP8, SM_90) == expected


def test_small_launches_default_to_shorter_programs():
    """Below SMALL_LAUNCH_BUCKET rows × keys the untuned TileLang choice is the 256-thread 128-key tile in chunks of
    4 (one sequence's decode, measured faster there); at and above it, the family default; every legal config stays
    a candidate; Triton's choice is left alone."""
    legal, _ = legal_configs(dsa_indexer, "tilelang", FP8, SM_90)
    default = dsa_indexer.tilelang_default_config(FP8, SM_90)
    shape = lambda c: (c["THREADS"], c["BLOCK_N"], c["ROWS"], c["CHUNK"], c["STAGES"])  # noqa: E731
    one_sequence = dsa_indexer.token_bucket(2 * 32768)
    configs, small = dsa_indexer.configs_for_bucket(FP8, SM_90, one_sequence, legal, default)
    assert configs == legal and shape(small) == dsa_indexer.TILELANG_SMALL_LAUNCH_DEFAULT and small in legal
    assert "MIN_BLOCKS" not in dict(small.params)
    many = dsa_indexer.token_bucket(128 * 32768)
    assert dsa_indexer.configs_for_bucket(FP8, SM_90, many, legal, default) == (legal, default)
    triton_legal, _ = legal_configs(dsa_indexer, "triton", FP8, SM_90)
    triton_default = dsa_indexer.triton_default_config(FP8, SM_90)
    assert dsa_indexer.configs_for_bucket(FP8, SM_90, one_sequence, triton_legal, triton_default) == (
        triton_legal, triton_default)


def test_loading_builds_both_untuned_choices_ahead():
    """tilelang_codegen.load starts building the untuned choices of large and of small launches (the default first):
    a few sequences' decode no longer builds its kernel in-process at its first call."""
    legal, _ = legal_configs(dsa_indexer, "tilelang", FP8, SM_90)
    default = dsa_indexer.tilelang_default_config(FP8, SM_90)
    chosen = {dsa_indexer.configs_for_bucket(FP8, SM_90, bucket, legal, default)[1] for bucket in
              (dsa_indexer.token_bucket(n) for n in (1, 2 * 32768, 128 * 32768, 1 << 30))}
    assert dsa_indexer.tilelang_prebuilt_configs(FP8, SM_90)[0] == default
    assert set(dsa_indexer.tilelang_prebuilt_configs(FP8, SM_90)) == chosen and len(chosen) == 2


def test_span_splits_decode_context_and_gives_prefill_whole_rows():
    config = dsa_indexer.tilelang_default_config(FP8, SM_90)
    block_n, chunk = config["BLOCK_N"], config["CHUNK"]
    # Prefill: 4096 rows fill the GPU: one program per row block covers the whole context.
    assert dsa_indexer.span_tiles(4096, 8192, config, 132) == 8192 // block_n
    # Decode at batch 1: the context split over many programs, in whole chunks of at least 2 tiles.
    tiles = dsa_indexer.span_tiles(1, 32768, config, 132)
    assert tiles % chunk == 0 and tiles * block_n < 32768 and -(-32768 // (tiles * block_n)) >= 32
    assert dsa_indexer.span_tiles(1, 100, config, 132) == chunk  # one chunk (the kernel masks the rest)


# ---------------------------------------------------------------------------------------------------------
# Lowered to CUDA for sm_90a

# name -> (spec, config, page size): the untuned FP8 config over DeepSeek's 64-token pages (a tile is one
# page), the public kernel's shape (4 warpgroups × 64 keys, 2 rows) over 16-token pages, and the bf16 cache.
LOWERED = {
    "fp8-default-page64": (FP8, None, 64),
    "fp8-512x256-page16": (FP8, (512, 256, 2, 3), 16),
    "bf16-default-page64": (BF16, None, 64),
}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """name -> (TileLang's lowered artifact, the config it was lowered for)."""
    directory = tmp_path_factory.mktemp("dsa_indexer_tilelang")
    artifacts = {}
    for name, (spec, shape, page_size) in LOWERED.items():
        path = directory / f"dsa_indexer_{'fp8' if spec.fp8 else 'bf16'}.py"
        path.write_text(dsa_indexer.tilelang_source(spec, SM_90))
        config = _config(*shape) if shape else dsa_indexer.tilelang_default_config(spec, SM_90)
        artifacts[name] = (tilelang_codegen.lower(path, dsa_indexer.TILELANG_FACTORY_NAME,
                                                  _with_page_size(config, page_size), SM_90), config)
    return artifacts


def test_lowered_indexer_runs_key_tiles_on_wgmma_with_async_copies(lowered):
    for name, (artifact, config) in lowered.items():
        source = artifact.kernel_source
        spec = LOWERED[name][0]
        operand = "kFloat8_e4m3" if spec.fp8 else "kBFloat16"
        n = config["ROWS"] * spec.heads
        k_step = 32 if spec.fp8 else 16
        # keys × (rows·heads): a 64-key warpgroup tile, all the rows' heads as N, fp32 accumulation
        assert f"tl::wgmma_ss<tl::DataType::{operand}, tl::DataType::{operand}, tl::DataType::kFloat32, 64, {n}, " \
               f"{k_step}," in source, name
        assert "cp_async_gs" in source and "cp_async_wait" in source, name  # the pipelined gathers
        assert ("k_scales" in source) == spec.fp8, name
        (device_func,) = artifact.device_mod.functions.values()
        assert int(device_func.attrs["dyn_shared_memory_buf"]) <= dsa_indexer.tilelang_shared_memory_bytes(
            spec, config), name


def test_lowered_indexer_offsets_are_64_bit(lowered):
    """The pool is read at page · page elements + slot · Di: past 2^31 bytes at 16M cached tokens of 132 B, so the
    page (read from the block table) is widened before it is scaled; the logits' row · context passes 2^31 at 4096
    rows × 512K. Only seq_lens is indexed by a 32-bit sequence number (< batch)."""
    for name, (artifact, _) in lowered.items():
        source = artifact.kernel_source
        accesses = global_offsets(source)
        reads = [offset for buffer, offset in accesses if buffer in ("k_values", "k_scales")]
        assert reads and all("block_table[" in offset for offset in reads), name
        narrow = {buffer for buffer, _, _ in narrow_accesses(source)}
        assert narrow <= {"seq_lens"}, (name, narrow_accesses(source))
        as_int32 = source.replace("(int64_t)", "").replace("int64_t ", "int ")  # the check sees 32-bit math
        assert {"k_values", "logits"} <= {buffer for buffer, _, _ in narrow_accesses(as_int32)}, name


@requires_nvcc
@pytest.mark.parametrize("name", ["fp8-default-page64", "fp8-512x256-page16"])
def test_lowered_indexer_compiles_with_nvcc(lowered, name, tmp_path):
    assert tilelang_codegen.nvcc_compile(lowered[name][0].kernel_source, SM_90, tmp_path).stat().st_size > 0


@requires_nvcc
def test_three_programs_a_multiprocessor_fit_without_spills(tmp_path):
    """The candidate asking for three 128-thread programs a multiprocessor gets __launch_bounds__(128, 3), and
    ptxas fits it in 65536 / 384 = 170 registers a thread without spilling (its twin without the ask takes ~227,
    i.e. two programs); its three programs' shared memory fits a multiprocessor."""
    [config] = [c for c in dsa_indexer.tilelang_configs(FP8, SM_90)
                if dict(c.params).get("MIN_BLOCKS") == 3 and c["STAGES"] == 3]
    path = tmp_path / "dsa_indexer_fp8.py"
    path.write_text(dsa_indexer.tilelang_source(FP8, SM_90))
    source = tilelang_codegen.lower_to_device_source(path, dsa_indexer.TILELANG_FACTORY_NAME,
                                                     _with_page_size(config, 64), SM_90)
    assert "__launch_bounds__(128, 3)" in source
    report = tilelang_codegen.ptxas_report(source, SM_90, tmp_path / "nvcc")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(stores == loads == "0" for stores, loads in spills), report
    [registers] = map(int, re.findall(r"Used (\d+) registers", report))
    assert registers * 128 * 3 <= 65536, report
    assert 3 * dsa_indexer.tilelang_shared_memory_bytes(FP8, config) <= 227 * 1024


# ---------------------------------------------------------------------------------------------------------
# GPU: against the op's reference

# (seq_lens, queries per sequence, max_context): decode (1-2 rows a sequence: programs of rows from several
# sequences), short prefill chunks at sequence boundaries, a context wider than every sequence (−inf past the
# ends), one narrower than the longest, and long causal prefill rows (tiles skipped above the diagonal).
GPU_CASES = {
    "decode": ([37, 200, 5, 64, 1000], [1, 2, 1, 1, 2], None),
    "prefill": ([37, 130, 5], [6, 10, 3], 150),
    "wide-context": ([90, 140], [2, 3], 600),
    "narrow-context": ([90, 1400], [2, 5], 1000),
    "long-prefill": ([1500, 700], [700, 300], None),
}


def _args(case: str, spec, page_size: int, seed: int):
    seq_lens, per_seq, max_context = GPU_CASES[case]
    return dsa_cases.indexer_args(seq_lens, per_seq, heads=spec.heads, head_dim=spec.head_dim, fp8=spec.fp8,
                                  page_size=page_size, device="cuda", generator=torch.Generator().manual_seed(seed),
                                  max_context=max_context, dtype=torch.bfloat16, fp8_q=spec.fp8)


def _check(logits, expected, spec, what):
    assert not logits.isnan().any(), f"{what}: unwritten or NaN logits"
    assert torch.equal(logits.isinf(), expected.isinf()), f"{what}: −inf (masked) columns differ"
    assert not (logits == float("inf")).any(), what
    scale = expected[expected.isfinite()].abs().max()
    # FP8 × FP8 on wgmma accumulates with about 14 bits (as the Triton kernel's test measures: up to 2^-12.2 of the
    # largest logit); bf16 products are exact in fp32, summed in another order.
    atol = (2**-10 if spec.fp8 else 2**-14) * scale
    torch.testing.assert_close(logits, expected, atol=atol, rtol=2**-10, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """spec -> tilelang_codegen.load's kernels (each config and page size compiled on first use)."""
    directory = tmp_path_factory.mktemp("dsa_indexer_tilelang_gpu")
    loaded = {}
    for spec in (FP8, BF16):
        path = directory / f"dsa_indexer_{'fp8' if spec.fp8 else 'bf16'}.py"
        path.write_text(dsa_indexer.tilelang_source(spec, SM_90))
        loaded[spec] = tilelang_codegen.load(dsa_indexer, path, spec, SM_90)
    return loaded


def _run(kernels, spec, config, args):
    inputs, outputs, _, result = dsa_indexer.prepare(spec, *args)
    for out in outputs:
        out.fill_(float("nan"))
    dsa_indexer.tilelang_launch(kernels[spec], config, *inputs, *outputs)
    torch.cuda.synchronize()
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("config", dsa_indexer.tilelang_configs(FP8, SM_90), ids=str)
def test_tilelang_indexer_every_config_matches_reference_on_gpu(config, kernels, seed):
    for case in GPU_CASES:
        args = _args(case, FP8, 64, seed)
        _check(_run(kernels, FP8, config, args), dsa_indexer_reference(*args), FP8, f"{case} {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("layout", ["fp8", "bf16"])
def test_tilelang_indexer_page_sizes_match_reference_on_gpu(layout, page_size, kernels, seed):
    spec = FP8 if layout == "fp8" else BF16
    config = dsa_indexer.tilelang_default_config(spec, SM_90)
    for case in GPU_CASES:
        args = _args(case, spec, page_size, seed)
        _check(_run(kernels, spec, config, args), dsa_indexer_reference(*args), spec,
               f"{case} page {page_size} {config}")


@pytest.mark.gpu
def test_tilelang_indexer_through_lowering_on_gpu(seed, tmp_path):
    """The op with the kernel id dzc's lowering binds for codegen "tilelang" (prepare, the bucket's config, the
    launch), at DeepSeek-V3.2's shape: a 1024-row prefill chunk at the end of a 4K context, FP8 cache."""
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False, codegen="tilelang")
    args = dsa_cases.indexer_args([4096], [1024], heads=64, head_dim=128, fp8=True, page_size=64, device="cuda",
                                  generator=torch.Generator().manual_seed(seed))
    record, _ = lower_op("dsa_indexer", args, target, options, Execution(target.runtime))
    assert record.codegen == "tilelang"
    logits = torch.ops.dzc.dsa_indexer(*args, kernel_id=record.kernel_id)
    torch.cuda.synchronize()
    expected = torch.cat([dsa_indexer_reference(args[0][rows], args[1][rows], *args[2:5], args[5][rows],
                                                args[6][rows], args[7])
                          for rows in (slice(i, i + 256) for i in range(0, 1024, 256))])
    _check(logits, expected, FP8, "through lowering")


def test_auto_codegen_asks_about_tilelang_only_when_triton_comes_second(monkeypatch):
    """Where Triton is an op's first choice and has a kernel, "auto" never asks whether TileLang runs here: that
    imports TileLang (1.4 s of a warm start on the H200 machine, session 35). Where TileLang comes first it asks."""
    from dzc.targets.device_runtime import CudaRuntime

    asked = []
    monkeypatch.setattr(tilelang_codegen, "import_problem", lambda: asked.append(1) or "not importable (test)")
    gpu, auto = Execution(CudaRuntime()), CompileOptions()
    monkeypatch.setitem(PREFERRED_CODEGENS, "dsa_indexer", ("triton", "tilelang"))
    assert choose_codegen("dsa_indexer", auto, gpu, FP8, SM_90) == "triton" and not asked
    monkeypatch.setitem(PREFERRED_CODEGENS, "dsa_indexer", ("tilelang", "triton"))
    assert choose_codegen("dsa_indexer", auto, gpu, FP8, SM_90) == "triton" and asked
