"""Triton kernels compiled ahead of a graph's first call (DZC_TRITON_PRECOMPILE, triton_codegen.Precompile): each
kernel's launch made on meta tensors must compile exactly the specialization the call's own launch then looks up,
and launch nothing."""

import contextlib
import textwrap

import pytest
import torch
from conftest import run_ahead_of_time_script
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dzc.lowering import Execution, _meta_argument, lower_graph, precompile_jobs
from dzc.ops import OPS
from dzc.options import CompileOptions
from dzc.targets import KERNEL_FAMILIES, TARGETS
from dzc.targets.triton_codegen import Precompile

# Run without Triton's interpreter (this pytest process may interpret), for sm_90 under a driver that compiles only:
# the CPU host has no GPU. Each family's first selftest case is traced and lowered as dzc.compile lowers a graph;
# its precompile job runs; then the op runs on the case's real (CPU) tensors with launches compile-only, and
# Triton's post-compile hook counts what that call still had to compile.
_WORKER = textwrap.dedent("""
    import contextlib, json, sys
    import dzc, torch, triton
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._library.custom_ops import OPDEFS
    from triton.backends.compiler import GPUTarget
    from dzc.lowering import Execution, lower_graph, precompile_jobs
    from dzc.ops import OPS
    from dzc.options import CompileOptions
    from dzc.targets import KERNEL_FAMILIES, TARGETS, triton_codegen
    from dzc.targets.launch import COMPILE_ONLY

    class CompileOnlyDriver:  # what JITFunction.run asks of the active driver before it would launch
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_active_torch_device(self): return torch.device("cpu")

    triton.runtime.driver.set_active(CompileOnlyDriver())
    compiles = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiles.append(1)
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=sys.argv[1] + "/dzc", autotune=False, codegen="triton")
    results = {}
    for op in KERNEL_FAMILIES:
        case, make = KERNEL_FAMILIES[op].selftest_cases(target.profile)[0]
        args = make(torch.device("cpu"), torch.Generator().manual_seed(0))
        graph = make_fx(lambda *a: OPS[op][0](*a), tracing_mode="fake")(*args).graph
        lower_graph(graph, target, options, Execution(target.runtime), torch.device("cuda", 0))
        jobs = precompile_jobs(graph)
        before = len(compiles)
        batch = triton_codegen.Precompile(jobs, contextlib.nullcontext, 2)
        batch.wait()
        ahead = len(compiles) - before
        [node] = [n for n in graph.nodes if "kernel_id" in n.kwargs]
        token = COMPILE_ONLY.set(True)
        OPDEFS[node.target._schema.name]._init_fn(*args, kernel_id=node.kwargs["kernel_id"])
        COMPILE_ONLY.reset(token)
        results[op] = dict(case=case, jobs=len(jobs), compiled=batch.compiled, failed=batch.failed,
                           skipped=dict(batch.skipped), ahead=ahead, at_call=len(compiles) - before - ahead)
    print("RESULTS " + json.dumps(results))
""")


def test_each_family_precompiles_what_its_first_call_launches(tmp_path):
    results = run_ahead_of_time_script(_WORKER, tmp_path, timeout=900)
    assert set(results) == set(KERNEL_FAMILIES)
    for op, result in results.items():
        assert result["jobs"] == 1 and not result["skipped"] and not result["failed"], (op, result)
        # Every kernel the call launches was compiled ahead (MoE: routing and GEMMs), none again at the call.
        assert result["compiled"] == result["ahead"] >= 1 and result["at_call"] == 0, (op, result)


