"""dzc.torch_fixes: each fix leaves the installed torch free of its bug, and is applied only where it has it."""

import pytest

from dzc import torch_fixes

triton_heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


def test_a_kernel_with_no_rows_gets_an_empty_launch_grid():
    """Inductor's 2D grid with z overflow at y extent 0: no y block, where torch 2.11 divided by zero (an MoE
    expert that no token picked, session 44)."""
    grid_class = triton_heuristics.Grid2DWithYZOverflow
    applied = torch_fixes.apply()
    assert torch_fixes.empty_y_grid(grid_class)[:2] == (1, 0)
    # Applied exactly where the unfixed code divides by zero.
    fixed_generate = grid_class.generate
    assert ("Grid2DWithYZOverflow at ynumel 0" in applied) == hasattr(fixed_generate, "__wrapped__")
    if hasattr(fixed_generate, "__wrapped__"):
        grid_class.generate = fixed_generate.__wrapped__
        try:
            with pytest.raises(ZeroDivisionError):
                torch_fixes.empty_y_grid(grid_class)
        finally:
            grid_class.generate = fixed_generate


@pytest.mark.parametrize("ynumel", [1, 15, 16, 17, 70000 * 16])
def test_the_fixed_grid_covers_every_row(ynumel):
    """Nonzero extents keep Inductor's grid: y blocks times z blocks cover every row (beyond the 65535 y limit
    too)."""
    torch_fixes.apply()
    grid = triton_heuristics.Grid2DWithYZOverflow({}, "python")
    grid.generate({"XBLOCK": 64, "YBLOCK": 16})
    scope = {"xnumel": 64, "ynumel": ynumel}
    exec("\n".join(grid.prefix), {}, scope)
    y, z = eval(str(grid.y_grid), {}, scope), eval(str(grid.z_grid), {}, scope)
    assert y <= 65535 and y * z * 16 >= ynumel and (y - 1) * z * 16 < ynumel
