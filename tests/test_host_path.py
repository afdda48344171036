"""The host path of a compiled call: Triton launches keyed by a cheap fast key that must stand for Triton's own
specialization (a stale launcher on new arguments would be a wrong answer), the CUDA-graph runner's tensor-only
keying, output lending (a replay never overwrites outputs someone still holds), the policy for keys above
cuda_graph_max_tokens, and tools/diagnose_overhead.py on the real path. CPU tests use the installed Triton's
specializer and the interpreter; the GPU tests run the real launcher and replays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dzc
from dzc import runtime
from dzc.models.decoder import AddRMSNorm
from dzc.runtime import CudaGraphRunner, Signature, _CapturedGraph, _flatten, flatten_call, graph_key
from dzc.targets.triton_codegen import fast_key, fast_key_refines

ROOT = Path(__file__).resolve().parents[1]


def _triton_specializer():
    """The installed Triton's own specializer, as its binder calls it for a CUDA target (no GPU needed)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    return lambda arg: native_specialize_impl(backend, arg, False, True, True)


def test_fast_key_stands_for_the_installed_triton_specialization():
    assert fast_key_refines(_triton_specializer())
    # A specializer finer than the key (32-byte alignment) is caught: the launcher then always takes the JIT path.
    specialize = _triton_specializer()
    finer = lambda a: (specialize(a), a.data_ptr() % 32 == 0) if isinstance(a, torch.Tensor) else specialize(a)  # noqa: E731
    assert not fast_key_refines(finer)


def test_fast_key_tells_apart_what_triton_specializes_on(seed):
    x = torch.randn(64, dtype=torch.bfloat16)
    base = fast_key((x, 7, 1e-6, None))
    assert fast_key((torch.randn(64, dtype=torch.bfloat16), 7, 0.5, None)) == base  # new values, same kernel
    assert fast_key((x[1:], 7, 1e-6, None)) != base  # 2 bytes off: not 16-byte aligned
    assert fast_key((x.half(), 7, 1e-6, None)) != base
    assert fast_key((x, 1, 1e-6, None)) != base  # Triton makes an integer 1 a constant
    assert fast_key((x, 16, 1e-6, None)) != base  # multiples of 16
    assert fast_key((x, 1 << 31, 1e-6, None)) != base  # i64
    assert fast_key((x, 7, 1e-6, x)) != base  # a tensor where there was None


