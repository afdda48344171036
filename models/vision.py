"""Reference vision encoders written the way upstream code writes them (Qwen2.5-VL's vision tower, MoonViT).

The patches of every image of a request are packed into one sequence; `cu_seqlens` (int32, [images + 1]) marks
where each image starts. Blocks are pre-norm transformer blocks with residuals (LayerNorm or RMSNorm), axial 2D
rotary embedding in HF's vision convention, non-causal attention restricted to each image — or, in window layers,
to windows of `window` × `window` patches inside each image (`cu_window_seqlens`) — and an MLP. At the end a
patch merger concatenates each 2×2 block of patches and projects it into the language model's embedding space.

Attention is spelled three ways, as upstream code does (`VisionConfig.attention`):
- "split": `lengths = cu_seqlens[1:] - cu_seqlens[:-1]`, `torch.split(q, lengths.tolist())` for q, k, v, one
  attention per image, `torch.cat` (transformers' Qwen2/2.5-VL and GLM-4V non-flash path).
- "mask": one attention over the whole pack with a block-diagonal mask built from cu_seqlens (segment ids of
  the tokens compared pairwise; older Qwen2-VL code and many ViT ports).
and each with `sdpa=True` (F.scaled_dot_product_attention) or `sdpa=False` (matmul, softmax, matmul).

Everything that depends on the images' sizes (cu_seqlens, rotary positions, window order) is computed outside
the model by `pack_images`, as transformers' `vision_utils` helpers do, so the model itself sees only tensors:
one captured graph serves any number of images of any sizes with the "mask" spelling; the "split" spelling's
per-image Python loop is unrolled by Dynamo, so it gets a graph per image (and window) count (docs/vision.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dzc.models.decoder import HFRMSNorm
from dzc.ops.varlen_attention import apply_vision_rotary


@dataclass(frozen=True)
class VisionConfig:
    hidden: int
    heads: int
    intermediate: int
    layers: int
    out_hidden: int  # the language model's embedding size (the projector's output)
    patch: int = 14  # pixels per patch side
    in_channels: int = 3
    merge: int = 2  # the patch merger concatenates merge × merge patches
    norm: str = "rms"  # "rms" (HF RMSNorm spelling) | "layer" (nn.LayerNorm)
    mlp: str = "swiglu"  # "swiglu" (Qwen2.5-VL) | "gelu" (MoonViT / SigLIP)
    # Window layers attend inside windows of window_patches × window_patches patches (Qwen2.5-VL: 112 px / 14 =
    # 8); None: every layer is a full-attention layer.
    window_patches: int | None = None
    full_attention_layers: tuple[int, ...] = ()  # with windows: the layers that attend over whole images
    attention: str = "split"  # "split" | "mask"
    sdpa: bool = True
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_window_layer(self, layer: int) -> bool:
        return self.window_patches is not None and layer not in self.full_attention_layers

    def __post_init__(self):
        if self.hidden % self.heads or self.head_dim % 4:
            raise ValueError(f"head_dim = hidden / heads must be a multiple of 4 (axial 2D RoPE), got "
                             f"{self.hidden} / {self.heads}")
        if self.window_patches is not None and self.window_patches % self.merge:
            raise ValueError(f"window_patches ({self.window_patches}) must be a multiple of merge ({self.merge})")
        for name, value, valid in (("norm", self.norm, ("rms", "layer")), ("mlp", self.mlp, ("swiglu", "gelu")),
                                   ("attention", self.attention, ("split", "mask"))):
            if value not in valid:
                raise ValueError(f"VisionConfig.{name} must be one of {valid}, got {value!r}")


# Qwen2.5-VL-7B's vision tower: 32 blocks, hidden 1280, 16 heads of 80, RMSNorm, SwiGLU; 112-pixel windows except
# in blocks 7, 15, 23, 31 (transformers' Qwen2_5_VLVisionConfig + the checkpoint's config.json).
QWEN25_VL_VISION = VisionConfig(hidden=1280, heads=16, intermediate=3420, layers=32, out_hidden=3584, patch=14,
                                norm="rms", mlp="swiglu", window_patches=8, full_attention_layers=(7, 15, 23, 31))
# Kimi-VL's MoonViT: 27 blocks, hidden 1152, 16 heads of 72, LayerNorm, GELU MLP, full attention everywhere,
# projected into a 2048-wide language model (Kimi-VL-A3B).
MOONVIT = VisionConfig(hidden=1152, heads=16, intermediate=4304, layers=27, out_hidden=2048, patch=14,
                       norm="layer", mlp="gelu")
# Tiny versions for tests (head_dim 16, 4-pixel patches, 4-patch windows): they run through Triton's interpreter.
TINY_QWEN_VISION = replace(QWEN25_VL_VISION, hidden=32, heads=2, intermediate=48, layers=2, out_hidden=24, patch=2,
                           window_patches=4, full_attention_layers=(1,))
TINY_MOONVIT = replace(MOONVIT, hidden=32, heads=2, intermediate=48, layers=2, out_hidden=24, patch=2)


@dataclass
class ImagePack:
    """The inputs of one request's images, packed: what the encoder's forward takes besides the patches."""

    patches: torch.Tensor  # [tokens, in_channels * patch * patch], window order (see window_index)
    cu_seqlens: torch.Tensor  # int32 [images + 1]
    positions: torch.Tensor  # int64 [tokens, 2]: (row, column) of each patch in its image, in window order
    window_index: torch.Tensor  # int64 [tokens / merge²]: window order -> merge-block order (argsort undoes it)
    cu_window_seqlens: torch.Tensor  # int32 [windows + 1]

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.patches, self.cu_seqlens, self.positions, self.window_index, self.cu_window_seqlens)


def pack_images(grids: list[tuple[int, int]], cfg: VisionConfig, dtype: torch.dtype = torch.float32,
                generator: torch.Generator | None = None) -> ImagePack:
    """Random patches for images of `grids` = [(rows, columns) of patches], packed as the encoder expects.

    Patches of an image are laid out merge-block-major (each merge × merge block contiguous, as the patch
    merger needs), then the merge blocks of the whole pack are reordered so that every attention window is
    contiguous (HF's `get_vision_window_index`); images stay contiguous and in order.
    """
    merge, unit = cfg.merge, cfg.merge * cfg.merge
    side = cfg.window_patches // merge if cfg.window_patches else None
    positions, window_index, window_lengths, seqlens, blocks_before = [], [], [], [], 0
    for rows, cols in grids:
        if rows % merge or cols % merge or rows <= 0 or cols <= 0:
            raise ValueError(f"image grid {rows}x{cols} patches is not a positive multiple of merge={merge}")
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        block = (rows // merge, merge, cols // merge, merge)
        positions.append(torch.stack([r.reshape(block).transpose(1, 2).flatten(),
                                      c.reshape(block).transpose(1, 2).flatten()], dim=-1))
        blocks = torch.arange(rows // merge * (cols // merge)).reshape(rows // merge, cols // merge) + blocks_before
        blocks_before += blocks.numel()
        seqlens.append(rows * cols)
        if side is None:  # no windows: one window per image
            window_index.append(blocks.flatten())
            window_lengths.append(rows * cols)
            continue
        for top in range(0, blocks.shape[0], side):
            for left in range(0, blocks.shape[1], side):
                window = blocks[top:top + side, left:left + side].flatten()
                window_index.append(window)
                window_lengths.append(window.numel() * unit)
    window_index = torch.cat(window_index)
    positions = torch.cat(positions).reshape(-1, unit, 2)[window_index].reshape(-1, 2)
    tokens = positions.shape[0]
    patches = torch.randn(tokens, cfg.in_channels * cfg.patch * cfg.patch, generator=generator).to(dtype)

    def cumulative(lengths):
        return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)

    return ImagePack(patches, cumulative(seqlens), positions, window_index, cumulative(window_lengths))


class VisionRotary(nn.Module):
    """Axial 2D RoPE: head_dim/4 frequencies for the row, the same for the column; cos/sin are [tokens, head_dim]
    laid out [row freqs, column freqs, row freqs, column freqs] for `rotate_half` (HF's vision convention)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        quarter = cfg.head_dim // 4
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(quarter, dtype=torch.float32) / quarter)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions):
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [tokens, 2 * quarter]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def block_diagonal_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens, tokens] bool: True where both tokens lie in the same segment of cu_seqlens."""
    segment = torch.searchsorted(cu_seqlens, torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype),
                                 right=True)
    return segment[:, None] == segment[None, :]


def attend(q, k, v, mask, scale, sdpa: bool):
    """q, k, v: [heads, tokens, head_dim] (one image or the whole pack with a mask) -> [heads, tokens, head_dim]."""
    if sdpa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cu_seqlens, cos, sin):
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3, self.cfg.heads, -1).unbind(1)  # [tokens, heads, head_dim]
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, tokens, head_dim]
        if self.cfg.attention == "mask":
            out = attend(q, k, v, block_diagonal_mask(cu_seqlens, tokens), self.scale, self.cfg.sdpa)
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            splits = [torch.split(t, lengths, dim=1) for t in (q, k, v)]
            out = torch.cat([attend(qi, ki, vi, None, self.scale, self.cfg.sdpa) for qi, ki, vi in zip(*splits)], dim=1)
        return self.proj(out.transpose(0, 1).reshape(tokens, -1))


def _norm(cfg: VisionConfig, width: int) -> nn.Module:
    return HFRMSNorm(width, cfg.eps) if cfg.norm == "rms" else nn.LayerNorm(width, eps=cfg.eps)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.hidden, (2 if self.gated else 1) * cfg.intermediate)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x):
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = _norm(cfg, cfg.hidden)
        self.attn = VisionAttention(cfg)
        self.norm2 = _norm(cfg, cfg.hidden)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, concatenate each merge × merge block of patches, and project into the language model's space."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden * cfg.merge * cfg.merge
        self.norm = _norm(cfg, cfg.hidden)
        self.fc1 = nn.Linear(self.width, self.width)
        self.fc2 = nn.Linear(self.width, cfg.out_hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x).reshape(-1, self.width))))


class VisionEncoder(nn.Module):
    """forward(*ImagePack.inputs()) -> [tokens / merge², out_hidden] image embeddings in merge-block order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.patch * cfg.patch, cfg.hidden, bias=False)
        self.rotary = VisionRotary(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.layers))
        self.merger = PatchMerger(cfg)

    def forward(self, patches, cu_seqlens, positions, window_index, cu_window_seqlens):
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        cos, sin = self.rotary(positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, cu_window_seqlens if self.cfg.is_window_layer(layer) else cu_seqlens, cos, sin)
        return self.merger(x)[torch.argsort(window_index)]


class AddLayerNorm(nn.Module):
    """One residual add and the nn.LayerNorm after it, returning (normed, sum): the smallest module the LayerNorm
    residual fusion applies to (tests, benchmarks). Weight around 1 and a random bias: ones and zeros would hide a
    missing affine step."""

    def __init__(self, hidden: int = 64, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=eps)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)
            self.norm.bias.normal_()

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


def build_vision_encoder(cfg: VisionConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> VisionEncoder:
    """Seeded random weights; norm weights (and LayerNorm biases) random too, so a missing one shows."""
    torch.manual_seed(seed)
    model = VisionEncoder(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model.to(dtype)


def build_vision_example(cfg: VisionConfig, grids=((2, 2), (2, 4), (4, 8))):
    """(encoder, inputs) for MODELS: the tiny config's encoder (fp32) and a pack of images of `grids`."""
    model = build_vision_encoder(cfg)
    return model, pack_images(list(grids), cfg, generator=torch.Generator().manual_seed(1)).inputs()
