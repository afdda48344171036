"""Every DZC_* environment variable, declared once. The environment is for debugging and deployment paths;
compile semantics are explicit CompileOptions (dzc/options.py).

Knobs are read when used (not at import), so tests can set them with `scope(...)`. Every read checks the value
against what the knob accepts, and dzc.compile checks them all (`validate()`) before anything is compiled: a
mistyped value is one error naming the variable, its value and what is accepted, not a crash inside Dynamo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A DZC_* environment variable holds a value its knob does not accept."""


@dataclass(frozen=True)
class Knob:
    env: str
    default: str
    help: str
    accepts: str = "any value"  # for the error message
    # value -> None when accepted, else why not ("" when `accepts` says it all); no check: any value
    check: Callable[[str], str | None] | None = None

    def get(self) -> str:
        value = os.environ.get(self.env, self.default)
        why = self.check(value) if self.check is not None else None
        if why is not None:
            raise ConfigError(f"dzc: {self.env}={value!r} is not accepted{f' ({why})' if why else ''}: {self.env} "
                              f"accepts {self.accepts}")
        return value


def _one_of(*values: str) -> Callable[[str], str | None]:
    return lambda value: None if value in values else ""


def _directory(value: str) -> str | None:
    if not value:
        return "empty"
    return "a file, not a directory" if Path(value).expanduser().is_file() else None


def _optional_directory(value: str) -> str | None:
    return _directory(value) if value else None


def _optional_file(value: str) -> str | None:
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.exists():
        return "no such file"
    return None if path.is_file() else "not a file"


CACHE_DIR = Knob("DZC_CACHE_DIR", str(Path.home() / ".cache" / "dzc"),
                 "where generated kernel sources and the tuning database live (CompileOptions.cache_dir wins)",
                 "a directory path (created if missing)", _directory)
DEBUG = Knob("DZC_DEBUG", "0",
             "1: print the compile report after each compile; 2: also the IR after each pass; 3: also kernel sources",
             "0, 1, 2 or 3", _one_of("", "0", "1", "2", "3"))
DUMP_DIR = Knob("DZC_DUMP_DIR", "",
                "if set, write 000_capture.txt, 001_<pass>.txt, ... and report.txt for every compiled graph there",
                "a directory path (created if missing), or empty for none", _optional_directory)
AUTOTUNE_LOG = Knob("DZC_AUTOTUNE_LOG", "0", "1: log every tuning run with each config's time", "0 or 1",
                    _one_of("", "0", "1"))
TUNING_DB = Knob("DZC_TUNING_DB", "",
                 "a shipped tuning database (dzc-tune --out), consulted read-only before the local cache "
                 "(CompileOptions.tuning_db wins); refused on a device other than the one it was tuned on",
                 "the path of an existing file written by dzc-tune --out, or empty for none", _optional_file)

CHECK_REWRITES = Knob("DZC_CHECK_REWRITES", "1",
                      "1: run each graph's first call also as captured and drop rewrites whose outputs differ; 0: "
                      "off (CompileOptions.check_rewrites wins)", "0 or 1", _one_of("0", "1"))

COMPILE_CACHE = Knob("DZC_COMPILE_CACHE", "1",
                     "1: keep what the passes made of each captured graph in <cache dir>/compile and reuse it in "
                     "later processes (warm compile); 0: off", "0 or 1", _one_of("0", "1"))

FRAME_CACHE = Knob("DZC_FRAME_CACHE", "1",
                   "1: with the compile cache on, also keep Dynamo's bytecode and guards for a compiled model "
                   "(<cache dir>/compile/frames), so that a warm start skips Dynamo's trace; 0: off", "0 or 1",
                   _one_of("0", "1"))

NESTED_REGIONS = Knob("DZC_NESTED_REGIONS", "1",
                      "1 (default): capture the repeated layers of an nn.ModuleList once, as nested compile "
                      "regions; 0: off (CompileOptions.nested_regions wins)", "0 or 1", _one_of("0", "1"))

# On by default since session 51: on an H100 the multimodal GPU test passes with it on, its decode rows equal the
# flat compile's on the same inputs, and at 32 + 16 layers Inductor's fallback compile took 27.1 s against 80.5 s
# flat (docs/results/compile_time_h200.md, sessions 47 and 51). 0 is the way back if Inductor meets a model it fails.
OUTLINE_FOR_INDUCTOR = Knob("DZC_OUTLINE_FOR_INDUCTOR", "1",
                            "1 (default): hand the repeated layers' calls to Inductor's fallback compile as "
                            "invoke_subgraph, each distinct body lowered once (dzc/outline_regions.py; where "
                            "Inductor fails on the outlined graph it compiles the flat one and the report says "
                            "why); 0: the flat graph, every layer's copy lowered",
                            "0 or 1", _one_of("0", "1"))

COMPILE_GC = Knob("DZC_COMPILE_GC", "paused",
                  "paused (default): Python's cyclic garbage collector waits while Dynamo compiles a frame (its "
                  "full collections rescan every fake tensor and graph node built so far); on: it runs as usual "
                  "(cyclic garbage a compile leaves is then freed during it, not after)", "paused or on",
                  _one_of("paused", "on"))

TILELANG_PREBUILD = Knob("DZC_TILELANG_PREBUILD", "1",
                         "1 (default): when a compiled graph's TileLang kernels are loaded on a GPU, build each one's "
                         "untuned configs (every token bucket's) that TileLang's kernel cache lacks in child "
                         "processes at once, all in parallel, into that cache, which the first call then reads; 0: "
                         "each is built when first called, one after another",
                         "0 or 1", _one_of("0", "1"))

TRITON_PRECOMPILE = Knob("DZC_TRITON_PRECOMPILE", "0",
                          "1: once a graph is lowered for a GPU, compile the Triton kernels its first call will launch "
                          "(untuned configs) in a thread pool while Inductor compiles the rest; 0 (default until it "
                          "has run on a GPU): each compiles at its first launch, one after another",
                          "0 or 1", _one_of("0", "1"))

TUNE_UNVALIDATED = Knob("DZC_TUNE_UNVALIDATED", "0",
                        "1: also time the tuning candidates whose kernels have not run on a GPU yet (each family's "
                        "UNVALIDATED list; dzc's own GPU campaigns validate them); 0 (default): leave them out, so "
                        "that a candidate that hangs or faults the device cannot take a user's process with it",
                        "0 or 1", _one_of("0", "1"))

KNOBS = (CACHE_DIR, DEBUG, DUMP_DIR, AUTOTUNE_LOG, TUNING_DB, CHECK_REWRITES, COMPILE_CACHE, FRAME_CACHE,
         NESTED_REGIONS, OUTLINE_FOR_INDUCTOR, COMPILE_GC, TILELANG_PREBUILD, TRITON_PRECOMPILE,
         TUNE_UNVALIDATED)


def debug_level() -> int:
    return int(DEBUG.get() or "0")


def validate() -> None:
    """Check every knob's value now (dzc.compile calls this): raises ConfigError for the first one not accepted."""
    for knob in KNOBS:
        knob.get()


@contextlib.contextmanager
def scope(**values: str):
    """Temporarily set knobs by name, e.g. scope(DZC_DEBUG="2"); restores the previous environment."""
    known = {k.env for k in KNOBS}
    unknown = set(values) - known
    if unknown:
        raise KeyError(f"unknown dzc knobs {sorted(unknown)}; known: {sorted(known)}")
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
