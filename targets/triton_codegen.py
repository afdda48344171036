"""Triton code generation: render an op's template, write it as a module file, import it, compile it ahead of time.

Generated modules are imported from their file (not exec'd) so that tracebacks, Triton's cache and profilers show
real source. Whether they run compiled or through Triton's interpreter is fixed for the process when Triton is
imported (dzc/__init__.py chooses the interpreter when no GPU is present).
"""

from __future__ import annotations

from pathlib import Path

import triton

from dzc.targets.generated_module import import_generated
from dzc.targets.profiles import DeviceProfile

NAME = "triton"
VERSION = triton.__version__


def interpreting() -> bool:
    """Whether this process runs Triton kernels through the interpreter (fixed when Triton is imported)."""
    return triton.knobs.runtime.interpret


def load_kernel(path: Path, kernel_name: str):
    """Import the generated module at `path` and return its @triton.jit function."""
    module = import_generated(path)
    return getattr(module, kernel_name)


def compile_ahead_of_time(path: Path, kernel_name: str, signature: dict, constexprs: dict, num_warps: int,
                          profile: DeviceProfile):
    """triton.compile for `profile` without a device (stock Triton knows CUDA targets only).

    Catches type and shape errors the interpreter lets through; returns the compiled kernel (asm, metadata).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1")
    fn = load_kernel(path, kernel_name)
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    target = GPUTarget(profile.triton_backend, profile.compute_capability, profile.warp_size)
    return triton.compile(source, target=target, options={"num_warps": num_warps})


def load(family, path: Path, spec, profile: DeviceProfile):
    """The loaded kernel a family's triton_launch takes: the @triton.jit function itself (configs are launch
    arguments, so one load serves every config). A family whose op runs several kernels (routing, then GEMMs)
    names them in TRITON_KERNEL_NAMES and gets a dict from name to @triton.jit function."""
    names = getattr(family, "TRITON_KERNEL_NAMES", None)
    if names is not None:
        module = import_generated(path)
        return {name: getattr(module, name) for name in names}
    return load_kernel(path, family.TRITON_KERNEL_NAME)
