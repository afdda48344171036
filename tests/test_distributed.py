"""Tensor and expert parallelism on 2 CPU ranks (gloo): sharded models compiled by dzc on each rank equal the
single-process eager model, keep their collectives, and get dzc's fusions on both ranks (from each rank's report).

One spawn runs every case (each rank pays Python + torch + dzc start-up once); the tests read what the ranks wrote.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
SEQS = (5, 7)  # two lengths: the second must reuse the first's graph
TOKENS_PER_RANK = (6, 9)


def _max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _summary(compiled, outputs, expected) -> dict:
    report = compiled.report
    return {"error": max(_max_relative_error(o, e) for o, e in zip(outputs, expected)),
            "passes": report.passes, "refusals": {k: [why for _, why in v] for k, v in report.refusals.items()},
            "graphs": len(report.graphs), "recompiles": sum(g.recompile for g in report.graphs),
            "breaks": sum(len(g.break_reasons) for g in report.graphs), "retries": report.capture_retries,
            "checks": [g.rewrite_check for g in report.graphs],
            "captured": "\n".join(text for g in report.graphs for name, text in g.stages if name == "capture"),
            "lowered": "\n".join(text for g in report.graphs for name, text in g.stages if name == "lowered")}


class _SharedPartial(nn.Module):
    """A row-parallel partial sum whose all-reduced value has a second use: the fusion must refuse."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 0.1 + 1)

    def forward(self, partial, residual):
        import torch.distributed._functional_collectives as funcol

        reduced = funcol.all_reduce(partial, "sum", dist.group.WORLD)
        h = residual + reduced
        v = h.float()
        return self.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), reduced * 2


def _prefill_then_decode(whole, compiled, new_session, hidden: int, seed: int) -> dict:
    """A prefill of 11 tokens then a decode step for 2 sequences, the whole layer eagerly and the compiled
    shard each over its own session's paged cache; the compiled run's _summary against the eager one."""
    eager, fused = new_session(), new_session()
    outputs, expected = [], []
    for seq in (11, 1):
        x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(seed + seq))
        with torch.no_grad():
            expected.append(eager.step(whole, x))
            outputs.append(fused.step(compiled, x))
    return _summary(compiled, outputs, expected)


