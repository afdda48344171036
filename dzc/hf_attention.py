"""dzc's attention implementation for transformers models, selected by dzc.compile: packed (varlen) attention
becomes dzc.varlen_attention with no graph pattern; everything else computes what the model's own implementation
does.

transformers models call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, attention_mask,
scaling=..., dropout=..., ...)`. When dzc.compile is handed a `PreTrainedModel` (or a module holding one), it
registers `dzc_flash_sdpa` and `dzc_flash_eager` (`AttentionInterface.register`) and selects, on every config the
model's modules use (text and vision sub-configs), the one whose base is that config's implementation, "sdpa" or
"eager" (a user's flash, flex or own implementation is left alone). `CompileOptions.hf_attention` says how long
the selection lasts.

"flash" in the name is what makes Qwen-VL-style vision towers take their packed path: one attention call over
the pack with `cu_seq_lens_q` and `max_length_q`, instead of splitting q, k, v per image in a Python loop
(which Dynamo unrolls: one graph per image count). That call is `dzc.varlen_attention`. Every other call goes to
the base implementation with the same arguments, and the name's mask function is the base's (sdpa's bool mask,
eager's additive one), so text models compute exactly what they did. Packed calls the op does not express
(causal, dropout, softcap, grouped heads, other q and k segments) run the base implementation per segment, which
is what the model's own non-flash path does; a packed call with a mask, a sliding window, sinks or a position bias
over the whole pack has no per-segment form and is an error, never a guess.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import weakref
from dataclasses import dataclass, field

import torch

# Names of dzc's implementations, by the implementation they stand in for.
NAMES = {"sdpa": "dzc_flash_sdpa", "eager": "dzc_flash_eager"}

_VARLEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# attention module class -> the eager_attention_forward of the file that defines it (each modeling file has its
# own: sinks, softcap, ...). Filled when a model is taken over, read under Dynamo.
_EAGER_FUNCTIONS: dict[type, object] = {}


def varlen_refusal(query, key, value, attention_mask, kwargs) -> str | None:
    """Why a packed call (cu_seq_lens_q given) is not plain non-causal attention inside each segment, which is
    all dzc.varlen_attention computes; None when it is."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_q:
        return "q and k have their own cu_seqlens"
    if attention_mask is not None:
        return "an attention mask on top of the segments"
    if kwargs.get("is_causal"):
        return "causal attention"
    if kwargs.get("dropout"):  # sdpa applies a dropout it is given even in eval mode
        return "dropout"
    for name in ("s_aux", "sliding_window", "softcap", "position_bias"):
        if kwargs.get(name) is not None:
            return name
    if query.dim() != 4 or query.shape[0] != 1:
        return f"not one packed sequence [1, heads, tokens, head_dim]: {tuple(query.shape)}"
    if key.shape != query.shape or value.shape != query.shape:
        return "k or v shaped unlike q (grouped heads)"
    if query.dtype not in _VARLEN_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype}"
    return None


def varlen_attention_forward(module, query, key, value, cu_seqlens, max_seqlen, scaling):
    """query/key/value [1, heads, tokens, head_dim] packed, segments by cu_seqlens -> [1, tokens, heads, head_dim]
    (the layout HF attention functions return)."""
    if isinstance(max_seqlen, torch.Tensor):  # a 0-d tensor (qwen2_5_vl_vision_inputs): read inside the graph
        max_seqlen = max_seqlen.item()
    if max_seqlen is None:
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.dzc.varlen_attention(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, scale, None, None)
    return out.unsqueeze(0), None


def _base_function(base: str, module):
    if base == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # By the class's MRO: dzc.compile may have swapped the module's class for a subclass (dzc/regions.py).
    function = next((_EAGER_FUNCTIONS[cls] for cls in type(module).__mro__ if cls in _EAGER_FUNCTIONS), None)
    if function is None:
        raise ValueError(f"dzc's attention (eager base): no eager_attention_forward found for "
                         f"{type(module).__qualname__} in {type(module).__module__}")
    return function


