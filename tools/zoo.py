"""The public model zoo: transformers models as their authors ship them, tiny and random, through dzc.compile.

    python tools/zoo.py                          # measure every row, print the table
    python tools/zoo.py --write                  # ... and write it into docs/zoo.md
    python tools/zoo.py Llama "Gemma3 (text)"    # only these rows
    python tools/zoo.py Llama --write            # ... and replace only their rows in docs/zoo.md

Each row builds a transformers model from a tiny config (1-2 layers, hidden 64, built offline: no download) with
seeded random weights, and compiles it UNCHANGED: `dzc.compile(model)`, no dzc helper, no edit to the model's
code, the attention implementation transformers picks by default. It then calls it on three input lengths (three
sequence lengths, three packs of images, three batch sizes) in fp32 and in bf16 and records what a user would
want to know on release day: does it compile, how many graphs and graph breaks, which fusions fired where, the
share of FLOPs and bytes that run in dzc kernels (the compile report's coverage), the largest error against eager
and whether the three lengths recompiled. tests/test_model_zoo.py asserts that every row compiles and matches.

Norm weights are drawn around their init value (ones, or zeros for Gemma's `1 + w`) and biases around zero:
transformers' init would hide a dropped weight multiply or bias.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are built here; nothing may come from the Hub

import dzc  # noqa: E402  (first: it turns Triton's interpreter on when no GPU is present)
import torch  # noqa: E402

# Relative to the largest magnitude of eager's output: fp32 differs only by reduction order; bf16 by a few ulps
# of a rounding that differs in a norm or a softmax, carried through the layers after it.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "text" (input_ids -> logits) or "vision" (a vision tower)
    build: Callable[[], torch.nn.Module]  # fp32, seeded
    inputs: Callable[[int, torch.dtype], tuple[tuple, dict]]  # (length index 0..2, dtype) -> (args, kwargs)
    outputs: Callable[[object], tuple[torch.Tensor, ...]]  # model output -> tensors compared with eager
    selects: bool = False  # a top-k choice (MoE router, sparse-attention indexer) depends on the activations


def _perturb_constant_parameters(model: torch.nn.Module) -> None:
    """Norm weights of ones (or zeros, Gemma's 1 + w) and biases of zeros get noise around that value."""
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn_like(param) * 0.1)


def _seeded(factory: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = factory().eval()
            _perturb_constant_parameters(model)
        return model

    return build


_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEQUENCE_LENGTHS = (7, 12, 20)


def _text(name: str, model_class: str, config_class: str, selects: bool = False, **config) -> Entry:
    def factory():
        import transformers  # noqa: PLC0415 (optional dependency)

        return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**_TEXT, **config}))

    def inputs(index, dtype):
        ids = torch.randint(3, _TEXT["vocab_size"], (2, SEQUENCE_LENGTHS[index]),
                            generator=torch.Generator().manual_seed(index))
        return (), {"input_ids": ids}

    return Entry(name, "text", _seeded(factory), inputs, lambda out: (out.logits,), selects)


_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0, **_MOE)

# Packs of images as (t, h, w) patch grids: another image count and other sizes per call (h, w even: 2x2 merge).
IMAGE_PACKS = ([[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [1, 2, 2], [1, 2, 2]], [[1, 4, 4]])
_PATCH = 2  # Qwen-VL towers: 2x2-pixel patches of 3 channels, one frame (temporal_patch_size 1)


def _qwen_vl_vision(name: str, module: str, model_class: str, config_class: str, **config) -> Entry:
    def factory():
        import importlib  # noqa: PLC0415

        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        cfg = getattr(configuration, config_class)(num_heads=4, patch_size=_PATCH, temporal_patch_size=1,
                                                   in_channels=3, spatial_merge_size=2, **config)
        return getattr(modeling, model_class)._from_config(cfg)

    def inputs(index, dtype):
        grid_thw = torch.tensor(IMAGE_PACKS[index])
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * _PATCH * _PATCH,
                             generator=torch.Generator().manual_seed(index)).to(dtype)
        return (pixels, grid_thw), {}

    return Entry(name, "vision", _seeded(factory), inputs, lambda out: (out.last_hidden_state, out.pooler_output))