def test_a_job_that_cannot_run_on_meta_tensors_is_skipped_and_reported():
    told = []
    jobs = [("reads.a.value", lambda: torch.empty(1, device="meta").item()), ("nothing", lambda: None)]
    batch = Precompile(jobs, contextlib.nullcontext, 1)
    Precompile.wait_all()  # what a kernel's first launch does
    assert batch not in Precompile._running
    batch.when_done(told.append)  # done already: told at once
    assert batch.compiled == batch.failed == 0
    assert list(batch.skipped.values()) == [1] and next(iter(batch.skipped)).startswith("reads.a.value: ")
    assert told == [batch.describe()] and "skipped: 1 x reads.a.value" in told[0]


@pytest.mark.parametrize("offset", [0, 3, 8])
def test_meta_arguments_keep_the_alignment_of_the_traced_values(offset):
    """Triton specialises a pointer on 16-byte alignment: a view's storage offset must carry over."""
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    with FakeTensorMode():
        node.meta["val"] = torch.empty(200, dtype=torch.bfloat16)[offset:offset + 96].view(8, 12)[:, :10]
    meta = _meta_argument(node)
    assert meta.device.type == "meta" and meta.shape == (8, 10) and meta.stride() == (12, 1)
    assert meta.data_ptr() == 2 * offset  # bf16: 2 bytes an element, from an aligned base


def test_jobs_take_plain_meta_tensors_under_the_compiles_fake_mode():
    """dzc lowers inside Dynamo's backend call, under its fake mode: a job's arguments must still be meta tensors
    with an address (session 44, H100: the MoE's fake arguments had none, and nothing was compiled ahead)."""
    target = TARGETS["cuda:sm_90"]
    _, make = KERNEL_FAMILIES["add_rms_norm"].selftest_cases(target.profile)[0]
    args = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    graph = make_fx(lambda *a: OPS["add_rms_norm"][0](*a), tracing_mode="fake")(*args).graph
    lower_graph(graph, target, CompileOptions(autotune=False, codegen="triton"), Execution(target.runtime),
                torch.device("cuda", 0))
    with FakeTensorMode():
        [(_, job)] = precompile_jobs(graph)
    tensors = [a for a in job.__defaults__[1] if isinstance(a, torch.Tensor)]
    assert tensors and all(type(t) is torch.Tensor and t.is_meta for t in tensors), [type(t) for t in tensors]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


@pytest.mark.gpu
def test_the_first_call_on_a_gpu_launches_the_kernels_compiled_ahead(tmp_path, monkeypatch):
    """The MoE block (routing and GEMM kernels): with DZC_TRITON_PRECOMPILE=1 every Triton kernel the first call
    launches was compiled ahead (Triton's post-compile hook fires for those only), and the output is bit for bit
    what the same compile gives without it (the same kernels and configs)."""
    import triton

    import dzc
    from dzc import config
    from dzc.models import build_model

    model, inputs = build_model("moe_mxfp4")
    model = model.cuda()
    inputs = [i.cuda() if isinstance(i, torch.Tensor) else i for i in inputs]
    outputs, reports, compiles = {}, {}, []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda *args, **kwargs: compiles.append(1))
    for knob in ("1", "0"):
        torch._dynamo.reset()
        with config.scope(DZC_TRITON_PRECOMPILE=knob), torch.no_grad():
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / knob), autotune=False))
            outputs[knob] = compiled(*inputs)
        torch.cuda.synchronize()
        Precompile.wait_all()
        reports[knob] = compiled.report
        if knob == "1":
            compiled_with_it = len(compiles)
    [graph] = reports["1"].graphs
    assert "mxfp4_moe" in {k.op for k in reports["1"].kernels}
    ahead = int(graph.triton_precompile.split(" kernel specializations compiled ahead")[0])
    assert ahead >= 2 and "skipped" not in graph.triton_precompile and "failed" not in graph.triton_precompile, \
        graph.triton_precompile  # (session 43, H100: 0 compiled ahead; the message was not kept)
    assert compiled_with_it == ahead, graph.triton_precompile  # nothing compiled at the call itself
    assert reports["0"].graphs[0].triton_precompile == ""
    assert torch.equal(outputs["1"], outputs["0"])
