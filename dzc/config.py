"""Every DZC_* environment variable, declared once. The environment is for debugging and deployment paths;
compile semantics are explicit CompileOptions (dzc/options.py).

Knobs are read when used (not at import), so tests can set them with `scope(...)`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Knob:
    env: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.env, self.default)


CACHE_DIR = Knob("DZC_CACHE_DIR", str(Path.home() / ".cache" / "dzc"),
                 "where generated kernel sources and the tuning database live (CompileOptions.cache_dir wins)")
DEBUG = Knob("DZC_DEBUG", "0",
             "1: print the compile report after each compile; 2: also the IR after each pass; 3: also kernel sources")
DUMP_DIR = Knob("DZC_DUMP_DIR", "",
                "if set, write 000_capture.txt, 001_<pass>.txt, ... and report.txt for every compiled graph there")
AUTOTUNE_LOG = Knob("DZC_AUTOTUNE_LOG", "0", "1: log every tuning run with each config's time")
TUNING_DB = Knob("DZC_TUNING_DB", "",
                 "a shipped tuning database (dzc-tune --out), consulted read-only before the local cache "
                 "(CompileOptions.tuning_db wins); refused on a device other than the one it was tuned on")

KNOBS = (CACHE_DIR, DEBUG, DUMP_DIR, AUTOTUNE_LOG, TUNING_DB)


def debug_level() -> int:
    return int(DEBUG.get() or "0")


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
