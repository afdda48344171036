"""Static checks of the TileLang templates' generated Python (no lowering, no TileLang needed).

Conditions are joined with `and` / `or`, never with `&` / `|`. On a comparison TVMScript's `&` is bitwise_and of
two bools: TVM's arithmetic analyzer cannot see through it, so TileLang's layout inference and loop partitioning
cannot use either side as a fact (a loop-invariant side is not hoisted, a bound it implies is not known), and they
spend their effort on it. `and` becomes tir.And: the CUDA that comes out is the same test (`&&`), with invariant
sides hoisted and implied ones dropped. Lowering on the 2-core CPU host (TileLang 0.1.15, sm_90; session 50): the
FP8 indexer's untuned kernels 61.8 -> 30.7 s and 47.1 -> 24.7 s, the top-k's 37.3 -> 24.2 s, mxfp4_moe's gate/up
18.3 -> 12.2 s, varlen attention's 10.6 -> 8.4 s (docs/results/compile_time_cpu.md, "Session 50")."""

import ast

import pytest
import torch

from dzc.targets import (add_layer_norm, add_rms_norm, dsa_indexer, dsa_topk, mxfp4_moe, sparse_attention,
                         varlen_attention)
from dzc.targets.profiles import SM_90

BF16, FP32 = torch.bfloat16, torch.float32
SPECS = {
    "add_layer_norm": (add_layer_norm, add_layer_norm.AddLayerNormSpec(1280, BF16, BF16, BF16, BF16, BF16, FP32,
                                                                       True)),
    "add_rms_norm": (add_rms_norm, add_rms_norm.AddRmsNormSpec(2880, BF16, BF16, BF16, BF16, FP32, True, True)),
    "dsa_indexer": (dsa_indexer, dsa_indexer.DsaIndexerSpec(64, 128, torch.float8_e4m3fn, True)),
    "dsa_topk": (dsa_topk, dsa_topk.DsaTopkSpec()),
    "mxfp4_moe": (mxfp4_moe, mxfp4_moe.MXFP4MoESpec(2880, 2880, 128, 4, BF16, FP32, BF16, BF16, "clamped_swiglu",
                                                    True)),
    "sparse_attention": (sparse_attention, sparse_attention.SparseAttentionSpec(128, 1, 576, 512, BF16, False,
                                                                                topk=2048, page_size=64)),
    "varlen_attention": (varlen_attention, varlen_attention.make_spec(80, BF16, FP32)),
}


def joined_conditions(source: str) -> list[str]:
    """Each `a & b` / `a | b` of `source` whose operand is a comparison or a boolean expression, as its text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)) and any(
                isinstance(side, (ast.Compare, ast.BoolOp)) for side in (node.left, node.right)):
            found.append(ast.get_source_segment(source, node))
    return found


def test_joined_conditions_finds_bitwise_joins_of_comparisons_only():
    source = ("a = (x < n) & (y < m)\nb = (x < n) | (y >= 0) & (z == 1)\nc = (w & 1) ^ 1\nd = x < n and y < m\n"
              "e = (bits & mask) > 0\n")
    assert joined_conditions(source) == ["(x < n) & (y < m)", "(x < n) | (y >= 0) & (z == 1)", "(y >= 0) & (z == 1)"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tilelang_template_joins_conditions_with_and_or(name):
    family, spec = SPECS[name]
    source = family.tilelang_source(spec, SM_90)
    assert "@T.prim_func" in source, name
    assert joined_conditions(source) == [], f"{name}: join these conditions with and / or"