def _ranks(rank: int, world: int, out_dir: str) -> None:
    import dzc
    from dzc import distributed
    from dzc.models import distributed as sharded
    from dzc.models.moe import build_moe
    from torch.distributed.device_mesh import init_device_mesh

    options = dzc.CompileOptions(autotune=False)
    results = {}
    sizes = dict(hidden=32, heads=2, intermediate=64, layers=1, vocab=64)
    tokens = [torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seq)) for seq in SEQS]
    reference = sharded.build_tp_decoder(**sizes)
    with torch.no_grad():
        expected = [reference(t) for t in tokens]

    # TP the standard ways: DTensor's parallel styles, and the same shards written with functional collectives.
    mesh = init_device_mesh("cpu", (world,))
    for name, model in (("dtensor", sharded.parallelize(sharded.build_tp_decoder(**sizes), mesh)),
                        ("functional", sharded.shard_by_hand(sharded.build_tp_decoder(**sizes), rank, world,
                                                                 dist.group.WORLD))):
        compiled = dzc.compile(model, target="cuda", options=options)
        results[name] = _summary(compiled, [compiled(t) for t in tokens], expected)

    # DSA under TP: half the MLA heads on each rank, indexer and latent cache replicated (DeepSeek-V3.2's way);
    # a ragged prefill then a decode step over each rank's paged cache, against the whole layer run eagerly.
    from dzc.kv_cache import PagedKVCache
    from dzc.models.dsa import TINY_DSA, DSASession, build_dsa_attention

    # With the indexer's heads split too, its partial scores are all-reduced before the top-k.
    layer = build_dsa_attention(dtype=torch.float32)
    for name, shard_indexer in (("dsa", False), ("dsa_sharded_indexer", True)):
        model = sharded.shard_dsa_attention(build_dsa_attention(dtype=torch.float32), rank, world, dist.group.WORLD,
                                            shard_indexer)
        compiled = dzc.compile(model, target="cuda", options=options)
        results[name] = _prefill_then_decode(
            layer, compiled, lambda: DSASession(PagedKVCache(TINY_DSA.cache_config(), 8, 2, fp8_index=True,
                                                             latent_dtype=torch.float32)), TINY_DSA.hidden, 30)

    # The DSA + MoE decoder layer under TP: attention heads split, experts split, each rank routing a share of the
    # tokens; a prefill then a decode step over each rank's cache, against the whole layer run eagerly.
    from dzc.models.multimodal import CONFIGS, build_multimodal, new_cache

    cfg = CONFIGS["tiny"]
    whole = build_multimodal(cfg, torch.float32).language.layers[0]
    compiled = dzc.compile(sharded.TensorParallelDecoderLayer(whole, rank, world, dist.group.WORLD), target="cuda",
                           options=options)
    results["decoder_layer"] = _prefill_then_decode(
        whole, compiled, lambda: DSASession(new_cache(cfg, 8, 2, fp8_index=True, dtype=torch.float32)), cfg.hidden, 40)

    # EP: each rank routes its own tokens; experts 0-1 on rank 0, 2-3 on rank 1.
    block = build_moe("tiny-gptoss")
    layer = sharded.ExpertParallelMoE(block, rank, world, dist.group.WORLD)
    compiled = dzc.compile(layer, target="cuda", options=options)
    # The same layer with its all_to_alls and split reads left as the model wrote them: the rewritten run must give
    # the same result to the bit.
    unmerged = dzc.compile(layer, target="cuda", options=dzc.CompileOptions(
        autotune=False, disable_passes=("merge_all_to_all_dispatches", "read_all_to_all_splits_once")))
    outputs, expected, same = [], [], []
    for count in TOKENS_PER_RANK:
        x = torch.randn(world * count, block.cfg.hidden, generator=torch.Generator().manual_seed(count)).bfloat16()
        with torch.no_grad():
            expected.append(block(x)[rank * count:(rank + 1) * count])
        outputs.append(compiled(x[rank * count:(rank + 1) * count]))
        same.append(torch.equal(outputs[-1], unmerged(x[rank * count:(rank + 1) * count])))
    results["expert_parallel"] = dict(_summary(compiled, outputs, expected), same_as_unmerged=same,
                                      unmerged=_summary(unmerged, outputs, expected))

    # Refusal: the all-reduced value is used again after the add.
    partial = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 + rank))
    residual = torch.randn(4, 32, generator=torch.Generator().manual_seed(20))
    shared = _SharedPartial(32)
    compiled = dzc.compile(shared, target="cuda", options=options)
    results["refusal"] = _summary(compiled, list(compiled(partial, residual)), list(shared.forward(partial, residual)))

    # The rewrite check's agreement over a graph's group: a flag raised on one rank is seen on both; over two
    # groups there is none.
    def communicating(*groups):
        graph = torch.fx.Graph()
        value = graph.placeholder("x")
        for group in groups:
            value = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (value, "sum", group))
        graph.output(value)
        return graph

    any_rank, _ = distributed.rank_agreement(communicating(dist.group.WORLD.group_name), "cpu")
    second = dist.new_group(list(range(world)))
    none, why = distributed.rank_agreement(communicating(dist.group.WORLD.group_name, second.group_name), "cpu")
    results["agreement"] = {"flag": any_rank(rank == 1), "no_flag": any_rank(False), "two_groups": [none, why]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from dzc import distributed

    out = tmp_path_factory.mktemp("ranks")
    distributed.spawn_ranks(_ranks, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("style", ["dtensor", "functional"])
def test_tensor_parallel_decoder_matches_single_process_eager(ranks, style):
    for rank, results in enumerate(ranks):
        case = results[style]
        assert case["error"] < 1e-4, (rank, case["error"])
        # The collectives stay in the graph; one graph for both lengths on each rank.
        assert "_c10d_functional.all_reduce" in case["captured"] and "_c10d_functional.wait_tensor" in case["captured"]
        assert (case["graphs"], case["recompiles"], case["breaks"], case["retries"]) == (1, 0, 0, [])
        # One layer: attention's o and the MLP's down projection end in an all-reduce, each read by a residual add
        # + RMSNorm: both fused on each rank, lowered as the all-reduce + dzc's add_rms_norm kernel.
        assert case["passes"]["fuse_residual_norm"] == 2
        assert case["passes"]["fuse_all_reduce_residual_norm"] == 2, case["refusals"]
        assert case["lowered"].count("_c10d_functional.all_reduce.default") == 2
        assert case["lowered"].count("dzc.add_rms_norm.default") == 2
        # The rewrite check ran the graph twice on both ranks, in step (its collectives matched), and passed.
        assert [c.split(" ")[0] for c in case["checks"]] == ["passed"], case["checks"]


@pytest.mark.parametrize("case_name", ["dsa", "dsa_sharded_indexer"])
def test_tensor_parallel_dsa_attention_matches_the_whole_layer(ranks, case_name):
    for rank, results in enumerate(ranks):
        case = results[case_name]
        assert case["error"] < 1e-4, (rank, case["error"])
        assert "_c10d_functional.all_reduce" in case["captured"] and (case["breaks"], case["retries"]) == (0, [])
        # Every graph (prefill, decode) of every rank fuses its indexer, top-k and attention over its own heads.
        assert case["passes"]["fuse_sparse_attention"] == case["graphs"] >= 1, case["refusals"]
        assert "dzc.sparse_attention.default" in case["lowered"] and "dzc.dsa_indexer.default" in case["lowered"]
        # The output projection's all-reduce, and the index scores' when the indexer's heads are split: after
        # the fused indexer, before the top-k.
        reductions = case["lowered"].count("_c10d_functional.all_reduce.default")
        assert reductions == case["graphs"] * (2 if case_name == "dsa_sharded_indexer" else 1), case["lowered"]
        if case_name == "dsa_sharded_indexer":  # (first occurrences: the first graph's)
            lowered = case["lowered"]
            assert lowered.index("dzc.dsa_indexer.default") < lowered.index("_c10d_functional.all_reduce.default") \
                < lowered.index("aten.topk.default")


def test_tensor_parallel_dsa_moe_decoder_layer_matches_the_whole_layer(ranks):
    for rank, results in enumerate(ranks):
        case = results["decoder_layer"]
        assert case["error"] < 1e-4, (rank, case["error"])
        assert (case["breaks"], case["retries"]) == (0, [])
        for collective in ("all_reduce", "all_to_all_single"):
            assert f"_c10d_functional.{collective}" in case["captured"], collective
        # Per graph (prefill, decode) on every rank: the attention over this rank's heads, its local experts, and
        # the attention output's all-reduce with the residual add + post-attention norm.
        fired = case["passes"]
        assert fired["fuse_sparse_attention"] == fired["fuse_mxfp4_experts"] == case["graphs"] >= 1, case["refusals"]
        assert fired["fuse_all_reduce_residual_norm"] == case["graphs"], case["refusals"]
        assert fired["merge_all_to_all_dispatches"] == case["graphs"], case["refusals"]
        for op in ("sparse_attention", "mxfp4_moe", "add_rms_norm"):
            assert f"dzc.{op}.default" in case["lowered"], op


def test_expert_parallel_moe_matches_single_device_layer(ranks):
    for rank, results in enumerate(ranks):
        case = results["expert_parallel"]
        # bf16 output; the fused kernel sums a token's slots in fp32, the reference per expert in bf16.
        assert case["error"] < 2 ** -6, (rank, case["error"])
        assert "_c10d_functional.all_to_all_single" in case["captured"]
        assert (case["breaks"], case["retries"]) == (0, [])
        # The local experts (a per-expert loop over this rank's experts) fuse into dzc.mxfp4_moe on every graph.
        assert case["passes"]["fuse_mxfp4_experts"] == case["graphs"] >= 1, case["refusals"]
        assert "dzc.mxfp4_moe.default" in case["lowered"]
        # The dispatch's three all_to_alls (rows, expert ids, routing weights: the same splits) are one call of
        # their bytes: the counts', the dispatch's and the combine's remain, and the result is the same to the bit.
        assert case["passes"]["merge_all_to_all_dispatches"] == case["graphs"], case["refusals"]
        calls = "_c10d_functional.all_to_all_single.default("
        assert case["lowered"].count(calls) == 3 * case["graphs"], case["lowered"]
        assert case["unmerged"]["lowered"].count(calls) == 5 * case["unmerged"]["graphs"]
        # The 2 x world split sizes (send.tolist(), receive.tolist()) are read from one copy to the host.
        assert case["passes"]["read_all_to_all_splits_once"] == case["graphs"], case["refusals"]
        reads = "aten._local_scalar_dense.default("
        assert case["lowered"].count("prims.device_put.default(") == case["graphs"], case["lowered"]
        assert case["lowered"].count(reads) == case["unmerged"]["lowered"].count(reads) == 2 * WORLD * case["graphs"]
        assert case["same_as_unmerged"] == [True] * len(TOKENS_PER_RANK)


def test_all_reduce_with_another_use_is_refused(ranks):
    for results in ranks:
        case = results["refusal"]
        assert case["error"] < 1e-5
        assert case["passes"]["fuse_residual_norm"] == 1 and case["passes"]["fuse_all_reduce_residual_norm"] == 0
        assert any("another use" in why for why in case["refusals"]["fuse_all_reduce_residual_norm"])


def test_rank_agreement_is_the_same_on_every_rank(ranks):
    assert [(r["agreement"]["flag"], r["agreement"]["no_flag"]) for r in ranks] == [(True, False)] * WORLD
    assert all(r["agreement"]["two_groups"][0] is None and "2 process groups" in r["agreement"]["two_groups"][1]
               for r in ranks)


def test_all_reduce_add_rms_norm_reference_is_the_reduce_then_the_add_norm():
    """In one process (a gloo group of one): the op's reference = the functional all-reduce, then add_rms_norm's
    reference; the op lowered into parts gives the same."""
    from dzc import distributed
    from dzc.ops import add_rms_norm_reference, all_reduce_add_rms_norm_reference

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0,
                                world_size=1)
    try:
        generator = torch.Generator().manual_seed(0)
        x, residual = (torch.randn(5, 32, generator=generator).bfloat16() for _ in range(2))
        weight = torch.randn(32, generator=generator).bfloat16()
        args = (weight, 1e-6, False, True, torch.bfloat16, torch.bfloat16, torch.float32, False)
        group = dist.group.WORLD.group_name
        y, h = torch.ops.dzc.all_reduce_add_rms_norm(x, residual, *args, group)
        y_ref, h_ref = add_rms_norm_reference(x, residual, *args)
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
        assert all(torch.equal(a, b) for a, b in zip(all_reduce_add_rms_norm_reference(x, residual, *args, group),
                                                     (y, h)))
    finally:
        if own_group:
            dist.destroy_process_group()


def test_dump_tp_needs_a_tp_plan(capsys):
    from dzc import dump

    assert dump.main(["llama_decoder", "--tp", "2"]) == 2
    assert "has no tp_plan" in capsys.readouterr().err


def _gpu_ranks(rank: int, world: int, out_dir: str) -> None:
    """One rank per GPU (NCCL): the DTensor-sharded decoder under dzc with its defaults (tuning, the rewrite check,
    CUDA graphs for <= 256 tokens), against the unsharded eager model on the same GPU, over decode-sized calls
    (warm-up, capture, replays: the all-reduces inside a captured CUDA graph) and a prefill-sized one."""
    import dzc
    from dzc.models import distributed as sharded
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank)
    sizes = dict(hidden=256, heads=4, intermediate=512, layers=2, vocab=256)
    reference = sharded.build_tp_decoder(torch.bfloat16, **sizes).to(device)
    model = sharded.parallelize(sharded.build_tp_decoder(torch.bfloat16, **sizes).to(device),
                                    init_device_mesh("cuda", (world,)))
    compiled = dzc.compile(model, target="cuda")
    errors = []
    for step, seq in enumerate([1] * 5 + [300]):
        tokens = torch.randint(0, sizes["vocab"], (1, seq), device=device,
                               generator=torch.Generator(device=device).manual_seed(step))
        with torch.no_grad():
            errors.append(_max_relative_error(compiled(tokens), reference(tokens)))
    results = {"errors": errors, "passes": compiled.report.passes, "checks": [g.rewrite_check
                                                                              for g in compiled.report.graphs],
               "cuda_graphs": compiled._cuda_graphs.describe()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_on_two_gpus(tmp_path):
    from dzc import distributed

    distributed.spawn_ranks(_gpu_ranks, WORLD, str(tmp_path), backend="nccl")
    for rank in range(WORLD):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(results["errors"]) < 2 ** -5, (rank, results)
        assert results["passes"]["fuse_all_reduce_residual_norm"] == 4, results
        assert all(c.startswith("passed") or c.startswith("skipped") for c in results["checks"]), results
        print(f"rank {rank}: {results}")
