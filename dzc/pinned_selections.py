"""Top-k selections made comparable for the rewrite check (dzc/capture.py, CompileOptions.check_rewrites).

A graph that computes in bf16 and selects with top-k (an MoE router, DSA's key selection) flips a selection where two
scores lie within a rounding of each other at the k-th place: a fused kernel that rounds elsewhere than the model
can pick the other one, and everything computed from the pick differs from then on, although both runs are right.
So the check records the captured graph's selections (`Recorded`) and replays the rewritten graph with them
(`Pinned`): where a row of the rewritten graph's own top-k picks other positions, and each position the captured
graph picked scores, in the rewritten graph, within `tolerance` x the row's largest |score| of its own k-th score,
the row takes the captured graph's picks (a near-tie: either answer is right); elsewhere it keeps its own, and the
outputs then show the difference. The tolerance is the check's own bound for the graph's precision, so a rewrite
whose scores are off by more than a rounding still fails.

Pinning needs the rewritten graph to make the same top-k calls in the same order: the check counts the aten.topk
nodes of both graphs first (a rewrite that selects inside a kernel, dzc.dsa_topk, makes them differ) and does not
pin, and so does not compare, where they differ.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOPK = torch.ops.aten.topk.default


def topk_calls(graph_module: torch.fx.GraphModule) -> int:
    """The aten.topk nodes of a graph module and of the graph modules it holds (outlined or nested bodies)."""
    return sum(node.target is TOPK for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes)


def _last_dimension(indices: torch.Tensor, dim: int) -> bool:
    return dim in (-1, indices.dim() - 1)


def _arguments(args, kwargs) -> tuple[int, int, bool]:
    """(k, dim, largest) of an aten.topk call."""
    names = ("self", "k", "dim", "largest", "sorted")
    bound = dict(zip(names, args), **kwargs)
    return bound["k"], bound.get("dim", -1), bound.get("largest", True)


class Recorded(TorchDispatchMode):
    """Runs ops as they are and keeps each top-k's chosen positions, in call order (`picks`: None for a call
    along another dimension than the last, which is not pinned), up to `budget` bytes (a long prefill's key
    selections over every layer can be gigabytes: `over_budget` then, and no pinning)."""

    def __init__(self, budget: int):
        super().__init__()
        self.picks: list[torch.Tensor | None] = []
        self.budget = budget
        self.over_budget = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is TOPK and not self.over_budget:
            indices = result[1]
            self.budget -= indices.numel() * indices.element_size()
            self.over_budget = self.budget < 0
            last = _last_dimension(indices, _arguments(args, kwargs or {})[1])
            self.picks = [] if self.over_budget else [*self.picks, indices.clone() if last else None]
        return result


class Pinned(TorchDispatchMode):
    """Runs ops as they are, except that each top-k row picking other positions than the recorded call's at a
    near-tie takes the recorded picks (the values then are the row's own scores at those positions). A call pairs
    with the recorded call of its place in the order where both select along their last dimension the same number
    of rows (a rewrite may drop a leading size 1). `pinned` counts the rows given the recorded picks; `mismatch`
    says why the calls could not be paired (then nothing more is pinned)."""

    def __init__(self, picks: list[torch.Tensor | None], tolerance: float):
        super().__init__()
        self.picks, self.tolerance = picks, tolerance
        self.calls = self.pinned = 0
        self.mismatch = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is not TOPK:
            return result
        call, self.calls = self.calls, self.calls + 1
        if self.mismatch:
            return result
        values, indices = result
        k, dim, largest = _arguments(args, kwargs)
        recorded = self.picks[call] if call < len(self.picks) else None
        if recorded is None or not _last_dimension(indices, dim) or recorded.numel() != indices.numel() or \
                recorded.shape[-1] != indices.shape[-1]:
            self.mismatch = (f"top-k call {call} ({tuple(indices.shape)}) does not pair with the captured graph's "
                             "(another size, or not along the last dimension)")
            return result
        recorded = recorded.reshape(indices.shape).to(indices.dtype)
        differ = (indices.sort(dim).values != recorded.sort(dim).values).any(dim, keepdim=True)
        if k == 0 or not differ.any():
            return result
        scores = args[0] if largest else -args[0]
        kth = (values if largest else -values).amin(dim, keepdim=True)
        their = scores.gather(dim, recorded).amin(dim, keepdim=True)
        scale = scores.detach().abs().nan_to_num(0, 0, 0).amax(dim, keepdim=True)
        # A row whose picks differ beyond a near-tie keeps its own: the outputs tell.
        pin = differ & (their >= kth - self.tolerance * scale)
        self.pinned += int(pin.sum())
        take = pin.expand_as(indices)
        indices = torch.where(take, recorded, indices)
        return torch.where(take, args[0].gather(dim, indices), values), indices
