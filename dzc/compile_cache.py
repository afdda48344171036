"""The warm-compile cache: what the passes made of a captured graph, kept across processes in the cache directory.

A second process that captures the same graph (the same ATen graph, the same input metadata and symbolic sizes)
for the same target, options, pass list and versions skips the passes: it loads the rewritten graph and its
stages (the dumps, where each pass fired and refused), and lowering binds it to the kernel sources already in
`<cache>/kernels` (written by the first process; lowering rewrites a source only when it differs). What Inductor
compiled for the graph's leftover ops travels beside it as torch's own cache artifacts
(`torch.compiler.save_cache_artifacts`, loaded with `load_cache_artifacts` before the fallback compiles, so
Inductor's FX graph cache hits).

Layout: `<cache>/compile/<key>.pkl`, one entry per graph (a pickled dict, the rewritten graph in torch's
GraphPickler form, which keeps the fake values and symbolic sizes), written atomically (temporary file + rename).
The key (`entry_key`) hashes everything that changes the result: the captured graph's text and its inputs'
metadata (sizes symbolic or not, strides, dtypes, devices), the values of its tensor constants, the target and
its profile's fingerprint, the options that reach the passes and lowering, the pass list, and the versions of
dzc (a hash of its sources), torch, Triton and TileLang. A stale entry is therefore just not found. An entry that
cannot be read (a truncated write, a hand edit, another format) is rebuilt with a warning.

The cache directory (DZC_CACHE_DIR or CompileOptions.cache_dir) is one self-contained directory: kernels/, the
tuning database, compile/ entries; copy it to another machine of the same kind (same GPU, same versions) and the
first compile there is warm. Set TRITON_CACHE_DIR inside it too to carry Triton's compiled binaries.
Entries are pickles: load only cache directories you trust, as with torch's own caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx._graph_pickler import GraphPickler, Options

from dzc import config

FORMAT_VERSION = 1
# Options that do not change what the passes and lowering make of a graph: where the cache lives (a copied
# directory must still hit) and the shipped tuning database (read by tuning, at the first call).
_KEY_EXCLUDED_OPTIONS = ("cache_dir", "tuning_db")


@functools.cache
def dzc_source_hash() -> str:
    """A hash of dzc's sources (dzc/, passes/, targets/ with its templates): any edit there is a new dzc version."""
    import dzc.passes  # noqa: PLC0415 (packages whose directories are hashed)
    import dzc.targets  # noqa: PLC0415

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(dzc.passes.__file__).parent, Path(dzc.targets.__file__).parent):
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".tmpl") and p.is_file()):
            digest.update(f"\0{path.relative_to(package.parent)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    """The versions an entry was made with (any difference misses)."""
    try:
        tilelang = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        tilelang = "not installed"
    import triton  # noqa: PLC0415 (dzc imports it already; here only its version)

    return {"dzc": dzc_source_hash(), "torch": torch.__version__, "triton": triton.__version__,
            "tilelang": tilelang, "format": str(FORMAT_VERSION)}


def _describe_input(value) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor({tuple(str(s) for s in value.shape)}, stride={tuple(str(s) for s in value.stride())}, "
                f"offset={value.storage_offset()}, {value.dtype}, {value.device.type}, "
                f"grad={value.requires_grad})")
    return f"{type(value).__name__}({value})"


def _constants(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's tensor constants (get_attr), by value: a pass may read them."""
    described = []
    # AOTAutograd calls the backend with its fake mode active: reading a real constant's bytes must leave it.
    with unset_fake_temporarily():
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor) and not value.is_meta and not isinstance(value, FakeTensor):
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                described.append(f"{node.target}: {_describe_input(value)} {hashlib.sha256(data).hexdigest()[:16]}")
            else:
                described.append(f"{node.target}: {type(value).__name__}")
    return described


def pass_identity(graph_pass) -> str:
    """A pass by name and where its code is (file name and line, not the path: a copied cache must hit): a pass
    swapped for another function under the same name (a test's wrapper) is another pass. Its code's content is
    in the dzc source hash."""
    function = graph_pass.func if isinstance(graph_pass, functools.partial) else graph_pass
    code = getattr(function, "__code__", None)
    where = f"{Path(code.co_filename).name}:{code.co_firstlineno}" if code is not None else type(function).__name__
    return f"{graph_pass.__name__} ({where})"


