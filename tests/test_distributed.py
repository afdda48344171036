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


class _UnmergeableExchange(nn.Module):
    """Exchanges the EP passes must leave alone, each with its reason: split sizes read from an i64 and an i32
    tensor (read_all_to_all_splits_once: one copy needs one dtype) and from 0-D sums; two calls with the same
    splits where the second's input needs the first's result, and a third over another group
    (merge_all_to_all_dispatches); and a host read that is no split size (not the pass's: left as it is)."""

    def __init__(self, other_group):
        super().__init__()
        self.other_group = other_group

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        group = dist.group.WORLD
        owner = (x[:, 0] > 0).long()
        order = torch.argsort(owner, stable=True)
        x, owner = x[order], owner[order]
        send = (owner[:, None] == torch.arange(WORLD)).sum(0)
        receive = funcol.all_to_all_single(send.int(), None, None, group)
        send_splits, receive_splits = send.tolist(), receive.tolist()
        rows = funcol.all_to_all_single(x, receive_splits, send_splits, group)
        again = funcol.all_to_all_single(x * rows.sum(), receive_splits, send_splits, group)
        other = funcol.all_to_all_single(x + 1, receive_splits, send_splits, self.other_group)
        counted = [(owner == r).sum().item() for r in range(WORLD)]
        alone = funcol.all_to_all_single(x - 1, receive_splits, counted, group)
        return rows + again + other * owner.sum().item() + alone


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


def _ep_stages(compiled) -> list:
    """[name, text] of the first graph's stage before merge_all_to_all_dispatches, its own and the next
    (read_all_to_all_splits_once)."""
    stages = compiled.report.graphs[0].stages
    at = [name for name, _ in stages].index("merge_all_to_all_dispatches")
    return [list(stage) for stage in stages[at - 1:at + 2]]


def _pad_stages(compiled) -> list:
    """[name, text] of the first graph's stages read_all_to_all_splits_once and pad_all_to_all_to_capacity."""
    stages = compiled.report.graphs[0].stages
    at = [name for name, _ in stages].index("pad_all_to_all_to_capacity")
    return [list(stage) for stage in stages[at - 1:at + 1]]


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
    outputs, expected, same, inputs = [], [], [], []
    for count in TOKENS_PER_RANK:
        x = torch.randn(world * count, block.cfg.hidden, generator=torch.Generator().manual_seed(count)).bfloat16()
        inputs.append(x)
        with torch.no_grad():
            expected.append(block(x)[rank * count:(rank + 1) * count])
        outputs.append(compiled(x[rank * count:(rank + 1) * count]))
        same.append(torch.equal(outputs[-1], unmerged(x[rank * count:(rank + 1) * count])))
    results["expert_parallel"] = dict(_summary(compiled, outputs, expected), same_as_unmerged=same,
                                      unmerged=_summary(unmerged, outputs, expected), stages=_ep_stages(compiled))

    # The same layer with a declared capacity, the most rows (tokens x top_k) a rank sends here: chunks of 18 rows
    # per peer, no split read back; then a call of 10 tokens per rank (20 rows) on both ranks.
    capacity = block.cfg.top_k * max(TOKENS_PER_RANK)
    padded = dzc.compile(layer, target="cuda", options=dzc.CompileOptions(autotune=False,
                                                                          ep_max_dispatch_rows=capacity))
    padded_outputs = [padded(x[rank * count:(rank + 1) * count]) for count, x in zip(TOKENS_PER_RANK, inputs)]
    try:
        padded(torch.randn(max(TOKENS_PER_RANK) + 1, block.cfg.hidden).bfloat16())
        over = ""
    except RuntimeError as error:
        over = str(error)
    results["expert_parallel_capacity"] = dict(
        _summary(padded, padded_outputs, expected), stages=_pad_stages(padded), over_capacity=over,
        host_syncs=[g.host_syncs for g in padded.report.graphs])

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

    # The EP passes' refusals: exchanges they must leave alone (each rank sends a share of its 7 rows).
    model = _UnmergeableExchange(second)
    compiled = dzc.compile(model, target="cuda", options=options)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(50 + rank))
    output = compiled(x)
    results["ep_refusals"] = dict(_summary(compiled, [output], [model(x)]), same=torch.equal(output, model(x)),
                                  stages=_ep_stages(compiled))
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


