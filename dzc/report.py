"""The compile report: what dzc did to a model, as data (for tests and --json) and as a readable summary.

It accumulates over the life of a compiled model: every graph Dynamo hands over (graph breaks make several,
recompiles add more), every pass with where it fired, every generated kernel with the config chosen per token
bucket, and what was left to the fallback.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from dzc.targets.launch import KernelRecord

if TYPE_CHECKING:  # dzc.coverage imports lowering, which times its stages with CompileTimer from here
    from dzc.coverage import Coverage, GraphCoverage


class CompileTimer:
    """Seconds spent per compile stage, summed over the stage's pieces, in the order the stages first ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def format_seconds(seconds: dict[str, float]) -> str:
    """'12.3 s: dynamo 4.1, aot_autograd 5.2, ...' with each pass under 'pass <name>' grouped as 'passes'."""
    passes = {name.removeprefix("pass "): s for name, s in seconds.items() if name.startswith("pass ")}
    parts = []
    for name, value in seconds.items():
        if not name.startswith("pass "):
            parts.append(f"{name} {value:.2f}")
        elif passes:  # at the first pass, all of them
            inner = ", ".join(f"{p} {v:.2f}" for p, v in passes.items())
            parts.append(f"passes {sum(passes.values()):.2f} ({inner})")
            passes = {}
    return f"{sum(seconds.values()):.2f} s: " + ", ".join(parts)


@dataclass
class GraphRecord:
    compile_id: str  # Dynamo's "frame/compile" id
    recompile: bool  # Dynamo compiled this frame before (a guard on shapes, dtypes or globals failed)
    nodes: int
    dynamic_sizes: list[str]  # symbolic sizes among the graph's inputs
    break_reasons: list[str]  # graph breaks Dynamo recorded since the previous graph
    fallback: str  # who runs the unfused ops of this graph
    execution: str
    not_runnable_reason: str
    unfused_ops: dict[str, int]  # ATen op -> count, left to the fallback
    # Ops whose results the host must wait for (data-dependent sizes or values: nonzero, .item() kept as a host
    # number): calls of such a graph cannot be captured into a CUDA graph, so dzc's runner never tries.
    host_syncs: list[str] = field(default_factory=list)
    stages: list[tuple[str, str]] = field(default_factory=list)  # (stage name, IR text); not in summaries
    # What the rewrite check (CompileOptions.check_rewrites) found on the graph's first call: "" before that call,
    # "passed: <errors>", "dropped <passes>: ...", or "skipped: <why>".
    rewrite_check: str = ""
    # The share of FLOPs and bytes run in dzc kernels, the largest unfused ops, near-misses (dzc/coverage.py).
    coverage: GraphCoverage | None = None
    # Compile seconds per stage: "dynamo" (tracing the frame), "aot_autograd" (to the ATen graph), "pass <name>",
    # "ir text" (the stages' dumps), "lowering", "codegen", "kernel load", "compile cache", "fallback compile",
    # "rewrite check" (the graph's first call under the check: both runs, tuning and kernel builds inside them).
    compile_seconds: dict[str, float] = field(default_factory=dict)
    # The warm-compile cache (dzc/compile_cache.py): "hit" (the capture's entry: AOTAutograd, the passes and the
    # rewrite check skipped), "hit after AOTAutograd (...)" (the rewritten graph's entry only, and why),
    # "miss" (built and stored), "off", or what went wrong.
    compile_cache: str = ""
    # The graph's nested compile region bodies (dzc/regions.py), one line each: its calls and the sites the passes
    # rewrote in it ("body repeated_subgraph0 called 8 times: fuse_residual_norm 1 site").
    regions: list[str] = field(default_factory=list)
    # Inductor fallback: the repeated layers' calls handed to it as invoke_subgraph, each body compiled once
    # (dzc/outline_regions.py): "3 bodies for 150 calls (...); left inlined: ..."; "" where it did not run.
    inductor_outlined: str = ""
    inductor_by_key: bool = False  # a warm hit loaded Inductor's compile by the key its entry kept
    inductor_key_unused: str = ""  # why a warm hit did not, where its entry kept one (inductor_entry.load)
    # Its Triton kernels compiled ahead of the first call (DZC_TRITON_PRECOMPILE, triton_codegen.Precompile):
    # "running", then how many were compiled in how long and what was skipped; "" where it did not run.
    triton_precompile: str = ""


