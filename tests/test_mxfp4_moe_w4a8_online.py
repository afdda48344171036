"""W4A8 online (FP8=1, WORKSPACE=0): both GEMMs convert the packed MXFP4 weights to E4M3 in registers, with no
conversion kernel and no workspace. The in-register conversion against the op's rounding (mxfp4_to_e4m3) bit for
bit at every relative exponent a block can have, the layer bit for bit against the workspace path of the same tile,
and the sm_90 compile of the offered tiles. The layer against the op's reference: tests/test_mxfp4_moe_w4a8.py's
W4A8_CASES.

On CPU the kernels run through Triton's interpreter, where the word lookup is its arithmetic form; on a GPU the
same tests run the inline-PTX byte permutes (the tables and the bytes must be the same). Inputs are fresh seeded
random weights; outputs are poisoned before every launch.
"""

import pytest
import torch
from conftest import SASS_TABLES_TRITON, gpt_oss_gemm_sass

from dzc.ops.mxfp4_moe import FP8_GROUP, mxfp4_to_e4m3
from dzc.targets import mxfp4_moe, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE
ONLINE = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=1, FP8=1)
ONLINE_STACKED = KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=0, SPLIT_K=1, FP8=1,
                                   FP8_STACKED=1)

_TILE_PROBE = '''

@triton.jit
def e4m3_tile_probe(blocks_ptr, scales_ptr, out_ptr, block_scales_ptr, N: tl.constexpr, K: tl.constexpr,
                    ROWS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    k0 = tl.program_id(0) * FP8_GROUP
    scales = _e4m3_scales(scales_ptr, rows, rows < N, k0, K)
    tile, block_scale = _e4m3_tile(blocks_ptr, scales, rows, rows < N, k0, K, ROWS)
    columns = k0 + tl.arange(0, FP8_GROUP)
    tl.store(out_ptr + rows[:, None] * K + columns[None, :], tile.to(tl.uint8, bitcast=True),
             mask=(rows < N)[:, None] & (columns < K)[None, :])
    tl.store(block_scales_ptr + rows * _groups(K) + tl.program_id(0), block_scale, mask=rows < N)
'''


def _spec(args) -> mxfp4_moe.MXFP4MoESpec:
    return mxfp4_moe.spec_from_args(*args[:11], fp8_activations=True)


def _source(tmp_path, extra: str = ""):
    args = mxfp4_moe.random_moe_args(torch.device("cpu"), torch.Generator().manual_seed(0), tokens=1, hidden=160,
                                     inter=96, experts=2, top_k=1)
    path = tmp_path / "w4a8_online.py"
    path.write_text(mxfp4_moe.triton_source(_spec(args), SM_90) + extra)
    return path


