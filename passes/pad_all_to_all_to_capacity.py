"""pad_all_to_all_to_capacity: an expert-parallel dispatch and combine whose split sizes are read back to the host
=>  the same exchange in fixed chunks of a declared capacity, with no host read

Expert-parallel code exchanges per-rank row counts on the device, reads them back as the split sizes of the
dispatch and the combine (`send.tolist()`, `receive.tolist()`), and sends the rows with those splits. The reads
make the host wait for the device every call, and the unbacked sizes keep the graph out of a CUDA graph. With a
capacity K declared for every rank (CompileOptions.ep_max_dispatch_rows: the most rows a rank sends in one
dispatch, DeepEP low-latency mode's num_max_dispatch_tokens_per_rank x top_k), each peer's chunk is K rows: every
shape is static and the counts stay on the device.

Before (after merge_all_to_all_dispatches and read_all_to_all_splits_once; world 2):

    %r = _c10d_functional.wait_tensor(_c10d_functional.all_to_all_single(%s, [1, 1], [1, 1], %g))   # i64[2]
    %host = prims.device_put(aten.cat([%s, %r]), cpu); %s0 .. %r1 = aten._local_scalar_dense(select(%host, 0, i))
    ... Dynamo's checks of the read values (aten._assert_scalar of u >= 0, of sum(send) == rows)
    %d = _c10d_functional.all_to_all_single(%x, [%r0, %r1], [%s0, %s1], %g)        # x [N, B] -> [r0 + r1, B]
    %w = _c10d_functional.wait_tensor(%d)
    ... row-wise ops on %w, dzc.mxfp4_moe(rows, ids, weights, ...) -> %y          # [r0 + r1, H]
    %c = _c10d_functional.wait_tensor(_c10d_functional.all_to_all_single(%y, [%s0, %s1], [%r0, %r1], %g))

After (no host read; K = the capacity):

    aten._assert_scalar(sym_size(%x, 0) <= K, "... ep_max_dispatch_rows ...")       # N is a host size
    %i = prims.iota(N); %ends = aten.cumsum(%s, 0); %peer = aten.sum(%i[:, None] >= %ends, [1])
    %pos = %peer * K + %i - (%ends - %s)[%peer]            # row i's slot in its peer's chunk
    %d = _c10d_functional.all_to_all_single(aten.index_put(full([2K, B], 0), [%pos], %x), [K, K], [K, K], %g)
    %valid = (prims.iota(K) < %r[:, None]).view(2K, 1)      # received row j holds data iff j % K < r[j // K]
    ... the same row-wise ops on [2K, ...]; each mxfp4_moe's ids -> ids * %valid, weights -> weights * %valid
    %c = aten.index(wait(all_to_all_single(%y, [K, K], [K, K], %g)), [%pos])   # [N, H]: each row where it was

The reads, their host copy and Dynamo's checks of the read values are erased: the graph waits on the host for
nothing.

Exact where: every node between the received rows and the combine is row-wise in dim 0 (views and slices that
keep dim 0, elementwise ops whose other operands broadcast over dim 0, casts, dzc.mxfp4_moe(_w4a8)), and nothing
computed from the received rows is used elsewhere, so a valid row is computed from the same values as before.
Padding rows arrive as zero bytes (a zero expert id less the rank's first expert is out of range) and are masked
before the only op that indexes by them, the MoE (ids and weights multiplied by the 0/1 mask: a valid row's are
unchanged, a padding row's id becomes 0, in range); their results are never read. The combine brings each row
back to the slot it left from. The counts sent must sum to the rows dispatched (all_to_all_single's own condition,
which the erased checks verified). The MoE kernel sees K x world rows instead of the received count and may pick
another tile (or, with moe_fp8_activations, another precision path) for them: the result equals the unpadded one
within the kernel's tolerance, not to the bit. A call with more than K rows to dispatch raises an error naming
ep_max_dispatch_rows, checked on the host from the input's size (no device sync): an aten._assert_scalar, which
the eager fallback runs each call and Inductor turns into a guard (such a call recompiles, and that compile fails).

Refused (with the reason): no capacity declared; split sizes that are not the host reads of the exchanged counts
or are used elsewhere; a node that is not row-wise between dispatch and combine; rows whose count is data-
dependent or above the capacity at compile time. Ordering: after merge_all_to_all_dispatches (one dispatch of the
rows, ids and weights) and read_all_to_all_splits_once (whose host copy it erases), before lowering.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from dzc.passes.graph_pass import (PassResult, call_with_fake_value, calls_any, copy_graph, fake_value, is_call,
                                   location_of, read_element)

NAME = "pad_all_to_all_to_capacity"
aten, prims = torch.ops.aten, torch.ops.prims
_c10d = torch.ops._c10d_functional
_ALL_TO_ALL, _WAIT = _c10d.all_to_all_single.default, _c10d.wait_tensor.default
_MOE = (torch.ops.dzc.mxfp4_moe.default, torch.ops.dzc.mxfp4_moe_w4a8.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view.dtype)
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
# What Dynamo emits to check or constrain an unbacked size.
_CHECKS = (aten._assert_scalar.default, aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default)
_FULL = 2 ** 62  # a slice end at least this large takes the whole dim


def _element(read) -> tuple[torch.fx.Node, int] | None:
    """(1-D integer tensor, index) whose element `read` reads to the host (directly, or through a host copy of a
    concatenation, as read_all_to_all_splits_once spells it), else None."""
    found = read_element(read) if is_call(read, aten._local_scalar_dense.default) else None
    if found is None:
        return None
    tensor, index = found
    if is_call(tensor, prims.device_put.default):
        tensor = tensor.args[0]
    pieces = tensor.args[0] if is_call(tensor, aten.cat.default) and tensor.args[1:] in ((), (0,)) else [tensor]
    lengths = [fake_value(piece).shape[0] if fake_value(piece) is not None and fake_value(piece).dim() == 1
               else None for piece in pieces]
    if not all(isinstance(length, int) for length in lengths):
        return None
    for piece, length in zip(pieces, lengths):
        if index < length:
            return piece, index
        index -= length
    return None


def _read_tensor(splits, world: int) -> torch.fx.Node | None:
    """The tensor whose elements 0..world-1 `splits` reads in order, else None."""
    if not isinstance(splits, (list, tuple)) or len(splits) != world:
        return None
    elements = [_element(read) for read in splits]
    tensors = {element[0] for element in elements if element is not None}
    if None in elements or len(tensors) != 1 or [index for _, index in elements] != list(range(world)):
        return None
    tensor = tensors.pop()
    value = fake_value(tensor)
    return tensor if value.shape[0] == world and not value.dtype.is_floating_point else None


def _counts(received: torch.fx.Node, sent: torch.fx.Node, group) -> bool:
    """Whether `received` is the wait of the all_to_all of `sent` (one count to each peer) over `group`."""
    if not is_call(received, _WAIT) or not is_call(received.args[0], _ALL_TO_ALL):
        return False
    source, out_splits, in_splits, exchange_group = received.args[0].args
    world = fake_value(sent).shape[0]
    return source is sent and exchange_group == group and all(
        splits is None or list(splits) == [1] * world for splits in (out_splits, in_splits))


def _row_wise(node: torch.fx.Node, region: set) -> bool:
    """Whether row i of `node`'s value depends only on row i of its operands in `region` (their dim 0), and on no
    other operand's dim 0."""
    value = fake_value(node)
    if node.op != "call_function" or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    inside = [n for n in node.all_input_nodes if n in region]
    if node.target in _MOE:
        return all(arg in region for arg in node.args[:3]) and set(inside) == set(node.args[:3])
    source = node.args[0]
    if is_call(node, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, *_VIEWS, *_CASTS):
        before = fake_value(source)
        if inside != [source] or not statically_known_true(value.shape[0] == before.shape[0]):
            return False
        if node.kwargs and not is_call(node, *_CASTS):  # (the dims below are read from the positional args)
            return False
        if is_call(node, aten.slice.Tensor):
            dim, start, end, step = list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:]
            return dim % before.dim() != 0 or (
                start in (0, None) and (end is None or isinstance(end, int) and end >= _FULL) and step == 1)
        if is_call(node, aten.select.int):
            return node.args[1] % before.dim() != 0
        if is_call(node, aten.unsqueeze.default):
            return node.args[1] % value.dim() != 0
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.pointwise not in node.target.tags:
        return False
    # Elementwise: operands from the region have the output's rank and rows; others broadcast over dim 0.
    for operand in node.all_input_nodes:
        other = fake_value(operand)
        if operand in region:
            if other.dim() != value.dim() or not statically_known_true(other.shape[0] == value.shape[0]):
                return False
        elif isinstance(other, torch.Tensor) and other.dim() == value.dim() and other.shape[0] != 1:
            return False
    return True


