"""Targets: the one explicit table of what dzc can compile for.

A target is a device profile (plain data) + the code generators that can emit its kernels + the runtime that
launches and times them. `target="cuda"` / `"musa"` name a vendor's default profile; `"cuda:sm_80"` or
`"musa:mp_22"` pick one. Nothing here is discovered by import side effects or file names.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from dzc.targets import add_rms_norm, device_runtime, tilelang_codegen, triton_codegen
from dzc.targets import varlen_attention
from dzc.targets import mxfp4_moe
from dzc.targets import dsa_indexer, dsa_topk, sparse_attention
from dzc.targets import add_layer_norm
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90, DeviceProfile


@dataclass(frozen=True)
class Target:
    profile: DeviceProfile
    codegens: dict[str, ModuleType]  # codegen name -> its module (NAME, VERSION, load/compile functions)
    runtime: device_runtime.DeviceRuntime  # launches on profile.torch_device_type tensors
    # CPU tensors run this target's Triton kernels through Triton's interpreter (how CI and the demo run CUDA
    # code without a GPU). MUSA targets do not: nothing should look as if it had run MUSA code.
    interpret_on_cpu: bool

    @property
    def name(self) -> str:
        return self.profile.name


_CODEGENS = {"triton": triton_codegen, "tilelang": tilelang_codegen}

TARGETS: dict[str, Target] = {
    "cuda:sm_90": Target(SM_90, _CODEGENS, device_runtime.CudaRuntime(), interpret_on_cpu=True),
    "cuda:sm_80": Target(SM_80, _CODEGENS, device_runtime.CudaRuntime(), interpret_on_cpu=True),
    "musa:mp_22": Target(MP_22, _CODEGENS, device_runtime.MusaRuntime(), interpret_on_cpu=False),
    "musa:mp_31": Target(MP_31, _CODEGENS, device_runtime.MusaRuntime(), interpret_on_cpu=False),
}

# A bare vendor name means its newest profile (Hopper / S5000).
DEFAULT_PROFILE = {"cuda": "cuda:sm_90", "musa": "musa:mp_31"}

# Kernel families: per dzc op, the module that knows its spec, sources, config spaces and launches.
KERNEL_FAMILIES: dict[str, ModuleType] = {
    "add_rms_norm": add_rms_norm,
    "add_layer_norm": add_layer_norm,
    "varlen_attention": varlen_attention,
    "mxfp4_moe": mxfp4_moe,
    "mxfp4_moe_w4a8": mxfp4_moe,  # the same family: specs of this op get the FP8 configs (MXFP4MoESpec)
    "dsa_indexer": dsa_indexer,
    "dsa_topk": dsa_topk,
    "sparse_attention": sparse_attention,
}

# Triton on CPU tensors (interpreter): how a CUDA or MUSA target runs where no GPU is present.
INTERPRETER = device_runtime.InterpreterRuntime()


def resolve_target(name: str) -> Target:
    """'cuda' | 'musa' | a full profile name -> Target; anything else is a ValueError naming the valid ones."""
    key = DEFAULT_PROFILE.get(name, name)
    if key not in TARGETS:
        valid = sorted(DEFAULT_PROFILE) + sorted(TARGETS)
        raise ValueError(f"unknown dzc target {name!r}; valid targets: {', '.join(valid)}")
    return TARGETS[key]
