"""Shared by the tests that read SASS of kernels compiled for sm_90 on a host without a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path


def cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the one Triton ships beside its ptxas."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    candidate = Path(get_ptxas(90).path).with_name("cuobjdump")
    return str(candidate) if candidate.is_file() else None
