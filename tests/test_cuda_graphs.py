"""CUDA-graph replay of small calls (dzc.runtime.CudaGraphRunner, above Dynamo): same results as the guarded path,
inputs copied in, written arguments and cache objects used in place, each call's work (buffer updates included)
run once, block tables bucketed, outputs owned by the caller; the MoE workspace a graph captured stays its own.
Captures happen only after a call that compiled nothing; one that fails leaves CUDA usable (stream, RNG) and its
key runs without graphs, the error recorded. Assertion messages carry runner.describe() (keys, refusals)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dzc
from dzc.models.decoder import AddRMSNorm, HFRMSNorm
from dzc.runtime import CudaGraphRunner
from test_cuda_graph_eligibility import KeepPositive, ScaleByHostValue

pytestmark = pytest.mark.gpu


class AddNormInPlace(torch.nn.Module):
    """Writes its residual input in place (as a cache update would)."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)

    def forward(self, x, residual):
        residual.add_(x)
        return self.norm(residual)


def _model(cls, hidden, seed):
    torch.manual_seed(seed)
    model = cls(hidden).cuda().bfloat16()
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.1)
    return model


def _inputs(tokens, hidden):
    return (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16))


def test_replay_matches_guarded_path_and_sees_new_values(seed, tmp_path):
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=64))
    x, r = _inputs(8, 256)
    with torch.no_grad():
        for step in range(4):
            expected = model(x, r)
            actual = compiled(x, r)
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)
            if step == 1:
                x.mul_(-2.0)  # same tensor, new values: inputs are copied in at every replay
            if step == 2:
                x, r = _inputs(8, 256)  # other tensors, same signature: replayed, copied in
    runner = compiled._cuda_graphs
    assert len(runner.graphs) == 1, runner.describe()
    first, second = compiled(x, r)[0], compiled(x, r)[0]
    assert first.data_ptr() != second.data_ptr()  # outputs are copies the caller owns


def test_reuse_outputs_returns_the_graph_buffers(seed, tmp_path):
    """With reuse_outputs, every call that replays returns the graph's buffers (the captured call included); calls
    run as they are return their own tensors: the first (it compiles; the runner sees calls once a graph exists)
    and the runner's first of the key (it compiled nothing: the next is captured)."""
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_reuse_outputs=True))
    runner = compiled._cuda_graphs
    x, r = _inputs(4, 256)
    before = [compiled(x, r)[0] for _ in range(2)]
    assert not runner.graphs and before[0].data_ptr() != before[1].data_ptr(), runner.describe()
    first = compiled(x, r)[0]  # captured, replayed
    assert len(runner.graphs) == 1, runner.describe()
    graph_output = next(iter(runner.graphs.values())).flat_outputs[0]
    assert first.data_ptr() == graph_output.data_ptr()
    x2, r2 = _inputs(4, 256)
    second = compiled(x2, r2)[0]
    assert first.data_ptr() == second.data_ptr(), runner.describe()
    with torch.no_grad():
        torch.testing.assert_close(second, model(x2, r2)[0], atol=0.02, rtol=0.02)


def test_a_written_argument_is_replayed_in_place(seed, tmp_path):
    """The call writes its residual (AOTAutograd's input mutation): the graph uses the caller's tensor at its own
    address, so each replay's write lands there; a residual at another address gets its own graph (up to
    MAX_GRAPHS_PER_SIGNATURE), then such calls run without graphs. Under inference_mode: no version counters."""
    model = _model(AddNormInPlace, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    with torch.inference_mode():
        x, r = _inputs(4, 256)
        expected_r = r.clone()
        for _ in range(4):
            x.normal_()
            expected = model.norm(expected_r + x)
            torch.testing.assert_close(compiled(x, r), expected, atol=0.02, rtol=0.02)
            expected_r += x
            torch.testing.assert_close(r, expected_r, atol=0.05, rtol=0.02)
        runner = compiled._cuda_graphs
        assert len(runner.graphs) == 1 and [s.in_place for s in runner.signatures.values()] == [{1}], \
            runner.describe()
        for _ in range(runner.MAX_GRAPHS_PER_SIGNATURE + 2):  # a new residual each call
            x, r = _inputs(4, 256)
            expected_r = r + x
            torch.testing.assert_close(compiled(x, r), model.norm(expected_r), atol=0.02, rtol=0.02)
            torch.testing.assert_close(r, expected_r, atol=0.05, rtol=0.02)
        assert "addresses" in (next(iter(runner.signatures.values())).refused or ""), runner.describe()


def test_replays_under_inference_mode_with_keyword_arguments(seed, tmp_path):
    """Serving loops run under inference_mode (inference tensors have no version counter: reading one crashed the
    first small call) and pass arguments by keyword (they bypassed the runner)."""
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path)))
    with torch.inference_mode():
        x, r = _inputs(8, 256)
        for _ in range(4):
            x.normal_()  # the same tensor, new values: copied in at every replay
            for a, e in zip(compiled(x, residual=r), model(x, r)):
                torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)
    assert len(compiled._cuda_graphs.graphs) == 1, compiled._cuda_graphs.describe()


