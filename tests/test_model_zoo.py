"""The public model zoo (tools/zoo.py, docs/zoo.md): every row, a transformers model compiled unchanged with
dzc.compile, compiles and matches upstream eager (a copy of the model taken before dzc.compile selects its own
attention) over three input lengths, in fp32 and bf16, with the fusions, graph breaks and recompiles of the table.
A row that fails or mismatches is a bug; a change in what fires is a change of the scoreboard (docs/zoo.md:
`python tools/zoo.py --write`)."""

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import dzc

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_spec = importlib.util.spec_from_file_location("zoo", Path(__file__).resolve().parent.parent / "tools" / "zoo.py")
zoo = sys.modules["zoo"] = importlib.util.module_from_spec(_spec)  # registered: its dataclasses look it up
_spec.loader.exec_module(zoo)


# Every row in fp32 (the tight tolerance: any wrong rewrite shows). bf16 doubles the compiles (over 3 minutes on
# two CPU cores): CI takes the rows whose bf16 numerics differ in kind (a dense decoder, an MoE router's top-k, the
# packed vision attention); tools/zoo.py runs every row in both for docs/zoo.md. The DSA indexer's top-k in bf16
# (DeepseekV32, ~50 s here: the sparse-attention kernels through the interpreter) is CI's in
# tests/test_sparse_attention_without_cache.py::test_compiled_hf_deepseek_v32_bf16_prefill_without_cache: HF
# DeepseekV32 in bf16 through dzc.compile, its dsa_indexer and sparse_attention kernels, against eager with this
# file's bf16 tolerance and near-tie allowance; its fp32 row here keeps the zoo's spelling and three lengths.
# MXFP4-experts rows in bf16: the dzc.mxfp4_moe kernel with bf16 routing weights (Qwen3-MoE) and with fp32 ones in
# a bf16 model (Mixtral: the combine sums in fp32, then casts back).
BF16_ROWS = ("Llama", "Qwen3-MoE", "Qwen2-VL vision", "Qwen3-MoE (MXFP4 experts)", "Mixtral (MXFP4 experts)")
ROWS = ([pytest.param(name, torch.float32, id=f"{name}-fp32") for name in zoo.ZOO]
        + [pytest.param(name, torch.bfloat16, id=f"{name}-bf16", marks=pytest.mark.slow) for name in BF16_ROWS])


# What fires per row over the three calls (fp32 and bf16 alike), and the recompiles (docs/zoo.md says why).
FIRED = {
    "Llama": {"fuse_residual_norm": 2},
    "Qwen3": {"fuse_residual_norm": 2},
    "Gemma3 (text)": {"canonicalize_graph": 1, "fuse_residual_norm": 8, "fuse_windowed_attention": 1},
    "Mistral": {"canonicalize_graph": 1, "fuse_residual_norm": 4, "fuse_windowed_attention": 1},
    "Phi3": {"fuse_residual_norm": 2},
    "GptOss": {"canonicalize_graph": 2, "fuse_residual_norm": 8, "fuse_windowed_attention": 4},
    "Qwen3-MoE": {"fuse_residual_norm": 2},
    "Mixtral": {"fuse_residual_norm": 2},
    "DeepseekV3": {"canonicalize_graph": 1, "fuse_residual_norm": 2},
    "DeepseekV32": {"fuse_residual_norm": 2, "fuse_sparse_attention": 1},
    "Qwen2-VL vision": {"fuse_residual_norm": 4, "fuse_vision_attention": 2},
    "Qwen2.5-VL vision": {"fuse_residual_norm": 8, "fuse_vision_attention": 4},
    "SigLIP vision": {"fuse_residual_norm": 2},
    # The MoE rows with MXFP4 experts (zoo.MXFP4_ROWS): one dzc.mxfp4_moe per layer and graph (GptOss: 2 layers,
    # 2 graphs).
    "GptOss (MXFP4 experts)": {"canonicalize_graph": 2, "fuse_residual_norm": 8, "fuse_windowed_attention": 4,
                               "fuse_mxfp4_experts": 4},
    "Qwen3-MoE (MXFP4 experts)": {"fuse_residual_norm": 2, "fuse_mxfp4_experts": 1},
    "Mixtral (MXFP4 experts)": {"fuse_residual_norm": 2, "fuse_mxfp4_experts": 1},
    "DeepseekV3 (MXFP4 experts)": {"canonicalize_graph": 1, "fuse_residual_norm": 2, "fuse_mxfp4_experts": 1},
}
# None of them is dzc's to remove:
# - the sliding-window rows (window 8; 7, 12 and 20 tokens): transformers branches on the length against the window.
#   Its sdpa mask is skipped below the window (masking_utils._ignore_causal_mask_sdpa; Gemma3, Mistral), and the
#   sliding cache keeps the last window - 1 tokens (`full_key_states[:, :, -window + 1:]`, cache_utils), a slice whose
#   start and contiguity torch guards (at exactly window - 1 it is the whole tensor; GptOss has only this branch).
#   So 7 tokens get a graph of their own, 12 and 20 share one (every length at or above the window does), and
#   lengths below 7 a third (test below).
# - the Qwen-VL towers (packs of 2, 3 and 1 images): max_seqlen (and Qwen2.5's max_window_seqlen), the patch count
#   of the longest image, is a Python int that transformers' size helpers compute eagerly, between graphs. Dynamo
#   takes an int that crosses a graph break as a constant until it changes (8, 8, then 16 here), then as a symbol;
#   an int carries no dynamic mark (see torch.compiler.config.dynamic_values' docstring). Not the single image: a
#   pack of one only re-traces the frames that hold no graph (test below).
# A size of 1 (a batch of one, a pack that merges to one token) is specialised as well. torch's ways around that
# (backed_size_oblivious, unbacked dims) trace a graph at 2 or more that can be wrong at 1 (Inductor's code for a
# squeeze of that dim keeps it), and dzc cannot tell whether a model's code has such an op: it leaves them off.
RECOMPILES = {"Gemma3 (text)": 1, "Mistral": 1, "GptOss": 1, "GptOss (MXFP4 experts)": 1, "Qwen2-VL vision": 1,
              "Qwen2.5-VL vision": 1}


