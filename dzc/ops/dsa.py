"""DeepSeek Sparse Attention (DSA): dzc.dsa_indexer, dzc.dsa_topk, dzc.sparse_attention.

The three steps of a DSA layer (../shared/reference/kernels.md §1), each a custom op with one plain-torch
reference. They read paged caches: a cache tensor's dim 0 is the page, dim 1 the token within the page. A dense
[B, S, ...] tensor is a cache of B pages of S tokens with block_table = arange(B)[:, None]; that is how a graph
with dense keys (HF transformers) uses the same ops.

Rows of the query side are flat: query t belongs to sequence query_seq[t] and sits at position query_pos[t] of it
(causal: keys at positions <= query_pos[t] are visible). block_table int32 [B, max_pages] maps a sequence's
position p to page block_table[b, p // page_size]; seq_lens int32 [B] counts its tokens.

The `check_*` functions validate arguments (shapes and dtypes only: no device synchronisation); kernel families
call them too, so that a bad call fails the same way with or without a kernel.
"""

from __future__ import annotations

import torch

from dzc import runtime
from dzc.kv_cache import FP8_LATENT_TILE, SCALE_BYTES, dequantize_latent, fp8_latent_token_bytes, gather_index_keys

_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise ValueError(f"dzc.{op}: {message}")


def _check_sequence_tables(op: str, queries: int, block_table, seq_lens, query_seq, query_pos=None) -> None:
    _require(block_table.dim() == 2 and block_table.dtype == torch.int32, op,
             f"block_table must be int32 [batch, max_pages], got {block_table.dtype} {list(block_table.shape)}")
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.shape[0] == block_table.shape[0],
             op, f"seq_lens must be int32 [batch={block_table.shape[0]}], got {seq_lens.dtype} "
                 f"{list(seq_lens.shape)}")
    for name, rows in (("query_seq", query_seq), ("query_pos", query_pos)):
        if rows is not None:
            _require(rows.dim() == 1 and rows.dtype == torch.int32 and rows.shape[0] == queries, op,
                     f"{name} must be int32 [queries={queries}], got {rows.dtype} {list(rows.shape)}")


def index_k_cache_layout(index_k_cache: torch.Tensor, head_dim: int) -> tuple[int, bool]:
    """(page_size, is_fp8) of an indexer key cache: bf16/fp16/fp32 [pages, page_size, head_dim], or the FP8
    layout uint8 [pages, page_size * (head_dim + 4)] (values, then one fp32 scale per token)."""
    if index_k_cache.dtype == torch.uint8:
        _require(index_k_cache.dim() == 2 and index_k_cache.shape[1] % (head_dim + SCALE_BYTES) == 0, "dsa_indexer",
                 f"an FP8 index_k_cache is uint8 [pages, page_size * {head_dim + SCALE_BYTES}], got "
                 f"{list(index_k_cache.shape)}")
        return index_k_cache.shape[1] // (head_dim + SCALE_BYTES), True
    _require(index_k_cache.dim() == 3 and index_k_cache.shape[2] == head_dim
             and index_k_cache.dtype in _ATTENTION_DTYPES, "dsa_indexer",
             f"index_k_cache must be [pages, page_size, {head_dim}] in bf16/fp16/fp32 or the uint8 FP8 layout, got "
             f"{index_k_cache.dtype} {list(index_k_cache.shape)}")
    return index_k_cache.shape[1], False


def check_dsa_indexer_args(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos) -> None:
    _require(q.dim() == 3 and q.dtype in _QUERY_DTYPES, "dsa_indexer",
             f"q must be [queries, heads, head_dim] in bf16/fp16/fp32/float8_e4m3fn, got {q.dtype} {list(q.shape)}")
    _require(weights.dtype == torch.float32 and tuple(weights.shape) == tuple(q.shape[:2]), "dsa_indexer",
             f"weights must be fp32 [queries, heads] = {list(q.shape[:2])}, got {weights.dtype} "
             f"{list(weights.shape)}")
    index_k_cache_layout(index_k_cache, q.shape[2])
    _check_sequence_tables("dsa_indexer", q.shape[0], block_table, seq_lens, query_seq, query_pos)


