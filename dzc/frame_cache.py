"""Frame entries: Dynamo's part of a warm compile, kept across processes, so that a warm start skips Dynamo's trace.

A capture entry (dzc/compile_cache.py) skips AOTAutograd, the passes and the rewrite check, but only once Dynamo has
traced the model's Python again, which is most of what a warm compile costs (90% of the README demo's, on the CPU
host). A frame entry keeps what Dynamo made of the model's forward: its transformed bytecode, its guards, and for
each graph the key of the graph's capture entry. A later process with the same model code, target, options, pass
list and versions installs that bytecode and those guards on the forward (torch's own precompile machinery:
torch._dynamo.package.CompilePackage), builds each graph from its capture entry, and runs: Dynamo traces nothing
while the guards hold. A call the guards reject is traced and compiled as usual, and the frame entry is saved again
with the new graph.

Where it applies (else the report's `frame_cache` says why not): the compile cache is on (DZC_COMPILE_CACHE) and
DZC_FRAME_CACHE too; the model is an nn.Module with a Python forward and no hooks (dzc then compiles a copy of
forward's code bound to the model: torch installs loaded bytecode on a code object, and a copy per compiled model
keeps it from every other compile of the same class); and when saving, the capture was one frame (no graph break)
whose every graph has a capture entry.

Guards. torch cannot save guards on object identity. dzc leaves out only those on objects that are the same in
every process by their name: Python modules (`torch`, the model's imports), functions, classes and torch ops reached
by their module and qualified name, and registry dicts reached from a module (torch's pytree node table, whose key
set is recorded), each recorded in the entry and checked again before it is used. torch checks that the source of
every function Dynamo traced is unchanged. The guards left out are left out of this process's compile too: a module
global reassigned after the compile (a function monkeypatched) is not noticed, as with torch's own precompile;
DZC_FRAME_CACHE=0 keeps every guard. A capture whose guards include any other identity guard (an
object that is not importable) makes no frame entry: Dynamo's trace fails there, and dzc compiles again without
one (the report says so). Entries are pickles in `<cache>/compile/frames`: load only cache directories you trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib
import inspect
import itertools
import marshal
import re
import time
import types
import uuid
import weakref

import torch
from torch._dynamo.guards import CheckFunctionManager
from torch._subclasses.fake_tensor import FakeTensorMode

from dzc import compile_cache, config

# Guard kinds torch cannot save (torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES):
# they compare an object's identity or a dict's version.
_UNSAVED_GUARDS = frozenset(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ()))


def enabled() -> bool:
    return compile_cache.enabled() and config.FRAME_CACHE.get() == "1"


def _by_name(value) -> str | None:
    """"module" or "module:qualname" when `value` is a Python module, or a function or class its module's attribute
    path leads back to (the same object in every process that imports it); else None."""
    if inspect.ismodule(value):  # (torch.ops.dzc is one too, an attribute of torch rather than an importable module)
        parts = value.__name__.split(".")
        for name in [value.__name__] + [f"{'.'.join(parts[:i])}:{'.'.join(parts[i:])}" for i in range(1, len(parts))]:
            if _resolve(name) is value:
                return name
        return None
    if isinstance(value, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):  # torch.ops.<namespace>.<op>
        name = f"torch:ops.{value._qualified_op_name.replace('::', '.')}"
        name += f".{value._overloadname}" if isinstance(value, torch._ops.OpOverload) else ""
        return name if _resolve(name) is value else None
    module = getattr(value, "__module__", None)
    # (a C builtin's qualified name is its class's, torch._C._VariableFunctionsClass.zeros_like; its module
    # exports it under its name)
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if isinstance(module, str) and isinstance(name, str) and "<locals>" not in name \
                and _resolve(f"{module}:{name}") is value:
            return f"{module}:{name}"
    return None


# A guard's source that is an attribute path from an imported module: __import__('torch').utils._pytree.X
_IMPORTED = re.compile(r"__import__\('([\w.]+)'\)((?:\.\w+)+)")


def _identity(entry) -> str | None:
    """How a guard torch cannot save can be checked in another process, or None: the guarded object's name
    (_by_name), or, for a guard on a dict's keys or version, the dict's name and its keys' names where both are
    found by name (the key set is compared when an entry is loaded; a guard on the dict's values is lost: only
    registries such as torch's pytree node table are guarded this way)."""
    if not entry.has_value:
        return None
    if isinstance(entry.value, dict):
        found = _IMPORTED.fullmatch(entry.name)
        name = f"{found.group(1)}:{found.group(2)[1:]}" if found else None
        if name is None or _resolve(name) is not entry.value:
            return None
        keys = [_by_name(key) for key in entry.value]
        return None if None in keys else f"{name} keys {','.join(sorted(keys))}"
    return _by_name(entry.value)


def _holds(identity: str) -> bool:
    """Whether what _identity recorded is so in this process."""
    name, _, keys = identity.partition(" keys ")
    found = _resolve(name)
    if not keys:
        return found is not None
    return isinstance(found, dict) and sorted(_by_name(key) or "?" for key in found) == keys.split(",")


def _resolve(name: str):
    module, _, qualname = name.partition(":")
    try:
        found = importlib.import_module(module)
        for part in qualname.split(".") if qualname else ():
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return found


@dataclasses.dataclass
class _Stored:
    """A frame entry as pickled: Dynamo's cache entry of the forward (torch's _DynamoCacheEntry: bytecode, guards,
    traced sources), each graph's capture-entry key by Dynamo's name for the compiled graph, and the guards left
    out, by the name their object is found under."""

    dynamo: object
    graphs: dict[str, str]
    named_objects: list[str]


class _Graph:
    """What torch's CompilePackage.install takes for a backend (its after_deserialization): the graph built from its
    capture entry by the model's dzc backend."""

    def __init__(self, compiled):
        self.compiled = compiled

    def after_deserialization(self):
        return self.compiled


class FrameCache:
    """The frame entry of one compiled model: found (and installed) or not before the first call, saved after calls
    that compiled graphs. `state` is what the report shows."""

    def __init__(self, model, backend, target, options):
        self.backend = backend
        self.state = "off (DZC_FRAME_CACHE or DZC_COMPILE_CACHE is 0)"
        self.package = None
        self.function = None  # the copy of forward that Dynamo compiles, bound to the model
        self._named: set[str] = set()  # guards left out, by name (this process's compiles)
        self._refused = ""  # why this process's capture cannot have a frame entry
        self._stored: dict[str, str] = {}  # backend id -> capture key, of graphs built from a loaded entry
        self._saved_graphs = -1
        if not enabled():
            return
        forward = getattr(type(model), "forward", None)
        why = _unsupported_torch() or (
            "the model is not an nn.Module" if not isinstance(model, torch.nn.Module)
            else "its forward is not a Python function" if not isinstance(forward, types.FunctionType)
            else "it has forward hooks (dzc would compile forward alone)" if _hooked(model) else "")
        if why:
            self.state = f"off ({why})"
            return
        self.forward = forward
        copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                  forward.__defaults__, forward.__closure__)
        copy.__kwdefaults__, copy.__qualname__ = forward.__kwdefaults__, forward.__qualname__
        self.function = types.MethodType(copy, model)
        passes = [compile_cache.pass_identity(p) for p in backend.enabled_passes()]
        chosen = compile_cache.chosen_options(options)
        self.parts = {"kind": "frame", "forward": f"{forward.__module__}:{forward.__qualname__}",
                      "code": hashlib.sha256(marshal.dumps(forward.__code__)).hexdigest()[:16],
                      "target": target.name, "profile": target.profile.fingerprint, "options": chosen,
                      "passes": passes, "versions": compile_cache.versions()}
        self.cache = compile_cache.CompileCache(options.resolved_cache_dir())
        self.state = "miss"

    @property
    def state(self) -> str:
        return self.backend.report.frame_cache

    @state.setter
    def state(self, value: str) -> None:
        self.backend.report.frame_cache = value

    def load(self) -> None:
        """Before the first call (inside dzc.compile's call context: grad mode as its graphs see it): find this
        model's frame entry and install it, or start an empty package."""
        from torch._dynamo.package import CompilePackage  # noqa: PLC0415 (torch's precompile internals)

        # (the layers marked as nested compile regions: their classes, which the bytecode's guards name)
        self.parts.update({"global state": compile_cache.global_state(), "regions": self.backend.marking.describe()})
        self.key = hashlib.sha256(repr(sorted(self.parts.items())).encode()).hexdigest()[:32]
        stored, why = self.cache.load_frame(self.key)
        why = why and f"entry unreadable, replaced ({why})"
        if stored is not None:
            with _gc_paused():
                why = self._install(stored)
            if not why:
                self.state = f"hit ({len(stored.graphs)} graph{'s' if len(stored.graphs) != 1 else ''}, Dynamo's " \
                             "trace skipped)"
                self._saved_graphs = len(self.backend.report.graphs)
                return
        if why:
            self.state = f"miss ({why})"
        self.package = CompilePackage(self.function.__func__)

    def _install(self, stored: _Stored) -> str:
        """Install a loaded entry on the forward's copy; "" or why it cannot be used (nothing is left installed)."""
        from torch._dynamo.package import CompilePackage  # noqa: PLC0415

        missing = [name for name in stored.named_objects if not _holds(name)]
        if missing:
            return f"what its guards name is not so here: {', '.join(m[:80] for m in missing[:3])}"
        try:  # (torch checks its versions and the traced sources here)
            package = CompilePackage(self.function.__func__, stored.dynamo)
        except Exception as err:  # noqa: BLE001  (changed sources, another torch: compile as usual)
            return f"torch refused it ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        captures = _rename_graphs(stored)
        checkpoint = self.backend.report.checkpoint()
        graphs = {}
        for index, (backend_id, capture) in enumerate(captures.items()):
            compiled = self.backend.compile_capture_entry(capture, f"entry/{index}")
            if isinstance(compiled, str):
                self.backend.report.restore(checkpoint)
                return f"graph {backend_id}: {compiled}"
            graphs[backend_id] = _Graph(compiled)
        start = time.perf_counter()
        try:
            # Unpickling a guard's source may install a guard (torch's ImportSource), which needs a trace's
            # context; what it installs there is dropped with it.
            with torch._guards.tracing(torch._guards.TracingContext(FakeTensorMode())):
                package.install(graphs)
        except Exception as err:  # noqa: BLE001  (the model itself is compiled instead: the copy never runs)
            _drop_globals(self.function.__func__.__globals__, list(captures))
            self.backend.report.restore(checkpoint)
            return f"torch refused it ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        if captures:  # (a stage of the warm compile, as Dynamo's trace is of a cold one: it grows with the model)
            self.backend.report.graphs[-len(captures)].compile_seconds["dynamo guards"] = time.perf_counter() - start
        _reserve_dynamo_names(self.function.__func__.__globals__)
        # The graphs installed in the module's globals go with this model (torch leaves them; its uninstall would
        # also take the import aliases other compiled code of the module reads).
        weakref.finalize(self, _drop_globals, self.function.__func__.__globals__, list(captures))
        self.package, self._stored, self._named = package, captures, set(stored.named_objects)
        return ""

    def guard_filter(self, entries) -> list[bool]:
        """Dynamo's guard_filter_fn: every guard is kept but those torch cannot save whose object is found by name
        (recorded, and checked again when an entry is loaded). A kept guard torch cannot save fails the capture;
        refusal() then says why, and dzc compiles without a frame entry."""
        keep = []
        for entry in entries:
            kinds = (entry.guard_type, *entry.derived_guard_types)
            unsaved = (any(kind in _UNSAVED_GUARDS for kind in kinds)
                       or getattr(entry.orig_guard, "_unserializable", False))
            name = _identity(entry) if unsaved else None
            if unsaved and name is None:
                self._refused = f"a {entry.guard_type} guard on {entry.name} (not an object found by name)"
            if name is not None:
                self._named.add(name)
            keep.append(name is None)
        return keep

    def off(self, why: str) -> None:
        """No frame entry for this model from now on (its forward's copy is compiled without one)."""
        self.package, self.state = None, f"off ({why})"

    def refusal(self) -> str:
        return self._refused

    def save(self) -> None:
        """After a call that compiled graphs: write the entry (every graph of the frame, loaded or new)."""
        graphs = self.backend.report.graphs
        if self.package is None or len(graphs) == self._saved_graphs:
            return
        self._saved_graphs = len(graphs)
        entry = self.package.cache_entry()
        if len(entry.codes) != 1:
            self.state = "not saved (graph breaks: Dynamo compiled more than the forward's frame)"
            return
        if entry.codes[0].bypassed:  # (torch's own refusals: a graph holding parameters at static addresses)
            self.state = "not saved (torch bypassed the frame's package)"
            return
        captures = dict(self._stored)
        for backend_id in entry.backend_ids:
            if backend_id not in captures:
                capture, why = self.backend.capture_entry_of(backend_id)
                if capture is None:
                    self.state = f"not saved (graph {backend_id} has no capture entry: {why})"
                    return
                captures[backend_id] = capture
        stored = _Stored(entry, {b: captures[b] for b in entry.backend_ids}, sorted(self._named))
        try:
            problem = self.cache.store_frame(self.key, self.parts, stored)
        except Exception as err:  # noqa: BLE001  (an object in Dynamo's state that does not pickle)
            self.state = f"not saved ({type(err).__name__}: {str(err)[:160]})"
            return
        if problem:
            self.state = f"not saved ({problem})"
        elif not self.state.startswith("hit"):  # (a miss keeps its reason)
            self.state = "stored" + self.state.removeprefix("miss")


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic GC off while an entry loads. The load allocates objects in proportion to the graph's nodes
    (nodes, fake values and their symbolic sizes, guards, and a reference cycle per call of torch's pytree), and each
    full collection this set off scanned the whole heap of a process that has imported torch (~400K objects, 0.18 s
    on the CPU host), one more every ~100K objects: 1.5 s of a 6.4 s load of the multimodal model at full depth
    (61 + 32 layers). Paused, one collection after it takes what the load left (0.1-0.2 s there)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _rename_graphs(stored: _Stored) -> dict[str, str]:
    """Give the entry's graphs new names (their capture keys by name, returned): torch installs a graph as a global
    of the forward's module under Dynamo's name for it, which another model of this process may hold (it made or
    loaded the same entry, perhaps since dropped: Dynamo leaves its globals behind). The bytecode that calls them is
    renamed with them."""
    renamed = {old: f"{old.rsplit('_', 5)[0]}_{uuid.uuid4().hex}" for old in stored.graphs}  # __compiled_fn_3_...
    for code in stored.dynamo.codes:
        code.backend_ids = [renamed.get(name, name) for name in code.backend_ids]
        for guarded in code.guarded_codes:
            names = tuple(renamed.get(name, name) for name in guarded.dynamo_code.co_names)
            guarded.dynamo_code = dataclasses.replace(guarded.dynamo_code, co_names=names)
    return {renamed[old]: capture for old, capture in stored.graphs.items()}


def _drop_globals(scope: dict, names: list[str]) -> None:
    for name in names:
        scope.pop(name, None)


def _unsupported_torch() -> str:
    """Why this torch cannot keep frame entries, or "" (torch 2.13 can: CompilePackage, Dynamo's package and
    guard_filter_fn arguments)."""
    try:
        import torch._dynamo.package  # noqa: F401, PLC0415
        from torch._dynamo.eval_frame import _optimize  # noqa: PLC0415
    except ImportError as err:
        return f"torch {torch.__version__} lacks Dynamo's packages ({err})"
    wanted = {"package", "guard_filter_fn"} - set(inspect.signature(_optimize).parameters)
    return f"torch {torch.__version__}'s Dynamo takes no {', '.join(sorted(wanted))}" if wanted else ""


def _reserve_dynamo_names(scope: dict) -> None:
    """torch installs a loaded entry's globals in the forward's module under the names Dynamo made for them in the
    process that saved it (__builtins_dict___0); Dynamo's name counter here would make the same names when it
    traces a function of that module (a guard failed), which torch 2.13 refuses (AssertionError: name already exists
    in scope). The counter is moved past them."""
    from torch._dynamo import bytecode_transformation  # noqa: PLC0415

    taken = [int(found.group(1)) for name in scope if (found := re.fullmatch(r"__\w+_(\d+)", name))]
    counter = bytecode_transformation._unique_id_counter
    current = re.search(r"\d+", repr(counter))  # itertools.count(7): the next number it gives
    if taken and current is not None and max(taken) >= int(current.group()):
        bytecode_transformation._unique_id_counter = itertools.count(max(taken) + 1)


def _hooked(module: torch.nn.Module) -> bool:
    from torch.nn.modules import module as torch_module  # noqa: PLC0415

    hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")
    return bool(module._forward_hooks or module._forward_pre_hooks
                or any(getattr(torch_module, name, None) for name in hooks))
