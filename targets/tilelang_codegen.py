"""TileLang code generation: import a rendered kernel module, build its prim_func for a config, lower or compile it.

A generated TileLang module defines a factory (e.g. `build(threads, rows)`) that returns a `@T.prim_func` for
one block shape; a config's params, lower-cased, are the factory's keyword arguments. It may name TileLang pass
configs its kernels need in PASS_CONFIGS (lowering and compiling add them to the profile's). TileLang reads a
prim_func's source with inspect, so generated code is always imported from its file, never exec'd.

Without a GPU, lowering gives the device source (CUDA C++ for CUDA profiles) and nvcc can compile it; running
needs `tilelang.compile` on a machine with the device. `import tilelang` takes seconds, so it happens only inside
the functions that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dzc import config as dzc_config
from dzc.targets.generated_module import import_generated
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.profiles import DeviceProfile

NAME = "tilelang"
# As another codegen's tuning candidate (dzc/lowering.py) only its untuned default config: each config takes
# 10-30 s to build (TVM lowering and nvcc), so tuning over all of them would multiply every tuned compile.
TUNED_AS_ALTERNATIVE = False
try:
    VERSION = importlib.metadata.version("tilelang")
except importlib.metadata.PackageNotFoundError:  # dzc still imports; TileLang kernels fail when first built
    VERSION = "not installed"

# Target kinds that upstream TileLang lacks, and the TileLang build that provides each.
_FORKS_BY_TARGET_KIND = {
    "musa": "Moore Threads' TileLang fork tilelang_musa (https://github.com/MooreThreads/tilelang_musa, "
            "which needs the MUSA SDK and torch_musa)",
}


def load_factory(path: Path, factory_name: str):
    """Import the generated module at `path` (once per process) and return its prim_func factory."""
    module = import_generated(path)
    return getattr(module, factory_name)


def build_prim_func(path: Path, factory_name: str, config: KernelConfig):
    """The generated module's prim_func for one config, read from its record beside the module where an earlier
    process kept one (prim_func_record), else built by the factory and recorded. TileLang's front end took 0.4-0.6 s
    for the sparse attention's decode kernel on the CPU host, the record 0.03 s (a warm start builds every kernel's)."""
    from tilelang import tvm

    record = prim_func_record(path, factory_name, config)
    try:
        recorded = tvm.ir.load_json(record.read_text())
        # (TVM's TIR is tvm.tirx in upstream TileLang, tvm.tir in older builds such as forks)
        if isinstance(recorded, (getattr(tvm, "tirx", None) or tvm.tir).PrimFunc):
            return recorded
    except Exception:  # noqa: BLE001 - none yet, or a damaged one (a full disk): built again below
        pass
    factory = load_factory(path, factory_name)
    prim_func = factory(**{name.lower(): value for name, value in config.params})
    # Recorded only where the JSON reads back as the same function: the same script, which is all TileLang keys its
    # kernel cache by (so the record can only ever give what the factory gives).
    try:
        text = tvm.ir.save_json(prim_func)
        same = tvm.ir.load_json(text).script(show_meta=True) == prim_func.script(show_meta=True)
    except Exception:  # noqa: BLE001 - a node TVM cannot serialize: not recorded, built by the factory each time
        same = False
    if same:
        _write_atomically(record, text)
    return prim_func


def prim_func_record(path: Path, factory_name: str, config: KernelConfig) -> Path:
    """Where the prim_func of `path`'s module, `factory_name` and `config` is kept, as TVM's JSON of it: keyed by
    the module's text, the factory, the config and TileLang's version, which are all it is built from."""
    key = hashlib.sha256(f"{VERSION}\n{factory_name}\n{config}\n".encode() + Path(path).read_bytes()).hexdigest()
    return Path(path).with_name(f"{Path(path).stem}.{factory_name}.{key[:16]}.prim_func.json")


def _write_atomically(path: Path, text: str) -> None:
    """Write then rename (a process reading it at once never sees half of it); an unwritable directory only
    leaves it unrecorded."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        pass
    finally:
        partial.unlink(missing_ok=True)


