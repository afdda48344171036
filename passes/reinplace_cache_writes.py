"""Re-inplace cache writes: a model's in-place write into a graph input (a KV cache), functionalized by capture,
becomes an in-place write again, and the copy of the whole input that functionalization added disappears.

A model writes its paged KV cache in place: `cache.view(-1, d)[slots] = rows` (dzc.models.dsa), or through views
of one byte pool (dzc.kv_cache.write_index_keys, FP8 layout: a page's e4m3 values and fp32 scales are two slices
of a uint8 pool, written as bytes). AOTAutograd functionalizes every such write into an out-of-place op that
returns a whole new cache value, and (keep_inference_input_mutations, dzc/capture.py) keeps the mutation in the
graph as one `copy_` of the final value into the input, at the end. Per step that is a copy of the whole cache
to append a few rows. This pass turns the chain of functional writes back into in-place ones and drops the copy:

    %v = aten.view(%cache, [-1, d])
    %w = aten.index_put(%v, [%slots], %rows)             # a new cache-sized tensor
    %n = aten.view(%w, [pages, 64, 1, d])
    ... reads of %n (the written cache) ...
    %c = aten.copy_(%cache, %n)                           # the whole cache copied back
  ⇒
    %v = aten.view(%cache, [-1, d])
    %w = aten.index_put_(%v, [%slots], %rows)            # writes the new rows only
    %n = aten.view(%w, [pages, 64, 1, d])                 # a view of %cache
    ... the same reads ...

Writes into a region of the input come back through view-scatter ops, which become no-ops once the write went to
the region itself (the FP8 layout: a slice of the uint8 pool, viewed per page, written, scattered back):

    %x = aten.view(aten.slice(%pool, 1, 1024, end), [pages, 64, 4])
    %w = aten.index_put(%x, [%pages, %offsets], %scale_bytes)
    %b = aten.slice_scatter(%pool, aten.view(%w, [pages, 256]), 1, 1024, end)
  ⇒
    %w = aten.index_put_(%x, [%pages, %offsets], %scale_bytes)   # into the pool's slice
    (%b's uses read %pool)

Writes: index_put (also what `index_copy_` and `cache[idx] = x` capture as), scatter (src and value), copy (a
slice or select assignment `cache[:, a:b] = x`) → their in-place overloads; view scatters: slice_scatter,
select_scatter (dropped). Each input is rewritten whole or not at all.

Alias analysis. After the rewrite, every value derived from the input by views, writes and view-scatters ("the
cache's family") is memory of the input; its layout is recomputed from the input's fake tensor by replaying the
view ops, so strides, offsets and dtype views are the real ones, and a view that the in-place form cannot take
refuses. Each family value has a version (how many writes its contents include); a node that reads a family
value (anything but a view, a write through it, or a size query) must run when that version is the latest:
reading the cache as it was before a later write would see that write after the rewrite.

Refused (recorded, the input keeps its functional writes and the copy):
- a read of the cache as it was before a later write (an op after the write, or a graph output, reading an
  older version);
- two writes from one version of the cache (branching: the first would clobber what the second reads);
- a write whose other operands (indices, values) are views of the cache itself;
- a view-scatter whose source is not the written region itself (a different region, or a value computed from the
  cache), or where a write since the scattered version went outside that region;
- a write through a dtype view that changes the element size (an fp32 view of a uint8 pool): Inductor, the
  fallback on GPUs, lowers such a view of a strided tensor as a copy, so the write would be lost (hence
  dzc.kv_cache writes the FP8 layout's scales as bytes);
- a view the in-place cache cannot take (e.g. a dtype view of a misaligned slice), or a copy-back whose source is
  not the latest version of the cache with the input's own layout (another op computed the new value: `x.add_(1)`);
- another graph input sharing the cache's memory.

PyTorch machinery used: AOTAutograd's keep_inference_input_mutations (the `copy_` in the graph that marks an
input AOTAutograd found mutated, and its runtime wrapper bumping the input's version counter, which
dzc.runtime.CudaGraphRunner reads to never replay a mutating call). Inductor's reinplace pass
(torch._inductor.fx_passes.reinplace) is not used: on the FP8 layout it leaves both index_puts out of place and
copies the pool back (it only follows scatters of scatters, and index_put into a view of an input only where the
copy-back has the same layout), it needs Inductor's virtualized fake mode and a FakeTensorUpdater whose signature
changes between torch releases, and it reports nothing. torch.fx.passes.reinplace targets graphs without the
copy-back of an input.

Ordering: last, after the fusions. They match the functional graph (a write is a value to follow; after
fuse_sparse_attention the dense gather of the written cache is gone and the dzc ops read the cache in place), and
nothing after this pass may move a read across a write. Lowering and the fallback see in-place writes into the
caller's cache.
"""

