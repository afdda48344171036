"""dzc.kv_cache: pages, block tables, ragged batches, appends over many steps, the FP8 indexer key and latent
layouts."""

import ml_dtypes
import numpy as np
import pytest
import torch

from dzc.kv_cache import (
    PAGE_SIZE,
    DSACacheConfig,
    PagedKVCache,
    dequantize_latent,
    fp8_index_page_bytes,
    fp8_latent_rank,
    fp8_latent_token_bytes,
    gather_index_keys,
    gather_latent,
    quantize_index_keys,
    quantize_latent,
    split_fp8_index_pages,
)
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90

TINY = DSACacheConfig(layers=2, kv_lora_rank=32, qk_rope_head_dim=8, index_head_dim=16)


def _positions_of(cache, sequence):
    """Physical slots of every token of a sequence, from its block-table row."""
    row = cache.block_table[sequence].tolist()
    return [row[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(cache.lengths[sequence])]


def test_ragged_prefill_then_appends_allocate_pages_from_the_free_list():
    cache = PagedKVCache(TINY, max_pages=8, batch=3, fp8_index=False)
    slots = cache.reserve([70, 3, 64])
    assert cache.lengths == [70, 3, 64]
    assert [len(p) for p in cache.pages] == [2, 1, 1]
    assert cache.seq_lens.tolist() == [70, 3, 64] and cache.seq_lens.dtype == torch.int32
    table = cache.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 2)
    # Every token has its own slot, and the slots are the block table's translation of the positions.
    assert len(set(slots.tolist())) == 137
    assert slots.tolist() == _positions_of(cache, 0) + _positions_of(cache, 1) + _positions_of(cache, 2)
    for step in range(70):  # decode: one token per sequence per step; sequence 2 crosses a page boundary at once
        new = cache.reserve([1, 1, 1])
        assert new.tolist() == [_positions_of(cache, b)[-1] for b in range(3)]
    assert cache.lengths == [140, 73, 134]
    assert [len(p) for p in cache.pages] == [3, 2, 3]
    assert len(cache.free_pages) == 0
    used = [page for pages in cache.pages for page in pages]
    assert sorted(used) == list(range(8))  # no page handed out twice


def test_out_of_pages_and_free():
    cache = PagedKVCache(TINY, max_pages=2, batch=2, fp8_index=False)
    cache.reserve([64, 64])
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve([1, 0])
    cache.free(0)
    assert cache.lengths == [0, 64] and len(cache.free_pages) == 1
    cache.reserve([1, 0])
    with pytest.raises(ValueError, match="one non-negative token count per sequence"):
        cache.reserve([1])


def test_writes_land_in_place_and_survive_later_steps(seed):
    cache = PagedKVCache(TINY, max_pages=6, batch=2, fp8_index=False)
    storage = cache.latent[0].data_ptr()
    rows = {}
    for count in ([5, 66], [1, 1], [60, 1], [1, 1]):
        slots = cache.reserve(count)
        latent = torch.randn(len(slots), TINY.latent_dim).bfloat16()
        cache.write_latent(0, slots, latent)
        for slot, row in zip(slots.tolist(), latent):
            rows[slot] = row
    assert cache.latent[0].data_ptr() == storage  # never reallocated
    flat = cache.latent[0].view(-1, TINY.latent_dim)
    for sequence in range(2):
        for slot in _positions_of(cache, sequence):
            assert torch.equal(flat[slot], rows[slot])


def _reference_quantize(keys: np.ndarray):
    """Independent reference: numpy + ml_dtypes' e4m3 rounding, scale 2^ceil(log2(max(amax, 1e-4) / 448))."""
    amax = np.maximum(np.abs(keys).max(axis=-1), 1e-4)
    scales = np.array([2.0 ** np.ceil(np.log2(a / 448.0)) for a in amax.ravel()]).reshape(amax.shape)
    values = (keys / scales[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return values, scales.astype(np.float32)


def test_fp8_quantization_matches_the_reference(seed):
    keys = torch.randn(50, 128) * torch.logspace(-6, 3, 50)[:, None]  # tiny keys hit the amax floor
    values, scales = quantize_index_keys(keys)
    expected_values, expected_scales = _reference_quantize(keys.numpy().astype(np.float64))
    np.testing.assert_array_equal(scales.numpy(), expected_scales)
    assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales)))  # powers of two
    np.testing.assert_array_equal(values.view(torch.uint8).numpy(), expected_values.view(np.uint8))
    assert values.float().abs().max() <= 448