def tvm_target(profile: DeviceProfile):
    """The profile's TileLang target string as a TVM Target.

    profile.tilelang_target is written in the CLI form ("cuda -arch=sm_90a"), which the TVM in TileLang 0.1.15
    no longer parses; it takes the dict form ({"kind": "cuda", "arch": "sm_90a"}).
    """
    from tilelang import tvm  # TileLang ships its own TVM and puts it on the import path

    kind, *options = profile.tilelang_target.split()
    config = {"kind": kind}
    for option in options:
        key, _, value = option.removeprefix("-").partition("=")
        config[key] = value
    _require_target_kind(kind, profile)
    return tvm.target.Target(config)


def installed() -> bool:
    """Whether TileLang (or tilelang_musa) is importable here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("tilelang") is not None


@functools.cache
def import_problem() -> str | None:
    """Why the installed TileLang cannot be used, or None: not installed, or its import fails (a native library
    it loads missing: the H200 machine without the z3 wheel raised OSError for libz3.so). Imports TileLang once."""
    if not installed():
        return "tilelang is not installed"
    try:
        import tilelang  # noqa: F401
    except (ImportError, OSError) as err:
        return f"tilelang does not import: {type(err).__name__}: {err}"
    return None


def installed_target_kinds() -> set[str]:
    """Target kinds the installed TileLang can lower to.

    TileLang 0.1.15 keeps them in its backend registry (tilelang.backend); older releases, and tilelang_musa
    (forked from one), list them in tilelang.utils.target.SUPPORTED_TARGETS. Either may be missing; without a
    TileLang that imports there are none.
    """
    if import_problem() is not None:
        return set()
    import tilelang

    kinds = set()
    try:
        from tilelang.backend import list_backends
    except ImportError:
        pass
    else:
        kinds.update(kind for backend in list_backends().values() for kind in backend.target_kinds)
    try:
        from tilelang.utils.target import SUPPORTED_TARGETS
    except ImportError:
        pass
    else:
        kinds.update(SUPPORTED_TARGETS)
    kinds.discard("auto")  # a request to detect the device, not a target
    if not kinds:
        raise RuntimeError(f"cannot tell which targets tilelang {tilelang.__version__} supports")
    return kinds


def _require_target_kind(kind: str, profile: DeviceProfile) -> None:
    kinds = installed_target_kinds()
    if kind in kinds:
        return
    needed = _FORKS_BY_TARGET_KIND.get(kind, f"a TileLang build with a {kind!r} backend")
    raise RuntimeError(
        f"cannot lower TileLang kernels for {profile.name} (target {profile.tilelang_target!r}): that needs "
        f"{needed}; the installed tilelang {VERSION} targets only {', '.join(sorted(kinds))}")


def pass_configs(profile: DeviceProfile) -> dict:
    """The profile's TileLang pass configs that the installed TileLang knows, as PassConfigKey -> value."""
    import tilelang

    return {getattr(tilelang.PassConfigKey, name): value for name, value in profile.tilelang_pass_configs
            if hasattr(tilelang.PassConfigKey, name)}


def fast_math_pass_configs(profile: DeviceProfile) -> dict:
    """A template's PASS_CONFIGS for nvcc's fast math (--use_fast_math: exp2 is one MUFU.EX2, divisions are
    approximate, as in Triton's and the public TileLang kernels), unless the profile pins it (MUSA's TileLang kernels
    run without)."""
    pinned = any(name == "TL_ENABLE_FAST_MATH" for name, _ in profile.tilelang_pass_configs)
    return {} if pinned else {"TL_ENABLE_FAST_MATH": True}


def kernel_pass_configs(path: Path, profile: DeviceProfile) -> dict:
    """pass_configs(profile) and those the generated module at `path` names in PASS_CONFIGS (PassConfigKey member
    names -> values: a kernel that places its own barriers turns TileLang's automatic ones off). A name the installed
    TileLang lacks is an error: the kernel was written assuming it."""
    import tilelang

    configs = pass_configs(profile)
    for name, value in getattr(import_generated(path), "PASS_CONFIGS", {}).items():
        if not hasattr(tilelang.PassConfigKey, name):
            raise RuntimeError(f"{path.name} needs the TileLang pass config {name}, which tilelang {VERSION} lacks")
        configs[getattr(tilelang.PassConfigKey, name)] = value
    return configs


