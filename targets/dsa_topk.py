"""Kernels for dzc.dsa_topk: exact top-k positions per row, by sampled bounds and radix select (no sort of the row).

Each fp32 logit maps to a uint32 key with the same order. A sorted sample of SAMPLE evenly spaced keys gives two
keys that bracket the k-th largest with high probability; one sweep counts the keys above the upper one and keeps
the positions between the two (at most CANDIDATES, in a per-row scratch); when the counts prove the bracket holds,
radix select (histogram passes of RADIX_BITS-bit digits) runs over those candidates only, else over the whole row
(read once per pass). A last sweep writes every key above the k-th largest and the first equal ones (smaller
position first) in position order, so the output is ascending and deterministic, −1-padded when fewer than k exist.
One program per row, reading it in BLOCK-position chunks.

Why (H200, session 16, docs/results/dsa_topk_parts_h200.md): on a 32K row a 256-bin histogram costs ~10 µs and a
whole-row prefix sum more when the row is kept in registers (spills), so the earlier form, four histogram passes
over the whole row and a two-sum write, took ~100 µs where one read of the row takes 4. The sampled form makes
two sweeps of the row plus passes over ~1.5K candidates.

TileLang (targets/templates/dsa_topk.tilelang.py.tmpl): one thread block per row, radix select with the
candidates in shared memory: a histogram of the keys' top 12 bits over the row, a second sweep that marks the keys
above the threshold bin in a bitmap of the row and keeps the bin's keys, 8-bit rounds over those, then a prefix sum
of the bitmaps' popcounts writes the winners in position order (the same result as the Triton kernel's, with the
same arguments; the launch ignores the scratch). Issue 14: per row it has to be at least as fast as the public
TileLang topk_selector (tile-ai/tilelang examples/deepseek_v32), which it follows in shape.

Tuning bucket: the row width rounded up to a power of two (the config is a per-row choice; rows only fill the
grid).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from dzc.ops import dsa as dsa_ops
from dzc.targets import dsa_cases, tilelang_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import tilelang_config_legal
from dzc.targets.profiles import DeviceProfile

TEMPLATES = Path(__file__).parent / "templates"

# Candidates never run on a GPU, (params, why): out of users' tuning (launch.tuning_candidates).
# (WARP_VOTE=1's and SPECULATE=1's numerics passed on an H100 in session 39.) Also one that failed its GPU numerics
# once: the tuner's agreement check (the selected logits, agreement_values) sees a wrong selection only in the runs
# it times, so a config that is wrong now and then could still be picked; out until the failure is explained
# (docs/results/dsa_topk_parts_h200.md, sessions 46-47).
UNVALIDATED = (
    ({"THREADS": 512, "WIDTH": 131072, "SWEEP": 8192},
     "failed its GPU numerics once on an H100 (session 46; 32 passing runs since), cause not found"),
)


@dataclass(frozen=True)
class DsaTopkSpec:
    """The kernel is the same for every k, width and row count (run-time values); only the dtype is fixed."""

    logits_dtype: torch.dtype = torch.float32

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.logits_dtype,)  # legality checks float dtypes (indices are int32 everywhere)

    def describe(self) -> str:
        return "logits=float32 indices=int32"


def spec_from_node(node) -> DsaTopkSpec:
    logits, lengths = (node.args[i].meta["val"] for i in range(2))
    dsa_ops.check_dsa_topk_args(logits, lengths, node.args[2])
    return DsaTopkSpec()


def token_bucket(tokens: int) -> int:
    """`tokens` is the row width (prepare's work); tuning results are kept per power of two of it."""
    return 1 << max(tokens - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------------------
# Triton

TRITON_KERNEL_NAME = "dsa_topk_kernel"


def triton_source(spec: DsaTopkSpec, profile: DeviceProfile) -> str:
    return Template((TEMPLATES / "dsa_topk.triton.py.tmpl").read_text()).substitute(profile=profile.name)


# Sample size and candidate capacity of the tuned configs. With k = 2048 the bracket holds ~1.5K candidates of a
# 32K row and ~3K of a 128K row (4 standard deviations of the sample rank each side); a row whose candidates
# overflow (very long rows, heavy ties) takes the whole-row radix select, and is still exact.
SAMPLE = 2048
CANDIDATES = 4096


def triton_configs(spec: DsaTopkSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Chunk size × warps (4..16 positions a thread: whole-row temporaries stay in registers) with the sampled
    bounds, and the whole-row radix select alone (SAMPLE = 0) in the default chunking, timed beside them."""
    configs = []
    for block in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8, 16, 32):
            per_thread = block // (num_warps * profile.warp_size)
            if 4 <= per_thread <= 16:
                configs.append(KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block, RADIX_BITS=8,
                                                 SAMPLE=SAMPLE, CANDIDATES=CANDIDATES))
    return [*configs, radix_config(profile)]


def _with_chunk(profile: DeviceProfile, block: int, sample: int = SAMPLE) -> KernelConfig:
    """8 positions a thread (as many warps as the profile has, 4 at least)."""
    num_warps = min(profile.max_num_warps, max(4, block // (8 * profile.warp_size)))
    return KernelConfig.make(num_warps=num_warps, num_stages=1, BLOCK=block, RADIX_BITS=8, SAMPLE=sample,
                             CANDIDATES=CANDIDATES if sample else 0)


def triton_default_config(spec: DsaTopkSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice without a width: 4096-position chunks, sampled bounds."""
    return _with_chunk(profile, 4096)


def radix_config(profile: DeviceProfile) -> KernelConfig:
    """The whole-row radix select alone (no sample): the form before the sampled bounds, for benchmarks."""
    return _with_chunk(profile, 4096, sample=0)


def configs_for_bucket(spec: DsaTopkSpec, profile: DeviceProfile, bucket: int, configs: list[KernelConfig],
                       default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """Triton: chunks no wider than the row (a wider one only masks lanes), or the narrowest the profile takes: the
    untuned choice is the row's width up to 4096 positions at 8 a thread where that is legal, else the narrowest
    legal chunk; tuning times those chunks and the whole-row radix select. TileLang: tilelang_configs_for_bucket."""
    if _is_tilelang(default):
        return tilelang_configs_for_bucket(bucket, configs, default)
    sampled = [c for c in configs if c["SAMPLE"]]
    if not sampled:
        return configs, default
    widest = max(bucket, min(c["BLOCK"] for c in sampled))
    candidates = [c for c in configs if c["BLOCK"] <= widest or not c["SAMPLE"]]
    chosen = _with_chunk(profile, min(widest, 4096))
    if chosen not in candidates:  # e.g. 1024 positions at 8 a thread need fewer threads than a MUSA warp group
        chosen = min((c for c in candidates if c["SAMPLE"]), key=lambda c: (c["BLOCK"], c.num_warps))
    return candidates, chosen


def triton_shared_memory_bytes(spec: DsaTopkSpec, config: KernelConfig) -> int:
    """The histogram's bins, and the largest of the phases' cross-warp scratch (reused between them): the chunk's
    prefix sums, the sample's sort, the candidates' keys; one int32 each."""
    return 4 * (1 << config["RADIX_BITS"]) + 4 * max(config["BLOCK"], config["SAMPLE"], config["CANDIDATES"])


def triton_launch(kernel, config: KernelConfig, logits, lengths, k, indices, scratch):
    def launch(logits, lengths, indices):
        rows, width = logits.shape
        # split_rows' pieces are more rows than the op's: a scratch row each
        buffer = scratch if rows <= scratch.shape[0] else scratch.new_empty(rows, scratch.shape[1])
        kernel[(rows,)](logits, lengths, indices, buffer, width, k,
                        logits.stride(0), logits.stride(1), indices.stride(0), indices.stride(1), buffer.stride(0),
                        BLOCK=config["BLOCK"], RADIX_BITS=config["RADIX_BITS"], SAMPLE=config["SAMPLE"],
                        CANDIDATES=config["CANDIDATES"], num_warps=config.num_warps, num_stages=config.num_stages)

    split_rows(launch, logits, lengths, k, indices)


def triton_signature(spec: DsaTopkSpec, config: KernelConfig) -> tuple[dict, dict]:
    """(signature, constexprs) for compiling the kernel ahead of time with triton.compile (no GPU needed)."""
    signature = {"logits_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*i32", "scratch_ptr": "*i32",
                 "n_cols": "i32", "k": "i32", "stride_lt": "i32", "stride_ls": "i32", "stride_ot": "i32",
                 "stride_ok": "i32", "stride_st": "i32", "BLOCK": "constexpr", "RADIX_BITS": "constexpr",
                 "SAMPLE": "constexpr", "CANDIDATES": "constexpr"}
    return signature, {name: config[name] for name in ("BLOCK", "RADIX_BITS", "SAMPLE", "CANDIDATES")}


# ---------------------------------------------------------------------------------------------------------
# TileLang

TILELANG_FACTORY_NAME = "build"
# Threads a row; the positions the bitmaps span (a row up to that wide is written from the bitmaps the selection
# fills, a wider one a span at a time from bitmaps rebuilt by re-reading it); candidates kept in shared memory
# (the threshold bin of the first histogram: for normal logits at k = 2048 about 900 keys of a 32K row, 1400 of a
# 128K one; a bin with more runs the rounds over the whole row, exact but slower).
TILELANG_THREADS = (512, 1024)
TILELANG_WIDTHS = (32768, 131072)
TILELANG_CANDIDATES = 4096
# Row positions a block loads before it uses any: 8 loads in flight a thread at 1024 threads (64 registers a thread
# at most), 16 or 32 at 512. A row of few blocks (decode at batch 1) waits on these loads' latency.
TILELANG_SWEEPS = {512: (8192, 16384), 1024: (8192,)}
# The template's first-histogram bins and later rounds' bins (each thread zeroes and scans whole shares of them).
_TILELANG_FIRST_BINS = 4096
_TILELANG_RADIX = 256
# Wider radix rounds (1024 bins, one a thread at 1024 threads): two rounds after the first histogram instead of
# three, each a block-wide scan and a few barriers. H200, session 30: 1-2% faster at 32K and 128K (the tuner's pick).
TILELANG_WIDE_RADIX_BITS = 10
# Positions of a row whose keys the first sweep keeps in shared memory (128 KiB), for the second sweep (and the
# rounds over a whole row) to read there instead of the logits: a 32K row is then read from memory once. Where
# the rest of the shared memory allows it (the H200's 227 KiB: both spans), at 1024 threads with 10-bit rounds
# (the fastest there, session 30), beside the configs without it; with 8 or 16 loads in flight a thread in the
# one sweep left over the logits (59 registers a thread at 16, no spills: ptxas, sm_90a).
TILELANG_CACHE = 32768
TILELANG_CACHED_SWEEPS = (8192, 16384)
# The second sweep (the candidates and the bitmap of the keys above them) by warp votes (the template's warp_vote):
# ballots give the bitmap's words, and the bin's keys take their slots from a mask a thread, a shuffle scan and one
# atomic add a warp and sweep step (session 55; before, ballots of "in the bin" and ~24 population counts a warp
# and step, a quarter-rate instruction: session 53's H100 timed that sweep at 4.35 µs against 4.06 without votes).
# Session 34 (H200, 32K rows, phase stamps): that sweep took 4.2 of the block's 14.2 µs reading keys from shared
# memory, bound by its per-key work (shared atomics among it), not bytes. Only where a warp is 32 lanes (one bitmap
# word), beside its twin without it (the cached keys at TILELANG_VOTE_SWEEP positions in flight). Timed on an H100
# (session 46, 128 rows, beside that twin in one run): 9.5 / 8.9 / 11.0 / 15.4 µs at 4K / 8K / 16K / 32K against
# 9.8 / 9.5 / 11.3 / 15.5, so the untuned choice where the span is within the cached keys; not timed past them (the
# 128K span keeps the speculative buffer).
TILELANG_VOTE_SWEEP = 8192
# The second sweep over the row replaced by one over a speculative buffer (the template's speculate): the first
# sweep step's histogram estimates the threshold bin, and the first sweep keeps every key from there up, with its
# position, in the candidates' arrays grown to TILELANG_SPECULATE_BUFFER entries; a row whose buffer overflows, or
# whose threshold bin lies below the estimate, takes the second sweep as before. Why: H200, 128 rows of 128K (past
# the cached keys), that sweep re-read the logits: 18.8 of the block's 44 µs. Only where a warp is 32 lanes; a
# tuning candidate beside each span's untuned choice (6144 entries: 16 KiB more shared memory, what the 128K span
# leaves on the H200). The untuned choice of spans wider than the cached keys (_preference): H100, session 39, 128
# rows, k 2048, 128K span: 18.5, 23.1, 32.8, 40.1 µs at 40K, 64K, 96K, 128K positions against 19.1, 25.5, 38.0,
# 52.5 without it (docs/results/dsa_topk_speculate_h200.md); within the cache the second sweep reads shared memory.
TILELANG_SPECULATE_BUFFER = 6144


def _is_tilelang(config: KernelConfig) -> bool:
    return "WIDTH" in dict(config.params)


def tilelang_source(spec: DsaTopkSpec, profile: DeviceProfile) -> str:
    return Template((TEMPLATES / "dsa_topk.tilelang.py.tmpl").read_text()).substitute(
        profile=profile.name, warp_size=profile.warp_size)


def tilelang_configs(spec: DsaTopkSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """Threads a row × bitmap span × positions in flight (× radix bits at 1024 threads, and the cached keys' twins
    there, one of them also with warp votes where a warp is 32 lanes; and each span's untuned choice with the
    speculative buffer, same warps), pruned to what is legal on `profile` (72 KiB of shared memory on mp_22 leaves
    the 32K span only, and no cached keys)."""
    configs = []
    for width in TILELANG_WIDTHS:
        for threads in TILELANG_THREADS:
            if (threads % profile.warp_size or threads < _TILELANG_RADIX or _TILELANG_FIRST_BINS % threads
                    or width % (32 * threads)):
                continue  # the template's shapes: whole warps, whole shares of bins and bitmap words a thread
            for sweep in TILELANG_SWEEPS[threads]:
                # (RADIX_BITS only where it is not the template's 8: the others keep their tuning-database names)
                radixes = [{}]
                if threads >= 1 << TILELANG_WIDE_RADIX_BITS:  # one bin a thread, as 8-bit rounds have at 256+
                    radixes.append({"RADIX_BITS": TILELANG_WIDE_RADIX_BITS})
                for radix in radixes:
                    configs.append(KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=1,
                                                     THREADS=threads, WIDTH=width, CANDIDATES=TILELANG_CANDIDATES,
                                                     SWEEP=sweep, **radix))
            if threads == 1 << TILELANG_WIDE_RADIX_BITS:
                configs += [KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=1, THREADS=threads,
                                              WIDTH=width, CANDIDATES=TILELANG_CANDIDATES, SWEEP=sweep,
                                              RADIX_BITS=TILELANG_WIDE_RADIX_BITS, CACHE=TILELANG_CACHE)
                            for sweep in TILELANG_CACHED_SWEEPS]
                if profile.warp_size == 32:
                    configs.append(KernelConfig.make(num_warps=threads // profile.warp_size, num_stages=1,
                                                     THREADS=threads, WIDTH=width, CANDIDATES=TILELANG_CANDIDATES,
                                                     SWEEP=TILELANG_VOTE_SWEEP, RADIX_BITS=TILELANG_WIDE_RADIX_BITS,
                                                     CACHE=TILELANG_CACHE, WARP_VOTE=1))
        if profile.warp_size == 32:  # the span's untuned choice with the speculative buffer, where it is legal
            spans = [c for c in configs if c["WIDTH"] == width and not dict(c.params).get("WARP_VOTE")
                     and tilelang_config_legal(profile, c, tilelang_shared_memory_bytes(spec, c), spec.dtypes)]
            if spans:
                chosen = max(spans, key=_preference)
                configs.append(KernelConfig.make(chosen.num_warps, chosen.num_stages, **dict(chosen.params),
                                                 SPECULATE=1, SPECULATE_BUFFER=TILELANG_SPECULATE_BUFFER))
    return [c for c in configs
            if tilelang_config_legal(profile, c, tilelang_shared_memory_bytes(spec, c), spec.dtypes)]


def tilelang_default_config(spec: DsaTopkSpec, profile: DeviceProfile) -> KernelConfig:
    """Untuned choice without a width: the widest span, the most threads, the row's keys cached where the shared
    memory allows it, 10-bit radix rounds where there are as many threads as bins, the fewest positions in flight.
    H200, session 30, 128 rows of 32K: 15.4 µs against 16.6 for the same config with 8-bit rounds and no cache
    (1.08x; 1.14x in the tuner's timing), 128K 1.02x."""
    configs = tilelang_configs(spec, profile)
    if not configs:
        raise ValueError(f"no legal TileLang top-k config on {profile.name}")
    return max(configs, key=lambda c: (c["WIDTH"], _preference(c)))


def _preference(config: KernelConfig) -> tuple:
    """Within a span: the most threads, cached keys, 10-bit rounds, the fewest positions in flight, warp votes where
    the span is within the cached keys (measured faster there: TILELANG_VOTE_SWEEP; not timed past them), the
    speculative buffer where the span is wider than the cached keys (measured faster there:
    TILELANG_SPECULATE_BUFFER; not timed within the cache). The speculative buffer is offered on the span's choice
    without votes (the pair measured), so the two never meet in one config."""
    params = dict(config.params)
    within = config["WIDTH"] <= params.get("CACHE", 0)
    vote = params.get("WARP_VOTE", 0) * (1 if within else -1)
    speculate = params.get("SPECULATE", 0) * (-1 if within else 1)
    return (config["THREADS"], "CACHE" in params, params.get("RADIX_BITS") == TILELANG_WIDE_RADIX_BITS,
            -config["SWEEP"], vote, speculate)


def tilelang_configs_for_bucket(bucket: int, configs: list[KernelConfig],
                                default: KernelConfig) -> tuple[list[KernelConfig], KernelConfig]:
    """The narrowest span that holds a row of the bucket (else the widest: longer rows are written span by span);
    tuning times its configs, the untuned choice is the one the default's rule prefers there."""
    widths = sorted({c["WIDTH"] for c in configs}) or [default["WIDTH"]]
    width = next((w for w in widths if w >= bucket), widths[-1])
    candidates = [c for c in configs if c["WIDTH"] == width] or [default]
    chosen = max(candidates, key=_preference)
    return candidates, chosen


def tilelang_prebuilt_configs(spec: DsaTopkSpec, profile: DeviceProfile) -> list[KernelConfig]:
    """What tilelang_codegen.load starts building ahead: the untuned choice of every span (the default's, the widest,
    first). A model's rows are as wide as its context: short contexts take a narrow span, whose kernel was otherwise
    built in-process at its first call."""
    configs, default = tilelang_configs(spec, profile), tilelang_default_config(spec, profile)
    spans = sorted({c["WIDTH"] for c in configs}, reverse=True)
    chosen = [default]
    for width in spans:
        config = tilelang_configs_for_bucket(width, configs, default)[1]
        if config not in chosen:
            chosen.append(config)
    return chosen


def tilelang_shared_memory_bytes(spec: DsaTopkSpec, config: KernelConfig) -> int:
    """First histogram, candidates' keys and positions (as many as the speculative buffer where it is more), the two
    bitmaps, the warps' sums, the chosen bin, the candidate counter, the cached keys and the buffer's counter (int32
    each), each rounded up to 16 bytes as TileLang places them."""
    params = dict(config.params)
    room = max(config["CANDIDATES"], params.get("SPECULATE_BUFFER", 0) if params.get("SPECULATE") else 0)
    sizes = (_TILELANG_FIRST_BINS, room, room, config["WIDTH"] // 32, config["WIDTH"] // 32, 2 * config.num_warps,
             4, 1, params.get("CACHE", 0), 1 if params.get("SPECULATE") else 0)
    return sum(-(-4 * n // 16) * 16 for n in sizes)


def tilelang_phase_stamped(config: KernelConfig) -> KernelConfig:
    """`config` with the template's phase stamps (PHASE_STAMPS=1: thread 0's clocks at each phase's end, into a
    fourth argument tilelang_launch does not pass), for tools/diagnose_dsa_topk_phases.py. A diagnostic build, so
    never among tilelang_configs (what tuning and the untuned choice pick from)."""
    return KernelConfig.make(config.num_warps, config.num_stages, **dict(config.params), PHASE_STAMPS=1)


def tilelang_launch(compiled, config: KernelConfig, logits, lengths, k, indices, scratch):
    """The Triton launch's arguments; the kernel takes k from the indices' shape and needs no scratch.
    `compiled` is what tilelang_codegen.load returns (one compiled kernel per config)."""
    kernel = compiled.kernel_for(config)
    split_rows(lambda logits, lengths, indices: tilelang_codegen.launch_arguments((logits, lengths), (indices,))
               .launch(kernel), logits, lengths, k, indices)


# ---------------------------------------------------------------------------------------------------------
# Both codegens


# Fewer than SPLIT_ROWS_BELOW rows at least SPLIT_FROM positions wide are selected in SPLIT_WIDTH-position pieces
# (split_rows): with one program (or thread block) a row, a few long rows leave most of the GPU idle. H200, session
# 23, 2 rows of 1M positions: TileLang's kernel 425 µs and Triton's 4.3 ms whole, torch.topk 140 µs; TileLang
# takes 128 rows of 32K in 20 µs. Rows enough to fill the GPU (half an H200's SMs and more) stay whole: their
# pieces would take several waves. The split itself has not run on a GPU yet.
SPLIT_WIDTH = 32768
SPLIT_FROM = 262144
SPLIT_ROWS_BELOW = 64


def split_rows(launch, logits, lengths, k: int, indices) -> None:
    """launch(logits, lengths, indices) runs the kernel over rows; fewer than SPLIT_ROWS_BELOW rows at least
    SPLIT_FROM wide take two rounds of it: the k largest of each SPLIT_WIDTH-position piece of every row (the
    pieces as rows of their own), then the k largest of those candidates. Exact, with the same ties: the row's k
    largest are among its pieces' k largest. Every piece before the one holding the row's length is whole, so it
    keeps exactly k valid positions; that piece keeps min(k, what is left) and then −1s, later pieces only −1s.
    The valid candidates are therefore a prefix of the candidate row, in ascending position order, so the second
    round's ties (the smaller candidate first) are the row's (the smaller position first)."""
    rows, width = logits.shape
    piece = SPLIT_WIDTH
    pieces = -(-width // piece)
    # (pieces * k >= width: the candidates would be no fewer than the positions)
    if width < SPLIT_FROM or rows >= SPLIT_ROWS_BELOW or pieces * k >= width:
        launch(logits, lengths, indices)
        return
    if width % piece or not logits.is_contiguous():
        # Positions past the row's width are past every length (the op clamps lengths to it): never valid.
        whole = logits.new_full((rows, pieces * piece), float("-inf"))
        whole[:, :width] = logits
        logits = whole
    lengths = lengths.long().clamp(0, width)
    starts = torch.arange(pieces, device=logits.device) * piece
    piece_lengths = (lengths[:, None] - starts).clamp(0, piece).to(torch.int32).reshape(-1)
    chosen = torch.empty(rows * pieces, k, dtype=torch.int32, device=logits.device)
    launch(logits.view(rows * pieces, piece), piece_lengths, chosen)
    positions = torch.where(chosen >= 0, chosen + starts.repeat(rows)[:, None].to(torch.int32), -1).view(rows, -1)
    values = torch.gather(logits, 1, positions.clamp(min=0).long())  # those of −1s lie past the valid prefix
    whole_pieces = lengths // piece
    candidate_lengths = (whole_pieces * k + (lengths - whole_pieces * piece).clamp(max=k)).to(torch.int32)
    picked = torch.empty_like(indices)
    split_rows(launch, values, candidate_lengths, k, picked)  # pieces * k may be that wide again
    indices.copy_(torch.where(picked >= 0, torch.gather(positions, 1, picked.clamp(min=0).long()), -1))


def prepare(spec: DsaTopkSpec, logits, lengths, k, *_static):
    """Op arguments -> (kernel inputs, kernel outputs (preallocated: the indices and the candidates' scratch, which
    only the Triton kernel uses), the row width (0 without rows), the op's result)."""
    dsa_ops.check_dsa_topk_args(logits, lengths, k)
    k = int(k)
    indices = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    scratch = torch.empty(logits.shape[0], CANDIDATES, dtype=torch.int32, device=logits.device)
    # The kernel indexes lengths as a dense vector (a strided one was read at the wrong elements).
    work = max(logits.shape[1], 1) if logits.shape[0] else 0  # the row width picks the config (token_bucket)
    return (logits, lengths.contiguous(), k), (indices, scratch), work, indices


def agreement_values(inputs: tuple, indices: torch.Tensor) -> tuple[torch.Tensor]:
    """What the tuner compares across configs, exactly (launch.agreement_check), instead of the positions, which
    may differ where logits tie: each row's selected logits in order, NaN for each -1 (a row with fewer than k
    positions; a selected -inf logit stays -inf). A wrong selection shows as another value or another count."""
    logits = inputs[0]
    picked = torch.gather(logits.float(), 1, indices.clamp_min(0).long())
    picked = torch.where(indices >= 0, picked, float("nan"))
    return (picked.sort(dim=1, descending=True).values,)


def selftest_cases(profile: DeviceProfile):
    """Named small cases for dzc-selftest: rows longer and shorter than k (and empty), distinct and tied logits."""
    build = functools.partial(dsa_cases.topk_args, 4, 256, [256, 10, 100, 0], 16)
    return [("distinct", build), ("ties", functools.partial(build, ties=True))]
