"""setmaxnreg of every warp-specialized TileLang kernel dzc offers stays within its block's register pool (no GPU).

setmaxnreg moves registers only within the block's own allocation: a 384-thread block launched at N registers a
thread (ptxas "Used N registers") holds 3 x N x 128, and a warpgroup's setmaxnreg.inc (SASS: USETMAXREG.TRY_ALLOC,
retried in a loop) waits until the other warpgroups' setmaxnreg.dec have freed enough. Counts over the block's
warpgroups that add up to more than warpgroups x N hang the kernel: the sparse attention's BALANCED=1 at 216 / 216 /
80 of 3 x 168 did on its first GPU run (session 39, H100; fixed in 8635a69, where
tests/test_sparse_attention_balanced.py checks that kernel's SASS too).

For the warp-specialized configs of each family (sparse attention's bf16 and FP8 caches with ROW_ADDRESS, BALANCED,
FP8_INTERLEAVED and CLUSTER; varlen attention's PINGPONG, OVERLAP, SPLIT_COLUMNS, LONGEST_FIRST; the FP8 indexer;
both MXFP4 MoE GEMMs), at the specs their own tests use, the kernel is lowered for sm_90a and compiled to a cubin
(nvcc -Xptxas -v): each warpgroup (threads / 128, by the source's threadIdx.x branches) reaches exactly one
setmaxnreg, not under a loop or another branch on threadIdx.x; an increase asks for at least the launch count, a
decrease for at most it; and the counts add up to at most warpgroups x the launch count. Lowering takes ~10 s a
kernel, so the default run covers one config of each distinct role layout (REPRESENTATIVE, ~2-3 minutes);
test_every_offered_config_has_a_representative ties every offered config to one, and DZC_SETMAXNREG_ALL=1 lowers
them all (test_every_offered_config, ~10 minutes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dzc.targets import dsa_indexer, mxfp4_moe, sparse_attention, tilelang_codegen, varlen_attention
from dzc.targets.profiles import SM_90

BF16 = torch.bfloat16
DSA_V32 = dict(topk=2048, page_size=64)
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, BF16, False, **DSA_V32)
MLA_FP8 = dataclasses.replace(MLA, fp8_cache=True)
INDEXER = dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True)
GPT_OSS = mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, BF16, torch.float32, BF16, BF16, "clamped_swiglu", True)

# name -> (family, spec): the specs of the per-family warp-specialized tests.
SPECS = {
    "sparse-bf16": (sparse_attention, MLA),
    "sparse-bf16-16h": (sparse_attention, dataclasses.replace(MLA, heads=16)),
    "sparse-fp8": (sparse_attention, MLA_FP8),
    "sparse-fp8-256h": (sparse_attention, dataclasses.replace(MLA_FP8, heads=256)),
    "varlen-d128": (varlen_attention, varlen_attention.make_spec(128, BF16, None)),
    "varlen-d72-rope": (varlen_attention, varlen_attention.make_spec(72, BF16, torch.float32)),
    "varlen-d80": (varlen_attention, varlen_attention.make_spec(80, BF16, None)),
    "indexer-fp8": (dsa_indexer, INDEXER),
    "moe-gpt-oss": (mxfp4_moe, GPT_OSS),
}

# The knobs whose configs run other setmaxnreg branches of their template: sparse attention's BALANCED consumers
# (216 / 216 / its own producer count) and CLUSTER producer. Every other knob (split counts, tiles, stages, rows a
# program, ROW_ADDRESS, FP8_INTERLEAVED, PINGPONG, OVERLAP, SPLIT_COLUMNS, LONGEST_FIRST) changes what a role computes
# under the same set_max_nreg calls; the representatives still take each of them at least once.
ROLE_KNOBS = {"sparse_attention": ("BALANCED", "CLUSTER")}


def _params(config) -> dict:
    return dict(config.params)


def _warp_specialized(config) -> bool:
    return bool(_params(config).get("WARP_SPECIALIZED"))


def _family_name(family) -> str:
    return family.__name__.rsplit(".", 1)[-1]


def _role_layout(family, spec, config) -> tuple:
    """The family, its cache type (sparse attention's FP8 cache has its own producer) and the role knobs set."""
    fp8 = getattr(spec, "fp8_cache", False) if family is sparse_attention else False
    knobs = ROLE_KNOBS.get(_family_name(family), ())
    return (_family_name(family), fp8, tuple(k for k in knobs if _params(config).get(k)))


def _offered():
    """(spec name, family, spec, config) of every warp-specialized TileLang config offered on sm_90 for SPECS."""
    return [(name, family, spec, config) for name, (family, spec) in SPECS.items()
            for config in family.tilelang_configs(spec, SM_90) if _warp_specialized(config)]


def _label(config) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(_params(config).items())
                    if k not in ("WARP_SPECIALIZED", "THREADS", "BLOCK_M", "BLOCK_H", "BLOCK_K"))


