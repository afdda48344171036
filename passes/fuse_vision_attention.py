"""fuse_vision_attention: attention over packed images, however upstream spells it  =>  one dzc.varlen_attention

A vision encoder packs the patches of all images of a request into one sequence; attention is non-causal and
restricted to each image (or to windows inside it), delimited by `cu_seqlens`. Spellings this pass recognises
(each with `F.scaled_dot_product_attention` — decomposed to math on CPU, a fused SDPA op on GPUs — or eager
matmul/softmax/matmul, in any dtype; each attention read by attention_patterns.read_attention):

1. Per-image loop (transformers' Qwen2/2.5-VL, GLM-4V non-flash path), which Dynamo unrolls once scalar outputs
   are captured; a walker (below), as a pattern cannot say "one attention per piece of a split":

    %d = aten.sub.Tensor(aten.slice(%cu, 0, 1, end), aten.slice(%cu, 0, 0, -1))   # lengths
    %u_i = aten._local_scalar_dense.default(aten.select.int(%d, 0, i))            # lengths.tolist()
    %qs = aten.split_with_sizes.default(%q, [%u_0, ..., %u_B-1], dim)             # same for k, v
    %o_i = <attention(%qs[i], %ks[i], %vs[i]) for i < B>                           # no mask, not causal
    %o = aten.cat.default([layout(%o_0), ..., layout(%o_B-1)], dim)

2. Attention over the whole pack whose mask terms (attention_patterns' mask reader) are exactly {segment}: the
   block-diagonal mask built from cu_seqlens by segment ids,

    %seg = aten.searchsorted.Tensor(%cu, aten.arange(tokens), right=True)
    %m = aten.eq.Tensor(unsqueeze(%seg, 1), unsqueeze(%seg, 0))                   # bool [tokens, tokens]
                                                                                   # (or the sides swapped)
    %o = <attention(%q, %k, %v) with %m as additive (where(%m, 0, -inf)) or masked_fill(~%m, -inf) mask>

   in every spelling the reader knows (bool keep/drop masks, where, masked_fill, additive, padded by SDPA for its
   GPU kernel) and where(%m, s, -inf). The masked value may be finfo(dtype).min instead of -inf (HF's masks:
   where(%m, 0, finfo.min), masked_fill(~%m, finfo.min), where(%m, s, finfo.min)): anything at or below
   attention_patterns.MASKED counts as masked. Exact because no query row is fully masked: %m is [tokens, tokens]
   (checked, and so is every node carrying it to the scores: no select or broadcast moves an entry) of one %seg
   compared with itself, so query i always sees key i, the row's max is a visible score, and exp(masked - max)
   underflows to 0 as with -inf (unless scores reach ~65000 in magnitude, fp16's finfo.min: the bound every
   attention pass takes). A fully masked row would differ (finfo.min: uniform; -inf: NaN, or 0 through SDPA; the
   op: 0), and cannot occur here.

3. dzc.varlen_attention already in the graph (HF models entered through dzc's AttentionInterface function,
   dzc.hf_attention, or code calling the op): only the rotary fold below applies.

Window attention is the same spellings with `cu_window_seqlens` in place of cu_seqlens.

After:

    %o = dzc.varlen_attention.default(%q', %k', %v', %cu, %max_seqlen, scale, %cos, %sin)  # [tokens, heads, dim]
    (+ permute/unsqueeze/clone back to the layout the old output had)

where %q' is %q brought to [tokens, heads, head_dim], max_seqlen is sym_max of the unrolled lengths (spelling 1)
or computed in the graph from cu_seqlens (spelling 2) as max(%cu - %cu[clamp_min(iota(len(%cu), start=-1), 0)]):
tensors of len(%cu) elements only, which add no guard on the segment count (see _max_seqlen). Rotary fold (rotary_patterns.fold_rotary, which says why
it is exact): when q and k are both HF's vision rotary embedding — `(x.float() * cos + rotate_half(x.float()) *
sin).to(x.dtype)` with the same fp32 cos/sin [tokens, head_dim] — the op takes the unrotated q, k and cos, sin,
and applies the rotation as it loads q and k. The interleaved (pairwise) rotary, rot = stack((-x[..., 1::2],
x[..., ::2]), -1).flatten(-2), rotates pairs (2i, 2i+1) where the op rotates (i, i + d/2):

    %r = (x * cos + rot(x) * sin).to(dtype)  for q and k, same cos, sin
  =>
    %x' = aten.cat.default([aten.slice(%x, -1, 0, end, 2), aten.slice(%x, -1, 1, end, 2)], -1)  # q, k, cos, sin
    dzc.varlen_attention.default(%q', %k', %v, ..., %cos', %sin')

Refusals (reported): causal or dropout attention over a split; a split whose pieces are not all attended in order
and concatenated along the token dim in the same order; an intermediate of an attention with a use outside it;
a layout the pass cannot map to [tokens, heads, head_dim]; a block-diagonal mask not [tokens, tokens] over the
attended tokens. Silently skipped (not packed attention): attention without a split by cu_seqlens lengths or a
mask of exactly the segment term — a causal text attention, a plain ViT attention over one image, a segment mask
joined with other terms — or with a bias above MASKED (-1e4: hidden keys keep some weight). Not folded (the op
gets the model's rotated q, k): rotaries of other spellings, or q and k rotated by different spellings or tables.

Ordering: after fuse_residual_norm (independent patterns; the norm pass never touches attention), before
lowering. It needs Dynamo's capture_scalar_outputs (dzc's default) for spelling 1 to be one graph at all.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

from dzc.passes.attention_patterns import SDPA_OPS, WHOLE, AttentionCore, new_node, read_attention, same
from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of
from dzc.passes.patterns import cast_dtype, remove_dead
from dzc.passes.rotary_patterns import fold_rotary

aten = torch.ops.aten
prims = torch.ops.prims
dzc = torch.ops.dzc

NAME = "fuse_vision_attention"


# --- one attention: attention_patterns' reader, through SDPA's fp32 compute on 16-bit q, k, v ------------------

def _read_core(node) -> AttentionCore | None:
    """read_attention, and for the math spelling: q.float(), k.float(), v.float() read as the 16-bit q, k, v (SDPA's
    CPU decomposition computes in fp32) and the result's one cast back to q's dtype as the output; None when the
    result stays in another dtype than q's (the op could not produce it)."""
    core = read_attention(node)
    if core is None or is_call(node, *SDPA_OPS):
        return core
    q, k, v = (_skip_upcast(n) for n in (core.q, core.k, core.v))
    out = core.out
    if len(out.users) == 1 and cast_dtype(next(iter(out.users))) == fake_value(q).dtype != fake_value(out).dtype:
        out = next(iter(out.users))
    if fake_value(out).dtype != fake_value(q).dtype:
        return None
    return replace(core, q=q, k=k, v=v, out=out, anchor=out)