class CountSteps(torch.nn.Module):
    """Updates a buffer in forward (a step counter, a running statistic)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.steps += 1
        return x * self.steps


def test_buffers_updated_in_forward_move_once_per_call(tmp_path):
    """Calls run as they are until one compiled nothing (here the second: the first compiles); the capture runs
    no kernel; every later call is one replay: the buffer counts calls exactly."""
    model = CountSteps()
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        for step in range(1, 6):
            torch.testing.assert_close(compiled(x), x * step)
    assert model.steps.item() == 5 and len(compiled._cuda_graphs.graphs) == 1, compiled._cuda_graphs.describe()


class NormAndSoftmax(torch.nn.Module):
    """A residual RMSNorm (dzc's rewrite: its graph's first call runs the rewrite check) beside a softmax left to
    Inductor (whose first run picks among its reduction configs by timing them)."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = HFRMSNorm(hidden, 1e-6)

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h.float().softmax(-1)


def test_a_graph_compiled_by_a_call_is_captured_only_after_a_call_that_compiled_nothing(seed, tmp_path):
    """A key whose first call compiles a new graph (one token: Dynamo specialises size 1): that call ran the
    rewrite check, not the compiled code. Seen on the H200 (DSA decode steps): capturing the next call ran
    Inductor's first run inside the capture, which invalidated it. The next call runs as it is, the one after is
    captured and replayed."""
    model = _model(NormAndSoftmax, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path)))
    runner = compiled._cuda_graphs
    with torch.inference_mode():
        compiled(*_inputs(8, 256))  # compiles (the token count dynamic)
        for step in range(4):
            x, r = _inputs(1, 256)
            for a, e in zip(compiled(x, r), model(x, r)):
                torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)
            assert len(runner.graphs) == (1 if step >= 2 else 0), f"step {step}: {runner.describe()}"
    assert not any(s.refused for s in runner.signatures.values()), runner.describe()
    assert [g.fallback for g in compiled.report.graphs] == ["inductor", "inductor"], compiled.report
    assert compiled.report.graphs[1].rewrite_check.startswith("passed"), compiled.report
    torch.randn(8, device="cuda")


def _host_read(x):
    return x * x.sum().item()  # waits on the GPU: a capture cannot


def test_a_failed_capture_leaves_cuda_usable_and_its_key_runs_without_graphs(seed):
    """The capture fails inside (the host waits on the GPU) and so at its end: the refusal names the error raised
    inside, the current stream and the CUDA RNG are as before (on the H200 the next randn raised "Offset increment
    outside graph capture encountered unexpectedly"), every call's result is right, and capturing works again."""
    runner = CudaGraphRunner(_host_read, 64, reuse_outputs=False)
    stream = torch.cuda.current_stream()
    for step in range(4):
        x = torch.randn(4, 64, device="cuda")
        torch.testing.assert_close(runner(x), x * x.sum().item())
    (signature,) = runner.signatures.values()
    assert not runner.graphs and signature.refused, runner.describe()
    assert signature.refused.startswith("capture failed: ") and "(at " in signature.refused, runner.describe()
    assert "previous error during capture" not in signature.refused.split(";")[0], runner.describe()
    assert torch.cuda.current_stream() == stream
    torch.randn(8, device="cuda")
    doubled = CudaGraphRunner(lambda x: x * 2, 64, reuse_outputs=False)
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda")
        torch.testing.assert_close(doubled(x), x * 2)
    assert len(doubled.graphs) == 1, doubled.describe()


def test_random_draws_in_a_graph_replay_fresh_numbers(seed):
    """The default CUDA generator is registered with each capture: every replay draws anew. A generator of the
    call's own is either followed the same way or refused with its error; CUDA's RNG stays usable either way."""
    noisy = CudaGraphRunner(lambda x: x + torch.rand_like(x), 64, reuse_outputs=False)
    x = torch.zeros(4, 64, device="cuda")
    draws = [noisy(x) for _ in range(4)]
    assert len(noisy.graphs) == 1, noisy.describe()
    assert all(bool(((d >= 0) & (d < 1)).all()) for d in draws)
    assert not torch.equal(draws[2], draws[3])  # the capture's replay, then a replay
    generator = torch.Generator(device="cuda").manual_seed(seed)
    own = CudaGraphRunner(lambda x: x + torch.rand(x.shape, device=x.device, generator=generator), 64, False)
    draws = [own(x) for _ in range(4)]
    assert all(bool(((d >= 0) & (d < 1)).all()) for d in draws) and not torch.equal(draws[2], draws[3])
    (signature,) = own.signatures.values()
    assert len(own.graphs) == 1 or "generator" in (signature.refused or ""), own.describe()
    torch.randn(8, device="cuda")


