"""Triton code generation: render an op's template, write it as a module file, import it, compile it ahead of time.

Generated modules are imported from their file (not exec'd) so that tracebacks, Triton's cache and profilers show
real source. Whether they run compiled or through Triton's interpreter is fixed for the process when Triton is
imported (dzc/__init__.py chooses the interpreter when no GPU is present).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

from dzc.targets import musa_triton
from dzc.targets.generated_module import import_generated
from dzc.targets.launch import COMPILE_ONLY
from dzc.targets.profiles import DeviceProfile

NAME = "triton"
VERSION = triton.__version__
# As another codegen's tuning candidate (dzc/lowering.py) tuned over all its configs: each compiles in about a second.
TUNED_AS_ALTERNATIVE = True


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
        return {name: launchable(getattr(module, name)) for name in names}
    return launchable(load_kernel(path, family.TRITON_KERNEL_NAME))


def launchable(fn, interpret: bool | None = None):
    """A @triton.jit function as families launch it: through CachedLaunchKernel, or itself where Triton interprets
    (`interpret`, default this process's mode): the interpreter has no compiled kernels to launch directly."""
    return fn if (interpreting() if interpret is None else interpret) else CachedLaunchKernel(fn)


class CachedLaunchKernel:
    """A @triton.jit function whose launches skip the JIT's per-call work once a specialization is compiled.

    `JITFunction.run` costs about 20 µs of host time per launch on Triton 3.6 (device and stream lookups, its
    binder specialising every argument, a string cache key, option parsing, hook and global-value checks): more
    than the kernel itself for small token counts. Here the first launch of each specialization goes through the
    JIT (it compiles or loads the kernel and launches it), and later ones call the compiled kernel's launcher
    directly with the arguments, as Inductor's launchers do. A specialization is found by a key of the arguments'
    cheap facts (fast_key: dtypes, 16-byte alignment, integers equal to 1, multiples of 16, their integer width;
    a TMA descriptor's base dtype and block shape) that must determine Triton's own specialization: the installed
    Triton is checked once per process (fast_key_refines, on its specializer); where it specialises on anything
    else, every launch (with descriptors: every launch with one) takes the JIT path, as do launches with arguments
    of other kinds and, so that profilers (proton) see them, launches while launch hooks are installed. Used as
    `kernel[grid](*args, **constexprs_and_options)`, like the function.
    """

    def __init__(self, fn):
        self.fn = fn
        # (device, options and constexprs, fast_key(args)) -> (launcher, function, packed metadata, the
        # arguments after the positional ones, as Triton's binder completed them)
        self._launchers: dict[tuple, tuple] = {}
        # Constexpr parameters passed positionally are keyed by value (each value is its own kernel).
        self._constexprs = tuple(i for i, param in enumerate(fn.params) if param.is_constexpr)

    def __getattr__(self, name):  # everything else (warmup, src, ...) is the JIT function's
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        if COMPILE_ONLY.get():  # a Precompile job: compile into the JIT's cache, launch nothing
            self.fn.warmup(*args, grid=grid, **kwargs)
            return None
        hooks = triton.knobs.runtime
        if callable(grid) or _has_calls(hooks.launch_enter_hook) or _has_calls(hooks.launch_exit_hook):
            return self.fn[grid](*args, **kwargs)
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = (device, tuple(kwargs.items()), fast_key(args),
               tuple([args[i] for i in self._constexprs if i < len(args)]) if self._constexprs else ())
        launcher = self._launchers.get(key)
        if launcher is None:
            return self._first_launch(key, device, grid, args, kwargs)
        run, function, metadata, rest = launcher
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            driver.get_current_stream(device), function, metadata, None, None, None, *args, *rest)
        return None

    def _first_launch(self, key, device, grid, args, kwargs):
        """Launch through the JIT (it compiles or loads the kernel) and keep its launcher for `key`'s later calls,
        where the fast key stands for Triton's specialization here."""
        Precompile.wait_all()  # a kernel being compiled ahead is in the JIT's cache once its batch is done
        kernel = self.fn[grid](*args, **kwargs)
        binder = self.fn.device_caches[device][-1]
        plain, descriptors = _fast_keys_exact(binder)
        if plain and all(isinstance(a, _FAST_KINDS) or (descriptors and type(a) is _DESCRIPTOR) for a in args):
            bound = tuple(binder(*args, **kwargs)[0].values())
            self._launchers[key] = (kernel.run, kernel.function, kernel.packed_metadata, bound[len(args):])
        return kernel


