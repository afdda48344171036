"""A DeepSeek-V3.2-style attention layer (MLA + lightning indexer + sparse top-k mask) over dzc's paged KV cache.

Written the way upstream reference code writes DSA (DeepSeek-V3.2-Exp inference/model.py; kernels.md §1):
- MLA with a q LoRA, a KV latent (512) + a shared RoPE key (64), 128 heads, interleaved RoPE. Attention runs in
  the absorbed (MQA) form upstream uses for decode and FlashMLA for both phases: the query's no-RoPE part is
  multiplied into the latent space, every head attends over the same 576-wide latent row, V is its first 512.
- The lightning indexer: 64 heads x 128, one key per token shared by all index heads, LayerNorm on the key,
  half-split (NeoX) RoPE (the trap of kernels.md §1.2: MLA stays interleaved), per-head weights, ReLU(q.k)
  weighted and summed over heads, causal, top-k 2048 (the bf16 form transformers uses: no Hadamard, no FP8 q).
- The sparse mask as upstream spells it: index_mask = full(-inf).scatter_(-1, topk, 0), plus the causal mask,
  added to dense attention scores. This is the O(context x queries) form dzc's fuse_sparse_attention replaces.

State lives in a dzc.kv_cache.PagedKVCache: the layer writes its new latent rows and indexer keys at the slots
the cache reserved (in place, `index_put_`), then reads every sequence's rows back through the block table
(`cache[block_table].flatten(1, 2)`: the eager spelling of a paged read; the dense context length is
max_pages * page_size, positions past a sequence's length are masked by causality). The block table width, not
a Python int, carries the context length, so a growing context is a dynamic size and does not recompile.
Eagerly the writes touch only the new rows. In a compiled graph AOTAutograd functionalizes them (index_put into
a new cache value, copied back into the cache argument by a `copy_` at the end of the graph); the pass
reinplace_cache_writes turns them back into in-place writes of the new rows and drops the copy, so a compiled
step does not copy the layer's cache either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dzc.kv_cache import DSACacheConfig, PagedKVCache, gather_index_keys, write_index_keys


@dataclass(frozen=True)
class DSAConfig:
    hidden: int = 7168
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def cache_config(self, layers: int = 1) -> DSACacheConfig:
        return DSACacheConfig(layers, self.kv_lora_rank, self.qk_rope_head_dim, self.index_head_dim)


# DeepSeek-V3.2-Exp's attention dimensions (config_671B_v3.2.json).
DEEPSEEK_V32 = DSAConfig()
# Small enough for CPU tests: 8 index heads make an all-zero (tied) index score unlikely.
TINY_DSA = DSAConfig(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                     v_head_dim=16, index_heads=8, index_head_dim=16, index_topk=8)


class RMSNorm(nn.Module):
    """DeepSeek's RMSNorm: fp32 math, fp32 weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, dim // 2] for positions (any int shape)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's RoPE: pairs (x0, x1), (x2, x3), ... rotated as complex numbers (DeepSeek's apply_rotary_emb)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer's RoPE: NeoX/half-split, x[:d/2] paired with x[d/2:] (not interleaved; kernels.md §1.2)."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=cfg.eps)
        self.weights_proj = nn.Linear(cfg.hidden, cfg.index_heads, bias=False)

    def _rope(self, x, cos, sin):
        rope = self.cfg.qk_rope_head_dim
        return torch.cat((rope_half_split(x[..., :rope], cos, sin), x[..., rope:]), dim=-1)

    def forward(self, x, q_latent, cos, sin, slots, block_table, index_cache, mask):
        cfg = self.cfg
        batch, seq, _ = x.shape
        # Heads from the projection's width: a rank whose projection holds a share of the heads scores those.
        q = self.wq_b(q_latent).view(batch, seq, -1, cfg.index_head_dim)
        q = self._rope(q, cos[:, :, None], sin[:, :, None])
        # LayerNorm in fp32 and back, as DeepSeek's reference does (its weights stay fp32; CUDA's layer_norm
        # does not mix dtypes). One key per token, shared by all index heads: [B, S, D].
        k_proj = self.wk(x)
        k = self._rope(self.k_norm(k_proj.float()).to(k_proj.dtype), cos, sin)
        write_index_keys(index_cache, slots, k.reshape(-1, cfg.index_head_dim))
        keys = gather_index_keys(index_cache, block_table, cfg.index_head_dim)  # [B, context, D] fp32
        weights = self.weights_proj(x).float() * (cfg.index_heads ** -0.5 * cfg.index_head_dim ** -0.5)
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).unsqueeze(1)))  # [B, S, H, context]
        logits = self.head_sum(weights, scores) + mask  # [B, S, context]
        return logits.topk(min(cfg.index_topk, logits.shape[-1]), dim=-1).indices

    def head_sum(self, weights, scores):
        """The index score: the heads' ReLU scores weighted and summed."""
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class DSAAttention(nn.Module):
    """One DSA attention layer; `layer` picks its caches in the PagedKVCache."""

    def __init__(self, cfg: DSAConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.v_head_dim, cfg.hidden, bias=False)
        self.indexer = Indexer(cfg)
        self.softmax_scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5

    def forward(self, x, positions, block_table, slots, cache: PagedKVCache):
        """x [B, S, hidden]; positions int64 [B, S] of the new tokens; block_table int32 [B, pages]; slots int64
        [B * S], where cache.reserve put the new tokens."""
        cfg = self.cfg
        batch, seq, _ = x.shape
        lora, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        cos, sin = rope_angles(positions, rope, cfg.rope_theta)

        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(batch, seq, cfg.heads, cfg.qk_nope_head_dim + rope)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, rope], dim=-1)
        q_pe = rope_interleaved(q_pe, cos[:, :, None], sin[:, :, None])
        kv_latent, k_pe = self.wkv_a(x).split([lora, rope], dim=-1)
        latent = torch.cat((self.kv_norm(kv_latent), rope_interleaved(k_pe, cos, sin)), dim=-1)

        latent_cache = cache.latent[self.layer]
        latent_cache.view(-1, lora + rope)[slots] = latent.reshape(-1, lora + rope).to(latent_cache.dtype)
        context = latent_cache[block_table.long()].flatten(1, 2)  # [B, pages * page_size, 1, 576]

        # Causal over each sequence's positions; keys past a sequence's length sit at later positions.
        key_positions = torch.arange(context.shape[1], device=x.device)
        mask = torch.where(key_positions <= positions[..., None], 0.0, float("-inf"))  # [B, S, context]
        topk = self.indexer(x, q_latent, cos, sin, slots, block_table, cache.index_keys[self.layer], mask)
        index_mask = torch.full_like(mask, float("-inf")).scatter_(-1, topk, 0) + mask

        # Absorbed MLA: q_nope moves into the latent space; all heads share the latent K (V = its first 512).
        w_kv_b = self.wkv_b.weight.view(cfg.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, lora)
        w_uk, w_uv = w_kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        q_absorbed = torch.cat((torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_pe), dim=-1)
        keys = context.transpose(1, 2)  # [B, 1, context, 576]
        scores = torch.matmul(q_absorbed.transpose(1, 2), keys.transpose(-1, -2)) * self.softmax_scale
        scores = scores + index_mask.unsqueeze(1)  # [B, H, S, context]
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype)
        out_latent = torch.matmul(probs, keys[..., :lora])  # [B, H, S, 512]
        out = torch.einsum("bhsc,hdc->bshd", out_latent, w_uv)
        return self.wo(out.flatten(2))