# One config of each role layout, decode and prefill forms mixed: (spec name, predicate on the config's params).
REPRESENTATIVE = {
    "sparse-bf16-prefill": ("sparse-bf16", lambda p: p["SPLITS"] == 0 and len(p) == 6),
    "sparse-bf16-row-address-decode": ("sparse-bf16", lambda p: p["SPLITS"] == 16 and p.get("ROW_ADDRESS")),
    "sparse-bf16-balanced-prefill": ("sparse-bf16", lambda p: p["SPLITS"] == 0 and p.get("BALANCED")),
    "sparse-fp8-decode": ("sparse-fp8", lambda p: p["SPLITS"] == 4 and len(p) == 6),
    "sparse-fp8-interleaved-prefill": ("sparse-fp8", lambda p: p["SPLITS"] == 0 and p.get("FP8_INTERLEAVED")
                                       and not p.get("CLUSTER")),
    "sparse-fp8-cluster-decode": ("sparse-fp8", lambda p: p["SPLITS"] == 1 and p.get("CLUSTER")),
    "varlen-d128-n176": ("varlen-d128", lambda p: p["BLOCK_N"] == 176 and len(p) == 5),
    "varlen-d128-pingpong-overlap": ("varlen-d128", lambda p: p.get("PINGPONG") and p.get("OVERLAP")),
    # (LONGEST_FIRST=1's twin: the same roles, and the knob covered)
    "varlen-d72-split-columns-pingpong": ("varlen-d72-rope", lambda p: p.get("SPLIT_COLUMNS") and p.get("PINGPONG")
                                          and not p.get("OVERLAP") and p.get("LONGEST_FIRST")),
    "indexer-4-rows": ("indexer-fp8", lambda p: p["ROWS"] == 4),
    "moe-n256-4-stages": ("moe-gpt-oss", lambda p: (p["BLOCK_N"], p["NUM_STAGES"]) == (256, 4)),
}


def _representative(name: str):
    spec_name, wanted = REPRESENTATIVE[name]
    family, spec = SPECS[spec_name]
    [config] = [c for c in family.tilelang_configs(spec, SM_90) if _warp_specialized(c) and wanted(_params(c))]
    return family, spec, config


def test_every_offered_config_has_a_representative():
    """Every warp-specialized config offered for SPECS shares its role layout with a REPRESENTATIVE one, and each
    knob any of a family's configs sets is set by one of its representatives (a new knob or family needs one
    there); every REPRESENTATIVE names exactly one offered config."""
    representatives = [_representative(name) for name in REPRESENTATIVE]
    offered = _offered()
    assert len(offered) >= 60, len(offered)
    missing = ({_role_layout(family, spec, config) for _, family, spec, config in offered}
               - {_role_layout(*r) for r in representatives})
    assert not missing, missing
    knobs = {(_family_name(family), k) for _, family, _, config in offered for k in _params(config)}
    assert not knobs - {(_family_name(family), k) for family, _, config in representatives for k in _params(config)}


# ---------------------------------------------------------------------------------------------------------
# Reading the CUDA source


