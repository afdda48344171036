"""fuse_mxfp4_experts: MoE expert matmuls on MXFP4-dequantized weights, with their routing glue and combine  =>
one dzc.mxfp4_moe node; the dequantized weights disappear from the graph.

Before (three spellings; W13 = dzc.mxfp4_dequantize(w13_blocks, w13_scales, bf16) [E, 2I, H], W2 likewise
[E, H, I]; `act` is one of the recognised activations below, biases optional):

  per-expert loop (dzc models' "per_expert", DeepSeek-V3 reference style), repeated for e = 0 .. E-1:
    %tok, %slot = aten.unbind(aten.nonzero(aten.eq.Scalar(%topk_ids, e)), 1)
    %gu  = aten.add(aten.mm(aten.index(%x, [%tok]), aten.permute(aten.select(%W13, 0, e), [1, 0])),
                    aten.select(%b13, 0, e))                       # or aten.addmm(bias, x, w)
    %y   = aten.add(aten.mm(act(%gu), aten.permute(aten.select(%W2, 0, e), [1, 0])), aten.select(%b2, 0, e))
    %acc = aten.index_add(%acc, 0, %tok, aten.mul(%y, aten.index(aten.unsqueeze(%topk_weights, 2), [%tok, %slot])))
  with %acc starting as aten.full([T, H], 0).

  gathered bmm (dzc models' "gathered_bmm", transformers' batched_mm style):
    %ids = aten.view(%topk_ids, [-1]);  %rows = repeat_interleave(%x, k)  (unsqueeze, expand, clone, view)
    %gu  = aten.squeeze(aten.bmm(aten.index(%W13, [%ids]), aten.unsqueeze(%rows, -1)), -1) + aten.index(%b13, [%ids])
    %y   = aten.squeeze(aten.bmm(aten.index(%W2, [%ids]), aten.unsqueeze(act(%gu), -1)), -1) + aten.index(%b2, [%ids])
    %out = aten.sum(aten.view(aten.mul(%y, aten.view(%topk_weights, [-1, 1])), [T, k, H]), [1])
  transformers' batched_mm multiplies by aten.unsqueeze(mask(aten.view(%topk_weights, [-1])), -1) instead, with
  mask(v) = v; under expert parallelism mask(v) = aten.where(aten.ge(%ids, E), aten.scalar_tensor(0), v) and the
  weights and biases are gathered by clamp(%ids, 0, E-1): matched only where no id reaches E, as for grouped mm.

  grouped mm (transformers 5.x default experts implementation, e.g. GptOss; aten._grouped_mm, or its custom
  transformers.grouped_mm_fallback op for non-bf16 weights):
    %ids_g, %perm = aten.sort(aten.view(%topk_ids, [-1]));  %offs = aten.cumsum(aten.histc(%ids_g, E, 0, E-1))
    %gu  = mask(aten._grouped_mm(mask(aten.index(%x, [%perm // k])), aten.permute(%W13, [0, 2, 1]), %offs)
                + aten.index(%b13, [%bias_ids]))
    %y   = mask(aten._grouped_mm(act(%gu), aten.permute(%W2, [0, 2, 1]), %offs) + aten.index(%b2, [%bias_ids]))
    %y   = aten.mul(%y, aten.unsqueeze(aten.index(aten.view(%topk_weights, [-1]), [%perm]), -1))
    %out = aten.sum(aten.view(aten.index(%y, [inverse of %perm]), [T, k, H]), [1])
  Without expert-parallel sentinel handling, mask(v) = v and %bias_ids = %ids_g. With it (transformers 5.17
  always; later versions only under expert parallelism), mask(v) = aten.where(%sentinel, aten.scalar_tensor(0), v)
  with %sentinel = aten.unsqueeze(aten.ge(%ids_g, E), -1), and %bias_ids = aten.clamp_max(%ids_g, E-1). The op has
  no sentinel rows, so this is matched only where %topk_ids are the indices of an aten.topk over E scores: no id
  reaches E, and the masks and the clamp are identities.

Where the routing weights are fp32 in a 16-bit model (the weighted sum is then fp32) and the sum's only use is a
cast back to the activations' dtype, that cast is the layer's output: the op sums in fp32 and rounds once there.

After:

    %out = dzc.mxfp4_moe.default(%x, %topk_ids, %topk_weights, %w13_blocks, %w13_scales, %b13, %w2_blocks,
                                 %w2_scales, %b2, activation, gate_up_interleaved, alpha, limit)

The routing (router GEMM, scoring, top-k, renormalisation) stays as it is: the op starts from topk ids and weights.

Activations, read by the patterns of passes/expert_patterns.py (fp32 casts between the ops are ignored; mul matches
in either operand order):
    gate/up split: slices 0::2 / 1::2 of gu (interleaved), or slices [:W/2] / [W/2:] or split/chunk into halves
    "silu_glu":           silu(gate) * up, silu spelled aten.silu, gate * sigmoid(gate) or gate / (1 + exp(-gate))
    "clamped_swiglu": g = clamp_max(gate, L); (clamp(up, -L, L) + 1) * (g * sigmoid(g * alpha)), each clamp spelled
                      clamp, or clamp_max and clamp_min in either nesting

Every node between the layer's inputs and its output must be accounted for by the match, so nothing the op would
not compute is dropped. Every dequantized weight left in the graph afterwards is reported as a refusal too,
whether or not a pattern anchor was found near it. The pass refuses (reported, graph unchanged there) when: the
expert weights are plain tensors rather than MXFP4 dequantizations (BF16 experts stay as they are, for the
fallback); an intermediate (including a dequantized weight) has a use outside the layer; the loop does not cover
every expert exactly once; the activation is not one of the above; the dequantized dtype differs from the
activations'; sentinel masks guard expert ids that are not provably below E.

Ordering: runs on the captured ATen graph, after fuse_residual_norm (independent of it: it reads the normalised
activations whichever node produces them) and before lowering. The per-expert loop spelling reaches the pass as
one graph only when Dynamo captures aten.nonzero (capture_dynamic_output_shape_ops, which dzc.compile turns on).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from dzc.ops.mxfp4_moe import check_mxfp4_moe_args
from dzc.passes.expert_patterns import clamp_bounds, read_activation, under_casts
from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of
from dzc.passes.patterns import cast_dtype

aten = torch.ops.aten
prims = torch.ops.prims

NAME = "fuse_mxfp4_experts"
_DEQUANTIZE = torch.ops.dzc.mxfp4_dequantize.default
_MXFP4_MOE = torch.ops.dzc.mxfp4_moe.default
_GROUPED_MMS = (aten._grouped_mm.default,)
_ACTIVATION_OPS = 40  # more nodes than any recognised activation spans


def _grouped_mm_targets() -> tuple:
    """aten._grouped_mm, plus transformers' custom fallback op when transformers has registered it."""
    fallback = getattr(torch.ops.transformers, "grouped_mm_fallback", None)
    return _GROUPED_MMS + ((fallback.default,) if fallback is not None else ())


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@dataclass
class _Match:
    """One MoE layer: the op's operands, the node it replaces, and every node the match accounted for."""

    x: torch.fx.Node
    topk_ids: torch.fx.Node
    topk_weights: torch.fx.Node
    w13: torch.fx.Node  # the dequantize nodes
    w2: torch.fx.Node
    b13: torch.fx.Node | None
    b2: torch.fx.Node | None
    activation: tuple[str, bool, float, float]  # name, interleaved, alpha, limit
    out: torch.fx.Node
    seen: set = field(default_factory=set)
    top_k: int | None = None  # slots per token where the spelling fixes it (the combine's view)


