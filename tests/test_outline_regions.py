"""dzc/outline_regions.py: the inlined copies of a region body outlined again as invoke_subgraph calls before
Inductor's fallback compile, where that equals the flat graph, and refused with a reason where it would not.

Graphs are traced from small torch functions (ATen ops, traced values by fake tensor propagation) and tagged the
way regions.flatten tags a body's copies; the outlined module runs eagerly (invoke_subgraph runs its body) against
the flat one on seeded random inputs, bit for bit (the same ops in the same order). The end-to-end case compiles
a model with nested regions through Inductor and checks the report and the numerics.
"""

import operator
import re

import pytest
import torch
import torch.fx
from conftest import assert_warm_values_rebuilt
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dzc import config, ir
from dzc.outline_regions import CALL, INVOKE_SUBGRAPH, SPLIT, outline_repeated_calls


def _layer(x, w):
    return torch.relu(x @ w) + x


def _traced(fn, *inputs) -> torch.fx.GraphModule:
    gm = make_fx(fn)(*inputs)
    FakeTensorProp(gm).propagate(*inputs)
    return gm


def _tag(gm: torch.fx.GraphModule, calls: int | list[int]) -> None:
    """Tag the call_function nodes as runs, in order, as regions.flatten does: `calls` equal runs, or runs of the
    given lengths (nodes after them are the caller's)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    lengths = [len(nodes) // calls] * calls if isinstance(calls, int) else calls
    start = 0
    for i, length in enumerate(lengths):
        for node in nodes[start:start + length]:
            node.meta[CALL] = ("body", f"call{i}")
        start += length


def _inputs(seed, *shapes):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


GOLDEN_OUTLINED = """# outlined
graph(%a0: f32[8, 16], %a1: f32[16, 16], %a2: f32[16, 16], %a3: f32[16, 16]):
  %0 = getattr 'dzc_outlined_0'
  %1 = invoke_subgraph(%0, 'dzc_outlined_0', %a0, %a1)  # (f32[8, 16])
  %2 = %1[0]  # f32[8, 16]
  %3 = invoke_subgraph(%0, 'dzc_outlined_0', %2, %a2)  # (f32[8, 16])
  %4 = %3[0]  # f32[8, 16]
  %5 = invoke_subgraph(%0, 'dzc_outlined_0', %4, %a3)  # (f32[8, 16])
  %6 = %5[0]  # f32[8, 16]
  return (%6,)
"""
GOLDEN_BODY = """# body
graph(%a0: f32[8, 16], %a1: f32[16, 16]):
  %0 = aten.mm.default(%a0, %a1)  # f32[8, 16]
  %1 = aten.relu.default(%0)  # f32[8, 16]
  %2 = aten.add.Tensor(%1, %a0)  # f32[8, 16]
  return (%2,)
