"""A multimodal reference model: a vision encoder feeding a DSA + MXFP4-MoE decoder over a paged KV cache.

Written the way Qwen2.5-VL / Kimi-VL put images into a language model:
- the vision encoder (dzc.models.vision: packed images, axial 2D RoPE, pre-norm blocks, 2×2 patch merger and a
  projector into the language model's width) turns a request's images into rows of image features;
- the request's token ids hold one placeholder id (`image_token_id`) per image feature row; the text tokens are
  embedded and the image features are put at the placeholders in order (`masked_scatter`, transformers' Qwen-VL
  spelling), so the language model sees one sequence of text and image embeddings;
- the decoder: layers of pre-norm blocks with residuals (HF RMSNorm spelling, so that fuse_residual_norm fuses
  each residual add with the next norm, across layers too): DSA attention (dzc.models.dsa: MLA + lightning
  indexer + top-k sparse mask, reading and writing a dzc.kv_cache.PagedKVCache) and an MoE block with MXFP4
  experts (dzc.models.moe, gpt-oss layout, per-expert loop); a final norm and the LM head over each sequence's
  last position (what a serving engine samples from).

How it runs (`MultimodalSession`), as serving engines split it:
- one compiled module for the vision encoder, called once per request with images. The encoder uses the "mask"
  spelling of packed attention (docs/vision.md): one graph serves any image count and sizes, so the compile count
  stays 1 whatever packs arrive (the "split" spelling would re-trace per image count).
- the merge of image features into the text embeddings runs eagerly between the two (vLLM does the same: the
  multimodal embedding merge stays outside the compiled, CUDA-graphed language model);
- one compiled module for a decoder step (`DecoderStep`: embeddings in, last-position logits out, over the paged
  cache it owns). Prefill and decode go through the same compiled module with symbolic token counts; Dynamo
  specialises a size of 1, so a decode step (one token per sequence) gets its own graph: 2 graphs in all, reused
  by every later prefill (any length) and decode step (any context length: the block table's width is a dynamic
  size). Holding the cache as state, not as an argument, keeps every argument a tensor, so dzc's CUDA-graph runner
  can replay decode steps (the graph writes the cache in place, at the slots given).
`MultimodalModel.forward` is the whole prefill (images + text) in one call: the eager reference, and what
`dzc-dump multimodal` captures (one graph showing every fusion).

Configs (`CONFIGS`):
- "tiny": Qwen2.5-VL-style vision (hidden 32, 2 blocks: a window layer and a full-attention one), decoder hidden
  64, 2 layers of tiny DSA (4 heads, latent 32 + RoPE 16, top-k 8) and tiny gpt-oss MoE (4 experts, top-2): runs
  through Triton's interpreter on a CPU (tests, demo, dzc-dump --target cuda) and has legal MUSA configs for
  every kernel (dzc-dump --target musa).
- "h200": sized for one H200 benchmark (tools/bench_multimodal.py): Qwen2.5-VL-7B's vision dims (hidden 1280,
  16 heads × 80, 112-px windows) with 4 of its 32 blocks (the last a full-attention block), projected into a
  2880-wide decoder; 4 decoder layers (of gpt-oss-20b's 24) with gpt-oss-20b's MoE (32 experts, top-4, hidden =
  intermediate = 2880, clamped SwiGLU, biases) and DeepSeek-V3.2's DSA dims (MLA latent 512 + RoPE 64, q LoRA
  1536, indexer 64 heads × 128, top-k 2048) with gpt-oss's 64 attention heads; gpt-oss's vocabulary (201088).
  The layer counts are cut so that eager runs and torch.compile baselines compile in minutes; per layer, shapes
  and weight bytes are the real models'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from dzc import mxfp4
from dzc.api import compile as dzc_compile
from dzc.kv_cache import PagedKVCache
from dzc.models.decoder import HFRMSNorm
from dzc.models.dsa import DEEPSEEK_V32, TINY_DSA, DSAAttention, DSAConfig, DSASession
from dzc.models.dsa import RMSNorm as DSARMSNorm
from dzc.models.moe import CONFIGS as MOE_CONFIGS
from dzc.models.moe import MoEBlock, MoEConfig
from dzc.models.vision import QWEN25_VL_VISION, TINY_QWEN_VISION, ImagePack, VisionConfig, VisionEncoder, pack_images


@dataclass(frozen=True)
class MultimodalConfig:
    vision: VisionConfig  # its out_hidden is the decoder's width
    attention: DSAConfig
    moe: MoEConfig
    layers: int
    vocab: int
    image_token_id: int  # the placeholder id: one per image feature row in a request's token ids
    eps: float = 1e-6

    @property
    def hidden(self) -> int:
        return self.attention.hidden

    def __post_init__(self):
        widths = {"vision.out_hidden": self.vision.out_hidden, "attention.hidden": self.attention.hidden,
                  "moe.hidden": self.moe.hidden}
        if len(set(widths.values())) != 1:
            raise ValueError(f"the vision projector, DSA attention and MoE must share the decoder width: {widths}")
        if self.vision.attention != "mask":
            raise ValueError("MultimodalConfig.vision.attention must be 'mask': one vision graph for any image pack "
                             "(the 'split' spelling re-traces per image count; docs/vision.md)")
        if not 0 <= self.image_token_id < self.vocab:
            raise ValueError(f"image_token_id {self.image_token_id} is not in the vocabulary [0, {self.vocab})")


_GPT_OSS_20B_MOE = replace(MOE_CONFIGS["gpt-oss-120b"], experts=32)  # gpt-oss-20b: 32 experts, same shapes
CONFIGS = {
    # The tiny DSA with a 16-wide RoPE key: Dqk = 32 + 16 is whole 16-deep MMA steps, which the TileLang sparse
    # attention (MUSA's codegen) needs; TINY_DSA's 32 + 8 has no legal config there.
    "tiny": MultimodalConfig(vision=replace(TINY_QWEN_VISION, out_hidden=64, attention="mask"),
                             attention=replace(TINY_DSA, qk_rope_head_dim=16),
                             moe=MOE_CONFIGS["tiny-gptoss"], layers=2, vocab=256, image_token_id=255),
    "h200": MultimodalConfig(
        vision=replace(QWEN25_VL_VISION, layers=4, full_attention_layers=(3,), out_hidden=2880, attention="mask"),
        attention=replace(DEEPSEEK_V32, hidden=2880, heads=64), moe=_GPT_OSS_20B_MOE, layers=4, vocab=201088,
        image_token_id=200000),
}


_PLACEHOLDER_MISMATCH = "the image placeholders in input_ids (image_token_id) do not match the image feature rows"


class DecoderLayer(nn.Module):
    """Pre-norm block: x + DSA(norm(x)), then + MoE(norm(.)); the adds feed the next norms (residual fusion)."""

    def __init__(self, cfg: MultimodalConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = HFRMSNorm(cfg.hidden, cfg.eps)
        self.attn = DSAAttention(cfg.attention, layer)
        self.post_attention_layernorm = HFRMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MoEBlock(cfg.moe, dtype)

    def forward(self, x, positions, block_table, slots, cache: PagedKVCache):
        x = x + self.attn(self.input_layernorm(x), positions, block_table, slots, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """inputs_embeds [B, S, hidden] -> logits [B, vocab] of each sequence's last new token; the layers write the new
    tokens' latent rows and indexer keys into the cache at `slots` (see DSAAttention.forward for the arguments)."""

    def __init__(self, cfg: MultimodalConfig, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer, dtype) for layer in range(cfg.layers))
        self.norm = HFRMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, inputs_embeds, positions, block_table, slots, cache: PagedKVCache):
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, positions, block_table, slots, cache)
        return self.lm_head(self.norm(x)[:, -1])


