"""dzc's op set: each fused operation is a torch.library op with exactly one plain-torch reference.

The reference defines what the op means; every generated kernel is tested against it. Passes rewrite ATen
subgraphs into these ops; lowering fills in the `kernel_id` argument with the id of a generated kernel, and the
op then launches that kernel instead of running the reference (an empty `kernel_id` runs the reference).

One module per op: its custom op, fake implementation and reference. Adding an op = a module here + a row in OPS.
"""

from __future__ import annotations

import torch

from dzc.mxfp4 import dequantize as mxfp4_dequantize_reference
from dzc.ops.add_layer_norm import add_layer_norm_reference
from dzc.ops.add_rms_norm import add_rms_norm_reference
from dzc.ops.all_reduce_add_rms_norm import all_reduce_add_rms_norm_reference, lower_as_parts
from dzc.ops.dsa import dsa_indexer_reference, dsa_topk_reference, sparse_attention_reference
from dzc.ops.mxfp4_moe import mxfp4_moe_reference, mxfp4_moe_w4a8_reference
from dzc.ops.varlen_attention import varlen_attention_reference

# Every dzc op, by the name the IR printer and the report use, with its reference implementation.
OPS = {
    "add_rms_norm": (torch.ops.dzc.add_rms_norm.default, add_rms_norm_reference),
    "mxfp4_moe": (torch.ops.dzc.mxfp4_moe.default, mxfp4_moe_reference),
    # The same layer with FP8 (E4M3) activations and weights in its GEMMs (opt-in: quantize_moe_activations).
    "mxfp4_moe_w4a8": (torch.ops.dzc.mxfp4_moe_w4a8.default, mxfp4_moe_w4a8_reference),
    # Not a fusion: what MXFP4 experts modules call in eager; it runs as itself (no kernel_id), and
    # fuse_mxfp4_experts removes it where it feeds expert matmuls.
    "mxfp4_dequantize": (torch.ops.dzc.mxfp4_dequantize.default, mxfp4_dequantize_reference),
    "varlen_attention": (torch.ops.dzc.varlen_attention.default, varlen_attention_reference),
    "add_layer_norm": (torch.ops.dzc.add_layer_norm.default, add_layer_norm_reference),
    # DeepSeek Sparse Attention: indexer logits -> top-k positions -> attention over those only.
    "dsa_indexer": (torch.ops.dzc.dsa_indexer.default, dsa_indexer_reference),
    "dsa_topk": (torch.ops.dzc.dsa_topk.default, dsa_topk_reference),
    "sparse_attention": (torch.ops.dzc.sparse_attention.default, sparse_attention_reference),
    # Tensor parallelism: the all-reduce ending a row-parallel projection + the residual add + RMSNorm after it.
    "all_reduce_add_rms_norm": (torch.ops.dzc.all_reduce_add_rms_norm.default, all_reduce_add_rms_norm_reference),
}

# Ops that lowering turns back into their parts where no kernel family takes them (op name -> node -> None).
LOWERED_AS_PARTS = {"all_reduce_add_rms_norm": lower_as_parts}

__all__ = ["OPS", "add_rms_norm_reference", "mxfp4_moe_reference", "mxfp4_moe_w4a8_reference",
           "mxfp4_dequantize_reference", "varlen_attention_reference", "add_layer_norm_reference",
           "dsa_indexer_reference", "dsa_topk_reference", "sparse_attention_reference",
           "all_reduce_add_rms_norm_reference", "LOWERED_AS_PARTS"]