def test_fast_key_stands_for_the_installed_triton_specialization_of_tma_descriptors():
    """Triton specializes a host TMA descriptor on its base's dtype and its block shape: those are its fast key, and
    a specializer that also read its shape is caught (launches with descriptors then take the JIT path)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    specialize = _triton_specializer()
    assert fast_key_refines(specialize, descriptors=True)
    finer = lambda a: (specialize(a), tuple(a.shape)) if isinstance(a, TensorDescriptor) else specialize(a)  # noqa: E731
    assert not fast_key_refines(finer, descriptors=True) and fast_key_refines(finer)
    w = torch.zeros(4, 64, 64, dtype=torch.uint8)
    base = fast_key((TensorDescriptor.from_tensor(w, [1, 32, 32]),))
    assert fast_key((TensorDescriptor.from_tensor(w[1:, :32], [1, 32, 32]),)) == base  # other address and shape
    assert fast_key((TensorDescriptor.from_tensor(w, [1, 16, 32]),)) != base
    assert fast_key((TensorDescriptor.from_tensor(w.view(torch.int32), [1, 32, 8]),)) != base


def test_tensor_only_calls_are_keyed_as_the_general_flattening_keys_them(seed):
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    fast = flatten_call((x, r), {})
    general = runtime.FlatCall([], [], [], [])
    _flatten((x, r), general)
    _flatten({}, general)
    assert fast.structure == tuple(general.structure) and fast.inputs == [x, r]
    assert graph_key(fast) == graph_key(flatten_call((x, r), {}))
    assert graph_key(fast) != graph_key(flatten_call((x, r[:, :4]), {}))
    assert graph_key(fast) != graph_key(flatten_call((x, r), {"scale": 1.0}))


def test_lent_outputs_are_replayed_over_only_once_nothing_holds_them(seed):
    """The use counts _CapturedGraph reads (no replay here: the graph part needs a GPU)."""
    out, buffer = torch.randn(4, 8), torch.randn(4, 8)
    graph = _CapturedGraph(None, [(0, buffer)], (out, out[1:]), ())
    assert graph.watched is not None and graph.idle()
    graph.lent = True
    alias = out.detach()
    assert not graph.idle()
    view = alias[2:]
    del alias
    assert not graph.idle()  # a view of the alias still holds the storage
    del view
    assert graph.idle()
    storage = out.untyped_storage()  # a Python storage object is made once per storage: no holder
    assert graph.idle()
    del storage
    # An output that something else holds (an argument returned as it is, a tensor the model keeps) is never lent.
    kept = out.detach()
    assert _CapturedGraph(None, [], (out,), ()).watched is None
    del kept


def test_keys_above_max_tokens_replay_only_where_timed_replays_beat_the_host_time():
    runner = CudaGraphRunner(lambda x: x, 16, reuse_outputs=False)
    fast, slow = Signature(warm=True, host_s=100e-6, tokens=4096), Signature(warm=True, host_s=30e-6, tokens=4096)
    runner.signatures.update({"fast": fast, "slow": slow})
    graphs = {key: _CapturedGraph(None, [], (torch.zeros(2),), ()) for key in [("fast", ()), ("slow", ()),
                                                                            ("slow", (1,))]}
    runner.graphs.update(graphs)
    for key, signature in (("fast", fast), ("slow", slow)):
        signature.replay_s = (60e-6,)
        assert runner._judge(key, signature) and signature.pays is None  # one timed replay: not decided yet
        signature.replay_s += (50e-6,)
    assert runner._judge("fast", fast) and fast.pays
    assert not runner._judge("slow", slow) and not slow.pays
    assert list(runner.graphs) == [("fast", ())]
    assert "a replay takes 50 us of GPU time, copies included, the call as it is 30 us of host time" in slow.refused
    assert "4096 tokens: replays pay" in runner.describe()


def test_diagnose_overhead_times_each_layer_on_the_cpu(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "diagnose_overhead.py"), "--device", "cpu",
                             "--hidden", "16", "--tokens", "2", "--calls", "3", "--cache-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for layer in ("Dynamo (frame, guards)", "AOTAutograd runtime wrappers", "dzc graph code",
                  "GeneratedKernel (prepare, config)", "family launch (grid, arguments)",
                  "Triton interpreter (runs the kernel: not host time)", "host overhead, all layers"):
        assert layer in result.stdout, result.stdout


# ------------------------------------------------------------------------------------------------------------
# GPU: the real launcher and replays


def _norm_model(hidden, seed, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return AddRMSNorm(hidden).cuda().to(dtype)


def _close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=0.02, rtol=0.02)


@pytest.mark.gpu
def test_cached_launches_match_the_jit_and_respecialize(seed, tmp_path):
    """Back-to-back launches through the cached launcher give the JIT's results, and new alignments, token counts
    (1 is a constant for Triton) and dtypes get their own specialization, never a stale one."""
    model = _norm_model(256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=0,
                                                             check_rewrites=False))
    flat = torch.randn(64 * 256 + 8, device="cuda", dtype=torch.bfloat16)
    cases = [(torch.randn(7, 256, device="cuda", dtype=torch.bfloat16),) * 1,
             (flat[:7 * 256].view(7, 256),), (flat[1:7 * 256 + 1].view(7, 256),),  # 2 bytes off: unaligned
             (torch.randn(1, 256, device="cuda", dtype=torch.bfloat16),),
             (torch.randn(48, 256, device="cuda", dtype=torch.bfloat16),)]
    with torch.no_grad():
        for (x,) in cases:
            r = torch.randn_like(x)
            for _ in range(3):  # first through the JIT, then cached
                _close(compiled(x, r), model(x, r))
        kernel = runtime._KERNELS[compiled.report.kernels[0].kernel_id]
        assert len(kernel.compiled._launchers) >= 3, kernel.compiled._launchers.keys()
        half = _norm_model(256, seed, torch.float16)
        compiled_half = dzc.compile(half, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=0))
        x = torch.randn(7, 256, device="cuda", dtype=torch.float16)
        for _ in range(3):
            _close(compiled_half(x, x.flip(0)), half(x, x.flip(0)))


@pytest.mark.gpu
def test_held_outputs_are_never_overwritten_by_a_replay(seed, tmp_path):
    """Outputs lent by replays stay as they were while held: a loop holding the last step's output gets a twin
    graph, one holding more makes the key copy its outputs out; every output keeps its own call's values."""
    model = _norm_model(256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path)))
    runner = compiled._cuda_graphs
    held, expected = [], []
    with torch.no_grad():
        for step in range(12):
            x, r = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16), torch.randn(4, 256, device="cuda",
                                                                                        dtype=torch.bfloat16)
            y = compiled(x, r)
            if step < 6:
                del y  # dropped at once: replays lend the same buffers again
            elif step < 9:
                held, expected = held[-1:] + [y], expected[-1:] + [model(x, r)]  # the last step's output held
            else:
                held.append(y)
                expected.append(model(x, r))
            for h, e in zip(held, expected):
                _close(h, e)
    assert len(runner.graphs) == 1, runner.describe()
    graph = next(iter(runner.graphs.values()))
    assert graph.twin is not None and "outputs copied out" in runner.describe(), runner.describe()


@pytest.mark.gpu
def test_repeated_keys_above_max_tokens_replay_where_it_pays(seed, tmp_path):
    """Above cuda_graph_max_tokens: a key's first call only records the key, repeated calls are observed,
    captured and their replays timed; whatever is decided, every call's results are the model's."""
    model = _norm_model(256, seed)
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), cuda_graph_max_tokens=8))
    runner = compiled._cuda_graphs
    with torch.no_grad():
        for step in range(10):
            x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
            r = torch.randn_like(x)
            _close(compiled(x, r), model(x, r))
            if step == 1:  # the compiling call, then the key's first call through the runner
                (signature,) = runner.signatures.values()
                assert signature.tokens == 64 and not signature.warm, runner.describe()
            torch.cuda.synchronize()
    (signature,) = runner.signatures.values()
    assert signature.pays is not None, runner.describe()
    assert bool(runner.graphs) == signature.pays, runner.describe()
