"""transformers' GptOss, tiny and random, built offline: the HF model whose experts dzc quantizes to MXFP4
(dzc.mxfp4.quantize_experts) and fuses (fuse_mxfp4_experts matches transformers 5.x's grouped_mm experts)."""

from __future__ import annotations

import torch


def build_tiny_gpt_oss(dtype: torch.dtype = torch.bfloat16, layers: int = 2, experts: int = 4, top_k: int = 2,
                       hidden: int = 64, intermediate: int = 32, experts_implementation: str | None = None,
                       mxfp4_experts: bool = True, seed: int = 0):
    """GptOssForCausalLM (vocab 128) with random weights; its experts in MXFP4 unless mxfp4_experts=False.

    Expert and router weights and biases are drawn with std 0.2: transformers' init leaves biases at zero, which
    would hide a bias the compiled model drops. experts_implementation None = transformers' default (grouped_mm).
    """
    import transformers  # noqa: PLC0415 (optional dependency of the models package)

    from dzc import mxfp4  # noqa: PLC0415

    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, sliding_window=16,
        layer_types=["full_attention"] * layers, experts_implementation=experts_implementation,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.GptOssForCausalLM(config).to(dtype).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".experts." in name or ".router." in name:
                    param.normal_(0, 0.2)
    if mxfp4_experts:
        mxfp4.quantize_experts(model)
    return model


def build_gpt_oss_example(seq: int = 16, batch: int = 2):
    """(tiny GptOss with MXFP4 experts, bf16, no KV cache, (input_ids,)): the MODELS entry."""
    model = build_tiny_gpt_oss(torch.bfloat16)
    model.config.use_cache = False
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)
