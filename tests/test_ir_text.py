"""dzc.ir.print_graph formats each symbolic size once per distinct expression: the text it prints is the one that
formatting every value's sizes (ir.value_type, as the cached graphs' types are stored) gives."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dzc import ir


class _ByValueType(ir._Printer):
    """The printer as it was: every value's sizes formatted through value_type."""

    def node_type(self, node):
        if "val" not in node.meta and node.name in self.types:
            return self.type_of(self.types[node.name])
        return self.type_of(ir.value_type(node.meta.get("val")))

    def arg(self, value):
        if isinstance(value, torch.SymInt):
            return self.symbol(value)
        return super().arg(value)


def test_symbolic_sizes_print_as_value_type_formats_them():
    def f(x, y):
        n, m = x.shape
        z = torch.cat([x, y], 0).view(-1, m)[: n + 1]
        return z * 2, torch.full([n * m + 1], 1.0), x.new_empty(n, 2 * m).split(m, 1)

    graph = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 3), torch.randn(5, 3)).graph
    text = ir.print_graph(graph, "symbolic")
    assert "s0" in text and "s1" in text and "s2" in text  # (the sizes are symbolic)
    assert text == _ByValueType().print(graph, "symbolic")
    types = ir.value_types(graph)  # a cached graph's: no values, their stored types
    for node in graph.nodes:
        node.meta.pop("val", None)
    assert ir.print_graph(graph, "symbolic", types) == text
