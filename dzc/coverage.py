"""Coverage: how much of a compiled graph runs in dzc kernels, what is left to the fallback, and what nearly fused.

For each graph dzc compiled (after its passes and lowering), every op is costed from the fake values capture left
on it (`meta["val"]`), at the sizes of the call that compiled it:

- FLOPs: torch.utils.flop_counter's registered formula where the op has one (matmuls, convolutions, fused
  attention); else one per output element for pointwise ops and one per input element for reductions; 0 for
  data movement. dzc ops count what their meaning computes (an attention's two matmuls over the keys it attends
  to, an MoE's two expert GEMMs per routed token) - not what a kernel happens to do.
- Bytes moved: each op reads its distinct tensor inputs and writes its outputs once (views and shape arithmetic
  move nothing; a gather reads the rows it gathers, not its whole table; a paged attention the cache rows it
  selects). This is op by op, as the graph stands: the fallback (Inductor) may fuse neighbouring unfused ops and
  move less.

A size known only at run time (an expert's token count after `nonzero`, a length read with `.item()`) counts as
the graph's token count (its largest dynamic input size), clamped to the bound capture knows; `estimated` says
where that happened.

Near-misses are sites that look like something a dzc pass fuses, left in the graph unfused:
- attention: a softmax whose scores come from a matmul (through scaling, masking, casts) and whose
  probabilities feed a matmul, or a fused scaled-dot-product-attention op;
- residual norm: a norm (rsqrt or sqrt of a mean/variance) of the sum of two tensors;
- MXFP4 experts: an MXFP4 weight still dequantized in full (dzc.mxfp4_dequantize left in the graph).
Each carries the reasons the passes recorded (`refused(where, why)`) at the source lines of the site's nodes, or
says that no pass recorded one (a spelling no pass recognises).
"""

from __future__ import annotations

import collections
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from dzc.lowering import dzc_op_name
from dzc.passes.graph_pass import location_of

aten = torch.ops.aten

LARGEST = 10  # unfused ops listed per graph

# Which passes' refusals can explain each kind of near-miss.
_PASSES_FOR = {"attention": ("fuse_sparse_attention", "fuse_vision_attention", "fuse_windowed_attention"),
               "residual norm": ("fuse_residual_norm",),
               "MXFP4 experts": ("fuse_mxfp4_experts",)}
# What dzc fuses of each kind, for a site no pass recorded a reason about (it may be a kind dzc has no op for).
_CLAIMS = {"attention": "fuse_sparse_attention takes attention under a top-k selection, fuse_vision_attention "
                        "attention over packed images (cu_seqlens), fuse_windowed_attention causal attention with a "
                        "local window or sinks (plain causal and non-causal attention run in the fallback's SDPA)",
           "residual norm": "fuse_residual_norm takes an add followed by an RMSNorm or LayerNorm",
           "MXFP4 experts": "fuse_mxfp4_experts takes routed MoE experts on MXFP4 weights"}


@dataclass
class OpCost:
    """An unfused op (all its instances at one source line), with what it costs."""

    op: str
    where: str  # "file.py:line (function)"
    source: str  # the model's source line
    count: int
    flops: int
    bytes: int


@dataclass
class NearMiss:
    kind: str  # "attention", "residual norm", "MXFP4 experts"
    where: str
    count: int  # sites at this source line (one per layer, usually)
    reasons: list[str]  # "<pass>: <why>", or why no pass took it


@dataclass
class GraphCoverage:
    compile_id: str = ""
    dzc_flops: int = 0
    fallback_flops: int = 0
    dzc_bytes: int = 0
    fallback_bytes: int = 0
    largest_unfused: list[OpCost] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    estimated: list[str] = field(default_factory=list)  # data-dependent sizes that were estimated
    uncosted: list[str] = field(default_factory=list)  # ops whose cost could not be read (counted as 0)

    @property
    def flop_share(self) -> float:
        return _share(self.dzc_flops, self.fallback_flops)

    @property
    def byte_share(self) -> float:
        return _share(self.dzc_bytes, self.fallback_bytes)

    def summary(self) -> str:
        return (f"in dzc kernels: {_percent(self.flop_share)} of {_quantity(self.dzc_flops + self.fallback_flops)}"
                f"FLOP, {_percent(self.byte_share)} of {_quantity(self.dzc_bytes + self.fallback_bytes)}B moved")

    def lines(self) -> list[str]:
        lines = [f"graph {self.compile_id}: {self.summary()}"]
        if self.estimated:
            lines.append(f"  sizes known only at run time counted as estimated: {', '.join(self.estimated)}")
        if self.uncosted:
            lines.append(f"  not costed (counted as 0): {'; '.join(self.uncosted)}")
        if self.largest_unfused:
            lines.append("  largest unfused ops (left to the fallback):")
            for op in self.largest_unfused:
                count = f" x{op.count}" if op.count > 1 else ""
                lines.append(f"    {op.op}{count}: {_quantity(op.flops)}FLOP, {_quantity(op.bytes)}B at {op.where}"
                             + (f": {op.source}" if op.source else ""))
        if self.near_misses:
            lines.append("  near-misses (looked like a fusion, not rewritten):")
            for miss in self.near_misses:
                count = f" x{miss.count}" if miss.count > 1 else ""
                lines.append(f"    {miss.kind}{count} at {miss.where}")
                lines.extend(f"      {reason}" for reason in miss.reasons)
        return lines


