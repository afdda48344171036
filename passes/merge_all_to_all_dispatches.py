"""merge_all_to_all_dispatches: all_to_all_single calls with the same splits and group  =>  one all_to_all_single
of their rows' bytes side by side

Expert-parallel MoE code dispatches several per-row tensors with the same splits (the router's per-rank counts):
the token rows, their expert ids, their routing weights. Each all_to_all_single is a collective call of its own
(a launch, the backend's bookkeeping, a wait), and the splits are unbacked sizes, so none of it runs in a CUDA
graph. They move the same rows to the same ranks, so one call can move them all.

Before (functional collectives, as Dynamo traces torch.distributed._functional_collectives.all_to_all_single):

    %a = _c10d_functional.all_to_all_single.default(%rows, %out_splits, %in_splits, %group)   # bf16 [N, H]
    %ra = _c10d_functional.wait_tensor.default(%a)                                             # bf16 [M, H]
    %b = _c10d_functional.all_to_all_single.default(%ids, %out_splits, %in_splits, %group)    # i64 [N]
    %rb = _c10d_functional.wait_tensor.default(%b)                                             # i64 [M]

After (the rows travel side by side in one element type, the unit: that of the input with the most bytes a row,
so the token rows move as they are; narrower or wider inputs are bit-cast to it, widest element first so that
every piece starts at a multiple of its element size, the row padded to a multiple of the widest):

    %ib = aten.view.default(aten.view.dtype(%ids, torch.bfloat16), [-1, 4])                   # bf16 [N, 4]
    %packed = aten.constant_pad_nd.default(aten.cat.default([%ib, %rows], 1), [0, pad])        # bf16 [N, B]
    %m = _c10d_functional.all_to_all_single.default(%packed, %out_splits, %in_splits, %group)
    %w = _c10d_functional.wait_tensor.default(%m)                                              # bf16 [M, B]
    %rb = aten.select.int(aten.view.dtype(aten.slice.Tensor(%w, 1, 0, 4), torch.int64), 1, 0)  # i64 [M]
    %ra = aten.slice.Tensor(%w, 1, 4, 4 + H)                                                    # bf16 [M, H]

Exact: every byte arrives where it did (all_to_all_single splits dim 0 only; the bytes of a row stay together).
The results are strided views of the received buffer; their values are the same.

Conditions (a group that fails one is left alone, with the reason): the calls share the group and both split
lists (the same nodes or numbers, in order; a call with another call's lists over another group is refused as
such); each is waited on once; each input is 1-D or 2-D; the nodes that compute the later calls' inputs can move
before the first call (none of them is a collective, none writes anything). Ordering: after fuse_mxfp4_experts
(which reads the received ids and weights as they were traced), before lowering.
"""

from __future__ import annotations

import torch
import torch.fx

from dzc.passes.graph_pass import (PassResult, call_with_fake_value, calls_any, copy_graph, fake_value, is_call,
                                   location_of)

NAME = "merge_all_to_all_dispatches"
_c10d = torch.ops._c10d_functional
_ALL_TO_ALL = _c10d.all_to_all_single.default
_WAIT = _c10d.wait_tensor.default
aten = torch.ops.aten


def _key(node: torch.fx.Node):
    """What two calls must share to merge: the split lists (nodes or ints, in order) and the group."""
    _, output_splits, input_splits, group = node.args

    def as_key(splits):
        return None if splits is None else tuple(splits)

    return as_key(output_splits), as_key(input_splits), group


def _why_not(calls: list[torch.fx.Node]) -> str:
    for call in calls:
        if len(call.users) != 1 or not is_call(next(iter(call.users)), _WAIT):
            return f"{call.name} is not waited on exactly once"
        value = fake_value(call.args[0])
        if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2):
            return f"{call.name}'s input is not a 1-D or 2-D tensor"
    return ""


def _to_move(calls: list[torch.fx.Node], order: dict) -> list[torch.fx.Node] | str:
    """The nodes after the first call that the later calls' inputs need (in graph order), to move before it; or
    why they cannot move."""
    first = order[calls[0]]
    needed: set[torch.fx.Node] = set()
    stack = [call.args[0] for call in calls[1:]]
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or order[node] <= first or node in needed:
            continue
        if node.op != "call_function" or (isinstance(node.target, torch._ops.OpOverload) and (
                node.target.namespace == "_c10d_functional" or node.target._schema.is_mutable)):
            return f"{node.name}, which a later call's input needs, cannot move before the first call"
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(needed, key=order.__getitem__)


