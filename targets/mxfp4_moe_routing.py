"""Routing kernels of dzc.mxfp4_moe, shared by its Triton and TileLang GEMMs: group (token, slot) pairs by expert,
schedule row blocks per expert, and combine the per-pair expert outputs into tokens.

Nothing here synchronises with the host: every buffer is sized from host-known shapes (P = tokens * top_k pairs,
E experts), so a decode step can be captured in a CUDA graph.

    pairs p = t * top_k + j, expert ids[p] = topk_ids[t, j]
    1. moe_count_kernel      per chunk of CHUNK pairs: how many pairs go to each expert (no atomics)
    2. moe_schedule_kernel   one program: expert offsets (prefix sum), each chunk's base per expert, workspace slots
                             of the activated experts, and the row blocks of BLOCK_M sorted rows (block -> expert,
                             first row, end row; -1 for the unused tail of the upper-bound grid)
    3. moe_scatter_kernel    per chunk: sorted_pairs[offset + rank] = p, rank = earlier pairs of the same expert
                             (in chunk order then pair order: the grouping is deterministic, no atomics)
       (moe_route_one_chunk_kernel does 1-3 in one launch when the pairs fit one chunk: decode)
    ... the GEMMs run over the blocks ...
    4. moe_combine_kernel    out[t] = sum_j pair_out[t * top_k + j] in slot order j = 0..k-1 (fp32; with split-K
                             the partial sums of each pair first, in split order), one write per
                             token: deterministic, unlike atomic adds into out from the down GEMM, and the extra
                             traffic (P * H fp32 written and read) is < 1% of the weight bytes at decode.

Expert ids outside [0, E) cannot raise without a host sync: those pairs are left out of the grouping and the
combine writes NaN for their tokens, so bad routing shows instead of passing silently.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from dzc.targets import triton_codegen

# Pairs per program of the count and scatter kernels: the scatter's rank is a CHUNK x CHUNK comparison.
ROUTING_CHUNK = 128
# Row blocks scheduled per step of the schedule kernel's loop (a SCHEDULE_STEP x E_POW2 comparison).
SCHEDULE_STEP = 16


def max_row_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Upper bound on the row blocks of any routing: each expert's last block may be partial."""
    return -(-pairs // block_m) + min(experts, pairs)


@triton.jit
def _load_expert_ids(ids_ptr, chunk, pairs, num_experts, CHUNK: tl.constexpr):
    """(pair indices, expert ids as int32, valid) of one chunk; ids outside [0, E) are invalid. The range check
    runs in the ids' own dtype, so an int64 id cannot alias a valid one by truncation."""
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = p < pairs
    raw = tl.load(ids_ptr + p, mask=in_range, other=-1)
    valid = in_range & (raw >= 0) & (raw < num_experts)
    return p, tl.where(valid, raw, -1).to(tl.int32), valid


@triton.jit
def _histogram(ids, valid, E_POW2: tl.constexpr):
    experts = tl.arange(0, E_POW2)
    return tl.sum(((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32), axis=0)


@triton.jit
def _write_schedule(counts, expert_offsets_ptr, expert_counts_ptr, expert_slots_ptr, expert_first_block_ptr,
                    block_expert_ptr, block_row_start_ptr, block_row_end_ptr, max_blocks,
                    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCHEDULE_STEP: tl.constexpr):
    """From the per-expert counts: expert offsets (prefix sum), workspace slots of the activated experts (0.. in
    expert order), and the row blocks (expert, first row, end row; -1 past the last used block)."""
    experts = tl.arange(0, E_POW2)
    offsets = tl.cumsum(counts, axis=0) - counts
    active = (counts > 0).to(tl.int32)
    tl.store(expert_slots_ptr + experts, tl.cumsum(active, axis=0) - active)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    total_blocks = tl.sum(blocks, axis=0)
    tl.store(expert_offsets_ptr + experts, offsets)
    tl.store(expert_counts_ptr + experts, counts)
    tl.store(expert_first_block_ptr + experts, block_end - blocks)
    tl.debug_barrier()  # the per-block loop below (and callers) read those back by expert
    for b0 in range(0, max_blocks, SCHEDULE_STEP):
        b = b0 + tl.arange(0, SCHEDULE_STEP)
        in_use = b < total_blocks
        # The expert whose blocks contain b: the number of experts whose blocks all end at or before b.
        expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        expert = tl.where(in_use, expert, 0)
        first_row = tl.load(expert_offsets_ptr + expert)
        end_row = first_row + tl.load(expert_counts_ptr + expert)
        row_start = first_row + (b - tl.load(expert_first_block_ptr + expert)) * BLOCK_M
        row_end = tl.minimum(end_row, row_start + BLOCK_M)
        inside = b < max_blocks
        tl.store(block_expert_ptr + b, tl.where(in_use, expert, -1), mask=inside)
        tl.store(block_row_start_ptr + b, tl.where(in_use, row_start, 0), mask=inside)
        tl.store(block_row_end_ptr + b, tl.where(in_use, row_end, 0), mask=inside)


@triton.jit
def _scatter(p, ids, valid, bases, sorted_pairs_ptr, CHUNK: tl.constexpr):
    """sorted_pairs[base of its expert + rank] = p, rank = earlier pairs of the chunk with the same expert."""
    q = tl.arange(0, CHUNK)
    earlier_same = (ids[:, None] == ids[None, :]) & (q[None, :] < q[:, None]) & valid[None, :]
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(sorted_pairs_ptr + bases + rank, p, mask=valid)


@triton.jit
def moe_count_kernel(ids_ptr, chunk_counts_ptr, pairs, num_experts, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    _, ids, valid = _load_expert_ids(ids_ptr, chunk, pairs, num_experts, CHUNK)
    tl.store(chunk_counts_ptr + chunk * E_POW2 + tl.arange(0, E_POW2), _histogram(ids, valid, E_POW2))


@triton.jit
def moe_schedule_kernel(chunk_counts_ptr, n_chunks, chunk_bases_ptr, expert_offsets_ptr, expert_counts_ptr,
                        expert_slots_ptr, expert_first_block_ptr, block_expert_ptr, block_row_start_ptr,
                        block_row_end_ptr, max_blocks,
                        E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCHEDULE_STEP: tl.constexpr):
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for c in range(n_chunks):
        counts += tl.load(chunk_counts_ptr + c * E_POW2 + experts)
    running = tl.cumsum(counts, axis=0) - counts
    for c in range(n_chunks):
        tl.store(chunk_bases_ptr + c * E_POW2 + experts, running)
        running += tl.load(chunk_counts_ptr + c * E_POW2 + experts)
    _write_schedule(counts, expert_offsets_ptr, expert_counts_ptr, expert_slots_ptr, expert_first_block_ptr,
                    block_expert_ptr, block_row_start_ptr, block_row_end_ptr, max_blocks, E_POW2, BLOCK_M,
                    SCHEDULE_STEP)


@triton.jit
def moe_scatter_kernel(ids_ptr, chunk_bases_ptr, sorted_pairs_ptr, pairs, num_experts,
                       E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    p, ids, valid = _load_expert_ids(ids_ptr, chunk, pairs, num_experts, CHUNK)
    bases = tl.load(chunk_bases_ptr + chunk * E_POW2 + ids, mask=valid, other=0)
    _scatter(p, ids, valid, bases, sorted_pairs_ptr, CHUNK)


@triton.jit
def moe_route_one_chunk_kernel(ids_ptr, sorted_pairs_ptr, pairs, num_experts, expert_offsets_ptr,
                               expert_counts_ptr, expert_slots_ptr, expert_first_block_ptr, block_expert_ptr,
                               block_row_start_ptr, block_row_end_ptr, max_blocks,
                               E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCHEDULE_STEP: tl.constexpr,
                               CHUNK: tl.constexpr):
    """Count, schedule and scatter in one launch when all pairs fit one chunk (decode): two launches fewer."""
    p, ids, valid = _load_expert_ids(ids_ptr, 0, pairs, num_experts, CHUNK)
    _write_schedule(_histogram(ids, valid, E_POW2), expert_offsets_ptr, expert_counts_ptr, expert_slots_ptr,
                    expert_first_block_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, max_blocks,
                    E_POW2, BLOCK_M, SCHEDULE_STEP)
    bases = tl.load(expert_offsets_ptr + ids, mask=valid, other=0)
    _scatter(p, ids, valid, bases, sorted_pairs_ptr, CHUNK)


@triton.jit
def moe_combine_kernel(pair_out_ptr, ids_ptr, out_ptr, num_experts, stride_out, pairs,
                       HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr):
    """pair_out is [SPLITS, pairs, HIDDEN]: the down GEMM's partial sums over SPLITS slices of its reduction
    (split-K decode), 1 otherwise; they are added in split order, then the slots in slot order."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        routed = (expert >= 0) & (expert < num_experts)
        # An unrouted pair's row was never written: read it anyway (it is allocated) and replace it by NaN.
        value = tl.zeros([BLOCK_H], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            value += tl.load(pair_out_ptr + (split * pairs + pair) * HIDDEN + cols, mask=mask, other=0.0)
        total += tl.where(routed, value, float("nan"))
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


ROUTING_KERNELS = {
    "moe_count_kernel": moe_count_kernel,
    "moe_schedule_kernel": moe_schedule_kernel,
    "moe_scatter_kernel": moe_scatter_kernel,
    "moe_route_one_chunk_kernel": moe_route_one_chunk_kernel,
    "moe_combine_kernel": moe_combine_kernel,
}


@functools.cache
def launchable(name: str):
    """The routing kernel `name` as route() and combine() launch it: through dzc's cached launcher, which skips
    Triton's JIT dispatch after a specialization's first launch (triton_codegen.launchable). Wrapped at the first
    launch, not at import, so that it follows the mode (interpreter or not) Triton was imported in."""
    return triton_codegen.launchable(ROUTING_KERNELS[name])