_FAST_KINDS = (torch.Tensor, int, float, type(None))  # bool is an int
try:  # the host-side TMA descriptor (CUDA Tritons); only this exact class is keyed (not Gluon's, with a layout)
    from triton.tools.tensor_descriptor import TensorDescriptor as _DESCRIPTOR
except ImportError:
    _DESCRIPTOR = None


def fast_key(args: tuple) -> tuple:
    """What Triton's specialization of `args` depends on, cheaply: per tensor its dtype and whether its address is
    a multiple of 16; per integer whether it is 1 or a multiple of 16 and which of i32 / i64 / u64 it fits; per
    TMA descriptor its base's dtype and its block shape; per other argument its type."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
                  else (a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF, a >= 1 << 63) if type(a) is int
                  else (_DESCRIPTOR, a.base.dtype, tuple(a.block_shape)) if type(a) is _DESCRIPTOR
                  else type(a) for a in args])


def fast_key_refines(specialize, descriptors: bool = False) -> bool:
    """Whether arguments with equal fast_key always get equal specializations from `specialize(arg)` (Triton's own
    specializer): checked on groups of arguments that fast_key does not tell apart (addresses at every power-of-two
    offset up to 256 bytes, integers of every alignment and width, floats, booleans; with `descriptors`, TMA
    descriptors of one dtype and block shape over other addresses, shapes, strides and padding). The specializer
    reads a tensor's address and dtype only, so CPU tensors stand for device ones."""
    base = torch.empty(1024, dtype=torch.uint8)
    base = base[(-base.data_ptr()) % 256:]  # 256-byte aligned
    groups = [[base[o:] for o in (0, 16, 32, 48, 64, 128, 256)], [base[o:] for o in (1, 2, 4, 8, 24, 40)],
              [16, 32, 48, 64, 4096, -16, 1 << 20], [2, 3, 5, 8, 17, 2881, -1], [1 << 31, (1 << 40) + 16],
              [(1 << 31) + 1, (1 << 40) + 8], [(1 << 63) + 16, (1 << 64) - 16], [0.5, 1e-6, 1.0, 3.0], [True, False]]
    if descriptors:
        if _DESCRIPTOR is None:
            return False
        words = base[:768].view(torch.float32)  # 192 words: float, so that NaN padding is legal too
        views = [words.view(3, 64), words[16:].view(11, 16), words.view(6, 32)[:, :16], words[64:].view(2, 64)]
        groups = [[_DESCRIPTOR.from_tensor(v, [2, 16]) for v in views]
                  + [_DESCRIPTOR.from_tensor(words.view(3, 64), [2, 16], padding="nan")]]
    for group in groups:
        keys = {fast_key((a,)) for a in group}
        assert len(keys) == 1, f"fast_key tells {group} apart"
        if len({_frozen(specialize(a)) for a in group}) > 1:
            return False
    return True


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


_EXACT: dict[int, tuple[bool, bool]] = {}  # id(specializer) -> fast_key_refines on it, without / with descriptors


def _fast_keys_exact(binder) -> tuple[bool, bool]:
    """fast_key_refines on the specializer a Triton binder calls (`specialize_impl(backend, arg, is_const,
    specialize, align)` in Triton 3.6 and 3.9), for tensors and scalars and for TMA descriptors; False for a
    binder of another form (other Triton versions)."""
    namespace = getattr(binder, "__globals__", {})
    specialize, backend = namespace.get("specialize_impl"), namespace.get("backend")
    if specialize is None or backend is None:
        return False, False
    if id(specialize) not in _EXACT:
        exact = []
        for descriptors in (False, True):
            try:
                exact.append(fast_key_refines(lambda a: specialize(backend, a, False, True, True), descriptors))
            except Exception:  # a specializer with other parameters, a descriptor class of another form
                exact.append(False)
        _EXACT[id(specialize)] = (exact[0], exact[0] and exact[1])
    return _EXACT[id(specialize)]


def _has_calls(hook) -> bool:
    """Whether a Triton launch hook would do anything: None, or (Triton >= 3.5) an empty HookChain, does not."""
    return hook is not None and len(getattr(hook, "calls", (hook,))) > 0


