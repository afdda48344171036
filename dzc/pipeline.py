"""The pass pipeline: which passes run, in which order, for a target.

One literal list per target, read top to bottom. Passes never test the vendor; a target that needs a different
order or set gets its own list here.
"""

from __future__ import annotations

import functools
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.fx

from dzc import ir, regions
from dzc.options import CompileOptions
from dzc.passes.canonicalize_graph import canonicalize_graph
from dzc.passes.fuse_all_reduce_residual_norm import fuse_all_reduce_residual_norm
from dzc.passes.fuse_mxfp4_experts import fuse_mxfp4_experts
from dzc.passes.fuse_residual_norm import fuse_residual_norm
from dzc.passes.fuse_sparse_attention import fuse_sparse_attention
from dzc.passes.fuse_vision_attention import fuse_vision_attention
from dzc.passes.fuse_windowed_attention import fuse_windowed_attention
from dzc.passes.graph_pass import PassResult, note_scalar_constants, written_inputs
from dzc.passes.merge_all_to_all_dispatches import merge_all_to_all_dispatches
from dzc.passes.pad_all_to_all_to_capacity import pad_all_to_all_to_capacity
from dzc.passes.quantize_moe_activations import quantize_moe_activations
from dzc.passes.read_all_to_all_splits_once import read_all_to_all_splits_once
from dzc.passes.reinplace_cache_writes import reinplace_cache_writes
from dzc.report import CompileTimer
from dzc.targets import Target

GraphPass = Callable[[torch.fx.Graph], PassResult]


def build_pipeline(target: Target, options: CompileOptions = CompileOptions()) -> list[GraphPass]:
    """The passes for `target` under `options`, in order. CUDA and MUSA share the list: their differences are
    profile fields that lowering (and the opt-in W4A8 rewrite) read, not different rewrites."""
    return [
        # Equivalent spellings -> one (exact: no number changes). First: every fusion below matches the canonical
        # form instead of each model's spelling.
        canonicalize_graph,
        # Residual add + RMSNorm -> dzc.add_rms_norm. Next: it only needs the canonical ATen ops, and later
        # fusions (attention, MoE) consume the normalised activations it produces.
        fuse_residual_norm,
        # Tensor parallelism: all-reduce (sum) of a row-parallel projection + dzc.add_rms_norm ->
        # dzc.all_reduce_add_rms_norm. After fuse_residual_norm, whose add_rms_norm nodes it consumes; lowering
        # decides per profile how the op runs (the backend's all-reduce + the add_rms_norm kernel today).
        fuse_all_reduce_residual_norm,
        # DSA top-k masked dense attention -> dzc.dsa_indexer + the model's top-k + sparse_attention. Independent
        # of the norm fusion; it must see the dense attention's bmm/softmax before any attention fusion claims it.
        fuse_sparse_attention,
        # Attention over packed images (per-image split/cat loop, block-diagonal cu_seqlens mask, windows) ->
        # dzc.varlen_attention, with HF's vision RoPE folded in. After fuse_sparse_attention, which must see dense
        # attention first (this pass only claims attention delimited by cu_seqlens, so the two never compete).
        fuse_vision_attention,
        # Causal attention with a local window or attention sinks (text decoders' sliding-window layers, gpt-oss)
        # -> dzc.varlen_attention. After fuse_sparse_attention (an attention under a top-k mask is its; this pass
        # leaves such masks alone) and fuse_vision_attention (non-causal packs are its; this pass takes causal only).
        fuse_windowed_attention,
        # MoE expert matmuls on MXFP4-dequantized weights (+ routing glue, combine) -> dzc.mxfp4_moe. Independent
        # of the other fusions (it takes the normalised activations from whichever node produces them); before
        # lowering, which must never see the dequantized weights it removes.
        fuse_mxfp4_experts,
        # Opt-in (options.moe_fp8_activations): dzc.mxfp4_moe -> dzc.mxfp4_moe_w4a8 (FP8 activations) where the
        # profile has native E4M3. After fuse_mxfp4_experts, which makes the nodes it rewrites.
        *([_on_profile(quantize_moe_activations, target)] if options.moe_fp8_activations else []),
        # Expert parallelism: all_to_all_single calls with the same splits and group (an MoE dispatch's rows,
        # expert ids, routing weights) -> one call of their bytes. After fuse_mxfp4_experts, which reads the
        # received ids and weights as traced; exact (bytes moved as they were).
        merge_all_to_all_dispatches,
        # The split sizes an all_to_all_single needs on the host, read one element at a time (.tolist()) -> one
        # copy to the host, read there: one wait for the device instead of 2 x world. Exact.
        read_all_to_all_splits_once,
        # options.ep_max_dispatch_rows (else refused): the dispatch and combine whose splits those reads are ->
        # all_to_alls of fixed chunks of that many rows per peer, padding masked; the reads, their copy and
        # Dynamo's checks of them erased (no host sync: a CUDA graph can replay the layer). After both passes above
        # (one dispatch, one host copy to erase); equal within the MoE kernel's tolerance (it sees more rows).
        functools.update_wrapper(functools.partial(pad_all_to_all_to_capacity,
                                                   capacity=options.ep_max_dispatch_rows), pad_all_to_all_to_capacity),
        # Functional writes into an input (KV cache) + AOTAutograd's copy-back -> in-place writes, no copy of the
        # cache. Last: the fusions match the functional graph (fuse_sparse_attention then reads the written cache
        # in place instead of gathering it), and no later pass may move a read across a write.
        reinplace_cache_writes,
    ]


def _on_profile(graph_pass, target: Target) -> GraphPass:
    """A pass that also reads the target's profile, as a Graph -> PassResult function under its own name."""
    return functools.update_wrapper(functools.partial(graph_pass, profile=target.profile), graph_pass)


