"""HF transformers vision towers entered through their attention interface: one graph for any pack of images.

transformers' Qwen-VL-style vision towers take a varlen path when the configured attention implementation is a
flash one: they hand `cu_seqlens` and `max_seqlen` to the attention function instead of splitting q, k, v per
image in a Python loop (which Dynamo unrolls: one graph per image count). dzc registers such a function,
`dzc_flash_varlen`, that calls dzc.varlen_attention; the RoPE HF applies before it is folded into the op by
fuse_vision_attention.

What depends on the images' sizes and count — cu_seqlens, rotary positions, window order — transformers computes
with Python loops over `grid_thw.tolist()`; its `vision_utils` helpers take them precomputed instead (the
`kwargs` of the tower's forward). `qwen2_5_vl_vision_inputs` computes them outside the compiled graph, so the
graph sees only tensors with dynamic sizes:

    visual = model.visual  (or Qwen2_5_VisionTransformerPretrainedModel(config))
    use_dzc_attention(visual)
    compiled = dzc.compile(visual, "cuda")
    out = compiled(pixel_values, grid_thw, **qwen2_5_vl_vision_inputs(visual.config, grid_thw))

See docs/vision.md for what this path and the graph rewrite each cover.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "dzc_flash_varlen"  # "flash" in the name is what makes HF models take their cu_seqlens path


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                             is_causal=None, **kwargs):
    """An HF attention function (AttentionInterface): query/key/value [1, heads, tokens, head_dim] packed, with
    cu_seq_lens_q; returns ([1, tokens, heads, head_dim], None) as HF's flash functions do."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{ATTENTION_NAME} is dzc's attention for packed (varlen) vision attention; "
                         f"{type(module).__name__} called it without cu_seq_lens_q")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError(f"{ATTENTION_NAME}: q and k must share cu_seqlens (self-attention over one pack)")
    if attention_mask is not None or is_causal or dropout:
        raise ValueError(f"{ATTENTION_NAME}: only non-causal attention without mask or dropout (vision encoders)")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME}: expected one packed sequence [1, heads, tokens, head_dim], got "
                         f"{tuple(query.shape)}")
    max_seqlen = max_length_q
    if isinstance(max_seqlen, torch.Tensor):  # precomputed by qwen2_5_vl_vision_inputs: read inside the graph
        max_seqlen = max_seqlen.item()
    if max_seqlen is None:
        max_seqlen = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max().item()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.dzc.varlen_attention(q, k, v, cu_seq_lens_q, max_seqlen, scale, None, None)
    return out.unsqueeze(0), None


def use_dzc_attention(model) -> None:
    """Make `model` (an HF vision tower) call dzc's varlen attention function."""
    from transformers import AttentionInterface  # noqa: PLC0415 (transformers is optional for dzc)

    AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    # Set directly: PreTrainedModel.set_attn_implementation would look for a flash kernel on the Hub.
    model.config._attn_implementation = ATTENTION_NAME


def qwen2_5_vl_vision_inputs(config, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The size-dependent inputs of a Qwen2.5-VL vision tower, computed eagerly by transformers' own helpers.

    max_seqlen and max_window_seqlen are 0-d tensors, read with .item() inside the graph: as Python ints they
    would be specialised on (a recompile per value); computed inside the graph from cu_seqlens they would make
    Dynamo specialise on one image (a slice of one element).
    """
    from transformers import vision_utils  # noqa: PLC0415

    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid_thw)
    window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
        grid_thw, config.spatial_merge_size, config.window_size, config.patch_size)
    return {
        "position_ids": vision_utils.get_vision_position_ids(grid_thw, config.spatial_merge_size),
        "cu_seqlens": cu_seqlens,
        "window_index": window_index,
        "cu_window_seqlens": cu_window_seqlens,
        "max_seqlen": (cu_seqlens[1:] - cu_seqlens[:-1]).max(),
        "max_window_seqlen": (cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max(),
    }