def _skip_upcast(node):
    """x for x.float() with x in a 16-bit float dtype, else node."""
    if cast_dtype(node) == torch.float32 and fake_value(node.args[0]).dtype in (torch.float16, torch.bfloat16):
        return node.args[0]
    return node


# --- layouts: which dim of a tensor holds tokens (T), heads (H), head_dim (D), or a unit batch (1) ---------------

def _labels(shape, heads) -> list[str] | None:
    """Labels of an attention operand [..., tokens, head_dim] whose leading dims multiply to `heads`."""
    labels = []
    for size in shape[:-2]:
        if same(size, 1):
            labels.append("1")
        elif same(size, heads) and "H" not in labels:
            labels.append("H")
        else:
            return None
    if "H" not in labels:
        if not labels or not same(heads, 1):
            return None
        labels[-1] = "H"  # one head: the unit dim right before the tokens
    return labels + ["T", "D"]


def _forward_labels(node, labels):
    """Labels after one layout op applied to a tensor with `labels`; None if the op is not a pure layout change."""
    if is_call(node, aten.clone.default, aten.alias.default) or cast_dtype(node) is not None:
        return labels
    if is_call(node, aten.permute.default):
        return [labels[d % len(labels)] for d in node.args[1]]
    if is_call(node, aten.transpose.int):
        a, b = (d % len(labels) for d in node.args[1:3])
        labels = list(labels)
        labels[a], labels[b] = labels[b], labels[a]
        return labels
    if is_call(node, aten.unsqueeze.default):
        labels = list(labels)
        labels.insert(node.args[1] % (len(labels) + 1), "1")
        return labels
    if is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.squeeze.default):
        # Only inserting or removing unit dims keeps the labels meaningful.
        source = [(label, size) for label, size in zip(labels, fake_value(node.args[0]).shape)
                  if not same(size, 1)]
        shape = fake_value(node).shape
        target = [size for size in shape if not same(size, 1)]
        if len(source) != len(target) or not all(same(a[1], b) for a, b in zip(source, target)):
            return None
        kept = iter(label for label, _ in source)
        out = ["1" if same(size, 1) else next(kept) for size in shape]
        return out if {"H", "T", "D"} <= set(out) else None
    return None