@dataclass
class Coverage:
    """compiled.report.coverage: one GraphCoverage per captured graph, and the shares over all of them."""

    graphs: list[GraphCoverage]

    @property
    def flop_share(self) -> float:
        return _share(sum(g.dzc_flops for g in self.graphs), sum(g.fallback_flops for g in self.graphs))

    @property
    def byte_share(self) -> float:
        return _share(sum(g.dzc_bytes for g in self.graphs), sum(g.fallback_bytes for g in self.graphs))

    @property
    def near_misses(self) -> list[NearMiss]:
        return [miss for graph in self.graphs for miss in graph.near_misses]

    def __str__(self) -> str:
        lines = [f"dzc coverage: {_percent(self.flop_share)} of FLOPs and {_percent(self.byte_share)} of bytes "
                 f"moved run in dzc kernels, over {len(self.graphs)} graph(s)"]
        for graph in self.graphs:
            lines.extend(f"  {line}" for line in graph.lines())
        return "\n".join(lines)


def _share(dzc: int, fallback: int) -> float:
    total = dzc + fallback
    return dzc / total if total else 0.0


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%"


def _quantity(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} "


# ---------------------------------------------------------------------------------------------------------------
# Sizes


class _Sizes:
    """Concrete sizes of one graph's symbolic values: the hint of the call that compiled it; a data-dependent
    (unbacked) size is the graph's token count (largest dynamic input size), clamped to the range capture knows."""

    def __init__(self, graph: torch.fx.Graph):
        hints = [1]
        for node in graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                hints += [int(d.node.hint) for d in value.shape
                          if isinstance(d, torch.SymInt) and d.node.has_hint()]
        self.tokens = max(hints)
        self.estimated: set[str] = set()

    def of(self, value):
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            node = value.node
            if node.has_hint():
                return node.hint
            env, expr = node.shape_env, node.expr
            # torch 2.13 renamed var_to_val (the hints of backed symbols) and deprecated the old name.
            backed = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
            substitutions = {}
            for symbol in expr.free_symbols:
                if symbol in backed:
                    substitutions[symbol] = backed[symbol]
                    continue
                bounds = env.var_to_range.get(symbol)
                lower = int(bounds.lower) if bounds is not None and bounds.lower.is_finite else 0
                upper = bounds.upper if bounds is not None else math.inf
                estimate = self.tokens if not upper.is_finite else min(int(upper), self.tokens)
                substitutions[symbol] = max(lower, estimate)
                self.estimated.add(str(symbol))
            concrete = expr.xreplace(substitutions)
            return int(concrete) if isinstance(value, torch.SymInt) else concrete
        return value

    def shape(self, tensor: torch.Tensor) -> torch.Size:
        return torch.Size(int(self.of(d)) for d in tensor.shape)

    def numel(self, tensor: torch.Tensor) -> int:
        return math.prod(self.shape(tensor))

    def nbytes(self, value) -> int:
        return sum(self.numel(t) * t.element_size() for t in _tensors(value))


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a node's value (a tensor, or tuples, lists and dicts of them). Not through torch's pytree: each
    of its tree_flatten calls leaves a reference cycle (its recursive helper) for the cyclic GC, and this runs several
    times per node of graphs that grow with the model's depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list, dict)):
        return [t for v in (value.values() if isinstance(value, dict) else value) for t in _tensors(v)]
    return []


def _value(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


# ---------------------------------------------------------------------------------------------------------------
# Costs


_NO_COST = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten._assert_scalar.default,
            aten.sym_constrain_range_for_size.default, aten._local_scalar_dense.default}
