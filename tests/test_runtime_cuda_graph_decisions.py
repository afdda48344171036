"""The CUDA-graph runner's decisions, on the CPU: how a call's arguments are flattened (keywords, containers, cache
objects), its tokens, its graph key, block-table buckets, and what the calls of a key run as they are show (the
arguments it writes, from AOTAutograd's input mutations; the version counters a replay bumps; Python state it
changes; whether it compiled, so that the next call may be captured; side effects happening once), under
torch.inference_mode too; how a failed capture's error is described. Capture and replay themselves are in
test_cuda_graphs.py (GPU)."""

from __future__ import annotations

import collections

import pytest
import torch

import dzc
from dzc.kv_cache import DSACacheConfig, PagedKVCache
from dzc.runtime import (CudaGraphRunner, Signature, Unkeyable, _capture_error, block_table_position, call_tokens,
                         flatten_call, graph_key, observe, pad_block_table, page_bucket)
from dzc.models.dsa import DSAAttention, TINY_DSA

Pair = collections.namedtuple("Pair", "first second")


class Slots:
    """Objects without __dict__ cannot be searched for tensors."""

    __slots__ = ("k",)


def _cache(batch=2, max_pages=4):
    return PagedKVCache(DSACacheConfig(layers=2, kv_lora_rank=8, qk_rope_head_dim=8, index_head_dim=16), max_pages,
                        batch, fp8_index=False)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_keywords_containers_and_cache_objects_are_flattened():
    cache = _cache()
    cache.reserve([70, 3])  # lengths, pages and the free list: plain numbers, not state
    x, positions, table = _randn(2, 1, 8), torch.zeros(2, 1, dtype=torch.long), cache.block_table
    call = flatten_call((x, positions), {"block_table": table, "cache": cache, "extra": [Pair(x, 0.5), {"s": 3}]})
    assert [id(t) for t in call.inputs] == [id(x), id(positions), id(table), id(x)]
    assert [id(t) for t in call.state] == [id(t) for t in cache.latent + cache.index_keys]
    assert call.objects == [cache]
    # Keyword names, values and containers are part of the structure; tensors are not.
    same = flatten_call((_randn(2, 1, 8, seed=1), positions.clone()),
                        {"block_table": table, "cache": cache, "extra": [Pair(x, 0.5), {"s": 3}]})
    assert same.structure == call.structure
    for other in ({"block_table": table, "cache": cache, "extra": [Pair(x, 0.25), {"s": 3}]},
                  {"block_table": table, "cache": cache, "extra": [Pair(x, 0.5), {"t": 3}]},
                  {"table": table, "cache": cache, "extra": [Pair(x, 0.5), {"s": 3}]}):
        assert flatten_call((x, positions), other).structure != call.structure
    assert flatten_call((1,), {}).structure != flatten_call((True,), {}).structure != flatten_call((1.0,), {})
    # The capture call: the direct tensors replaced in order, objects passed as they are.
    new = [t.clone() for t in call.inputs]
    args, kwargs = call.rebuild((x, positions), {"block_table": table, "cache": cache,
                                                 "extra": [Pair(x, 0.5), {"s": 3}]}, new)
    assert args[0] is new[0] and args[1] is new[1] and kwargs["block_table"] is new[2]
    assert kwargs["cache"] is cache and isinstance(kwargs["extra"][0], Pair) and kwargs["extra"][0].first is new[3]


def test_arguments_the_runner_cannot_key():
    slots = Slots()
    slots.k = torch.zeros(2)
    for argument in (lambda t: t, slots, torch.nn.Linear(2, 2)):
        with pytest.raises(Unkeyable):
            flatten_call((torch.zeros(2), argument), {})


