"""Random inputs for the DSA kernels (dsa_indexer, dsa_topk, sparse_attention): ragged batches of sequences in
paged caches with shuffled, non-identity block tables. The kernel families' selftest_cases, the kernel tests and
tools/bench_dsa.py all build their arguments here, so every consumer exercises the same layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dzc import kv_cache


@dataclass(frozen=True)
class Paging:
    """Where each sequence's tokens live: block_table[b, i] is the physical page of tokens [i·page_size, ...)."""

    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_pages]; entries past a sequence's last page are −1
    page_size: int
    pages: int  # physical pages in the cache (including some no sequence uses)


def host_generator(generator: torch.Generator) -> torch.Generator:
    """The builders here draw on the host (Python loops over rows, .tolist()): a device generator (dzc-selftest
    passes one for the device it tests) seeds a host generator from its own stream, so a seed still replays."""
    if generator.device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator().manual_seed(seed)


def random_paging(seq_lens: list[int], page_size: int, device, generator: torch.Generator,
                  spare_pages: int = 2) -> Paging:
    """Pages handed out in a random order (never the identity), plus a few unused ones."""
    generator = host_generator(generator)
    needed = [-(-n // page_size) for n in seq_lens]
    pages = sum(needed) + spare_pages
    order = torch.randperm(pages, generator=generator).tolist()
    if order == sorted(order):  # the identity would hide a kernel that ignores the block table
        order = order[1:] + order[:1]
    width = max(max(needed), 1)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.int32)
        taken += n
    return Paging(torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device), page_size, pages)