# Ops that read only the rows they gather: their whole table is not moved.
_GATHERS = {aten.embedding.default, aten.index.Tensor, aten.gather.default, aten.index_select.default,
            aten._unsafe_index.Tensor}
_SDPA_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def _is_sdpa(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "aten" and any(n in node.target._opname for n in _SDPA_NAMES))


def _aten_flops(node: torch.fx.Node, sizes: _Sizes) -> int:
    target = node.target
    out = _value(node)

    def concrete(value):
        return sizes.shape(value) if isinstance(value, torch.Tensor) else sizes.of(value)

    formula = flop_registry.get(target.overloadpacket)
    if formula is not None:  # (the arguments' sizes only for it: most ops are pointwise, costed by their output)
        args = tree_map(concrete, tree_map(_value, (node.args, node.kwargs)))
        return int(formula(*args[0], **args[1], out_val=tree_map(concrete, out)))
    if _is_sdpa(node):  # CPU's fused SDPA has no registered formula: both matmuls of [B, H, L, S]
        q, k, v = (sizes.shape(_value(a)) for a in node.args[:3])
        return 2 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    if target in (aten._grouped_mm.default,):  # [M, K] x [E, K, N] with offsets: every row meets one expert
        a, b = sizes.shape(_value(node.args[0])), sizes.shape(_value(node.args[1]))
        return 2 * math.prod(sizes.shape(out)) * a[-1] if b else 0
    if torch.Tag.pointwise in target.tags:
        return sum(sizes.numel(t) for t in _tensors(out))
    if torch.Tag.reduction in target.tags:
        inputs = _tensors(_value(node.args[0]))
        return sizes.numel(inputs[0]) if inputs else 0
    return 0


def _aten_bytes(node: torch.fx.Node, sizes: _Sizes) -> int:
    inputs = list(dict.fromkeys(n for n in node.all_input_nodes if isinstance(_value(n), torch.Tensor)))
    out = sizes.nbytes(_value(node))
    if node.target in _GATHERS:  # the indices, and the rows gathered (as many bytes as the output)
        indices = [n for n in inputs if not _value(n).is_floating_point()]
        return sum(sizes.nbytes(_value(n)) for n in indices) + 2 * out
    return sum(sizes.nbytes(_value(n)) for n in inputs) + out


