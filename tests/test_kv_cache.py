"""dzc.kv_cache: pages, block tables, ragged batches, appends over many steps, the FP8 indexer key layout."""

import ml_dtypes
import numpy as np
import pytest
import torch

from dzc.kv_cache import (
    PAGE_SIZE,
    DSACacheConfig,
    PagedKVCache,
    fp8_index_page_bytes,
    gather_index_keys,
    quantize_index_keys,
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