@dataclass
class CompileReport:
    target: str
    options: str
    graphs: list[GraphRecord] = field(default_factory=list)
    passes: dict[str, int] = field(default_factory=dict)  # pass name -> rewrites made, over all graphs
    pass_sites: dict[str, list[str]] = field(default_factory=dict)  # pass name -> where it fired
    refusals: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # pass -> (where, why)
    kernels: list[KernelRecord] = field(default_factory=list)
    # Why Dynamo ran (part of) the model eagerly, without dzc: a recompile limit reached (it only logs a warning).
    eager_runs: list[str] = field(default_factory=list)
    # Rewrites the rewrite check dropped: {"pass", "graph", "sites", "error"} (the error it found on the outputs).
    dropped_rewrites: list[dict] = field(default_factory=list)
    # Captures that failed with dzc's capture settings and were retried without them (graph breaks accepted).
    capture_retries: list[str] = field(default_factory=list)
    # Why dzc's attention implementation was taken off a transformers model after a call it could not compute as
    # the model's own (dzc.hf_attention.PackedCallRefusal); "" while it is on (or was never selected).
    attention_given_back: str = ""
    # Seconds of the calls that compiled something, less the compile stages of their graphs: the first run of the
    # new graphs (kernel builds and tuning on first launch, the run itself), one entry per such call.
    first_run_seconds: list[float] = field(default_factory=list)
    # CompileOptions.nested_regions: the layers marked as nested compile regions ("layers: 8 x HFLayer"), "off",
    # "none" (no repeated layers), or why a capture with regions was refused and captured again without them.
    nested_regions: str = ""
    # Captures with regions tried again with the regions kept (dims a region specialised no longer marked dynamic,
    # or fewer layers marked: dzc/regions.py), one line each; refusals are in nested_regions.
    region_retries: list[str] = field(default_factory=list)
    # The frame entry (dzc/frame_cache.py): "hit (...)" (Dynamo's trace skipped), "miss", "stored", "off (why)",
    # "not saved (why)".
    frame_cache: str = ""

    @property
    def compiles(self) -> int:
        return len(self.graphs)

    @property
    def recompiles(self) -> int:
        return sum(1 for g in self.graphs if g.recompile)

    @property
    def graph_breaks(self) -> list[str]:
        return [reason for g in self.graphs for reason in g.break_reasons]

    def fired(self) -> dict[str, int]:
        """The passes that rewrote something, with how many times (report.passes lists every pass that ran)."""
        return {name: count for name, count in self.passes.items() if count}

    @property
    def coverage(self) -> Coverage:
        """Per graph: how much runs in dzc kernels, the largest ops left to the fallback, and the sites that looked
        like a fusion but were not rewritten, with why."""
        from dzc.coverage import Coverage  # noqa: PLC0415 (dzc.coverage imports lowering, which imports this)

        return Coverage([g.coverage for g in self.graphs if g.coverage is not None])

    @property
    def reference_fallbacks(self) -> list[KernelRecord]:
        """Op instances that run their plain-torch reference, no kernel taking them (the record says why)."""
        return [k for k in self.kernels if k.codegen == "reference"]

    def compile_seconds(self) -> dict[str, float]:
        """Compile seconds per stage summed over every graph, and the first runs of the new graphs."""
        total: dict[str, float] = {}
        for graph in self.graphs:
            for name, seconds in graph.compile_seconds.items():
                total[name] = total.get(name, 0.0) + seconds
        if self.first_run_seconds:
            total["first run"] = sum(self.first_run_seconds)
        return total

    @property
    def tuning_seconds(self) -> float:
        """Seconds spent tuning kernels (inside first runs and rewrite checks), from the kernels' records."""
        return sum(t["tuning_seconds"] for k in self.kernels for t in k.tuned.values())

    def record_pass(self, name: str, rewrites: list[str], refusals: list[tuple[str, str]]) -> None:
        self.passes[name] = self.passes.get(name, 0) + len(rewrites)
        self.pass_sites.setdefault(name, []).extend(rewrites)
        self.refusals.setdefault(name, []).extend(refusals)

    def checkpoint(self) -> tuple:
        """What the compiles from now on change (restore puts it back)."""
        return (len(self.graphs), dict(self.passes), {k: list(v) for k, v in self.pass_sites.items()},
                {k: list(v) for k, v in self.refusals.items()}, list(self.kernels))

    def restore(self, checkpoint: tuple) -> None:
        """Forget the compiles since `checkpoint` (a capture that was thrown away and done again)."""
        graphs, self.passes, self.pass_sites, self.refusals, self.kernels = checkpoint
        del self.graphs[graphs:]

    def drop_rewrites(self, name: str, graph: str, rewrites: list[str], error: str) -> None:
        """A pass's rewrites in one graph were dropped by the rewrite check: they no longer count as fired."""
        self.passes[name] -= len(rewrites)
        sites = self.pass_sites[name]
        for site in rewrites:
            sites.remove(site)
        self.dropped_rewrites.append({"pass": name, "graph": graph, "sites": list(rewrites), "error": error})

    def to_json(self) -> dict:
        data = asdict(self)
        for graph in data["graphs"]:
            graph.pop("stages")
        data.update(compiles=self.compiles, recompiles=self.recompiles)
        return data

    def __str__(self) -> str:
        lines = [f"dzc compile report: target {self.target}",
                 f"  options: {self.options}",
                 f"  graphs captured: {len(self.graphs)}   recompiles: {self.recompiles}   "
                 f"graph breaks: {len(self.graph_breaks)}"]
        for reason in self.graph_breaks:
            lines.append(f"    break: {reason}")
        for reason in self.eager_runs:
            lines.append(f"  NOT COMPILED: {reason}")
        for retry in self.capture_retries:
            lines.append(f"  capture retried: {retry}")
        if self.attention_given_back:
            lines.append(f"  attention given back: {self.attention_given_back}")
        if self.nested_regions:
            lines.append(f"  nested compile regions: {self.nested_regions}")
        for retry in self.region_retries:
            lines.append(f"    regions retried: {retry}")
        if self.frame_cache:
            lines.append(f"  frame entry: {self.frame_cache}")
        for dropped in self.dropped_rewrites:
            lines.append(f"  REWRITE DROPPED: {dropped['pass']} in graph {dropped['graph']} at "
                         f"{', '.join(dropped['sites'])}: {dropped['error']}")
        for graph in self.graphs:
            dynamic = ", ".join(graph.dynamic_sizes) or "none"
            lines.append(f"  graph {graph.compile_id}: {graph.nodes} nodes, dynamic sizes: {dynamic}, "
                         f"kernels run on: {graph.execution}")
            if graph.not_runnable_reason:
                lines.append(f"    why: {graph.not_runnable_reason}")
            for region in graph.regions:
                lines.append(f"    region {region}")
            if graph.coverage is not None:
                lines.append(f"    {graph.coverage.summary()} (report.coverage: what was left and why)")
            if graph.unfused_ops:
                ops = ", ".join(f"{op} x{n}" for op, n in sorted(graph.unfused_ops.items()))
                lines.append(f"    left to {graph.fallback}: {ops}")
            if graph.inductor_outlined:
                lines.append(f"    repeated layers outlined for Inductor: {graph.inductor_outlined}")
            if graph.inductor_by_key:
                lines.append("    Inductor's compile loaded by the key the compile cache entry kept (no hash of the "
                             "graph)")
            if graph.inductor_key_unused:
                lines.append("    Inductor's compile looked up by the graph's hash, not by the key the compile cache "
                             f"entry kept: {graph.inductor_key_unused}")
            if graph.triton_precompile:
                lines.append(f"    Triton kernels compiled ahead: {graph.triton_precompile}")
            if graph.host_syncs:
                lines.append(f"    host syncs (calls run without CUDA graphs): {', '.join(graph.host_syncs)}")
            if graph.rewrite_check:
                lines.append(f"    rewrite check: {graph.rewrite_check}")
            if graph.compile_seconds:
                cache = f" (compile cache: {graph.compile_cache})" if graph.compile_cache else ""
                lines.append(f"    compile time {format_seconds(graph.compile_seconds)}{cache}")
        if self.graphs:
            tuning = self.tuning_seconds
            lines.append(f"  compile time, all graphs: {format_seconds(self.compile_seconds())}"
                         + (f"; tuning {tuning:.2f} s of it (first runs, rewrite checks)" if tuning else ""))
        lines.append("  passes:")
        for name, count in self.passes.items():
            sites = collections.Counter(self.pass_sites[name])
            where = ", ".join(f"{site}" + (f" x{n}" if n > 1 else "") for site, n in sites.items())
            lines.append(f"    {name}: {count} rewrite(s)" + (f" at {where}" if where else ""))
            for site, reason in self.refusals.get(name, []):
                lines.append(f"      refused at {site}: {reason}")
        lines.append(f"  kernels: {len(self.kernels)}")
        for k in self.kernels:
            lines.append(f"    {k.kernel_id}: op {k.op} (x{k.uses}), {k.codegen} for {k.profile}, {k.spec}")
            lines.append(f"      source: {k.source_path}")
            lines.append(f"      runs on: {k.execution}; {k.configs_considered} configs "
                         f"({k.configs_illegal} illegal for the profile, pruned)")
            for bucket, tuned in sorted(k.tuned.items()):
                lines.append(f"      tokens <= {bucket}: {tuned['config']} ({tuned['how']}, "
                             f"{tuned['tuning_seconds']:.2f} s, {tuned['failed_configs']} failed)"
                             + (f"; path: {tuned['path']}" if "path" in tuned else "")
                             + (f"; runs external {tuned['external']}" if tuned.get("external") else ""))
                for config, why in tuned.get("failures", {}).items():
                    lines.append(f"        skipped {config}: {why}")
            for why, count in k.configs_unvalidated.items():
                lines.append(f"      left out of tuning: {count} config(s) with {why} (DZC_TUNE_UNVALIDATED=1 "
                             f"times them)")
            if k.external_candidates:
                lines.append(f"      external candidates offered: {', '.join(k.external_candidates)}")
            for alternative in k.alternatives:  # the same op's kernel from another codegen, tuned on its own
                lines.append(f"      candidate dzc.{alternative.codegen}: {alternative.kernel_id}, source "
                             f"{alternative.source_path}")
                for bucket, tuned in sorted(alternative.tuned.items()):
                    lines.append(f"        tokens <= {bucket}: {tuned['config']} ({tuned['how']})")
            for note in k.notes:
                lines.append(f"      note: {note}")
        return "\n".join(lines)

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=1, default=str)
