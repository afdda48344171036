"""quantize_moe_activations: MXFP4 MoE layers => their W4A8 form, where the user asked for it and the profile has
native FP8 (CompileOptions.moe_fp8_activations).

Before:

    %out = dzc.mxfp4_moe.default(%x, %topk_ids, %topk_weights, %w13_blocks, %w13_scales, %b13, %w2_blocks,
                                 %w2_scales, %b2, activation, gate_up_interleaved, alpha, limit)

After:

    %out = dzc.mxfp4_moe_w4a8.default(<the same arguments>)

dzc.mxfp4_moe_w4a8 quantizes the activations to E4M3 (one power-of-two scale per 128 columns of a row) and
multiplies FP8 operands: its numerics differ from dzc.mxfp4_moe's (its reference, in dzc/ops/mxfp4_moe.py, says
exactly how), which is why the rewrite is an option and never a tuning choice. It refuses, and the report says
why, on profiles without native E4M3 (sm_80, mp_22): those keep the W4A16 op.

Ordering: after fuse_mxfp4_experts, which makes the nodes it rewrites; before lowering, which picks the kernels
by op.
"""

from __future__ import annotations

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, copy_graph, is_call, location_of
from dzc.targets.profiles import DeviceProfile

NAME = "quantize_moe_activations"
_W4A16 = torch.ops.dzc.mxfp4_moe.default
_W4A8 = torch.ops.dzc.mxfp4_moe_w4a8.default


def quantize_moe_activations(graph: torch.fx.Graph, profile: DeviceProfile) -> PassResult:
    """Rewrite every dzc.mxfp4_moe node into dzc.mxfp4_moe_w4a8 if `profile` has native E4M3; returns a new graph
    and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for node in graph.nodes:
        if not is_call(node, _W4A16):
            continue
        if not profile.supports_dtype(torch.float8_e4m3fn):
            result.refused(location_of(node), f"{profile.name} has no native FP8 (E4M3): the layer stays W4A16")
            continue
        with graph.inserting_before(node):
            w4a8 = graph.call_function(_W4A8, node.args, node.kwargs)
        w4a8.meta.update(node.meta)
        node.replace_all_uses_with(w4a8)
        graph.erase_node(node)
        result.rewrote(location_of(w4a8))
    return result
