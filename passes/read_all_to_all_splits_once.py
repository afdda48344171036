"""read_all_to_all_splits_once: the split sizes of all_to_all_single calls read back one element at a time  =>
one copy of them to the host, read there

Expert-parallel code exchanges its per-rank token counts on the device, then hands them to all_to_all_single as
split sizes, which the backend needs on the host: `send.tolist()`, `receive.tolist()`. Dynamo traces each element
as its own `.item()`: 2 x world reads a call, and on a GPU each one waits for the device.

Before (world 2: two counts sent, two received):

    %a = aten._local_scalar_dense.default(aten.select.int(%send, 0, 0))        # sym u0
    %b = aten._local_scalar_dense.default(aten.select.int(%send, 0, 1))        # sym u1
    %c = aten._local_scalar_dense.default(aten.select.int(%receive, 0, 0))     # sym u2
    %d = aten._local_scalar_dense.default(aten.select.int(%receive, 0, 1))     # sym u3
    ... _c10d_functional.all_to_all_single.default(%rows, [%c, %d], [%a, %b], %group)

After (one copy to the host before the first read, as Inductor's decompositions spell it; each read is then of
host memory):

    %host = prims.device_put.default(aten.cat.default([%send, %receive]), cpu)
    %a = aten._local_scalar_dense.default(aten.select.int(%host, 0, 0))        # sym u0
    %b = aten._local_scalar_dense.default(aten.select.int(%host, 0, 1))        # sym u1
    %c = aten._local_scalar_dense.default(aten.select.int(%host, 0, 2))        # sym u2
    %d = aten._local_scalar_dense.default(aten.select.int(%host, 0, 3))        # sym u3

Exact: the same integers are read. The reads keep their nodes (and the unbacked sizes they define); only their
input changes. The graph still reads values back (no CUDA graph), but it waits for the device once a run.

Conditions: a read whose value is a split size of an all_to_all_single, of one element of a 1-D integer tensor of
fixed length. The reads go in runs, one copy each: a run's tensors are all computed before its first read (each
EP layer of a model gets its own), and are of one dtype. A read that fails is left alone, with the reason.
Ordering: any time before lowering (it touches no op another pass matches).
"""

from __future__ import annotations

import torch
import torch.fx

from dzc.passes.graph_pass import (PassResult, call_with_fake_value, calls_any, copy_graph, fake_value, is_call,
                                   location_of, read_element)

NAME = "read_all_to_all_splits_once"
aten = torch.ops.aten
_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def _is_split(read: torch.fx.Node) -> bool:
    """Whether the value of `read` is a split size of an all_to_all_single."""
    return any(is_call(user, _ALL_TO_ALL) and any(read in (splits or ()) for splits in user.args[1:3])
               for user in read.users)


def _groups(reads: list[torch.fx.Node], elements: list, order: dict) -> list[list[int]]:
    """The reads (positions in `reads`) in runs that one copy can serve: each run's tensors are all computed
    before its first read (a model with several EP layers gets a run per layer)."""
    runs: list[list[int]] = []
    for i, (tensor, _) in enumerate(elements):
        if runs and order[tensor] < order[reads[runs[-1][0]]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _read_once(graph: torch.fx.Graph, reads: list[torch.fx.Node], elements: list) -> str:
    """Rewrite one run of reads to read one host copy; returns "" or why not."""
    sources = list(dict.fromkeys(tensor for tensor, _ in elements))
    if len({fake_value(t).dtype for t in sources}) > 1:
        return "the split sizes are read from tensors of different dtypes"
    offsets, total = {}, 0
    for tensor in sources:
        offsets[tensor] = total
        total += fake_value(tensor).shape[0]
    with graph.inserting_before(reads[0]):
        joined = call_with_fake_value(graph, aten.cat.default, (sources,)) if len(sources) > 1 else sources[0]
        host = call_with_fake_value(graph, torch.ops.prims.device_put.default, (joined, torch.device("cpu")))
        for read, (tensor, index) in zip(reads, elements):
            old = read.args[0]
            read.args = (call_with_fake_value(graph, aten.select.int, (host, 0, offsets[tensor] + index)),)
            if not old.users:
                graph.erase_node(old)
    return ""


def read_all_to_all_splits_once(graph: torch.fx.Graph) -> PassResult:
    """Read each run of a graph's all_to_all split sizes through one copy to the host; returns a new graph and a
    report."""
    if not calls_any(graph, _ALL_TO_ALL):  # every site starts at an all_to_all_single
        return PassResult(NAME, graph)
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    reads = [n for n in graph.nodes if is_call(n, aten._local_scalar_dense.default) and _is_split(n)]
    elements = [read_element(read) for read in reads]
    for read, element in zip(reads, elements):
        if element is None:
            result.refused(location_of(read), "a split size is not one element of a 1-D integer tensor of fixed "
                                              "length")
    kept = [(read, element) for read, element in zip(reads, elements) if element is not None]
    order = {node: i for i, node in enumerate(graph.nodes)}
    for run in _groups([r for r, _ in kept], [e for _, e in kept], order):
        if len(run) < 2:
            continue
        run_reads, run_elements = [kept[i][0] for i in run], [kept[i][1] for i in run]
        why = _read_once(graph, run_reads, run_elements)
        if why:
            result.refused(location_of(run_reads[0]), why)
        else:
            result.rewrote(location_of(run_reads[0]))
    return result