SIGLIP_BATCHES = (2, 3, 5)


def _siglip_vision() -> Entry:
    def factory():
        import transformers  # noqa: PLC0415

        return transformers.SiglipVisionModel._from_config(transformers.SiglipVisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=16,
            patch_size=4))

    def inputs(index, dtype):  # three batch sizes (from 2: a size of 1 is specialised): a fixed-size tower's length
        pixels = torch.randn(SIGLIP_BATCHES[index], 3, 16, 16, generator=torch.Generator().manual_seed(index)).to(dtype)
        return (pixels,), {}

    return Entry("SigLIP vision", "vision", _seeded(factory), inputs,
                 lambda out: (out.last_hidden_state, out.pooler_output))


def _mxfp4_experts(entry: Entry) -> Entry:
    """`entry` with its MoE experts' weights in MXFP4, as loading an MXFP4 checkpoint gives: built as the row it
    stands beside, then dzc.mxfp4.quantize_experts (packed uint8 blocks and scales buffers that the experts module
    dequantizes in its forward, transformers' default experts implementation unchanged). The eager reference is
    this quantized model: the row measures dzc against it, not the quantization error."""
    def build():
        from dzc import mxfp4  # noqa: PLC0415

        model = entry.build()
        mxfp4.quantize_experts(model)
        return model

    return dataclasses.replace(entry, name=f"{entry.name} (MXFP4 experts)", build=build)


