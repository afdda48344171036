"""dzc's one-shot all-reduce + residual add + RMSNorm kernel (targets/all_reduce_add_rms_norm.py).

CPU: (a) numerics under Triton's interpreter with WORLD ranks simulated in one process: the kernel's address
table points at WORLD separate CPU tensors (the interpreter dereferences host addresses) and BARRIER=False
compiles the signal-pad barrier out (that flag exists for this test only: one process has no peers to wait
for); (b) the kernel WITH the barrier compiled ahead of time for sm_90: its PTX has system-scope atomics and no
multimem/multicast instruction. GPU (not run on this machine): (c) world size 1 through real symmetric memory on
one GPU; (d) 2 ranks on 2 GPUs.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from conftest import assert_close_for_dtype, run_ahead_of_time_script, ulp

from dzc.ops import add_rms_norm_reference
from dzc.targets import all_reduce_add_rms_norm as family
from dzc.targets import triton_codegen
from dzc.targets.profiles import SM_80, SM_90, MP_31

# (hidden, x dtype, residual/sum dtype, weight dtype (None: no weight), sum_in_fp32, cast_before_weight,
# compute dtype, divide_by_rms): HF Llama bf16 and fp16, DeepSeek's fp32 residual stream, fp32, Gemma's fp32
# weight, a weightless bf16-math norm with `v / sqrt(.)`. 200: a padded row.
CASES = [
    (64, torch.bfloat16, torch.bfloat16, torch.bfloat16, False, True, torch.float32, False),
    (200, torch.float16, torch.float16, torch.float16, False, True, torch.float32, False),
    (200, torch.bfloat16, torch.float32, torch.bfloat16, True, False, torch.float32, False),
    (64, torch.float32, torch.float32, torch.float32, True, False, torch.float32, False),
    (64, torch.bfloat16, torch.bfloat16, torch.float32, False, False, torch.float32, False),
    (96, torch.bfloat16, torch.bfloat16, None, False, False, torch.bfloat16, True),
]


def _load(spec, tmp_path):
    path = tmp_path / f"all_reduce_{abs(hash(spec))}.py"
    path.write_text(family.triton_source(spec, SM_90))
    return triton_codegen.load_kernel(path, family.TRITON_KERNEL_NAME)


def _interpreter_rounding(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype as the Triton interpreter casts: bf16 by truncating the fp32 bits (a GPU rounds to nearest
    even), fp16 through numpy (nearest even)."""
    if dtype == torch.bfloat16 and triton_codegen.interpreting():
        return (values.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return values.float().to(dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-{str(c[1])[6:]}-{str(c[2])[6:]}-w{c[3]}")
def test_simulated_ranks_match_sum_then_add_rms_norm_reference(case, world, seed, tmp_path):
    if not triton_codegen.interpreting():
        pytest.skip("simulates ranks through host addresses: Triton's interpreter only")
    hidden, dtype, sum_dtype, weight_dtype, sum_in_fp32, cast_before_weight, compute_dtype, divide_by_rms = case
    generator = torch.Generator().manual_seed(seed)
    tokens = 37
    partials = [torch.randn(tokens, hidden, generator=generator).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=generator).to(sum_dtype)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=generator)).to(weight_dtype) if weight_dtype else None
    eps = 1e-6
    norm_args = (weight, eps, sum_in_fp32, cast_before_weight, dtype, sum_dtype, compute_dtype, divide_by_rms)
    spec = family.spec_from_args(world, partials[0], residual, *norm_args)
    assert not family.problems(spec, SM_90)
    kernel = _load(spec, tmp_path)
    table = torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64)  # the rendezvous' buffer_ptrs_dev

    # The op's reference semantics: the ranks' sum (in x's dtype: the backend's all-reduce), then add_rms_norm's
    # reference. The kernel sums in fp32 in rank order and rounds once; for 2 ranks that is the backend's sum
    # bit for bit (checked here on the inputs themselves), for more an order the backend may or may not take.
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    if world == 2:
        assert torch.equal(total.to(dtype), partials[0] + partials[1])
    reduced = _interpreter_rounding(total, dtype)
    expected_y, expected_h = add_rms_norm_reference(reduced, residual, *norm_args)

    default = family.triton_default_config(spec, SM_90)
    several_rows = next(c for c in family.triton_configs(spec, SM_90) if c["ROWS"] == 4)
    # programs: one per row block, and 3 programs looping over the row blocks (the grid capped by the signal pad)
    for config, programs in ((default, 1 << 20), (several_rows, 3), (default, 3)):
        y = torch.full_like(expected_y, float("nan"))
        h = torch.full_like(expected_h, float("nan"))
        family.triton_launch(kernel, config, spec, table.data_ptr(), 0, 0, tokens, residual, weight, eps, y, h,
                             programs, barrier=False)
        assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
        if not sum_in_fp32:
            # y is a function of the rounded sum h: judged from the kernel's own h (one truncated ulp there is
            # not counted twice).
            expected_y, _ = add_rms_norm_reference(h, torch.zeros_like(h), *norm_args)
        assert not y.isnan().any(), "an element of y was not written"
        if dtype == torch.bfloat16 or compute_dtype == torch.bfloat16:
            # Every step of the norm rounds (and on the interpreter truncates) in bf16 where compute_dtype is bf16;
            # otherwise two roundings: the normalised value and the product.
            bound = 2.5 * ulp(expected_y, y.dtype) + (weight.float().abs() if weight is not None else 1.0) * \
                ulp(expected_y, y.dtype) * (4 if compute_dtype == torch.bfloat16 else 1)
            excess = (y.float() - expected_y.float()).abs() - bound
            assert (excess <= 0).all(), f"y exceeds the rounding bound by up to {excess.max().item():.3g}"
        else:
            assert_close_for_dtype(y, expected_y)