def test_widening_block_table_reuses_power_of_two_graphs(seed, tmp_path):
    """A DSA layer's decode steps over dzc's paged cache (a cache object argument, written in place by the
    replays) while the block table widens from 1 to 3 pages: graphs for 1, 2 and 4 pages only (the table padded
    with page 0), every step as the same compiled layer without graphs gives, the caches equal too."""
    from dzc.kv_cache import PagedKVCache
    from dzc.models.dsa import TINY_DSA, DSASession, build_dsa_attention

    model = build_dsa_attention(seed=seed).cuda()
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False)
    plain = dzc.compile(model, "cuda", replace(options, cuda_graph_max_tokens=0))
    graphed = dzc.compile(model, "cuda", options)
    sessions = [DSASession(PagedKVCache(TINY_DSA.cache_config(), 8, 2, False, "cuda")) for _ in range(2)]
    prompt = torch.randn(2, 60, TINY_DSA.hidden, device="cuda").bfloat16()
    with torch.inference_mode():
        for session, compiled in zip(sessions, (plain, graphed)):
            session.step(compiled, prompt)
        for _ in range(80):  # positions 60..139: pages 1 to 3
            x = torch.randn(2, 1, TINY_DSA.hidden, device="cuda").bfloat16()
            expected, actual = (session.step(compiled, x) for session, compiled in zip(sessions, (plain, graphed)))
            torch.testing.assert_close(actual, expected, atol=0.02, rtol=0.02)
    runner = graphed._cuda_graphs
    widths = sorted({key[0][1][2][0][1] for key in runner.graphs})  # the block table's [rows, pages]
    assert widths == [1, 2, 4], f"{widths}\n{runner.describe()}"
    for mine, theirs in zip(sessions[1].cache.latent + sessions[1].cache.index_keys,
                            sessions[0].cache.latent + sessions[0].cache.index_keys):
        torch.testing.assert_close(mine, theirs, atol=0.02, rtol=0.02)


def test_moe_workspace_captured_by_a_graph_outlives_its_replacement(seed, tmp_path):
    """A graph captured on the MoE workspace path keeps its own buffer: growing the shared workspace afterwards
    (a larger layer) and reusing the freed memory cannot reach what the graph reads and writes."""
    from test_mxfp4_moe_kernels import WORKSPACE, case_args, check_against_reference, load_triton

    from dzc.targets import mxfp4_moe

    args = case_args("gptoss-bfloat16-T5", seed, "cuda")
    spec = mxfp4_moe.spec_from_args(*args[:11])
    kernels = load_triton(spec, tmp_path)
    inputs, (out,), _, _ = mxfp4_moe.prepare(spec, *args)
    mxfp4_moe.release_workspaces()
    mxfp4_moe.triton_launch(kernels, WORKSPACE, *inputs, out)  # warm-up: compiles, allocates the shared buffer
    shared = mxfp4_moe.workspace_bytes("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mxfp4_moe.triton_launch(kernels, WORKSPACE, *inputs, out)
    mxfp4_moe.workspace("cuda", torch.uint8, 4 * shared)  # grows: the old shared buffer is freed
    poison = [torch.full((shared,), 7, dtype=torch.uint8, device="cuda") for _ in range(4)]
    out.fill_(float("nan"))
    graph.replay()
    check_against_reference(args, out)
    assert all(bool((p == 7).all()) for p in poison), "the graph wrote into memory it does not own"
    mxfp4_moe.release_workspaces()


def test_large_calls_take_the_guarded_path_until_a_repeated_key_is_judged(seed, tmp_path):
    """Above max_tokens: lengths seen once cost only their key (no capture); a repeated key is captured, its
    replays timed, and then it either keeps replaying or is refused with the timings; every call's result is the
    guarded path's."""
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=16))
    runner = compiled._cuda_graphs
    guarded = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=0))
    compiled(*_inputs(32, 256))  # the first call compiles, before any graph exists: the runner does not see it
    for tokens in (64, 80, 96):  # prefill of ever new lengths
        x, r = _inputs(tokens, 256)
        torch.testing.assert_close(compiled(x, r), guarded(x, r), rtol=0, atol=0)
    assert not runner.graphs and len(runner.signatures) == 3, runner.describe()
    assert all(s.graphs == 0 and s.pays is None for s in runner.signatures.values()), runner.describe()
    x, r = _inputs(64, 256)
    for _ in range(12):  # observed, captured, TIMED_REPLAYS timed replays, judged (a recompile may add one)
        x.normal_(), r.normal_()  # new values each call: a replay must see them
        torch.testing.assert_close(compiled(x, r), guarded(x, r), rtol=0, atol=0)
    [judged] = [s for s in runner.signatures.values() if s.graphs]
    assert judged.pays is not None and len(judged.replay_s) == runner.TIMED_REPLAYS, runner.describe()
    assert (judged.refused is None) == judged.pays, runner.describe()
    assert bool(runner.graphs) == judged.pays, runner.describe()