def lower(path: Path, factory_name: str, config: KernelConfig, profile: DeviceProfile):
    """Lower the kernel for `config` to `profile`'s target without a device; returns TileLang's artifact."""
    import tilelang
    from tilelang import tvm

    target = tvm_target(profile)
    prim_func = build_prim_func(path, factory_name, config)
    # tilelang.lower also reads the target from TVM's context; without one it fails with 'Target context required'.
    # Pass configs reach it through a PassContext, as tilelang.compile passes them (only where the profile or the
    # kernel has any, so CUDA lowering is otherwise exactly TileLang's default).
    configs = kernel_pass_configs(Path(path), profile)
    context = tvm.transform.PassContext(opt_level=3, config=configs) if configs else contextlib.nullcontext()
    with context, target:
        return tilelang.lower(prim_func, target=target)


def lower_to_device_source(path: Path, factory_name: str, config: KernelConfig, profile: DeviceProfile) -> str:
    """The device source (CUDA C++ for CUDA profiles) that TileLang generates for `config` on `profile`."""
    return lower(path, factory_name, config, profile).kernel_source


def nvcc_compile(cuda_source: str, profile: DeviceProfile, workdir: Path, fast_math: bool = False) -> Path:
    """Compile TileLang's CUDA source to an object file for `profile` (no GPU needed); returns its path.

    The flags match what TileLang's own CUDA backend passes: C++20 and its template and CUTLASS headers, and
    --use_fast_math for a kernel whose PASS_CONFIGS ask for it (`fast_math`).
    """
    return _nvcc(cuda_source, profile, workdir, fast_math)[0]


def ptxas_report(cuda_source: str, profile: DeviceProfile, workdir: Path, fast_math: bool = False) -> str:
    """What ptxas says of the compiled kernels (`-Xptxas -v`): registers, stack frame, spill stores and loads."""
    return _nvcc(cuda_source, profile, workdir, fast_math, ("-Xptxas", "-v"))[1]