def test_gate_is_the_profiles_symmetric_memory_field():
    spec = family.spec_from_args(2, torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.bfloat16),
                                 None, 1e-6, False, True, torch.bfloat16, torch.bfloat16)
    assert SM_90.symmetric_memory and SM_80.symmetric_memory and not MP_31.symmetric_memory
    assert not family.problems(spec, SM_90)
    assert any("symmetric_memory" in p for p in family.problems(spec, MP_31))
    # The signal pad (9216 bytes by default) holds 2 barriers x WORLD flags per program.
    assert family.max_programs(2) == 576 and family.max_programs(8) == 144
    assert any("signal pad" in p for p in family.problems(family.AllReduceAddRmsNormSpec(spec.norm, 2000), SM_90))
    # Not a kernel family of the op: the default lowering stays the parts everywhere.
    from dzc.targets import KERNEL_FAMILIES

    assert "all_reduce_add_rms_norm" not in KERNEL_FAMILIES


_AOT_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path

    import torch

    import dzc
    from dzc.targets import all_reduce_add_rms_norm as family, triton_codegen
    from dzc.targets.profiles import SM_90

    assert not triton_codegen.interpreting()
    out = Path(sys.argv[1])
    results = []
    x = torch.empty(1, 7168, dtype=torch.bfloat16)
    for world in (2, 8):
        spec = family.spec_from_args(world, x, x, torch.empty(7168, dtype=torch.bfloat16), 1e-6, False, True,
                                     torch.bfloat16, torch.bfloat16)
        path = out / f"all_reduce_{world}.py"
        path.write_text(family.triton_source(spec, SM_90))
        config = family.triton_default_config(spec, SM_90)
        signature, constexprs = family.triton_signature(spec, config, barrier=True)
        kernel = triton_codegen.compile_ahead_of_time(path, family.TRITON_KERNEL_NAME, signature, constexprs,
                                                      config.num_warps, SM_90, num_stages=1,
                                                      divisible_by_16=("residual_ptr", "y_ptr", "h_ptr"))
        ptx = kernel.asm["ptx"]
        results.append(dict(world=world,
                            cas_release_sys=len(re.findall(r"atom\\.[a-z.]*release[a-z.]*sys[a-z.]*cas|atom\\.[a-z.]*sys[a-z.]*release[a-z.]*cas", ptx)),
                            cas_acquire_sys=len(re.findall(r"atom\\.[a-z.]*acquire[a-z.]*sys[a-z.]*cas|atom\\.[a-z.]*sys[a-z.]*acquire[a-z.]*cas", ptx)),
                            atoms=sorted(set(re.findall(r"atom\\.[a-z0-9.]+", ptx))),
                            multimem="multimem" in ptx, multicast="multicast" in ptx.lower(),
                            bar_sync="bar.sync" in ptx or "barrier.sync" in ptx))
    print("RESULTS " + json.dumps(results))
