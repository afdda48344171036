"""The public model zoo (tools/zoo.py, docs/zoo.md): every row, a transformers model compiled unchanged with
dzc.compile, compiles and matches upstream eager (a copy of the model taken before dzc.compile selects its own
attention) over three input lengths, in fp32 and bf16, with the fusions, graph breaks and recompiles of the table.
A row that fails or mismatches is a bug; a change in what fires is a change of the scoreboard (docs/zoo.md:
`python tools/zoo.py --write`)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

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
BF16_ROWS = ("Llama", "Qwen3-MoE", "Qwen2-VL vision")
ROWS = ([pytest.param(name, torch.float32, id=f"{name}-fp32") for name in zoo.ZOO]
        + [pytest.param(name, torch.bfloat16, id=f"{name}-bf16", marks=pytest.mark.slow) for name in BF16_ROWS])


# What fires per row over the three calls (fp32 and bf16 alike), and the recompiles that are the models' own
# branches (docs/zoo.md says which).
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
}
RECOMPILES = {"Gemma3 (text)": 1, "Mistral": 1, "GptOss": 1, "Qwen2-VL vision": 1, "Qwen2.5-VL vision": 1}


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