def test_tokens_are_activation_rows_or_token_ids_never_state_or_tables():
    """A paged decode step: 8 sequences' hidden states beside a block table of 8 x 64 pages, positions and a cache
    object whose pages hold thousands of rows: 8 tokens."""
    cache = _cache(batch=8, max_pages=64)
    hidden, table, positions = torch.empty(8, 1, 32), torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, 1)
    assert call_tokens(flatten_call((hidden, table, positions.long(), 0.5, None, cache), {}).inputs) == 8
    # Token ids only: the count ids, positions and slots share, not the table's or a whole-context mask's.
    ids, mask = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 900, dtype=torch.long)
    assert call_tokens([ids, torch.zeros(4, 8, dtype=torch.int32), ids.clone(), torch.zeros(64)[:0].long()]) == 64
    assert call_tokens(flatten_call((ids,), {"attention_mask": mask, "block_table": table}).inputs) == 64
    assert call_tokens([torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long), mask]) == 3
    assert call_tokens([torch.empty(0, 0)]) == 0 and call_tokens([torch.tensor(5)]) == 0


def test_graph_key_holds_what_a_graph_is_specialised_on():
    cache = _cache()
    x, table = _randn(4, 8), torch.zeros(2, 2, dtype=torch.int32)
    key = graph_key(flatten_call((x, table, cache), {}))
    assert graph_key(flatten_call((_randn(4, 8, seed=1), table.clone(), cache), {})) == key  # values: no
    assert graph_key(flatten_call((_randn(8, 4).t(), table, cache), {})) != key  # strides
    assert graph_key(flatten_call((x.double(), table, cache), {})) != key  # dtype
    assert graph_key(flatten_call((x, table, _cache()), {})) != key  # another cache: its tensors' addresses
    assert graph_key(flatten_call((x, x, cache), {})) != graph_key(flatten_call((x, x.clone(), cache), {}))
    with torch.inference_mode():
        assert graph_key(flatten_call((x, table, cache), {})) != key  # inference mode
        inference_x = x.clone()
    assert graph_key(flatten_call((inference_x, table, cache), {})) != key  # an inference tensor


def test_block_tables_are_padded_to_power_of_two_page_counts():
    assert [page_bucket(w) for w in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    table = torch.tensor([[3, 5, 7], [2, 0, 0]], dtype=torch.int32)
    padded = pad_block_table(table)
    assert padded.dtype == torch.int32 and torch.equal(padded, torch.tensor([[3, 5, 7, 0], [2, 0, 0, 0]]).int())
    assert pad_block_table(padded) is padded
    positions = torch.zeros(2, 3)
    assert pad_block_table(positions) is positions  # not a table: floating
    assert block_table_position(DSAAttention(TINY_DSA)) == 2
    assert block_table_position(torch.nn.Linear(2, 2)) is None


class WriteInPlace(torch.nn.Module):
    """Scales its `state` argument in place (by 1 in the test, so its values do not change: only AOTAutograd's
    input-mutation metadata can tell that the call writes it) and counts its calls in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, state, scale):
        state.mul_(scale)
        self.calls += 1
        return x * 2 + state.sum()


class CacheObject:
    def __init__(self):
        self.k = torch.zeros(4, 8)
        self.steps = 0


class AppendToCache(torch.nn.Module):
    """Grows its cache argument by replacing the tensor (transformers' DynamicCache does this with torch.cat)."""

    def forward(self, x, cache):
        cache.k = torch.cat([cache.k, x])
        return cache.k.sum(0)


class WriteCacheObject(torch.nn.Module):
    """Writes rows of its cache object's tensor in place at `slots` (a paged cache write)."""

    def forward(self, x, slots, cache):
        cache.k[slots] = x
        return cache.k.sum(0)


def _compiled(model, tmp_path):
    return dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "no_grad"])