def _dzc_cost(op: str, node: torch.fx.Node, sizes: _Sizes) -> tuple[int, int]:
    """(FLOPs, bytes) of a dzc op from its meaning."""
    args = [_value(a) for a in node.args]
    inputs = list(dict.fromkeys(n for n in node.all_input_nodes if isinstance(_value(n), torch.Tensor)))
    moved = sum(sizes.nbytes(_value(n)) for n in inputs) + sizes.nbytes(_value(node))
    if op == "add_rms_norm":  # add, square, sum, scale, weight
        return 5 * sizes.numel(args[0]), moved
    if op == "add_layer_norm":
        return 8 * sizes.numel(args[0]), moved
    if op == "varlen_attention":  # each query attends to at most max_seqlen keys of its segment
        (tokens, heads, d_qk), d_v = sizes.shape(args[0]), sizes.shape(args[2])[-1]
        keys = min(int(sizes.of(args[4])), tokens)
        return 2 * tokens * heads * keys * (d_qk + d_v), moved
    if op == "sparse_attention":  # k selected cache rows per query, read through the block table
        q, k_cache, v_cache, indices = args[0], args[1], args[2], args[6]
        (tokens, heads, d_qk), selected = sizes.shape(q), sizes.shape(indices)[-1]
        d_v = int(sizes.of(args[8]))
        rows = tokens * selected
        row_bytes = sum(math.prod(sizes.shape(c)[2:]) * c.element_size() for c in (k_cache, v_cache) if c is not None)
        read = sum(sizes.nbytes(a) for a in (q, indices)) + rows * row_bytes
        return 2 * rows * heads * (d_qk + d_v), read + sizes.nbytes(_value(node))
    if op == "dsa_indexer":  # every query scores max_context keys: ReLU(q.k) weighted over heads
        (tokens, heads, dim), context = sizes.shape(args[0]), int(sizes.of(args[7]))
        cache, sequences = args[2], sizes.shape(args[3])[0]
        keys = min(sizes.nbytes(cache), sequences * context * math.prod(sizes.shape(cache)[2:]) * cache.element_size())
        read = sum(sizes.nbytes(a) for a in (args[0], args[1])) + keys
        return 2 * tokens * heads * context * (dim + 1), read + sizes.nbytes(_value(node))
    if op == "dsa_topk":
        return sizes.numel(args[0]), moved
    if op in ("mxfp4_moe", "mxfp4_moe_w4a8"):  # two expert GEMMs per routed token; the experts it reaches
        (tokens, hidden), slots = sizes.shape(args[0]), sizes.shape(args[1])[-1]
        experts, two_i = sizes.shape(args[4])[:2]
        weights = [a for a in args[3:9] if isinstance(a, torch.Tensor)]
        reached = min(experts, tokens * slots) / experts
        read = sum(sizes.nbytes(a) for a in args[:3]) + reached * sum(sizes.nbytes(w) for w in weights)
        return 2 * tokens * slots * (two_i * hidden + hidden * two_i // 2), int(read) + sizes.nbytes(_value(node))
    return sum(sizes.numel(t) for t in _tensors(_value(node))), moved


def _runs_in_dzc_kernel(op: str | None, node: torch.fx.Node) -> bool:
    """A dzc op lowered to a generated kernel (an op without a kernel_id argument, or lowered to its reference
    with an empty one, runs plain torch)."""
    if op is None:
        return False
    arguments = {a.name for a in node.target._schema.arguments}
    if "kernel_id" not in arguments:
        return False
    if "kernel_id" in node.kwargs:
        return bool(node.kwargs["kernel_id"])
    from dzc.targets import KERNEL_FAMILIES  # noqa: PLC0415 (a graph before lowering: whether it would be)

    return op in KERNEL_FAMILIES


def _source_line(node: torch.fx.Node) -> str:
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = [i for i, line in enumerate(lines) if line.strip().startswith("File ")]
    if not frames or frames[-1] + 1 >= len(lines):
        return ""
    return lines[frames[-1] + 1].strip()


# ---------------------------------------------------------------------------------------------------------------
# Near-misses


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


_MATMULS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default)
# What lies between attention scores and their softmax, or probabilities and their matmul: scaling, masking,
# softcapping, casts, views, broadcasts.
_PASS_THROUGH = (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten._to_copy.default,
                 aten.clone.default, aten.expand.default, aten.contiguous.default)


def _is_pass_through(node) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:  # an element of a multi-output op (var_mean)
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        target in _PASS_THROUGH or target.is_view or torch.Tag.pointwise in target.tags)


def _softmax_input(node: torch.fx.Node):
    """x for softmax(x): aten._softmax, or the decomposed exp(x - amax(x)) (its exp node)."""
    if _is_call(node, aten._softmax.default, aten._safe_softmax.default):
        return node.args[0]
    if _is_call(node, aten.exp.default) and _is_call(node.args[0], aten.sub.Tensor):
        x, peak = node.args[0].args
        if _is_call(peak, aten.amax.default, aten.detach.default) and peak.args[0] is x:
            return x
    return None


def _reaches(start, found, forward: bool) -> torch.fx.Node | None:
    """A node satisfying `found` reached from `start` through pass-through ops only (inputs or users)."""
    frontier, seen = [start], set()
    while frontier and len(seen) < 64:
        node = frontier.pop()
        if node in seen or not isinstance(node, torch.fx.Node):
            continue
        seen.add(node)
        if found(node):
            return node
        if node is start or _is_pass_through(node):
            frontier.extend(node.users if forward else node.all_input_nodes)
    return None


def _neighbourhood(nodes: list[torch.fx.Node], depth: int = 6) -> set[torch.fx.Node]:
    """The nodes within `depth` input edges of `nodes`, not past a matmul: where a refusal of this site's
    fusion may have been recorded (a top-k selection feeding the mask, a residual add)."""
    region, frontier = set(nodes), list(nodes)
    for _ in range(depth):
        frontier = [i for n in frontier if not _is_call(n, *_MATMULS) or n in nodes for i in n.all_input_nodes
                    if i.op == "call_function" and i not in region]
        region.update(frontier)
    return region


def _attention_sites(graph: torch.fx.Graph):
    for node in graph.nodes:
        if _is_sdpa(node):
            yield node, [node]
            continue
        x = _softmax_input(node)
        if x is None:
            continue
        scores = _reaches(x, lambda n: _is_call(n, *_MATMULS), forward=False)
        values = _reaches(node, lambda n: n is not node and _is_call(n, *_MATMULS), forward=True)
        if scores is not None and values is not None:
            yield node, [scores, node, values]


