"""expert_patterns: the activation between a MoE layer's two expert GEMMs, as declarative patterns (passes/patterns.py),
for fuse_mxfp4_experts.

The pass finds the layer's structure (a per-expert loop, a gathered bmm, a grouped mm): the gate_up GEMM's result
gu [.., 2I] and the down GEMM's input a. `read_activation(a, gu, seen)` reads which activation a computes from gu.
One pattern per meaning, before => what it reads:

    SILU            aten.silu(g) | g * sigmoid(g) | g / (1 + exp(-g))             => silu(g)
    SILU_GLU        SILU(gate) * up                                               => silu_glu(gate, up)
    CLAMPED_SWIGLU  (u + 1) * (g * sigmoid(g * alpha)), alpha a float, with       => clamped_swiglu(gate, up, alpha, L)
                    g = clamp_max(gate, L), u = clamp(up, -L, L) as CLAMPED reads them (other clamps: Refusal)
    CLAMPED         v under clamp_max / clamp_min / clamp, each bound set once    => (v, min, max)
    SLICE_HALVES    gu[..., 0::2], gu[..., 1::2]                                  => (gate, up), interleaved
                    gu[..., :W/2], gu[..., W/2:]                                  => (gate, up), concatenated
    SPLIT_HALVES    split(gu, sizes, -1)[0], [1] in two equal halves (chunk)      => (gate, up), concatenated

Every step looks through dtype casts and squeeze(unsqueeze(v, d), d) pairs (`UnderCasts`: fp32 upcasts, and what
functionalization leaves of an in-place op on a view); mul matches in either operand order. Every node a reading
consumed, the looked-through casts included, is added to `seen`: the pass checks that the layer holds nothing
else.
"""

from __future__ import annotations

import itertools
import operator

import torch

from dzc.passes.graph_pass import Refusal, fake_value, is_call
from dzc.passes.patterns import AnyOf, Match, Op, Pattern, Var

aten = torch.ops.aten
prims = torch.ops.prims


def under_casts(node) -> tuple:
    """(the value under dtype casts (prims.convert_element_type, aten._to_copy with only a dtype) and
    squeeze(unsqueeze(v, d), d) pairs, the nodes looked through)."""
    through = []
    while True:
        if is_call(node, prims.convert_element_type.default) or (
                is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}):
            through.append(node)
            node = node.args[0]
        elif (is_call(node, aten.squeeze.dim) and is_call(node.args[0], aten.unsqueeze.default)
              and node.args[1] == node.args[0].args[1]):
            through += [node, node.args[0]]
            node = node.args[0].args[0]
        else:
            return node, through


class UnderCasts(Pattern):
    """`inner` fitting the value under all of under_casts' steps (a loop: patterns have no repetition); the steps
    join the match's nodes. Greedy, as the pass always was: `inner` never sees a partly stripped value."""

    def __init__(self, inner: Pattern):
        self.inner = inner

    def fits(self, value, bindings, nodes):
        value, through = under_casts(value)
        yield from self.inner.fits(value, bindings, [*nodes, *through])


_c = UnderCasts


def _mul(a, b) -> Pattern:
    return Op(aten.mul.Tensor, _c(a), _c(b), commutative=True)


def _plus_one(v) -> Pattern:
    # v + 1: add's alpha left out or 1.
    return Op(aten.add.Tensor, _c(v), 1) | Op(aten.add.Tensor, _c(v), 1, kwargs={"alpha": 1})


# aten.silu(g) | g * sigmoid(g) | g / (1 + exp(-g))  =>  silu(g)
SILU = (Op(aten.silu.default, _c(Var("g")))
        | _mul(Var("g"), Op(aten.sigmoid.default, _c(Var("g"))))
        | Op(aten.div.Tensor, _c(Var("g")),
             _c(_plus_one(Op(aten.exp.default, _c(Op(aten.neg.default, _c(Var("g")))))))))

# silu(g) * up  =>  silu_glu(gate = g, up)
SILU_GLU = _c(_mul(SILU, Var("up")))

# (u + 1) * (g * sigmoid(g * alpha))  =>  clamped_swiglu(g, u, alpha); read_activation reads the clamps on g and u.
CLAMPED_SWIGLU = _c(_mul(_plus_one(Var("up_clamped")),
                         _mul(Var("gate_clamped"),
                              Op(aten.sigmoid.default, _c(_mul(Var("gate_clamped"), Var("alpha")))))))


def _clamp(v, low, high) -> Pattern:
    """aten.clamp(v, min, max), each bound passed positionally, by keyword or left out (a left-out Var bound stays
    unbound: None)."""
    bounds = (("min", low), ("max", high))
    return AnyOf(*(Op(aten.clamp.default, _c(v), *(p for _, p in bounds[:given]),
                      kwargs={name: p for (name, p), keyed in zip(bounds[given:], keys) if keyed})
                   for given in range(3) for keys in itertools.product((False, True), repeat=2 - given)))


def _clamp_max(v) -> Pattern:
    return Op(aten.clamp_max.default, _c(v), Var("high"))


def _clamp_min(v) -> Pattern:
    return Op(aten.clamp_min.default, _c(v), Var("low"))