def _body(text: str) -> list[str]:
    """A stage's graph lines, its '# built by' header left off."""
    return text.splitlines()[1:]


def _split_reads(text: str) -> str:
    """A stage's lines from the counts' exchange (the first all_to_all_single) through the last checked read: where
    read_all_to_all_splits_once rewrites."""
    lines = _body(text)
    first = next(i for i, line in enumerate(lines) if "all_to_all_single" in line)
    last = max(i for i, line in enumerate(lines) if "_assert_scalar" in line)
    return "\n".join(lines[first:last + 1]) + "\n"


def _dispatch(text: str) -> str:
    """A stage's lines after the last checked read through the combine's wait (the last wait_tensor): where
    merge_all_to_all_dispatches rewrites."""
    lines = _body(text)
    first = max(i for i, line in enumerate(lines) if "_assert_scalar" in line) + 1
    last = max(i for i, line in enumerate(lines) if "wait_tensor" in line)
    return "\n".join(lines[first:last + 1]) + "\n"


def _renamed(text: str) -> str:
    """`text` with its graph inputs and size symbols renumbered in order of first appearance (rank 1's graph has
    one more input, its tokens being a view at an offset, so its numbers differ from rank 0's)."""
    import re

    def renumbered(text: str, pattern: str, prefix: str) -> str:
        names: dict = {}
        return re.sub(pattern, lambda m: names.setdefault(m.group(0), f"{prefix}{len(names)}"), text)

    return renumbered(renumbered(text, r"%a\d+\b", "%a#"), r"\bs\d+\b", "s#")


# The EP layer's graph on rank 0 where each EP pass rewrites, before and after it; rank 1's has the same lines but
# for its inputs' and symbols' numbers and its first expert ({first}: 0 or 2). Long lines go on after a backslash.
_DISPATCH_BEFORE_MERGE = """\
  %46 = aten.div.Tensor_mode(%16, 2, rounding_mode='floor')  # i64[2*s0]
  %47 = aten.index.Tensor(%a3, [%46])  # bf16[2*s0, 64]
  %48 = _c10d_functional.all_to_all_single.default(%47, [%39, %43], [%27, %31], '0')  # bf16[s3 + s4, 64]
  %49 = _c10d_functional.wait_tensor.default(%48)  # bf16[s3 + s4, 64]
  %50 = _c10d_functional.all_to_all_single.default(%17, [%39, %43], [%27, %31], '0')  # i64[s3 + s4]
  %51 = _c10d_functional.wait_tensor.default(%50)  # i64[s3 + s4]
  %52 = aten.sub.Tensor(%51, {first})  # i64[s3 + s4]
  %53 = aten.view.default(%13, [-1])  # bf16[2*s0]
  %54 = aten.index.Tensor(%53, [%16])  # bf16[2*s0]
  %55 = _c10d_functional.all_to_all_single.default(%54, [%39, %43], [%27, %31], '0')  # bf16[s3 + s4]
  %56 = _c10d_functional.wait_tensor.default(%55)  # bf16[s3 + s4]
  %57 = aten.slice.Tensor(%52, 0, 0, 9223372036854775807)  # i64[s3 + s4]
  %58 = aten.unsqueeze.default(%57, 1)  # i64[s3 + s4, 1]
  %59 = aten.slice.Tensor(%56, 0, 0, 9223372036854775807)  # bf16[s3 + s4]
  %60 = aten.unsqueeze.default(%59, 1)  # bf16[s3 + s4, 1]
  %61 = dzc.mxfp4_moe.default(%49, %58, %60, %a4, %a5, %a8, %a6, %a7, %a9, 'clamped_swiglu', True, 1.702, 7.0)  # \
bf16[s3 + s4, 64]
  %62 = _c10d_functional.all_to_all_single.default(%61, [%27, %31], [%39, %43], '0')  # bf16[s1 + s2, 64]
  %63 = _c10d_functional.wait_tensor.default(%62)  # bf16[s1 + s2, 64]
"""