from __future__ import annotations

import contextlib
import heapq
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.utils._sympy.functions import FloorDiv, Mod

from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of

aten = torch.ops.aten

# Functional write -> its in-place overload; the written tensor is the first argument of both.
_IN_PLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.copy.default: aten.copy_.default,
}
# View-scatter -> the view it writes back (same arguments after the source).
_SCATTERED_VIEW = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
}
# Ops that read a tensor's sizes, not its contents.
_SIZE_QUERIES = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default)


@dataclass
class _Member:
    """A value that is the cache's memory after the rewrite."""

    version: int  # writes included in its contents
    fake: object  # its fake tensor after the rewrite (a list for split-like views)


def _is_view(node: torch.fx.Node) -> bool:
    """Whether node returns an alias of its first argument: by the op's schema, or (ops without the annotation,
    e.g. _unsafe_view) because its captured fake value shares the first argument's storage."""
    target = node.target
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if target is operator.getitem:
        return True  # an element of a view op's list result (split)
    if isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[0] if target._schema.arguments else None
        if first is not None and first.alias_info is not None and not first.alias_info.is_write:
            return True
    value, base = fake_value(node), fake_value(node.args[0])
    return isinstance(value, torch.Tensor) and isinstance(base, torch.Tensor) and _same_storage(value, base)


def _op(node: torch.fx.Node) -> str:
    """'aten.add.Tensor at model.py:12 (forward)' for refusal messages."""
    if node.op == "output":
        return "the graph's output"
    return f"{node.target} at {location_of(node)}"


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _storage_key(a) == _storage_key(b)


def _equal(x, y) -> bool:
    """Whether two sizes are equal whenever the graph runs: provably, or given the divisibility its guards
    establish. A dtype view of a dynamic page, e.g. u8 -> f32 -> u8, has size 4 * (s // 4) where the slice it
    writes back has s, and Dynamo's guard s % 4 == 0 (the view's own requirement) is what makes them equal."""
    if statically_known_true(sym_eq(x, y)):
        return True
    symbolic = [v for v in (x, y) if isinstance(v, torch.SymInt)]
    if not symbolic:
        return False
    shape_env = symbolic[0].node.shape_env
    difference = sympy.expand(sympy.sympify(x.node.expr if isinstance(x, torch.SymInt) else x)
                              - sympy.sympify(y.node.expr if isinstance(y, torch.SymInt) else y))
    exact = {division: division.args[0] / division.args[1] for division in difference.atoms(FloorDiv)
             if shape_env.replace(Mod(*division.args)) in shape_env.divisible}
    return sympy.expand(difference.xreplace(exact)) == 0


