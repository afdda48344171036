"""Reference sharded models for several devices: a small decoder with a `tp_plan`, sharded by torch.distributed's
parallel styles (DTensor) or by hand with functional collectives, a DSA attention layer sharded over its heads as
DeepSeek-V3.2's reference code shards it, an expert-parallel MoE block exchanging tokens with all_to_all_single,
and the DSA + MoE decoder layer made of both. tests/test_distributed.py, `dzc-dump --tp` and
tools/bench_distributed.py use them."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from dzc import mxfp4
from dzc.models.decoder import HFRMSNorm
from dzc.models.dsa import DSAAttention, Indexer
from dzc.models.moe import MoEExperts


class Attention(nn.Module):
    """Self-attention with separate q/k/v/o projections, heads taken from the projections' width (`view(..., -1,
    head_dim)`, as transformers' models write it), so that column-sharded q/k/v run the local heads."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float):
        super().__init__()
        self.input_layernorm = HFRMSNorm(hidden, eps)
        self.attn = Attention(hidden, heads)
        self.post_attention_layernorm = HFRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x):
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TPDecoder(nn.Module):
    """A Llama-style decoder (HF RMSNorm spelling) whose projections shard the standard way: `tp_plan` names them
    in transformers' vocabulary (colwise: output features split; rowwise: input features split, then all-reduce)."""

    tp_plan = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
               "layers.*.attn.o": "rowwise", "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise",
               "layers.*.mlp.down": "rowwise"}

    def __init__(self, hidden: int = 64, heads: int = 4, intermediate: int = 128, layers: int = 2, vocab: int = 128,
                 eps: float = 1e-6):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, intermediate, eps) for _ in range(layers))
        self.norm = HFRMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_tp_decoder(dtype: torch.dtype = torch.float32, seed: int = 0, **sizes) -> TPDecoder:
    """A TPDecoder with seeded random weights (norm weights around 1), the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    model = TPDecoder(**sizes)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else noise * param.shape[-1] ** -0.5)
    return model.to(dtype).eval()


def tp_decoder_example(batch: int = 2, seq: int = 8):
    """(TPDecoder in fp32, (token ids,)): what `dzc-dump dzc.models.distributed:tp_decoder_example --tp 2` shards."""
    return build_tp_decoder(), (torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1)),)


def _planned(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style, for the modules the plan's patterns ('layers.*.mlp.down') name."""
    import fnmatch  # noqa: PLC0415

    return {name: style for name, _ in model.named_modules() for pattern, style in plan.items()
            if fnmatch.fnmatchcase(name, pattern)}


def parallelize(model: nn.Module, mesh, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard `model` in place over the 1-D device mesh with torch.distributed.tensor.parallel.parallelize_module:
    each "colwise" module gets ColwiseParallel, each "rowwise" RowwiseParallel (its all-reduce ends the
    projection). The plan defaults to the model's `tp_plan`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = _planned(model, plan if plan is not None else model.tp_plan)
    return parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})


class _ColumnShard(nn.Module):
    """The rows of a linear layer's weight this rank computes (its output features); no communication."""

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, dim=0)[rank].clone(), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


class _RowShard(nn.Module):
    """The columns of a linear layer's weight this rank holds (its input features), then the all-reduce of the
    partial sums, written with torch.distributed's functional collectives."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, dim=1)[rank].clone(), requires_grad=False)
        self.group = group

    def forward(self, x):
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)


def shard_by_hand(model: nn.Module, rank: int, world: int, group, plan: dict[str, str] | None = None) -> nn.Module:
    """`parallelize`'s sharding written by hand: the planned linear layers replaced (in place) by their shards, the
    row-parallel ones ending in funcol.all_reduce."""
    for name, style in _planned(model, plan if plan is not None else model.tp_plan).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        setattr(parent, child, _ColumnShard(linear, rank, world) if style == "colwise"
                else _RowShard(linear, rank, world, group))
    return model


class _ShardedIndexer(Indexer):
    """The lightning indexer over this rank's index heads (query and head-weight projections column-split by
    head), its partial head sums all-reduced: every rank then ranks the same scores."""

    def __init__(self, indexer: Indexer, rank: int, world: int, group):
        super().__init__(indexer.cfg)
        for name, module in indexer.named_children():  # copies: each keeps its dtype (the norm's fp32 weights)
            setattr(self, name, copy.deepcopy(module))
        self.wq_b, self.weights_proj = (_ColumnShard(p, rank, world) for p in (indexer.wq_b, indexer.weights_proj))
        self.group = group

    def head_sum(self, weights, scores):
        return funcol.all_reduce(super().head_sum(weights, scores), "sum", self.group)


def shard_dsa_attention(layer: DSAAttention, rank: int, world: int, group, shard_indexer: bool = False):
    """A copy of a DSA attention layer computing this rank's share of its heads, the way DeepSeek-V3.2's
    reference inference code runs under tensor parallelism: the query up-projection (wq_b) and the latent's
    per-head up-projection (wkv_b) column-split by head, the output projection (wo) row-split and all-reduced;
    the q/kv down-projections, their norms and the lightning indexer replicated (its projections are plain
    Linear layers there: every rank computes all index heads, so every rank selects the same top-k), and so is
    the latent cache (one latent KV head: each rank keeps the whole cache). shard_indexer: the indexer's heads
    split too, as later DeepSeek code does (column-parallel indexer projections), their scores all-reduced."""
    cfg = layer.cfg
    if cfg.heads % world or (shard_indexer and cfg.index_heads % world):
        raise ValueError(f"shard_dsa_attention: {cfg.heads} heads ({cfg.index_heads} index heads) over {world} "
                         f"ranks: the heads it splits must divide evenly")
    local = copy.deepcopy(layer)
    local.cfg = replace(cfg, heads=cfg.heads // world)
    local.wq_b, local.wkv_b = (_ColumnShard(linear, rank, world) for linear in (layer.wq_b, layer.wkv_b))
    local.wo = _RowShard(layer.wo, rank, world, group)
    if shard_indexer:
        local.indexer = _ShardedIndexer(layer.indexer, rank, world, group)
    return local


class ExpertParallelMoE(nn.Module):
    """An MoE block with its experts partitioned across the ranks of `group` (rank r holds experts [r·E/W,
    (r+1)·E/W)), each rank routing its own tokens, written as expert-parallel code is:

        route -> sort (token, slot) pairs by expert -> exchange counts -> all_to_all_single the rows, expert ids
        and routing weights (variable splits) -> local experts (the single-device experts module over E/W
        experts: dzc fuses it into dzc.mxfp4_moe) -> all_to_all_single the results back -> sum each token's slots.

    Equals `block` on the same tokens; the sum over a token's slots runs in ascending expert order, as the
    single-device per-expert loop adds them."""

    def __init__(self, block, rank: int, world: int, group):
        super().__init__()
        cfg = block.cfg
        if cfg.experts % world or block.shared is not None:
            raise ValueError(f"ExpertParallelMoE: {cfg.experts} experts over {world} ranks, shared expert "
                             f"{block.shared is not None}: experts must divide evenly, no shared expert")
        self.router, self.world, self.group = block.router, world, group
        self.local_experts = cfg.experts // world
        self.first = rank * self.local_experts
        full, part = block.experts, slice(self.first, self.first + self.local_experts)
        self.experts = MoEExperts(replace(cfg, experts=self.local_experts), full.compute_dtype)
        bias = (lambda b: None if b is None else b.detach()[part])
        self.experts.load_mxfp4(mxfp4.MXFP4Experts(
            mxfp4.MXFP4Weight(full.gate_up_blocks[part], full.gate_up_scales[part]),
            mxfp4.MXFP4Weight(full.down_blocks[part], full.down_scales[part]),
            bias(full.gate_up_bias), bias(full.down_bias), interleaved=cfg.gate_up_interleaved))

    def forward(self, x):
        topk_ids, topk_weights = self.router(x)
        slots = topk_ids.shape[1]
        ids = topk_ids.reshape(-1)
        order = torch.argsort(ids, stable=True)
        ids = ids[order]
        owners = torch.arange(self.world, device=x.device)
        send = (ids[:, None] // self.local_experts == owners).sum(0)
        receive = funcol.all_to_all_single(send, None, None, self.group)
        send_splits, receive_splits = send.tolist(), receive.tolist()
        source = order // slots

        def dispatch(t):
            return funcol.all_to_all_single(t, receive_splits, send_splits, self.group)

        rows = dispatch(x[source])
        local_ids = dispatch(ids) - self.first
        weights = dispatch(topk_weights.reshape(-1)[order])
        y = self.experts(rows, local_ids[:, None], weights[:, None])
        back = funcol.all_to_all_single(y, send_splits, receive_splits, self.group)
        return torch.zeros_like(x).index_add_(0, source, back)


class TensorParallelDecoderLayer(nn.Module):
    """A DSA + MoE decoder layer (dzc.models.multimodal.DecoderLayer) across the ranks of `group`: attention over
    this rank's heads (shard_dsa_attention: its output projection row-split and all-reduced, so every rank holds
    every token's hidden state), the MoE's experts split (ExpertParallelMoE) with each rank routing a contiguous
    1/world share of the tokens, and the shares' results summed across the ranks (an all-reduce of the share
    placed among zero rows: an all-gather of uneven shares). Equals `layer` on the same inputs; the norms are
    replicated."""

    def __init__(self, layer, rank: int, world: int, group, shard_indexer: bool = False):
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.input_layernorm = copy.deepcopy(layer.input_layernorm)
        self.attn = shard_dsa_attention(layer.attn, rank, world, group, shard_indexer)
        self.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm)
        self.mlp = ExpertParallelMoE(layer.mlp, rank, world, group)

    def forward(self, x, positions, block_table, slots, cache):
        x = x + self.attn(self.input_layernorm(x), positions, block_table, slots, cache)
        h = self.post_attention_layernorm(x).reshape(-1, x.shape[-1])
        tokens = h.shape[0]
        start, end = self.rank * tokens // self.world, (self.rank + 1) * tokens // self.world
        share = F.pad(self.mlp(h[start:end]), (0, 0, start, tokens - end))
        return x + funcol.all_reduce(share, "sum", self.group).view_as(x)
