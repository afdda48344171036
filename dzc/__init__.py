"""dzc: a day-zero compiler for new large models on CUDA and MUSA GPUs.

    compiled = dzc.compile(model, target="cuda")     # or "musa", "cuda:sm_80", "musa:mp_22"
    out = compiled(*inputs)
    print(compiled.report)
"""

__version__ = "0.1.0"

import os
import sys

import torch


def _select_triton_interpreter() -> None:
    """With no GPU, generated Triton kernels can only run through Triton's interpreter, which must be chosen
    before Triton is imported (its own library functions are @triton.jit too). So when nothing has imported
    Triton yet and no GPU is present, turn it on; TRITON_INTERPRET set by the user always wins."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    musa = getattr(torch, "musa", None)
    if not torch.cuda.is_available() and not (musa is not None and musa.is_available()):
        os.environ["TRITON_INTERPRET"] = "1"


_select_triton_interpreter()

from dzc import ops  # noqa: E402,F401  (registers the dzc:: torch ops)
from dzc.api import CompiledModel, backend, compile  # noqa: E402
from dzc.options import CompileOptions  # noqa: E402
from dzc.targets import TARGETS  # noqa: E402


def _register_dynamo_backend() -> None:
    from torch._dynamo import register_backend

    # torch.compile(model, backend="dzc"): target "cuda", default options; its report is backend.report.
    register_backend(name="dzc")(backend("cuda"))


_register_dynamo_backend()

__all__ = ["compile", "CompileOptions", "CompiledModel", "backend", "TARGETS", "__version__"]