class MultimodalModel(nn.Module):
    """Vision encoder + token embedding + language model. forward = one whole prefill (images and text)."""

    def __init__(self, cfg: MultimodalConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg.vision)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.language = LanguageModel(cfg, dtype)

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        """Text embeddings with the image features put at the placeholder ids, in order (Qwen-VL's merge)."""
        embeds = self.embed_tokens(input_ids)
        if image_features is None:  # text only (decode steps): nothing to merge, no host sync
            return embeds
        placeholders = input_ids == self.cfg.image_token_id
        # transformers checks the same (a silent partial scatter would misplace images); torch._check also holds
        # inside a compiled graph (a runtime assertion there, whose message must be a constant).
        torch._check(int(placeholders.sum()) == image_features.shape[0], lambda: _PLACEHOLDER_MISMATCH)
        mask = placeholders.unsqueeze(-1).expand_as(embeds)
        return embeds.masked_scatter(mask, image_features.to(embeds.dtype))

    def forward(self, input_ids, positions, block_table, slots, cache: PagedKVCache, patches, cu_seqlens,
                patch_positions, window_index, cu_window_seqlens):
        features = self.vision(patches, cu_seqlens, patch_positions, window_index, cu_window_seqlens)
        return self.language(self.embed(input_ids, features), positions, block_table, slots, cache)