def entry_key(captured_text: str, gm: torch.fx.GraphModule, example_inputs, target, options,
              passes: list, extra_versions: dict[str, str] | None = None) -> tuple[str, dict]:
    """(the entry's key, the parts it hashes). captured_text: ir.print_graph of the captured graph; passes: the
    pipeline's passes that run (disabled ones left out)."""
    chosen = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name not in _KEY_EXCLUDED_OPTIONS}
    chosen["check_rewrites"] = options.resolved_check_rewrites()
    parts = {
        "graph": captured_text,
        "inputs": [_describe_input(value) for value in example_inputs],
        "constants": _constants(gm),
        "target": target.name,
        "profile": target.profile.fingerprint,
        "options": repr(sorted(chosen.items())),
        "passes": [pass_identity(p) for p in passes],
        "versions": {**versions(), **(extra_versions or {})},
    }
    text = repr(sorted(parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32], parts


@dataclass
class Entry:
    """What a build's passes made of the graph: the rewritten graph (before lowering), the stages ((name, text,
    rewrites, refusals), the last three None for "capture"), and torch's cache artifacts for the fallback compile
    (None where there were none)."""

    graph: torch.fx.Graph
    stages: list[tuple[str, str, list[str] | None, list[tuple[str, str]] | None]]
    torch_artifacts: bytes | None = None


# The node metadata lowering, coverage and Inductor read; the rest (where a node came from, module stacks) holds
# objects that do not pickle and nothing a later stage needs.
_KEPT_METADATA = frozenset({"val", "tensor_meta", "stack_trace", "unbacked_bindings", "original_aten"})


def _no_mode() -> None:
    return None


class _GraphPickler(GraphPickler):
    """GraphPickler, where a fake view's base (torch 2.13 clears the fake mode of the view's own description, not of
    its base's) does not pickle the mode either: unpickling puts the loading fake mode on both."""

    def reducer_override(self, obj):
        if isinstance(obj, FakeTensorMode):
            return _no_mode, ()
        return super().reducer_override(obj)


def pickle_graph(graph: torch.fx.Graph) -> bytes | str:
    """The graph in GraphPickler form (fake values and symbolic sizes kept), or why it cannot be pickled."""
    options = Options(ops_filter=None, node_metadata_key_filter=_KEPT_METADATA.__contains__)
    try:
        return _GraphPickler.dumps(torch.fx.GraphModule(torch.nn.Module(), graph), options)
    except Exception as err:  # noqa: BLE001  (a graph GraphPickler cannot write is only not cached)
        return f"not stored: the graph cannot be pickled ({type(err).__name__}: {str(err)[:200]})"


class CompileCache:
    """The entries of one cache directory."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.directory = Path(cache_dir) / "compile"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.pkl"

    def load(self, key: str, fake_mode) -> tuple[Entry | None, str]:
        """(the entry, "") on a hit; (None, "") when there is none; (None, why) when the file is unreadable (it is
        then rebuilt: the caller's store replaces it), with a warning."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, ""
        except OSError as err:
            return None, self._warn(path, f"{type(err).__name__}: {err}")
        try:
            stored = pickle.loads(data)
            if not isinstance(stored, dict) or stored.get("format") != FORMAT_VERSION or stored.get("key") != key:
                raise ValueError(f"not a format-{FORMAT_VERSION} entry for this key")
            with fake_mode:
                module = GraphPickler.loads(stored["graph"], fake_mode)
            return Entry(module.graph, stored["stages"], stored["torch_artifacts"]), ""
        except Exception as err:  # noqa: BLE001  (anything a damaged file raises: it is rebuilt)
            return None, self._warn(path, f"{type(err).__name__}: {str(err)[:200]}")

    @staticmethod
    def _warn(path: Path, why: str) -> str:
        message = f"corrupted entry rebuilt ({why})"
        warnings.warn(f"dzc: compile cache entry {path} is unreadable ({why}); compiling the graph again and "
                      "replacing it", RuntimeWarning, stacklevel=4)
        return message

    def store(self, key: str, parts: dict, graph: bytes, stages: list, torch_artifacts: bytes | None) -> str:
        """Write an entry (graph: pickle_graph's bytes); returns "" or, when it could not be written (read-only,
        full disk), why (the compile stands, it is only not cached)."""
        data = pickle.dumps({"format": FORMAT_VERSION, "key": key, "parts": parts, "graph": graph,
                             "stages": stages, "torch_artifacts": torch_artifacts})
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=self.directory, prefix=key, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(partial, self.path(key))
            finally:
                Path(partial).unlink(missing_ok=True)
        except OSError as err:
            return f"not stored in {self.directory} ({type(err).__name__}: {err})"
        return ""


def enabled() -> bool:
    return config.COMPILE_CACHE.get() == "1"


def save_torch_artifacts() -> bytes | None:
    """torch's cache artifacts made in this process so far (Inductor's FX graph cache entries, its Triton
    bundles, autotuning results), or None where there are none."""
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception:  # noqa: BLE001  (an optional speed-up: without it the fallback compiles again)
        return None
    return saved[0] if saved else None


def load_torch_artifacts(artifacts: bytes | None) -> None:
    """Put saved artifacts into torch's local caches (the fallback compile then hits Inductor's FX graph cache)."""
    if artifacts:
        try:
            torch.compiler.load_cache_artifacts(artifacts)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"dzc: torch's cache artifacts in the compile cache could not be loaded ({err}); the "
                          "fallback compiles again", RuntimeWarning, stacklevel=3)
