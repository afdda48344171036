"""Benchmark dzc's mxfp4_moe kernels (Triton: online dequant and workspace paths; TileLang: online dequant) against
eager dequantize-then-matmul, torch.compile of it, BF16 weights through torch._grouped_mm and, where it is there,
OpenAI's triton_kernels MXFP4 MoE (matmul_ogs), in one run (H200).

    python tools/bench_mxfp4_moe.py [--quick] [--musa-legal] [--models gpt-oss-120b deepseek-style]
                                    [--tokens 1 2 4 8 16 32 64 2048 8192] [--routing uniform skewed] [--out results.md]
    python tools/bench_mxfp4_moe.py --w4a8 --tokens 2048 8192 --codegens triton   # W4A8 (FP8) beside W4A16
    python tools/bench_mxfp4_moe.py ... --match "FP8_STACKED=1 SPLIT_K=1 WORKSPACE=0"   # defaults + those configs
    python tools/bench_mxfp4_moe.py --memory-only [--memory-layers 2] [--models ...]   # peak memory, no timings
    python tools/bench_mxfp4_moe.py --dry-run [--quick] [--triton-kernels DIR]   # CPU: the plan, no launches

Shapes are dzc.models.moe.CONFIGS (gpt-oss-120b: E=128, top-4, H=I=2880, clamped SwiGLU, biases, gate/up
interleaved; deepseek-style: E=256, top-8, H=7168, I=2048, SwiGLU, no biases). Weights are random MXFP4 (uniform
random E2M1 codes, scales 2^-8..2^-4), routing uniform-random top-k or skewed (Zipf over experts, s=1.2).

Figures: effective bandwidth = bytes of the packed weights and scales of the experts the call actually touches
÷ time (the decode roofline: 4.8 TB/s datasheet, ~4.3 copy); TFLOP/s = 2·T·k·3·H·I ÷ time (bf16 dense ~790,
datasheet 989); ratios against the eager dequant path and the BF16 grouped GEMM. dzc's kernels are timed as dzc
runs them: the whole op (routing, both GEMMs, combine) replayed from a CUDA graph (no host synchronisation in it),
with triton.testing.do_bench (L2 flushed before each call). Per token bucket the family's tier of configs is
timed and the best kept ("tuned"), besides the cost model's untuned choice ("default"). Every variant is checked
against the op's reference (dzc.ops.mxfp4_moe_reference) once before it is timed.

--musa-legal: only configs legal on musa:mp_22 (128-lane warps, <= 8 warps, 72 KiB shared memory, no fp8),
launched with the same thread counts on the H200 (num_warps x4): validates the algorithm and its tiling as the
MUSA card would run it; it does not measure MUSA speed, code generation or its compilers.

triton_kernels (OpenAI's MXFP4 MoE kernels, used by gpt-oss and vLLM): a baseline where the package is there,
--triton-kernels DIR or .triton-kernels/ at the repo root (tools/fetch_triton_kernels.sh copies it from a triton
snapshot: it must match the Triton installed, 3.6 on the H200). The same random weights, dequantized and
re-quantized by its own downcast_to_mxfp (exact: they are MXFP4 values already), in its Hopper swizzled value and
scale layouts (HopperMXValueLayout / HopperMXScaleLayout, as its bench_mlp.py builds them); the whole layer as
gpt-oss runs it, from a CUDA graph: routing metadata from topk_ids (its topk with the given indices, then
make_ragged_tensor_metadata), matmul_ogs gathering the tokens into the gate/up GEMM with its SwiGLU fused, and
matmul_ogs into the down GEMM scaled by topk_weights (gammas) and scattered back, summed over the top-k.
DeepSeek's silu(gate) * up runs as the same fused SwiGLU (alpha 1, no clamp) on gate/up rows interleaved offline
with a bias of -1 on the up rows: gate * sigmoid(gate) * ((up - 1) + 1). Skipped, with the reason printed, where
the package is absent, does not import, or fails to build, run or match the reference.

Memory: peak torch.cuda.max_memory_allocated of L stacked MoE layers run on a prefill batch: packed weights + one
workspace (shared by the layers) + activations, against the same layers with an offline BF16 copy of the experts
(run through torch._grouped_mm) and an offline FP8 copy (e4m3 + one fp32 scale per row: its storage, plus the
activations the BF16 run needed), and projected to the model's full depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import platform
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton
import triton.testing

from bench_add_rms_norm import graph_time  # tools/ is on sys.path when run as a script
from dzc import mxfp4
from dzc.models.moe import CONFIGS
from dzc.ops.mxfp4_moe import fp8_applies, glu_activation, mxfp4_moe_reference, mxfp4_moe_w4a8_reference
from dzc.targets import mxfp4_moe as family
from dzc.targets import tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, SM_90

PEAK_BYTES_PER_S = 4.8e12
PEAK_BF16_FLOPS = 989e12
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (2048, 8192)
# Full model depth, for the memory projection (gpt-oss-120b: 36 layers; DeepSeek-V3-style: 58 MoE layers).
MODEL_LAYERS = {"gpt-oss-120b": 36, "deepseek-style": 58}
# Prefill batch of the memory measurement: enough rows per expert that the cost model picks the workspace path.
MEMORY_TOKENS = 8192
# Configs timed per token bucket: the cost model's default plus up to this many more of the bucket's tier.
TUNED_CONFIGS = {"quick": 3, "full": 8}
# Where tools/fetch_triton_kernels.sh puts OpenAI's triton_kernels (git-ignored; carried to the GPU machine).
TRITON_KERNELS_DIR = Path(__file__).resolve().parent.parent / ".triton-kernels"


@dataclass
class Layer:
    name: str
    spec: family.MXFP4MoESpec
    w13_blocks: torch.Tensor
    w13_scales: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    w2_bias: torch.Tensor | None
    alpha: float
    limit: float

    def args(self, hidden, topk_ids, topk_weights) -> tuple:
        return (hidden, topk_ids, topk_weights, self.w13_blocks, self.w13_scales, self.w13_bias, self.w2_blocks,
                self.w2_scales, self.w2_bias, self.spec.activation, self.spec.interleaved, self.alpha, self.limit)


def model_spec(name: str) -> family.MXFP4MoESpec:
    cfg = CONFIGS[name]
    return family.MXFP4MoESpec(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k, torch.bfloat16, torch.float32,
                               torch.bfloat16 if cfg.expert_bias else None,
                               torch.bfloat16 if cfg.expert_bias else None, cfg.activation, cfg.gate_up_interleaved)


def random_layer(name: str, device, generator) -> Layer:
    cfg = CONFIGS[name]
    e, h, i = cfg.experts, cfg.hidden, cfg.intermediate
    on = dict(device=device, generator=generator)

    def packed(n, k):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, **on)
        scales = torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, **on)
        return blocks, scales

    w13_blocks, w13_scales = packed(2 * i, h)
    w2_blocks, w2_scales = packed(h, i)
    bias = (lambda rows: 0.1 * torch.randn(e, rows, **on).bfloat16()) if cfg.expert_bias else (lambda rows: None)
    return Layer(name, model_spec(name), w13_blocks, w13_scales, bias(2 * i), w2_blocks, w2_scales, bias(h), cfg.alpha,
                 cfg.limit)


def random_routing(spec, tokens: int, skewed: bool, device, generator):
    """(hidden, topk_ids int32, topk_weights fp32): distinct experts per token; skewed = Zipf(1.2) popularity."""
    logits = torch.rand(tokens, spec.experts, device=device, generator=generator).clamp_min(1e-9)
    logits = logits.log().neg().log().neg()
    if skewed:
        ranks = torch.arange(1, spec.experts + 1, device=device, dtype=torch.float32)
        logits = logits - 1.2 * ranks.log()  # Gumbel top-k over Zipf probabilities
    top, ids = logits.topk(spec.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    hidden = torch.randn(tokens, spec.hidden, device=device, generator=generator).bfloat16()
    return hidden, ids.to(torch.int32), weights


# ---------------------------------------------------------------------------------------------------------
# Baselines


def _expert_body(x_rows, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, activation: str,
                 interleaved: bool, alpha: float, limit: float):
    """One expert, dequantize then matmul (bf16 weights, fp32 accumulate): y [rows, H] fp32."""
    w13 = mxfp4.dequantize(w13_blocks, w13_scales, torch.bfloat16)
    gate_up = (x_rows @ w13.T).float()
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.float()
    act = glu_activation(gate_up, activation, interleaved, alpha, limit).to(x_rows.dtype)
    y = (act @ mxfp4.dequantize(w2_blocks, w2_scales, torch.bfloat16).T).float()
    return y + w2_bias.float() if w2_bias is not None else y


def dequant_loop(body):
    """The eager dequant path: for each activated expert (host loop), dequantize its weights and multiply."""

    def run(hidden, topk_ids, topk_weights, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
            activation, interleaved, alpha, limit):
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        ids = topk_ids.long()
        for e in ids.unique().tolist():
            tokens, slots = torch.where(ids == e)
            y = body(hidden[tokens], w13_blocks[e], w13_scales[e], None if w13_bias is None else w13_bias[e],
                     w2_blocks[e], w2_scales[e], None if w2_bias is None else w2_bias[e], activation, interleaved,
                     alpha, limit)
            out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
        return out.to(hidden.dtype)

    return run


class GroupedMMBaseline:
    """BF16 expert weights (an offline copy) through torch._grouped_mm; routing by torch ops, no host sync."""

    def __init__(self, layer: Layer):
        self.layer = layer
        self.w13 = self._dequantize(layer.w13_blocks, layer.w13_scales)  # [E, 2I, H]
        self.w2 = self._dequantize(layer.w2_blocks, layer.w2_scales)  # [E, H, I]

    @staticmethod
    def _dequantize(blocks, scales, experts_at_once: int = 8) -> torch.Tensor:
        """A few experts at a time: dequantize's fp32 intermediates for all 256 DeepSeek experts would be ~60 GB."""
        out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.bfloat16, device=blocks.device)
        for first in range(0, blocks.shape[0], experts_at_once):
            chunk = slice(first, first + experts_at_once)
            out[chunk] = mxfp4.dequantize(blocks[chunk], scales[chunk], torch.bfloat16)
        return out

    def __call__(self, hidden, topk_ids, topk_weights, *_):
        layer, spec = self.layer, self.layer.spec
        ids = topk_ids.reshape(-1).long()
        order = torch.sort(ids, stable=True).indices
        counts = torch.zeros(spec.experts, dtype=torch.int32, device=ids.device).index_add_(
            0, ids, torch.ones_like(ids, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = hidden[order // spec.top_k]
        gate_up = torch._grouped_mm(rows, self.w13.transpose(-2, -1), offs=offsets).float()
        sorted_experts = ids[order]
        if layer.w13_bias is not None:
            gate_up = gate_up + layer.w13_bias[sorted_experts].float()
        act = glu_activation(gate_up, spec.activation, spec.interleaved, layer.alpha, layer.limit).bfloat16()
        y = torch._grouped_mm(act, self.w2.transpose(-2, -1), offs=offsets).float()
        if layer.w2_bias is not None:
            y = y + layer.w2_bias[sorted_experts].float()
        y = y * topk_weights.reshape(-1)[order, None].float()
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, order // spec.top_k, y).to(hidden.dtype)


def load_triton_kernels(directory: str | None) -> tuple[types.SimpleNamespace | None, str]:
    """OpenAI's triton_kernels from `directory` (--triton-kernels; default .triton-kernels/ at the repo root, 'none'
    skips it), put first on sys.path and imported: (its functions, a line saying where from and which commit) or
    (None, why not). Imported here, not at the top: the CPU paths (--help, --dry-run) must not depend on it."""
    if directory is not None and directory.lower() == "none":
        return None, "skipped (--triton-kernels none)"
    path = Path(directory) if directory is not None else TRITON_KERNELS_DIR
    if not (path / "triton_kernels" / "__init__.py").is_file():
        how = "--triton-kernels" if directory is not None else "default"
        return None, (f"not found ({how} {path} has no triton_kernels/ package; bash tools/fetch_triton_kernels.sh "
                      f"copies it from a triton snapshot)")
    source = {}
    if (path / "SOURCE").is_file():
        for line in (path / "SOURCE").read_text().splitlines():
            key, _, value = line.partition(": ")
            source[key] = value
    origin = f"{path}, commit {source.get('commit', 'unknown (no SOURCE file)')[:12]}"
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        matmul = importlib.import_module("triton_kernels.matmul_ogs")
        tk = types.SimpleNamespace(
            matmul_ogs=matmul.matmul_ogs, PrecisionConfig=matmul.PrecisionConfig, RoutingData=matmul.RoutingData,
            GatherIndx=matmul.GatherIndx, ScatterIndx=matmul.ScatterIndx, FusedActivation=matmul.FusedActivation,
            FnSpecs=matmul.FnSpecs,
            swiglu_fn=importlib.import_module("triton_kernels.swiglu").swiglu_fn,
            downcast_to_mxfp=importlib.import_module("triton_kernels.numerics_details.mxfp").downcast_to_mxfp,
            layout=importlib.import_module("triton_kernels.tensor_details.layout"),
            **{name: getattr(importlib.import_module("triton_kernels.tensor"), name)
               for name in ("convert_layout", "wrap_torch_tensor", "FP4", "make_ragged_tensor_metadata")})
    except Exception as err:  # a package for another Triton: missing names, changed signatures
        return None, f"{origin}: does not import with Triton {triton.__version__}: {type(err).__name__}: {err}"
    return tk, f"{origin} ({matmul.__file__}), imported with Triton {triton.__version__}"


class TritonKernelsMoE:
    """The MoE layer on OpenAI's triton_kernels, as gpt-oss runs it (module docstring): MXFP4 weights in its Hopper
    swizzled layouts, routing metadata from topk_ids, two matmul_ogs calls (gather + gate/up GEMM + fused SwiGLU;
    down GEMM + gammas + scatter, summed over the top-k)."""

    def __init__(self, tk: types.SimpleNamespace, layer: Layer, experts_at_once: int = 8):
        self.tk, self.layer = tk, layer
        spec = layer.spec
        device = layer.w13_blocks.device
        w13_bias = layer.w13_bias
        w13_rows = None
        if spec.activation == "silu_glu":
            # silu(gate) * up as triton_kernels' fused SwiGLU: gate/up rows interleaved (its activation pairs
            # adjacent output columns), no clamp, alpha 1, and a bias of -1 on the up rows (it computes
            # gate * sigmoid(alpha * gate) * (up + 1)).
            if spec.interleaved or w13_bias is not None:
                raise NotImplementedError("silu_glu with interleaved gate/up or expert biases")
            i = spec.inter
            w13_rows = torch.stack((torch.arange(i, device=device), i + torch.arange(i, device=device)), -1).flatten()
            self.b13 = torch.zeros(spec.experts, 2 * i, dtype=torch.float32, device=device)
            self.b13[:, 1::2] = -1.0
            self.activation_args = (1.0, None)
            self.activation_name = "silu_glu as swiglu fused (alpha 1, no clamp, up bias -1)"
        else:
            if not spec.interleaved:
                raise NotImplementedError("clamped SwiGLU with gate and up halves not interleaved")
            self.b13 = None if w13_bias is None else w13_bias.float()
            self.activation_args, self.activation_name = (layer.alpha, layer.limit), "swiglu fused"
        self.b2 = None if layer.w2_bias is None else layer.w2_bias.float()
        self.w13_values, self.w13_scales = self._quantize(layer.w13_blocks, layer.w13_scales, w13_rows,
                                                          experts_at_once)
        self.w2_values, self.w2_scales = self._quantize(layer.w2_blocks, layer.w2_scales, None, experts_at_once)
        self.scale_layouts: dict[int, tuple] = {}  # num_warps -> (w13 scales, w2 scales) in that layout
        self.activation = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                             self.activation_args)

    def _quantize(self, blocks, scales, rows, experts_at_once):
        """dzc's packed weight [E, N, K] (its rows reordered by `rows` if given) -> triton_kernels' MXFP4 of its
        transpose [E, K, N] (what matmul_ogs multiplies, x [M, K] @ w [K, N]): values in HopperMXValueLayout,
        scales (E8M0 [E, K/32, N]) left strided until a num_warps picks their layout."""
        tk = self.tk
        values, block_scales = [], []
        for first in range(0, blocks.shape[0], experts_at_once):
            chunk = slice(first, first + experts_at_once)
            weight = mxfp4.dequantize(blocks[chunk], scales[chunk], torch.bfloat16)
            if rows is not None:
                weight = weight[:, rows]
            weight = weight.transpose(-2, -1)
            v, sc = tk.downcast_to_mxfp(weight, torch.uint8, axis=1)
            values.append(v.transpose(-2, -1).contiguous())  # [e, N, K/2]: K-major, as downcast_to_mxfp gives it
            block_scales.append(sc.transpose(-2, -1).contiguous())
        values = torch.cat(values).transpose(-2, -1)  # [E, K/2, N], K contiguous
        block_scales = torch.cat(block_scales).transpose(-2, -1)  # [E, K/32, N]
        layout_cls, layout_opts = tk.layout.HopperMXValueLayout, {"mx_axis": 1}
        return tk.convert_layout(tk.wrap_torch_tensor(values, dtype=tk.FP4), layout_cls, **layout_opts), block_scales

    @staticmethod
    def num_warps(tokens: int) -> int:
        """Its bench_mlp.py's choice for MXFP4 on Hopper (the scale layout is swizzled for the kernel's warps)."""
        return 4 if tokens <= 512 else 8

    def _precision(self, num_warps: int):
        if num_warps not in self.scale_layouts:
            tk = self.tk
            self.scale_layouts[num_warps] = tuple(
                tk.PrecisionConfig(weight_scale=tk.convert_layout(
                    tk.wrap_torch_tensor(scales), tk.layout.HopperMXScaleLayout, mx_axis=1, num_warps=num_warps))
                for scales in (self.w13_scales, self.w2_scales))
        return self.scale_layouts[num_warps]

    def describe(self, tokens: int) -> str:
        return f"HOPPER_VALUE/HOPPER_SCALE w{self.num_warps(tokens)}, {self.activation_name}"

    def routed(self, topk_ids, topk_weights):
        """Its routing metadata for these experts per token, built once in plain torch as its reference
        (make_bitmatrix_metadata_torch) defines it, not timed: the layer call on the tokens' hidden states.
        (Session 17: its own topk with given indices ended in a device-side index assert on the H200.)"""
        tk, spec = self.tk, self.layer.spec
        flat = topk_ids.reshape(-1).long()
        combine = torch.argsort(flat, stable=True)  # slot (rows grouped by expert) -> flat (token, choice) entry
        dispatch = torch.empty_like(combine)
        dispatch[combine] = torch.arange(flat.numel(), device=flat.device)  # flat entry -> its slot
        if not (0 <= int(flat.min()) and int(flat.max()) < spec.experts):
            raise ValueError(f"expert ids outside [0, {spec.experts})")
        ragged = tk.make_ragged_tensor_metadata(torch.bincount(flat, minlength=spec.experts).int(), flat.numel())
        routing = tk.RoutingData(None, ragged.slice_sizes, spec.experts, spec.top_k, ragged)
        gammas = topk_weights.reshape(-1).float()[combine]
        combine, dispatch = combine.int(), dispatch.int()
        gather, scatter = tk.GatherIndx(combine, dispatch), tk.ScatterIndx(dispatch, combine)

        def layer(hidden):
            pc13, pc2 = self._precision(self.num_warps(hidden.shape[0]))
            act = tk.matmul_ogs(hidden, self.w13_values, self.b13, routing, gather_indx=gather,
                                precision_config=pc13, fused_activation=self.activation)
            return tk.matmul_ogs(act, self.w2_values, self.b2, routing, scatter_indx=scatter, precision_config=pc2,
                                 gammas=gammas)
        return layer


# ---------------------------------------------------------------------------------------------------------
# dzc kernels


def bucket_configs(spec, codegen: str, bucket: int, musa_legal: bool, how_many: int,
                   match: list[str] | None = None) -> list[tuple[str, KernelConfig]]:
    """[("default", config), ("tuned candidates"...)] for the bucket: the cost model's choice first (no compile:
    the dry run lists them too). With `match`, the candidates are the tier's configs whose text contains one of
    those strings (all of them)."""
    if musa_legal:
        legal, _ = legal_configs(family, codegen, spec, MP_22)
        # The same threads per block on 32-lane warps.
        legal = [KernelConfig(c.params, c.num_warps * MP_22.warp_size // SM_90.warp_size, c.num_stages)
                 for c in legal]
    else:
        legal, _ = legal_configs(family, codegen, spec, SM_90)
    default = getattr(family, f"{codegen}_default_config")(spec, SM_90)
    tier, default = family.configs_for_bucket(spec, SM_90, bucket, legal,
                                              default if default in legal else legal[0])
    others = [c for c in tier if c != default]
    if match:
        return [("default", default)] + [("candidate", c) for c in others if any(text in str(c) for text in match)]
    # The default's tile with every other split of the reduction (a same-run A/B of split-K), then a spread
    # of the rest of the tier.
    tile = {k: v for k, v in default.params if k != "SPLIT_K"}
    splits = [c for c in others if {k: v for k, v in c.params if k != "SPLIT_K"} == tile
              and (c.num_warps, c.num_stages) == (default.num_warps, default.num_stages)]
    # and the default's tile with and without its weights by TMA and as the MMA's A operand, every split and
    # depth (same-run A/Bs; the workspace path's tile too: SWAP_AB tiles are online ones)
    variants = ("TMA", "SWAP_AB")

    def shape(config):  # the tile without its split, path and variants
        return {k: v for k, v in config.params if k not in ("SPLIT_K", "WORKSPACE", *variants)}

    # (and the default's own tile on other warp counts)
    alternatives = [c for c in others if c not in splits and shape(c) == shape(default)
                    and (c.num_warps == default.num_warps or c.params == default.params)]
    rest = [c for c in others if c not in splits + alternatives]
    step = max(1, len(rest) // max(how_many, 1))
    return [("default", default)] + [("candidate", c) for c in splits + alternatives + rest[::step][:how_many]]


class DzcKernels:
    """The family's generated kernels for one spec and codegen, launched as GeneratedKernel would."""

    def __init__(self, spec, codegen: str, workdir: Path, match: list[str] | None = None):
        self.spec, self.codegen, self.match = spec, codegen, match
        source = getattr(family, f"{codegen}_source")(spec, SM_90)
        path = workdir / f"mxfp4_moe_{codegen}_{abs(hash(spec))}.py"
        path.write_text(source)
        module = triton_codegen if codegen == "triton" else tilelang_codegen
        self.compiled = module.load(family, path, spec, SM_90)
        self.launch = getattr(family, f"{codegen}_launch")

    def configs(self, bucket: int, musa_legal: bool, how_many: int) -> list[tuple[str, KernelConfig]]:
        """[("default", config), ("tuned candidates"...)] for the bucket: the cost model's choice first."""
        return bucket_configs(self.spec, self.codegen, bucket, musa_legal, how_many, self.match)

    def run(self, config, args):
        inputs, (out,), _, result = family.prepare(self.spec, *args)
        self.launch(self.compiled, config, *inputs, out)
        return result


def time_configs(kernels: "DzcKernels", bucket: int, musa_legal: bool, how_many: int, op_args, expected, errors,
                 label: str) -> tuple[float, float, KernelConfig | None]:
    """The cost model's default, then the tier's candidates, each checked against `expected(config)` (a reference
    output and its relative tolerance; the errors are appended to `errors`) and timed: (default seconds, best
    seconds, best config)."""
    default_s = tuned_s = float("inf")
    tuned_config = None
    for role, config in kernels.configs(bucket, musa_legal, how_many):
        try:
            result = kernels.run(config, op_args)
        except Exception as err:  # a candidate that does not compile is skipped, as the tuner does
            if role == "default":
                raise
            print(f"skipped {config}: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
            continue
        errors.append(check(f"dzc {kernels.codegen} {config}", result, *expected(config)))
        seconds = graph_time(lambda c=config: kernels.run(c, op_args))
        print(f"  {label} {role} {config}: {seconds * 1e6:.1f} µs", file=sys.stderr)
        if role == "default":
            default_s = seconds
        if seconds < tuned_s:
            tuned_s, tuned_config = seconds, config
    return default_s, tuned_s, tuned_config


def plain_time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median") * 1e-3


W4A16_TOLERANCE = 2**-7  # bf16: a rounding of the activation and of the output, against the output's scale
# W4A8: besides those, an activation one bf16 ulp from the reference's can quantize to the neighbouring E4M3 value
# (2^-4 of it); over 2880-wide rows a few such flips moved outputs by up to 8.6e-3 of the scale on the H200
# (gpt-oss-120b, 2048 tokens, 2026-12-01). tests/test_mxfp4_moe_w4a8.py judges each GEMM exactly; this is the gross
# check a timing run needs.
W4A8_TOLERANCE = 2**-6


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, relative: float = W4A16_TOLERANCE) -> float:
    """The largest error against the output's scale must stay under `relative` of it; returns that error
    relative to the scale."""
    scale = expected.float().abs().max().item()
    error = (actual.float() - expected.float()).abs().max().item()
    if actual.isnan().any() or error > relative * scale + 1e-6:
        raise AssertionError(f"{name}: max error {error:.3g} vs output scale {scale:.3g}")
    return error / max(scale, 1e-30)


def time_triton_kernels(tk_moe: "TritonKernelsMoE | None", op_args, expected, errors) -> tuple[float, str]:
    """The triton_kernels layer checked against the op's reference (its error appended to `errors`) and timed
    from a CUDA graph (plainly, with the L2 flushed, where capture fails): (seconds, its config), NaN and why
    where it is not there or fails."""
    if tk_moe is None:
        return float("nan"), "-"
    hidden, topk_ids, topk_weights = op_args[:3]
    config = tk_moe.describe(hidden.shape[0]) + ", routing metadata precomputed (untimed)"
    try:
        layer = tk_moe.routed(topk_ids, topk_weights)
        error = check("triton_kernels", layer(hidden), expected)
    except Exception as err:  # a kernel that does not compile or launch here, or a wrong result
        print(f"triton_kernels baseline failed ({config}): {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
        return float("nan"), f"failed: {type(err).__name__}"
    errors.append(error)
    try:
        return graph_time(lambda: layer(hidden)), config
    except RuntimeError as err:
        print(f"triton_kernels: no CUDA graph ({str(err)[:200]}); timed call by call", file=sys.stderr)
        torch.cuda.synchronize()
        return plain_time(lambda: layer(hidden)), config + " (no graph)"


def dry_run(args, how_many: int, tk, tk_origin: str) -> None:
    """--dry-run: the arguments, each model's spec and the configs each token count would time (no compile),
    whether triton_kernels imports and from which commit; nothing touches a GPU."""
    print(f"dry run: triton_kernels {'found' if tk is not None else 'not used'}: {tk_origin}")
    for model in args.models:
        spec = model_spec(model)
        for tokens in args.tokens:
            bucket = family.token_bucket(tokens)
            plans = []
            for codegen in args.codegens:
                if codegen == "tilelang" and bucket > 64:
                    continue
                configs = bucket_configs(spec, codegen, bucket, args.musa_legal, how_many if codegen == "triton" else 0,
                                         args.match)
                plans.append(f"{codegen}: {len(configs)} configs (default {configs[0][1]})")
            if args.w4a8:
                configs = bucket_configs(dataclasses.replace(spec, fp8_activations=True), "triton", bucket, False,
                                         how_many, args.match)
                plans.append(f"w4a8: {len(configs)} configs (default {configs[0][1]})")
            tk_plan = (f"HOPPER_VALUE/HOPPER_SCALE w{TritonKernelsMoE.num_warps(tokens)}" if tk is not None else "-")
            print(f"dry run: {model} T={tokens} bucket {bucket}: {spec.describe()}; {'; '.join(plans)}; "
                  f"triton_kernels: {tk_plan}")


# ---------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b", "deepseek-style"], choices=sorted(MODEL_LAYERS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DECODE_TOKENS + PREFILL_TOKENS))
    parser.add_argument("--routing", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    parser.add_argument("--codegens", nargs="+", default=["triton", "tilelang"], choices=["triton", "tilelang"])
    parser.add_argument("--quick", action="store_true", help="a subset that finishes in about two minutes")
    parser.add_argument("--musa-legal", action="store_true", help="only configs legal on musa:mp_22 (see the doc)")
    parser.add_argument("--memory-layers", type=int, default=2,
                        help="stacked layers in the memory measurement (0: skip it)")
    parser.add_argument("--w4a8", action="store_true",
                        help="also time the W4A8 op (dzc.mxfp4_moe_w4a8: FP8 activations on the workspace path at "
                             "prefill sizes, W4A16 online at decode sizes)")
    parser.add_argument("--match", nargs="+",
                        help="time each bucket's default and only the tier's configs whose text contains one of these "
                             "(W4A16 and W4A8 alike; a config's text: KEY=VALUE pairs, sorted, space-separated)")
    parser.add_argument("--memory-only", action="store_true", help="only the memory measurement (no timings)")
    parser.add_argument("--triton-kernels", metavar="DIR",
                        help="OpenAI's triton_kernels package folder (holding triton_kernels/), timed as a baseline; "
                             "default: .triton-kernels/ at the repo root where present (tools/fetch_triton_kernels.sh)"
                             "; 'none': skip it")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: check the arguments, list the specs and the configs each token count would time "
                             "and whether triton_kernels imports; no GPU, nothing launched")
    parser.add_argument("--out", help="write the markdown report here too")
    args = parser.parse_args()
    if args.quick:
        args.models, args.tokens, args.routing = ["gpt-oss-120b"], [1, 8, 64, 2048], ["uniform"]
        args.codegens = ["triton"]
    how_many = TUNED_CONFIGS["quick" if args.quick else "full"]
    tk, tk_origin = load_triton_kernels(args.triton_kernels)
    if args.dry_run:
        dry_run(args, how_many, tk, tk_origin)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_mxfp4_moe needs a CUDA GPU (--dry-run checks the arguments without one)")
    print(f"triton_kernels baseline: {tk_origin}", file=sys.stderr, flush=True)
    device = torch.device("cuda")
    torch._dynamo.config.recompile_limit = 256
    workdir = Path(tempfile.mkdtemp(prefix="dzc-bench-mxfp4-moe-"))
    generator = torch.Generator(device=device).manual_seed(0)
    lines = [f"# dzc mxfp4_moe benchmark{' (MUSA-legal configs)' if args.musa_legal else ''}", "",
             f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Triton {triton.__version__}; "
             f"TileLang {tilelang_codegen.VERSION}; Python {platform.python_version()}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"triton_kernels: {tk_origin if tk is not None else 'not timed: ' + tk_origin}", "",
             "Effective bandwidth = packed weight + scale bytes of the experts touched / time (4.8 TB/s datasheet). "
             "dzc times: whole op from a CUDA graph. eager = dequantize-then-matmul per activated expert; "
             "compile = torch.compile of its per-expert body; grouped_mm = offline BF16 weights, torch._grouped_mm "
             "(CUDA graph); triton_kernels = OpenAI's MXFP4 MoE (matmul_ogs), the whole layer as gpt-oss runs it "
             "(CUDA graph; its weights re-quantized by its downcast_to_mxfp into its Hopper swizzled layouts; "
             "config = value/scale layouts, warps, activation). Ratios: baseline time / dzc tuned time.", ""]
    if args.memory_only:
        lines += memory_report(args.models, args.memory_layers, device, generator, workdir)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return
    header = ("| model | routing | T | experts touched | path (tuned) | dzc default µs | dzc tuned µs | TB/s "
              "| % of 4.8 | TFLOP/s | tilelang µs | W4A8 op µs | W4A8 op path | W4A8 TFLOP/s | eager µs | compile µs "
              "| grouped_mm µs | triton_kernels µs | triton_kernels config | vs eager | vs compile | vs grouped_mm "
              "| vs triton_kernels | rel. err |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    print("\n".join(lines), flush=True)
    compiled_body = torch.compile(_expert_body, dynamic=True)
    for model in args.models:
        layer = random_layer(model, device, generator)
        spec = layer.spec
        kernels = {cg: DzcKernels(spec, cg, workdir, args.match) for cg in args.codegens}
        w4a8_kernels = (DzcKernels(dataclasses.replace(spec, fp8_activations=True), "triton", workdir, args.match)
                        if args.w4a8 else None)
        grouped = GroupedMMBaseline(layer)
        tk_moe = None
        if tk is not None:
            try:
                tk_moe = TritonKernelsMoE(tk, layer)
            except Exception as err:  # e.g. a layout or kernel this Triton or GPU lacks
                print(f"triton_kernels baseline unavailable for {model}: {type(err).__name__}: {str(err)[:300]}",
                      file=sys.stderr)
        for routing in args.routing:
            for tokens in args.tokens:
                hidden, topk_ids, topk_weights = random_routing(spec, tokens, routing == "skewed", device, generator)
                op_args = layer.args(hidden, topk_ids, topk_weights)
                expected = mxfp4_moe_reference(*op_args)
                touched = int(topk_ids.unique().numel())
                useful_bytes = touched * family.packed_expert_bytes(spec)
                bucket = family.token_bucket(tokens)
                errors = []
                default_s = tuned_s = float("inf")
                tuned_config = None
                if "triton" in kernels:
                    default_s, tuned_s, tuned_config = time_configs(
                        kernels["triton"], bucket, args.musa_legal, how_many, op_args,
                        lambda config: (expected, W4A16_TOLERANCE), errors, f"{model} T={tokens}")
                w4a8_s, w4a8_path = float("nan"), "-"
                if w4a8_kernels is not None:
                    # The W4A8 op is W4A16 at decode sizes (dzc.ops.mxfp4_moe.fp8_applies), its reference too.
                    fp8 = fp8_applies(tokens, spec.top_k, spec.experts)
                    w4a8_expected = mxfp4_moe_w4a8_reference(*op_args)
                    _, w4a8_s, w4a8_config = time_configs(
                        w4a8_kernels, bucket, False, how_many, op_args,
                        lambda config: (w4a8_expected, W4A8_TOLERANCE if fp8 else W4A16_TOLERANCE),
                        errors, f"{model} T={tokens} W4A8")
                    w4a8_path = family.describe_config(w4a8_config).split(" (")[0] if w4a8_config else "-"
                tilelang_s = float("nan")
                if "tilelang" in kernels and bucket <= 64:
                    tl_kernels = kernels["tilelang"]
                    (_, tl_config), *_ = tl_kernels.configs(bucket, args.musa_legal, 0)
                    errors.append(check("dzc tilelang", tl_kernels.run(tl_config, op_args), expected))
                    tilelang_s = graph_time(lambda: tl_kernels.run(tl_config, op_args))
                eager = dequant_loop(_expert_body)
                errors.append(check("eager", eager(*op_args), expected))
                eager_s = plain_time(lambda: eager(*op_args))
                compiled = dequant_loop(compiled_body)
                errors.append(check("torch.compile", compiled(*op_args), expected))
                compile_s = plain_time(lambda: compiled(*op_args))
                try:
                    errors.append(check("grouped_mm", grouped(*op_args), expected))
                    grouped_s = graph_time(lambda: grouped(*op_args))
                except (RuntimeError, AssertionError) as err:
                    print(f"grouped_mm baseline unavailable: {err}", file=sys.stderr)
                    grouped_s = float("nan")
                tk_s, tk_config = time_triton_kernels(tk_moe, op_args, expected, errors)
                bandwidth = useful_bytes / tuned_s
                row = (f"| {model} | {routing} | {tokens} | {touched} | "
                       f"{family.describe_config(tuned_config).split(' (')[0] if tuned_config else '-'} | "
                       f"{default_s * 1e6:.1f} | {tuned_s * 1e6:.1f} | {bandwidth / 1e12:.2f} | "
                       f"{100 * bandwidth / PEAK_BYTES_PER_S:.0f}% | "
                       f"{family.flops(spec, tokens) / tuned_s / 1e12:.1f} | "
                       f"{tilelang_s * 1e6:.1f} | {w4a8_s * 1e6:.1f} | {w4a8_path} | "
                       f"{family.flops(spec, tokens) / w4a8_s / 1e12:.1f} | "
                       f"{eager_s * 1e6:.1f} | {compile_s * 1e6:.1f} | {grouped_s * 1e6:.1f} | "
                       f"{tk_s * 1e6:.1f} | {tk_config} | "
                       f"{eager_s / tuned_s:.1f}x | {compile_s / tuned_s:.1f}x | {grouped_s / tuned_s:.2f}x | "
                       f"{tk_s / tuned_s:.2f}x | {max(errors):.1e} |")
                lines.append(row)
                print(row, f"  [tuned: {tuned_config}]", flush=True)
                if args.out:  # the rows so far survive a run that dies later (a baseline's kernel crashing the GPU)
                    Path(args.out).write_text("\n".join(lines) + "\n")
        grouped = kernels = tk_moe = None  # free the BF16 and triton_kernels copies before the next model
        torch.cuda.empty_cache()
    if args.memory_layers:
        lines += ["", *memory_report(args.models, args.memory_layers, device, generator, workdir)]
    lines += ["", "Goals: decode >= 70% of 4.8 TB/s at T >= 8 and >= 55% at T = 1; >= 3x the eager dequant path; "
              "prefill >= 550 TFLOP/s at >= 256 rows per expert (gpt-oss T=8192)."]
    text = "\n".join(lines)
    print("\n".join(lines[-12:]))
    if args.out:
        Path(args.out).write_text(text + "\n")


def memory_report(models, layers: int, device, generator, workdir) -> list[str]:
    """Peak memory of `layers` stacked MoE layers on a prefill batch, MXFP4 (dzc) vs offline BF16 / FP8 copies."""
    lines = [f"## Peak GPU memory, {layers} stacked MoE layers, prefill T={MEMORY_TOKENS} (GiB)", "",
             "| model | dzc: packed + workspace + activations | of which workspace | BF16 copy (grouped_mm) | "
             "FP8 copy (storage + BF16 run's activations) | dzc saving vs FP8 | full depth: dzc / FP8 / BF16 |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    gib = 2**30
    for model in models:
        torch.cuda.empty_cache()
        family.release_workspaces()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stack = [random_layer(model, device, generator) for _ in range(layers)]
        spec = stack[0].spec
        hidden, topk_ids, topk_weights = random_routing(spec, MEMORY_TOKENS, False, device, generator)
        kernels = DzcKernels(spec, "triton", workdir)
        (_, config), *_ = kernels.configs(family.token_bucket(MEMORY_TOKENS), musa_legal=False, how_many=0)
        if not config["WORKSPACE"]:
            raise AssertionError(f"the memory measurement should run the workspace path; the cost model chose {config}")
        packed = sum(t.numel() * t.element_size() for layer in stack for t in
                     (layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales))
        torch.cuda.reset_peak_memory_stats()
        x = hidden
        for layer in stack:
            x = kernels.run(config, layer.args(x, topk_ids, topk_weights))
        torch.cuda.synchronize()
        dzc_peak = torch.cuda.max_memory_allocated() - base
        workspace = family.workspace_bytes(hidden.device)
        del x
        # BF16 copies, run through torch._grouped_mm.
        bf16_layers = [GroupedMMBaseline(layer) for layer in stack]
        for layer in stack:
            layer.w13_blocks = layer.w2_blocks = layer.w13_scales = layer.w2_scales = None
        del stack
        family.release_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_bf16 = torch.cuda.memory_allocated()
        weights_bf16 = sum(b.w13.numel() * 2 + b.w2.numel() * 2 for b in bf16_layers)
        x = hidden
        for baseline in bf16_layers:
            x = baseline(x, topk_ids, topk_weights)
        torch.cuda.synchronize()
        activations_bf16 = torch.cuda.max_memory_allocated() - base_bf16
        bf16_peak = weights_bf16 + activations_bf16
        fp8_weights = weights_bf16 // 2 + sum((b.w13.shape[0] * b.w13.shape[1] + b.w2.shape[0] * b.w2.shape[1]) * 4
                                              for b in bf16_layers)
        fp8_peak = fp8_weights + activations_bf16
        del bf16_layers, x
        torch.cuda.empty_cache()
        depth = MODEL_LAYERS[model]
        per_layer = packed / layers
        activations_dzc = dzc_peak - packed - workspace
        full = (depth * per_layer + workspace + activations_dzc, depth * fp8_weights / layers + activations_bf16,
                depth * weights_bf16 / layers + activations_bf16)
        lines.append(f"| {model} | {dzc_peak / gib:.2f} | {workspace / gib:.2f} | {bf16_peak / gib:.2f} | "
                     f"{fp8_peak / gib:.2f} | {100 * (1 - dzc_peak / fp8_peak):.0f}% | "
                     f"{full[0] / gib:.0f} / {full[1] / gib:.0f} / {full[2] / gib:.0f} "
                     f"({100 * (1 - full[0] / full[1]):.0f}% below FP8) |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