def scatter_to_pages(per_token: list[torch.Tensor], paging: Paging, fill: float = float("nan")) -> torch.Tensor:
    """[pages, page_size, *features] cache holding sequence b's tokens (per_token[b]: [len_b, *features]) at
    their block-table slots; slots no token owns hold `fill` (NaN: a kernel that reads them cannot hide it)."""
    features = per_token[0].shape[1:]
    cache = torch.full((paging.pages, paging.page_size, *features), fill, dtype=per_token[0].dtype,
                       device=per_token[0].device)
    table = paging.block_table.cpu()
    for b, tokens in enumerate(per_token):
        for pos in range(tokens.shape[0]):
            cache[table[b, pos // paging.page_size], pos % paging.page_size] = tokens[pos]
    return cache


def random_fp8_index_cache(paging: Paging, keys: list[torch.Tensor]) -> torch.Tensor:
    """The uint8 FP8 key cache [pages, page_size·(Di + 4)] holding keys[b] ([len_b, Di]) of each sequence,
    quantized and written by dzc.kv_cache.write_index_keys; bytes no token owns are random (NaN patterns
    included), so a kernel that reads them shows it."""
    head_dim = keys[0].shape[1]
    device = keys[0].device
    cache = torch.randint(0, 256, (paging.pages, kv_cache.fp8_index_page_bytes(paging.page_size, head_dim)),
                          dtype=torch.uint8, device=device)
    table = paging.block_table.long()
    for b, seq_keys in enumerate(keys):
        positions = torch.arange(seq_keys.shape[0], device=device)
        slots = table[b, positions // paging.page_size] * paging.page_size + positions % paging.page_size
        kv_cache.write_index_keys(cache, slots, seq_keys)
    return cache


def queries_at(seq_lens: list[int], per_seq: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_seq, query_pos) int32 for the last per_seq[b] positions of each sequence b (decode: 1 or 2;
    prefill: a chunk), in sequence order."""
    seqs, positions = [], []
    for b, (n, count) in enumerate(zip(seq_lens, per_seq)):
        for pos in range(n - count, n):
            seqs.append(b)
            positions.append(pos)
    return (torch.tensor(seqs, dtype=torch.int32, device=device),
            torch.tensor(positions, dtype=torch.int32, device=device))


def indexer_args(seq_lens: list[int], per_seq: list[int], heads: int, head_dim: int, fp8: bool, page_size: int,
                 device, generator: torch.Generator, max_context: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, fp8_q: bool = True) -> tuple:
    """dsa_indexer's arguments (without kernel_id): q, weights, index_k_cache, block_table, seq_lens, query_seq,
    query_pos, max_context (default: the longest sequence). fp8: the uint8 FP8 cache and an e4m3 q (a `dtype` q
    with fp8_q=False); otherwise q and cache in `dtype`."""
    generator = host_generator(generator)
    paging = random_paging(seq_lens, page_size, device, generator)
    query_seq, query_pos = queries_at(seq_lens, per_seq, device)
    rows = query_seq.shape[0]
    weights = torch.randn(rows, heads, generator=generator).to(device)
    keys = [torch.randn(n, head_dim, generator=generator).to(device) for n in seq_lens]
    if fp8:
        q = torch.randn(rows, heads, head_dim, generator=generator) * 8
        q = q.to(device, torch.float8_e4m3fn if fp8_q else dtype)
        cache = random_fp8_index_cache(paging, keys)
    else:
        q = torch.randn(rows, heads, head_dim, generator=generator).to(device, dtype)
        cache = scatter_to_pages([k.to(dtype) for k in keys], paging)
    return (q, weights, cache, paging.block_table, paging.seq_lens, query_seq, query_pos,
            max_context if max_context is not None else max(seq_lens))


def topk_args(rows: int, width: int, lengths: list[int], k: int, device, generator: torch.Generator,
              ties: bool = False) -> tuple:
    """dsa_topk's arguments: logits fp32 [rows, width] (ties: values drawn from a few levels, so that many are
    equal; some −inf either way), lengths int32 [rows], k."""
    generator = host_generator(generator)
    if ties:
        logits = torch.randint(-3, 4, (rows, width), generator=generator).float()
    else:
        logits = torch.randn(rows, width, generator=generator)
    logits[torch.rand(rows, width, generator=generator) < 0.05] = float("-inf")
    return logits.to(device), torch.tensor(lengths, dtype=torch.int32, device=device), k


def sparse_attention_args(seq_lens: list[int], per_seq: list[int], heads: int, kv_heads: int, d_qk: int, d_v: int,
                          separate_v: bool, topk: int, page_size: int, device, generator: torch.Generator,
                          dtype=torch.bfloat16, fp8_cache: bool = False, causal: bool = False, window: int = 0,
                          sinks: bool = False, index_block: int = 1) -> tuple:
    """sparse_attention's arguments: q, k_cache, v_cache (None: V = K[..., :d_v]), block_table, seq_lens,
    query_seq, indices, sm_scale, d_v. Indices are distinct causal positions of the row's sequence mixed with
    invalid ones (−1 and positions ≥ the sequence length); some rows have none valid. fp8_cache: k_cache is the
    FP8 latent layout (one KV head, V its first d_v), written by dzc.kv_cache.write_latent; bytes no token owns
    are random (NaN patterns included). causal, window or sinks: three more arguments, query_pos, sinks (fp32
    [heads], random logits, or None) and window; with query_pos some rows also select positions past the query
    (written, to be skipped), and rows with no valid index still attend their window. index_block > 1: the
    indices select blocks of that many positions (the block holding the query among them, partly in its future),
    and a fourth argument, index_block, follows."""
    generator = host_generator(generator)
    paging = random_paging(seq_lens, page_size, device, generator)
    query_seq, query_pos = queries_at(seq_lens, per_seq, device)
    rows = query_seq.shape[0]
    q = torch.randn(rows, heads, d_qk, generator=generator).to(device, dtype)
    latent = [torch.randn(n, kv_heads, d_qk, generator=generator).to(device, dtype) for n in seq_lens]
    if fp8_cache:
        k_cache = torch.randint(0, 256, (paging.pages, page_size, 1, kv_cache.fp8_latent_token_bytes(d_v, d_qk - d_v)),
                                generator=generator, dtype=torch.uint8).to(device)
        table = paging.block_table.long()
        for b, rows_b in enumerate(latent):
            positions = torch.arange(rows_b.shape[0], device=device)
            slots = table[b, positions // page_size] * page_size + positions % page_size
            kv_cache.write_latent(k_cache, slots, rows_b[:, 0], d_v)
    else:
        k_cache = scatter_to_pages(latent, paging)
    v_cache = None
    if separate_v:
        v_cache = scatter_to_pages([torch.randn(n, kv_heads, d_v, generator=generator).to(device, dtype)
                                    for n in seq_lens], paging)
    indices = torch.full((rows, topk), -1, dtype=torch.int32)
    seqs, positions = query_seq.tolist(), query_pos.tolist()
    for t in range(rows):
        if t % 7 == 3:
            continue  # a row with no valid index: its output is 0
        visible = torch.randperm(positions[t] // index_block + 1, generator=generator)
        if index_block > 1:  # the block holding the query (partly in its future) first, kept valid below
            own = positions[t] // index_block
            visible = torch.cat([visible.new_tensor([own]), visible[visible != own]])
        visible = visible[:topk]
        indices[t, :visible.numel()] = visible.int()
        invalid = torch.rand(topk, generator=generator) < 0.15
        if index_block > 1:
            invalid[0] = False
        beyond = -(-seq_lens[seqs[t]] // index_block) + torch.randint(0, 50, (topk,), generator=generator,
                                                                        dtype=torch.int32)
        indices[t] = torch.where(invalid, torch.where(torch.rand(topk, generator=generator) < 0.5, -1, beyond),
                                 indices[t])
        future = torch.arange(positions[t] + 1, seq_lens[seqs[t]], dtype=torch.int32)
        if (causal or window) and index_block == 1 and future.numel() and t % 3 == 1:  # past the query: skipped
            indices[t, -1] = future[torch.randint(0, future.numel(), (1,), generator=generator)]
    args = (q, k_cache, v_cache, paging.block_table, paging.seq_lens, query_seq, indices.to(device), d_qk ** -0.5,
            d_v)
    if not (causal or window or sinks or index_block > 1):
        return args
    sink_logits = (torch.randn(heads, generator=generator) * 2).to(device) if sinks else None
    extras = (query_pos if causal or window else None, sink_logits, window)
    return args + extras + ((index_block,) if index_block > 1 else ())