_DISPATCH_MERGED = """\
  %46 = aten.div.Tensor_mode(%16, 2, rounding_mode='floor')  # i64[2*s0]
  %47 = aten.index.Tensor(%a3, [%46])  # bf16[2*s0, 64]
  %48 = aten.view.default(%13, [-1])  # bf16[2*s0]
  %49 = aten.index.Tensor(%48, [%16])  # bf16[2*s0]
  %50 = aten.view.dtype(%17, bf16)  # bf16[8*s0]
  %51 = aten.view.default(%50, [-1, 4])  # bf16[2*s0, 4]
  %52 = aten.unsqueeze.default(%49, 1)  # bf16[2*s0, 1]
  %53 = aten.cat.default([%51, %47, %52], 1)  # bf16[2*s0, 69]
  %54 = aten.constant_pad_nd.default(%53, [0, 3], 0.0)  # bf16[2*s0, 72]
  %55 = _c10d_functional.all_to_all_single.default(%54, [%39, %43], [%27, %31], '0')  # bf16[s3 + s4, 72]
  %56 = _c10d_functional.wait_tensor.default(%55)  # bf16[s3 + s4, 72]
  %57 = aten.slice.Tensor(%56, 1, 0, 4)  # bf16[s3 + s4, 4]
  %58 = aten.view.dtype(%57, i64)  # i64[s3 + s4, 1]
  %59 = aten.select.int(%58, 1, 0)  # i64[s3 + s4]
  %60 = aten.slice.Tensor(%56, 1, 4, 68)  # bf16[s3 + s4, 64]
  %61 = aten.slice.Tensor(%56, 1, 68, 69)  # bf16[s3 + s4, 1]
  %62 = aten.select.int(%61, 1, 0)  # bf16[s3 + s4]
  %63 = aten.sub.Tensor(%59, {first})  # i64[s3 + s4]
  %64 = aten.slice.Tensor(%63, 0, 0, 9223372036854775807)  # i64[s3 + s4]
  %65 = aten.unsqueeze.default(%64, 1)  # i64[s3 + s4, 1]
  %66 = aten.slice.Tensor(%62, 0, 0, 9223372036854775807)  # bf16[s3 + s4]
  %67 = aten.unsqueeze.default(%66, 1)  # bf16[s3 + s4, 1]
  %68 = dzc.mxfp4_moe.default(%60, %65, %67, %a4, %a5, %a8, %a6, %a7, %a9, 'clamped_swiglu', True, 1.702, 7.0)  # \
bf16[s3 + s4, 64]
  %69 = _c10d_functional.all_to_all_single.default(%68, [%27, %31], [%39, %43], '0')  # bf16[s1 + s2, 64]
  %70 = _c10d_functional.wait_tensor.default(%69)  # bf16[s1 + s2, 64]
"""

_SPLIT_READS_BEFORE = """\
  %24 = _c10d_functional.all_to_all_single.default(%23, [1, 1], [1, 1], '0')  # i64[2]
  %25 = _c10d_functional.wait_tensor.default(%24)  # i64[2]
  %26 = aten.select.int(%23, 0, 0)  # i64[]
  %27 = aten._local_scalar_dense.default(%26)  # sym s1
  %28 = ge(%27, 0)  # SymBool
  %29 = aten._assert_scalar.default(%28, "Runtime assertion failed for expression u0 >= 0 on node 'ge'")  # NoneType
  %30 = aten.select.int(%23, 0, 1)  # i64[]
  %31 = aten._local_scalar_dense.default(%30)  # sym s2
  %32 = ge(%31, 0)  # SymBool
  %33 = aten._assert_scalar.default(%32, "Runtime assertion failed for expression u1 >= 0 on node 'ge_1'")  # NoneType
  %34 = sym_sum((%27, %31))  # sym s1 + s2
  %35 = mul(2, %a2)  # sym 2*s0
  %36 = eq(%34, %35)  # SymBool
  %37 = aten._assert_scalar.default(%36, "Runtime assertion failed for expression Eq(u0 + u1, 2*s77) on node 'eq_3'") \
 # NoneType
  %38 = aten.select.int(%25, 0, 0)  # i64[]
  %39 = aten._local_scalar_dense.default(%38)  # sym s3
  %40 = ge(%39, 0)  # SymBool
  %41 = aten._assert_scalar.default(%40, "Runtime assertion failed for expression u2 >= 0 on node 'ge_2'")  # NoneType
  %42 = aten.select.int(%25, 0, 1)  # i64[]
  %43 = aten._local_scalar_dense.default(%42)  # sym s4
  %44 = ge(%43, 0)  # SymBool
  %45 = aten._assert_scalar.default(%44, "Runtime assertion failed for expression u3 >= 0 on node 'ge_3'")  # NoneType
"""