def _nvcc(cuda_source: str, profile: DeviceProfile, workdir: Path, fast_math: bool,
          extra: tuple[str, ...] = ()) -> tuple[Path, str]:
    if profile.nvcc_gencode is None:
        raise RuntimeError(f"{profile.name} is not a target nvcc compiles for")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    tilelang_dir = Path(importlib.util.find_spec("tilelang").origin).parent
    include_dirs = [tilelang_dir / "src", tilelang_dir / "3rdparty" / "cutlass" / "include"]
    for include_dir in include_dirs:
        if not include_dir.is_dir():
            raise RuntimeError(f"the installed tilelang has no {include_dir}; cannot compile its CUDA source")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    flags = [*(["--use_fast_math"] if fast_math else []), *extra]
    digest = hashlib.sha256(f"{profile.nvcc_gencode}\n{flags}\n{cuda_source}".encode()).hexdigest()[:16]
    source_path = workdir / f"tilelang_{profile.arch}_{digest}.cu"
    object_path = source_path.with_suffix(".o")
    source_path.write_text(cuda_source)
    command = [nvcc, "-std=c++20", "-w", "-O3", *flags, *profile.nvcc_gencode.split(),
               *(f"-I{d}" for d in include_dirs), "-c", str(source_path), "-o", str(object_path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source_path} for {profile.name}:\n{result.stderr}")
    return object_path, result.stderr


def compile_for_device(path: Path, factory_name: str, config: KernelConfig, profile: DeviceProfile):
    """tilelang.compile for `profile`: a kernel callable on device tensors (compiles anywhere, runs on a GPU)."""
    import tilelang

    target = tvm_target(profile)
    kernel = tilelang.compile(build_prim_func(path, factory_name, config), target=target,
                              pass_configs=kernel_pass_configs(Path(path), profile),
                              compile_flags=list(profile.tilelang_compile_flags) or None)
    # Where TileLang's kernel cache keeps it (an attribute TileLang tags its cached kernels with; without it, or
    # with the cache off, nothing is noted and a later process prebuilds the kernel as if it were new).
    cached_at = getattr(kernel, "_tilelang_cache_path", None)
    if isinstance(cached_at, str) and tilelang.env.is_cache_enabled():
        _write_atomically(_built_note(path, factory_name, config), cached_at)
    return kernel


def _built_note(path: Path, factory_name: str, config: KernelConfig) -> Path:
    return prim_func_record(path, factory_name, config).with_suffix(".built")


def in_kernel_cache(path: Path, factory_name: str, config: KernelConfig) -> bool:
    """Whether compile_for_device built this kernel into this process's TileLang kernel cache (another process may
    have had another TILELANG_CACHE_DIR), and its entry is still there: then a process's own compile only loads it
    (no child need build it ahead)."""
    import tilelang

    cache_dir = getattr(tilelang.env, "TILELANG_CACHE_DIR", None)  # (a TileLang without it: built ahead as new)
    try:
        cached_at = Path(_built_note(path, factory_name, config).read_text()).resolve()
    except OSError:
        return False
    return cache_dir is not None and cached_at.is_dir() and Path(cache_dir).resolve() in cached_at.parents


def factory_configs(family, spec, config: KernelConfig) -> dict[str, KernelConfig]:
    """Kernel name -> factory config of every TileLang kernel `config` launches: the family's
    tilelang_kernel_configs(spec, config) where it launches several (or derives more arguments), else the config
    itself."""
    if hasattr(family, "tilelang_kernel_configs"):
        return family.tilelang_kernel_configs(spec, config)
    return {family.TILELANG_FACTORY_NAME: config}


class _Prebuild:
    """One kernel built by compile_for_device in a child process, into TileLang's kernel cache on disk (the child
    inherits TILELANG_CACHE_DIR), where this process's own compile of it then finds it. A build takes 10-60 s of
    TVM lowering and nvcc, mostly one core's work: a graph's kernels built on first use, one after another, made most
    of a cold compile on the H200 (docs/results/compile_time_h200.md); children build them in parallel while the
    graph is still being compiled and its Triton kernels built. At most one child a core runs at a time."""

    _slots = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) - 1))
    _running: set[subprocess.Popen] = set()
    _lock = threading.Lock()

    def __init__(self, path: Path, factory_name: str, config: KernelConfig, profile: DeviceProfile):
        self._payload = pickle.dumps((str(path), factory_name, config, profile))
        self._done = threading.Event()
        self._state = "queued"  # -> "running" -> "built" | "failed: <why>"; or "dropped" (claimed while queued)
        # A daemon thread: a process that exits while a child builds kills the child (_stop_children), not waits.
        threading.Thread(target=self._run, name="dzc-tilelang-prebuild", daemon=True).start()

    def _run(self) -> None:
        with self._slots:
            with self._lock:
                if self._state == "dropped":
                    return
                self._state = "running"
            try:
                process = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                with self._lock:
                    self._running.add(process)
                _, stderr = process.communicate(self._payload)
                with self._lock:
                    self._running.discard(process)
                lines = stderr.decode(errors="replace").strip().splitlines()
                self._state = "built" if process.returncode == 0 else f"failed: {(lines or ['?'])[-1][:300]}"
            except OSError as error:
                self._state = f"failed: {error}"
            finally:
                self._done.set()

    def claim(self) -> str:
        """Before this process builds the kernel itself: wait for the child where it is building (it is ahead),
        drop the build where it has not started; returns what happened ("built", "dropped", "failed: ...")."""
        with self._lock:
            if self._state == "queued":
                self._state = "dropped"
                return self._state
        self._done.wait()
        return self._state

    @classmethod
    def stop_children(cls) -> None:
        with cls._lock:
            for process in cls._running:
                process.kill()


atexit.register(_Prebuild.stop_children)

# What a prebuild child runs: one compile_for_device, its arguments pickled on stdin.
_CHILD = ("import pickle, sys; from pathlib import Path; from dzc.targets.tilelang_codegen import compile_for_device; "
          "path, factory, config, profile = pickle.load(sys.stdin.buffer); "
          "compile_for_device(Path(path), factory, config, profile)")


class KernelsByConfig:
    """What a family's tilelang_launch takes: TileLang fixes the block shape at compile time, so each config is
    its own kernel, compiled on first use and kept; `prebuild` starts building some in child processes."""

    def __init__(self, path: Path, factory_name: str, profile: DeviceProfile):
        self.path = path
        self.factory_name = factory_name
        self.profile = profile
        self._kernels: dict[KernelConfig, object] = {}
        self._prebuilds: dict[KernelConfig, _Prebuild] = {}
        self.prebuilt: dict[KernelConfig, str] = {}  # how each claimed prebuild ended (_Prebuild.claim)

    @property
    def prebuilding(self) -> int:
        """Kernels started by `prebuild` and not yet asked for."""
        return len(self._prebuilds)

    def prebuild(self, configs: Iterable[KernelConfig]) -> None:
        """Start building `configs` in child processes (_Prebuild), where TileLang's kernel cache is on."""
        import tilelang

        if not tilelang.env.is_cache_enabled():  # the children's kernels would reach this process nowhere
            return
        for config in configs:
            # A kernel already in the cache is not built ahead: a child would start Python, import dzc and TileLang
            # and only load it, while the first launch waited for it (on a warm start, every kernel).
            if (config not in self._kernels and config not in self._prebuilds
                    and not in_kernel_cache(self.path, self.factory_name, config)):
                self._prebuilds[config] = _Prebuild(self.path, self.factory_name, config, self.profile)

    def kernel_for(self, config: KernelConfig):
        kernel = self._kernels.get(config)
        if kernel is None:
            prebuild = self._prebuilds.pop(config, None)
            if prebuild is not None:  # built into the cache (read below), or failed: then built here, same error
                self.prebuilt[config] = prebuild.claim()
            kernel = compile_for_device(self.path, self.factory_name, config, self.profile)
            self._kernels[config] = kernel
        return kernel


