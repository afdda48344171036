"""DSA end to end: the ops' references, the reference layer over the paged cache, HF DeepseekV32 and GlmMoeDsa — fused by
fuse_sparse_attention, matching eager over a prefill and decode steps, no recompile as the context grows.

Compiled-with-kernels tests use dzc.compile (Triton kernels through the interpreter); the rest run the pass
pipeline's output with the ops' references (fast) so that more spellings and steps fit in CI time."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

import dzc
from dzc.kv_cache import PagedKVCache, quantize_index_keys
from dzc.models.dsa import TINY_DSA, DSASession, build_dsa_attention, build_hf_deepseek_v32, build_hf_glm_moe_dsa
from dzc.ops.dsa import dsa_indexer_reference, dsa_topk_reference, sparse_attention_reference
from dzc.pipeline import run_pipeline
from dzc.targets import resolve_target

# ---------------------------------------------------------------------------------------------------------------
# The references against the dense spelling they replace.


def test_topk_reference_order_ties_and_short_rows(seed):
    logits = torch.randn(5, 40)
    lengths = torch.tensor([40, 17, 3, 0, 40], dtype=torch.int32)
    logits[4, 10:20] = 1.5  # ten ties at the top: the smaller positions win
    logits[4, :10] = -5.0
    logits[4, 20:] = logits[4, 20:].abs().neg()
    out = dsa_topk_reference(logits, lengths, 8)
    assert out.dtype == torch.int32 and out.shape == (5, 8)
    for row in range(2):
        expected = torch.topk(logits[row, : lengths[row]], 8).indices.sort().values
        assert torch.equal(out[row].long(), expected)
    assert out[2].tolist() == sorted(range(3)) + [-1] * 5  # fewer than k visible: -1 padding
    assert out[3].tolist() == [-1] * 8
    assert out[4].tolist() == list(range(10, 18))


def _dense_attention(q, keys, values, visible, scale):
    """[T, H, D] queries over per-query dense keys [T, S, D] with a visibility mask [T, S]: the masked softmax."""
    scores = torch.einsum("thd,tsd->ths", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("ths,tsd->thd", probs, values.float())


def test_sparse_attention_reference_reads_pages_and_masks_invalid_indices(seed):
    page, pages, heads, d_qk, d_v = 4, 6, 3, 12, 8
    k_cache = torch.randn(pages, page, 1, d_qk)
    block_table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 7], dtype=torch.int32)
    query_seq = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    indices = torch.tensor([[0, 9, 4, -1], [1, 2, 10, 11], [6, 0, 3, 7], [-1, -1, 7, 8]], dtype=torch.int32)
    q = torch.randn(4, heads, d_qk)
    out = sparse_attention_reference(q, k_cache, None, block_table, seq_lens, query_seq, indices, 0.3, d_v)
    dense = k_cache[block_table.long()].flatten(1, 2)[:, :, 0]  # [B, 12, d_qk]
    keys = dense[query_seq.long()]
    visible = torch.zeros(4, 12, dtype=torch.bool)
    for t in range(4):
        for index in indices[t].tolist():
            if 0 <= index < seq_lens[query_seq[t]]:
                visible[t, index] = True
    expected = _dense_attention(q, keys, keys[..., :d_v], visible, 0.3)
    torch.testing.assert_close(out, expected)
    assert out[3].abs().max() == 0  # every index invalid: the row is 0
    # MHA form (Hkv = H) with its own V cache.
    k_heads, v_heads = torch.randn(pages, page, heads, d_qk), torch.randn(pages, page, heads, d_v)
    out = sparse_attention_reference(q, k_heads, v_heads, block_table, seq_lens, query_seq, indices, 0.3, d_v)
    for h in range(heads):
        keys = k_heads[block_table.long()].flatten(1, 2)[:, :, h][query_seq.long()]
        values = v_heads[block_table.long()].flatten(1, 2)[:, :, h][query_seq.long()]
        torch.testing.assert_close(out[:, h], _dense_attention(q[:, h:h + 1], keys, values, visible, 0.3)[:, 0])


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_reference_is_the_weighted_relu_head_sum(seed, fp8):
    cache = PagedKVCache(TINY_DSA.cache_config(), max_pages=5, batch=2, fp8_index=fp8)
    slots = cache.reserve([70, 9])
    keys = torch.randn(len(slots), 16)
    cache.write_index_keys(0, slots, keys)
    q, weights = torch.randn(3, 8, 16).bfloat16(), torch.randn(3, 8)
    query_seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    query_pos = torch.tensor([69, 3, 8], dtype=torch.int32)
    logits = dsa_indexer_reference(q, weights, cache.index_keys[0], cache.block_table, cache.seq_lens, query_seq,
                                   query_pos, 140)
    assert logits.shape == (3, 140) and logits.dtype == torch.float32
    if fp8:  # what the cache holds: e4m3 values times the per-token scale
        values, scales = quantize_index_keys(keys)
        stored = values.float() * scales[:, None]
    else:
        stored = keys.bfloat16().float()
    rows = [stored[:70], stored[70:]]
    for t, (b, pos) in enumerate(zip(query_seq.tolist(), query_pos.tolist())):
        expected = (torch.relu(q[t].float() @ rows[b][: pos + 1].T) * weights[t][:, None]).sum(0)
        torch.testing.assert_close(logits[t, : pos + 1], expected, atol=1e-4, rtol=1e-4)
        assert torch.isinf(logits[t, pos + 1:]).all() and (logits[t, pos + 1:] < 0).all()


# ---------------------------------------------------------------------------------------------------------------
# Models through the pass pipeline (reference ops).


def _pipeline_backend(stages):
    """A torch.compile backend: dzc's capture (AOTAutograd + Inductor decompositions) and pass pipeline, then the
    graph runs as is (dzc ops with their references). `stages` collects each graph's pipeline stages."""
    def compile_graph(gm, _):
        graph, graph_stages = run_pipeline(gm.graph, resolve_target("cuda"))
        stages.append((graph, graph_stages))
        return torch.fx.GraphModule(gm, graph)

    return aot_autograd(fw_compiler=compile_graph, inference_compiler=compile_graph,
                        decompositions=select_decomp_table())