""")


def test_kernel_with_barrier_compiles_for_sm_90_with_system_scope_atomics(tmp_path):
    results = run_ahead_of_time_script(_AOT_SCRIPT, tmp_path)
    assert [r["world"] for r in results] == [2, 8]
    for r in results:
        # The barrier's signal (release) and wait (acquire) CAS at system scope; a CTA barrier around them.
        assert r["cas_release_sys"] >= 1 and r["cas_acquire_sys"] >= 1, r
        assert r["bar_sync"], r
        # No NVLink multicast: no multimem instruction, nothing multicast.
        assert not r["multimem"] and not r["multicast"], r


# ---------------------------------------------------------------------------------------------------------
# GPU (later sessions)


def _run_one_shot(rank: int, world: int, out_dir: str) -> None:
    """In a process group of `world` ranks on GPUs: the one-shot kernel against the op's reference (the group's
    all-reduce, then add_rms_norm_reference) over several calls and token counts (buffer reuse and growth; the
    pads must be reset after every call or the next call hangs)."""
    import torch.distributed as dist

    from dzc.targets import resolve_target

    profile = resolve_target("cuda").profile
    device = torch.device("cuda", rank)
    runner = family.OneShotAllReduceAddRmsNorm(dist.group.WORLD, profile, f"{out_dir}/kernels")
    errors = []
    for call, tokens in enumerate((1, 5, 64, 300, 7, 300)):
        generator = torch.Generator(device=device).manual_seed(100 * call + rank)
        x = torch.randn(tokens, 7168, device=device, generator=generator).bfloat16()
        residual = torch.randn(tokens, 7168, device=device,
                               generator=torch.Generator(device=device).manual_seed(call)).bfloat16()
        weight = (1 + 0.1 * torch.randn(7168, device=device,
                                        generator=torch.Generator(device=device).manual_seed(7))).bfloat16()
        args = (weight, 1e-6, False, True, torch.bfloat16, torch.bfloat16)
        y, h = runner(x, residual, *args)
        reduced = x.clone()
        dist.all_reduce(reduced)
        expected_y, expected_h = add_rms_norm_reference(reduced, residual, *args)
        errors.append([(h.float() - expected_h.float()).abs().max().item(),
                       (y.float() - expected_y.float()).abs().max().item()])
    torch.cuda.synchronize()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(errors, f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_shot_kernel_at_world_size_1_on_one_gpu(tmp_path):
    """A group of one rank: rendezvous of one, the barrier signalling only itself. torch's documentation does not
    say whether a single-rank rendezvous is allowed; where it refuses, the test skips with torch's error (then only
    test_one_shot_kernel_on_two_gpus covers the kernel on hardware)."""
    import torch.distributed as dist

    from dzc import distributed

    if family.runtime_problems(torch.device("cuda")):
        pytest.skip("; ".join(family.runtime_problems(torch.device("cuda"))))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        import torch.distributed._symmetric_memory as symm_mem

        try:
            probe = symm_mem.empty(16, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(probe, dist.group.WORLD.group_name)
        except RuntimeError as error:
            pytest.skip(f"symmetric memory rendezvous refuses a group of one here ({error}): needs 2 GPUs")
        _run_one_shot(0, 1, str(tmp_path))
    finally:
        dist.destroy_process_group()
    errors = json.loads((tmp_path / "rank0.json").read_text())
    # One rank: the reduced x is x itself; the kernel is add_rms_norm's on a GPU (round to nearest): h exact,
    # y within one bf16 rounding of the product (the squares summed in another order).
    for h_error, y_error in errors:
        assert h_error == 0.0, errors
        assert y_error <= 2 ** -4, errors


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_one_shot_kernel_on_two_gpus(tmp_path):
    """2 ranks (NCCL, symmetric memory over NVLink, no multicast): bit-identical h to NCCL's bf16 sum + residual
    (the 2-rank sum in fp32 rounded once is NCCL's), y within the norm's rounding; 6 calls (pads reset)."""
    import os

    from dzc import distributed

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    distributed.spawn_ranks(_run_one_shot, 2, str(tmp_path), backend="nccl")
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {errors}")
        for h_error, y_error in errors:
            assert h_error == 0.0, (rank, errors)
            assert y_error <= 2 ** -4, (rank, errors)