# TileLang compiles a kernel for buffers with the dense strides its prim_func declares and 16-byte-aligned base
# pointers (it vectorises into 16-byte loads and stores: uint4 / float4 in the CUDA source). Unlike Triton it
# neither checks nor specialises on either at launch: a misaligned base faults ('misaligned address'), a strided
# one is read at the wrong elements. So every tensor a TileLang kernel gets goes through launch_arguments.
ALIGNMENT = 16


def aligned_dense(tensor: torch.Tensor) -> bool:
    """Whether a TileLang kernel can take `tensor` as it is: dense, with a 16-byte-aligned base pointer. (An offset
    view is contiguous, so .contiguous() alone returns it unchanged and misaligned.)"""
    return tensor.is_contiguous() and tensor.data_ptr() % ALIGNMENT == 0


# Fresh allocations are aligned (torch's allocators align to at least 64 bytes).
def _input_for_kernel(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if aligned_dense(tensor) else tensor.clone(memory_format=torch.contiguous_format)


def _output_for_kernel(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if aligned_dense(tensor) else torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


@dataclass
class LaunchArguments:
    """What a TileLang kernel is called with (`arguments`), and the outputs that were computed into aligned dense
    temporaries: `finish()` copies each into the output it stands for, after the launch."""

    arguments: tuple
    write_back: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def finish(self) -> None:
        for temporary, output in self.write_back:
            output.copy_(temporary)

    def launch(self, kernel) -> None:
        """Call `kernel` with the arguments, then copy the temporaries back."""
        kernel(*self.arguments)
        self.finish()


def launch_arguments(inputs: Sequence, outputs: Sequence[torch.Tensor], scalars: Sequence = ()) -> LaunchArguments:
    """A TileLang kernel's arguments (inputs, outputs, scalars, in that order): inputs that are not dense and
    16-byte aligned are copied into fresh dense tensors, and such outputs are replaced by fresh dense temporaries
    that finish() copies back. None inputs (parameters a kernel was generated without) are left out. One input
    passed twice (a cache serving as keys and values) is copied once."""
    copies: dict[int, torch.Tensor] = {}
    kernel_inputs = []
    for tensor in inputs:
        if tensor is None:
            continue
        if id(tensor) not in copies:
            copies[id(tensor)] = _input_for_kernel(tensor)
        kernel_inputs.append(copies[id(tensor)])
    kernel_outputs = [_output_for_kernel(output) for output in outputs]
    write_back = tuple((temporary, output) for temporary, output in zip(kernel_outputs, outputs)
                       if temporary is not output)
    return LaunchArguments((*kernel_inputs, *kernel_outputs, *scalars), write_back)


def load(family, path: Path, spec, profile: DeviceProfile) -> KernelsByConfig:
    """The loaded kernel a family's tilelang_launch takes (lowering only loads TileLang kernels for a GPU), its
    untuned configs' kernels building in child processes already (DZC_TILELANG_PREBUILD): the family's
    tilelang_prebuilt_configs where a bucket's untuned choice may be another config, else its default."""
    kernels = KernelsByConfig(path, family.TILELANG_FACTORY_NAME, profile)
    if dzc_config.TILELANG_PREBUILD.get() == "1":
        untuned = getattr(family, "tilelang_prebuilt_configs", None)
        configs = untuned(spec, profile) if untuned else [family.tilelang_default_config(spec, profile)]
        kernels.prebuild(factory for config in configs for factory in factory_configs(family, spec, config).values())
    return kernels