def _same_layout(a, b) -> bool:
    """Same memory seen the same way: storage, dtype, sizes, strides, offset."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
        return False
    if not _same_storage(a, b) or a.dim() != b.dim():
        return False
    pairs = [*zip(a.shape, b.shape), *zip(a.stride(), b.stride()), (a.storage_offset(), b.storage_offset())]
    return all(_equal(x, y) for x, y in pairs)


def _tensors(value) -> list:
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]


class _CacheFamily:
    """The analysis of one mutated input: which values become its memory, their versions, and the writes."""

    def __init__(self, cache: torch.fx.Node, copy_back: torch.fx.Node):
        self.cache, self.copy_back = cache, copy_back
        self.cache_fake = fake_value(cache)
        self.members: dict[torch.fx.Node, _Member] = {cache: _Member(0, self.cache_fake)}
        self.writes: list[torch.fx.Node] = []
        self.dropped_scatters: list[torch.fx.Node] = []

    def _replay(self, node: torch.fx.Node, target=None, args=None):
        """node's op (or target with args) on the cache's rewritten fake values: its value after the rewrite."""
        target = target or node.target
        args = node.args if args is None else args

        def fake(arg):
            return self.members[arg].fake if arg in self.members else arg.meta["val"]

        fake_args, fake_kwargs = torch.fx.node.map_arg((args, node.kwargs), fake)
        if target is operator.getitem:
            return fake_args[0][fake_args[1]]
        mode = self.cache_fake.fake_mode
        shape_env = mode.shape_env
        guards = (shape_env.suppress_guards(), shape_env.ignore_fresh_unbacked_symbols()) if shape_env else ()
        with mode, contextlib.ExitStack() as stack:
            for context in guards:
                stack.enter_context(context)
            try:
                return target(*fake_args, **fake_kwargs)
            except RuntimeError as error:  # the in-place cache's strides do not allow this view
                raise Refusal(f"{_op(node)} cannot view the cache in place: {error}") from None

    def _latest(self, arg: torch.fx.Node, reader: torch.fx.Node) -> None:
        version = self.members[arg].version
        if version != len(self.writes):
            stale = self.writes[version]
            raise Refusal(f"{_op(reader)} reads the cache as it was before the "
                          f"write at {location_of(stale)}")

    def _within(self, written: torch.fx.Node, region) -> bool:
        """Whether the memory a write went through lies inside `region`: some value it views (through views,
        writes and view-scatters, which never reach outside what they view) has the region's layout."""
        node = written
        while node in self.members:
            if _same_layout(self.members[node].fake, region):
                return True
            if node is self.cache or is_call(node, aten.as_strided.default):
                return False
            node = node.args[0]
        return False

    def _through_resizing_dtype_view(self, written: torch.fx.Node) -> bool:
        node = written
        while node is not self.cache:
            if is_call(node, aten.view.dtype) and \
                    fake_value(node.args[0]).dtype.itemsize != fake_value(node).dtype.itemsize:
                return True
            node = node.args[0]
        return False

    def _operands_in_family(self, args, kwargs) -> bool:
        found = []
        torch.fx.node.map_arg((args, kwargs), lambda arg: found.append(arg in self.members))
        return any(found)

    def visit(self, node: torch.fx.Node) -> None:
        """Classify node, which uses a member, or raise Refusal."""
        used = [a for a in node.all_input_nodes if a in self.members]
        if node is self.copy_back:
            source = node.args[1]
            if source not in self.members or not _same_layout(self.members[source].fake, self.cache_fake):
                raise Refusal(f"the value copied back into the input is not the input written in place "
                              f"({_op(source)})")
            self._latest(source, node)
        elif node.target in _IN_PLACE and node.args[0] in self.members:
            base = node.args[0]
            if self._operands_in_family(node.args[1:], node.kwargs):
                raise Refusal(f"the write at {location_of(node)} reads the cache it writes (indices or values)")
            if self._through_resizing_dtype_view(base):
                raise Refusal(f"the write at {location_of(node)} goes through a dtype view that changes the element "
                              f"size (Inductor lowers such a view of a strided tensor as a copy: the write would be "
                              f"lost); write bytes through same-size views instead")
            if self.members[base].version != len(self.writes):
                raise Refusal(f"two writes from one value of the cache: {location_of(node)} writes the cache as it "
                              f"was before the write at {location_of(self.writes[self.members[base].version])}")
            self.writes.append(node)
            self.members[node] = _Member(len(self.writes), self.members[base].fake)  # in place: returns its base
        elif node.target in _SCATTERED_VIEW and node.args[0] in self.members:
            base, source = node.args[0], node.args[1]
            if source not in self.members or self._operands_in_family(node.args[2:], node.kwargs):
                raise Refusal(f"the scatter at {location_of(node)} writes back a value that is not a write into "
                              f"the cache's own memory")
            region = self._replay(node, _SCATTERED_VIEW[node.target], (base, *node.args[2:]))
            if not _same_layout(self.members[source].fake, region):
                raise Refusal(f"the scatter at {location_of(node)} writes back a region other than the one written")
            self._latest(source, node)
            since = self.writes[self.members[base].version:]
            if not all(self._within(write.args[0], region) for write in since):
                raise Refusal(f"a write since the scattered value at {location_of(node)} went outside the region "
                              f"scattered back")
            self.dropped_scatters.append(node)
            self.members[node] = _Member(self.members[source].version, self.members[base].fake)
        elif _is_view(node) and node.args[0] in self.members and used == [node.args[0]]:
            fake = self._replay(node)
            if all(_same_storage(t, self.cache_fake) for t in _tensors(fake)):
                self.members[node] = _Member(self.members[node.args[0]].version, fake)
            else:  # a reshape that copies the strided cache: a read
                self._latest(node.args[0], node)
        elif not is_call(node, *_SIZE_QUERIES):
            for arg in used:
                self._latest(arg, node)


