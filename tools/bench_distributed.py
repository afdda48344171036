"""Multi-GPU benchmark of dzc's tensor- and expert-parallel paths, one process per GPU (torchrun), in one run:

    torchrun --nproc-per-node 2 tools/bench_distributed.py [--out docs/results/distributed_h200.md] [--no-tune]
    python tools/bench_distributed.py                 # world size 1 on one GPU (the sharded paths, unsharded)
    python tools/bench_distributed.py --quick         # tiny sizes on the CPU with gloo (smoke test)
    python tools/bench_distributed.py --no-tune --tables ep   # the expert-parallel table alone

(1) all-reduce + residual add + RMSNorm, bf16, hidden 7168, tokens {1, 64, 4096}: dzc (the all-reduce in the
    graph, fused with the add + norm by fuse_all_reduce_residual_norm) vs torch.distributed's all-reduce then a
    torch.compile'd add + norm. Goal: dzc >= 1.3x at <= 64 tokens. Beside them, dzc's one-shot kernel
    (targets/all_reduce_add_rms_norm.py: reads the peers' symmetric-memory buffers, add + norm in its epilogue;
    not a lowering yet, called directly): timed where the profile has `symmetric_memory` and torch's symmetric
    memory is usable, else its column says why it was skipped.
(2) a decoder layer at TP = world vs TP = 1 (rank 0 alone, the whole layer): prefill throughput (tokens/s) and
    the one-token step time, for two layers: dzc.models.distributed's TPDecoder (dense attention, SwiGLU MLP;
    hidden 7168), and the reference DSA + MXFP4-MoE layer (one layer of dzc.models.multimodal's "h200" config:
    hidden 2880, 64 MLA heads, gpt-oss-20b's 32 experts) as TensorParallelDecoderLayer runs it (heads split,
    experts split, each rank routing a share of the tokens) over a paged cache. Goals: prefill >= 1.7x,
    step <= 0.65x at TP = 2.
(3) the MXFP4 MoE layer (gpt-oss-120b's shapes, 32 experts: the weights are quantized on the host) with experts
    split over the ranks (dzc.distributed's ExpertParallelMoE: all_to_all_single with the router's splits, local
    experts in dzc.mxfp4_moe) vs the whole layer on one GPU (rank 0 alone), on the same tokens per rank; beside
    them the EP layer without merge_all_to_all_dispatches and read_all_to_all_splits_once, and the whole layer
    without dzc's CUDA graphs (the EP
    graph reads its split sizes back to the host, so it never runs in one), and a profile of the EP calls.

--no-tune: dzc's untuned default configs (tuning the MoE kernels' token buckets takes minutes on a GPU: at world
size 1 on the H200 it outran a 200 s run). Each table is printed as soon as it is complete.

Every dzc result is checked against the eager model on the same inputs before it is timed; every compile report
must show its fusion fired. Times: median of back-to-back calls (host + device), after warm-up, a barrier
before each batch of calls.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import replace

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from dzc import distributed
from dzc.models import distributed as sharded
from dzc.models.decoder import HFRMSNorm
from dzc.models.dsa import DSASession
from dzc.models.moe import CONFIGS, build_moe
from dzc.models.multimodal import CONFIGS as DECODER_CONFIGS
from dzc.models.multimodal import build_multimodal, new_cache
from dzc.targets import all_reduce_add_rms_norm as one_shot
from dzc.targets import resolve_target

FULL = dict(hidden=7168, tokens=[1, 64, 4096], layer=dict(hidden=7168, heads=56, intermediate=18432, vocab=1024),
            prefill=4096, moe=replace(CONFIGS["gpt-oss-120b"], experts=32), moe_tokens=[64, 4096], iterations=20,
            warmups=2, decoder="h200")
QUICK = dict(hidden=64, tokens=[1, 8], layer=dict(hidden=64, heads=4, intermediate=128, vocab=128),
             prefill=16, moe="tiny-gptoss", moe_tokens=[8], iterations=1, warmups=1, decoder="tiny")


class AllReduceAddNorm(nn.Module):
    """The end of a row-parallel projection: all-reduce the partial sums, add the residual, HF RMSNorm."""

    def __init__(self, hidden: int, group):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(0))
        self.group = group

    def forward(self, partial, residual):
        h = residual + funcol.all_reduce(partial, "sum", self.group)
        return self.norm(h), h


# The share of rows a selecting layer may get another way than eager (see check): 1% measured, margin for TP's
# different partial sums.
FLIPPED_ROWS = 0.03


def timed(fn, sizes: dict, device, together: bool = True) -> float:
    """Median seconds of sizes["iterations"] back-to-back calls after sizes["warmups"] calls (--quick: one each, the
    first compiles; its timings mean nothing through the interpreter); `together`: every rank in step (a barrier
    before each call), else this rank alone (the one-GPU baselines)."""
    for _ in range(sizes["warmups"]):
        fn()
    times = []
    for _ in range(sizes["iterations"]):
        if together:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(name: str, actual, expected, tolerance: float, selects: bool = False) -> None:
    """dzc's result against eager's: the largest difference over the largest |value| within `tolerance`.
    `selects`: the layer picks among values in bf16 (a router's or an indexer's top-k). Two correct computations that
    round differently then pick another expert or position where two scores nearly tie, and such a row differs by
    a whole expert's output (on the H200, 42 of 4096 rows of the DSA+MoE layer's prefill even with both of dzc's
    rewrites off: Inductor's rounding against eager's; dzc's own rewrite check skips such graphs for that reason).
    There the check is per row: at most FLIPPED_ROWS of the rows beyond `tolerance`, the median row within a quarter
    of it."""
    scale = expected.float().abs().max().clamp_min(1e-30)
    rows = (actual.float() - expected.float()).abs().flatten(0, -2).amax(-1) / scale
    worst, median, beyond = rows.max().item(), rows.median().item(), (rows > tolerance).float().mean().item()
    if not selects and not worst <= tolerance:
        raise SystemExit(f"{name}: dzc differs from eager by {worst:.3g} of the largest |value| (> {tolerance})")
    if selects and not (beyond <= FLIPPED_ROWS and median <= tolerance / 4):
        raise SystemExit(f"{name}: {beyond:.1%} of the rows differ from eager's by more than {tolerance} of the "
                         f"largest |value| (at most {FLIPPED_ROWS:.0%} may: near-tie selections), the median row by "
                         f"{median:.3g} (at most {tolerance / 4})")
    if selects and beyond:
        print(f"{name}: {beyond:.1%} of the rows beyond {tolerance} of the largest |value| (near-tie selections), "
              f"median row {median:.3g}", flush=True)


def fired(compiled, name: str) -> None:
    if not compiled.report.passes.get(name):
        raise SystemExit(f"dzc did not fire {name}:\n{compiled.report}")


def all_reduce_norm(sizes, options, target, device, group, rank) -> list[str]:
    rows = []
    module = AllReduceAddNorm(sizes["hidden"], group).to(device).bfloat16()
    compiled = dzc.compile(module, target=target, options=options)

    def add_norm(reduced, residual):
        return module.norm(residual + reduced)

    if device.type == "cuda":  # Inductor's CPU code (--quick) needs a C++ toolchain and minutes here
        add_norm = torch.compile(add_norm)

    def unfused(partial, residual):
        reduced = partial.clone()
        dist.all_reduce(reduced, group=group)
        return add_norm(reduced, residual)

    profile = resolve_target(target).profile
    skipped = one_shot.OneShotAllReduceAddRmsNorm.unavailable(profile, device)
    runner = None
    if skipped:
        print(f"dzc one-shot fused: skipped ({skipped})")
    else:
        runner = one_shot.OneShotAllReduceAddRmsNorm(group, profile, f"{options.resolved_cache_dir()}/one_shot")
    norm = module.norm
    for tokens in sizes["tokens"]:
        generator = torch.Generator(device=device).manual_seed(tokens + rank)
        partial = torch.randn(tokens, sizes["hidden"], device=device, generator=generator).bfloat16()
        residual = torch.randn(tokens, sizes["hidden"], device=device,
                               generator=torch.Generator(device=device).manual_seed(tokens)).bfloat16()
        with torch.no_grad():
            check(f"all_reduce_add_rms_norm T={tokens}", compiled(partial, residual)[0], unfused(partial, residual),
                  2 ** -6)
            fused_s = timed(lambda: compiled(partial, residual), sizes, device)
            unfused_s = timed(lambda: unfused(partial, residual), sizes, device)
            one_shot_cells = "skipped | - "
            if runner is not None:
                def fused_one_shot():
                    return runner(partial, residual, norm.weight, norm.variance_epsilon, False, True,
                                  torch.bfloat16, torch.bfloat16)

                try:  # the first call rendezvouses (a group of one may be refused)
                    first = fused_one_shot()[0]
                except RuntimeError as error:
                    print(f"dzc one-shot fused: skipped (symmetric memory refused: {error})")
                    runner = None
                if runner is not None:
                    check(f"one-shot all_reduce_add_rms_norm T={tokens}", first, unfused(partial, residual), 2 ** -6)
                    one_shot_s = timed(fused_one_shot, sizes, device)
                    one_shot_cells = f"{one_shot_s * 1e6:.1f} | {unfused_s / one_shot_s:.2f}x "
        rows.append(f"| all_reduce_add_rms_norm | {sizes['hidden']} | {tokens} | {fused_s * 1e6:.1f} | "
                    f"{unfused_s * 1e6:.1f} | {unfused_s / fused_s:.2f}x | {one_shot_cells}|")
    fired(compiled, "fuse_all_reduce_residual_norm")
    return rows


def tp_layer(sizes, options, target, device, mesh, rank, world) -> list[str]:
    layer = dict(sizes["layer"], layers=1)
    tokens = {"prefill": torch.randint(0, layer["vocab"], (1, sizes["prefill"]), device=device,
                                       generator=torch.Generator(device=device).manual_seed(1)),
              "step": torch.randint(0, layer["vocab"], (1, 1), device=device,
                                    generator=torch.Generator(device=device).manual_seed(2))}
    results = {}
    for tp in sorted({1, world}):
        model = sharded.build_tp_decoder(torch.bfloat16, **layer).to(device)
        with torch.no_grad():
            expected = {name: model(t) for name, t in tokens.items()}
        if tp > 1:
            sharded.parallelize(model, mesh)
        elif rank != 0:
            dist.barrier()  # TP = 1 runs on rank 0 alone
            continue
        compiled = dzc.compile(model, target=target, options=options)
        with torch.no_grad():
            for name, t in tokens.items():
                check(f"TP={tp} {name}", compiled(t), expected[name], 2 ** -4)
                results[(tp, name)] = timed(lambda t=t: compiled(t), sizes, device, together=tp > 1)
        if tp > 1:
            fired(compiled, "fuse_all_reduce_residual_norm")
        elif world > 1:
            dist.barrier()
    return tp_rows("", sizes["prefill"], results, rank, world)


def tp_rows(label: str, prefill: int, results: dict, rank: int, world: int) -> list[str]:
    """Rank 0's table rows of a layer's TP = 1 and TP = world runs: results[(tp, "prefill" | "step")] in seconds."""
    if rank != 0:
        return []
    return [f"| {label}TP={tp} | {prefill / results[(tp, 'prefill')]:.0f} | {results[(tp, 'step')] * 1e6:.1f} | "
            f"{results[(1, 'prefill')] / results[(tp, 'prefill')]:.2f}x | "
            f"{results[(tp, 'step')] / results[(1, 'step')]:.2f}x |" for tp in sorted({1, world})]


def dsa_moe_layer(sizes, options, target, device, group, rank, world) -> list[str]:
    """(2b) The reference DSA + MXFP4-MoE decoder layer (dzc.models.multimodal's, one layer of its config) at
    TP = world (TensorParallelDecoderLayer) vs the whole layer on rank 0: a prefill of sizes["prefill"] tokens
    and a one-token step after it, each rewriting its own slots of a paged cache every call."""
    cfg = replace(DECODER_CONFIGS[sizes["decoder"]], layers=1)
    whole = build_multimodal(cfg, torch.bfloat16, device=device).language.layers[0]
    prefill = sizes["prefill"]
    session = DSASession(new_cache(cfg, -(-(prefill + 1) // 16) + 1, 1, fp8_index=False, dtype=torch.bfloat16,
                                   device=device))
    generator = torch.Generator(device=device).manual_seed(3)
    inputs = {name: session.inputs(torch.randn(1, seq, cfg.hidden, device=device, dtype=torch.bfloat16,
                                               generator=generator))[:-1]
              for name, seq in (("prefill", prefill), ("step", 1))}
    with torch.no_grad():
        expected = {name: whole(*args, session.cache) for name, args in inputs.items()}
    results = {}
    for tp in sorted({1, world}):
        if tp == 1 and rank != 0:
            dist.barrier()  # TP = 1 runs on rank 0 alone
            continue
        layer = whole if tp == 1 else sharded.TensorParallelDecoderLayer(whole, rank, world, group)
        compiled = dzc.compile(layer, target=target, options=options)
        with torch.no_grad():
            for name, args in inputs.items():
                check(f"DSA+MoE layer TP={tp} {name}", compiled(*args, session.cache), expected[name], 2 ** -4,
                      selects=True)
                results[(tp, name)] = timed(lambda args=args: compiled(*args, session.cache), sizes,
                                            device, together=tp > 1)
        for name in ("fuse_sparse_attention", "fuse_mxfp4_experts"):
            fired(compiled, name)
        if tp == 1 and world > 1:
            dist.barrier()
    return tp_rows(f"DSA+MoE ({sizes['decoder']}), ", prefill, results, rank, world)


def ep_layer(sizes, options, target, device, group, rank, world) -> list[str]:
    """(3) The EP layer (dzc as it compiles it: the dispatch's all_to_alls merged by merge_all_to_all_dispatches,
    the split sizes read through one copy to the host by read_all_to_all_splits_once), the same with those passes
    off, and the whole layer on rank 0 with and without dzc's CUDA graphs: the EP path's overhead split into what
    the two passes save and what losing CUDA graphs to the split sizes' host reads costs; and the EP layer with a
    fixed capacity (ep_max_dispatch_rows = the row's tokens x top_k: pad_all_to_all_to_capacity, no host read, so
    small calls replay a CUDA graph). Rank 0 also prints the EP layer's collectives and host syncs per call and a
    profile of its calls."""
    block = build_moe(sizes["moe"]).to(device)
    hidden = block.cfg.hidden
    rows = []
    layer = sharded.ExpertParallelMoE(block, rank, world, group).to(device)
    compiled_ep = dzc.compile(layer, target=target, options=options)
    unmerged = replace(options, disable_passes=(*options.disable_passes, "merge_all_to_all_dispatches",
                                                "read_all_to_all_splits_once"))
    compiled_unmerged = dzc.compile(layer, target=target, options=unmerged)
    # Each pass alone off: which of the two pays (printed, not tabled).
    alone = {name: dzc.compile(layer, target=target,
                               options=replace(options, disable_passes=(*options.disable_passes, name)))
             for name in ("merge_all_to_all_dispatches", "read_all_to_all_splits_once")}
    compiled_one = compiled_plain = None
    if rank == 0:
        compiled_one = dzc.compile(block, target=target, options=options)
        compiled_plain = dzc.compile(block, target=target, options=replace(options, cuda_graph_max_tokens=0))
    for tokens in sizes["moe_tokens"]:
        x = torch.randn(world * tokens, hidden, device=device,
                        generator=torch.Generator(device=device).manual_seed(tokens)).bfloat16()
        mine = x[rank * tokens:(rank + 1) * tokens]
        with torch.no_grad():
            got = compiled_ep(mine)
            check(f"EP={world} T={tokens}", got, block(x)[rank * tokens:(rank + 1) * tokens], 2 ** -4, selects=True)
            # The same bytes arrive either way (tests/test_distributed.py: equal to the bit on the CPU); here the
            # final index_add_'s atomics may add a token's slots in another order.
            check(f"EP={world} T={tokens} with the EP passes vs without", got, compiled_unmerged(mine), 2 ** -7)
            ep_s = timed(lambda: compiled_ep(mine), sizes, device)
            compiled_padded = dzc.compile(layer, target=target, options=replace(
                options, ep_max_dispatch_rows=tokens * block.cfg.top_k))
            check(f"EP={world} T={tokens} fixed capacity", compiled_padded(mine),
                  block(x)[rank * tokens:(rank + 1) * tokens], 2 ** -4, selects=True)
            fired(compiled_padded, "pad_all_to_all_to_capacity")
            padded_s = timed(lambda: compiled_padded(mine), sizes, device)
            unmerged_s = timed(lambda: compiled_unmerged(mine), sizes, device)
            without = {name: timed(lambda c=c: c(mine), sizes, device) for name, c in alone.items()}
            if rank == 0:
                print(f"EP={world} T={tokens}: " + ", ".join(f"without {name} {t * 1e6:.1f} µs"
                                                            for name, t in without.items()), flush=True)
            one_s = plain_s = 0.0
            if rank == 0:
                one_s = timed(lambda: compiled_one(mine), sizes, device, together=False)
                plain_s = timed(lambda: compiled_plain(mine), sizes, device, together=False)
            if tokens == sizes["moe_tokens"][0]:  # every rank runs the calls (collectives); rank 0 prints
                ep_profile(compiled_ep, mine, device, rank, world)
        if world > 1:
            dist.barrier()
        rows.append(f"| EP={world} | {tokens} | {ep_s * 1e6:.1f} | {padded_s * 1e6:.1f} | {unmerged_s * 1e6:.1f} | "
                    f"{one_s * 1e6:.1f} | {plain_s * 1e6:.1f} | {one_s / ep_s:.2f}x |")
    fired(compiled_ep, "fuse_mxfp4_experts")
    fired(compiled_ep, "merge_all_to_all_dispatches")
    fired(compiled_ep, "read_all_to_all_splits_once")
    return rows


def ep_profile(compiled, x, device, rank: int, world: int) -> None:
    """Print the EP graph's collectives and host syncs (from its report) and torch.profiler's top ops over a few
    calls (rank 0's): where a call's time goes."""
    if world > 1:
        dist.barrier()
    graphs = compiled.report.graphs
    lowered = "\n".join(text for g in graphs for name, text in g.stages if name == "lowered")
    syncs = lowered.count("aten._local_scalar_dense.default(")
    if rank == 0:
        print(f"EP={world} graph: {lowered.count('_c10d_functional.all_to_all_single.default(')} all_to_all_single, "
              f"{syncs} values read back by the host (_local_scalar_dense) per call, through "
              f"{lowered.count('prims.device_put.default(') or syncs} device-to-host copies; host syncs: "
              f"{', '.join(h for g in graphs for h in g.host_syncs) or 'none'}", flush=True)
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            compiled(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if rank != 0:
        return
    averages = prof.key_averages()
    print(f"EP={world}, {x.shape[0]} tokens, 5 calls, by self CPU time:", flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    if device.type == "cuda":
        print(f"EP={world}, {x.shape[0]} tokens, 5 calls, by self device time:", flush=True)
        print(averages.table(sort_by="self_device_time_total", row_limit=15), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU with gloo (smoke test)")
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--out", help="append the tables to this markdown file (rank 0)")
    parser.add_argument("--no-tune", action="store_true", help="dzc's untuned default configs")
    parser.add_argument("--tables", default="norm,tp,ep",
                        help="which tables, comma-separated: norm (1), tp (2), ep (3); default all")
    args = parser.parse_args()
    tables = set(args.tables.split(","))
    if not tables <= {"norm", "tp", "ep"}:
        parser.error(f"--tables: {args.tables!r} is not a comma-separated choice of norm, tp, ep")

    sizes = QUICK if args.quick else FULL
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.quick or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    target = resolve_target(args.target)
    backend = distributed.backend_for(device, target.profile)
    if "MASTER_ADDR" not in os.environ:  # python tools/bench_distributed.py: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed.free_port()))
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh(device.type, (world,))
    group = dist.group.WORLD
    # The CPU interpreter would tune for minutes; on the GPU dzc tunes as users get it unless --no-tune.
    tuned = not (args.quick or args.no_tune)
    options = dzc.CompileOptions(autotune=tuned)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    emit(rank, args.out, f"## bench_distributed: world {world} ({backend}), {name}, torch {torch.__version__}, "
                         f"{datetime.date.today()}{' (--quick)' if args.quick else ''}, dzc "
                         f"{'tuned' if tuned else 'untuned defaults'}\n")
    if "norm" in tables:
        emit(rank, args.out, "| op | hidden | tokens | dzc parts (µs) | all-reduce + torch.compile add+norm (µs) | "
                             "speed-up | dzc one-shot fused (µs) | one-shot speed-up |",
             "|---|---|---|---|---|---|---|---|",
             *all_reduce_norm(sizes, options, args.target, device, group, rank), "")
    if "tp" in tables:
        emit(rank, args.out, "| layer | prefill tokens/s | step (µs) | prefill vs TP=1 | step vs TP=1 |",
             "|---|---|---|---|---|", *tp_layer(sizes, options, args.target, device, mesh, rank, world),
             *dsa_moe_layer(sizes, options, args.target, device, group, rank, world), "")
    if "ep" in tables:
        emit(rank, args.out, "| MoE | tokens per rank | EP layer (µs) | EP, fixed capacity (µs) | "
                             "EP, without the 2 EP passes (µs) | whole layer, one device (µs) | "
                             "the same without CUDA graphs (µs) | speed-up |",
             "|---|---|---|---|---|---|---|---|",
             *ep_layer(sizes, options, args.target, device, group, rank, world), "")
    dist.destroy_process_group()


def emit(rank: int, out: str | None, *lines: str) -> None:
    """Rank 0 prints a finished table (and appends it to --out) at once: a run cut short keeps what it measured."""
    if rank != 0:
        return
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