class _Tracker:
    """Records the nodes a matcher walks through, so that the rewrite can check it accounted for the region."""

    def __init__(self):
        self.seen: set[torch.fx.Node] = set()

    def take(self, node, *targets):
        """node if it calls one of targets (recorded), else raise Refusal."""
        if not is_call(node, *targets):
            raise Refusal(f"expected {'/'.join(str(t) for t in targets)}, found "
                           f"{node.format_node() if isinstance(node, torch.fx.Node) else repr(node)}")
        self.seen.add(node)
        return node

    def snapshot(self) -> set:
        return set(self.seen)

    def restore(self, snapshot: set) -> None:
        """Forget what a failed alternative recorded."""
        self.seen = snapshot

    def strip_casts(self, node):
        """The value under dtype casts and squeeze(unsqueeze(v, d), d) pairs (expert_patterns.under_casts)."""
        node, through = under_casts(node)
        self.seen.update(through)
        return node


def _operands(t: _Tracker, node, target):
    """Both orders of a commutative binary node's operands (casts stripped), or () if node is not that op."""
    node = t.strip_casts(node)
    if not is_call(node, target) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return ()
    t.seen.add(node)
    a, b = (t.strip_casts(v) for v in node.args)
    return ((a, b), (b, a))


# ---------------------------------------------------------------------------------------------------------------
# Weights

def _dequantized(t: _Tracker, node, what: str) -> torch.fx.Node:
    """The dzc.mxfp4_dequantize node under views of a weight; a refusal if the weight is a plain tensor."""
    node = t.strip_casts(node)
    if not is_call(node, _DEQUANTIZE):
        dtype = fake_value(node).dtype if fake_value(node) is not None else ''
        raise Refusal(f"the {what} expert weights are plain {dtype} "
                      f"tensors, not MXFP4 (no dzc.mxfp4_dequantize): left to the fallback")
    t.seen.add(node)
    return node


