"""fuse_sparse_attention: golden IR for each spelling, refusals, and what is left after it (no [queries x context]
tensor but the indexer logits). The pass is tested on the pipeline's output (reference ops, no kernels: fast);
test_dsa_models.py runs whole models through dzc.compile with the kernels."""

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from dzc import ir
from dzc.passes.fuse_sparse_attention import fuse_sparse_attention

NEG = float("-inf")


def _fuse(module, *inputs, dynamic=False):
    """Capture module as dzc does (AOTAutograd, Inductor's decompositions), run fuse_sparse_attention on the graph
    and execute the result (reference ops): (captured GraphModule, PassResult, fused output, eager output)."""
    captured = []

    def rewrite(gm, _):
        result = fuse_sparse_attention(gm.graph)
        captured.append((gm, result))
        return torch.fx.GraphModule(gm, result.graph)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=rewrite, inference_compiler=rewrite, decompositions=select_decomp_table())
    with torch.no_grad():
        expected = module(*inputs)
        actual = torch.compile(module, backend=backend, dynamic=dynamic)(*inputs)
    gm, result = captured[0]
    first = (lambda out: out[0] if isinstance(out, tuple) else out)
    return gm, result, first(actual), first(expected)


class DenseDSA(nn.Module):
    """The upstream spelling on dense keys: indexer scores, causal mask, top-k, -inf scatter mask merged with the
    causal mask, dense attention with one latent K shared by all heads (V = its first 8 dims)."""

    def __init__(self, spelling="merged"):
        super().__init__()
        self.spelling = spelling

    def forward(self, q_index, k_index, weights, q, kv, positions):
        context = kv.shape[1]
        mask = torch.where(torch.arange(context) <= positions[..., None], 0.0, NEG)  # [B, S, T]
        scores = F.relu(torch.matmul(q_index.float(), k_index.float().transpose(-1, -2).unsqueeze(1)))
        logits = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2) + mask
        topk = logits.topk(min(4, context), dim=-1).indices
        if self.spelling == "merged":  # DeepSeek reference: index_mask += mask
            attention_mask = (torch.full_like(mask, NEG).scatter_(-1, topk, 0) + mask).unsqueeze(1)
        else:  # "separate": the causal mask added to the scores on its own
            attention_mask = torch.full_like(mask, NEG).scatter_(-1, topk, 0).unsqueeze(1) + mask.unsqueeze(1)
        scores = torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * 0.125 + attention_mask
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, kv[..., :8].unsqueeze(1)), positions


class SDPADSA(nn.Module):
    """HF's SDPA spelling: a boolean causal mask, the top-k as a boolean drop mask, SDPA with attn_mask."""

    def forward(self, q_index, k_index, weights, q, kv, positions):
        context = kv.shape[1]
        causal = torch.arange(context) <= positions[..., None]  # [B, S, T] True = visible
        scores = F.relu(torch.matmul(q_index.float(), k_index.float().transpose(-1, -2).unsqueeze(1)))
        logits = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2).masked_fill(~causal, NEG)
        topk = logits.topk(min(4, context), dim=-1).indices.to(torch.int32)
        dropped = torch.ones_like(causal).scatter(-1, topk.long(), False)
        keep = (causal & ~dropped).unsqueeze(1)
        k = kv.unsqueeze(1).expand(-1, q.shape[1], -1, -1)
        return F.scaled_dot_product_attention(q, k, k[..., :8], attn_mask=keep, scale=0.125), positions