def _plan(copy_back: torch.fx.Node, order: dict[torch.fx.Node, int], inputs: dict[int, list]) -> _CacheFamily:
    """order: each node's position in the graph (erasing nodes keeps the others' order); inputs: the graph's tensor
    inputs by storage (_inputs_by_storage)."""
    cache = copy_back.args[0]
    family = _CacheFamily(cache, copy_back)
    if not isinstance(family.cache_fake, torch.Tensor):
        raise Refusal(f"input {cache.name} has no fake tensor")
    other = next((o for o in inputs.get(_storage_key(family.cache_fake), []) if o is not cache), None)
    if other is not None:
        raise Refusal(f"inputs {cache.name} and {other.name} share memory")
    # Every node that uses a member, in graph order: only a member's users can join the family or read it, so they
    # come from a heap of those users (a scan of the whole graph per mutated input was quadratic in its depth).
    pending, queued = [], set()

    def follow(member: torch.fx.Node) -> None:
        for user in member.users:
            if user not in queued:
                queued.add(user)
                heapq.heappush(pending, (order[user], user))

    follow(cache)
    while pending:
        node = heapq.heappop(pending)[1]
        family.visit(node)
        if node in family.members:
            follow(node)
    if not family.writes:
        raise Refusal(f"the value copied back into {cache.name} is not a write into it")
    return family


def _rewrite(graph: torch.fx.Graph, family: _CacheFamily) -> None:
    for node, member in family.members.items():
        if node.op == "call_function":
            node.meta["val"] = member.fake
    for write in family.writes:
        write.target = _IN_PLACE[write.target]
    for scatter in family.dropped_scatters:
        scatter.replace_all_uses_with(scatter.args[0])
        graph.erase_node(scatter)
    family.copy_back.replace_all_uses_with(family.cache)
    graph.erase_node(family.copy_back)
    # The inverse views that fed the scatters are dead now (views only: writes stay, they are the point).
    for node in reversed(list(family.members)):
        if node.op == "call_function" and node.graph is graph and not node.users and node not in family.writes \
                and node not in family.dropped_scatters:
            graph.erase_node(node)


def _inputs_by_storage(graph: torch.fx.Graph) -> dict[int, list[torch.fx.Node]]:
    """The placeholders with a tensor value, in graph order, by their storage (_storage_key): once per pass,
    not once per mutated input (the rewrite changes no input's value)."""
    inputs: dict[int, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="placeholder"):
        value = fake_value(node)
        if isinstance(value, torch.Tensor):
            inputs.setdefault(_storage_key(value), []).append(node)
    return inputs


def _copy_backs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """AOTAutograd's in-graph input mutations: copy_(placeholder, new value)."""
    return [node for node in graph.find_nodes(op="call_function", target=aten.copy_.default)
            if node.args[0].op == "placeholder"]


def reinplace_cache_writes(graph: torch.fx.Graph) -> PassResult:
    graph = copy_graph(graph)
    result = PassResult("reinplace_cache_writes", graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    inputs = _inputs_by_storage(graph)
    for copy_back in _copy_backs(graph):
        try:
            family = _plan(copy_back, order, inputs)
        except Refusal as why:
            result.refused(f"input {copy_back.args[0].name}", str(why))
            continue
        _rewrite(graph, family)
        for write in family.writes:
            result.rewrote(location_of(write))
    return result