_TEXT_ROWS = (
    _text("Llama", "LlamaForCausalLM", "LlamaConfig", head_dim=16),
    _text("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", head_dim=16),
    _text("Gemma3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16, query_pre_attn_scalar=16,
          sliding_window=8, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
    _text("Mistral", "MistralForCausalLM", "MistralConfig", head_dim=16, sliding_window=8),
    _text("Phi3", "Phi3ForCausalLM", "Phi3Config", original_max_position_embeddings=128,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    _text("GptOss", "GptOssForCausalLM", "GptOssConfig", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
          intermediate_size=32, sliding_window=8, num_hidden_layers=2,
          layer_types=["sliding_attention", "full_attention"], selects=True),
    _text("Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=16, num_experts=4, selects=True, **_MOE),
    _text("Mixtral", "MixtralForCausalLM", "MixtralConfig", head_dim=16, num_local_experts=4,
          num_experts_per_tok=2, selects=True),
    _text("DeepseekV3", "DeepseekV3ForCausalLM", "DeepseekV3Config", selects=True, **_MLA),
    # 16 index heads: with few, a key's ReLU scores are all zero often enough that keys tie at the top-k
    # boundary, where eager's torch.topk and dzc's (ties to the smaller position) pick different, equally valid keys.
    _text("DeepseekV32", "DeepseekV32ForCausalLM", "DeepseekV32Config", index_topk=4, index_head_dim=16,
          index_n_heads=16, selects=True, **_MLA),
)
# The MoE rows again with MXFP4 experts: the same models, where the fuse_mxfp4_experts pass (one dzc.mxfp4_moe
# kernel per layer) fires on transformers' own experts modules.
MXFP4_ROWS = ("GptOss", "Qwen3-MoE", "Mixtral", "DeepseekV3")
_VISION_ROWS = (
    _qwen_vl_vision("Qwen2-VL vision", "qwen2_vl", "Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig",
                    depth=1, embed_dim=64, hidden_size=64, mlp_ratio=2),
    _qwen_vl_vision("Qwen2.5-VL vision", "qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel",
                    "Qwen2_5_VLVisionConfig", depth=2, hidden_size=64, intermediate_size=128, out_hidden_size=64,
                    window_size=8, fullatt_block_indexes=[1]),
    _siglip_vision(),
)
ZOO: dict[str, Entry] = {e.name: e for e in (
    *_TEXT_ROWS, *(_mxfp4_experts(e) for e in _TEXT_ROWS if e.name in MXFP4_ROWS), *_VISION_ROWS)}


@dataclass
class Run:
    """One model in one dtype: compiled unchanged and called on the three lengths."""

    dtype: torch.dtype
    selects: bool = False
    error: str = ""  # the exception, where compiling or running failed
    max_error: float = float("nan")  # max |dzc - eager| over the lengths and outputs, relative to max |eager|
    rows: int = 0  # output rows (tokens, patches) compared, over the three calls ...
    rows_off: int = 0  # ... and those with an error over the tolerance
    calls_over: int = 0  # calls with more rows over the tolerance than accepted (top-k near-ties in bf16)
    compiles: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    eager_runs: int = 0
    fired: dict[str, int] = field(default_factory=dict)
    flop_share: float = float("nan")  # of FLOPs / bytes moved, in dzc kernels
    byte_share: float = float("nan")
    report: str = ""  # the compile report and its coverage, for --report
    seconds: float = 0.0

    @property
    def matches(self) -> bool:
        return not self.error and self.rows > 0 and not self.calls_over


# A model that makes a top-k choice on its activations (an MoE router, a sparse-attention indexer) turns a one-ulp
# difference into another choice where two candidates are near a tie: the fused norm rounds once where eager rounds
# twice, so in bf16 a token may take another expert or key, a different but equally valid result. Up to one row
# in 16 of each call may then be over the tolerance; never in fp32, where such ties do not occur at these sizes.
NEAR_TIE_ROWS = 16


def measure(entry: Entry, dtype: torch.dtype, cache_dir: str, device: str | None = None) -> Run:
    """Compile `entry` unchanged in `dtype`, call it on the three lengths, compare with eager."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = Run(dtype, entry.selects)
    start = time.perf_counter()
    torch._dynamo.reset()
    model = entry.build().to(device=device, dtype=dtype)  # MXFP4 experts dequantize to `dtype` (dzc.mxfp4)
    # The eager reference is a copy taken first: dzc.compile selects dzc's own attention implementation on the
    # model it is handed (transformers' attention interface), so that model's eager calls would run dzc's ops.
    reference = copy.deepcopy(model)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=cache_dir, autotune=False))
    tolerance = TOLERANCE[dtype]
    errors = []
    try:
        for index in range(3):
            args, kwargs = entry.inputs(index, dtype)
            args = tuple(a.to(device) for a in args)
            kwargs = {k: v.to(device) for k, v in kwargs.items()}
            with torch.no_grad():  # inference, both (dzc compiles inference graphs)
                expected = entry.outputs(reference(*args, **kwargs))
                # A graph's first call returns the graph as captured (CompileOptions.check_rewrites): the second
                # is the one that runs dzc's kernels and rewrites.
                compiled(*args, **kwargs)
                actual = entry.outputs(compiled(*args, **kwargs))
            rows = rows_off = 0
            for a, e in zip(actual, expected, strict=True):
                scale = e.float().abs().max().item() or 1.0
                row_errors = ((a.float() - e.float()).abs() / scale).flatten(0, -2).amax(-1)
                errors.append(row_errors.max().item())
                rows += row_errors.numel()
                rows_off += int((~(row_errors <= tolerance)).sum())  # NaN counts as off
            run.rows += rows
            run.rows_off += rows_off
            accepted = max(1, rows // NEAR_TIE_ROWS) if entry.selects and dtype != torch.float32 else 0
            run.calls_over += rows_off > accepted
    except Exception as err:  # a row that fails is a table entry here; the test fails on it
        err = getattr(err, "inner_exception", None) or err  # Dynamo's BackendCompilerFailed: what dzc raised
        lines = str(err).strip().splitlines() or [""]
        run.error = f"{type(err).__name__}: {lines[0][:200]}"
    report = compiled.report
    if errors:
        run.max_error = max(errors)
    run.compiles, run.graph_breaks, run.recompiles = report.compiles, len(report.graph_breaks), report.recompiles
    run.eager_runs = len(report.eager_runs)
    run.fired = report.fired()
    coverage = report.coverage
    if coverage.graphs:
        run.flop_share, run.byte_share = coverage.flop_share, coverage.byte_share
    run.report = f"{report}\n{coverage}"
    run.seconds = time.perf_counter() - start
    return run


def _percent(share: float) -> str:
    return "—" if share != share else f"{100 * share:.0f}%"


def _error_cell(run: Run) -> str:
    if run.error:
        return f"FAILS: {run.error}"
    cell = f"{run.max_error:.1e}"
    if run.rows_off:
        cell += f" ({run.rows_off} of {run.rows} rows over {TOLERANCE[run.dtype]:.0e}"
        cell += ": top-k near-ties)" if run.matches else ") MISMATCH"
    return cell


def table(results: dict[str, list[Run]]) -> str:
    """The markdown table of docs/zoo.md."""
    lines = ["| model | graphs | graph breaks | recompiles (3 lengths) | fused sites per pass (bf16) | "
             "in dzc kernels: FLOPs / bytes (bf16) | max error vs eager, fp32 | bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        by_dtype = {run.dtype: run for run in runs}
        bf16 = by_dtype.get(torch.bfloat16, runs[-1])
        fired = ", ".join(f"{p} {n}" for p, n in bf16.fired.items()) or "none"
        other = {tuple(sorted(r.fired.items())) for r in runs}
        if len(other) > 1:
            fired += " (fp32: " + (", ".join(f"{p} {n}" for p, n in by_dtype[torch.float32].fired.items())
                                   or "none") + ")"
        compiles = " / ".join(str(r.compiles) for r in runs)
        breaks = " / ".join(str(r.graph_breaks) for r in runs)
        recompiles = " / ".join(str(r.recompiles) for r in runs)
        if any(r.eager_runs for r in runs):
            compiles += " (ran eagerly)"
        lines.append(f"| {name} | {compiles} | {breaks} | {recompiles} | {fired} | "
                     f"{_percent(bf16.flop_share)} / {_percent(bf16.byte_share)} | "
                     + " | ".join(_error_cell(by_dtype[d]) if d in by_dtype else "—" for d in DTYPES) + " |")
    return "\n".join(lines) + "\n"


DOC_HEADER = """# The model zoo: day-0 scoreboard

Generated by `python tools/zoo.py --write` (tests/test_model_zoo.py asserts the same rows compile and match eager).
Each row is a transformers {version} model built from a tiny random config (1-2 layers, hidden 64, offline) and
compiled **unchanged** with `dzc.compile(model)`: no dzc helper call, no change to the model's code, transformers'
default attention implementation. Three calls per dtype: three sequence lengths (7, 12, 20 tokens, batch 2),
three packs of images (1 to 3 images of other sizes), or three batch sizes (SigLIP's fixed-size images). Each input
is run twice under `torch.no_grad()` and the second call compared: a graph's first call returns the graph as
captured, beside which dzc checks its rewrites (`CompileOptions.check_rewrites`).

Columns: graphs captured, graph breaks and recompiles over the three calls (fp32 / bf16); the passes that fired
with their number of sites (bf16; fp32 where it differs); the share of FLOPs and of bytes moved that ran in dzc
kernels rather than the fallback (the compile report's `coverage`, bf16); the largest |dzc - eager| over the three
calls relative to the largest |eager| (tolerance {fp32:.0e} in fp32, {bf16:.0e} in bf16). A fusion that does not fire
is a table entry; a row that fails or mismatches is a bug. In bf16, a model that makes a top-k choice on its
activations (MoE router, sparse-attention indexer) may take another, equally valid expert or key for a token near a
tie (a one-ulp difference in a fused norm decides it): up to one row in 16 of a call may be over the tolerance
there, and the table says how many were. Why a fusion did not fire is in the row's compile report and coverage
(near-misses with the passes' reasons): `python tools/zoo.py NAME --report`.
Recompiles, none of them dzc's to remove: the sliding-window models (Gemma3, Mistral, GptOss) have a window of 8
tokens in their tiny configs, and transformers takes another path below it than at or above it
(`masking_utils._ignore_causal_mask_sdpa` skips the mask below the window; the sliding cache keeps the last
window - 1 tokens, a slice whose start and contiguity torch guards): 7 tokens (window - 1) get their own graph,
12 and 20 share one, as torch.compile makes. The Qwen-VL towers' one recompile is max_seqlen, the patch count of
the longest image (8, 8, then 16): a Python int that transformers' size helpers compute eagerly, between graphs,
which Dynamo takes as a constant until it first changes, then as a symbol. Other image counts (a single image
included) and sizes share one graph (docs/vision.md).
MXFP4 rows: "NAME (MXFP4 experts)" is row NAME with its MoE experts' weights replaced by MXFP4 through
`dzc.mxfp4.quantize_experts(model)` (packed uint8 blocks and E8M0 scales that the experts module dequantizes in its
forward), standing for an MXFP4 checkpoint as transformers loads it; the experts implementation is transformers'
default, unchanged. Eager is that quantized model (the error columns are dzc against it, not the quantization
error); in bf16 the experts dequantize to bf16, as a checkpoint loaded in bf16 does. fuse_mxfp4_experts turns each
layer's experts into one `dzc.mxfp4_moe` kernel, also where a router returns fp32 top-k weights in a bf16 model
(Mixtral, DeepseekV3: the combine sums in fp32 and casts back, where the op rounds too). tests/test_model_zoo.py
runs the four MXFP4 rows in fp32, and Qwen3-MoE's and Mixtral's in bf16.

"""


def _merged(new_table: str, old_doc: str) -> str:
    """The table with the rows of `new_table` and, for every other zoo row, its row in `old_doc`, in ZOO's order
    (a run of some rows with --write replaces only theirs)."""
    def rows(text):
        found = {}
        for line in text.splitlines():
            cells = line.split(" | ")
            if line.startswith("| ") and cells[0][2:] in ZOO:
                found[cells[0][2:]] = line
        return found

    old, new = rows(old_doc), rows(new_table)
    header = new_table.splitlines()[:2]
    return "\n".join(header + [new.get(name) or old[name] for name in ZOO if name in new or name in old]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"rows to run (default all): {', '.join(ZOO)}")
    parser.add_argument("--write", action="store_true",
                        help="write the table into docs/zoo.md (with names: replace only those rows)")
    parser.add_argument("--report", action="store_true", help="print each bf16 compile report and its coverage")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ZOO]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(ZOO)}")
    results = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in args.names or ZOO:
            results[name] = [measure(ZOO[name], dtype, cache_dir) for dtype in DTYPES]
            for run in results[name]:
                print(f"{name} {run.dtype}: {_error_cell(run)} ({run.seconds:.1f} s)", file=sys.stderr)
                if args.report and run.dtype == torch.bfloat16:
                    print(run.report, file=sys.stderr)
    text = table(results)
    print(text)
    if args.write:
        import transformers  # noqa: PLC0415

        path = Path(__file__).resolve().parent.parent / "docs" / "zoo.md"
        if args.names:
            text = _merged(text, path.read_text() if path.exists() else "")
        doc = DOC_HEADER.format(version=transformers.__version__, fp32=TOLERANCE[torch.float32],
                                bf16=TOLERANCE[torch.bfloat16]) + text
        path.write_text(doc)
    return 0 if all(run.matches for runs in results.values() for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