def _norm_input(node: torch.fx.Node):
    """h for a norm's rsqrt(mean(h^2) + eps), sqrt(var(h) + eps), ...: the input of the reduction under it."""
    reduction = _reaches(node.args[0], lambda n: _is_call(n, aten.mean.dim, aten.sum.dim_IntList, aten.var.correction,
                                                          aten.var_mean.correction), forward=False)
    if reduction is None:
        return None
    h = reduction.args[0]
    while _is_call(h, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten._to_copy.default,
                   aten.view.default, aten.sub.Tensor) and h.args:
        h = h.args[0]
    return h


def _residual_norm_sites(graph: torch.fx.Graph):
    for node in graph.nodes:
        if not _is_call(node, aten.rsqrt.default, aten.sqrt.default):
            continue
        h = _norm_input(node)
        if _is_call(h, aten.add.Tensor) and all(isinstance(_value(a), torch.Tensor) and _value(a).dim() > 0
                                                 for a in h.args[:2]):
            yield node, [h, node]


def _expert_sites(graph: torch.fx.Graph):
    for node in graph.nodes:
        if dzc_op_name(node) == "mxfp4_dequantize":
            yield node, [node]


_SITES = (("attention", _attention_sites), ("residual norm", _residual_norm_sites),
          ("MXFP4 experts", _expert_sites))


def _near_misses(graph: torch.fx.Graph, refusals: list[tuple[str, str, str]]) -> list[NearMiss]:
    """Unfused sites that look like a fusion, each with the refusals recorded at its nodes' source lines."""
    grouped: dict[tuple[str, str, tuple[str, ...]], int] = collections.Counter()
    for kind, find in _SITES:
        relevant = [(p, where, why) for p, where, why in refusals if p in _PASSES_FOR[kind]]
        for anchor, nodes in find(graph):
            places = {location_of(n) for n in _neighbourhood(nodes)}
            reasons = tuple(dict.fromkeys(f"{p}: {why}" for p, where, why in relevant
                                          if any(where == place or where.startswith(place + " ")
                                                 for place in places)))
            if not reasons:
                reasons = (f"no pass recorded a reason: {_CLAIMS[kind]}, and none recognised this site",)
            grouped[(kind, location_of(anchor), reasons)] += 1
    return [NearMiss(kind, where, count, list(reasons)) for (kind, where, reasons), count in grouped.items()]


# ---------------------------------------------------------------------------------------------------------------


def graph_coverage(graph: torch.fx.Graph, refusals: list[tuple[str, str, str]] = ()) -> GraphCoverage:
    """The coverage of one graph after dzc's passes (and lowering, before the fallback compiles it); `refusals`
    = (pass, where, why) recorded by the passes on this graph. A statistic: an op it cannot cost counts as 0 and
    is listed, never failing the compile."""
    sizes = _Sizes(graph)
    coverage = GraphCoverage()
    unfused: dict[tuple[str, str], OpCost] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
                or node.target in _NO_COST or (node.target.is_view and dzc_op_name(node) is None):
            continue
        op = dzc_op_name(node)
        try:
            flops, moved = (_dzc_cost(op, node, sizes) if op is not None
                            else (_aten_flops(node, sizes), _aten_bytes(node, sizes)))
        except Exception as error:  # noqa: BLE001 (a cost formula that does not fit this op instance)
            coverage.uncosted.append(f"{node.target} at {location_of(node)} ({type(error).__name__}: {error})")
            flops, moved = 0, 0
        if _runs_in_dzc_kernel(op, node):
            coverage.dzc_flops += flops
            coverage.dzc_bytes += moved
            continue
        coverage.fallback_flops += flops
        coverage.fallback_bytes += moved
        name = str(node.target)
        where = location_of(node)
        cost = unfused.setdefault((name, where), OpCost(name, where, _source_line(node), 0, 0, 0))
        cost.count += 1
        cost.flops += flops
        cost.bytes += moved
    coverage.largest_unfused = sorted(unfused.values(), key=lambda c: (c.flops, c.bytes), reverse=True)[:LARGEST]
    try:
        coverage.near_misses = _near_misses(graph, list(refusals))
    except Exception as error:  # noqa: BLE001 (as above: a statistic never fails the compile)
        coverage.uncosted.append(f"near-misses not searched ({type(error).__name__}: {error})")
    coverage.estimated = sorted(sizes.estimated)
    return coverage