_SPLIT_READS_ONCE = """\
  %24 = _c10d_functional.all_to_all_single.default(%23, [1, 1], [1, 1], '0')  # i64[2]
  %25 = _c10d_functional.wait_tensor.default(%24)  # i64[2]
  %26 = aten.cat.default([%23, %25])  # i64[4]
  %27 = prims.device_put.default(%26, 'cpu')  # i64[4]
  %28 = aten.select.int(%27, 0, 0)  # i64[]
  %29 = aten.select.int(%27, 0, 1)  # i64[]
  %30 = aten.select.int(%27, 0, 2)  # i64[]
  %31 = aten.select.int(%27, 0, 3)  # i64[]
  %32 = aten._local_scalar_dense.default(%28)  # sym s1
  %33 = ge(%32, 0)  # SymBool
  %34 = aten._assert_scalar.default(%33, "Runtime assertion failed for expression u0 >= 0 on node 'ge'")  # NoneType
  %35 = aten._local_scalar_dense.default(%29)  # sym s2
  %36 = ge(%35, 0)  # SymBool
  %37 = aten._assert_scalar.default(%36, "Runtime assertion failed for expression u1 >= 0 on node 'ge_1'")  # NoneType
  %38 = sym_sum((%32, %35))  # sym s1 + s2
  %39 = mul(2, %a2)  # sym 2*s0
  %40 = eq(%38, %39)  # SymBool
  %41 = aten._assert_scalar.default(%40, "Runtime assertion failed for expression Eq(u0 + u1, 2*s77) on node 'eq_3'") \
 # NoneType
  %42 = aten._local_scalar_dense.default(%30)  # sym s3
  %43 = ge(%42, 0)  # SymBool
  %44 = aten._assert_scalar.default(%43, "Runtime assertion failed for expression u2 >= 0 on node 'ge_2'")  # NoneType
  %45 = aten._local_scalar_dense.default(%31)  # sym s4
  %46 = ge(%45, 0)  # SymBool
  %47 = aten._assert_scalar.default(%46, "Runtime assertion failed for expression u3 >= 0 on node 'ge_3'")  # NoneType
"""


# The same layer compiled with ep_max_dispatch_rows=18: the dispatch as read_all_to_all_splits_once leaves it
# (its split reads are _SPLIT_READS_ONCE), and from the counts' exchange to the combine's rows back in place after
# pad_all_to_all_to_capacity.
_DISPATCH_BEFORE_PADDING = """\
  %48 = aten.div.Tensor_mode(%16, 2, rounding_mode='floor')  # i64[2*s0]
  %49 = aten.index.Tensor(%a3, [%48])  # bf16[2*s0, 64]
  %50 = aten.view.default(%13, [-1])  # bf16[2*s0]
  %51 = aten.index.Tensor(%50, [%16])  # bf16[2*s0]
  %52 = aten.view.dtype(%17, bf16)  # bf16[8*s0]
  %53 = aten.view.default(%52, [-1, 4])  # bf16[2*s0, 4]
  %54 = aten.unsqueeze.default(%51, 1)  # bf16[2*s0, 1]
  %55 = aten.cat.default([%53, %49, %54], 1)  # bf16[2*s0, 69]
  %56 = aten.constant_pad_nd.default(%55, [0, 3], 0.0)  # bf16[2*s0, 72]
  %57 = _c10d_functional.all_to_all_single.default(%56, [%42, %45], [%32, %35], '0')  # bf16[s3 + s4, 72]
  %58 = _c10d_functional.wait_tensor.default(%57)  # bf16[s3 + s4, 72]
  %59 = aten.slice.Tensor(%58, 1, 0, 4)  # bf16[s3 + s4, 4]
  %60 = aten.view.dtype(%59, i64)  # i64[s3 + s4, 1]
  %61 = aten.select.int(%60, 1, 0)  # i64[s3 + s4]
  %62 = aten.slice.Tensor(%58, 1, 4, 68)  # bf16[s3 + s4, 64]
  %63 = aten.slice.Tensor(%58, 1, 68, 69)  # bf16[s3 + s4, 1]
  %64 = aten.select.int(%63, 1, 0)  # bf16[s3 + s4]
  %65 = aten.sub.Tensor(%61, {first})  # i64[s3 + s4]
  %66 = aten.slice.Tensor(%65, 0, 0, 9223372036854775807)  # i64[s3 + s4]
  %67 = aten.unsqueeze.default(%66, 1)  # i64[s3 + s4, 1]
  %68 = aten.slice.Tensor(%64, 0, 0, 9223372036854775807)  # bf16[s3 + s4]
  %69 = aten.unsqueeze.default(%68, 1)  # bf16[s3 + s4, 1]
  %70 = dzc.mxfp4_moe.default(%62, %67, %69, %a4, %a5, %a8, %a6, %a7, %a9, 'clamped_swiglu', True, 1.702, 7.0)  # \
bf16[s3 + s4, 64]
  %71 = _c10d_functional.all_to_all_single.default(%70, [%32, %35], [%42, %45], '0')  # bf16[s1 + s2, 64]
  %72 = _c10d_functional.wait_tensor.default(%71)  # bf16[s1 + s2, 64]
"""

