"""passes.graph_pass: copy_graph makes the graph Graph.graph_copy makes (the same nodes, names, arguments, users,
meta and code), though each node is given its arguments by assignment; written_inputs finds the inputs a graph
writes, through every kind of alias."""

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dzc.passes.graph_pass import copy_graph, written_inputs


def _described(graph):
    return [(n.name, n.op, n.target, repr(n.args), repr(n.kwargs), type(n.args), type(n.kwargs),
             [type(a) for a in n.args], n.type, [u.name for u in n.users], [i.name for i in n.all_input_nodes],
             {key: id(value) for key, value in n.meta.items()}) for n in graph.nodes]


def test_copy_graph_makes_what_graph_copy_makes():
    def f(x, y):
        n = x.shape[0]
        return torch.cat([x, y * 2], 0)[: n + 1].sum(0, keepdim=True), x.view(-1), torch.full([n], 1.0)

    graph = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 3), torch.randn(2, 3)).graph
    x = next(iter(graph.nodes))
    with graph.inserting_before(graph.output_node()):
        nested = graph.call_function(operator.getitem, ((x, [x, {"a": (x, slice(None, x, 2))}]), 0))
        graph.call_function(torch.ops.aten.cat.default, ([x, nested],), {"dim": 0})
    expected = torch.fx.Graph()
    expected.output(expected.graph_copy(graph, {}))
    copied = copy_graph(graph)
    assert _described(copied) == _described(expected)
    assert copied.python_code("self").src == expected.python_code("self").src
    # New nodes are named as in graph_copy's copy (the same names taken).
    for g in (copied, expected):
        with g.inserting_before(g.output_node()):
            g.call_function(torch.ops.aten.mul.Tensor, (next(iter(g.nodes)), 2))
    assert [n.name for n in copied.nodes] == [n.name for n in expected.nodes]


def test_written_inputs_follow_views_split_items_and_in_place_results():
    def f(cache, rows, other, unused):
        first, second = cache.split(2, dim=0)        # an item of a list-returning view
        second[0].copy_(rows[0])
        rows.view(-1).add_(1.0).mul_(2.0)             # an in-place op's result, written again
        return other.transpose(0, 1)[0] * 2 + unused  # read only, through a view

    graph = make_fx(f)(torch.randn(4, 3), torch.randn(2, 3), torch.randn(3, 3), torch.randn(3)).graph
    assert written_inputs(graph) == {0, 1}
    # A graph that writes nothing.
    assert written_inputs(make_fx(lambda x: x.split(1)[0] * 2)(torch.randn(2, 3)).graph) == set()