def _mark_dynamic(args):
    for value in args:
        if isinstance(value, torch.Tensor):
            for dim in range(value.dim() if not value.is_floating_point() else value.dim() - 1):
                if value.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


# Views of the cache pool and writes into it: pool-sized (symbolic when the pool's sizes are), not [queries x context].
_POOL_VIEWS_AND_WRITES = {"aten.slice.Tensor", "aten.view.default", "aten.view.dtype", "aten.alias.default",
                          "aten.index_put.default", "aten.index_put_.default", "aten.slice_scatter.default",
                          "aten.copy_.default"}


def _context_sized(graph):
    """(op, shape) of every value with a dim equal to the context length (64 * pages: the size that grows)."""
    found = []
    for node in graph.nodes:
        value = node.meta.get("val")
        # min(k, context) (the top-k width upstream writes) is bounded by k, not context-sized.
        if isinstance(value, torch.Tensor) and any(not isinstance(d, int) and "*" in str(d)
                                                   and not str(d).startswith("Min(") for d in value.shape):
            found.append((str(node.target), tuple(str(d) for d in value.shape)))
    return found


@pytest.mark.slow
def _assert_close_but_for_near_ties(actual, expected):
    """Rows (query tokens) match to 1e-4, but for at most one in 50: the indexer op sums ReLU(q·k) in another
    order than the eager spelling, so where two keys' scores are within rounding of each other at the top-k
    boundary the selections may differ. A wrong selection or attention would mismatch far more rows."""
    close = torch.isclose(actual, expected, atol=1e-4, rtol=1e-4).flatten(0, -2).all(-1)
    assert (~close).sum() <= max(1, close.numel() // 50), f"{(~close).sum()} of {close.numel()} rows differ"


def test_dsa_layer_fuses_and_matches_eager_over_ragged_prefill_and_decode(seed):
    """FP8 paged indexer cache (test_compiled_dsa_decode_... covers the BF16 one). The layer runs in fp32 so that
    eager's own rounding (bf16 scores before the softmax) does not hide a wrong selection in the tolerance."""
    model = build_dsa_attention(dtype=torch.float32)
    eager_cache, fused_cache = (PagedKVCache(TINY_DSA.cache_config(), 8, 2, fp8_index=True,
                                             latent_dtype=torch.float32) for _ in range(2))
    eager, fused = DSASession(eager_cache), DSASession(fused_cache)
    with torch.no_grad():  # sequence 1's prompt runs eagerly in both: the batch is ragged from the start
        x = torch.randn(1, 62, 64)
        eager.step(model, x, [1])
        fused.step(model, x, [1])
    stages = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_pipeline_backend(stages))
    # A compiled prefill of 126 tokens, then decode steps crossing both sequences' page boundaries.
    steps = [(torch.randn(1, 126, 64), [0])] + [(torch.randn(2, 1, 64), None) for _ in range(3)]
    with torch.no_grad():
        for x, sequences in steps:
            expected = eager.step(model, x, sequences)
            args = fused.inputs(x, sequences)
            _mark_dynamic(args[1:4])
            # The pool's sizes symbolic too (Dynamo makes them so once it has seen another cache): its views then
            # keep whole-dim slices the pass must look through.
            _mark_dynamic(fused_cache.index_keys)
            actual = compiled(*args)
            _assert_close_but_for_near_ties(actual, expected)
    assert eager_cache.lengths == [129, 65]
    assert len(stages) == 2  # prefill, and one decode graph for every context length
    for graph, graph_stages in stages:
        passes = {stage.name: stage.result for stage in graph_stages if stage.result is not None}
        assert len(passes["fuse_sparse_attention"].rewrites) == 1, passes["fuse_sparse_attention"].refusals
        lowered = graph_stages[-1].text
        assert lowered.count("dzc.dsa_indexer.default") == lowered.count("dzc.sparse_attention.default") == 1
        indexer = next(n for n in graph.nodes if n.target is torch.ops.dzc.dsa_indexer.default)
        assert indexer.args[2].meta["val"].dtype == torch.uint8  # reads the FP8 pages, not a dense gather
        # Only the indexer logits are [queries x context]: no mask, no scores, no dense gather of the cache.
        sized = _context_sized(graph)
        allocating = [op for op, _ in sized if op != "prims.iota.default" and op not in _POOL_VIEWS_AND_WRITES]
        assert allocating == ["dzc.dsa_indexer.default"], sized