def test_first_call_finds_the_arguments_written_and_runs_once(tmp_path, inference):
    """Under inference_mode (where tensors have no version counter) as under no_grad: the written argument is
    found from the compiled graph's input mutations, the module's buffer moves once per call."""
    model = WriteInPlace()
    compiled = _compiled(model, tmp_path)
    with torch.inference_mode() if inference else torch.no_grad():
        x, state, scale = _randn(4, 8), _randn(4, 8, seed=1), torch.ones(())
        args = (x, state, scale)
        result, signature = observe(compiled._run_compiled, args, {}, flatten_call(args, {}))
        torch.testing.assert_close(result, x * 2 + state.sum())
        assert signature.refused is None and signature.in_place == {1}
        assert int(model.calls) == 1
        # It compiled: not warm (the graph's first call ran the rewrite check, not the compiled code). The next
        # call of the key compiles nothing: warm, so the one after it may be captured.
        assert not signature.warm
        # A replay bumps what the call bumps: the written input's counter (inference tensors have none).
        assert signature.written == (() if inference else (1,))
        _, again = observe(compiled._run_compiled, args, {}, flatten_call(args, {}))
        assert again.warm and again.in_place == {1} and int(model.calls) == 2
        merged = signature.merge(again)
        assert merged.capturable() and merged.in_place == {1} and merged.refused is None
        # A later key (another token count, which the first compile made dynamic): again one call, again the
        # written input found; nothing compiled, so it is warm at once.
        args = (_randn(2, 8), _randn(2, 8, seed=1), torch.ones(()))
        _, signature = observe(compiled._run_compiled, args, {}, flatten_call(args, {}))
        assert signature.in_place == {1} and int(model.calls) == 3 and signature.warm
        # Another dtype compiles again: not warm.
        args = (_randn(2, 8).double(), _randn(2, 8, seed=1).double(), torch.ones((), dtype=torch.float64))
        _, signature = observe(compiled._run_compiled, args, {}, flatten_call(args, {}))
        assert signature.in_place == {1} and int(model.calls) == 4 and not signature.warm
        # That compile may have made the graph the first key's calls reach next: no capture before another warm call.
        assert merged.warm and not merged.capturable()


def test_first_call_finds_writes_made_outside_compiled_graphs(tmp_path):
    """Eager code (here the whole function, uncompiled) writing an inference tensor: seen by comparing values."""

    def write(x, residual):
        residual.add_(x)
        return residual * 2

    with torch.inference_mode():
        args = (_randn(4, 8), _randn(4, 8, seed=1))
        _, signature = observe(write, args, {}, flatten_call(args, {}))
    assert signature.in_place == {1}


def test_calls_that_change_their_argument_objects_are_refused(tmp_path):
    cache = CacheObject()
    x = _randn(2, 8)
    with torch.inference_mode():
        _, signature = observe(_compiled(AppendToCache(), tmp_path)._run_compiled, (x, cache), {},
                               flatten_call((x, cache), {}))
    assert signature.refused and "Python state" in signature.refused
    assert cache.k.shape == (6, 8)


def test_a_cache_object_written_in_place_is_state_not_a_refusal(tmp_path):
    cache = CacheObject()
    x, slots = _randn(2, 8), torch.tensor([1, 3])
    with torch.inference_mode():
        call = flatten_call((x, slots, cache), {})
        _, signature = observe(_compiled(WriteCacheObject(), tmp_path)._run_compiled, (x, slots, cache), {}, call)
    assert signature.refused is None and signature.in_place == frozenset()
    assert call.state == [cache.k] and torch.equal(cache.k[slots], x)
    # The cache's tensor was made outside inference mode: the write moves its version counter, which a replay
    # bumps too (index 2: after x and slots). A cache made under inference mode has none.
    assert signature.written == (2,)
    with torch.inference_mode():
        cache = CacheObject()
        call = flatten_call((x, slots, cache), {})
        _, signature = observe(_compiled(WriteCacheObject(), tmp_path)._run_compiled, (x, slots, cache), {}, call)
    assert signature.written == () and signature.in_place == frozenset() and torch.equal(cache.k[slots], x)


def test_merged_signatures_keep_every_write_and_refusal():
    first = Signature(None, frozenset({0}), (0,), warm=False)
    later = Signature("the call changes an argument's shape or strides", frozenset({2}), (3,), warm=True)
    merged = first.merge(later)
    assert merged.refused == later.refused and merged.in_place == {0, 2} and merged.written == (0, 3)
    # What the GPU tests' assertion messages print.
    runner = CudaGraphRunner(lambda x: x, 16, reuse_outputs=False)
    runner.signatures.update({"a": first, "b": merged})
    runner.bypassed["an argument holds a function"] += 2
    assert runner.describe() == ("0 graphs, 2 keys\n"
                                 "  key 0: 0 graphs, not warm yet (its last call compiled); in place: [0]\n"
                                 "  key 1: refused: the call changes an argument's shape or strides; in place: [0, 2]\n"
                                 "  bypassed 2x: an argument holds a function")