def _inputs(batch=2, queries=3, context=12, heads=2, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    positions = torch.arange(context - queries, context).expand(batch, queries).clone()
    return (randn(batch, queries, 8, 16).bfloat16(), randn(batch, context, 16).bfloat16(), randn(batch, queries, 8),
            randn(batch, heads, queries, 24), randn(batch, context, 24), positions)


def test_golden_merged_mask_spelling():
    inputs = _inputs()
    gm, result, actual, expected = _fuse(DenseDSA("merged"), *inputs)
    before = ir.print_graph(gm.graph)
    after = ir.print_graph(result.graph)
    assert result.rewrites and not result.refusals
    assert before != after  # the pass rewrote a copy: the captured graph still has the dense attention
    ops = [line.split(" = ")[1].split("(")[0] for line in after.splitlines() if " = " in line]
    assert "aten.topk.default" in before and "aten.scatter.value" in before and "aten.amax.default" in before
    for gone in ("aten.topk.default", "aten.scatter.value", "aten.amax.default", "aten.exp.default",
                 "aten.relu.default", "aten.le.Tensor", "aten.bmm.default"):
        assert gone not in ops, gone
    assert ops.count("dzc.dsa_indexer.default") == ops.count("dzc.dsa_topk.default") == 1
    assert ops.count("dzc.sparse_attention.default") == 1
    # Indexer on the bf16 keys (HF's .float() moves into the op); V = K[..., :8] -> v_cache None; B pages of T.
    assert after == """\
graph(%a0: f32[2, 12, 24], %a1: i64[2, 3], %a2: bf16[2, 3, 8, 16], %a3: bf16[2, 12, 16], %a4: f32[2, 3, 8], %a5: f32[2, 2, 3, 24]):
  %0 = aten.unsqueeze.default(%a1, 2)  # i64[2, 3, 1]
  %1 = aten.unsqueeze.default(%a4, -2)  # f32[2, 3, 1, 8]
  %2 = aten.expand.default(%1, [2, 3, 1, 8])  # f32[2, 3, 1, 8]
  %3 = aten.view.default(%2, [6, 1, 8])  # f32[6, 1, 8]
  %4 = aten.unsqueeze.default(%a0, 1)  # f32[2, 1, 12, 24]
  %5 = aten.view.default(%0, [-1, 3])  # i64[2, 3]
  %6 = aten.expand.default(%5, [2, 3])  # i64[2, 3]
  %7 = aten.reshape.default(%6, [-1])  # i64[6]
  %8 = prims.convert_element_type.default(%7, i32)  # i32[6]
  %9 = aten.clone.default(%8, memory_format=torch.contiguous_format)  # i32[6]
  %10 = prims.iota.default(2, device='cpu', dtype=i32, requires_grad=False, start=0, step=1)  # i32[2]
  %11 = aten.unsqueeze.default(%10, 1)  # i32[2, 1]
  %12 = aten.expand.default(%11, [2, 3])  # i32[2, 3]
  %13 = aten.reshape.default(%12, [-1])  # i32[6]
  %14 = aten.clone.default(%13, memory_format=torch.contiguous_format)  # i32[6]
  %15 = aten.unsqueeze.default(%10, 1)  # i32[2, 1]
  %16 = aten.full.default([2], 12, device='cpu', dtype=i32)  # i32[2]
  %17 = aten.reshape.default(%a2, [-1, 8, 16])  # bf16[6, 8, 16]
  %18 = aten.reshape.default(%3, [-1, 8])  # f32[6, 8]
  %19 = dzc.dsa_indexer.default(%17, %18, %a3, %15, %16, %14, %9, 12)  # f32[6, 12]
  %20 = aten.add.Tensor(%9, 1)  # i32[6]
  %21 = aten.index.Tensor(%16, [%14])  # i32[6]
  %22 = aten.minimum.default(%20, %21)  # i32[6]
  %23 = dzc.dsa_topk.default(%19, %22, 4)  # i32[6, 4]
  %24 = aten.permute.default(%a5, [0, 2, 1, 3])  # f32[2, 3, 2, 24]
  %25 = aten.reshape.default(%24, [-1, 2, 24])  # f32[6, 2, 24]
  %26 = aten.permute.default(%4, [0, 2, 1, 3])  # f32[2, 12, 1, 24]
  %27 = dzc.sparse_attention.default(%25, %26, None, %15, %16, %14, %23, 0.125, 8)  # f32[6, 2, 8]
  %28 = aten.view.default(%27, [2, 3, 2, 8])  # f32[2, 3, 2, 8]
  %29 = aten.permute.default(%28, [0, 2, 1, 3])  # f32[2, 2, 3, 8]
  return (%29,)
""", after
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_separate_causal_mask_and_sdpa_spellings_fire_and_match():
    inputs = _inputs(seed=1)
    for module in (DenseDSA("separate"), SDPADSA()):
        gm, result, actual, expected = _fuse(module, *inputs)
        assert len(result.rewrites) == 1 and not result.refusals, (module, result.refusals)
        after = ir.print_graph(result.graph)
        assert "aten.topk" not in after and "aten.bmm" not in after
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


class DenseCausal(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MaskEscapes(DenseDSA):
    """The sparse mask is also returned: the fused ops cannot produce it, so the pass must leave this alone."""

    def forward(self, q_index, k_index, weights, q, kv, positions):
        context = kv.shape[1]
        mask = torch.where(torch.arange(context) <= positions[..., None], 0.0, NEG)
        scores = F.relu(torch.matmul(q_index.float(), k_index.float().transpose(-1, -2).unsqueeze(1)))
        logits = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2) + mask
        index_mask = torch.full_like(mask, NEG).scatter_(-1, logits.topk(4, dim=-1).indices, 0) + mask
        probs = (torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * 0.125 + index_mask.unsqueeze(1)).softmax(-1)
        return torch.matmul(probs, kv[..., :8].unsqueeze(1)), index_mask


class PaddingMask(DenseDSA):
    """The indexer mask also hides padding keys (a model input): not the causal mask the ops implement."""

    def forward(self, q_index, k_index, weights, q, kv, positions, padding):
        context = kv.shape[1]
        mask = torch.where(torch.arange(context) <= positions[..., None], 0.0, NEG) + padding
        scores = F.relu(torch.matmul(q_index.float(), k_index.float().transpose(-1, -2).unsqueeze(1)))
        logits = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2) + mask
        index_mask = torch.full_like(mask, NEG).scatter_(-1, logits.topk(4, dim=-1).indices, 0) + mask
        probs = (torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * 0.125 + index_mask.unsqueeze(1)).softmax(-1)
        return torch.matmul(probs, kv[..., :8].unsqueeze(1))