@pytest.mark.parametrize("fp8", [True, False])
def test_index_key_cache_layout(seed, fp8):
    cache = PagedKVCache(TINY, max_pages=4, batch=2, fp8_index=fp8)
    head_dim = TINY.index_head_dim
    slots = cache.reserve([70, 20])
    keys = torch.randn(len(slots), head_dim)
    cache.write_index_keys(1, slots, keys)
    dense = gather_index_keys(cache.index_keys[1], cache.block_table, head_dim)
    got = torch.cat([dense[0, :70], dense[1, :20]])
    if fp8:
        assert cache.index_keys[1].shape == (4, fp8_index_page_bytes(PAGE_SIZE, head_dim))
        assert fp8_index_page_bytes(64, 128) == 64 * 132
        # Values then scales within each page, as vLLM/SGLang lay them out.
        values, scales = quantize_index_keys(keys)
        page, offset = int(slots[3]) // PAGE_SIZE, int(slots[3]) % PAGE_SIZE
        raw = cache.index_keys[1][page]
        assert torch.equal(raw[offset * head_dim:(offset + 1) * head_dim], values[3].view(torch.uint8))
        scale_bytes = raw[PAGE_SIZE * head_dim + 4 * offset:PAGE_SIZE * head_dim + 4 * offset + 4]
        assert scale_bytes.view(torch.float32).item() == scales[3].item()
        view_values, view_scales = split_fp8_index_pages(cache.index_keys[1], head_dim)
        assert view_values.data_ptr() == cache.index_keys[1].data_ptr()  # views, not copies
        torch.testing.assert_close(got, values.float() * scales[:, None], rtol=0, atol=0)
        torch.testing.assert_close(got, keys, rtol=2**-3, atol=1e-3)
    else:
        assert cache.index_keys[1].dtype == torch.bfloat16
        torch.testing.assert_close(got, keys.bfloat16().float(), rtol=0, atol=0)


def test_the_profile_decides_the_index_layout():
    for profile, fp8 in ((SM_90, True), (MP_31, True), (SM_80, False), (MP_22, False)):
        cache = PagedKVCache.for_profile(profile, TINY, max_pages=1, batch=1)
        assert cache.fp8_index is fp8
        assert cache.index_keys[0].dtype == (torch.uint8 if fp8 else torch.bfloat16)


# The FP8 latent layout needs whole 128-value tiles: a latent of 2 tiles + an 8-wide RoPE key.
TINY_FP8_LATENT = DSACacheConfig(layers=1, kv_lora_rank=256, qk_rope_head_dim=8, index_head_dim=16)