def test_every_row_has_its_expectations():
    assert set(FIRED) == set(zoo.ZOO) and set(RECOMPILES) <= set(zoo.ZOO)


@pytest.mark.parametrize("name, dtype", ROWS)
def test_zoo_row_compiles_unchanged_and_matches_eager(name, dtype, tmp_path):
    run = zoo.measure(zoo.ZOO[name], dtype, str(tmp_path / "cache"))
    assert not run.error, f"{name} ({dtype}) failed: {run.error}"
    assert not run.eager_runs, f"{name} ({dtype}) ran eagerly, without dzc"
    assert run.compiles >= 1
    assert run.fired == FIRED[name], f"{name} ({dtype}): fired {run.fired}"
    assert (run.graph_breaks, run.recompiles) == (0, RECOMPILES.get(name, 0)), name
    assert run.matches, (f"{name} ({dtype}): max |dzc - eager| {run.max_error:.3g} of max |eager|, {run.rows_off} of "
                         f"{run.rows} rows over {zoo.TOLERANCE[dtype]:.0e}")
    # The report's coverage is there for every graph, with shares in [0, 1].
    assert 0 <= run.flop_share <= 1 and 0 <= run.byte_share <= 1


def _compiled_with_reference(name: str, cache_dir: str):
    """A zoo row's model compiled unchanged, with an eager copy taken first (as zoo.measure does)."""
    model = zoo.ZOO[name].build()
    reference = copy.deepcopy(model)
    return dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=cache_dir, autotune=False)), reference


def _recompiles_over_calls(compiled, reference, calls, outputs) -> list[int]:
    """The report's recompiles after each call (args), each checked against eager on dzc's kernels (the second call
    of a new graph: the first returns the graph as captured)."""
    counts = []
    for args in calls:
        with torch.no_grad():
            expected = outputs(reference(*args))
            compiled(*args)
            actual = outputs(compiled(*args))
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
        counts.append(compiled.report.recompiles)
    return counts


def test_qwen_vl_tower_recompiles_once_for_the_longest_image_not_for_the_image_count(tmp_path):
    """The Qwen-VL rows' recompile (RECOMPILES): packs of 2, 1 and 3 images whose longest image is as long share the
    first graph (a single image does not recompile it); the first pack with another longest image recompiles once
    (max_seqlen turns from a constant into a symbol), and no later pack does, whatever its longest image or count.
    (A pack of one merged token, a single 2 x 2-patch image, would: a size of 1, which Dynamo specialises.)"""
    compiled, reference = _compiled_with_reference("Qwen2-VL vision", str(tmp_path))
    packs = ([[1, 2, 2], [1, 4, 2]], [[1, 2, 4]], [[1, 2, 2], [1, 2, 2], [1, 4, 2]],  # longest image: 8 patches
             [[1, 4, 4]], [[1, 2, 2], [1, 8, 4]], [[1, 6, 2]])  # 16, 32, 12
    calls = []
    for index, grids in enumerate(packs):
        grid_thw = torch.tensor(grids)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * zoo._PATCH ** 2,
                             generator=torch.Generator().manual_seed(index))
        calls.append((pixels, grid_thw))
    counts = _recompiles_over_calls(compiled, reference, calls, lambda out: (out.last_hidden_state,))
    assert counts == [0, 0, 0, 1, 1, 1], counts


def test_sliding_window_decoder_recompiles_only_where_the_model_branches_on_the_window(tmp_path):
    """The sliding-window rows' recompile (RECOMPILES): every length at or above the window (8) shares one graph,
    every length below window - 1 another, and window - 1 (7) a third, static one."""
    compiled, reference = _compiled_with_reference("Mistral", str(tmp_path))
    lengths = (12, 20, 9, 31, 5, 3, 7)
    calls = [(torch.randint(3, zoo._TEXT["vocab_size"], (2, length), generator=torch.Generator().manual_seed(length)),)
             for length in lengths]
    counts = _recompiles_over_calls(compiled, reference, calls, lambda out: (out.logits,))
    assert counts == [0, 0, 0, 0, 1, 1, 2], dict(zip(lengths, counts))
