"""A reference MoE block written the way upstream model code writes it, with expert weights in MXFP4.

    router:  logits = x @ Wr^T (+ br); scores = softmax(logits) or sigmoid(logits); topk; optional renormalisation
    experts: y = sum_j w_j * down_e(act(gate_up_e(x))), e = topk_ids[:, j]  (+ an optional shared expert)

Expert weights follow the gpt-oss layout: gate_up [E, 2I, H] (gate/up rows interleaved or concatenated), down
[E, H, I], optional biases. Held either as plain parameters ("bf16": what a BF16 checkpoint gives) or as MXFP4
buffers ("mxfp4": blocks + scales, see dzc.mxfp4). In MXFP4 the eager forward dequantizes the whole weight through
the op `dzc::mxfp4_dequantize` and multiplies: that is the meaning a compiled model must reproduce; the
fuse_mxfp4_experts pass turns it into one dzc.mxfp4_moe node that never materialises the dequantized weights.

The expert loop has two spellings (`expert_loop`):
- "per_expert": `for e in range(E): tokens, slots = torch.where(topk_ids == e); ...; out.index_add_(...)` (the
  DeepSeek-V3 reference and transformers' eager experts loop over the experts the same way). The loop bound is
  the static E; each `torch.where` is data dependent (aten.nonzero), which Dynamo captures in one graph only with
  `capture_dynamic_output_shape_ops` (CompileOptions.capture_dynamic_output_shapes, on by default); upstream's
  variants that loop over `expert_hit.nonzero()` or skip empty experts with `.tolist()` graph-break instead
  (transformers' eager GptOss experts do), so dzc spells it this way.
- "gathered_bmm": every (token, slot) pair gathers its expert's weights (`w[topk_ids.flatten()]`) and runs one
  bmm (transformers' batched_mm experts); no data-dependent shapes, so it captures without special settings.

Activations: "silu_glu" (silu(gate) * up) and "clamped_swiglu" (gpt-oss: gate = min(gate, limit),
up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dzc import mxfp4


@dataclass(frozen=True)
class MoEConfig:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid" over all experts, before top-k
    renormalize: bool = True  # divide the k weights by their sum
    activation: str = "clamped_swiglu"  # "silu_glu" | "clamped_swiglu"
    gate_up_interleaved: bool = True
    expert_bias: bool = True
    router_bias: bool = True
    shared_expert: bool = False  # one dense SwiGLU expert of `intermediate` added to every token (DeepSeek)
    alpha: float = 1.702
    limit: float = 7.0
    expert_loop: str = "per_expert"  # "per_expert" | "gathered_bmm"


# Named configurations. gpt-oss-120b: E=128, top-4, hidden 2880, intermediate 2880, softmax over the top-4 logits
# (= softmax, top-k, renormalise), clamped SwiGLU, biases, interleaved gate/up. DeepSeek-style: E=256, top-8,
# hidden 7168, intermediate 2048, sigmoid scoring with renormalisation, plain SwiGLU, a shared expert.
CONFIGS = {
    "gpt-oss-120b": MoEConfig(hidden=2880, intermediate=2880, experts=128, top_k=4),
    "deepseek-style": MoEConfig(hidden=7168, intermediate=2048, experts=256, top_k=8, scoring="sigmoid",
                                activation="silu_glu", gate_up_interleaved=False, expert_bias=False,
                                router_bias=False, shared_expert=True),
}
CONFIGS["tiny-gptoss"] = replace(CONFIGS["gpt-oss-120b"], hidden=64, intermediate=32, experts=4, top_k=2)
CONFIGS["tiny-deepseek"] = replace(CONFIGS["deepseek-style"], hidden=64, intermediate=32, experts=8, top_k=3)


class MoEExperts(nn.Module):
    """E SwiGLU experts; weights as parameters ("bf16") or MXFP4 buffers ("mxfp4")."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.experts
        self.compute_dtype = dtype
        self.weight_format = "bf16"
        e, h, i = cfg.experts, cfg.hidden, cfg.intermediate
        self.gate_up_weight = nn.Parameter(torch.randn(e, 2 * i, h, dtype=dtype) * h**-0.5)
        self.down_weight = nn.Parameter(torch.randn(e, h, i, dtype=dtype) * i**-0.5)
        if cfg.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.randn(e, 2 * i, dtype=dtype) * 0.1)
            self.down_bias = nn.Parameter(torch.randn(e, h, dtype=dtype) * 0.1)
        else:
            self.gate_up_bias = self.down_bias = None

    # --- weights -------------------------------------------------------------------------------------------
    def quantize(self) -> None:
        """Replace the float weights by MXFP4 (used by dzc.mxfp4.quantize_experts)."""
        self.load_mxfp4(mxfp4.MXFP4Experts(mxfp4.MXFP4Weight.from_float(self.gate_up_weight.detach()),
                                           mxfp4.MXFP4Weight.from_float(self.down_weight.detach()),
                                           interleaved=self.cfg.gate_up_interleaved))

    def load_mxfp4(self, experts: mxfp4.MXFP4Experts) -> None:
        """Hold `experts` (packed) instead of the float weights; biases are taken when given."""
        e, h, i = self.cfg.experts, self.cfg.hidden, self.cfg.intermediate
        if experts.gate_up.shape != (e, 2 * i, h):
            raise ValueError(f"MoEExperts: gate_up {experts.gate_up.shape} does not fit E={e}, 2I={2 * i}, H={h}")
        if experts.interleaved != self.cfg.gate_up_interleaved:
            raise ValueError("MoEExperts: the packed gate/up row order differs from the config's")
        for name in ("gate_up_weight", "down_weight"):
            self._parameters.pop(name, None)
        self.register_buffer("gate_up_blocks", experts.gate_up.blocks)
        self.register_buffer("gate_up_scales", experts.gate_up.scales)
        self.register_buffer("down_blocks", experts.down.blocks)
        self.register_buffer("down_scales", experts.down.scales)
        if experts.gate_up_bias is not None:
            self.gate_up_bias = nn.Parameter(experts.gate_up_bias.to(self.compute_dtype), requires_grad=False)
        if experts.down_bias is not None:
            self.down_bias = nn.Parameter(experts.down_bias.to(self.compute_dtype), requires_grad=False)
        self.weight_format = "mxfp4"

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in the compute dtype; dequantized when held in MXFP4."""
        if self.weight_format == "bf16":
            return self.gate_up_weight, self.down_weight
        dequantize = torch.ops.dzc.mxfp4_dequantize
        return (dequantize(self.gate_up_blocks, self.gate_up_scales, self.compute_dtype),
                dequantize(self.down_blocks, self.down_scales, self.compute_dtype))

    # --- forward -------------------------------------------------------------------------------------------
    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.gate_up_interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if cfg.activation == "silu_glu":
            return F.silu(gate) * up
        gate = gate.clamp(min=None, max=cfg.limit)
        up = up.clamp(min=-cfg.limit, max=cfg.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * cfg.alpha))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.cfg.expert_loop == "per_expert":
            return self._per_expert(x, topk_ids, topk_weights)
        return self._gathered_bmm(x, topk_ids, topk_weights)

    def _per_expert(self, x, topk_ids, topk_weights):
        gate_up_weight, down_weight = self.weights()
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tokens, slots = torch.where(topk_ids == e)
            gate_up = x[tokens] @ gate_up_weight[e].t()
            if self.gate_up_bias is not None:
                gate_up = gate_up + self.gate_up_bias[e]
            y = self.activation(gate_up) @ down_weight[e].t()
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out.index_add_(0, tokens, y * topk_weights[tokens, slots, None])
        return out

    def _gathered_bmm(self, x, topk_ids, topk_weights):
        gate_up_weight, down_weight = self.weights()
        tokens, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        gate_up = torch.bmm(gate_up_weight[ids], rows).squeeze(-1)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[ids]
        y = torch.bmm(down_weight[ids], self.activation(gate_up).unsqueeze(-1)).squeeze(-1)
        if self.down_bias is not None:
            y = y + self.down_bias[ids]
        y = y * topk_weights.reshape(-1, 1)
        return y.view(tokens, k, -1).sum(dim=1)


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, dtype=dtype) * cfg.hidden**-0.5)
        self.bias = nn.Parameter(torch.randn(cfg.experts, dtype=dtype) * 0.1) if cfg.router_bias else None

    def forward(self, x):
        logits = F.linear(x, self.weight, self.bias).float()
        scores = logits.softmax(dim=-1) if self.cfg.scoring == "softmax" else logits.sigmoid()
        topk_weights, topk_ids = torch.topk(scores, self.cfg.top_k, dim=-1)
        if self.cfg.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights.to(x.dtype)


class SharedExpert(nn.Module):
    def __init__(self, cfg: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False, dtype=dtype)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoEBlock(nn.Module):
    """x [..., H] -> [..., H]: router, routed experts, optional shared expert."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, dtype)
        self.experts = MoEExperts(cfg, dtype)
        self.shared = SharedExpert(cfg, dtype) if cfg.shared_expert else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.router(x)
        y = self.experts(x, topk_ids, topk_weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)


def build_moe(cfg: MoEConfig | str, dtype: torch.dtype = torch.bfloat16, weight_format: str = "mxfp4",
              seed: int = 0) -> MoEBlock:
    """An MoEBlock with seeded random weights, its experts in `weight_format` ("mxfp4" or "bf16")."""
    if isinstance(cfg, str):
        cfg = CONFIGS[cfg]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        block = MoEBlock(cfg, dtype).eval()
    if weight_format == "mxfp4":
        mxfp4.quantize_experts(block)
    elif weight_format != "bf16":
        raise ValueError(f"weight_format must be 'mxfp4' or 'bf16', not {weight_format!r}")
    return block



def build_moe_example(seq: int = 16, batch: int = 2, cfg: MoEConfig | str = "tiny-gptoss"):
    """(MoEBlock with MXFP4 experts in bf16, (x [batch * seq, hidden],)): the MODELS entry."""
    block = build_moe(cfg)
    x = torch.randn(batch * seq, block.cfg.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    return block, (x,)