def _reference_latent_bytes(latent: np.ndarray, rank: int) -> np.ndarray:
    """Independent reference of FlashMLA's 656 B/token layout: per token the e4m3 bytes of the NoPE values (scale
    per 128 = max(amax / 448, smallest normal fp32), value / scale in fp32 as vLLM's writer divides, rounded to e4m3
    by ml_dtypes), the fp32 scales' bytes, the bf16 RoPE values' bytes (little-endian, as the GPU stores them)."""
    tiles = latent[:, :rank].reshape(len(latent), -1, 128).astype(np.float32)
    scales = np.maximum(np.abs(tiles).max(axis=-1) / np.float32(448.0), np.finfo(np.float32).tiny)
    values = (tiles / scales[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(len(latent), -1)
    rope = latent[:, rank:].astype(ml_dtypes.bfloat16)
    return np.concatenate([values.view(np.uint8), scales.view(np.uint8), rope.view(np.uint8)], axis=1)


def test_fp8_latent_quantization_matches_the_reference(seed):
    assert fp8_latent_token_bytes(512, 64) == 656  # DeepSeek-V3.2 (FlashMLA, vLLM's fp8_ds_mla)
    assert fp8_latent_rank(656, 576) == 512 and fp8_latent_rank(600, 576) is None
    rank, rope = TINY_FP8_LATENT.kv_lora_rank, TINY_FP8_LATENT.qk_rope_head_dim
    latent = torch.randn(40, rank + rope) * torch.logspace(-3, 3, 40)[:, None]
    latent[3, :128] = 0.0  # an all-zero tile: scale floored, values 0, no NaN
    latent = latent.bfloat16()
    packed = quantize_latent(latent, rank)
    assert packed.dtype == torch.uint8 and packed.shape == (40, fp8_latent_token_bytes(rank, rope))
    expected = _reference_latent_bytes(latent.float().numpy(), rank)
    np.testing.assert_array_equal(packed.numpy(), expected)
    restored = dequantize_latent(packed, rank, torch.bfloat16)
    assert restored.dtype == torch.bfloat16 and not restored.isnan().any()
    assert torch.equal(restored[:, rank:], latent[:, rank:])  # RoPE kept in bf16 exactly
    # e4m3 keeps 3 mantissa bits: half a unit is 2^-4 of the value; small values of a tile lose more (absolute
    # error at most half the tile's scale times the smallest subnormal step).
    tile_amax = latent[:, :rank].float().unflatten(-1, (-1, 128)).abs().amax(-1).repeat_interleave(128, dim=-1)
    error = (restored[:, :rank].float() - latent[:, :rank].float()).abs()
    assert torch.all(error <= latent[:, :rank].float().abs() * 2**-4 + tile_amax * 2**-9 * 2**-1 + 1e-30)


@pytest.mark.parametrize("fp8_latent", [True, False])
def test_latent_cache_layouts_write_in_place_and_gather(seed, fp8_latent):
    cache = PagedKVCache(TINY_FP8_LATENT, max_pages=4, batch=2, fp8_index=False, fp8_latent=fp8_latent)
    rank, dim = TINY_FP8_LATENT.kv_lora_rank, TINY_FP8_LATENT.latent_dim
    storage = cache.latent[0].data_ptr()
    slots = cache.reserve([70, 20])
    latent = torch.randn(len(slots), dim).bfloat16()
    cache.write_latent(0, slots, latent)
    assert cache.latent[0].data_ptr() == storage
    dense = gather_latent(cache.latent[0], cache.block_table, rank, torch.bfloat16)
    assert dense.shape == (2, 2 * PAGE_SIZE, 1, dim) and dense.dtype == torch.bfloat16
    got = torch.cat([dense[0, :70, 0], dense[1, :20, 0]])
    if fp8_latent:
        assert cache.latent[0].dtype == torch.uint8
        assert cache.latent[0].shape == (4, PAGE_SIZE, 1, fp8_latent_token_bytes(rank, 8))
        # Token rows are quantize_latent's bytes, at the slots the block table names.
        flat = cache.latent[0].view(-1, cache.latent[0].shape[-1])
        assert torch.equal(flat[slots], quantize_latent(latent, rank))
        assert torch.equal(got, dequantize_latent(quantize_latent(latent, rank), rank, torch.bfloat16))
        torch.testing.assert_close(got.float(), latent.float(), rtol=2**-4, atol=2**-5)
    else:
        assert cache.latent[0].dtype == torch.bfloat16
        assert torch.equal(got, latent)


def test_the_profile_grants_the_fp8_latent_where_fp8_is_native():
    for profile, fp8 in ((SM_90, True), (MP_31, True), (SM_80, False), (MP_22, False)):
        cache = PagedKVCache.for_profile(profile, TINY_FP8_LATENT, max_pages=1, batch=1, fp8_latent=True)
        assert cache.fp8_latent is fp8
        assert cache.latent[0].dtype == (torch.uint8 if fp8 else torch.bfloat16)
        assert not PagedKVCache.for_profile(profile, TINY_FP8_LATENT, max_pages=1, batch=1).fp8_latent