@pytest.mark.slow
def test_hf_deepseek_v32_sdpa_fuses_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    model, (tokens,) = build_hf_deepseek_v32(attn_implementation="sdpa")
    stages = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_pipeline_backend(stages))
    eager_cache = transformers.DynamicCache(config=model.config)
    fused_cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        for step in range(3):  # prefill, decode at a static context, decode at a dynamic one
            expected = model(tokens, cache=eager_cache, use_cache=True).logits
            actual = compiled(tokens, cache=fused_cache, use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
            tokens = expected[:, -1:].argmax(-1)
    assert len(stages) == 3
    for graph, graph_stages in stages:
        result = next(s.result for s in graph_stages if s.name == "fuse_sparse_attention")
        # one site: the SDPA call in transformers' sdpa_attention.py (its line moves between transformers releases)
        assert [where.split(" ")[0].split(":")[0] for where in result.rewrites] == ["sdpa_attention.py"], \
            result.refusals


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hf_glm_moe_dsa_fuses_and_matches_eager_at_topk_ties(attn_implementation):
    """Issue 16: GlmMoeDsa (interleaved-RoPE indexer, top-k masked_fill'ed into the finfo.min causal mask) with 2
    index heads, whose scores tie at 0 at the k-th place on the first decode steps: torch.topk's choice there is
    its own, and the fused graph must make the same one. Prefill, then decode steps with a DynamicCache."""
    transformers = pytest.importorskip("transformers")
    model, (tokens,) = build_hf_glm_moe_dsa(attn_implementation=attn_implementation)
    stages = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_pipeline_backend(stages))
    eager_cache = transformers.DynamicCache(config=model.config)
    fused_cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        for step in range(5):
            expected = model(tokens, cache=eager_cache, use_cache=True).logits
            actual = compiled(tokens, cache=fused_cache, use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"step {step}")
            tokens = expected[:, -1:].argmax(-1)
    for graph, graph_stages in stages:
        result = next(s.result for s in graph_stages if s.name == "fuse_sparse_attention")
        assert len(result.rewrites) == 1, result.refusals


