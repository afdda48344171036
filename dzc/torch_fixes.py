"""Fixes of bugs in the installed torch that make code dzc hands to it fail, each applied only where the installed
torch has the bug (checked by running the buggy code, not by version), before dzc's first Inductor compile.

- Inductor's launcher grid for kernels over a y dimension with a z overflow (Grid2DWithYZOverflow) divides by zero
  when the y extent is 0 at run time (pytorch/pytorch#179222, fixed in later torch; torch 2.11 has it). A model's
  own MoE loop over experts, left to Inductor where fuse_mxfp4_experts refuses, gathers each expert's rows into
  such a kernel: an expert no token picked raised ZeroDivisionError at the call (session 44, H100, torch 2.11).
  The fix launches no y blocks then, as the upstream fix does.
"""

from __future__ import annotations

import functools


@functools.cache
def apply() -> tuple[str, ...]:
    """Apply the fixes the installed torch needs (once a process); the names of those applied."""
    applied = []
    if _fix_empty_y_grid():
        applied.append("Grid2DWithYZOverflow at ynumel 0")
    return tuple(applied)


def empty_y_grid(grid_class) -> tuple[int, int, int]:
    """The python launcher grid `grid_class` generates for a kernel of y extent 0 (x extent 64): raises
    ZeroDivisionError where the bug is."""
    grid = grid_class({}, "python")
    grid.generate({"XBLOCK": 64, "YBLOCK": 16})
    scope = {"xnumel": 64, "ynumel": 0}
    exec("\n".join(grid.prefix), {}, scope)  # noqa: S102  (Inductor's own generated launcher code)
    return tuple(eval(str(size), {}, scope) for size in (grid.x_grid, grid.y_grid, grid.z_grid))  # noqa: S307


def _fix_empty_y_grid() -> bool:
    try:
        from torch._inductor.runtime import triton_heuristics  # noqa: PLC0415 (imports Triton)
    except ImportError:  # an Inductor without Triton: no such launcher
        return False
    grid_class = getattr(triton_heuristics, "Grid2DWithYZOverflow", None)
    if grid_class is None:
        return False
    try:
        empty_y_grid(grid_class)
        return False  # this torch has the fix (or another grid)
    except ZeroDivisionError:
        pass
    generate = grid_class.generate

    @functools.wraps(generate)
    def guarded_generate(self, *args, **kwargs):
        generate(self, *args, **kwargs)
        # y_grid_div_ (the prefix's z extent) is 0 exactly when ynumel is 0: then no y block.
        self.y_grid = (f"(0 if y_grid_div_ == 0 else {self.y_grid})" if self.mode == "python"
                       else f"(y_grid_div_ == 0 ? 0 : {self.y_grid})")

    grid_class.generate = guarded_generate
    try:
        fixed = empty_y_grid(grid_class)[1] == 0
    except Exception:  # noqa: BLE001  (the generated code is not the one this fix knows)
        fixed = False
    if not fixed:
        grid_class.generate = generate
    return fixed