def _region(received: torch.fx.Node, combine_key) -> tuple[list, torch.fx.Node] | str:
    """(the nodes computed from the received rows, the combine's all_to_all) or why the rows are not handled row-wise
    until one combine whose splits are `combine_key` (out splits, in splits, group)."""
    region, combines, nodes = {received}, [], list(received.graph.nodes)
    # In graph order: a node's operands from the region are all known when it is judged.
    for user in nodes[nodes.index(received) + 1:]:
        inside = [n for n in user.all_input_nodes if n in region]
        if not inside:
            continue
        if is_call(user, _ALL_TO_ALL) and inside == [user.args[0]]:
            combines.append(user)
        elif _row_wise(user, region):
            region.add(user)
        else:
            return f"{user.name} ({user.target}) uses the received rows and is not row-wise in them"
    if len(combines) != 1:
        return f"the received rows go back through {len(combines)} all_to_alls, not one"
    combine = combines[0]
    if (tuple(combine.args[1] or ()), tuple(combine.args[2] or ()), combine.args[3]) != combine_key:
        return f"{combine.name} does not send the rows back with the dispatch's splits swapped"
    if len(combine.users) != 1 or not is_call(next(iter(combine.users)), _WAIT):
        return f"{combine.name} is not waited on exactly once"
    return [n for n in nodes if n in region], combine