def _linear(t: _Tracker, node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """mm (+ add bias) or addmm: (input, weight operand, bias operand or None); node = the result."""
    node = t.strip_casts(node)
    if is_call(node, aten.addmm.default):
        t.seen.add(node)
        return node.args[1], node.args[2], node.args[0]
    for product, bias in _operands(t, node, aten.add.Tensor):
        if is_call(product, aten.mm.default):
            t.seen.add(product)
            return product.args[0], product.args[1], bias
    if is_call(node, aten.mm.default):
        t.seen.add(node)
        return node.args[0], node.args[1], None
    raise Refusal(f"expected an expert GEMM, found {node.format_node()}")


def _transposed_expert(t: _Tracker, node, expert: int) -> torch.fx.Node:
    """permute(select(W, 0, e), [1, 0]) -> W (also t / transpose)."""
    node = t.strip_casts(node)
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        t.seen.add(node)
    elif is_call(node, aten.t.default) or (is_call(node, aten.transpose.int) and set(node.args[1:]) in ({0, 1},
                                                                                                       {-1, -2})):
        t.seen.add(node)
    else:
        raise Refusal(f"expert weight operand is not W[e].t(): {node.format_node()}")
    select = t.take(node.args[0], aten.select.int)
    if select.args[1] != 0 or select.args[2] != expert:
        raise Refusal(f"expert {expert}'s GEMM reads another expert's weight ({select.format_node()})")
    return select.args[0]


def _untransposed(t: _Tracker, node, what: str) -> torch.fx.Node:
    """W under permute(W, [0, 2, 1]) / transpose(W, 1, 2) (transformers' [E, in, out] view of an [E, out, in]
    weight); a refusal if node is not such a view."""
    node = t.strip_casts(node)
    if (is_call(node, aten.permute.default) and list(node.args[1]) == [0, 2, 1]) or (
            is_call(node, aten.transpose.int) and set(node.args[1:]) in ({1, 2}, {-1, -2})):
        t.seen.add(node)
        return node.args[0]
    if not is_call(node, _DEQUANTIZE):
        _dequantized(t, node, what)  # plain weights: that refusal says more
    raise Refusal(f"the {what} expert GEMM multiplies by a dequantized weight that is not transposed")


def _same(values, what: str):
    first = values[0]
    if any(v is not first if isinstance(first, torch.fx.Node) else v != first for v in values[1:]):
        raise Refusal(f"the experts of one layer use different {what}")
    return first


# ---------------------------------------------------------------------------------------------------------------
# Shared by the structures: the activation's input, biases, the combine, expert-parallel sentinels

def _up_gu(t: _Tracker, node) -> torch.fx.Node:
    """The gate_up GEMM's result (with bias) that the activation ending at `node` splits: the operand of the first
    slice/split above node (casts stripped). The activation is a few ops, so the search stops after
    _ACTIVATION_OPS nodes."""
    frontier, visited = [node], set()
    while frontier and len(visited) < _ACTIVATION_OPS:
        current = frontier.pop()
        if current in visited or not isinstance(current, torch.fx.Node):
            continue
        visited.add(current)
        if is_call(current, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default):
            return t.strip_casts(current.args[0])
        frontier.extend(a for a in current.args if isinstance(a, torch.fx.Node))
    raise Refusal("no gate/up split found before the down GEMM")


def _biased(t: _Tracker, node):
    """node = value + bias[ids] (either order, bias [E, N]) -> (value, bias tensor, ids); else (node, None, None)."""
    before = t.snapshot()
    for value, bias in _operands(t, node, aten.add.Tensor):
        if (is_call(bias, aten.index.Tensor) and len(bias.args[1]) == 1 and fake_value(bias.args[0]) is not None
                and fake_value(bias.args[0]).dim() == 2):
            t.seen.add(bias)
            return value, bias.args[0], bias.args[1][0]
    t.restore(before)
    return node, None, None


def _token_sum(t: _Tracker, out):
    """sum(view(v, [T, k, H]), [1]) -> (v, k)."""
    total = t.take(out, aten.sum.dim_IntList)
    if list(total.args[1]) != [1] or _arg(total, 2, "keepdim", False):
        raise Refusal("the combine does not sum over the top-k slots")
    view = t.take(total.args[0], aten.view.default, aten.reshape.default, aten._unsafe_view.default)
    shape = fake_value(view).shape
    return view.args[0], shape[1]


def _sentinel_unmasked(t: _Tracker, node, masks: list):
    """v of where(mask, scalar_tensor, v) (a masked_fill of expert-parallel sentinel rows), its mask appended to
    masks; node itself when it is no such where. The fill value is not checked: _check_sentinels_impossible accepts
    the masks only where they never fire, and a where that keeps v's shape and dtype is then v."""
    if is_call(node, aten.where.self) and is_call(node.args[1], aten.scalar_tensor.default):
        value, kept = fake_value(node.args[2]), fake_value(node)
        if value is not None and kept is not None and (kept.shape, kept.dtype) == (value.shape, value.dtype):
            t.seen.update((node, node.args[1]))
            masks.append(node.args[0])
            return node.args[2]
    return node


def _check_sentinels_impossible(t: _Tracker, masks: list, gather_ids: list, ids, topk_ids, experts: int):
    """Each of gather_ids (what the weight or bias gathers read) is ids, clamp_max(ids, E-1) or clamp(ids, 0, E-1);
    each mask is ids >= E, possibly unsqueezed to broadcast over rows. Masks and clamps serve sentinel ids (>= E,
    expert parallelism), which the fused op does not have: they are accepted only where they are identities, ids
    being (a view of) the indices of a top-k over the E experts' scores, so in [0, E)."""
    clamped = False
    for gathered_by in gather_ids:
        unclamped, low, high = clamp_bounds(gathered_by, t.seen)
        if unclamped is not ids or (low, high) not in ((None, None), (None, experts - 1), (0, experts - 1)):
            raise Refusal("expert weights or biases are gathered by other ids than the routed expert ids")
        clamped |= high is not None
    for mask in masks:
        if is_call(mask, aten.unsqueeze.default) and mask.args[1] in (-1, 1):
            t.seen.add(mask)
            mask = mask.args[0]
        ge = t.take(mask, aten.ge.Scalar)
        if ge.args[0] is not ids or ge.args[1] != experts:
            raise Refusal(f"expert rows or routing weights are masked by something else than the sentinel mask "
                          f"(expert ids >= {experts}): {mask.format_node()}")
    if (masks or clamped) and not _top_k_indices(topk_ids, experts):
        raise Refusal(f"sentinel masks on expert ids that do not come from a top-k over the {experts} experts "
                      f"(expert parallelism: sentinel slots are not supported)")


def _top_k_indices(ids, experts: int) -> bool:
    """Whether ids are, under views and dtype casts, the indices of an aten.topk over a last dimension of size
    `experts`: then every id is below `experts`."""
    while is_call(ids, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                  prims.convert_element_type.default, aten._to_copy.default):
        ids = ids.args[0]
    if not (is_call(ids, operator.getitem) and ids.args[1] == 1 and is_call(ids.args[0], aten.topk.default)):
        return False
    topk = ids.args[0]
    scores = fake_value(topk.args[0])
    return _arg(topk, 2, "dim", -1) in (-1, scores.dim() - 1) and scores.shape[-1] == experts


# ---------------------------------------------------------------------------------------------------------------
# Structure: per-expert loop

def _accumulation(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(accumulator, row ids, rows) of `acc.index_add_(0, ids, rows)`; capture decomposes it into
    aten.index_put(acc, [ids], rows, accumulate=True) for some dtypes (fp32) and keeps aten.index_add for others."""
    if is_call(node, aten.index_add.default):
        if node.args[1] != 0 or len(node.args) > 4 or node.kwargs.get("alpha", 1) != 1:
            return None
        return node.args[0], node.args[2], node.args[3]
    if is_call(node, aten.index_put.default) and len(node.args[1]) == 1 and _arg(node, 3, "accumulate", False):
        return node.args[0], node.args[1][0], node.args[2]
    return None


def _match_per_expert_loop(final: torch.fx.Node) -> _Match:
    """final = the last accumulation (index_add) of the chain."""
    t = _Tracker()
    links = []
    acc = final
    while _accumulation(acc) is not None:
        t.seen.add(acc)
        links.append(_accumulation(acc))
        acc = acc.args[0]
    zeros = t.take(acc, aten.full.default, aten.zeros.default)
    if is_call(zeros, aten.full.default) and zeros.args[1] != 0:
        raise Refusal("the accumulator does not start at zero")
    xs, ids_list, weights_list, w13s, w2s, b13s, b2s, activations = ([] for _ in range(8))
    experts = []
    for _, tokens, contribution in reversed(links):
        weighted = None
        for y, w in _operands(t, contribution, aten.mul.Tensor):
            if is_call(w, aten.index.Tensor):
                weighted = (y, w)
                break
        if weighted is None:
            raise Refusal("an expert's contribution is not multiplied by its routing weights")
        y, w_index = weighted
        t.seen.add(w_index)
        w_source, index_list = w_index.args
        if is_call(w_source, aten.unsqueeze.default) and w_source.args[1] in (2, -1):
            t.seen.add(w_source)
            weights_list.append(w_source.args[0])
        else:
            raise Refusal("routing weights indexed in an unrecognised way")
        if len(index_list) != 2 or index_list[0] is not tokens:
            raise Refusal("routing weights indexed by other tokens than the contribution")
        slots = index_list[1]
        token_item, slot_item = (t.take(n, operator.getitem) for n in (tokens, slots))
        unbind = token_item.args[0]
        if slot_item.args[0] is not unbind or (token_item.args[1], slot_item.args[1]) != (0, 1):
            raise Refusal("tokens and slots do not come from one torch.where")
        t.take(unbind, aten.unbind.int)
        nonzero = t.take(unbind.args[0], aten.nonzero.default)
        eq = t.take(nonzero.args[0], aten.eq.Scalar)
        ids_list.append(eq.args[0])
        expert = eq.args[1]
        if not isinstance(expert, int):
            raise Refusal("an expert id compared with a non-constant")
        experts.append(expert)
        down_in, down_w, down_b = _linear(t, y)
        w2s.append(_transposed_expert(t, down_w, expert))
        if down_b is not None:
            b2s.append(t.take(down_b, aten.select.int).args[0])
            if down_b.args[1:] != (0, expert):
                raise Refusal("the down bias is another expert's")
        gu = _up_gu(t, down_in)
        up_in, up_w, up_b = _linear(t, gu)
        w13s.append(_transposed_expert(t, up_w, expert))
        if up_b is not None:
            b13s.append(t.take(up_b, aten.select.int).args[0])
            if up_b.args[1:] != (0, expert):
                raise Refusal("the gate_up bias is another expert's")
        x_index = t.take(up_in, aten.index.Tensor)
        if len(x_index.args[1]) != 1 or x_index.args[1][0] is not tokens:
            raise Refusal("an expert reads other rows than its tokens")
        xs.append(x_index.args[0])
        activations.append(read_activation(down_in, gu, t.seen))
    w13 = _dequantized(t, _same(w13s, "gate_up weights"), "gate_up")
    w2 = _dequantized(t, _same(w2s, "down weights"), "down")
    count = fake_value(w13).shape[0]
    if sorted(experts) != list(range(count)):
        raise Refusal(f"the loop covers experts {sorted(experts)}, not each of the {count} experts once")
    for biases in (b13s, b2s):
        if biases and len(biases) != count:
            raise Refusal("only some experts add a bias")
    return _Match(_same(xs, "inputs"), _same(ids_list, "topk ids"), _same(weights_list, "routing weights"), w13, w2,
                  _same(b13s, "gate_up biases") if b13s else None, _same(b2s, "down biases") if b2s else None,
                  _same(activations, "activations"), final, t.seen)


# ---------------------------------------------------------------------------------------------------------------
# Structure: gathered bmm

def _match_gathered_bmm(out: torch.fx.Node) -> _Match:
    """out = the combine's aten.sum over the slots."""
    t = _Tracker()
    weighted, k = _token_sum(t, out)
    masks: list = []
    for y, w in _operands(t, weighted, aten.mul.Tensor):
        if is_call(w, aten.unsqueeze.default) and w.args[1] in (-1, 1):
            flat = _sentinel_unmasked(t, w.args[0], masks)  # masked_fill(ids >= E, 0) under expert parallelism
            if is_call(flat, aten.view.default):
                t.seen.update((w, flat))  # weights.reshape(-1).unsqueeze(-1)
                topk_weights = flat.args[0]
                break
        if is_call(w, aten.view.default) and list(fake_value(w).shape[1:]) == [1]:
            t.seen.add(w)  # weights.reshape(-1, 1)
            topk_weights = w.args[0]
            break
    else:
        raise Refusal("the expert outputs are not multiplied by the routing weights")
    y, b2, b2_ids = _biased(t, y)
    w2, ids, a = _squeezed_bmm(t, y, "down")
    gu = _up_gu(t, a)
    gu_value, b13, b13_ids = _biased(t, gu)
    w13, ids_up, rows = _squeezed_bmm(t, gu_value, "gate_up")
    if ids_up is not ids or any(b is not None and b_ids is not ids for b, b_ids in ((b2, b2_ids), (b13, b13_ids))):
        raise Refusal("the GEMMs and biases gather by different ids")
    activation = read_activation(a, gu, t.seen)
    flat_ids = clamp_bounds(ids, t.seen)[0]  # under EP the gathers read clamp(flat ids, 0, E-1), checked below
    topk_ids = t.take(flat_ids, aten.view.default, aten.reshape.default).args[0]
    w13 = _dequantized(t, w13, "gate_up")
    experts = fake_value(w13).shape[0]
    _check_sentinels_impossible(t, masks, [ids], flat_ids, topk_ids, experts)
    x = _repeated_rows(t, rows, k)
    return _Match(x, topk_ids, topk_weights, w13, _dequantized(t, w2, "down"), b13, b2, activation, out, t.seen, k)


def _squeezed_bmm(t: _Tracker, node, what: str):
    """One row per (token, slot) times its expert's gathered weight -> (W [E, N, K] operand, ids, v):
        squeeze(bmm(index(W, [ids]), unsqueeze(v, -1)), -1)                      W[ids] @ v[..., None]
        squeeze(bmm(unsqueeze(v, 1), index(transpose(W), [ids])), 1)            v[:, None] @ W^T[ids]
    (the second is transformers' batched_mm on [E, in, out] weights)."""
    squeeze = t.take(t.strip_casts(node), aten.squeeze.dim)
    bmm = t.take(squeeze.args[0], aten.bmm.default)
    if is_call(bmm.args[0], aten.index.Tensor):
        gathered = t.take(bmm.args[0], aten.index.Tensor)
        vector = t.take(bmm.args[1], aten.unsqueeze.default)
        weight = gathered.args[0]
        if squeeze.args[1] not in (-1, 2) or vector.args[1] not in (-1, 2):
            raise Refusal(f"the {what} bmm is not W[ids] @ v[..., None]")
    else:
        vector = t.take(bmm.args[0], aten.unsqueeze.default)
        gathered = t.take(bmm.args[1], aten.index.Tensor)
        if squeeze.args[1] != 1 or vector.args[1] != 1:
            raise Refusal(f"the {what} bmm is not v[:, None] @ W[ids]")
        weight = _untransposed(t, gathered.args[0], what)
    if len(gathered.args[1]) != 1:
        raise Refusal(f"the {what} bmm gathers its weights by more than one index")
    return weight, gathered.args[1][0], vector.args[0]


def _repeated_rows(t: _Tracker, rows, k) -> torch.fx.Node:
    """x.repeat_interleave(k, dim=0) as capture decomposes it: view(clone(expand(unsqueeze(x, 1), [T, k, H])))."""
    view = t.take(rows, aten.view.default, aten.reshape.default, aten._unsafe_view.default)
    inner = view.args[0]
    if is_call(inner, aten.clone.default):
        t.seen.add(inner)
        inner = inner.args[0]
    expand = t.take(inner, aten.expand.default)
    unsqueeze = t.take(expand.args[0], aten.unsqueeze.default)
    if unsqueeze.args[1] != 1 or fake_value(expand).shape[1] != k:
        raise Refusal("the GEMM rows are not each token repeated k times")
    return unsqueeze.args[0]


# ---------------------------------------------------------------------------------------------------------------
# Structure: grouped mm

def _match_grouped_mm(out: torch.fx.Node) -> _Match:
    """out = the combine's aten.sum over the slots (transformers' grouped_mm experts)."""
    t = _Tracker()
    grouped = _grouped_mm_targets()
    unpermuted, k = _token_sum(t, out)
    unperm = t.take(unpermuted, aten.index.Tensor)
    inverse = t.take(unperm.args[1][0], aten.index_put.default)
    t.take(inverse.args[0], aten.empty.memory_format)
    perm = inverse.args[1][0]
    iota = t.take(inverse.args[2], prims.iota.default)
    if iota.kwargs.get("start", 0) != 0 or iota.kwargs.get("step", 1) != 1 or _arg(inverse, 3, "accumulate", False):
        raise Refusal("the un-sorting is not the inverse permutation")
    weighted = unperm.args[0]
    for y, w in _operands(t, weighted, aten.mul.Tensor):
        if is_call(w, aten.unsqueeze.default):
            t.seen.add(w)
            w_sorted = t.take(w.args[0], aten.index.Tensor)
            break
    else:
        raise Refusal("the expert outputs are not multiplied by the routing weights")
    if w_sorted.args[1][0] is not perm:
        raise Refusal("routing weights permuted differently from the tokens")
    topk_weights = t.take(w_sorted.args[0], aten.view.default, aten.reshape.default).args[0]
    # Routing: perm and sorted ids from one sort of the flattened ids; offsets = cumsum(histc(sorted ids)).
    t.take(perm, operator.getitem)
    sort = t.take(perm.args[0], aten.sort.default, aten.sort.stable)
    sorted_ids = next((u for u in sort.users if is_call(u, operator.getitem) and u.args[1] == 0), None)
    if sorted_ids is None or perm.args[1] != 1 or _arg(sort, 2, "descending", False):
        raise Refusal("the grouping permutation is not an ascending sort of the expert ids")
    t.seen.add(sorted_ids)
    masks: list = []
    y, b2, b2_ids = _biased(t, _sentinel_unmasked(t, y, masks))
    a, w2_op, offsets = _grouped_operands(t, y, grouped)
    gu = _up_gu(t, a)
    gu_value, b13, b13_ids = _biased(t, _sentinel_unmasked(t, gu, masks))
    rows, w13_op, offsets_up = _grouped_operands(t, gu_value, grouped)
    rows = _sentinel_unmasked(t, rows, masks)
    if offsets_up is not offsets:
        raise Refusal("the two grouped GEMMs use different group offsets")
    activation = read_activation(a, gu, t.seen)
    topk_ids = t.take(sort.args[0], aten.view.default, aten.reshape.default).args[0]
    w13 = _grouped_weight(t, w13_op, "gate_up")
    w2 = _grouped_weight(t, w2_op, "down")
    experts = fake_value(w13).shape[0]
    bias_ids = [b_ids for b, b_ids in ((b2, b2_ids), (b13, b13_ids)) if b is not None]
    _check_sentinels_impossible(t, masks, bias_ids, sorted_ids, topk_ids, experts)
    cumsum = t.take(offsets, aten.cumsum.default)
    if cumsum.args[1] not in (0, -1):
        raise Refusal("the group offsets are not a cumulative sum over experts")
    histc = t.take(cumsum.args[0], aten.histc.default)
    if (t.strip_casts(histc.args[0]) is not sorted_ids
            or [_arg(histc, 1, "bins", 100), _arg(histc, 2, "min", 0), _arg(histc, 3, "max", 0)] != [experts, 0,
                                                                                                   experts - 1]):
        raise Refusal("the group offsets are not a histogram of the sorted expert ids over all experts")
    source = t.take(rows, aten.index.Tensor)
    row_ids = t.take(source.args[1][0], aten.div.Tensor_mode)
    if row_ids.args[0] is not perm or row_ids.args[1] != k or row_ids.kwargs.get("rounding_mode") != "floor":
        raise Refusal("the grouped rows are not the tokens of the sorted (token, slot) pairs")
    return _Match(source.args[0], topk_ids, topk_weights, w13, w2, b13, b2, activation, out, t.seen, k)


def _grouped_operands(t: _Tracker, node, grouped) -> tuple:
    """A grouped GEMM without bias or output dtype: (rows, weight operand, offsets)."""
    mm = t.take(t.strip_casts(node), *grouped)
    rows, weight = mm.args[:2]
    offsets = _arg(mm, 2, "offs")
    if _arg(mm, 3, "bias") is not None or _arg(mm, 4, "out_dtype") is not None or offsets is None:
        raise Refusal("a grouped GEMM with a bias, an output dtype or no offsets")
    return rows, weight, offsets


def _grouped_weight(t: _Tracker, node, what: str) -> torch.fx.Node:
    """The dequantize node under the grouped GEMM's [E, in, out] weight operand."""
    return _dequantized(t, _untransposed(t, node, what), what)


# ---------------------------------------------------------------------------------------------------------------
# Anchors and the rewrite

def _anchors(graph: torch.fx.Graph):
    """(spelling, node) for each candidate MoE combine, in graph order."""
    grouped = _grouped_mm_targets()
    for node in graph.nodes:
        if _accumulation(node) is not None and not any(_accumulation(u) is not None and u.args[0] is node
                                                       for u in node.users):
            yield _match_per_expert_loop, node
        elif is_call(node, aten.sum.dim_IntList):
            source = node.args[0]
            feeding = _feeding_ops(source, depth=6)
            if any(is_call(n, *grouped) for n in feeding):
                yield _match_grouped_mm, node
            elif any(is_call(n, aten.bmm.default) and any(_is_expert_gather(a) for a in n.args[:2])
                     for n in feeding):
                yield _match_gathered_bmm, node


def _is_expert_gather(node) -> bool:
    """index(W [E, N, K], [ids]): per-row expert weights."""
    return (is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and fake_value(node.args[0]) is not None
            and fake_value(node.args[0]).dim() == 3)


def _feeding_ops(node, depth: int) -> list:
    """Nodes up to `depth` steps above node (to tell which spelling a combine belongs to)."""
    found, frontier = [], [node]
    for _ in range(depth):
        frontier = [a for n in frontier if isinstance(n, torch.fx.Node) for a in n.all_input_nodes]
        found.extend(frontier)
    return found


def _ancestors(nodes) -> set:
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _check_region(match: _Match) -> set:
    """The nodes the op replaces: ancestors of the output that are not ancestors of the op's inputs. Each must have
    been accounted for by the matcher, and none may be used outside the region."""
    inputs = [n for n in (match.x, match.topk_ids, match.topk_weights, match.b13, match.b2, *match.w13.args[:2],
                          *match.w2.args[:2]) if n is not None]
    region = _ancestors([match.out]) - _ancestors(inputs)
    region = {n for n in region if n.op == "call_function"}
    # Size arithmetic (SymInt values) computes no tensor; the views it sizes are matched.
    unaccounted = sorted((n for n in region if n not in match.seen and not isinstance(fake_value(n), torch.SymInt)),
                         key=lambda n: n.name)
    if unaccounted:
        raise Refusal(f"the layer computes something the fused op would not: {unaccounted[0].format_node()}")
    for node in region - {match.out}:
        if isinstance(fake_value(node), torch.SymInt):
            continue  # a size shared with other layers stays (the rewrite erases only what lost every user)
        outside = [u for u in node.users if u not in region and not _is_runtime_check(u)]
        if outside:
            what = "a dequantized weight" if node.target is _DEQUANTIZE else f"intermediate {node.name}"
            raise Refusal(f"{what} has a use outside the MoE layer ({outside[0].format_node()})")
    return region


def _is_runtime_check(node: torch.fx.Node) -> bool:
    """Size bookkeeping that capture adds after data-dependent ops (sym_size, comparisons, _assert_scalar)."""
    return node.op == "call_function" and (
        node.target in (aten.sym_size.int, aten._assert_scalar.default)
        or not isinstance(node.target, torch._ops.OpOverload) and node.target is not operator.getitem)


def _check_types(match: _Match, k: int | None) -> None:
    """The operands fit the op (its own argument check), the top-k width is the one the combine sums over, and
    the weights are dequantized to the activations' dtype."""
    x_val = fake_value(match.x)
    try:
        check_mxfp4_moe_args(x_val, fake_value(match.topk_ids), fake_value(match.topk_weights), *(
            fake_value(n) for n in (*match.w13.args[:2], match.b13, *match.w2.args[:2], match.b2)),
            match.activation[0])
    except ValueError as mismatch:
        raise Refusal(str(mismatch)) from None
    if k is not None and fake_value(match.topk_ids).shape[1] != k:
        raise Refusal(f"the combine sums over {k} slots but the top-k ids have {fake_value(match.topk_ids).shape[1]}")
    for name, node in (("gate_up", match.w13), ("down", match.w2)):
        if node.args[2] != x_val.dtype:
            raise Refusal(f"the {name} weights are dequantized to {node.args[2]} while the activations are "
                           f"{x_val.dtype}")
    if fake_value(match.out).dtype != x_val.dtype or tuple(fake_value(match.out).shape) != tuple(x_val.shape):
        raise Refusal("the layer's output differs from its input in dtype or shape")
    if fake_value(match.topk_ids).dtype not in (torch.int32, torch.int64):
        raise Refusal(f"topk ids are {fake_value(match.topk_ids).dtype}")


def _through_output_cast(match: _Match) -> None:
    """An fp32 combine of 16-bit activations (routers that return fp32 top-k weights: the weighted sum is fp32)
    whose only use is a cast back to the activations' dtype: the op's output is that cast. The op sums in fp32 and
    rounds once at its output (dzc/ops/mxfp4_moe.py), as this spelling does."""
    x_dtype = fake_value(match.x).dtype
    if fake_value(match.out).dtype != torch.float32 or x_dtype == torch.float32 or len(match.out.users) != 1:
        return
    [user] = match.out.users
    if cast_dtype(user) == x_dtype:
        match.seen.update((match.out, user))
        match.out = user


def _rewrite(graph: torch.fx.Graph, match: _Match, region: set) -> None:
    name, interleaved, alpha, limit = match.activation
    with graph.inserting_before(match.out):
        fused = graph.call_function(_MXFP4_MOE, (
            match.x, match.topk_ids, match.topk_weights, match.w13.args[0], match.w13.args[1], match.b13,
            match.w2.args[0], match.w2.args[1], match.b2, name, interleaved, alpha, limit))
    fused.meta["val"] = fake_value(match.out)
    fused.meta["stack_trace"] = match.out.meta.get("stack_trace")
    match.out.replace_all_uses_with(fused)
    # Remove the region bottom-up, and the runtime size checks that only guarded its data-dependent sizes.
    order = {node: i for i, node in enumerate(graph.nodes)}
    removable = set(region)
    for node in graph.nodes:
        if _is_runtime_check(node) and node.all_input_nodes and all(a in removable for a in node.all_input_nodes):
            removable.add(node)
    for node in sorted(removable, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def fuse_mxfp4_experts(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every MXFP4 MoE experts computation into dzc.mxfp4_moe; returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for matcher, node in list(_anchors(graph)):
        if getattr(node, "_erased", False):  # removed by an earlier rewrite
            continue
        try:
            match = matcher(node)
            _through_output_cast(match)
            region = _check_region(match)
            _check_types(match, match.top_k)
        except Refusal as refusal:
            result.refused(location_of(node), str(refusal))
            continue
        where = location_of(node)
        _rewrite(graph, match, region)
        result.rewrote(where)
    # MXFP4 weights that no pattern consumed stay dequantized in full: say so, even where no anchor matched (an
    # expert loop spelled in a way this pass does not know).
    for node in graph.nodes:
        if is_call(node, _DEQUANTIZE):
            result.refused(location_of(node), "an MXFP4 weight stays dequantized: no recognised MoE expert "
                                              "computation consumes it")
    return result