"""


def test_three_equal_calls_become_one_body(seed):
    def model(x, w0, w1, w2):
        return (_layer(_layer(_layer(x, w0), w1), w2),)

    inputs = _inputs(seed, (8, 16), (16, 16), (16, 16), (16, 16))
    gm = _traced(model, *inputs)
    _tag(gm, 3)
    assert ir.print_graph(gm.graph, "flat").count("aten.mm.default") == 3
    expected = gm(*inputs)
    outlined = outline_repeated_calls(gm)
    assert outlined.describe() == "1 bodies for 3 calls (9 nodes)"
    assert ir.print_graph(gm.graph, "outlined") == GOLDEN_OUTLINED
    assert ir.print_graph(gm.dzc_outlined_0.graph, "body") == GOLDEN_BODY
    calls = [n for n in gm.graph.nodes if n.target is INVOKE_SUBGRAPH]
    assert len(calls) == 3 and len({c.args[0] for c in calls}) == 1, "one body attribute for every call"
    torch.testing.assert_close(gm(*inputs), expected, atol=0, rtol=0)


def test_a_call_unlike_the_others_stays_inlined(seed):
    """The third layer scales by 2 (another constant): calls 0 and 1 share a body, call 2 is left as it was."""
    def model(x, w0, w1, w2):
        y = _layer(_layer(x, w0), w1)
        return (torch.relu(y @ w2) * 2 + y,)

    inputs = _inputs(seed, (8, 16), (16, 16), (16, 16), (16, 16))
    gm = _traced(model, *inputs)
    _tag(gm, [3, 3, 4])
    expected = gm(*inputs)
    outlined = outline_repeated_calls(gm)
    assert (outlined.bodies, outlined.calls) == (1, 2) and outlined.refused == {"no other call like it": 1}
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)) == 1
    torch.testing.assert_close(gm(*inputs), expected, atol=0, rtol=0)


def test_calls_of_other_sizes_do_not_share_a_body(seed):
    def model(x, w0, w1):
        return _layer(x, w0), _layer(x[:, :8], w1)

    inputs = _inputs(seed, (8, 16), (16, 16), (8, 8))
    gm = _traced(model, *inputs)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in nodes[:3]:
        node.meta[CALL] = ("body", "call0")
    for node in nodes[4:]:  # after the slice, which is the caller's
        node.meta[CALL] = ("body", "call1")
    outlined = outline_repeated_calls(gm)
    assert outlined.bodies == 0 and outlined.refused == {"no other call like it": 2}, outlined.describe()


def test_views_of_a_calls_inputs_stay_outside_it(seed):
    """Calls that only take a view of their input (an expert's weight, transposed) would become bodies returning
    their input's view, which Inductor's code for the multimodal model crashed on (session 43): the views stay
    in the graph, and such a call has nothing left to outline. A call computing from the view keeps it (a body's
    sizes must follow from its inputs')."""
    def model(x, w0, w1):
        return (x @ w0[1].t() + x @ w1[1].t(),)

    x, w0, w1 = _inputs(seed, (8, 16), (2, 16, 16), (2, 16, 16))
    for lengths, expected_calls in (([2, 2], 0), ([3, 3], 2)):  # [select, t] or [select, t, mm] per call
        gm = _traced(model, x, w0, w1)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert [n.target for n in nodes[:3]] == [torch.ops.aten.select.int, torch.ops.aten.t.default,
                                                 torch.ops.aten.mm.default], gm.graph
        calls = {0: nodes[:lengths[0]], 1: nodes[3:3 + lengths[1]]}
        for i, call in calls.items():
            for node in call:
                node.meta[CALL] = ("body", f"call{i}")
        expected = gm(x, w0, w1)
        result = outline_repeated_calls(gm)
        assert result.calls == expected_calls, result.describe()
        if expected_calls == 0:
            assert result.refused == {"only views of values from outside it": 2}, result.describe()
        for name, body in gm.named_children():
            assert [n.target for n in body.graph.nodes if n.op == "call_function"] == [
                torch.ops.aten.select.int, torch.ops.aten.t.default, torch.ops.aten.mm.default]
        torch.testing.assert_close(gm(x, w0, w1), expected, atol=0, rtol=0)


def test_views_a_call_gives_stay_outside_it_and_its_body_gives_their_base(seed):
    """A call whose values used outside are views of its own value (a qkv projection split by unbind into q, k, v)
    would become a body whose outputs alias each other: Inductor's C++ code gave NaN for it here, and crashed on
    the multimodal model's vision blocks (session 43). The views stay in the graph; the body gives their base."""
    def model(x, w0, w1):
        for w in (w0, w1):
            q, k, v = (x @ w).view(8, 3, 16).unbind(1)
            x = q * k + v
        return (x,)

    x, w0, w1 = _inputs(seed, (8, 16), (16, 48), (16, 48))
    gm = _traced(model, x, w0, w1)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for i, call in enumerate((nodes[:6], nodes[8:14])):  # [mm, view, unbind, getitem x3]; mul, add are the caller's
        for node in call:
            node.meta[CALL] = ("body", f"call{i}")
    expected = gm(x, w0, w1)
    result = outline_repeated_calls(gm)
    assert result.calls == 2, result.describe()
    [body] = gm.children()
    assert [n.target for n in body.graph.nodes if n.op == "call_function"] == [torch.ops.aten.mm.default]
    torch.testing.assert_close(gm(x, w0, w1), expected, atol=0, rtol=0)
    from torch._inductor.compile_fx import compile_fx_inner

    torch.testing.assert_close(compile_fx_inner(gm, [x, w0, w1])([x, w0, w1]), list(expected))


def test_calls_reading_sizes_only_stay_inlined():
    """Two equal calls that read only a size (a SymInt) and make tensors from it: Inductor places an
    invoke_subgraph on its operands' device and fails on such a body, so both stay inlined."""
    def model(x):
        n = x.shape[0]
        return ((torch.arange(n * 2, dtype=torch.float32) + 1) * (torch.arange(n * 2, dtype=torch.float32) + 1),)

    x = torch.randn(8, 4)
    gm = make_fx(model, tracing_mode="symbolic")(x)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(nodes) == 8, gm.graph
    for i, node in enumerate(nodes[1:7]):  # after the caller's sym_size, before its final product
        node.meta[CALL] = ("body", f"call{i // 3}")
    expected = gm(x)
    result = outline_repeated_calls(gm)
    assert result.calls == 0 and result.refused == {
        "it reads no tensor (Inductor's invoke_subgraph takes its device from one)": 2}, result.describe()
    torch.testing.assert_close(gm(x), expected, atol=0, rtol=0)


def test_a_write_cuts_a_call_and_the_parts_after_it_match(seed):
    """Each call writes a cache row in place (index_put_) between its two halves: the write stays in the graph
    where it was, and so does the read of the cache after it (Inductor orders a subgraph's reads against the
    caller's writes wrongly on the GPU); each half around them is outlined with its siblings."""
    def model(x, w0, w1, cache0, cache1, rows):
        out = x
        for w, cache in ((w0, cache0), (w1, cache1)):
            h = torch.tanh(out @ w)
            cache.index_put_((rows,), h[:2])
            out = (cache.sum(0) * h) + out
        return (out,)

    x, w0, w1, c0, c1 = _inputs(seed, (8, 16), (16, 16), (16, 16), (4, 16), (4, 16))
    rows = torch.tensor([1, 3])
    gm = _traced(model, x, w0, w1, c0.clone(), c1.clone(), rows)
    _tag(gm, 2)
    expected = gm(x, w0, w1, c0.clone(), c1.clone(), rows)
    outlined = outline_repeated_calls(gm)
    assert outlined.calls == 4 and outlined.bodies == 2, outlined.describe()
    assert outlined.cuts == {"a node with side effects (aten.index_put_.default)": 2,
                             "a read of memory the graph writes in place (aten.sum.dim_IntList)": 2}
    order = [n.target for n in gm.graph.nodes if n.target in (torch.ops.aten.index_put_.default,
                                                              torch.ops.aten.sum.dim_IntList)]
    assert order == [torch.ops.aten.index_put_.default, torch.ops.aten.sum.dim_IntList] * 2, order
    torch.testing.assert_close(gm(x, w0, w1, c0.clone(), c1.clone(), rows), expected, atol=0, rtol=0)


def test_a_node_a_pass_made_inside_a_call_joins_it(seed):
    """The caller's node between call 0's nodes (a pass made it: untagged), reading only call 0, is outlined with
    call 0; call 1 has no such node, so the two no longer match, and both stay as they were."""
    def model(x, w0, w1):
        h0 = x @ w0
        mid = h0.sum()  # untagged, between call 0's nodes
        y0 = torch.relu(h0) * mid
        h1 = y0 @ w1
        return (torch.relu(h1) * 2,)

    inputs = _inputs(seed, (8, 16), (16, 16), (16, 16))
    gm = _traced(model, *inputs)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in nodes[:1] + nodes[2:4]:
        node.meta[CALL] = ("body", "call0")
    for node in nodes[4:]:
        node.meta[CALL] = ("body", "call1")
    outlined = outline_repeated_calls(gm)
    assert outlined.calls == 0 and outlined.refused == {"no other call like it": 2}, outlined.describe()


def test_a_call_reading_a_value_the_caller_computes_from_it_is_split_there(seed):
    """Calls 0 and 1 interleave, and the caller adds their first results (a node of neither call) before each
    goes on with that sum: no one place for either call comes after the sum and before the use of its result.
    Each call is split at the sum (the multimodal model's DSA layers: the caller's views of a call's values, and
    the fused attention reading them, between its nodes); the halves match each other's and are outlined."""
    def model(x, w0, w1):
        a0, a1 = x @ w0, x @ w1
        both = a0 + a1
        return (torch.relu(a0) * both, torch.relu(a1) * both)

    inputs = _inputs(seed, (8, 16), (16, 16), (16, 16))
    gm = _traced(model, *inputs)
    expected = gm(*inputs)
    mm0, mm1, both, relu0, mul0, relu1, mul1 = [n for n in gm.graph.nodes if n.op == "call_function"]
    for call, members in (("call0", (mm0, relu0, mul0)), ("call1", (mm1, relu1, mul1))):
        for node in members:
            node.meta[CALL] = ("body", call)
    outlined = outline_repeated_calls(gm)
    assert (outlined.bodies, outlined.calls, outlined.refused) == (2, 4, {}), outlined.describe()
    assert outlined.cuts == {SPLIT: 2}, outlined.describe()
    order = [str(n.args[1]) if n.target is INVOKE_SUBGRAPH else n.target.__name__ for n in gm.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    assert order == ["dzc_outlined_0", "dzc_outlined_0", "add.Tensor", "dzc_outlined_1", "dzc_outlined_1"], order
    torch.testing.assert_close(gm(*inputs), expected, atol=0, rtol=0)


def test_interleaved_calls_reading_each_other_are_outlined_only_where_in_order(seed):
    """Each layer runs two calls whose nodes interleave, each reading the other's first value (A: relu, then its
    product with B's tanh; B: tanh, then its sum with A's relu). B's call goes first (at its tanh), so it reads
    A's relu where A's own call would come only later: B's calls are outlined, A's stay as they were."""
    def model(x):
        for _ in range(2):
            o = torch.relu(x)      # A
            t = torch.tanh(x)      # B
            p = o * t              # A
            m = t + o              # B
            x = p + m              # the caller's (reads both calls)
        return (x,)

    (x,) = _inputs(seed, (8, 16))
    gm = _traced(model, x)
    expected = gm(x)
    relu0, tanh0, mul0, add0, _, relu1, tanh1, mul1, add1, _ = [n for n in gm.graph.nodes if n.op == "call_function"]
    for call, members in (("a0", (relu0, mul0)), ("b0", (tanh0, add0)), ("a1", (relu1, mul1)), ("b1", (tanh1, add1))):
        for node in members:
            node.meta[CALL] = ("body", call)
    result = outline_repeated_calls(gm)
    assert (result.bodies, result.calls) == (1, 2), result.describe()
    assert result.refused == {"a value it gives is read by a call placed before it": 2}, result.describe()
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)) == 2
    torch.testing.assert_close(gm(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("write", [True, False], ids=["written-later", "never-written"])
def test_a_call_returning_a_view_of_a_value_written_later_is_refused(seed, write):
    """Each call returns its input transposed (a view) beside its result. A body's output is a buffer of its own,
    which would no longer see what the caller writes into that input afterwards: where x is written, call 0's view
    of it stays outside, so calls 0 and 1 differ and both stay inlined; where nothing is written both share a
    body."""
    def model(x, w0, w1):
        h0, v0 = torch.relu(x @ w0), x.t()
        h1, v1 = torch.relu(h0 @ w1), h0.t()
        if write:
            x.mul_(2)
        return (v0 + v1 + h1,)

    inputs = _inputs(seed, (16, 16), (16, 16), (16, 16))
    gm = _traced(model, *[i.clone() for i in inputs])
    _tag(gm, [3, 3])
    expected = gm(*[i.clone() for i in inputs])
    result = outline_repeated_calls(gm)
    if write:
        assert result.calls == 0 and result.refused == {"no other call like it": 2}, result.describe()
    else:
        assert result.calls == 2 and not result.refused, result.describe()
    torch.testing.assert_close(gm(*[i.clone() for i in inputs]), expected, atol=0, rtol=0)


def _fp32_decoder(seed, layers: int):
    """The llama-style decoder in fp32 (Inductor's C++ kernels against eager at fp32 tolerances), its inputs, and
    its eager outputs."""
    from dzc.models import build_model

    torch.manual_seed(seed)
    model, inputs = build_model("llama_decoder", layers=layers)
    inputs = [i.float() if isinstance(i, torch.Tensor) and i.is_floating_point() else i for i in inputs]
    model = model.float()
    with torch.no_grad():
        return model, inputs, model(*inputs)


@pytest.mark.parametrize("knob", ["1", "0"])
def test_inductor_fallback_compiles_the_outlined_layers(seed, knob, tmp_path):
    """A llama-style decoder with nested regions through dzc with Inductor as the fallback (on the CPU, its C++
    backend): the report says which calls were outlined, and the outputs match the eager model's."""
    import dzc

    model, inputs, expected = _fp32_decoder(seed, layers=3)
    with config.scope(DZC_OUTLINE_FOR_INDUCTOR=knob):
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False,
                                                                 fallback="inductor"))
        with torch.no_grad():
            out = compiled(*inputs)
    outlined = compiled.report.graphs[0].inductor_outlined
    if knob == "1":
        bodies, calls = map(int, re.match(r"(\d+) bodies for (\d+) calls", outlined).groups())
        assert bodies >= 1 and calls >= 3, outlined  # each of the 3 layers' calls in a body
        assert "repeated layers outlined for Inductor" in str(compiled.report)
    else:
        assert outlined == "off (DZC_OUTLINE_FOR_INDUCTOR=0)"
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("inductor_cache", [True, False])
def test_a_warm_start_loads_the_outlined_compile(seed, tmp_path, monkeypatch, inductor_cache):
    """The same compile in a second dzc.compile over the same cache directory (a frame entry: Dynamo and
    AOTAutograd skipped): the graph Inductor gets is outlined the same way, and the outputs are the cold ones bit
    for bit. Where Inductor's FX graph cache hits, the warm start rebuilds the fake values the outlining reads (the
    calls' nodes and their inputs), not every node's; where it is off, every value before Inductor compiles."""
    import gc
    import itertools

    import dzc
    from dzc import capture, compile_cache
    from dzc.models import build_model

    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "1")
    monkeypatch.setenv("DZC_OUTLINE_FOR_INDUCTOR", "1")
    torch.manual_seed(seed)
    model, inputs = build_model("llama_decoder", layers=3)
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False, fallback="inductor")
    runs, loads, deferred_values = [], [], compile_cache._DeferredValues
    for run in range(2):
        # The kernel ids in the graph Inductor hashes name the compiled model's serial: as in a second process, the
        # warm compile's is the cold one's.
        monkeypatch.setattr(capture, "_BACKEND_SERIAL", itertools.count(1000))
        if run == 1:
            monkeypatch.setattr(compile_cache, "_DeferredValues",
                                lambda *args: loads.append(deferred_values(*args)) or loads[-1])
        with torch._inductor.config.patch(fx_graph_cache=inductor_cache or run == 0):
            compiled = dzc.compile(model, "cuda", options)
            with torch.no_grad():
                outputs = [compiled(*inputs) for _ in range(2)]  # the cold first call runs the rewrite check
        runs.append((compiled.report, outputs[-1]))
        del compiled
        gc.collect()
    (cold, cold_out), (warm, warm_out) = runs
    assert warm.frame_cache.startswith("hit (1 graph"), warm.frame_cache
    assert warm.graphs[0].inductor_outlined == cold.graphs[0].inductor_outlined, warm.graphs[0].inductor_outlined
    assert "bodies for" in warm.graphs[0].inductor_outlined and not warm.graphs[0].inductor_outlined.startswith("0 ")
    # With Inductor's cache on, its compile is loaded by the key the entry kept: no outlining, no hash of the graph.
    assert warm.graphs[0].inductor_by_key == inductor_cache and not cold.graphs[0].inductor_by_key
    assert ("loaded by the key" in str(warm)) == inductor_cache
    [values] = loads
    assert_warm_values_rebuilt(values, inductor_cache)
    torch.testing.assert_close(warm_out, cold_out, atol=0, rtol=0)


def test_an_outlined_graph_inductor_refuses_is_compiled_flat(seed, tmp_path, monkeypatch):
    """Where Inductor fails on the outlined graph, the compile goes on with the flat graph (a slower compile, not a
    failed one); the warning and the report say so, and the outputs are right."""
    import torch._inductor.compile_fx as compile_fx

    import dzc

    real = compile_fx.compile_fx_inner

    def refusing(gm, *args, **kwargs):
        if gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
            raise NotImplementedError("this Inductor takes no invoke_subgraph")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", refusing)
    monkeypatch.setenv("DZC_OUTLINE_FOR_INDUCTOR", "1")
    model, inputs, expected = _fp32_decoder(seed, layers=2)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False,
                                                             fallback="inductor"))
    with pytest.warns(RuntimeWarning, match="outlining the repeated layers for Inductor failed"), torch.no_grad():
        out = compiled(*inputs)
    assert compiled.report.graphs[0].inductor_outlined == (
        "failed (NotImplementedError: this Inductor takes no invoke_subgraph); Inductor compiled the flat graph "
        "instead")
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
