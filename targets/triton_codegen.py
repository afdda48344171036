"""Triton code generation: render an op's template, write it as a module file, import it, compile it ahead of time.

Generated modules are imported from their file (not exec'd) so that tracebacks, Triton's cache and profilers show
real source. Whether they run compiled or through Triton's interpreter is fixed for the process when Triton is
imported (dzc/__init__.py chooses the interpreter when no GPU is present).
"""

from __future__ import annotations

import os
from pathlib import Path

import triton

from dzc.targets import musa_triton
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
                          profile: DeviceProfile, num_stages: int | None = None,
                          divisible_by_16: tuple[str, ...] = ()):
    """triton.compile for `profile` without a device (stock Triton knows CUDA targets only).

    Catches type and shape errors the interpreter lets through; returns the compiled kernel (asm, metadata).
    divisible_by_16 names the arguments a real launch would have Triton specialise as multiples of 16 (pointers
    from torch's allocator, strides of dense tensors): vectorised and asynchronous loads, and so shared-memory
    use, depend on it.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1")
    fn = load_kernel(path, kernel_name)
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    source = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget(profile.triton_backend, profile.compute_capability, profile.warp_size)
    options = {"num_warps": num_warps}
    if num_stages is not None:  # software pipelining depth: it sets how many shared-memory buffers loads get
        options["num_stages"] = num_stages
    return triton.compile(source, target=target, options=options)


def load(family, path: Path, spec, profile: DeviceProfile):
    """The loaded kernel a family's triton_launch takes: the @triton.jit function itself (configs are launch
    arguments, so one load serves every config). A family whose op runs several kernels (routing, then GEMMs)
    names them in TRITON_KERNEL_NAMES and gets a dict from name to @triton.jit function."""
    # Triton compiles at the first launch and reads its environment then: set what the profile's compiler needs
    # for this kernel (MUSA_ENABLE_SQMMA for tl.dot on mp_31) now, for the rest of the process.
    os.environ.update(musa_triton.compile_environment(profile, path.read_text()))
    names = getattr(family, "TRITON_KERNEL_NAMES", None)
    if names is not None:
        module = import_generated(path)
        return {name: _launchable(getattr(module, name)) for name in names}
    return _launchable(load_kernel(path, family.TRITON_KERNEL_NAME))


def _launchable(fn):
    # The interpreter has no compiled kernels to launch directly; it runs the function itself.
    return fn if interpreting() else CachedLaunchKernel(fn)


class CachedLaunchKernel:
    """A @triton.jit function whose launches skip the JIT's per-call bookkeeping once a specialization is compiled.

    `JITFunction.run` costs about 20 µs of host time per launch on Triton 3.6 (device and stream lookups, a
    string cache key, option parsing, hook and global-value checks): more than the kernel itself for small
    token counts. This keeps Triton's own binder, so the specialization (dtypes, 16-byte alignment, integers
    equal to 1) is exactly Triton's, keys the compiled kernel on it, and calls the kernel's launcher directly,
    as Inductor's launchers do. Used as `kernel[grid](*args, **constexprs_and_options)`, like the function.
    With launch hooks installed (profilers such as proton), every launch takes the JIT path so they see it.
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict[tuple, object] = {}

    def __getattr__(self, name):  # everything else (warmup, src, ...) is the JIT function's
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        hooks = triton.knobs.runtime
        if callable(grid) or _has_calls(hooks.launch_enter_hook) or _has_calls(hooks.launch_exit_hook):
            return self.fn[grid](*args, **kwargs)
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        binder = self.fn.device_caches[device][-1]
        bound, specialization, _ = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(kwargs.items()))
        kernel = self._compiled.get(key)
        if kernel is None:  # first launch of this specialization: the JIT compiles (or loads) and launches it
            kernel = self._compiled[key] = self.fn[grid](*args, **kwargs)
            return kernel
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   driver.get_current_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                   *bound.values())
        return kernel


def _has_calls(hook) -> bool:
    """Whether a Triton launch hook would do anything: None, or (Triton >= 3.5) an empty HookChain, does not."""
    return hook is not None and len(getattr(hook, "calls", (hook,))) > 0