def check_dsa_topk_args(logits, lengths, k) -> None:
    _require(logits.dim() == 2 and logits.dtype == torch.float32, "dsa_topk",
             f"logits must be fp32 [queries, context], got {logits.dtype} {list(logits.shape)}")
    _require(lengths.dim() == 1 and lengths.dtype == torch.int32 and lengths.shape[0] == logits.shape[0], "dsa_topk",
             f"lengths must be int32 [queries={logits.shape[0]}], got {lengths.dtype} {list(lengths.shape)}")
    _require(k >= 1, "dsa_topk", f"k must be >= 1, got {k}")


def is_fp8_latent_cache(k_cache) -> bool:
    """The FP8 latent layout (dzc.kv_cache: e4m3 NoPE values, fp32 scales per 128, bf16 RoPE per token)."""
    return k_cache.dtype == torch.uint8


def check_sparse_attention_args(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, d_v, query_pos=None,
                                 sinks=None, window: int = 0, index_block: int = 1) -> None:
    _require(q.dim() == 3 and q.dtype in _ATTENTION_DTYPES, "sparse_attention",
             f"q must be [queries, heads, d_qk] in bf16/fp16/fp32, got {q.dtype} {list(q.shape)}")
    queries, heads, d_qk = q.shape
    if is_fp8_latent_cache(k_cache):
        # V is the dequantized NoPE part: d_v values per token, d_qk - d_v RoPE values.
        token_bytes = fp8_latent_token_bytes(d_v, d_qk - d_v) if 0 < d_v < d_qk and d_v % FP8_LATENT_TILE == 0 \
            else None
        _require(k_cache.dim() == 4 and k_cache.shape[2] == 1 and k_cache.shape[3] == token_bytes
                 and v_cache is None, "sparse_attention",
                 f"an FP8 latent k_cache is uint8 [pages, page_size, 1, d_v + 4 * d_v / {FP8_LATENT_TILE} + "
                 f"2 * (d_qk - d_v)] with V its first d_v (a multiple of {FP8_LATENT_TILE}) and no v_cache; got "
                 f"{list(k_cache.shape)}, d_qk={d_qk}, d_v={d_v}, v_cache "
                 f"{'given' if v_cache is not None else 'None'}")
    else:
        _require(k_cache.dim() == 4 and k_cache.shape[3] == d_qk and k_cache.shape[2] in (1, heads),
                 "sparse_attention", f"k_cache must be [pages, page_size, 1 or {heads} heads, {d_qk}] or the uint8 "
                                     f"FP8 latent layout, got {k_cache.dtype} {list(k_cache.shape)}")
    if v_cache is None:
        _require(d_v <= d_qk, "sparse_attention", f"without v_cache V is K[..., :d_v]; d_v={d_v} > d_qk={d_qk}")
    else:
        _require(v_cache.dim() == 4 and tuple(v_cache.shape[:3]) == tuple(k_cache.shape[:3])
                 and v_cache.shape[3] == d_v, "sparse_attention",
                 f"v_cache must be [{', '.join(str(s) for s in k_cache.shape[:3])}, d_v={d_v}], got "
                 f"{list(v_cache.shape)}")
    _require(indices.dim() == 2 and indices.dtype == torch.int32 and indices.shape[0] == queries, "sparse_attention",
             f"indices must be int32 [queries={queries}, topk], got {indices.dtype} {list(indices.shape)}")
    _check_sequence_tables("sparse_attention", queries, block_table, seq_lens, query_seq, query_pos)
    _require(window >= 0 and (window == 0 or query_pos is not None), "sparse_attention",
             f"window must be >= 0 and needs query_pos (the window ends at the query's position); got window={window}"
             f", query_pos {'given' if query_pos is not None else 'None'}")
    _require(index_block >= 1, "sparse_attention", f"index_block must be >= 1, got {index_block}")
    _require(sinks is None or (sinks.dim() == 1 and sinks.dtype == torch.float32 and sinks.shape[0] == heads),
             "sparse_attention", f"sinks must be fp32 [heads={heads}], got "
                                 f"{None if sinks is None else (sinks.dtype, list(sinks.shape))}")


