"""Reference decoder stacks written the way upstream model code writes them, for tests, dumps and the demo.

Two spellings of the residual + RMSNorm that dzc's first fusion targets:
- "hf": HF transformers Llama style. The residual add runs in the activations' dtype; RMSNorm upcasts to fp32,
  `pow(2).mean(-1)`, `rsqrt`, casts back, then multiplies by the weight.
- "deepseek": DeepSeek-V3 reference style. The norm takes the residual stream: `x.float() + residual.float()`,
  normalises the fp32 sum, multiplies by an fp32 weight, and returns `(y, residual)` cast back. The residual of
  layer i feeds the first norm of layer i+1 (the cross-layer residual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderConfig:
    hidden: int = 64
    heads: int = 4
    intermediate: int = 128
    layers: int = 2
    vocab: int = 256
    eps: float = 1e-6
    norm_style: str = "hf"  # "hf" | "deepseek"


class HFRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, as written there."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class AddRMSNorm(nn.Module):
    """One residual add and the HF RMSNorm after it, returning (normed, sum): the smallest module the residual
    fusion applies to (tests, benchmarks). The weight is drawn around 1: ones would hide a missing multiply."""

    def __init__(self, hidden: int = 64, eps: float = 1e-6):
        super().__init__()
        self.norm = HFRMSNorm(hidden, eps)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


class DeepSeekRMSNorm(nn.Module):
    """DeepSeek-V3 reference RMSNorm: fp32 weight, optional fused residual stream."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.float32))

    def forward(self, x, residual=None):
        dtype = x.dtype
        if residual is None:
            x = x.float()
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            return (self.weight * x).to(dtype)
        x = residual = x.float() + residual.float()
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return (self.weight * x).to(dtype), residual.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class HFLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = HFRMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = HFRMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class DeepSeekLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = DeepSeekRMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = DeepSeekRMSNorm(cfg.hidden, cfg.eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, residual):
        if residual is None:
            x, residual = self.attn_norm(x), x
        else:
            x, residual = self.attn_norm(x, residual)
        x = self.attn(x)
        x, residual = self.ffn_norm(x, residual)
        return self.ffn(x), residual


class Decoder(nn.Module):
    """Embedding, `layers` decoder layers, final norm, LM head; input token ids [batch, seq]."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        if cfg.norm_style == "hf":
            self.layers = nn.ModuleList(HFLayer(cfg) for _ in range(cfg.layers))
            self.norm = HFRMSNorm(cfg.hidden, cfg.eps)
        elif cfg.norm_style == "deepseek":
            self.layers = nn.ModuleList(DeepSeekLayer(cfg) for _ in range(cfg.layers))
            self.norm = DeepSeekRMSNorm(cfg.hidden, cfg.eps)
        else:
            raise ValueError(f"norm_style must be 'hf' or 'deepseek', not {cfg.norm_style!r}")
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.cfg.norm_style == "hf":
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        x, _ = self.norm(x, residual)
        return self.head(x)


def build_decoder(cfg: DecoderConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> Decoder:
    """A decoder with seeded random weights (norm weights too, so that a wrong weight shows), in `dtype`;
    DeepSeek-style norms keep their fp32 weights as the reference code does."""
    generator = torch.Generator().manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 1:  # norm weights: around 1
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)
    model.to(dtype)
    if cfg.norm_style == "deepseek":
        for module in model.modules():
            if isinstance(module, DeepSeekRMSNorm):
                module.weight.data = module.weight.data.float()
    return model.eval()