# v under clamps, each of min and max set once, outermost first  =>  (v, min, max). Longest spelling first: the
# reading peels every clamp it can (clamp_max(clamp_min(v)) is never read as a clamp_max of a clamp_min).
_VALUE = Var("value")
CLAMPED = _c(_clamp_max(_clamp_min(_VALUE)) | _clamp_max(_VALUE)
             | _clamp_min(_clamp_max(_VALUE)) | _clamp_min(_VALUE)
             | _clamp(_clamp_min(_VALUE), None, Var("high")) | _clamp(_clamp_max(_VALUE), Var("low"), None)
             | _clamp(_VALUE, Var("low"), Var("high"))
             | _VALUE)


def clamp_bounds(node, seen: set) -> tuple:
    """(v, min, max) of node = CLAMPED(v), None for a bound no clamp sets; its nodes are added to seen."""
    match = CLAMPED.match(node)  # always: the last spelling is v alone
    seen.update(match.nodes)
    return match["value"], match.get("low"), match.get("high")


def _slice(name: str) -> Pattern:
    """aten.slice(gu, dim[, start[, end[, step]]]) bound as name, name_dim, ..; a left-out argument stays unbound."""
    args = [Var(f"{name}_{arg}") for arg in ("dim", "start", "end", "step")]
    return AnyOf(*(Op(aten.slice.Tensor, _c(Var("gu")), *args[:given], name=name) for given in range(1, 5)))


# gate, up = gu[..., a:b:s] for two (a, b, s)  =>  the halves; gate_up_halves checks the ranges.
SLICE_HALVES = (_slice("gate"), _slice("up"))

# gate, up = split(gu, sizes, dim)[0], [1]  =>  the halves; gate_up_halves checks the dim and the sizes.
_SPLIT = tuple(Op((aten.split.Tensor, aten.split_with_sizes.default), _c(Var("gu")), Var("sizes"), *dim, kwargs=kw,
                  name="split") for dim, kw in (((), None), ((Var("dim"),), None), ((), {"dim": Var("dim")})))
SPLIT_HALVES = (Op(operator.getitem, AnyOf(*_SPLIT), 0), Op(operator.getitem, Var("split"), 1))


def _both(patterns: tuple, gate, up, gu) -> Match | None:
    """The first way patterns[0] fits gate and patterns[1] fits up, with shared bindings and gu as `gu`."""
    for bindings, nodes in patterns[0].fits(gate, {"gu": gu}, []):
        for both, all_nodes in patterns[1].fits(up, bindings, nodes):
            return Match(gate, both, all_nodes)
    return None


def _range(match: Match, name: str, width) -> tuple:
    """A slice's (start, end, step) with its defaults, end capped at the width."""
    start, end, step = (match.get(f"{name}_{arg}") for arg in ("start", "end", "step"))
    return start or 0, end if end is not None and end < width else width, step or 1


def gate_up_halves(gate, up, gu, seen: set) -> bool:
    """Whether gate and up are gu's halves along its last dim interleaved (0::2 / 1::2) rather than concatenated;
    their nodes are added to seen. Refusal if they are not its halves."""
    dim, width = fake_value(gu).dim() - 1, fake_value(gu).shape[-1]
    match = _both(SLICE_HALVES, gate, up, gu)
    if match is not None and match["gate_dim"] in (-1, dim) and match["up_dim"] in (-1, dim):
        ranges = _range(match, "gate", width), _range(match, "up", width)
        for interleaved, expected in ((True, ((0, width, 2), (1, width, 2))),
                                      (False, ((0, width // 2, 1), (width // 2, width, 1)))):
            if ranges == expected:
                seen.update(match.nodes)
                return interleaved
    match = _both(SPLIT_HALVES, gate, up, gu)
    if (match is not None and match.get("dim", 0) in (-1, dim) and len(fake_value(match["split"])) == 2
            and fake_value(gate).shape[-1] == fake_value(up).shape[-1]):
        seen.update(match.nodes)
        return False
    raise Refusal("the activation's gate and up are not the two halves (or the even/odd rows) of the gate_up GEMM")


def read_activation(a, gu, seen: set) -> tuple[str, bool, float, float]:
    """The activation between gu (the gate_up GEMM + bias) and a (the down GEMM's input): (name, interleaved, alpha,
    limit), its nodes added to seen; Refusal if it is none of the above."""
    for match in CLAMPED_SWIGLU.matches(a):
        alpha = match["alpha"]
        if not isinstance(alpha, float):
            continue
        nodes = set(match.nodes)
        gate, gate_low, limit = clamp_bounds(match["gate_clamped"], nodes)
        up, up_low, up_high = clamp_bounds(match["up_clamped"], nodes)
        if gate_low is not None or not isinstance(limit, (int, float)) or (up_low, up_high) != (-limit, limit):
            raise Refusal("clamped SwiGLU whose clamps are not min(gate, L) and clamp(up, -L, L)")
        interleaved = gate_up_halves(gate, up, gu, nodes)
        seen.update(nodes)
        return "clamped_swiglu", interleaved, float(alpha), float(limit)
    match = SILU_GLU.match(a)
    if match is not None:
        nodes = set(match.nodes)
        interleaved = gate_up_halves(match["g"], match["up"], gu, nodes)
        seen.update(nodes)
        # alpha and limit are unused by silu_glu; fixed values keep the node's text deterministic.
        return "silu_glu", interleaved, 1.0, 0.0
    raise Refusal(f"unrecognised activation between the expert GEMMs (ending in {under_casts(a)[0].format_node()})")
