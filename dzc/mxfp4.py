"""MXFP4 (OCP Microscaling Formats v1.0): the format, the gpt-oss checkpoint layout, and MoE experts held in it.

Format. A block of 32 consecutive elements along the last (reduction, K) dimension shares one E8M0 scale
X = 2^(s - 127) (s = 0xFF is NaN); each element is an E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa
bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}); value = X * element. 4.25 bits per weight.

Layout (gpt-oss, also what transformers and vLLM use): for a weight [..., N, K]
    blocks uint8 [..., N, K/32, 16]   two codes a byte, element 2j in the low nibble, 2j+1 in the high one
    scales uint8 [..., N, K/32]       the E8M0 exponent byte of each block

Quantization follows the spec: shared exponent = floor(log2(amax of the block)) - emax_elem (2 for E2M1),
clamped to E8M0's range; each element is w / X rounded to the nearest E2M1 value (ties to even) and saturated to
±6. Dequantization is exact (every E2M1 value times a power of two is representable in fp32 and, within bf16's
exponent range, in bf16).

MoE experts. `quantize_experts(model)` replaces the expert weights of a model's MoE layers by MXFP4 in place
(dzc's reference MoE in dzc.models.moe, and transformers' experts modules such as GptOss's); `read_gpt_oss_experts`
reads the packed expert tensors of a gpt-oss safetensors checkpoint as they are stored, and `load_experts` puts
them into such modules. Modules keep only the packed tensors; the eager forward dequantizes through the op
`dzc::mxfp4_dequantize`, so that a captured graph shows one recognisable node per weight, which the
fuse_mxfp4_experts pass turns into a dzc.mxfp4_moe kernel that never materialises the dequantized weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

BLOCK = 32  # elements per scale
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of E2M1's largest normal (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# Code -> value, code = sign << 3 | magnitude (identical to gpt-oss FP4_VALUES and transformers' LUT).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rounding |v| (already scaled, at most 6 after saturation) to the nearest E2M1 magnitude, ties to the even code:
# the magnitude code is the number of these thresholds that |v| passes. (">" where the tie goes down to the even
# code below, ">=" where the code above is the even one.)
_UP_AT_TIE = (False, True, False, True, False, True, False)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _e8m0_values() -> torch.Tensor:
    """fp32 value of every E8M0 byte: 2^(s - 127), NaN for 0xFF (2^-127 is an fp32 subnormal, exact)."""
    exponents = torch.arange(256, dtype=torch.float64) - E8M0_BIAS
    values = torch.ldexp(torch.ones(256, dtype=torch.float64), exponents).float()
    values[E8M0_NAN] = float("nan")
    return values


_E8M0_TABLE = _e8m0_values()
_E2M1_TABLE = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# The lookup tables on each device, copied once: a copy per call would cost a transfer every call and break
# CUDA-graph capture (no host-to-device copy may happen inside one).
_TABLES_ON: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table_on(name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _TABLES_ON:
        _TABLES_ON[key] = table.to(device)
    return _TABLES_ON[key]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (fp32/bf16/fp16, K a multiple of 32, finite) -> (blocks u8 [..., N, K/32, 16], scales u8
    [..., N, K/32]), per OCP MX v1.0."""
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mxfp4.quantize takes fp32, bf16 or fp16 weights, not {w.dtype}")
    if w.dim() < 2 or w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4.quantize needs a weight [..., N, K] with K a multiple of {BLOCK}; got shape "
                         f"{tuple(w.shape)}")
    values = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    if not torch.isfinite(values).all():
        raise ValueError("mxfp4.quantize: the weight has NaN or Inf elements (MXFP4 elements are finite)")
    amax = values.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: frexp gives amax = m * 2^p with m in [0.5, 1), so floor(log2) = p - 1. A block of
    # zeros gets the smallest scale (its elements are zero whatever the scale).
    _, p = torch.frexp(amax)
    shared = torch.where(amax > 0, p - 1 - E2M1_EMAX, torch.full_like(p, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    scales = (shared + E8M0_BIAS).to(torch.uint8)
    # w / X as an exact multiply by 2^(-shared) (a table entry: shared is in [-127, 125], so the index is in
    # [2, 254]); amax / X < 8, so nothing overflows.
    scaled = values * _table_on("e8m0", _E8M0_TABLE, w.device)[(E8M0_BIAS - shared).long()].unsqueeze(-1)
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, up_at_tie in zip(_MIDPOINTS, _UP_AT_TIE):
        code += (magnitude >= midpoint if up_at_tie else magnitude > midpoint).to(torch.uint8)
    code |= torch.signbit(scaled).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), scales


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(blocks u8 [..., N, K/32, 16], scales u8 [..., N, K/32]) -> weight [..., N, K] in dtype.

    Exact in fp32; in bf16 as long as the scales stay within bf16's exponent range (always, bf16 has fp32's);
    fp16 overflows to inf beyond 65504 and flushes below its subnormals, like any cast to fp16. A NaN scale
    (0xFF) gives NaN elements, as the spec says.
    """
    check_packed(blocks, scales, "blocks")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    elements = _table_on("e2m1", _E2M1_TABLE, blocks.device)[codes.long()]
    scale_values = _table_on("e8m0", _E8M0_TABLE, blocks.device)[scales.long()]
    return (elements * scale_values.unsqueeze(-1)).reshape(*scales.shape[:-1], -1).to(dtype)


def check_packed(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Raise a ValueError naming `name` unless (blocks, scales) are a well-formed MXFP4 pair (shapes, dtypes)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{name}: MXFP4 blocks are [..., N, K/32, 16] uint8; got shape {tuple(blocks.shape)}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: scales shape {tuple(scales.shape)} does not match blocks shape "
                         f"{tuple(blocks.shape)} (expected {tuple(blocks.shape[:-1])})")


@dataclass
class MXFP4Weight:
    """One packed weight [..., N, K]: the two tensors of the gpt-oss layout."""

    blocks: torch.Tensor  # u8 [..., N, K/32, 16]
    scales: torch.Tensor  # u8 [..., N, K/32]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape [..., N, K]."""
        return (*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> MXFP4Weight:
        return cls(*quantize(w))


@dataclass
class MXFP4Experts:
    """The expert weights of one MoE layer in the gpt-oss layout.

    gate_up: [E, 2I, H], gate and up rows interleaved (gate = rows 0::2, up = rows 1::2) when `interleaved`,
    else gate = the first I rows; down: [E, H, I]; biases (optional) [E, 2I] and [E, H] in the same row order.
    """

    gate_up: MXFP4Weight
    down: MXFP4Weight
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    interleaved: bool = True

    def check(self, where: str) -> None:
        """Raise a ValueError naming `where` unless the shapes describe one MoE layer."""
        experts, two_i, hidden = self.gate_up.shape
        if self.down.shape != (experts, hidden, two_i // 2) or two_i % 2:
            raise ValueError(f"{where}: down weight {self.down.shape} does not match gate_up {self.gate_up.shape} "
                             f"(expected [{experts}, {hidden}, {two_i // 2}])")
        for name, bias, rows in (("gate_up bias", self.gate_up_bias, two_i), ("down bias", self.down_bias, hidden)):
            if bias is not None and tuple(bias.shape) != (experts, rows):
                raise ValueError(f"{where}: {name} has shape {tuple(bias.shape)}, expected [{experts}, {rows}]")


# ---------------------------------------------------------------------------------------------------------------
# The dequantize op: what the eager forward of an MXFP4 experts module calls.

@torch.library.custom_op("dzc::mxfp4_dequantize", mutates_args=())
def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The op form of `dequantize`: opaque to capture, so the graph shows one node per dequantized weight."""
    return dequantize(blocks, scales, dtype)


@mxfp4_dequantize.register_fake
def _mxfp4_dequantize_fake(blocks, scales, dtype):
    check_packed(blocks, scales, "dzc.mxfp4_dequantize")
    return blocks.new_empty((*scales.shape[:-1], scales.shape[-1] * BLOCK), dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss checkpoints: the packed expert tensors as stored, under either naming.

# name pattern -> (layer group, which weight, which part)
_CHECKPOINT_NAMES = (
    # openai/gpt-oss original names
    (re.compile(r"^block\.(\d+)\.mlp\.mlp1_weight\.(blocks|scales)$"), "gate_up"),
    (re.compile(r"^block\.(\d+)\.mlp\.mlp2_weight\.(blocks|scales)$"), "down"),
    (re.compile(r"^block\.(\d+)\.mlp\.mlp1_(bias)$"), "gate_up"),
    (re.compile(r"^block\.(\d+)\.mlp\.mlp2_(bias)$"), "down"),
    # transformers names
    (re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.gate_up_proj_(blocks|scales|bias)$"), "gate_up"),
    (re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.down_proj_(blocks|scales|bias)$"), "down"),
)


def _packed_blocks(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks as [E, N, K/32, 16]; also accepts the flattened [E, N, K/2] bytes transformers keeps in memory."""
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks are uint8, got {tensor.dtype}")
    if tensor.dim() == 3:
        if tensor.shape[-1] % (BLOCK // 2):
            raise ValueError(f"{name}: K = {2 * tensor.shape[-1]} (from {tuple(tensor.shape)} packed bytes) is not a "
                             f"multiple of {BLOCK}")
        return tensor.reshape(*tensor.shape[:-1], -1, BLOCK // 2)
    if tensor.dim() != 4 or tensor.shape[-1] != BLOCK // 2:
        raise ValueError(f"{name}: expected MXFP4 blocks [E, N, K/32, 16] uint8, got shape {tuple(tensor.shape)}")
    return tensor


def _checked_scales(tensor: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name}: E8M0 scales are uint8, got {tensor.dtype}")
    if tuple(tensor.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match its blocks (expected "
                         f"{tuple(blocks.shape[:-1])})")
    nan = (tensor == E8M0_NAN).nonzero()
    if len(nan):
        raise ValueError(f"{name}: {len(nan)} NaN scales (0xFF), first at index {tuple(nan[0].tolist())}")
    return tensor


def read_gpt_oss_experts(path: str | Path, device: str | torch.device = "cpu") -> dict[int, MXFP4Experts]:
    """The MXFP4 experts of every layer in a gpt-oss safetensors file (original or transformers names), as stored:
    packed, gate/up rows interleaved. Only the expert tensors are read; malformed ones raise a ValueError naming
    the tensor."""
    from safetensors import safe_open  # noqa: PLC0415 (only this reader needs it)

    parts: dict[int, dict[tuple[str, str], tuple[str, torch.Tensor]]] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        for name in f.keys():
            for pattern, weight in _CHECKPOINT_NAMES:
                match = pattern.match(name)
                if match:
                    layer, part = int(match.group(1)), match.group(2)
                    parts.setdefault(layer, {})[(weight, part)] = (name, f.get_tensor(name))
                    break
    layers = {}
    for layer, found in sorted(parts.items()):
        weights = {}
        for weight in ("gate_up", "down"):
            if (weight, "blocks") not in found:
                present = ", ".join(name for name, _ in found.values())
                raise ValueError(f"layer {layer}: no {weight} blocks among its expert tensors ({present})")
            blocks_name, blocks = found[(weight, "blocks")]
            blocks = _packed_blocks(blocks, blocks_name)
            scales_name = _sibling(blocks_name, "scales")
            if (weight, "scales") not in found:
                raise ValueError(f"{blocks_name}: its scales tensor {scales_name} is missing")
            scales = _checked_scales(found[(weight, "scales")][1], blocks, scales_name)
            weights[weight] = MXFP4Weight(blocks, scales)
        biases = {}
        for weight in ("gate_up", "down"):
            bias_name, bias = found.get((weight, "bias"), (None, None))
            rows = weights[weight].shape[:2]
            if bias is not None and (tuple(bias.shape) != rows or not bias.is_floating_point()):
                raise ValueError(f"{bias_name}: a {bias.dtype} bias of shape {tuple(bias.shape)}, expected a floating "
                                 f"[{rows[0]}, {rows[1]}]")
            biases[weight] = bias
        experts = MXFP4Experts(weights["gate_up"], weights["down"], biases["gate_up"], biases["down"],
                               interleaved=True)
        experts.check(f"layer {layer} experts ({', '.join(name for name, _ in found.values())})")
        layers[layer] = experts
    return layers


def _sibling(blocks_name: str, part: str) -> str:
    return blocks_name[: -len("blocks")] + part


# ---------------------------------------------------------------------------------------------------------------
# Experts modules held in MXFP4.

def _is_transformers_experts(module: nn.Module) -> bool:
    """transformers' experts modules (use_experts_implementation) that store gate_up_proj / down_proj as 3-D
    tensors: recognised by those attributes, so every model family built with the decorator is covered."""
    return (hasattr(module, "is_transposed") and hasattr(module, "has_gate")
            and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor))


class _MXFP4TransformersExperts:
    """Mixed into a transformers experts class: gate_up_proj / down_proj become properties that dequantize the
    packed buffers, in the layout the class's forward expects ([E, in, out] if is_transposed, else [E, out, in]).
    Every experts implementation of transformers (eager loop, batched_mm, grouped_mm) then runs unchanged."""

    def _dequantized(self, name: str) -> torch.Tensor:
        dtype = self.mxfp4_compute_dtype
        w = torch.ops.dzc.mxfp4_dequantize(getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales"), dtype)
        return w.transpose(-1, -2) if self.is_transposed else w

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._dequantized("gate_up_proj")

    @property
    def down_proj(self) -> torch.Tensor:
        return self._dequantized("down_proj")

    def _apply(self, fn, recurse=True):
        """Module.to / .bfloat16() / .half(): the packed uint8 buffers stay as they are (casts touch floating-point
        tensors only), and the dtype the weights dequantize to follows the cast, as a float weight would (else a
        model cast to bf16 would run its experts in the quantized-from dtype)."""
        self.mxfp4_compute_dtype = fn(torch.empty(0, dtype=self.mxfp4_compute_dtype)).dtype
        return super()._apply(fn, recurse)


_MIXED_CLASSES: dict[type, type] = {}


def _mxfp4_class(cls: type) -> type:
    if cls not in _MIXED_CLASSES:
        _MIXED_CLASSES[cls] = type(f"MXFP4{cls.__name__}", (_MXFP4TransformersExperts, cls), {})
    return _MIXED_CLASSES[cls]


def _set_transformers_experts(module: nn.Module, experts: MXFP4Experts, dtype: torch.dtype) -> None:
    if not module.has_gate:
        raise ValueError(f"{type(module).__name__}: experts without a gate projection are not supported")
    for name, weight in (("gate_up_proj", experts.gate_up), ("down_proj", experts.down)):
        if name in module._parameters:
            del module._parameters[name]
        module.register_buffer(f"{name}_blocks", weight.blocks)
        module.register_buffer(f"{name}_scales", weight.scales)
    for name, bias in (("gate_up_proj_bias", experts.gate_up_bias), ("down_proj_bias", experts.down_bias)):
        if bias is not None:
            setattr(module, name, nn.Parameter(bias.to(dtype), requires_grad=False))
    module.mxfp4_compute_dtype = dtype
    module.__class__ = _mxfp4_class(type(module))


def _transformers_experts_weights(module: nn.Module) -> MXFP4Experts:
    """Quantize a transformers experts module's weights, in the [E, out, in] layout MXFP4 scales along."""
    def rows_out(w):
        return w.detach().transpose(-1, -2) if module.is_transposed else w.detach()

    return MXFP4Experts(MXFP4Weight.from_float(rows_out(module.gate_up_proj)),
                        MXFP4Weight.from_float(rows_out(module.down_proj)),
                        interleaved=not module.is_concatenated)


def quantize_experts(model: nn.Module) -> list[str]:
    """Replace, in place, the expert weights of every MoE layer of `model` by MXFP4 (packed blocks and scales
    buffers; the full-precision parameters are dropped). Handles dzc's reference MoE experts and transformers'
    experts modules (GptOss, and any class built with `use_experts_implementation`). Returns the names of the
    modules it quantized; raises if it finds none."""
    from dzc.models.moe import MoEExperts  # noqa: PLC0415 (models import this module)

    done = []
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts):
            if module.weight_format == "mxfp4":
                continue
            module.quantize()
        elif _is_transformers_experts(module) and not isinstance(module, _MXFP4TransformersExperts):
            dtype = module.gate_up_proj.dtype
            _set_transformers_experts(module, _transformers_experts_weights(module), dtype)
        else:
            continue
        done.append(name)
    if not done:
        raise ValueError(f"quantize_experts: no MoE experts module found in {type(model).__name__}")
    return done


def load_experts(module: nn.Module, experts: MXFP4Experts, dtype: torch.dtype = torch.bfloat16) -> None:
    """Put packed experts (e.g. from read_gpt_oss_experts) into an experts module, dropping its float weights.

    Shapes must match the module's; gate/up row order must match how its forward splits them."""
    from dzc.models.moe import MoEExperts  # noqa: PLC0415

    where = type(module).__name__
    experts.check(where)
    if isinstance(module, MoEExperts):
        module.load_mxfp4(experts)
        return
    if not (_is_transformers_experts(module) or isinstance(module, _MXFP4TransformersExperts)):
        raise TypeError(f"load_experts: {where} is not an experts module dzc knows")
    expected = (module.num_experts, 2 * module.intermediate_size, module.hidden_size)
    if experts.gate_up.shape != expected:
        raise ValueError(f"load_experts: gate_up {experts.gate_up.shape} does not fit {where} (expected {expected})")
    if experts.interleaved == module.is_concatenated:
        raise ValueError(f"load_experts: {where} expects gate/up rows "
                         f"{'concatenated' if module.is_concatenated else 'interleaved'}")
    _set_transformers_experts(module, experts, dtype)