def test_dense_causal_attention_without_topk_is_not_touched():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    gm, result, _, _ = _fuse(DenseCausal(), q, k, v)
    assert not result.rewrites and not result.refusals
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)


def test_refuses_a_mask_with_another_use_and_a_padding_mask():
    inputs = _inputs(seed=2)
    gm, result, _, _ = _fuse(MaskEscapes(), *inputs)
    assert not result.rewrites
    assert [reason for _, reason in result.refusals] == ["the sparse mask has another use"]
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)

    padding = torch.zeros(2, 1, 12)
    padding[0, 0, :3] = NEG
    gm, result, _, _ = _fuse(PaddingMask(), *inputs, padding)
    assert not result.rewrites
    assert [reason for _, reason in result.refusals] == ["the indexer mask is not exactly causal"]


def test_refuses_indexer_keys_in_another_dtype_than_q():
    """dsa_indexer multiplies in one dtype or reads the uint8 FP8 pool: fp32 dense keys with a bf16 q (what an FP8
    pool read the pass cannot trace back looks like) stay as written, instead of failing later in lowering."""
    q_index, k_index, *rest = _inputs(seed=3)
    gm, result, _, _ = _fuse(DenseDSA("merged"), q_index, k_index.float(), *rest)
    assert not result.rewrites
    assert [reason for _, reason in result.refusals] == [
        "the indexer keys (torch.float32) and q (torch.bfloat16) differ in dtype and are not the FP8 index page pool"]
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)