def test_large_keys_read_inputs_that_repeat_their_addresses_in_place():
    """Above max_tokens, a key whose last two calls before its capture brought the same tensors' addresses is
    captured reading its dense inputs there (no copy a replay); the first call at other addresses drops its graphs
    and turns that off for good (the next capture copies); a key whose addresses moved before the capture copies."""
    from dzc.runtime import _compiles

    runner = CudaGraphRunner(lambda *a: a, 4, reuse_outputs=False)
    x, r, strided = _randn(8, 16), _randn(8, 16, seed=1), _randn(8, 32, seed=2)[:, ::2]
    call = flatten_call((x, r, strided), {})
    key = graph_key(call)
    signature = Signature(tokens=8)
    runner._read_in_place(key, signature, call)  # not warm: only the addresses are kept
    assert signature.reads is None and signature.addresses == (x.data_ptr(), r.data_ptr(), strided.data_ptr())
    signature.warm, signature.warm_at = True, _compiles()
    runner._read_in_place(key, signature, flatten_call((x, r, strided), {}))  # capturable: decided
    assert signature.reads == {0, 1} and signature.in_place == {0, 1}, "the strided input is not dense: copied"
    runner.signatures[key] = signature
    assert "inputs [0, 1] read in place" in runner.describe()
    signature.graphs = 1
    runner.graphs[(key, (x.data_ptr(), r.data_ptr()))] = "the key's graph"  # what the switch must drop
    runner._read_in_place(key, signature, flatten_call((x, r, strided), {}))
    assert signature.reads == {0, 1} and runner.graphs
    runner._read_in_place(key, signature, flatten_call((x.clone(), r, strided), {}))  # x elsewhere
    assert signature.reads == frozenset() and signature.in_place == frozenset() and not runner.graphs
    assert signature.graphs == 0 and signature.pays is None and signature.replay_s == ()
    runner._read_in_place(key, signature, flatten_call((x, r, strided), {}))  # back at first addresses: still off
    assert signature.reads == frozenset()

    moved = Signature(tokens=8, warm=True)
    runner._read_in_place(key, moved, call)  # warm but not capturable (warm_at is not now): addresses kept
    moved.warm_at = _compiles()
    runner._read_in_place(key, moved, flatten_call((x.clone(), r, strided), {}))
    assert moved.reads == frozenset() and moved.in_place == frozenset()


def _ending(error_inside):
    """What torch.cuda.graph's exit does when the capture was invalidated: capture_end raises over the error."""
    try:
        error_inside()
    finally:
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def _sync_inside_capture():
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")


def test_a_failed_capture_is_described_by_the_error_raised_inside_it():
    """The error that ended an invalidated capture says only that; the refusal names the one raised first, and
    where (seen on the H200: the refusal only said "operation failed due to a previous error during capture")."""
    with pytest.raises(RuntimeError) as caught:
        _ending(_sync_inside_capture)
    described = _capture_error(caught.value)
    assert described.startswith("RuntimeError: CUDA error: operation not permitted when stream is capturing (at "
                                "test_runtime_cuda_graph_decisions.py:"), described
    assert "in _sync_inside_capture); ending the capture: CUDA error: operation failed due to a previous" in described
    assert "more lines" not in described
    # A capture that ended without an error inside it (a failure at its end only): that error alone.
    with pytest.raises(RuntimeError) as caught:
        _ending(lambda: None)
    assert _capture_error(caught.value).startswith("RuntimeError: CUDA error: operation failed due to a previous")
    assert "ending the capture" not in _capture_error(caught.value)


def test_runner_leaves_cpu_calls_to_the_compiled_model(tmp_path):
    """Keyword and cache-object calls on CPU tensors go to the compiled model untouched (no CUDA is asked)."""
    model = WriteCacheObject()
    compiled = _compiled(model, tmp_path)
    cache = CacheObject()
    with torch.inference_mode():
        for step in range(3):
            x = _randn(2, 8, seed=step)
            compiled(x, slots=torch.tensor([step, step + 1]), cache=cache)
    assert isinstance(compiled._cuda_graphs, CudaGraphRunner)
    assert not compiled._cuda_graphs.signatures and not compiled._cuda_graphs.graphs