_PADDED = """\
  %24 = _c10d_functional.all_to_all_single.default(%23, [1, 1], [1, 1], '0')  # i64[2]
  %25 = _c10d_functional.wait_tensor.default(%24)  # i64[2]
  %26 = aten.div.Tensor_mode(%16, 2, rounding_mode='floor')  # i64[2*s0]
  %27 = aten.index.Tensor(%a3, [%26])  # bf16[2*s0, 64]
  %28 = aten.view.default(%13, [-1])  # bf16[2*s0]
  %29 = aten.index.Tensor(%28, [%16])  # bf16[2*s0]
  %30 = aten.view.dtype(%17, bf16)  # bf16[8*s0]
  %31 = aten.view.default(%30, [-1, 4])  # bf16[2*s0, 4]
  %32 = aten.unsqueeze.default(%29, 1)  # bf16[2*s0, 1]
  %33 = aten.cat.default([%31, %27, %32], 1)  # bf16[2*s0, 69]
  %34 = aten.constant_pad_nd.default(%33, [0, 3], 0.0)  # bf16[2*s0, 72]
  %35 = aten.sym_size.int(%34, 0)  # sym 2*s0
  %36 = le(%35, 18)  # SymBool
  %37 = aten._assert_scalar.default(%36, 'dzc: more rows to dispatch than CompileOptions.ep_max_dispatch_rows = 18 \
(the most rows, tokens x top_k, a rank may send in one expert-parallel dispatch)')  # NoneType
  %38 = prims.iota.default(%35, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[2*s0]
  %39 = aten.cumsum.default(%23, 0)  # i64[2]
  %40 = aten.sub.Tensor(%39, %23)  # i64[2]
  %41 = aten.unsqueeze.default(%38, 1)  # i64[2*s0, 1]
  %42 = aten.ge.Tensor(%41, %39)  # bool[2*s0, 2]
  %43 = aten.sum.dim_IntList(%42, [1])  # i64[2*s0]
  %44 = aten.index.Tensor(%40, [%43])  # i64[2*s0]
  %45 = aten.sub.Tensor(%38, %44)  # i64[2*s0]
  %46 = aten.mul.Tensor(%43, 18)  # i64[2*s0]
  %47 = aten.add.Tensor(%46, %45)  # i64[2*s0]
  %48 = aten.full.default([36, 72], 0, device='cpu', dtype=bf16, layout=torch.strided, pin_memory=False)  # \
bf16[36, 72]
  %49 = aten.index_put.default(%48, [%47], %34)  # bf16[36, 72]
  %50 = _c10d_functional.all_to_all_single.default(%49, [18, 18], [18, 18], '0')  # bf16[36, 72]
  %51 = _c10d_functional.wait_tensor.default(%50)  # bf16[36, 72]
  %52 = prims.iota.default(18, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[18]
  %53 = aten.unsqueeze.default(%25, 1)  # i64[2, 1]
  %54 = aten.lt.Tensor(%52, %53)  # bool[2, 18]
  %55 = aten.view.default(%54, [36, 1])  # bool[36, 1]
  %56 = aten.slice.Tensor(%51, 1, 0, 4)  # bf16[36, 4]
  %57 = aten.view.dtype(%56, i64)  # i64[36, 1]
  %58 = aten.select.int(%57, 1, 0)  # i64[36]
  %59 = aten.slice.Tensor(%51, 1, 4, 68)  # bf16[36, 64]
  %60 = aten.slice.Tensor(%51, 1, 68, 69)  # bf16[36, 1]
  %61 = aten.select.int(%60, 1, 0)  # bf16[36]
  %62 = aten.sub.Tensor(%58, {first})  # i64[36]
  %63 = aten.slice.Tensor(%62, 0, 0, 9223372036854775807)  # i64[36]
  %64 = aten.unsqueeze.default(%63, 1)  # i64[36, 1]
  %65 = aten.slice.Tensor(%61, 0, 0, 9223372036854775807)  # bf16[36]
  %66 = aten.unsqueeze.default(%65, 1)  # bf16[36, 1]
  %67 = aten.mul.Tensor(%64, %55)  # i64[36, 1]
  %68 = aten.mul.Tensor(%66, %55)  # bf16[36, 1]
  %69 = dzc.mxfp4_moe.default(%59, %67, %68, %a4, %a5, %a8, %a6, %a7, %a9, 'clamped_swiglu', True, 1.702, 7.0)  # \
bf16[36, 64]
  %70 = _c10d_functional.all_to_all_single.default(%69, [18, 18], [18, 18], '0')  # bf16[36, 64]
  %71 = _c10d_functional.wait_tensor.default(%70)  # bf16[36, 64]
  %72 = aten.index.Tensor(%71, [%47])  # bf16[2*s0, 64]
"""


