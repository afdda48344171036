"""Reference models: named factories for tests, dzc-dump and the demo.

Each entry builds (model, example_inputs) with seeded random weights; sizes are tiny so that they run through
Triton's interpreter on a CPU. `dzc-dump --list-models` lists them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dzc.models.decoder import DecoderConfig, build_decoder


def _decoder(norm_style: str, dtype: torch.dtype):
    def build(seq: int = 16, batch: int = 2):
        cfg = DecoderConfig(norm_style=norm_style)
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
}


def build_model(name: str, **kwargs):
    """MODELS name -> (model, example_inputs); a ValueError names the known models."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name][0](**kwargs)