def _to_thd(graph, node, labels):
    """node (with labels) -> a [tokens, heads, head_dim] node."""
    unit_dims = [d for d, label in enumerate(labels) if label == "1"]
    if unit_dims:
        node = new_node(graph, aten.squeeze.dims, (node, unit_dims))
        labels = [label for label in labels if label != "1"]
    order = [labels.index(role) for role in "THD"]
    if order == [0, 1, 2]:
        return node
    if is_call(node, aten.permute.default) and [node.args[1][o] % 3 for o in order] == [0, 1, 2]:
        return node.args[0]  # undoes the model's own permute: take what it permuted
    return new_node(graph, aten.permute.default, (node, order))


def _from_thd(graph, node, labels):
    """A [tokens, heads, head_dim] node -> a contiguous tensor laid out by labels (the replaced output's layout)."""
    roles = [label for label in labels if label != "1"]
    order = ["THD".index(role) for role in roles]
    if order != [0, 1, 2]:
        node = new_node(graph, aten.permute.default, (node, order))
        node = new_node(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    for d, label in enumerate(labels):
        if label == "1":
            node = new_node(graph, aten.unsqueeze.default, (node, d))
    return node


# --- the packed attention both spellings find, and the walks they share -------------------------------------

@dataclass
class _Packed:
    cores: list[AttentionCore]
    cu: torch.fx.Node
    q: torch.fx.Node  # the whole pack's q, k, v (the split inputs, or the masked attention's operands)
    k: torch.fx.Node
    v: torch.fx.Node
    out: torch.fx.Node  # replaced by the fused op's result
    out_labels: list[str]
    operand_labels: list[list[str]]  # labels of q, k, v
    heads: int
    max_seqlen: list[torch.fx.Node] | None  # the unrolled lengths (spelling 1), or None (computed from cu)
    region: set[torch.fx.Node] = field(default_factory=set)  # replaced: erased once the fused op stands
    leftovers: set[torch.fx.Node] = field(default_factory=set)  # may serve others: erased only when unused


def _heads_of(core: AttentionCore):
    shape = fake_value(core.q).shape
    lead = [s for s in shape[:-2] if not same(s, 1)]
    if len(lead) > 1:
        return None
    return lead[0] if lead else 1


def _region(out, stops) -> set[torch.fx.Node]:
    """Every node between stops and out (out included), walking arguments back from out."""
    seen, todo = set(), [out]
    while todo:
        node = todo.pop()
        if node in seen or node in stops or node.op != "call_function":
            continue
        if not isinstance(fake_value(node), (torch.Tensor, tuple, list)):
            continue  # sizes (SymInts) stay: the rest of the graph may use them
        seen.add(node)
        todo.extend(n for n in node.all_input_nodes)
    return seen


def _check_closed(region, keep, what):
    """Every node of the region but `keep` is used only inside it."""
    for node in region:
        if node in keep:
            continue
        outside = [u for u in node.users if u not in region]
        if outside:
            raise Refusal(f"{node.name} inside the {what} has a use outside it ({outside[0].name})")


def _operand_labels(core: AttentionCore, heads):
    labels = [_labels(fake_value(n).shape, heads) for n in (core.q, core.k, core.v)]
    if any(label is None for label in labels):
        raise Refusal("q, k, v are not laid out as [heads, tokens, head_dim] with unit batch dims")
    return labels


# --- spelling 1: the per-image split loop, a walker (a pattern cannot say "one attention per piece") -------------

def _lengths_source(sizes) -> torch.fx.Node | None:
    """cu_seqlens if sizes are [_local_scalar_dense(select((cu[1:] - cu[:-1]), 0, i)) for i < len(cu) - 1]."""
    diffs = set()
    for index, size in enumerate(sizes):
        if not is_call(size, aten._local_scalar_dense.default):
            return None
        select = size.args[0]
        if not is_call(select, aten.select.int) or tuple(select.args[1:]) != (0, index):
            return None
        diffs.add(select.args[0])
    if len(diffs) != 1:
        return None
    diff = diffs.pop()
    if not is_call(diff, aten.sub.Tensor):
        return None
    upper, lower = diff.args[:2]
    if not (is_call(upper, aten.slice.Tensor) and is_call(lower, aten.slice.Tensor)):
        return None
    cu = upper.args[0]
    if lower.args[0] is not cu or tuple(upper.args[1:4]) != (0, 1, WHOLE) or tuple(lower.args[1:4]) != (0, 0, -1):
        return None
    if not same(fake_value(cu).shape[0] - 1, len(sizes)) or fake_value(cu).dtype != torch.int32:
        return None
    return cu


def _match_split(core: AttentionCore, by_q: dict) -> _Packed | None:
    """Spelling 1: core is one image's attention of an unrolled per-image loop; collects all of them."""
    pieces = []
    for operand in (core.q, core.k, core.v):
        if not (is_call(operand, operator.getitem) and is_call(operand.args[0], aten.split_with_sizes.default)):
            return None
        pieces.append(operand)
    splits = [p.args[0] for p in pieces]
    cu = _lengths_source(splits[0].args[1])
    if cu is None:
        return None
    for split in splits[1:]:
        if list(split.args[1]) != list(splits[0].args[1]):
            raise Refusal("q, k and v are split by different lengths")
    count = len(splits[0].args[1])
    per_image = {}
    for item in splits[0].users:
        if not is_call(item, operator.getitem):
            raise Refusal("the split q is used whole")
        if item in by_q:
            per_image[item.args[1]] = by_q[item]
    if sorted(per_image) != list(range(count)):
        raise Refusal("not every image of the split is attended")
    cores = [per_image[i] for i in range(count)]
    for i, c in enumerate(cores):
        for operand, split in zip((c.q, c.k, c.v), splits):
            if not (is_call(operand, operator.getitem) and operand.args[0] is split and operand.args[1] == i):
                raise Refusal("image i's q, k, v are not the i-th pieces of their splits")
        if c.causal or c.dropout or c.masks:
            raise Refusal("causal, masked or dropout attention inside an image")
        if c.scale != core.scale:
            raise Refusal("the images are attended with different scales")
    heads = _heads_of(core)
    if heads is None:
        raise Refusal("more than one non-unit dim before the tokens")
    operand_labels = _operand_labels(core, heads)
    for split, labels in zip(splits, operand_labels):
        if labels[split.args[2] % len(labels)] != "T":
            raise Refusal("the split is not along the token dim")
    # Follow each image's output through layout ops to one cat along the token dim.
    cat, out_labels, chain = None, None, set()
    for c in cores:
        node, labels = c.out, _labels(fake_value(c.out).shape, heads)
        if labels is None:
            raise Refusal("an image's attention output is not [heads, tokens, head_dim]")
        while len(node.users) == 1 and not is_call(next(iter(node.users)), aten.cat.default):
            user = next(iter(node.users))
            labels = _forward_labels(user, labels)
            if labels is None:
                raise Refusal(f"{user.name} between an image's attention and the cat is not a layout op")
            chain.add(user)
            node = user
        users = list(node.users)
        if len(users) != 1 or not is_call(users[0], aten.cat.default):
            raise Refusal("an image's attention output is not concatenated (alone) with the others")
        if cat is not None and users[0] is not cat:
            raise Refusal("the images' outputs go to different cats")
        cat = users[0]
        if out_labels is not None and labels != out_labels:
            raise Refusal("the images' outputs are laid out differently")
        out_labels = labels
    inputs = list(cat.args[0])
    if len(inputs) != count or (cat.args[1] if len(cat.args) > 1 else 0) % len(out_labels) != out_labels.index("T"):
        raise Refusal("the cat is not exactly the images' outputs along the token dim")
    for i, (c, item) in enumerate(zip(cores, inputs)):
        # inputs[i] must come from core i (follow back through the chain)
        node = item
        while node is not c.out and node in chain:
            node = node.args[0]
        if node is not c.out:
            raise Refusal("the cat does not keep the images in order")
    stops = {p for c in cores for p in (c.q, c.k, c.v)}
    region = set(chain) | {cat}
    for c in cores:
        region |= _region(c.out, stops)
    region |= {p for c in cores for p in (c.q, c.k, c.v)} | set(splits)
    _check_closed(region, {cat}, "per-image attention")
    return _Packed(cores, cu, *(s.args[0] for s in splits), cat, out_labels, operand_labels, heads,
                   list(splits[0].args[1]), region)


# --- spelling 2: attention whose mask terms are exactly {segment} ------------------------------------------------

def _match_masked(core: AttentionCore) -> _Packed | None:
    """Spelling 2: one attention over the pack whose mask terms are exactly {segment}."""
    if not core.masks or core.terms is None or [term[0] for term in core.terms] != ["segment"]:
        return None
    (_, cu, mask), = core.terms
    if fake_value(cu).dtype != torch.int32:
        return None  # the op's cu_seqlens are int32
    if core.causal or core.dropout:
        raise Refusal("causal or dropout attention with a block-diagonal mask")
    # [tokens, tokens] over q's and k's tokens, as the attention reads it too: then query i sees key i (every row
    # sees a key, which masking by finfo.min needs to be exact) and the mask's segments are the op's.
    tokens = (fake_value(core.q).shape[-2], fake_value(core.k).shape[-2])
    for node in (mask, *core.masks):
        if not _tokens_by_tokens(node, tokens):
            raise Refusal("the block-diagonal mask is not [tokens, tokens] over the attended tokens")
    if not _keeps_entries(mask, core.masks, cu, tokens):
        raise Refusal("the block-diagonal mask is not [tokens, tokens] over the attended tokens")
    heads = _heads_of(core)
    if heads is None:
        raise Refusal("more than one non-unit dim before the tokens")
    operand_labels = _operand_labels(core, heads)
    out_labels = _labels(fake_value(core.out).shape, heads)
    if out_labels is None:
        raise Refusal("the attention output is not [heads, tokens, head_dim]")
    # The mask may be built once and shared by every layer: it is not part of the attention, and is removed
    # only once no attention uses it.
    region = _region(core.out, {core.q, core.k, core.v, *core.masks})
    _check_closed(region, {core.out}, "masked attention")
    packed = _Packed([core], cu, core.q, core.k, core.v, core.out, out_labels, operand_labels, heads, None, region)
    packed.leftovers = set().union(*(_region(node, {cu}) for node in core.masks))
    return packed


def _tokens_by_tokens(node, tokens) -> bool:
    shape = fake_value(node).shape
    return len(shape) >= 2 and all(same(a, b) for a, b in zip(shape[-2:], tokens))


def _keeps_entries(mask, masks, cu, tokens) -> bool:
    """Every node carrying the [tokens, tokens] segment mask to the attention's mask operands is [.., tokens,
    tokens] too, but SDPA's padding of a bias that it slices back (the reader checked the slice): no select of a
    row or broadcast of one moved a (query, key) entry, which the mask reader's views and selects would allow."""
    carries = {mask: True, cu: False}

    def carried(node):
        if node not in carries:
            carries[node] = any(carried(n) for n in node.all_input_nodes)
        return carries[node]

    for node in masks:
        carried(node)
    return all(node is mask or is_call(node, aten.constant_pad_nd.default) or _tokens_by_tokens(node, tokens)
               for node, hit in carries.items() if hit)


# --- the rewrite --------------------------------------------------------------------------------------------------

def _max_seqlen(graph, packed: _Packed):
    """The longest segment: sym_max of the unrolled lengths, or read from cu_seqlens in the graph."""
    if packed.max_seqlen is not None:
        longest = packed.max_seqlen[0]
        for length in packed.max_seqlen[1:]:
            node = graph.call_function(torch.sym_max, (longest, length))
            node.meta["val"] = torch.sym_max(fake_value(longest), fake_value(length))
            longest = node
        return longest
    # lengths[i] = cu[i] - cu[max(i - 1, 0)] (lengths[0] = 0), all of cu's size: no tensor of size len(cu) - 1,
    # whose fake propagation (Inductor runs it again, guards not suppressed) asks whether that size is 0 or 1
    # and so specialised the graph on packs of more than one segment: a pack of one recompiled (session 44).
    cu = packed.cu
    shape_env = fake_value(cu).fake_mode.shape_env
    size = graph.call_function(aten.sym_size.int, (cu, 0))
    size.meta["val"] = fake_value(cu).shape[0]
    iota = dict(start=-1, step=1, dtype=torch.int64, device=fake_value(cu).device, requires_grad=False)
    positions = graph.call_function(prims.iota.default, (size,), iota)  # -1, 0, ..., len(cu) - 2
    with fake_value(cu).fake_mode, shape_env.suppress_guards():
        positions.meta["val"] = prims.iota.default(size.meta["val"], **iota)
    previous = new_node(graph, aten.clamp_min.default, (positions, 0))
    lengths = new_node(graph, aten.sub.Tensor, (cu, new_node(graph, aten.index.Tensor, (cu, [previous]))))
    longest = new_node(graph, aten.max.default, (lengths,))
    node = graph.call_function(aten._local_scalar_dense.default, (longest,))
    with fake_value(cu).fake_mode, shape_env.suppress_guards():
        node.meta["val"] = aten._local_scalar_dense.default(fake_value(longest))
    bindings = compute_unbacked_bindings(shape_env, node.meta["val"])
    if bindings:
        node.meta["unbacked_bindings"] = bindings
    return node


def _rewrite(graph, packed: _Packed) -> torch.fx.Node:
    first = min(packed.region, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        operands = [_to_thd(graph, node, labels) for node, labels in zip((packed.q, packed.k, packed.v),
                                                                          packed.operand_labels)]
        max_seqlen = _max_seqlen(graph, packed)
    with graph.inserting_before(packed.out):
        fused = new_node(graph, dzc.varlen_attention.default,
                      (*operands, packed.cu, max_seqlen, packed.cores[0].scale, None, None))
        fused.meta["stack_trace"] = packed.cores[0].anchor.meta.get("stack_trace")
        result = _from_thd(graph, fused, packed.out_labels)
    packed.out.replace_all_uses_with(result)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(packed.region, key=order.__getitem__, reverse=True):  # users before what they use
        if not node.users:
            graph.erase_node(node)
    # The model's own re-layouts of q, k, v (which the op no longer reads) and the mask, once nothing uses them.
    remove_dead(set(packed.leftovers) | {packed.q, packed.k, packed.v})
    return fused


def fuse_vision_attention(graph: torch.fx.Graph) -> PassResult:
    """Rewrite attention over packed images into dzc.varlen_attention; returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    existing = [n for n in graph.nodes if is_call(n, dzc.varlen_attention.default)]
    cores = [core for core in map(_read_core, list(graph.nodes)) if core is not None]
    by_q = {core.q: core for core in cores}
    done: set[int] = set()
    fused_ops = []
    for core in cores:
        if id(core) in done:
            continue
        try:
            packed = _match_split(core, by_q) or _match_masked(core)
        except Refusal as refusal:
            result.refused(location_of(core.anchor), str(refusal))
            done.add(id(core))
            continue
        if packed is None:
            continue
        done.update(id(c) for c in packed.cores)
        where = location_of(packed.cores[0].anchor)
        fused_ops.append(_rewrite(graph, packed))
        result.rewrote(where)
    # The rotary fold: on the ops just made, and on ops already in the graph (dzc's HF attention function, model
    # code calling the op), where it is the whole rewrite.
    for op in fused_ops + existing:
        old_q, old_k = op.args[:2]
        if not fold_rotary(graph, op):
            continue
        if op in existing:
            result.rewrote(f"{location_of(op)} (rotary folded)")
        remove_dead(_region(old_q, set(op.all_input_nodes)) | _region(old_k, set(op.all_input_nodes)))
    return result