def test_a_large_key_reads_inputs_at_repeated_addresses_in_place(seed, tmp_path):
    """Above max_tokens, calls that bring the same tensors (new values each time) are captured reading them where
    they are: the graph holds no input copies, and replays see the new values; the first call with other tensors
    turns that off and the key is captured again copying its inputs. Every result is the guarded path's."""
    model = _model(AddRMSNorm, 256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=16))
    runner = compiled._cuda_graphs
    guarded = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=0))
    compiled(*_inputs(32, 256))  # the first call compiles, before any graph exists
    x, r = _inputs(64, 256)
    for _ in range(6):  # the key's first call, an observed one, then the capture (a recompile may add one)
        x.normal_(), r.normal_()
        torch.testing.assert_close(compiled(x, r), guarded(x, r), rtol=0, atol=0)
        if runner.graphs:
            break
    [(full_key, graph)] = runner.graphs.items()
    assert runner.signatures[full_key[0]].reads == {0, 1} and not graph.buffers, runner.describe()
    x.normal_(), r.normal_()  # one replay (timed: the key is judged after two)
    torch.testing.assert_close(compiled(x, r), guarded(x, r), rtol=0, atol=0)
    other_x, other_r = _inputs(64, 256)
    torch.testing.assert_close(compiled(other_x, other_r), guarded(other_x, other_r), rtol=0, atol=0)
    signature = runner.signatures[full_key[0]]
    [graph] = runner.graphs.values()
    assert signature.reads == frozenset() and len(graph.buffers) == 2, runner.describe()
    torch.testing.assert_close(compiled(x, r), guarded(x, r), rtol=0, atol=0)  # copied in now


def test_a_key_is_captured_again_after_every_graph_of_the_runner_is_gone(seed, tmp_path):
    """Once no captured graph lives (dropped here by reset; a replay's output still held, so the old pool keeps
    blocks), the next capture takes a pool of its own: torch's allocator asserts when a capture joins a pool whose
    graphs are all gone (seen on the H200: "use_count > 0 INTERNAL ASSERT FAILED", and the key ran without graphs).
    """
    model = _model(AddRMSNorm, 256, seed)
    options = dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=64,
                                 cuda_graph_reuse_outputs=True)
    compiled = dzc.compile(model, "cuda", options)
    runner = compiled._cuda_graphs
    x, r = _inputs(8, 256)
    with torch.no_grad():
        expected = model(x, r)
        for attempt in range(2):
            for _ in range(4):  # observed first, captured once a call compiled nothing
                compiled(x, r)
                if runner.graphs:
                    break
            assert runner.graphs and not any(s.refused for s in runner.signatures.values()), runner.describe()
            held = compiled(x, r)  # a replay: with reuse_outputs, the graph's own buffers (blocks of its pool)
            for a, e in zip(held, expected):
                torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)
            if attempt == 0:
                runner.reset()  # every graph gone, `held` still alive


def test_a_host_read_kept_on_the_device_replays_with_fresh_values(seed, tmp_path):
    compiled = dzc.compile(ScaleByHostValue(), "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    for step in range(3):  # new values each call: a replay that baked in the first call's amax would be wrong
        x = torch.randn(4, 64, device="cuda") * (step + 1)
        torch.testing.assert_close(compiled(x), x * x.abs().amax().item())
    assert len(compiled._cuda_graphs.graphs) == 1, compiled._cuda_graphs.describe()


def test_calls_with_host_syncs_run_without_cuda_graphs(seed, tmp_path):
    """The report names the op that makes the host wait; the runner never tries to capture such calls (a failed
    capture leaves the CUDA RNG state mid-capture: seen on the H200, the next randn raised)."""
    compiled = dzc.compile(KeepPositive(), "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), fallback="eager"))
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda")
        torch.testing.assert_close(compiled(x), x[x > 0] * 2)
    assert compiled.report.graphs[0].host_syncs == ["aten.index.Tensor"]
    assert not compiled._cuda_graphs.graphs and not compiled._cuda_graphs.signatures, compiled._cuda_graphs.describe()