def test_in_register_conversion_is_the_workspace_conversion_bit_for_bit(seed, tmp_path):
    """_e4m3_tile (tables of E4M3 bytes per MX group, looked up per word) against mxfp4_to_e4m3, the op's rounding
    (torch's own E4M3 cast): every E2M1 code in every group at every relative exponent from 0 to -26 (E4M3's
    subnormals from -6 on, everything rounds to zero from -13 on), scale bytes 0 and 1 (read as 1), 0xFF (a NaN
    block scale), 0xFE as a block's largest, a 32-column tail block (K = 160) and masked rows (40 of 64)."""
    generator = torch.Generator().manual_seed(seed)
    n, k = 40, 160
    # Each 16-byte group holds every code among its low nibbles and among its high ones, shuffled per group.
    codes = torch.arange(16, dtype=torch.uint8)
    groups = torch.stack([codes[torch.randperm(16, generator=generator)]
                          | (codes[torch.randperm(16, generator=generator)] << 4) for _ in range(n * k // 32)])
    blocks = groups.reshape(n, k // 32, 16)
    # Block 0 of row i: its largest scale, then three groups 0..26 below it (each distance in several rows).
    largest = torch.randint(60, 200, (n,), generator=generator)
    distance = torch.arange(3 * n).reshape(n, 3) % 27
    scales = torch.randint(90, 150, (n, k // 32), generator=generator)
    scales[:, 0] = largest
    scales[:, 1:4] = largest[:, None] - distance[torch.randperm(n, generator=generator)]
    scales[:, 1:4] = scales[:, 1:4][:, torch.randperm(3, generator=generator)]
    scales[0, :4] = torch.tensor([0, 1, 5, 3])
    scales[1, :4] = torch.tensor([0xFE, 0xFE - 7, 0xFE - 13, 0])
    scales[2, 2] = 0xFF
    scales = scales.to(torch.uint8)
    path = _source(tmp_path, _TILE_PROBE)
    probe = triton_codegen.load_kernel(path, "e4m3_tile_probe")
    out = torch.full((n, k), 0x7F, dtype=torch.uint8, device=DEVICE)
    block_scales = torch.full((n, 2), -1.0, device=DEVICE)
    probe[(2,)](blocks.to(DEVICE), scales.to(DEVICE), out, block_scales, N=n, K=k, ROWS=64)
    values, expected_scales = mxfp4_to_e4m3(blocks, scales)
    columns = torch.arange(k)
    nibble_order = columns // 32 * 32 + columns % 16 * 2 + columns % 32 // 16  # position -> column
    expected = values[:, nibble_order].to(torch.float8_e4m3fn).view(torch.uint8)
    mismatches = (out.cpu() != expected).nonzero()
    assert not len(mismatches), f"{len(mismatches)} bytes differ, first at (row, position) {mismatches[0].tolist()}"
    torch.testing.assert_close(block_scales.cpu(), expected_scales, atol=0, rtol=0, equal_nan=True)
    assert block_scales[2, 0].isnan() and block_scales.isnan().sum() == 1
    relative = scales[:, :4].int().clamp(min=1) - scales[:, :4].int().clamp(min=1).amax(1, keepdim=True)
    assert set(range(-26, 1)) <= set(relative.unique().tolist()), "every relative exponent must be exercised"
    e4m3 = values[:, :128].to(torch.float8_e4m3fn).view(torch.uint8)
    assert ((e4m3 & 0x78) == 0).logical_and(e4m3 & 7 != 0).any(), "E4M3 subnormals must occur"


def _layer_args(seed: int):
    """A prefill-sized layer (128 rows an expert: FP8 applies) with K tails (H = 160, I = 96), blocks whose MX
    scales differ by 9 to 14 (E4M3 subnormals, values rounded to zero), scale bytes 0, and one NaN scale in the
    down weight (expert 1, output column 7); bf16 activations."""
    args = list(mxfp4_moe.random_moe_args(torch.device("cpu"), torch.Generator().manual_seed(seed), tokens=128,
                                          hidden=160, inter=96, experts=2, top_k=2))
    generator = torch.Generator().manual_seed(seed + 1)
    for index in (4, 7):  # w13_scales, w2_scales
        scales = args[index].clone().int()
        spread = torch.rand(scales.shape, generator=generator) < 0.3
        drop = torch.randint(9, 15, scales.shape, generator=generator)
        scales = torch.where(spread, (scales - drop).clamp(min=0), scales)
        scales[0, 3, 1] = 0
        args[index] = scales.to(torch.uint8)
    args[7][1, 7, 2] = 0xFF
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


class _Launches:
    """One kernel of a loaded module, launched as usual, counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_online_layer_gives_the_workspace_paths_bits(seed, tmp_path):
    """The same tile (64 x 64, gate and up stacked) online and from the workspace: the same E4M3 operands, scales
    and dot, so the layer's output is the same bit for bit, the NaN scale's column included; the online launch runs
    no conversion kernel and takes no workspace. (The unstacked online tile against the reference:
    tests/test_mxfp4_moe_w4a8.py's W4A8_CASES.)"""
    online, workspace = (KernelConfig.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WORKSPACE=path, SPLIT_K=1,
                                           FP8=1, FP8_STACKED=1) for path in (0, 1))
    args = _layer_args(seed)
    spec = _spec(args)
    path = tmp_path / "w4a8.py"
    path.write_text(mxfp4_moe.triton_source(spec, SM_90))
    kernels = dict(triton_codegen.load(mxfp4_moe, path, spec, SM_90))
    convert = kernels["mxfp4_to_e4m3_experts_kernel"] = _Launches(kernels["mxfp4_to_e4m3_experts_kernel"])
    outs = []
    for config, poison in ((online, float("nan")), (workspace, 7.0)):
        mxfp4_moe.release_workspaces()
        inputs, (out,), _, _ = mxfp4_moe.prepare(spec, *args)
        assert inputs[-1] is True, "128 rows per expert must quantize"
        out.fill_(poison)
        launched = convert.count
        mxfp4_moe.triton_launch(kernels, config, *inputs, out)
        if config is online:
            assert convert.count == launched and mxfp4_moe.workspace_bytes(DEVICE) == 0, "online takes no workspace"
        else:
            assert convert.count == launched + 2 and mxfp4_moe.workspace_bytes(DEVICE) > 0
        outs.append(out.clone())
    # The NaN scale (expert 1, down row 7) reaches output column 7 of the tokens routed to expert 1, only there.
    nan_tokens = (args[1] == 1).any(1)
    expected_nan = torch.zeros_like(outs[0], dtype=torch.bool)
    expected_nan[nan_tokens, 7] = True
    assert torch.equal(outs[0].isnan(), expected_nan), "NaN outside the NaN scale's column: an output not written?"
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0, equal_nan=True)
    assert mxfp4_moe.describe_config(online).startswith("W4A8 online")


def test_online_stacked_tile_is_the_untuned_w4a8_prefill_choice():
    """The online tiles are in the W4A8 prefill tier for the tuner, the stacked 64 x 64 one its untuned choice (at
    gpt-oss-120b T=8192 its kernels took 7528 µs against the workspace tile's 15102 on an H100, session 40), and
    none is offered at decode sizes."""
    spec = mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
                                  "clamped_swiglu", True, fp8_activations=True)
    legal, _ = legal_configs(mxfp4_moe, "triton", spec, SM_90)
    online = [c for c in legal if dict(c.params).get("FP8") == 1 and c["WORKSPACE"] == 0]
    assert sorted(str(c) for c in online) == sorted(str(c) for c in mxfp4_moe.triton_configs(spec, SM_90)
                                                    if dict(c.params).get("FP8") == 1 and c["WORKSPACE"] == 0)
    assert ONLINE in online and ONLINE_STACKED in online and all(c["BLOCK_K"] == FP8_GROUP for c in online)
    tier, default = mxfp4_moe.configs_for_bucket(spec, SM_90, mxfp4_moe.token_bucket(8192), legal, legal[0])
    assert set(online) <= set(tier) and default == ONLINE_STACKED, default
    tier, _ = mxfp4_moe.configs_for_bucket(spec, SM_90, mxfp4_moe.token_bucket(64), legal, legal[0])
    assert not set(online) & set(tier)
    aligned = mxfp4_moe._plain_loads(ONLINE_STACKED)  # weights off 16-byte alignment: the workspace tile
    assert aligned["WORKSPACE"] == 1 and dict(aligned.params)["FP8_STACKED"] == 1


def test_online_tiles_compile_for_sm_90_with_fp8_wgmma_and_no_spills(tmp_path):
    """The offered online tiles' GEMMs compiled for sm_90 at gpt-oss-120b's shape and read by
    `tools/diagnose_mxfp4_moe_kernels.py --sass`: E4M3 wgmma (QGMMA), nothing spilled, the shared memory within the
    family's estimate, and a K step of the word lookup's length: converting each value by rounding arithmetic
    (the first form) took 4564 instructions a step on the stacked 64 x 64 gate/up tile, the lookup 748
    (docs/mxfp4_moe_kernels.md). Counts checked with Triton 3.9+."""
    tiles = {"stacked64": "BLOCK_M=64,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,WORKSPACE=0,FP8=1,FP8_STACKED=1,num_warps=4,"
                          "num_stages=3",
             "stacked128": "BLOCK_M=128,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,WORKSPACE=0,FP8=1,FP8_STACKED=1,"
                           "num_warps=8,num_stages=3"}
    results = gpt_oss_gemm_sass(tmp_path, **tiles)
    for label, result in results.items():
        for name, profile in result["profiles"].items():
            loop = profile["loop"]
            assert loop and all(s.startswith("QGMMA.") and s.endswith(".E4M3.E4M3") for s in loop["mma_shapes"]), \
                (label, name, loop)
            assert profile["spill_bytes"] == [0, 0] and loop["spill_accesses_in_loop"] == 0, (label, name, profile)
            assert profile["shared"] <= result["shared_estimate"], (label, name, profile["shared"])
            if SASS_TABLES_TRITON:
                assert loop["instructions"] < 900, (label, name, loop["instructions"])
                # each thread's packed words (16 a weight row), at least 3 byte permutes each: the lookup
                config = dict(item.split("=") for item in tiles[label].split(","))
                rows = int(config["BLOCK_N"]) * (2 if name == "moe_gate_up_kernel" else 1)
                words = rows * 16 // (32 * int(config["num_warps"]))
                assert loop["counts"].get("PRMT", 0) >= 3 * words, (label, name, loop["counts"])