# ---------------------------------------------------------------------------------------------------------------
# dzc.compile with the kernels.


def _compiled_decode(options, device: str, fp8_index: bool):
    model = build_dsa_attention().to(device)
    eager_cache, fused_cache = (PagedKVCache(TINY_DSA.cache_config(), 8, 2, fp8_index, device) for _ in range(2))
    eager, fused = DSASession(eager_cache), DSASession(fused_cache)
    with torch.no_grad():  # ragged prefill, eager: 126 and 66 tokens
        for sequence, length in ((0, 126), (1, 66)):
            x = torch.randn(1, length, 64, device=device).bfloat16()
            eager.step(model, x, [sequence])
            fused.step(model, x, [sequence])
    compiled = dzc.compile(model, "cuda", options)
    for _ in range(4):  # sequence 0 crosses into its third page: the block table widens
        x = torch.randn(2, 1, 64, device=device).bfloat16()
        expected = eager.step(model, x)
        actual = compiled(*fused.inputs(x))
        torch.testing.assert_close(actual.float(), expected.float(), atol=4e-2, rtol=4e-2)
    report = compiled.report
    assert report.passes["fuse_sparse_attention"] == 1
    assert report.compiles == 1 and report.recompiles == 0, "the growing context recompiled"
    # The selection stays the model's torch.topk (its tie-break); the indexer and the attention are dzc kernels.
    assert {k.op for k in report.kernels} >= {"dsa_indexer", "sparse_attention"}
    return report


@pytest.mark.slow
def test_compiled_dsa_decode_does_not_recompile_as_the_context_grows(seed, options):
    _compiled_decode(options, "cpu", fp8_index=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_index", [False, True])
def test_compiled_dsa_decode_on_gpu(seed, options, fp8_index):
    report = _compiled_decode(options, "cuda", fp8_index)
    assert all(k.execution == "cuda" for k in report.kernels), [k.execution for k in report.kernels]


@pytest.mark.slow
def test_compiled_hf_deepseek_v32_prefill_and_decode(options):
    transformers = pytest.importorskip("transformers")
    model, (tokens,) = build_hf_deepseek_v32(attn_implementation="eager")
    compiled = dzc.compile(model, "cuda", options)
    eager_cache = transformers.DynamicCache(config=model.config)
    fused_cache = transformers.DynamicCache(config=model.config)
    compiles = []
    with torch.no_grad():
        for step in range(4):
            expected = model(tokens, cache=eager_cache, use_cache=True).logits
            actual = compiled(tokens, cache=fused_cache, use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
            tokens = expected[:, -1:].argmax(-1)
            compiles.append(compiled.report.compiles)
    report = compiled.report
    # One graph for the prefill, one for decode, whatever the context length.
    assert compiles == [1, 2, 2, 2] and report.recompiles == 1
    assert report.passes["fuse_sparse_attention"] == 2
    assert all(site.startswith("modeling_deepseek_v32.py") for site in report.pass_sites["fuse_sparse_attention"])
