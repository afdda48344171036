"""Reference models: named factories for tests, dzc-dump and the demo.

Each entry builds (model, example_inputs) with seeded random weights; sizes are tiny so that they run through
Triton's interpreter on a CPU. `dzc-dump --list-models` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from dzc.models.decoder import DecoderConfig, build_decoder
from dzc.models.dsa import build_dsa_example, build_hf_deepseek_v32
from dzc.models.gpt_oss_hf import build_gpt_oss_example
from dzc.models.moe import build_moe_example
from dzc.models.multimodal import build_multimodal_example
from dzc.models.vision import TINY_MOONVIT, TINY_QWEN_VISION, build_vision_example


def _decoder(norm_style: str, dtype: torch.dtype):
    def build(seq: int = 16, batch: int = 2, layers: int = 2):
        cfg = DecoderConfig(norm_style=norm_style, layers=layers)
        model = build_decoder(cfg, dtype)
        tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        return model, (tokens,)

    return build


MODELS: dict[str, tuple[Callable, str]] = {
    "llama_decoder": (_decoder("hf", torch.bfloat16),
                      "2-layer decoder, HF Llama RMSNorm spelling, bf16, hidden 64"),
    "deepseek_decoder": (_decoder("deepseek", torch.bfloat16),
                         "2-layer decoder, DeepSeek-V3 reference RMSNorm(x, residual) spelling, bf16, hidden 64"),
    "llama_decoder_fp32": (_decoder("hf", torch.float32),
                           "the llama_decoder in fp32"),
    "dsa_attention": (build_dsa_example,
                      "DeepSeek-V3.2-style MLA + lightning indexer + top-k mask over a paged KV cache, bf16, "
                      "4 heads, top-k 8 (prefill step)"),
    "hf_deepseek_v32": (build_hf_deepseek_v32,
                        "transformers DeepseekV32ForCausalLM, tiny random config, eager attention, top-k 4"),
    "moe_mxfp4": (build_moe_example,
                  "MoE block with MXFP4 experts (tiny gpt-oss config: 4 experts, top-2, clamped SwiGLU, biases, "
                  "per-expert loop), bf16, hidden 64"),
    "hf_gpt_oss_mxfp4": (build_gpt_oss_example,
                         "transformers GptOssForCausalLM, tiny random config, experts quantized to MXFP4 "
                         "(grouped_mm experts), bf16, 2 layers"),
    "qwen2_5_vl_vision": (lambda: build_vision_example(replace(TINY_QWEN_VISION, attention="mask")),
                          "Qwen2.5-VL-style vision encoder (RMSNorm, SwiGLU, window + full layers, 2x2 merger), "
                          "3 images packed, block-diagonal-mask attention, fp32, hidden 32"),
    "moonvit": (lambda: build_vision_example(replace(TINY_MOONVIT, attention="split")),
                "MoonViT-style vision encoder (LayerNorm, GELU, 2x2 merger), 3 images packed, per-image "
                "split/cat attention, fp32, hidden 32"),
    "multimodal": (build_multimodal_example,
                   "vision encoder (tiny Qwen2.5-VL-style, mask attention) + 2-layer decoder of DSA attention over a "
                   "paged cache and MXFP4 MoE (tiny gpt-oss), bf16: prefill of 3 images + text"),
}


def build_model(name: str, **kwargs):
    """MODELS name -> (model, example_inputs); a ValueError names the known models."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name][0](**kwargs)