@pytest.mark.parametrize("pass_name, window, before, after", [
    ("merge_all_to_all_dispatches", _dispatch, _DISPATCH_BEFORE_MERGE, _DISPATCH_MERGED),
    ("read_all_to_all_splits_once", _split_reads, _SPLIT_READS_BEFORE, _SPLIT_READS_ONCE)])
def test_golden_expert_parallel_passes(ranks, pass_name, window, before, after):
    """The dispatch's rows, expert ids and routing weights packed into one all_to_all (the ids bit-cast to bf16,
    the row padded to a multiple of 8 bytes) and unpacked as views; the 2 x world split sizes read from one host
    copy of the counts sent and received."""
    for rank, results in enumerate(ranks):
        stages = results["expert_parallel"]["stages"]
        names = [name for name, _ in stages]
        assert names[1:] == ["merge_all_to_all_dispatches", "read_all_to_all_splits_once"], names
        at = names.index(pass_name)
        expected = [text.format(first=rank * 2) for text in (before, after)]
        got = [window(stages[at - 1][1]), window(stages[at][1])]
        if rank == 0:
            assert got == expected
        assert [_renamed(text) for text in got] == [_renamed(text) for text in expected], rank


def _exchange(text: str) -> str:
    """A stage's lines from the counts' exchange (the first all_to_all_single) through the one after the combine's
    wait (the last wait_tensor)."""
    lines = _body(text)
    first = next(i for i, line in enumerate(lines) if "all_to_all_single" in line)
    last = max(i for i, line in enumerate(lines) if "wait_tensor" in line)
    return "\n".join(lines[first:last + 2]) + "\n"


def test_golden_pad_all_to_all_to_capacity(ranks):
    """The counts stay on the device: each row's place in its peer's chunk of 18 from the counts' cumsum, the
    rows placed in zeros, both all_to_alls in equal chunks, the padding rows' expert ids and weights zeroed by the
    mask of received counts, the combined rows taken back from their places; the split reads, their host copy
    and Dynamo's checks of them gone, a host check of the row count against the capacity in their place."""
    for rank, results in enumerate(ranks):
        (name_before, before), (name_after, after) = results["expert_parallel_capacity"]["stages"]
        assert (name_before, name_after) == ("read_all_to_all_splits_once", "pad_all_to_all_to_capacity")
        expected = [text.format(first=rank * 2) for text in (_SPLIT_READS_ONCE, _DISPATCH_BEFORE_PADDING, _PADDED)]
        got = [_split_reads(before), _dispatch(before), _exchange(after)]
        if rank == 0:
            assert got == expected
        assert [_renamed(text) for text in got] == [_renamed(text) for text in expected], rank