class Precompile:
    """A graph's Triton kernels compiled ahead of its first call, in parallel, while the rest of the compile goes on.

    At a graph's first call each kernel's first launch compiles it through Triton's JIT, one after another on the
    calling thread (a second or more each: the first run took 16-25 s of a cold compile on an H100,
    docs/results/compile_time_h200.md). Each job here is a launch of one kernel as the call would make it, with
    meta tensors standing in for the call's (their sizes the first call's, their storage offsets its alignment):
    on this batch's thread, CachedLaunchKernel launches only compile (JITFunction.warmup), and under Triton's
    AsyncCompileMode those compiles run in a thread pool (Triton's compiler leaves the GIL for most of its work).
    They land in the JIT's own cache under the key a launch with the same specialization computes, so the first
    call finds them; a launch that specialises otherwise compiles as before. A kernel's first launch waits for the
    batches still running (wait_all), so nothing is compiled twice. A job that cannot run on meta tensors (a
    launcher that reads values on the host) is skipped: its kernels compile at the first call, as before."""

    _running: list[Precompile] = []
    _lock = threading.Lock()

    def __init__(self, jobs: list[tuple[str, Callable[[], object]]], device_context: Callable[[], object],
                 workers: int):
        self.jobs = jobs
        self.workers = workers
        self.compiled = 0  # kernel specializations compiled (or found in Triton's cache on disk)
        self.failed = 0  # compiles that raised (the first call compiles those itself and reports the error)
        self.skipped: collections.Counter[str] = collections.Counter()  # why -> jobs
        self.seconds = 0.0
        self._device_context = device_context
        self._listeners: list[Callable[[str], object]] = []
        self._done = False
        self._thread = threading.Thread(target=self._run, name="dzc-triton-precompile", daemon=True)
        with self._lock:
            self._running.append(self)
        self._thread.start()

    def _run(self) -> None:
        from triton.runtime._async_compile import AsyncCompileMode  # Triton >= 3.5 (available() checks)

        start = time.perf_counter()
        COMPILE_ONLY.set(True)  # this thread's own context: other threads launch as usual
        try:
            with self._device_context(), ThreadPoolExecutor(self.workers, "dzc-triton-compile") as pool, \
                    AsyncCompileMode(pool, ignore_errors=True) as mode:
                for name, job in self.jobs:
                    try:
                        job()
                    except Exception as err:  # noqa: BLE001  (the first call launches it as usual)
                        self.skipped[f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:120]}"] += 1
                futures = list(mode.raw_futures)  # (the mode forgets them once it has waited for them)
            for future in futures:
                if future.exception() is None:
                    self.compiled += 1
                else:
                    self.failed += 1
        except Exception as err:  # noqa: BLE001  (a driver without a device here: nothing compiled ahead)
            self.skipped[f"the batch: {type(err).__name__}: {str(err).splitlines()[0][:120]}"] += len(self.jobs)
        finally:
            self.seconds = time.perf_counter() - start
            with self._lock:
                self._done = True
                listeners, self._listeners = self._listeners, []
            for listener in listeners:
                listener(self.describe())

    def when_done(self, listener: Callable[[str], object]) -> None:
        """Call listener(describe()) once the batch is done (now, if it is)."""
        with self._lock:
            if not self._done:
                self._listeners.append(listener)
                return
        listener(self.describe())

    def wait(self) -> None:
        self._thread.join()
        with self._lock:
            if self in self._running:
                self._running.remove(self)

    @classmethod
    def wait_all(cls) -> None:
        if cls._running:
            for batch in list(cls._running):
                batch.wait()

    def describe(self) -> str:
        text = (f"{self.compiled} kernel specializations compiled ahead in {self.seconds:.2f} s "
                f"({len(self.jobs)} launches, {self.workers} threads)")
        if self.failed:
            text += f"; {self.failed} failed (compiled again at the first call)"
        if self.skipped:
            text += "; skipped: " + "; ".join(f"{n} x {why}" for why, n in self.skipped.items())
        return text

    @staticmethod
    def available() -> bool:
        """Whether this Triton compiles asynchronously (triton.runtime._async_compile: Triton >= 3.5)."""
        try:
            from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        except ImportError:
            return False
        return not interpreting()