def dsa_indexer_reference(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
                          max_context: int) -> torch.Tensor:
    """logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) for the keys of sequence query_seq[t] that are
    visible (s <= query_pos[t] and s < its seq_len); -inf elsewhere. fp32 [queries, max_context]. FP8 keys are
    dequantized (values * scale); an FP8 q carries its scales in `weights`."""
    head_dim = q.shape[2]
    keys = gather_index_keys(index_k_cache, block_table, head_dim)  # [B, capacity, D] fp32
    capacity = keys.shape[1]
    if capacity < max_context:
        keys = torch.nn.functional.pad(keys, (0, 0, 0, max_context - capacity))
    keys = keys[:, :max_context][query_seq.long()]  # [T, context, D]
    scores = torch.einsum("thd,tsd->ths", q.float(), keys).relu()
    logits = torch.einsum("th,ths->ts", weights.float(), scores)
    positions = torch.arange(max_context, device=q.device)
    visible = (positions <= query_pos[:, None]) & (positions < seq_lens[query_seq.long()][:, None])
    return logits.masked_fill(~visible, float("-inf"))


def dsa_topk_reference(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest logits[t, :lengths[t]] (every NaN the largest; ties: the smaller position first), their
    positions in ascending order, padded with -1 where fewer than k are available. int32 [queries, k]."""
    context = logits.shape[1]
    lengths = lengths.long().clamp(0, context)
    valid = torch.arange(context, device=logits.device) < lengths[:, None]
    # Stable descending sort: equal logits keep position order (smaller first). Positions past the length become
    # -inf and so sort after every valid position, a valid -inf included, since they are larger positions. Every
    # NaN is the largest value, as torch.topk ranks them: NaNs are made one +NaN first, because CUDA's torch.sort
    # ranks a NaN with the sign bit set below -inf (its radix sort orders the raw bits) while the CPU's does not.
    keys = logits.masked_fill(logits.isnan(), float("nan")).masked_fill(~valid, float("-inf"))
    ranked_positions = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    chosen = ranked_positions[:, :k]
    if chosen.shape[1] < k:
        chosen = torch.nn.functional.pad(chosen, (0, k - chosen.shape[1]), value=context)
    taken = torch.arange(k, device=logits.device) < lengths[:, None]
    chosen = torch.where(taken, chosen, context).sort(dim=-1).values
    return torch.where(chosen == context, -1, chosen).to(torch.int32)


def sparse_attention_reference(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale: float,
                               d_v: int, query_pos=None, sinks=None, window: int = 0,
                               index_block: int = 1) -> torch.Tensor:
    """out[t, h] = softmax over the attended positions of (q[t, h] . k[s]) * sm_scale, times v[s].

    Attended: the valid selected positions indices[t] (positions in sequence query_seq[t]; -1 or >= its seq_len is
    invalid; with index_block > 1 an index i selects the block of positions [i * index_block, (i + 1) *
    index_block), as block-sparse designs (NSA's selection, MoBA) select keys), and with query_pos (int32
    [queries], the query's position in its sequence) only those <= it (causal). window > 0 (needs query_pos) adds
    the `window` positions ending at the query's, (query_pos - window, query_pos] within [0, seq_len): a local
    window beside the selected set (their union; a selected position inside the window is attended once). sinks
    (fp32 [heads]): a per-head logit that joins each softmax's denominator and carries no value (gpt-oss's
    attention sinks), compared with the scaled scores. A row with no attended position is 0. Indices of a row are
    distinct (a top-k's are); a repeated one counts per slot.

    K rows are read through the block table; V = v_cache rows, or K[..., :d_v] when v_cache is None (MLA latent).
    [queries, heads, d_v] in q's dtype. The FP8 latent layout: the selected rows are dequantized to q's dtype
    (dequantize_latent: what the kernels multiply), then the same math."""
    page_size = k_cache.shape[1]
    sequences = query_seq.long()
    positions = indices.long()
    if index_block > 1:  # each index: its block's positions (a -1 index: all negative, invalid)
        within = torch.arange(index_block, device=q.device)
        positions = (positions[:, :, None] * index_block + within).flatten(1)
    lengths = seq_lens[sequences].long()[:, None]
    valid = (positions >= 0) & (positions < lengths)
    if query_pos is not None:
        valid &= positions <= query_pos.long()[:, None] - window  # the window's own slots attend the rest
    if window:
        local = query_pos.long()[:, None] - window + 1 + torch.arange(window, device=q.device)
        positions = torch.cat([positions, local], dim=1)
        valid = torch.cat([valid, (local >= 0) & (local < lengths)], dim=1)
    positions = torch.where(valid, positions, 0)
    page_column = (positions // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[sequences[:, None], page_column]  # [T, slots]
    offsets = positions % page_size
    keys = k_cache[pages, offsets]  # [T, slots, Hkv, d_qk] (FP8: [T, slots, 1, token bytes])
    keys = (dequantize_latent(keys, d_v, q.dtype) if is_fp8_latent_cache(k_cache) else keys).float()
    values = keys[..., :d_v] if v_cache is None else v_cache[pages, offsets].float()
    heads = q.shape[1]
    keys = keys.expand(-1, -1, heads, -1)
    values = values.expand(-1, -1, heads, -1)
    scores = torch.einsum("thd,tkhd->thk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-invalid row: softmax of -inf is NaN -> 0
    return torch.einsum("thk,tkhd->thd", probs, values).to(q.dtype)


@torch.library.custom_op("dzc::dsa_indexer", mutates_args=())
def dsa_indexer(q: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, query_seq: torch.Tensor, query_pos: torch.Tensor, max_context: int,
                kernel_id: str = "") -> torch.Tensor:
    check_dsa_indexer_args(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos)
    if kernel_id:
        return runtime.launch(kernel_id, q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
                              max_context)
    return dsa_indexer_reference(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos,
                                 max_context)


@dsa_indexer.register_fake
def _dsa_indexer_fake(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos, max_context,
                      kernel_id=""):
    check_dsa_indexer_args(q, weights, index_k_cache, block_table, seq_lens, query_seq, query_pos)
    return q.new_empty((q.shape[0], max_context), dtype=torch.float32)


@torch.library.custom_op("dzc::dsa_topk", mutates_args=())
def dsa_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, kernel_id: str = "") -> torch.Tensor:
    check_dsa_topk_args(logits, lengths, k)
    if kernel_id:
        return runtime.launch(kernel_id, logits, lengths, k)
    return dsa_topk_reference(logits, lengths, k)


@dsa_topk.register_fake
def _dsa_topk_fake(logits, lengths, k, kernel_id=""):
    check_dsa_topk_args(logits, lengths, k)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dzc::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_seq: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                     d_v: int, query_pos: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     window: int = 0, index_block: int = 1, kernel_id: str = "") -> torch.Tensor:
    args = (q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale, d_v, query_pos, sinks, window,
            index_block)
    check_sparse_attention_args(*args[:7], d_v, query_pos, sinks, window, index_block)
    if kernel_id:
        return runtime.launch(kernel_id, *args)
    return sparse_attention_reference(*args)


@sparse_attention.register_fake
def _sparse_attention_fake(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, sm_scale, d_v,
                           query_pos=None, sinks=None, window=0, index_block=1, kernel_id=""):
    check_sparse_attention_args(q, k_cache, v_cache, block_table, seq_lens, query_seq, indices, d_v, query_pos, sinks,
                                window, index_block)
    return q.new_empty((q.shape[0], q.shape[1], d_v))