def test_expert_parallel_moe_with_a_capacity_matches_single_device_layer(ranks):
    """ep_max_dispatch_rows: the EP layer equals the single-device block within the EP tolerance at each token
    count, with no host sync left (a CUDA graph could replay it); a call over the capacity raises, naming it; the
    layer compiled without the option is refused for want of one."""
    for rank, results in enumerate(ranks):
        case = results["expert_parallel_capacity"]
        assert case["error"] < 2 ** -6, (rank, case["error"])
        assert (case["breaks"], case["retries"]) == (0, [])
        assert case["passes"]["pad_all_to_all_to_capacity"] == case["graphs"] >= 1, case["refusals"]
        assert case["passes"]["merge_all_to_all_dispatches"] == case["graphs"]
        assert "aten._local_scalar_dense" not in case["lowered"] and "prims.device_put" not in case["lowered"]
        assert case["host_syncs"] == [[]] * case["graphs"]
        assert "ep_max_dispatch_rows = 18" in case["over_capacity"], case["over_capacity"]
        unpadded = results["expert_parallel"]
        assert unpadded["refusals"]["pad_all_to_all_to_capacity"] == [
            "no capacity declared (CompileOptions.ep_max_dispatch_rows)"] * unpadded["graphs"]


def test_expert_parallel_passes_refuse_what_they_cannot_rewrite(ranks):
    """_UnmergeableExchange: neither pass fires, each names why, and both leave the graph as it was."""
    for rank, results in enumerate(ranks):
        case = results["ep_refusals"]
        assert case["same"] and (case["graphs"], case["breaks"], case["retries"]) == (1, 0, []), (rank, case)
        assert case["passes"]["merge_all_to_all_dispatches"] == case["passes"]["read_all_to_all_splits_once"] == 0
        assert case["refusals"]["merge_all_to_all_dispatches"] == [
            "all_to_all_single_3 has the splits of all_to_all_single_1 but another process group ('1', not '0')",
            "wait_tensor_1, which a later call's input needs, cannot move before the first call"]
        assert case["refusals"]["read_all_to_all_splits_once"] == [
            "a split size is not one element of a 1-D integer tensor of fixed length"] * WORLD + [
            "the split sizes are read from tensors of different dtypes"]
        (_, before), (_, merged), (_, read) = case["stages"]
        assert _body(merged) == _body(before) and _body(read) == _body(before)
        # The counts' exchange and the four others; no host copy; the 2 x world splits read as the model wrote,
        # the 0-D sums' 2 and the multiplier's 1.
        assert case["lowered"].count("_c10d_functional.all_to_all_single.default(") == 5
        assert "prims.device_put" not in case["lowered"]
        assert case["lowered"].count("aten._local_scalar_dense.default(") == 2 * WORLD + WORLD + 1


