"""Which Triton is installed (upstream, Moore Threads' vendor build, or FlagTree), what it can do, and the rules
generated Triton source must follow on each.

A MUSA user has one of two Triton builds, and either replaces the `triton` package (../shared/reference/musa.md
§3.1): the vendor's wheel (Triton 3.2, backend module `triton.backends.mtgpu`) or FlagTree (3.6, backend
`triton.backends.mthreads`). Features are probed, not assumed from the version: tensor descriptors exist on
FlagTree 3.6 but not on the vendor 3.2 build. Some APIs exist in every build's frontend yet no MUSA backend
lowers them (tl.dot_scaled, inline asm, Gluon, multi-CTA clusters, the tl.extra.cuda library); those are
forbidden in any kernel generated for a MUSA profile, whichever build is installed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass

from dzc.targets.profiles import DeviceProfile

# Triton backend module -> flavour name (musa.md §3.1).
MUSA_BACKEND_MODULES = {"triton.backends.mtgpu": "mtgpu", "triton.backends.mthreads": "mthreads"}


@dataclass(frozen=True)
class TritonFlavour:
    name: str  # "upstream" | "mtgpu" (Moore Threads' vendor build) | "mthreads" (FlagTree)
    version: str
    backend_module: str | None  # the MUSA backend package, None for upstream Triton
    tensor_descriptors: bool  # tl.make_tensor_descriptor exists

    @property
    def targets_musa(self) -> bool:
        return self.backend_module is not None


# What a MUSA kernel may meet when no MUSA Triton is installed here: the builds users have (musa.md §3.1). Rules
# for a MUSA profile are checked against each, so generated code is legal on whichever the card owner has.
KNOWN_MUSA_FLAVOURS = (
    TritonFlavour("mtgpu", "3.2.0", "triton.backends.mtgpu", tensor_descriptors=False),
    TritonFlavour("mthreads", "3.6.0", "triton.backends.mthreads", tensor_descriptors=True),
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@functools.cache
def detect_flavour() -> TritonFlavour:
    """The installed Triton's flavour and features (imports triton.language; never a GPU)."""
    import triton
    import triton.language as tl

    backend = next((module for module in MUSA_BACKEND_MODULES if _module_exists(module)), None)
    name = MUSA_BACKEND_MODULES[backend] if backend else "upstream"
    return TritonFlavour(name, triton.__version__, backend, tensor_descriptors=hasattr(tl, "make_tensor_descriptor"))


# API name (an attribute or imported module path in kernel source) -> why no MUSA backend accepts it.
_FORBIDDEN_ON_MUSA = {
    "dot_scaled": "tl.dot_scaled (microscaled dot): no MUSA backend lowers it; dequantise and use tl.dot",
    "inline_asm_elementwise": "inline assembly: MUSA has no PTX and no inline-asm path",
    "gluon": "Gluon: 'MUSA backend does not support GLUON yet' (FlagTree)",
    "extra.cuda": "tl.extra.cuda: CUDA-only library; MUSA builds ship tl.extra.musa / libdevice",
    "num_ctas": "num_ctas / clusters: unsupported on MUSA (kernels run with num_ctas = 1)",
}
_TENSOR_DESCRIPTOR_APIS = ("make_tensor_descriptor", "TensorDescriptor")


def forbidden_apis(profile: DeviceProfile, flavour: TritonFlavour | None = None) -> dict[str, str]:
    """API name -> why it may not appear in Triton source generated for `profile`.

    flavour: the Triton build the kernel will meet; None = every build a user of this profile may have (the
    installed one where it targets this profile's backend, else KNOWN_MUSA_FLAVOURS).
    """
    if flavour is not None:
        flavours = (flavour,)
    else:
        installed = detect_flavour()
        musa_profile = profile.triton_backend == "musa"
        flavours = KNOWN_MUSA_FLAVOURS if musa_profile and not installed.targets_musa else (installed,)
    forbidden = {}
    if profile.triton_backend == "musa":
        forbidden.update(_FORBIDDEN_ON_MUSA)
    if not profile.triton_tensor_descriptors or not all(f.tensor_descriptors for f in flavours):
        for api in _TENSOR_DESCRIPTOR_APIS:
            without = [f"{f.name} {f.version}" for f in flavours if not f.tensor_descriptors]
            forbidden[api] = (f"tensor descriptors: absent on {', '.join(without)}" if without
                              else f"tensor descriptors: profile {profile.name} does not allow them")
    return forbidden


def _names_used(source: str) -> set[str]:
    """Every dotted attribute path, name and imported module path in `source` (comments and strings ignored)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            parts = []
            value = node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                parts.append(value.id)
            names.add(".".join(reversed(parts)))
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return names


def _mentions(names: set[str], api: str) -> bool:
    """Whether `api` ("dot_scaled", "extra.cuda") is a whole component sequence of some used name."""
    parts = api.split(".")
    for name in names:
        components = name.split(".")
        if any(components[i:i + len(parts)] == parts for i in range(len(components))):
            return True
    return False


def source_problems(source: str, profile: DeviceProfile, flavour: TritonFlavour | None = None) -> list[str]:
    """Forbidden APIs that generated Triton source uses on `profile`; empty when it uses none."""
    names = _names_used(source)
    return [f"uses {api}: {why}" for api, why in forbidden_apis(profile, flavour).items() if _mentions(names, api)]


def uses_matrix_instructions(source: str) -> bool:
    """Whether the kernel calls tl.dot (the only Triton op that lowers to MMA/SQMMA)."""
    return _mentions(_names_used(source), "dot")


def compile_environment(profile: DeviceProfile, source: str) -> dict[str, str]:
    """Environment the MUSA Triton compiler must see when it compiles this kernel.

    The vendor 3.2 build (and FlagTree 3.1) emit SQMMA for tl.dot on mp_31 only when MUSA_ENABLE_SQMMA=1 is set
    at compile time; FlagTree 3.6 always does, and the variable is harmless there (musa.md §3.2; FlagGems sets
    it around its own MUSA matrix kernels)."""
    if profile.matrix_instruction == "sqmma" and uses_matrix_instructions(source):
        return {"MUSA_ENABLE_SQMMA": "1"}
    return {}