def _checks_of(reads: list, calls: set) -> set | str:
    """The nodes that only check the reads' values (Dynamo's asserts and constraints on unbacked sizes, and the
    comparisons and sums they read), or why a read is used otherwise."""
    found, stack = set(), [user for read in reads for user in read.users if user not in calls]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        if not is_call(node, *_CHECKS) and not isinstance(fake_value(node), (torch.SymInt, torch.SymBool, int, bool)):
            return f"the split sizes are used by {node.name}, not only by the dispatch and the combine"
        found.add(node)
        stack.extend(node.users)
    return found


def _refresh(graph: torch.fx.Graph, start: torch.fx.Node) -> None:
    """Recompute the fake values of `start` and of every node computed from it (shapes without the unbacked
    sizes)."""
    changed: set = set()
    for node in graph.nodes:
        if node.op != "call_function" or (node is not start and not any(n in changed for n in node.all_input_nodes)):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), fake_value)
        leaves = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        # (a size computation on SymInts alone needs no fake mode)
        with leaves[0].fake_mode if leaves else contextlib.nullcontext():
            node.meta["val"] = node.target(*args, **kwargs)
        changed.add(node)


def _erase_dead(graph: torch.fx.Graph, checks: set, reads: list) -> None:
    """Erase the checks and the reads, then whatever only they used (the reads' selects, the host copy, the
    checks' operands)."""
    stack = [n for node in checks for n in node.all_input_nodes] + list(reads)
    for node in reversed(list(graph.nodes)):
        if node in checks:
            graph.erase_node(node)
    erased = set(checks)
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function" or node.users or (node not in reads and node.is_impure()):
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _dispatch_counts(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(counts sent, counts received) when `node` is an all_to_all whose split sizes are host reads of counts
    exchanged on its group (out splits: the received, in splits: the sent), else None."""
    if not is_call(node, _ALL_TO_ALL):
        return None
    _, out_splits, in_splits, group = node.args
    world = len(in_splits) if isinstance(in_splits, (list, tuple)) else 0
    sent, received = _read_tensor(in_splits, world), _read_tensor(out_splits, world)
    if sent is None or received is None or not _counts(received, sent, group):
        return None
    return sent, received


def _pad(graph: torch.fx.Graph, dispatch: torch.fx.Node, counts: tuple, capacity: int | None) -> str:
    """Rewrite one dispatch (its `counts` sent and received: _dispatch_counts) and its combine to chunks of
    `capacity` rows; returns "" or why not."""
    source, out_splits, in_splits, group = dispatch.args
    sent, received = counts
    if len(dispatch.users) != 1 or not is_call(next(iter(dispatch.users)), _WAIT):
        return f"{dispatch.name} is not waited on exactly once"
    wait = next(iter(dispatch.users))
    found = _region(wait, (tuple(in_splits), tuple(out_splits), group))
    if isinstance(found, str):
        return found
    region, combine = found
    reads = list(in_splits) + list(out_splits)
    checks = _checks_of(reads, {dispatch, combine})
    if isinstance(checks, str):
        return checks
    if capacity is None:
        return "no capacity declared (CompileOptions.ep_max_dispatch_rows)"
    value = fake_value(source)
    rows, world, trace = value.shape[0], len(in_splits), dispatch.meta.get("stack_trace")
    if free_unbacked_symbols(rows):
        return "the number of rows dispatched is data-dependent: no host check of the capacity without a sync"
    if statically_known_true(rows > capacity):
        return f"{rows} rows to dispatch, over ep_max_dispatch_rows = {capacity}"
    with graph.inserting_before(dispatch):
        if not isinstance(rows, int):
            # The host knows N (a backed size): a call with more rows than the capacity fails here, before the
            # rows are placed (an overfull chunk would spill into the next peer's).
            rows = graph.call_function(aten.sym_size.int, (source, 0))
            rows.meta["val"] = value.shape[0]
            fits = graph.call_function(operator.le, (rows, capacity))
            fits.meta["val"] = value.shape[0] <= capacity
            graph.call_function(aten._assert_scalar.default, (fits, (
                f"dzc: more rows to dispatch than CompileOptions.ep_max_dispatch_rows = {capacity} (the most rows, "
                f"tokens x top_k, a rank may send in one expert-parallel dispatch)"))).meta["val"] = None
        # As Inductor's decompositions spell them (the fallback compiles this graph as captured).
        index = call_with_fake_value(graph, prims.iota.default, (rows,), kwargs=dict(
            start=0, step=1, dtype=torch.int64, device=value.device, requires_grad=False), like=source)
        # Row i goes to the peer p with ends[p-1] <= i < ends[p] (the splits are contiguous), at slot
        # i - starts[p] of p's chunk.
        ends = call_with_fake_value(graph, aten.cumsum.default, (sent, 0), trace)
        starts = call_with_fake_value(graph, aten.sub.Tensor, (ends, sent), trace)
        passed = call_with_fake_value(graph, aten.ge.Tensor, (
            call_with_fake_value(graph, aten.unsqueeze.default, (index, 1), trace), ends), trace)
        peer = call_with_fake_value(graph, aten.sum.dim_IntList, (passed, [1]), trace)
        slot = call_with_fake_value(graph, aten.sub.Tensor, (
            index, call_with_fake_value(graph, aten.index.Tensor, (starts, [peer]), trace)), trace)
        positions = call_with_fake_value(graph, aten.add.Tensor, (
            call_with_fake_value(graph, aten.mul.Tensor, (peer, capacity), trace), slot), trace)
        padded = call_with_fake_value(graph, aten.full.default, ([world * capacity, *value.shape[1:]], 0), kwargs=dict(
            dtype=value.dtype, layout=torch.strided, device=value.device, pin_memory=False), like=source)
        placed = call_with_fake_value(graph, aten.index_put.default, (padded, [positions], source), trace)
    chunks = [capacity] * world
    dispatch.args = (placed, chunks, chunks, group)
    combine.args = (combine.args[0], chunks, chunks, group)
    back = next(iter(combine.users))
    with graph.inserting_before(back.next):
        rows_back = call_with_fake_value(graph, aten.index.Tensor, (back, [positions]), trace)
    back.replace_all_uses_with(rows_back, delete_user_cb=lambda user: user is not rows_back)
    _refresh(graph, dispatch)
    with graph.inserting_before(wait.next):
        # Received row j holds data iff j % K < received[j // K]; the rest are the senders' zero padding.
        slots = call_with_fake_value(graph, aten.lt.Tensor, (
            call_with_fake_value(graph, prims.iota.default, (capacity,), kwargs=dict(
                start=0, step=1, dtype=torch.int64, device=value.device, requires_grad=False), like=received),
            call_with_fake_value(graph, aten.unsqueeze.default, (received, 1), trace)), trace)
        valid = call_with_fake_value(graph, aten.view.default, (slots, [world * capacity, 1]), trace)
    for node in region:
        if node.target in _MOE:
            with graph.inserting_before(node):
                # x 0/1: a padding row's expert id becomes 0, a valid row's values stay what they were.
                ids, weights = (call_with_fake_value(graph, aten.mul.Tensor, (arg, valid), trace)
                                for arg in node.args[1:3])
            node.args = (node.args[0], ids, weights, *node.args[3:])
    _erase_dead(graph, checks, reads)
    return ""


def pad_all_to_all_to_capacity(graph: torch.fx.Graph, capacity: int | None = None) -> PassResult:
    """Pad each expert-parallel dispatch (and its combine) whose splits are host reads of exchanged counts to chunks
    of `capacity` rows per peer (CompileOptions.ep_max_dispatch_rows; None: refused); returns a new graph and a
    report."""
    if not calls_any(graph, _ALL_TO_ALL):  # every site starts at an all_to_all_single
        return PassResult(NAME, graph)
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for dispatch, counts in [(n, _dispatch_counts(n)) for n in graph.nodes]:
        if counts is None:
            continue
        where = location_of(dispatch)
        why = _pad(graph, dispatch, counts, capacity)
        if why:
            result.refused(where, why)
        else:
            result.rewrote(where)
    return result
