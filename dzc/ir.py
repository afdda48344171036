"""dzc's IR is the ATen-level torch.fx graph that AOTAutograd produces; this module prints and verifies it.

The printed form is deterministic and readable: one op per line, values numbered in order of definition, symbolic
sizes renamed s0, s1, ... in order of first appearance (torch's own names depend on its version), kwargs sorted,
each value's dtype and shape. Golden tests compare this text.

    graph(%a0: bf16[s0, 64], %a1: bf16[s0, 64], %a2: bf16[64]):
      %0 = aten.add.Tensor(%a0, %a1)  # bf16[s0, 64]
      ...
      return (%3, %0)
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx
from torch.fx.experimental.sym_node import SymNode

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def value_type(value) -> tuple:
    """What the printed form shows of a node's value, its symbolic sizes as torch names them (print_graph renames
    them): kept beside a cached graph, whose fake values a warm compile does not rebuild to print it."""
    if isinstance(value, torch.Tensor):
        return "tensor", (dtype_name(value.dtype), tuple(str(d) for d in value.shape))
    if isinstance(value, torch.SymInt):
        return "sym", str(value)
    if isinstance(value, (tuple, list)):
        return "seq", tuple(value_type(v) for v in value)
    return "name", type(value).__name__


def value_types(graph: torch.fx.Graph) -> dict[str, tuple]:
    """value_type of each node's value, by node name."""
    return {node.name: value_type(node.meta.get("val")) for node in graph.nodes}


class _Printer:
    def __init__(self, types: dict[str, tuple] | None = None):
        self.types = types or {}  # value_type by node name, for nodes whose meta holds no value (yet)
        self.values: dict[torch.fx.Node, str] = {}
        self.symbols: dict[str, str] = {}
        self.renamed: dict[str, str] = {}  # an expression's text -> its text with the symbols renamed
        self.sizes: dict = {}  # a SymInt's sympy expression -> symbol() of its text

    def symbol(self, expr) -> str:
        text = str(expr)
        renamed = self.renamed.get(text)
        if renamed is not None:  # (each layer's values repeat the same sizes: renamed once per printout)
            return renamed

        def rename(match):
            name = match.group(0)
            if name not in self.symbols:
                self.symbols[name] = f"s{len(self.symbols)}"
            return self.symbols[name]

        renamed = self.renamed[text] = re.sub(r"\b[su]\d+\b", rename, text)
        return renamed

    def type_of(self, described) -> str:
        """The printed type of a value as value_type describes it."""
        kind, what = described
        if kind == "tensor":
            dtype, dims = what
            return f"{dtype}[{', '.join(self.symbol(d) for d in dims)}]"
        if kind == "sym":
            return f"sym {self.symbol(what)}"
        if kind == "seq":
            return "(" + ", ".join(self.type_of(v) for v in what) + ")"
        return what

    def size(self, size) -> str:
        """symbol(str(size)) of an int or SymInt: a SymInt's text is its expression's, formatted by sympy once per
        distinct expression (formatting each value's sizes was half of printing a deep model's graph)."""
        if isinstance(size, int):
            return str(size)
        node = size.node
        if type(node) is not SymNode:  # (a nested int's text is not its expression's)
            return self.symbol(size)
        expr = node.expr
        text = self.sizes.get(expr)
        if text is None:
            text = self.sizes[expr] = self.symbol(expr)
        return text

    def value_text(self, value) -> str:
        """type_of(value_type(value)), its sizes through size()."""
        if isinstance(value, torch.Tensor):
            return f"{dtype_name(value.dtype)}[{', '.join(self.size(d) for d in value.shape)}]"
        if isinstance(value, torch.SymInt):
            return f"sym {self.size(value)}"
        if isinstance(value, (tuple, list)):
            return "(" + ", ".join(self.value_text(v) for v in value) + ")"
        return type(value).__name__

    def node_type(self, node: torch.fx.Node) -> str:
        if "val" not in node.meta and node.name in self.types:
            return self.type_of(self.types[node.name])
        return self.value_text(node.meta.get("val"))

    def arg(self, value) -> str:
        if isinstance(value, torch.fx.Node):
            return self.values[value]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.arg(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, torch.dtype):
            return dtype_name(value)
        if isinstance(value, torch.device):
            return repr(str(value))
        if isinstance(value, torch.SymInt):
            return self.size(value)
        if isinstance(value, torch.SymFloat):
            return self.symbol(value)
        if isinstance(value, torch._ops.HigherOrderOperator):
            # (its repr holds its address, which would make the text, a compile-cache key, differ between processes)
            return f"torch.ops.higher_order.{value.name()}"
        return repr(value)

    def target(self, node: torch.fx.Node) -> str:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return str(target)
        return getattr(target, "__name__", str(target))

    def print(self, graph: torch.fx.Graph, title: str | None) -> str:
        lines = [f"# {title}"] if title else []
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            self.values[node] = f"%a{i}"
        params = ", ".join(f"{self.values[n]}: {self.node_type(n)}" for n in placeholders)
        lines.append(f"graph({params}):")
        counter = 0
        for node in graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                lines.append(f"  return {self.arg(tuple(node.args[0]))}")
                continue
            name = f"%{counter}"
            counter += 1
            self.values[node] = name
            if node.op == "get_attr":
                lines.append(f"  {name} = getattr {node.target!r}")
                continue
            args = [self.arg(a) for a in node.args]
            args += [f"{k}={self.arg(v)}" for k, v in sorted(node.kwargs.items())]
            if node.target is operator.getitem:
                call = f"{args[0]}[{args[1]}]"
            else:
                call = f"{self.target(node)}({', '.join(args)})"
            lines.append(f"  {name} = {call}  # {self.node_type(node)}")
        return "\n".join(lines) + "\n"


def call_arguments(node: torch.fx.Node) -> dict:
    """An op call's arguments by their schema names, positional and keyword alike (defaults not filled in)."""
    names = [argument.name for argument in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def print_graph(graph: torch.fx.Graph, title: str | None = None, types: dict[str, tuple] | None = None) -> str:
    """Deterministic readable text of an ATen-level fx graph; `types`: value_types of nodes whose meta holds no
    value (a cached graph's, dzc/compile_cache.py)."""
    return _Printer(types).print(graph, title)


_VALUELESS_OPS = (torch.ops.aten._assert_scalar.default,)


def verify(graph: torch.fx.Graph) -> None:
    """The invariants every pass keeps: a well-formed graph, and a fake value on every computed node
    (lowering reads shapes and dtypes from it)."""
    graph.lint()
    for node in graph.nodes:
        # Runtime asserts on data-dependent sizes (after aten.nonzero) return nothing, so they carry no value.
        if node.op == "call_function" and "val" not in node.meta and node.target not in _VALUELESS_OPS:
            raise AssertionError(f"node {node.format_node()} has no meta['val']; passes must propagate it")