def build_dsa_attention(cfg: DSAConfig = TINY_DSA, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> DSAAttention:
    """A layer with seeded random weights (norm weights too); norms keep fp32 weights as upstream does."""
    generator = torch.Generator().manual_seed(seed)
    model = DSAAttention(cfg)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else noise * param.shape[-1] ** -0.5)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.float()
    return model.eval()


class DSASession:
    """Drives a DSA layer over a paged cache: prefill prompts, then decode steps, one call per step.

    `step(model, x)` reserves slots for x's tokens in every sequence, builds the step's positions, block table
    and slots, and calls model(x, positions, block_table, slots, cache)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    def inputs(self, x: torch.Tensor, sequences: list[int] | None = None) -> tuple:
        """The model's arguments for x [len(sequences), S, hidden]: S new tokens for each of `sequences` (default
        all; a subset prefills sequences to different lengths)."""
        sequences = list(range(self.cache.batch)) if sequences is None else sequences
        if x.shape[0] != len(sequences):
            raise ValueError(f"x has {x.shape[0]} rows for {len(sequences)} sequences")
        seq = x.shape[1]
        starts = [self.cache.lengths[b] for b in sequences]
        counts = [seq if b in sequences else 0 for b in range(self.cache.batch)]
        if sequences != sorted(set(sequences)):
            raise ValueError(f"sequences must be distinct and ascending (the order of the slots), got {sequences}")
        slots = self.cache.reserve(counts)
        positions = torch.tensor([[start + i for i in range(seq)] for start in starts], dtype=torch.int64,
                                 device=x.device)
        return x, positions, self.cache.block_table[sequences], slots, self.cache

    def step(self, model, x: torch.Tensor, sequences: list[int] | None = None) -> torch.Tensor:
        return model(*self.inputs(x, sequences))


def build_dsa_example(seq: int = 16, batch: int = 2, fp8_index: bool = False, max_pages: int = 16):
    """(layer, example inputs of a prefill step on a fresh paged cache): the MODELS entry."""
    model = build_dsa_attention()
    cache = PagedKVCache(TINY_DSA.cache_config(), max_pages, batch, fp8_index)
    x = torch.randn(batch, seq, TINY_DSA.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    return model, DSASession(cache).inputs(x)


def tiny_hf_deepseek_v32_config(attn_implementation: str = "eager"):
    """A tiny transformers DeepseekV32Config (built offline): 1 layer, 2 heads, 8 index heads, top-k 4."""
    from transformers import DeepseekV32Config  # noqa: PLC0415 (transformers is a test dependency)

    return DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=128,
        attn_implementation=attn_implementation)


def build_hf_deepseek_v32(seq: int = 6, batch: int = 2, attn_implementation: str = "eager", seed: int = 0):
    """(transformers DeepseekV32ForCausalLM with seeded random weights, (input_ids,))."""
    from transformers import DeepseekV32ForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(tiny_hf_deepseek_v32_config(attn_implementation)).eval()
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)


def build_hf_glm_moe_dsa(seq: int = 6, batch: int = 2, attn_implementation: str = "eager", seed: int = 0):
    """(transformers GlmMoeDsaForCausalLM with seeded random weights, (input_ids,)): DeepseekV32's DSA with an
    interleaved-RoPE indexer and the top-k put into the causal mask with masked_fill(finfo.min). 2 index heads, so
    that indexer scores tie at exactly 0 (every head's ReLU zero) and top-k tie-breaking is exercised."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: PLC0415

    config = GlmMoeDsaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=128,
        attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config).eval()
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)