@pytest.mark.parametrize("shapes, why", [(((4, 8), (4,)), None), (((4, 8), (4, 2, 2)), "not a 1-D or 2-D tensor")])
def test_merge_all_to_all_dispatches_on_fake_tensors(shapes, why):
    """In one process, on fake tensors: all_to_alls with the same splits and group merge where their inputs are 1-D
    or 2-D, and are refused, with the reason, where one is not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dzc.passes.merge_all_to_all_dispatches import merge_all_to_all_dispatches

    c10d, mode, graph = torch.ops._c10d_functional, FakeTensorMode(), torch.fx.Graph()
    sources, waits = [graph.placeholder(f"x{i}") for i in range(len(shapes))], []
    for source, shape in zip(sources, shapes):
        call = graph.call_function(c10d.all_to_all_single.default, (source, [2, 2], [2, 2], "0"))
        wait = graph.call_function(c10d.wait_tensor.default, (call,))
        with mode:
            source.meta["val"] = call.meta["val"] = wait.meta["val"] = torch.empty(shape)
        waits.append(wait)
    graph.output(tuple(waits))
    result = merge_all_to_all_dispatches(graph)
    calls = [n for n in result.graph.nodes if n.target == c10d.all_to_all_single.default]
    if why is None:
        assert (len(result.rewrites), len(calls), result.refusals) == (1, 1, [])
    else:
        assert (len(result.rewrites), len(calls)) == (0, 2) and why in result.refusals[0][1], result.refusals


@pytest.mark.parametrize("op, capacity, why", [
    ("mul", 8, None), ("mul", None, "no capacity declared"), ("mul", 4, "8 rows to dispatch, over"),
    ("cumsum", 8, "(aten.cumsum.default) uses the received rows and is not row-wise in them")])
def test_pad_all_to_all_to_capacity_on_fake_tensors(op, capacity, why):
    """In one process, on fake tensors: a dispatch of 8 rows and its combine, split sizes read from the exchanged
    counts, a row-wise op (x 2) or a cumsum over the rows between them. Padded where row-wise and a capacity of at
    least the 8 rows is declared (no host sync left); else refused with the reason."""
    import torch.distributed  # noqa: F401 (registers the functional collectives' fake kernels)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dzc.capture import _host_syncs
    from dzc.passes.pad_all_to_all_to_capacity import pad_all_to_all_to_capacity

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    mode, graph = FakeTensorMode(shape_env=ShapeEnv()), torch.fx.Graph()

    def call(target, *args, val=None):
        node = graph.call_function(target, args)
        with mode:
            node.meta["val"] = val if val is not None else target(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]))
        return node

    x, send = graph.placeholder("x"), graph.placeholder("send")
    with mode:
        x.meta["val"], send.meta["val"] = torch.empty(8, 4), torch.empty(2, dtype=torch.int64)
    received = call(c10d.wait_tensor.default, call(c10d.all_to_all_single.default, send, [1, 1], [1, 1], "0"))
    reads = [call(aten._local_scalar_dense.default, call(aten.select.int, counts, 0, i),
                  val=mode.shape_env.create_unbacked_symint()) for counts in (send, received) for i in range(2)]
    rows = call(c10d.wait_tensor.default, call(c10d.all_to_all_single.default, x, reads[2:], reads[:2], "0"))
    mixed = call(aten.mul.Tensor, rows, 2) if op == "mul" else call(aten.cumsum.default, rows, 0)
    back = call(c10d.wait_tensor.default, call(c10d.all_to_all_single.default, mixed, reads[:2], reads[2:], "0"))
    graph.output(back)
    result = pad_all_to_all_to_capacity(graph, capacity)
    if why is None:
        assert (len(result.rewrites), result.refusals, _host_syncs(result.graph)) == (1, [], [])
        assert tuple(list(result.graph.nodes)[-1].args[0].meta["val"].shape) == (8, 4)
    else:
        assert not result.rewrites and why in result.refusals[0][1], result.refusals
        assert _host_syncs(graph) == _host_syncs(result.graph) == ["aten._local_scalar_dense.default"]


def test_all_reduce_with_another_use_is_refused(ranks):
    for results in ranks:
        case = results["refusal"]
        assert case["error"] < 1e-5
        assert case["passes"]["fuse_residual_norm"] == 1 and case["passes"]["fuse_all_reduce_residual_norm"] == 0
        assert any("another use" in why for why in case["refusals"]["fuse_all_reduce_residual_norm"])


def test_collective_passes_return_a_graph_without_collectives_as_it_was(tmp_path, seed):
    """Without an all_reduce or an all_to_all_single the four collective passes find nothing to rewrite or refuse:
    each returns its input uncopied (passes.graph_pass.calls_any), and its pipeline stage repeats the text of the
    stage before it under its own title."""
    import dzc
    from dzc.models.decoder import AddRMSNorm
    from dzc.pipeline import build_pipeline
    from dzc.targets import resolve_target

    names = ("fuse_all_reduce_residual_norm", "merge_all_to_all_dispatches", "read_all_to_all_splits_once",
             "pad_all_to_all_to_capacity")
    model = AddRMSNorm(64)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(compiled(x, residual), model(x, residual))
    assert compiled.report.fired() == {"fuse_residual_norm": 1}
    stages = compiled.report.graphs[0].stages
    order = [name for name, _ in stages]
    for name in names:
        at = order.index(name)
        assert stages[at][1].splitlines()[0] == f"# built by {name}"
        assert _body(stages[at][1]) == _body(stages[at - 1][1])
    graph = torch.fx.symbolic_trace(lambda a, b: (a + b).relu()).graph
    for graph_pass in build_pipeline(resolve_target("cuda"), dzc.CompileOptions()):
        if graph_pass.__name__ in names:
            result = graph_pass(graph)
            assert result.graph is graph and not result.rewrites and not result.refusals, graph_pass.__name__


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