@dataclass
class Stage:
    """One step of the pipeline as the dumps show it: the graph text after it, and what it did."""

    name: str
    text: str
    result: PassResult | None  # None for the captured graph
    # (attribute, calls) of the region body this stage rewrote (dzc/regions.py); None for the whole graph
    region: tuple[str, int] | None = None


def run_pipeline(graph: torch.fx.Graph, target: Target, options: CompileOptions = CompileOptions(),
                 verify: bool = True, timer: CompileTimer | None = None, captured_text: str | None = None,
                 root: torch.nn.Module | None = None) -> tuple[torch.fx.Graph, list[Stage]]:
    """Run the passes over `graph`; `timer` gets each pass's seconds ("pass <name>", its verify included) and the
    stages' dumps' ("ir text"). captured_text: the capture stage's dump, where the caller printed it already.

    root: the module holding the bodies of `graph`'s invoke_subgraph calls (nested compile regions). Each distinct
    body is rewritten once (stages "<attribute>.<pass>"), the calls are replaced by their rewritten bodies (stage
    "inline_regions"), and the passes run over the flat graph: they find the sites that cross a body's boundary
    there. A body that writes its inputs or calls bodies of its own is inlined as captured, left to that run."""
    timer = timer or CompileTimer()
    passes = build_pipeline(target, options)
    disabled = options.disable_passes
    names = [p.__name__ for p in passes]
    unknown = set(disabled) - set(names)
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)} in disable_passes; passes: {', '.join(names)}")
    passes = [p for p in passes if p.__name__ not in disabled]
    bodies = regions.body_calls(graph, root) if root is not None else []
    if bodies:  # regions.flatten's graph has no module to read constants from: note them before (canonicalize_graph)
        note_scalar_constants(graph, root)
        for body in bodies:
            note_scalar_constants(body.module.graph, body.module)
    if captured_text is None:
        with timer.stage("ir text"):
            captured_text = (regions.captured_text(root, "captured by Dynamo + AOTAutograd") if bodies
                             else ir.print_graph(graph, "captured by Dynamo + AOTAutograd"))
    stages = [Stage("capture", captured_text, None)]
    if bodies:
        rewritten = {}
        for body in bodies:
            body_graph = body.module.graph
            if written_inputs(body_graph) or regions.body_calls(body_graph, body.module):
                continue
            region = (body.attribute, len(body.calls))
            body_graph, body_stages = _run_passes(body_graph, passes, verify, timer, f"in body {body.attribute}")
            rewritten[body.attribute] = body_graph
            stages += [Stage(f"{body.attribute}.{s.name}", s.text, s.result, region) for s in body_stages]
        with timer.stage("inline regions"):
            graph = regions.flatten(graph, root, rewritten)
            if verify:
                ir.verify(graph)
        with timer.stage("ir text"):
            stages.append(Stage("inline_regions", ir.print_graph(graph, "region bodies inlined at their calls"),
                                None))
    graph, flat_stages = _run_passes(graph, passes, verify, timer)
    return graph, stages + flat_stages


def _run_passes(graph: torch.fx.Graph, passes: list[GraphPass], verify: bool, timer: CompileTimer,
                where: str = "") -> tuple[torch.fx.Graph, list[Stage]]:
    """Run `passes` in order over `graph`: the graph after the last, and a stage per pass."""
    stages = []
    for graph_pass in passes:
        try:
            with timer.stage(f"pass {graph_pass.__name__}"):
                result = graph_pass(graph)
                if verify and result.graph is not graph:
                    ir.verify(result.graph)
        except Exception as error:
            # A pass that fails (a structure it did not expect) costs a fusion, not the compile: the graph goes on
            # as it was (passes never mutate their input), and the report and a warning say why.
            why = f"the pass failed ({type(error).__name__}: {error}{_raised_at(error)}); the graph is left as it was"
            warnings.warn(f"dzc: {graph_pass.__name__}{f' ({where})' if where else ''}: {why}", RuntimeWarning,
                          stacklevel=3)
            result = PassResult(graph_pass.__name__, graph, refusals=[("graph", why)])
        unchanged = result.graph is graph
        graph = result.graph
        with timer.stage("ir text"):
            title = f"built by {result.name}" + (f" {where}" if where else "")
            if unchanged and stages:  # the input returned as it was (passes.graph_pass.calls_any): the same text
                text = f"# {title}\n" + stages[-1].text.split("\n", 1)[1]
            else:
                text = ir.print_graph(graph, title)
            stages.append(Stage(result.name, text, result))
    return graph, stages


def pass_results(stages: list[Stage]) -> list[PassResult]:
    """One result per pass that ran, in pipeline order, over the whole graph: a site rewritten in a region body
    counts once per call of the body (the counts are those of the same model captured without regions), named
    "<site> [body <attribute>]". Refusals are the flat graph's: it holds every body's sites again (a site refused
    in a body is fused there where the other side of the body's boundary completes it, else refused again)."""
    merged: dict[str, PassResult] = {}
    for stage in stages:
        result = stage.result
        if result is None:
            continue
        into = merged.setdefault(result.name, PassResult(result.name, result.graph))
        if stage.region is None:
            into.graph = result.graph
            into.rewrites += result.rewrites
            into.refusals += result.refusals
            continue
        attribute, calls = stage.region
        into.rewrites += [f"{site} [body {attribute}]" for site in result.rewrites for _ in range(calls)]
    return list(merged.values())


def _raised_at(error: Exception) -> str:
    """Where in dzc's code (dzc/, passes/, targets/) `error` was raised, its innermost frame there: a report then
    locates a pass's bug."""
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(root)]
    if not frames:
        return ""
    return f" at {frames[-1].filename[len(root):]}:{frames[-1].lineno} ({frames[-1].name})"