def _unit(values: list) -> torch.dtype:
    """The element type the calls' rows travel as: that of the input with the most bytes a row (it then moves
    without a bit-cast, and its received rows are a plain view), where its element size divides every input's
    row; else bytes."""
    def row_bytes(value):
        return (value.shape[1] if value.dim() == 2 else 1) * value.element_size()

    if any(v.dtype.is_complex for v in values):
        return torch.uint8
    largest = max(values, key=lambda v: row_bytes(v) if isinstance(row_bytes(v), int) else 0)
    size = largest.element_size()
    if largest.dtype != torch.bool and all(isinstance(row_bytes(v), int) and row_bytes(v) % size == 0
                                           for v in values):
        return largest.dtype
    return torch.uint8


def _merge(graph: torch.fx.Graph, calls: list[torch.fx.Node], order: dict) -> str:
    """Rewrite `calls` (same key, graph order) into one; returns "" or why not."""
    why = _why_not(calls)
    if why:
        return why
    moving = _to_move(calls, order)
    if isinstance(moving, str):
        return moving
    first = calls[0]
    for node in moving:
        first.prepend(node)
    trace = first.meta.get("stack_trace")
    values = {call: fake_value(call.args[0]) for call in calls}
    unit = _unit(list(values.values()))
    # Widest element first: every piece then starts at a multiple of its element size.
    pieces = sorted(calls, key=lambda c: -values[c].element_size())
    widest = max(1, values[pieces[0]].element_size() // unit.itemsize)
    layout, offset = [], 0
    with graph.inserting_before(first):
        as_units = []
        for call in pieces:
            source, value = call.args[0], values[call]
            if not value.is_contiguous():
                source = call_with_fake_value(graph, aten.clone.default, (source,), trace)
            if value.dtype != unit and (value.dim() == 1 or value.shape[1] == 1):
                # A column is bit-cast flat, then viewed as rows: Inductor gives a size-1 last dim stride 0, which
                # a bit-cast to another element size refuses.
                flat = source if value.dim() == 1 else call_with_fake_value(graph, aten.view.default,
                                                                            (source, [-1]), trace)
                flat = call_with_fake_value(graph, aten.view.dtype, (flat, unit), trace)
                columns = value.element_size() // unit.itemsize
                source = call_with_fake_value(graph, aten.view.default, (flat, [-1, columns]), trace)
            elif value.dim() == 1:
                source = call_with_fake_value(graph, aten.unsqueeze.default, (source, 1), trace)
            elif value.dtype != unit:
                source = call_with_fake_value(graph, aten.view.dtype, (source, unit), trace)
            columns = fake_value(source).shape[1]
            as_units.append(source)
            layout.append((call, offset, columns, value))
            offset += columns
        packed = call_with_fake_value(graph, aten.cat.default, (as_units, 1), trace)
        if offset % widest:
            padding = [0, widest - offset % widest]
            packed = call_with_fake_value(graph, aten.constant_pad_nd.default, (packed, padding, 0.0), trace)
        merged = call_with_fake_value(graph, _ALL_TO_ALL, (packed, *first.args[1:]), trace)
        received = call_with_fake_value(graph, _WAIT, (merged,), trace)
        for call, start, columns, value in layout:
            wait = next(iter(call.users))
            piece = call_with_fake_value(graph, aten.slice.Tensor, (received, 1, start, start + columns), trace)
            if value.dtype != unit:
                piece = call_with_fake_value(graph, aten.view.dtype, (piece, value.dtype), trace)
            if value.dim() == 1:
                piece = call_with_fake_value(graph, aten.select.int, (piece, 1, 0), trace)
            wait.replace_all_uses_with(piece)
    for call in calls:
        wait = next(iter(call.users))
        graph.erase_node(wait)
        graph.erase_node(call)
    return ""


def merge_all_to_all_dispatches(graph: torch.fx.Graph) -> PassResult:
    """Merge each set of all_to_all_single calls sharing splits and group into one; returns a new graph and a
    report."""
    if not calls_any(graph, _ALL_TO_ALL):  # every site starts at an all_to_all_single
        return PassResult(NAME, graph)
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    groups: dict = {}
    for node in graph.nodes:
        if is_call(node, _ALL_TO_ALL):
            groups.setdefault(_key(node), []).append(node)
    # A call that shares its split lists with calls over another group is left alone: name why (equal splits,
    # None, are no such near miss: they say nothing of the rows).
    by_splits: dict = {}
    for key in groups:
        if key[:2] != (None, None):
            by_splits.setdefault(key[:2], []).append(key)
    for keys in by_splits.values():
        first = groups[keys[0]][0]
        for key in keys[1:]:
            call = groups[key][0]
            result.refused(location_of(call), f"{call.name} has the splits of {first.name} but another process "
                                              f"group ({key[2]!r}, not {keys[0][2]!r})")
    for calls in groups.values():
        if len(calls) < 2:
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        where = location_of(calls[0])
        why = _merge(graph, calls, order)
        if why:
            result.refused(where, why)
        else:
            result.rewrote(where)
    return result
