"""Importing generated kernel modules from their files (not exec'd strings): tracebacks, Triton's cache and
TileLang's source inspection all need a real file."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_generated(path: Path) -> ModuleType:
    """Import the module at `path` once per process. Its name includes a hash of the full path, so equal file
    names in different directories never share a cached module."""
    path = Path(path).resolve()
    path_hash = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    module_name = f"dzc_generated.{path.stem}_{path_hash}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return module
