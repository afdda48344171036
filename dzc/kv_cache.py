"""A paged KV cache for DeepSeek Sparse Attention (DSA) models: the state that survives across decode steps.

Memory is a pool of fixed-size pages (64 tokens each, the page size vLLM's and SGLang's DSA backends use).
Each sequence owns a list of pages, its row of the block table: token position p of sequence b lives in
physical page `block_table[b, p // 64]`, slot `p % 64`. Prefill writes a sequence's first tokens; each decode
step appends one token per sequence, taking a page from the free list when the last page is full. Nothing is
ever moved or concatenated: a step writes only its new tokens, so the state survives without copying the cache.

Per layer the cache holds:
- the MLA latent cache (KV latent 512 + RoPE key 64, one "head" shared by all attention heads), in one of two
  layouts (an option of the cache, `fp8_latent`; granted by `for_profile` only where the profile has e4m3):
  - BF16: bf16 [pages, 64, 1, 576] (FlashMLA's bf16 layout).
  - FP8 ("fp8_ds_mla", FlashMLA's FP8 cache): uint8 [pages, 64, 1, 656], per token 512 e4m3 NoPE values, 4 fp32
    scales (one per 128 values, amax / 448, floored at the smallest normal fp32, as vLLM's writer does), then the
    64 RoPE values in bf16. Readers dequantize value * scale to the MMA dtype; the RoPE part stays bf16.
- the lightning indexer's key cache, in one of two layouts chosen by the device profile (`supports_dtype(fp8)`,
  never the vendor):
  - FP8: uint8 [pages, 64 * 132]: per page the 64 x 128 e4m3 values first, then 64 fp32 scales, one per token
    (132 B/token, the layout vLLM and SGLang use). A key is quantized with amax clamped >= 1e-4, its scale
    amax / 448 rounded up to a power of two (DeepSeek's `act_quant(..., scale_fmt="ue8m0")`).
  - BF16: bf16 [pages, 64, 128].

The layout functions here are the one definition of the FP8 layouts: `fp8_index_page_bytes`,
`split_fp8_index_pages`, `split_fp8_index_page_bytes`, `quantize_index_keys` for the indexer keys;
`fp8_latent_token_bytes`, `fp8_latent_parts`, `quantize_latent`, `dequantize_latent` for the latent. dzc.ops.dsa
and the kernels read caches through them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dzc.targets.profiles import DeviceProfile

PAGE_SIZE = 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-4  # keys whose amax is below this get the scale of this amax (no division by ~0)
SCALE_BYTES = 4  # one fp32 scale per token
FP8_LATENT_TILE = 128  # latent NoPE values per fp32 scale (FlashMLA's 1 x 128 tiles)
ROPE_DTYPE = torch.bfloat16  # the FP8 latent layout keeps the RoPE key in bf16


def fp8_index_page_bytes(page_size: int, head_dim: int) -> int:
    """Bytes of one page of the FP8 indexer key cache: page_size * head_dim e4m3 values, then fp32 scales."""
    return page_size * (head_dim + SCALE_BYTES)


def _fp8_index_page_size(cache: torch.Tensor, head_dim: int) -> int:
    pages, page_bytes = cache.shape
    if cache.dtype != torch.uint8 or page_bytes % (head_dim + SCALE_BYTES):
        raise ValueError(f"an FP8 indexer key cache is uint8 [pages, page_size * {head_dim + SCALE_BYTES}]; got "
                         f"{cache.dtype} {list(cache.shape)}")
    return page_bytes // (head_dim + SCALE_BYTES)


def split_fp8_index_pages(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [pages, page_size * (head_dim + 4)] -> (e4m3 values [pages, page_size, head_dim], fp32 scales
    [pages, page_size]), both views of the cache's memory."""
    pages, page_size = cache.shape[0], _fp8_index_page_size(cache, head_dim)
    values = cache[:, : page_size * head_dim].view(torch.float8_e4m3fn).view(pages, page_size, head_dim)
    # The whole pool viewed as fp32 words, then the scale columns: Inductor lowers a view that changes the element
    # size of a strided tensor (the scale area alone) as a contiguous copy first, a copy of the scale area on
    # every compiled call.
    scales = cache.view(torch.float32)[:, page_size * head_dim // SCALE_BYTES:]
    return values, scales


def split_fp8_index_page_bytes(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two areas as split_fp8_index_pages, as uint8 views: value bytes [pages, page_size, head_dim] and
    scale bytes [pages, page_size, 4]. For writes: no view changes the element size of the strided pool (Inductor
    lowers such a view as a copy, and a compiled in-place write through it would be lost)."""
    pages, page_size = cache.shape[0], _fp8_index_page_size(cache, head_dim)
    value_bytes = cache[:, : page_size * head_dim].view(pages, page_size, head_dim)
    scale_bytes = cache[:, page_size * head_dim:].view(pages, page_size, SCALE_BYTES)
    return value_bytes, scale_bytes


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., head_dim] -> (e4m3 values, fp32 power-of-two scales [...]); keys ~= values * scale.

    One scale per key (DeepSeek quantizes in blocks of 128 = the index head dim): amax clamped >= 1e-4, scale =
    2^ceil(log2(amax / 448)), so that the largest value maps inside e4m3's range and the scale is exact."""
    amax = keys.float().abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scales = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    values = (keys.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scales


def fp8_latent_token_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token of the FP8 latent cache: kv_lora_rank e4m3 values, one fp32 scale per 128 of them, then
    rope_dim bf16 RoPE values (656 for DeepSeek-V3.2's 512 + 64)."""
    if kv_lora_rank % FP8_LATENT_TILE:
        raise ValueError(f"the FP8 latent layout quantizes in tiles of {FP8_LATENT_TILE}: kv_lora_rank "
                         f"{kv_lora_rank} is not a multiple")
    return kv_lora_rank + SCALE_BYTES * (kv_lora_rank // FP8_LATENT_TILE) + ROPE_DTYPE.itemsize * rope_dim


def fp8_latent_parts(kv_lora_rank: int) -> tuple[int, int]:
    """(byte offset of the scales, byte offset of the RoPE values) within a token of the FP8 latent layout."""
    scales = kv_lora_rank
    return scales, scales + SCALE_BYTES * (kv_lora_rank // FP8_LATENT_TILE)


def fp8_latent_rank(token_bytes: int, latent_dim: int) -> int | None:
    """The kv_lora_rank of an FP8 latent layout with `token_bytes` per token whose dequantized rows are latent_dim
    wide (the inverse of fp8_latent_token_bytes), else None."""
    for rank in range(FP8_LATENT_TILE, latent_dim + 1, FP8_LATENT_TILE):
        if fp8_latent_token_bytes(rank, latent_dim - rank) == token_bytes:
            return rank
    return None


def quantize_latent(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """latent [..., kv_lora_rank + rope] -> uint8 [..., fp8_latent_token_bytes]: the NoPE part as e4m3 with one
    fp32 scale per 128 values (scale = amax / 448, at least the smallest normal fp32: an all-zero tile stores
    zeros), the RoPE part as bf16. Bytes of one token are contiguous, so a write is one row per token."""
    nope = latent[..., :kv_lora_rank].float().unflatten(-1, (-1, FP8_LATENT_TILE))
    scales = (nope.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (nope / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    rope = latent[..., kv_lora_rank:].to(ROPE_DTYPE).contiguous()
    return torch.cat((values.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.view(torch.uint8)),
                     dim=-1)


def dequantize_latent(token_bytes: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., fp8_latent_token_bytes] -> [..., kv_lora_rank + rope] in `dtype`: value * scale rounded to dtype
    (what an MMA in dtype multiplies), the bf16 RoPE part converted. The oracle of every FP8 latent reader."""
    scale_at, rope_at = fp8_latent_parts(kv_lora_rank)
    token_bytes = token_bytes.contiguous()
    values = token_bytes[..., :scale_at].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, FP8_LATENT_TILE))
    scales = token_bytes[..., scale_at:rope_at].contiguous().view(torch.float32)
    nope = (values * scales.unsqueeze(-1)).flatten(-2).to(dtype)
    rope = token_bytes[..., rope_at:].contiguous().view(ROPE_DTYPE).to(dtype)
    return torch.cat((nope, rope), dim=-1)


@dataclass(frozen=True)
class DSACacheConfig:
    """What a layer stores per token; the defaults are DeepSeek-V3.2's."""

    layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    page_size: int = PAGE_SIZE

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


class PagedKVCache:
    """Pages, block tables and lengths for a batch of sequences, plus the per-layer latent and indexer caches.

    Usage per forward step: `slots = cache.reserve(new_tokens)` (allocates pages, grows the lengths), the model
    writes each layer's new rows through `write_latent` / `write_index_keys` at those slots, and reads the state
    through `block_table` / `seq_lens` (device tensors, rebuilt only when a page is added or a length grows).
    """

    def __init__(self, config: DSACacheConfig, max_pages: int, batch: int, fp8_index: bool,
                 device: torch.device | str = "cpu", latent_dtype: torch.dtype = torch.bfloat16,
                 fp8_latent: bool = False):
        if max_pages < 1 or batch < 1:
            raise ValueError(f"a paged cache needs at least one page and one sequence (max_pages={max_pages}, "
                             f"batch={batch})")
        self.config = config
        self.page_size = config.page_size
        self.fp8_index = fp8_index
        self.fp8_latent = fp8_latent
        self.device = torch.device(device)
        self.free_pages = list(range(max_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.pages: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = [0] * batch
        if fp8_latent:
            row, latent_dtype = fp8_latent_token_bytes(config.kv_lora_rank, config.qk_rope_head_dim), torch.uint8
        else:
            row = config.latent_dim
        self.latent = [torch.zeros(max_pages, self.page_size, 1, row, dtype=latent_dtype, device=self.device)
                       for _ in range(config.layers)]
        if fp8_index:
            shape = (max_pages, fp8_index_page_bytes(self.page_size, config.index_head_dim))
            self.index_keys = [torch.zeros(shape, dtype=torch.uint8, device=self.device)
                               for _ in range(config.layers)]
        else:
            shape = (max_pages, self.page_size, config.index_head_dim)
            self.index_keys = [torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
                               for _ in range(config.layers)]

    @classmethod
    def for_profile(cls, profile: DeviceProfile, config: DSACacheConfig, max_pages: int, batch: int,
                    device: torch.device | str = "cpu", fp8_latent: bool = False) -> PagedKVCache:
        """The indexer keys in FP8 where the profile has e4m3, BF16 elsewhere (mp_22, sm_80); the latent in FP8
        where asked (`fp8_latent`: it changes numerics) and the profile has e4m3, BF16 otherwise."""
        fp8 = profile.supports_dtype(torch.float8_e4m3fn)
        return cls(config, max_pages, batch, fp8, device, fp8_latent=fp8_latent and fp8)

    @property
    def batch(self) -> int:
        return len(self.pages)

    def reserve(self, new_tokens: list[int]) -> torch.Tensor:
        """Grow sequence b by new_tokens[b] tokens, allocating pages from the free list; returns the physical
        slots (page * page_size + offset) of the new tokens, in sequence order, int64 [sum(new_tokens)]."""
        if len(new_tokens) != self.batch or any(n < 0 for n in new_tokens):
            raise ValueError(f"reserve takes one non-negative token count per sequence ({self.batch}); "
                             f"got {new_tokens}")
        needed = sum(math.ceil((self.lengths[b] + n) / self.page_size) - len(self.pages[b])
                     for b, n in enumerate(new_tokens))
        if needed > len(self.free_pages):
            raise RuntimeError(f"paged KV cache out of pages: {needed} more needed, {len(self.free_pages)} free")
        slots = []
        for b, count in enumerate(new_tokens):
            start, end = self.lengths[b], self.lengths[b] + count
            for _ in range(math.ceil(end / self.page_size) - len(self.pages[b])):
                self.pages[b].append(self.free_pages.pop())
            # Vectorised over the new positions (a 1M-token prefill), reading only the pages they fall in.
            first = start // self.page_size
            touched = torch.tensor(self.pages[b][first:math.ceil(end / self.page_size)], dtype=torch.int64)
            positions = torch.arange(start, end, dtype=torch.int64)
            slots.append(touched[positions // self.page_size - first] * self.page_size + positions % self.page_size)
            self.lengths[b] = end
        return torch.cat(slots).to(self.device)

    def free(self, sequence: int) -> None:
        """Return a finished sequence's pages to the free list; its row restarts empty."""
        self.free_pages.extend(reversed(self.pages[sequence]))
        self.pages[sequence] = []
        self.lengths[sequence] = 0

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [batch, max pages in use]; rows of shorter sequences are padded with page 0 (never read: the
        lengths mark those positions invalid)."""
        width = max(1, max(len(p) for p in self.pages))
        rows = [p + [0] * (width - len(p)) for p in self.pages]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int32, device=self.device)

    def write_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [tokens, 576] -> the layer's latent cache at `slots` (in place), quantized when FP8."""
        write_latent(self.latent[layer], slots, latent, self.config.kv_lora_rank)

    def write_index_keys(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [tokens, 128] -> the layer's indexer key cache at `slots` (in place), quantized when FP8."""
        write_index_keys(self.index_keys[layer], slots, keys)


def write_index_keys(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Store keys [tokens, head_dim] at physical slots of an indexer key cache in either layout (in place).

    The FP8 layout quantizes each key (quantize_index_keys) and writes its e4m3 values and scale into the page
    areas split_fp8_index_pages defines. A plain function of tensors, so that a model's forward can call it."""
    head_dim = keys.shape[-1]
    if cache.dtype == torch.uint8:
        value_bytes, scale_bytes = split_fp8_index_page_bytes(cache, head_dim)
        key_values, key_scales = quantize_index_keys(keys)
        # Index (page, offset): a page's values and scales are not one flat run, so no flat view exists. Byte
        # copies: any device's index_put, and the compiled write stays in place (reinplace_cache_writes).
        pages, offsets = slots // value_bytes.shape[1], slots % value_bytes.shape[1]
        value_bytes[pages, offsets] = key_values.view(torch.uint8)
        # The 1-D scales' bytes, 4 per key: a dtype view of an unsqueezed [tokens, 1] would need a unit stride on
        # the size-1 dim, which Inductor does not give it (stride 0).
        scale_bytes[pages, offsets] = key_scales.view(torch.uint8).view(-1, key_scales.element_size())
    else:
        cache.view(-1, head_dim)[slots] = keys.to(cache.dtype)


def write_latent(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int) -> None:
    """Store latent rows [tokens, kv_lora_rank + rope] at physical slots of a latent cache in either layout (in
    place): the FP8 layout's 656-byte token rows are quantize_latent's, written as bytes through one flat view (a
    token's bytes are contiguous), as the bf16 rows are. A plain function of tensors, for a model's forward."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.uint8:
        flat[slots] = quantize_latent(latent, kv_lora_rank)
    else:
        flat[slots] = latent.to(flat.dtype)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, kv_lora_rank: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Dense latent rows [batch, max_pages * page_size, 1, kv_lora_rank + rope] of every sequence: the FP8 layout
    dequantized to `dtype` (dequantize_latent), the others as stored. The eager spelling of a paged read
    (dzc.models.dsa), which fuse_sparse_attention recognises."""
    rows = cache[block_table.long()]
    if cache.dtype == torch.uint8:
        rows = dequantize_latent(rows, kv_lora_rank, dtype)
    return rows.flatten(1, 2)


def gather_index_keys(cache: torch.Tensor, block_table: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Dense fp32 keys [batch, max_pages * page_size, head_dim] of every sequence, dequantized (k_fp8 * scale) for
    the FP8 layout. For references and tests; kernels read pages in place."""
    table = block_table.long()
    if cache.dtype == torch.uint8:
        values, scales = split_fp8_index_pages(cache, head_dim)
        keys = values[table].float() * scales[table].unsqueeze(-1)
    else:
        keys = cache[table].float()
    return keys.flatten(1, 2)