class DecoderStep(nn.Module):
    """One decoder step over the paged cache it owns: (inputs_embeds, positions, block_table, slots) -> logits.

    The module serving engines compile once and call for prefill chunks and decode steps alike (all arguments
    tensors: CUDA-graph replayable). Shares the language model's weights."""

    def __init__(self, language: LanguageModel, cache: PagedKVCache):
        super().__init__()
        self.language = language
        self.cache = cache

    def forward(self, inputs_embeds, positions, block_table, slots):
        return self.language(inputs_embeds, positions, block_table, slots, self.cache)


def _init_weights(model: nn.Module, generator: torch.Generator) -> None:
    """Seeded random weights for every parameter: matrices ~ N(0, 1/fan_in), embeddings N(0, 1), norm weights
    around 1 (ones would hide a missing multiply), biases small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
            if name.endswith("bias"):
                value = 0.1 * noise
            elif param.dim() == 1:
                value = 1.0 + 0.1 * noise
            elif name.startswith("embed_tokens"):
                value = noise
            else:
                value = noise * param.shape[-1] ** -0.5
            param.copy_(value)


def build_multimodal(cfg: MultimodalConfig | str = "tiny", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     device: torch.device | str = "cpu") -> MultimodalModel:
    """A MultimodalModel with seeded random weights on `device`, experts in MXFP4; DSA's norms keep fp32 weights
    (as upstream does), everything else in `dtype`."""
    cfg = CONFIGS[cfg] if isinstance(cfg, str) else cfg
    device = torch.device(device)
    with torch.device(device):
        model = MultimodalModel(cfg, dtype)
    _init_weights(model, torch.Generator(device).manual_seed(seed))
    model.to(dtype)
    for module in model.language.modules():
        if isinstance(module, (DSARMSNorm, nn.LayerNorm)):
            module.float()
    mxfp4.quantize_experts(model.language)
    return model.eval()


def new_cache(cfg: MultimodalConfig, max_pages: int, batch: int, fp8_index: bool, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> PagedKVCache:
    """A paged cache for every decoder layer; the latent rows in the model's dtype (the kernels read them in q's)."""
    return PagedKVCache(cfg.attention.cache_config(cfg.layers), max_pages, batch, fp8_index, device,
                        latent_dtype=dtype)


def request_ids(cfg: MultimodalConfig, grids: list[tuple[int, int]], text: list[int],
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [1, S] of one request: text[0] random text tokens, image 0's placeholders, text[1] tokens, image
    1's placeholders, ... (len(text) == len(grids) + 1). An image of rows × columns patches has
    rows * columns / merge² placeholders (one per merged feature row)."""
    if len(text) != len(grids) + 1:
        raise ValueError(f"{len(grids)} images need {len(grids) + 1} text runs around them, got {len(text)}")
    unit = cfg.vision.merge ** 2
    pieces = [torch.randint(0, cfg.image_token_id, (text[0],), generator=generator)]
    for (rows, cols), length in zip(grids, text[1:]):
        pieces.append(torch.full((rows * cols // unit,), cfg.image_token_id))
        pieces.append(torch.randint(0, cfg.image_token_id, (length,), generator=generator))
    return torch.cat(pieces)[None]


class MultimodalSession:
    """Drives a MultimodalModel over one paged cache, a request per cache sequence: encode the request's images,
    merge them into its text, prefill, then decode steps.

    `vision` and `decoder` are what runs the two halves: the eager modules by default, or compiled ones
    (`MultimodalSession.compiled`). The embedding merge runs eagerly between them."""

    def __init__(self, model: MultimodalModel, cache: PagedKVCache, vision=None, decoder=None):
        self.model = model
        self.cache = cache
        self.vision = vision if vision is not None else model.vision
        self.decoder = decoder if decoder is not None else DecoderStep(model.language, cache)
        self.pages = DSASession(cache)

    @classmethod
    def compiled(cls, model: MultimodalModel, cache: PagedKVCache, target: str = "cuda", options=None):
        """A session running dzc.compile'd vision encoder and decoder step; their reports are
        `session.vision.report` and `session.decoder.report`."""
        return cls(model, cache, dzc_compile(model.vision, target, options),
                   dzc_compile(DecoderStep(model.language, cache), target, options))

    def prefill(self, sequence: int, input_ids: torch.Tensor, images: ImagePack | None) -> torch.Tensor:
        """input_ids [1, S] (placeholders included) of a request into cache sequence `sequence` -> logits [1, V]."""
        features = self.vision(*images.inputs()) if images is not None else None
        embeds = self.model.embed(input_ids, features)
        return self.decoder(*self.pages.inputs(embeds, [sequence])[:4])

    def decode(self, token_ids: torch.Tensor, sequences: list[int]) -> torch.Tensor:
        """One new token per sequence: token_ids [len(sequences), 1] -> logits [len(sequences), V]."""
        embeds = self.model.embed(token_ids, None)
        return self.decoder(*self.pages.inputs(embeds, sequences)[:4])


def build_multimodal_example(grids=((2, 2), (2, 4), (4, 4)), text=(3, 5, 4, 6), device="cpu",
                             layers: int | None = None, vision_layers: int | None = None):
    """(tiny MultimodalModel in bf16, inputs of MultimodalModel.forward: a prefill of 3 images and text into a fresh
    cache): the MODELS entry. `device`: where the cache lives (move the model and the tensor inputs there too).
    layers: decoder and vision layers each (compile-time measurements at depth); None = the tiny config's 2.
    vision_layers: the vision layers, when they differ (the full-depth reference: 61 decoder, 32 vision)."""
    cfg = CONFIGS["tiny"]
    if layers is not None:
        cfg = replace(cfg, layers=layers, vision=replace(cfg.vision, layers=layers))
    if vision_layers is not None:
        cfg = replace(cfg, vision=replace(cfg.vision, layers=vision_layers))
    model = build_multimodal(cfg)
    generator = torch.Generator().manual_seed(1)
    images = pack_images(list(grids), cfg.vision, torch.bfloat16, generator)
    input_ids = request_ids(cfg, list(grids), list(text), generator)
    cache = new_cache(cfg, max_pages=4, batch=1, fp8_index=False, dtype=torch.bfloat16, device=device)
    _, positions, block_table, slots, _ = DSASession(cache).inputs(torch.empty(1, input_ids.shape[1], cfg.hidden))
    return model, (input_ids, positions, block_table, slots, cache, *images.inputs())
