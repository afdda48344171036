"""dzc's op set: each fused operation is a torch.library op with exactly one plain-torch reference.

The reference defines what the op means; every generated kernel is tested against it. Passes rewrite ATen
subgraphs into these ops; lowering fills in the `kernel_id` argument with the id of a generated kernel, and the
op then launches that kernel instead of running the reference (an empty `kernel_id` runs the reference).

One module per op: its custom op, fake implementation and reference. Adding an op = a module here + a row in OPS.
"""

from __future__ import annotations

import torch

from dzc.ops.add_rms_norm import add_rms_norm_reference

# Every dzc op, by the name the IR printer and the report use, with its reference implementation.
OPS = {
    "add_rms_norm": (torch.ops.dzc.add_rms_norm.default, add_rms_norm_reference),
}

__all__ = ["OPS", "add_rms_norm_reference"]