_SETMAXNREG = re.compile(r"tl::warpgroup_reg_(alloc|dealloc)<(\d+)>\(\)"
                         r"|setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
_THREAD_TEST = re.compile(r"^\(*\(int\)threadIdx\.x\)\s*(<|>=)\s*(\d+)\)*$")


@dataclasses.dataclass
class _Frame:
    lo: int
    hi: int
    else_lo: int = 0
    else_hi: int = 0
    guarded: bool = False  # under a loop or a branch on anything but threadIdx.x


@dataclasses.dataclass(frozen=True)
class SetMaxNReg:
    increase: bool
    count: int
    threads: tuple[int, int]  # [first, last) threadIdx.x reaching it
    guarded: bool


def _split(frame: _Frame, condition: str) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """Thread ranges of a branch's then and else sides within `frame`: split at N by threadIdx.x < N (or >= N);
    any other condition keeps the range, and guards both sides where it reads threadIdx.x (threads of a warpgroup
    may differ). One on the block's data only (the MoE GEMMs' `expert >= 0` of blockIdx.y) the whole block takes
    alike."""
    match = _THREAD_TEST.match(condition.strip())
    if match is None:
        return (frame.lo, frame.hi), (frame.lo, frame.hi), "threadIdx" in condition
    bound = int(match.group(2))
    below = (frame.lo, min(frame.hi, bound))
    above = (max(frame.lo, bound), frame.hi)
    return (below, above, False) if match.group(1) == "<" else (above, below, False)


def setmaxnreg_sites(source: str, threads: int) -> list[SetMaxNReg]:
    """The setmaxnreg calls of the one kernel in `source` with the threadIdx.x range that reaches each, from the
    nesting of its `if (((int)threadIdx.x) < N) { ... } else { ... }` branches (TVM's CUDA: one statement a line)."""
    body = source[source.index("__global__"):]
    stack = [_Frame(0, threads)]
    sites = []
    for line in body.splitlines():
        for match in _SETMAXNREG.finditer(line):
            increase = (match.group(1) or match.group(3)) in ("alloc", "inc")
            frame = stack[-1]
            sites.append(SetMaxNReg(increase, int(match.group(2) or match.group(4)), (frame.lo, frame.hi),
                                    any(f.guarded for f in stack)))
        code = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
        popped = None
        for position, char in enumerate(code):
            if char == "}":
                popped = stack.pop()
                assert stack, "unbalanced braces"
            elif char == "{":
                head = code[:position].strip()
                parent = stack[-1]
                if head.startswith("}"):
                    head = head.lstrip("} ")
                if head.startswith("else"):
                    assert popped is not None, line
                    lo, hi = popped.else_lo, popped.else_hi
                    base = _Frame(lo, hi, guarded=popped.guarded)
                    head = head[len("else"):].strip()
                    parent = base
                if head.startswith("if"):
                    condition = head[head.index("(") + 1:head.rindex(")")]
                    then, other, guarded = _split(parent, condition)
                    stack.append(_Frame(*then, *other, guarded=parent.guarded or guarded))
                else:  # a loop, or a block (a plain else, an initializer, a scope)
                    loop = head.startswith(("for", "while", "do"))
                    stack.append(_Frame(parent.lo, parent.hi, guarded=parent.guarded or loop))
    return sites


def test_reader_on_a_nested_role_split():
    source = """extern "C" __global__ void __launch_bounds__(384, 1) k(int n) {
  for (int i = 0; i < n; ++i) {
    x = {1, 2};
  }
  if (((int)threadIdx.x) < 128) {
    tl::warpgroup_reg_alloc<240>();
    if (0 <= n) {
      asm volatile("{\\n bar.sync 1;\\n}");
    }
  } else {
    if (((int)threadIdx.x) < 256) {
      tl::warpgroup_reg_alloc<232>();
    } else {
      if (((int)threadIdx.x) & 1) {
        tl::warpgroup_reg_dealloc<24>();
      }
    }
  }
}
"""
    assert setmaxnreg_sites(source, 384) == [SetMaxNReg(True, 240, (0, 128), False),
                                             SetMaxNReg(True, 232, (128, 256), False),
                                             SetMaxNReg(False, 24, (256, 384), True)]


def _threads(source: str) -> int:
    [threads] = re.findall(r"__launch_bounds__\((\d+)", source)
    return int(threads)


def _launch_bound_registers(threads: int) -> int:
    """The most registers a thread of a `threads`-thread block may launch with: 64 K an SM, a multiple of 8."""
    return min(255, 65536 // threads) // 8 * 8


def ptxas_registers(source: str, workdir: Path) -> int:
    """ptxas's "Used N registers" for the kernel in `source`: the count the block launches with (its cubin only,
    no host code: ~3 s, not the ~15 s of tilelang_codegen.ptxas_report's object file)."""
    tilelang_dir = Path(importlib.util.find_spec("tilelang").origin).parent
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kernel.cu").write_text(source)
    result = subprocess.run(
        ["nvcc", "-std=c++20", "-w", "-O3", "--use_fast_math", "-cubin", "-arch", "sm_90a", "-Xptxas", "-v",
         f"-I{tilelang_dir / 'src'}", f"-I{tilelang_dir / '3rdparty' / 'cutlass' / 'include'}",
         str(workdir / "kernel.cu"), "-o", str(workdir / "kernel.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    [used] = re.findall(r"Used (\d+) registers", result.stderr)
    return int(used)


def check_pool(family, spec, config, workdir: Path) -> list[tuple[str, list[int], int]]:
    """Lower every kernel `config` launches, check its setmaxnreg against the block's pool; returns (kernel, counts
    a warpgroup, launch registers) of each warp-specialized one."""
    path = workdir / "kernel_tilelang.py"
    path.write_text(family.tilelang_source(spec, SM_90))
    checked = []
    for kernel, kernel_config in tilelang_codegen.factory_configs(family, spec, config).items():
        if kernel == "rotate":
            continue  # varlen attention's RoPE pre-rotation: no warp roles
        source = tilelang_codegen.lower_to_device_source(path, family.TILELANG_FACTORY_NAME, kernel_config, SM_90)
        threads = _threads(source)
        sites = setmaxnreg_sites(source, threads)
        what = (kernel, _label(kernel_config), sites)
        assert sites, what
        assert threads % 128 == 0 and all(s.threads[0] % 128 == s.threads[1] % 128 == 0 for s in sites), what
        assert not any(s.guarded for s in sites), what
        per_warpgroup = []
        for warpgroup in range(threads // 128):
            reached = [s for s in sites if s.threads[0] <= 128 * warpgroup < s.threads[1]]
            assert len(reached) == 1, (warpgroup, what)
            per_warpgroup.append(reached[0])
        bound = _launch_bound_registers(threads)
        launch = ptxas_registers(source, workdir / kernel) if shutil.which("nvcc") else bound
        assert launch <= bound, (launch, bound, what)
        counts = [s.count for s in per_warpgroup]
        assert all(24 <= n <= 256 and n % 8 == 0 for n in counts), what
        assert all(s.count >= launch if s.increase else s.count <= launch for s in per_warpgroup), (launch, what)
        assert sum(counts) <= len(counts) * launch, (counts, launch, what)
        checked.append((kernel, counts, launch))
    return checked


def _needs_tilelang():
    problem = tilelang_codegen.import_problem()
    if problem:
        pytest.skip(problem)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH (ptxas gives the count the block launches with)")


# The counts each representative's kernels set, a warpgroup (consumers first, the producer last), of 168 a thread.
EXPECTED = {
    "sparse-bf16-prefill": [[248, 168, 80]],
    "sparse-bf16-row-address-decode": [[248, 168, 80]],
    "sparse-bf16-balanced-prefill": [[216, 216, 72]],
    "sparse-fp8-decode": [[248, 168, 80]],
    "sparse-fp8-interleaved-prefill": [[248, 168, 80]],
    "sparse-fp8-cluster-decode": [[248, 168, 80]],
    "varlen-d128-n176": [[240, 240, 24]],
    "varlen-d128-pingpong-overlap": [[240, 240, 24]],
    "varlen-d72-split-columns-pingpong": [[240, 240, 24]],
    "indexer-4-rows": [[216, 216, 72]],
    "moe-n256-4-stages": [[200, 200, 96], [200, 200, 96]],
}


@pytest.mark.parametrize("name", list(REPRESENTATIVE))
def test_setmaxnreg_stays_within_the_blocks_registers(name, tmp_path):
    _needs_tilelang()
    family, spec, config = _representative(name)
    checked = check_pool(family, spec, config, tmp_path)
    assert [counts for _, counts, _ in checked] == EXPECTED[name], checked
    assert all(launch == 168 for _, _, launch in checked), checked


@pytest.mark.skipif(not os.environ.get("DZC_SETMAXNREG_ALL"), reason="~10 minutes: set DZC_SETMAXNREG_ALL=1")
@pytest.mark.parametrize("index", range(len(_offered())))
def test_every_offered_config(index, tmp_path):
    _needs_tilelang()
    name, family, spec, config = _offered()[index]
    print(name, _label(config), check_pool(family, spec, config, tmp_path))