def _per_segment(base, module, query, key, value, kwargs):
    """The model's own non-flash path for a pack: the base implementation once per segment (segment i of q with
    segment i of k and v, as flash's varlen functions pair them), concatenated."""
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    q_pieces = torch.split(query, (cu_q[1:] - cu_q[:-1]).tolist(), dim=2)
    k_lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    kv_pieces = zip(torch.split(key, k_lengths, dim=2), torch.split(value, k_lengths, dim=2))
    function = _base_function(base, module)
    rest = {name: value for name, value in kwargs.items()
            if name not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    pieces = [function(module, q, k, v, None, **rest)[0] for q, (k, v) in zip(q_pieces, kv_pieces)]
    return torch.cat(pieces, dim=1), None


class PackedCallRefusal(ValueError):
    """A packed call dzc's attention implementation cannot compute as the model's own would. dzc.compile then puts
    the model's own implementation back (the report's attention_given_back says so) and calls again."""


# Packed-call arguments that apply to the whole pack: the base implementations, called per segment, cannot take
# them (sdpa ignores sliding_window and s_aux, leaving them to the mask and to eager).
_WHOLE_PACK_ARGUMENTS = ("sliding_window", "s_aux", "position_bias")


def _implementation(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("cu_seq_lens_q") is None:
            return _base_function(base, module)(module, query, key, value, attention_mask, **kwargs)
        reason = varlen_refusal(query, key, value, attention_mask, kwargs)
        if reason is None:
            return varlen_attention_forward(module, query, key, value, kwargs["cu_seq_lens_q"],
                                            kwargs.get("max_length_q"), kwargs.get("scaling"))
        if attention_mask is not None or any(kwargs.get(name) is not None for name in _WHOLE_PACK_ARGUMENTS):
            raise PackedCallRefusal(f"dzc's attention: {type(module).__qualname__} made a packed call ({reason}) "
                                    f"that neither dzc.varlen_attention nor {base} per segment computes")
        return _per_segment(base, module, query, key, value, kwargs)

    attention.__name__ = attention.__qualname__ = f"dzc_attention_{base}"
    return attention


def register() -> None:
    """Register dzc's implementations, and as their mask functions those of their bases."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: PLC0415
    from transformers.modeling_utils import AttentionInterface  # noqa: PLC0415

    for base, name in NAMES.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _implementation(base))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


@dataclass
class Selection:
    """Which configs of a model dzc's attention was selected on, and what each had before."""
    configs: list = field(default_factory=list)  # (config, the user's implementation)
    left: list[str] = field(default_factory=list)  # "ConfigClass: why it was left alone"
    eager_helpers: list[str] = field(default_factory=list)  # "module.name" of the helpers run outside the graph

    # The attribute behind the config's _attn_implementation property: its setter would also write the value it
    # is given into the sub-configs, whose bases may differ.
    def select(self) -> None:
        for config, original in self.configs:
            config._attn_implementation_internal = NAMES[original]

    def restore(self) -> None:
        for config, original in self.configs:
            config._attn_implementation_internal = original

    def __enter__(self):
        self.select()

    def __exit__(self, *exc):
        self.restore()

    def __str__(self) -> str:
        taken = ", ".join(f"{type(c).__name__} ({o} -> {NAMES[o]})" for c, o in self.configs) or "none"
        eager = f"; run eagerly, outside the graph: {', '.join(self.eager_helpers)}" if self.eager_helpers else ""
        return f"dzc attention on: {taken}" + "".join(f"; left alone: {why}" for why in self.left) + eager


def _model_configs(model: torch.nn.Module) -> list:
    """The distinct transformers configs the model's modules hold, in module order."""
    from transformers import PretrainedConfig  # noqa: PLC0415

    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs.setdefault(id(config), config)
    return list(configs.values())


# A modeling file that compares the implementation's name itself (DeepseekV32: `_attn_implementation in ("eager",
# "sdpa")` decides whether the top-k mask is applied, or handed to the attention function as `indices`) would take
# another path under dzc's name, which no check can vouch for. `is_flash_attention_requested`, the packed-sequence
# convention dzc's names opt into, is not such a comparison.
_NAME_COMPARISON = re.compile(r"_attn_implementation\s*(==|!=|\bin\b|\bnot\s+in\b)|\bin\s+[\w.]*_attn_implementation\b")


def _name_comparison(model: torch.nn.Module, config) -> str | None:
    """'file:line' of the first comparison of the attention implementation's name in the modeling code of the
    modules that hold `config`, or None."""
    names = dict.fromkeys(type(module).__module__ for module in model.modules()
                          if getattr(module, "config", None) is config)  # each modeling file read once
    for name in names:
        source_module = sys.modules.get(name)
        try:
            lines, _ = inspect.getsourcelines(source_module)
        except (OSError, TypeError):
            continue
        for number, line in enumerate(lines, 1):
            if _NAME_COMPARISON.search(line.split("#")[0]):
                return f"{source_module.__name__}:{number}"
    return None


def take_over(model, mode: str, owner) -> Selection | None:
    """Select dzc's attention on every config `model` uses, if it is or holds a transformers PreTrainedModel.

    mode "compiled": selected now, the user's implementations put back when `owner` (the CompiledModel) is
    garbage-collected; "calls": the caller enters the returned Selection around each compiled call; "off": nothing.
    """
    transformers = sys.modules.get("transformers")  # not imported: the model cannot be a PreTrainedModel
    if mode == "off" or transformers is None or not isinstance(model, torch.nn.Module):
        return None
    if not any(isinstance(m, transformers.PreTrainedModel) for m in model.modules()):
        return None
    register()
    selection = Selection()
    for config in _model_configs(model):
        current = config._attn_implementation
        if current in NAMES.values():
            continue  # already dzc's (use_dzc_attention, or another dzc.compile of the same model)
        if current not in NAMES:
            selection.left.append(f"{type(config).__name__}: attn_implementation {current!r} is the user's "
                                  "choice (dzc stands in only for 'sdpa' and 'eager')")
            continue
        compared = _name_comparison(model, config)
        if compared is not None:
            selection.left.append(f"{type(config).__name__}: its modeling code branches on the attention "
                                  f"implementation's name ({compared}); under another name it could compute "
                                  "something else")
            continue
        selection.configs.append((config, current))
    for module in model.modules():
        # The file that defines the class, or its base where dzc.compile swapped it for a subclass (dzc/regions.py)
        for cls in type(module).__mro__:
            function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
            if function is not None:
                _EAGER_FUNCTIONS[cls] = function
                break
    selection.eager_helpers = _run_size_helpers_eagerly(model)
    if mode == "compiled":
        selection.select()
        weakref.finalize(owner, selection.restore)
    return selection


# transformers.vision_utils holds "standalone functions for pre-computing very dynamic and data-dependent tensors
# that can break model graph capturing" (its docstring): cu_seqlens, rotary position ids and window indices from
# grid_thw, with Python loops over grid_thw.tolist(). Traced, each new image count recompiles their resumed loops
# (one graph set per request shape); run eagerly, they are a graph break each, and the graphs after them take
# their results as dynamic inputs: no recompile once Dynamo's automatic-dynamic warm-up is over (docs/vision.md).
# get_max_seqlen (the .item() of the longest segment) is the same kind of helper, from transformers.utils.generic.
_SIZE_HELPER_MODULES = {"transformers.vision_utils": None, "transformers.utils.generic": ("get_max_seqlen",)}


def mark_varying_dims(value) -> list[torch.Tensor]:
    """Leading dims of floating tensors (all dims of integer ones, e.g. token ids) may vary between calls: what
    dzc.compile assumes of a model's inputs, and of what the size helpers hand the graph. Returns the tensors it
    marked that carried no mark before (forget_marks takes the marks off them again).

    maybe_mark_dynamic is a hint, not an assertion: a dim the model code specialises (a size of 1, a size
    compared with a constant) stays static instead of raising.
    """
    if isinstance(value, torch.Tensor):
        fresh = not getattr(value, "_has_dynamo_dim_marking", False)
        dims = [dim for dim in range(value.dim() - 1 if value.is_floating_point() else value.dim())
                if value.shape[dim] > 1]
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(value, dim)
        return [value] if fresh and dims else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in mark_varying_dims(item)]
    return []


def forget_marks(tensors: list[torch.Tensor]) -> None:
    """Take the hints mark_varying_dims put on a call's inputs off again once the call is done: Dynamo compares a
    tensor's marks with those its graph was compiled for (a frame entry's saved guards reject marked inputs), and
    the caller's tensors should not carry dzc's hints into other compiles."""
    for tensor in tensors:
        for name in ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking"):
            tensor.__dict__.pop(name, None)


@functools.cache
def _eager(function):
    """function, run eagerly unless the caller passed precomputed inputs (one wrapper per function, so that guards
    on it hold across compiles). The helpers pop precomputed values from their `kwargs` argument: with some there
    (qwen2_5_vl_vision_inputs' tensors, or a max_seqlen the model computed once and hands its blocks), the traced
    helper returns them without a graph break."""
    def marked(*args, **kwargs):
        results = function(*args, **kwargs)
        # Sizes from data: dynamic from the first graph on, as the inputs are. Tensors' dims only: an int result
        # (get_max_seqlen's) can carry no mark, so Dynamo takes it as a constant until it first changes.
        mark_varying_dims(results)
        return results

    untraced = torch.compiler.disable(marked, recursive=True)

    @functools.wraps(function)
    def helper(*args, **kwargs):
        given = kwargs.get("kwargs")
        if isinstance(given, dict) and any(value is not None for value in given.values()):
            return function(*args, **kwargs)
        return untraced(*args, **kwargs)

    return helper


def _run_size_helpers_eagerly(model: torch.nn.Module) -> list[str]:
    """Bind the size helpers (_SIZE_HELPER_MODULES) to their eager wrappers in the namespaces of the modules that
    define `model`'s classes: process-wide (as Dynamo's capture settings are), the same values computed. Returns
    "module.name" of each binding replaced now or before."""
    helpers = {}
    for module_name, names in _SIZE_HELPER_MODULES.items():
        module = sys.modules.get(module_name)
        for name, value in vars(module).items() if module is not None else ():
            if inspect.isfunction(value) and value.__module__ == module_name and (names is None or name in names) \
                    and not name.startswith("_"):
                helpers[value] = _eager(value)
    wrappers = {id(wrapper) for wrapper in helpers.values()}
    replaced = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        namespace = vars(sys.modules[module_name]) if module_name in sys.modules else {}
        for name, value in list(namespace.items()):
            if not inspect.isfunction(value):
                continue
            if value in helpers:
                namespace[name] = helpers[value]
            elif id(value) not in wrappers:
                continue
            replaced.append(f"{module_name}.{name}")
    return replaced


def use_dzc_attention(model) -> None:
    """Select dzc's attention on `model` by hand (dzc.compile does it for transformers models): for a model
    compiled with torch.compile(backend=dzc.backend(...)) instead."""
    take_over(model, "compiled", model)


def qwen2_5_vl_vision_inputs(config, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The size-dependent inputs of a Qwen2.5-VL vision tower, computed eagerly by transformers' own helpers.

    Optional: passed as the tower's kwargs, they replace the helpers' Python loops over `grid_thw.tolist()` in the
    graph (docs/vision.md: what that changes). max_seqlen and max_window_seqlen are 0-d tensors, read with
    .item() inside the graph: as Python ints they would be specialised on (a recompile per value); computed inside
    the graph from cu_seqlens they would make Dynamo specialise on one image (a slice of one element).
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
