"""Static legality of an emitted kernel: its configs and its generated source, checked for a profile.

targets/legality.py prunes configs before tuning; this checks the finished product the way a MUSA card would
judge it, with no device: the untuned default config too (it is not pruned, it is chosen), threads and warp
multiples, the shared-memory estimate and the dtypes against the profile, the Triton APIs the profile's Triton
builds cannot lower (targets/musa_triton.py), and TileLang buffer dtypes the profile lacks (no FP4/FP6 on any
MUSA arch; FP8 only where native).
"""

from __future__ import annotations

import ast
import re
from types import ModuleType

from dzc.targets import musa_triton
from dzc.targets.launch import legal_configs
from dzc.targets.legality import config_problems
from dzc.targets.profiles import DeviceProfile

# TileLang dtype names of the narrow float formats -> the torch name a profile lists as native (None: no torch
# name, i.e. native nowhere dzc targets).
_TILELANG_NARROW_DTYPES = {
    "float8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float4_e2m1fn": None, "float6_e2m3fn": None, "float6_e3m2fn": None,
}
_NARROW_DTYPE_TOKEN = re.compile(r"\bfloat[468]_e\d+m\d+\w*")


def tilelang_source_problems(source: str, profile: DeviceProfile) -> list[str]:
    """Narrow float dtypes (in dtype strings or T.<dtype> names) that `profile` has no native support for."""
    tokens = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            tokens.update(_NARROW_DTYPE_TOKEN.findall(node.value))
        elif isinstance(node, ast.Attribute):
            tokens.update(_NARROW_DTYPE_TOKEN.findall(node.attr))
    problems = []
    for token in sorted(tokens):
        native = _TILELANG_NARROW_DTYPES.get(token)
        if native is None or native not in profile.native_dtypes:
            problems.append(f"uses {token} buffers: not native on {profile.arch}")
    return problems


def kernel_problems(family: ModuleType, codegen: str, spec, profile: DeviceProfile, source: str) -> list[str]:
    """Everything statically wrong with the kernel `family` emits for (codegen, spec, profile); empty when legal."""
    problems = []
    legal, _ = legal_configs(family, codegen, spec, profile)
    if not legal:
        problems.append(f"no legal {codegen} config on {profile.name}")
    default = getattr(family, f"{codegen}_default_config")(spec, profile)
    smem = getattr(family, f"{codegen}_shared_memory_bytes")
    for config in [default, *legal]:
        threads = config.num_warps * profile.warp_size
        for problem in config_problems(profile, threads=threads, num_warps=config.num_warps if codegen == "triton"
                                       else None, shared_memory_bytes=smem(spec, config), dtypes=spec.dtypes):
            problems.append(f"config {config}: {problem}")
    if codegen == "triton":
        problems += musa_triton.source_problems(source, profile)
    elif codegen == "tilelang":
        problems += tilelang_source_problems(source, profile)
    return problems
