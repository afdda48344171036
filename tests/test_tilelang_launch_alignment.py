"""What TileLang kernels are launched with: dense tensors at 16-byte-aligned base pointers, for every family's
TileLang launch (targets/tilelang_codegen.launch_arguments).

TileLang compiles a kernel for the dense strides its buffers declare and vectorises into 16-byte accesses (uint4 /
float4 in its CUDA) without checking either at launch: an offset view (contiguous, base not aligned) faulted on the
H200 with 'misaligned address' (the fuzzer's add_layer_norm/tilelang case). TileLang cannot run on a CPU, so the
CPU tests check the arguments the launch path hands the kernel; the `gpu` tests launch the real kernels on offset
views and compare with the op's reference.
"""

from __future__ import annotations

import pytest
import torch

from dzc.ops import add_layer_norm_reference, add_rms_norm_reference
from dzc.targets import add_layer_norm, add_rms_norm, dsa_cases, sparse_attention, tilelang_codegen, varlen_attention
from dzc.targets.add_layer_norm import AddLayerNormSpec
from dzc.targets.add_rms_norm import AddRmsNormSpec
from dzc.targets.profiles import SM_90
from dzc.targets.varlen_attention import VarlenAttentionSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def offset_view(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """t as a dense view `elements` past the start of a larger buffer (NaN, or -7, elsewhere): contiguous, with a
    base pointer that is not 16-byte aligned for one element of any dtype narrower than 16 bytes."""
    fill = float("nan") if t.is_floating_point() else -7
    buffer = torch.full((t.numel() + elements + 3,), fill, dtype=t.dtype, device=t.device)
    view = buffer[elements:elements + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def assert_kernel_ready(arguments: tilelang_codegen.LaunchArguments):
    for position, argument in enumerate(arguments.arguments):
        if isinstance(argument, torch.Tensor):
            assert argument.is_contiguous(), f"argument {position} has strides {argument.stride()}"
            assert argument.data_ptr() % 16 == 0, f"argument {position} starts at {argument.data_ptr() % 16} mod 16"


def assert_same_values(kernel_inputs, inputs):
    assert len(kernel_inputs) == len(inputs)
    for got, expected in zip(kernel_inputs, inputs):
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)


def test_offset_view_is_contiguous_but_misaligned():
    """The case .contiguous() alone misses (the fuzzer's offset views)."""
    x = offset_view(torch.randn(5, 13).to(FP16))
    assert x.is_contiguous() and x.contiguous().data_ptr() % 16 == 2
    assert not tilelang_codegen.aligned_dense(x)


@pytest.mark.parametrize("elements", [1, 3])
def test_add_layer_norm_arguments_are_aligned_for_offset_views(elements):
    """fp16 rows and fp32 affine parameters as offset views, as in the fuzzer's crash (x=float16[65, 512])."""
    g = torch.Generator().manual_seed(11)
    spec = AddLayerNormSpec(512, FP16, FP16, FP32, FP32, FP16, FP16, False)
    x, residual = (offset_view(torch.randn(65, 512, generator=g).to(FP16), elements) for _ in range(2))
    weight = offset_view(1 + 0.1 * torch.randn(512, generator=g), elements)
    bias = offset_view(0.1 * torch.randn(512, generator=g), elements)
    inputs, outputs, _, _ = add_layer_norm.prepare(spec, x, residual, weight, bias, 1e-6)
    arguments = add_layer_norm.tilelang_launch_arguments(*inputs, *outputs)
    assert_kernel_ready(arguments)
    assert_same_values(arguments.arguments[:4], (x, residual, weight, bias))
    assert arguments.arguments[4:6] == outputs and arguments.arguments[6] == 1e-6 and not arguments.write_back


class RecordingKernels:
    """Stands in for tilelang_codegen.load's result (TileLang cannot run on a CPU): records what the launch path
    hands the kernel, and writes a recognisable value into its outputs, as a kernel would."""

    def __init__(self, outputs: int):
        self.outputs = outputs
        self.calls = []

    def kernel_for(self, config):
        def kernel(*args):
            self.calls.append(args)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for n, output in enumerate(tensors[-self.outputs:]):
                output.fill_(n + 0.5)
        return kernel


def test_add_rms_norm_launch_copies_offset_inputs_and_writes_back_offset_outputs():
    """Through tilelang_launch: the kernel gets aligned dense copies; outputs that are views (here offset and
    row-strided) get the kernel's values, and the buffers around them are untouched."""
    g = torch.Generator().manual_seed(5)
    spec = AddRmsNormSpec(96, BF16, FP32, BF16, BF16, FP32, True, False)
    x = offset_view(torch.randn(7, 96, generator=g).to(BF16))
    residual = offset_view(torch.randn(7, 96, generator=g), 1)
    weight = offset_view(torch.randn(96, generator=g).to(BF16), 5)
    y = offset_view(torch.full((7, 96), float("nan"), dtype=BF16))
    h_buffer = torch.full((7, 100), float("nan"))
    h = h_buffer[:, :96]
    kernels = RecordingKernels(outputs=2)
    add_rms_norm.tilelang_launch(kernels, add_rms_norm.tilelang_default_config(spec, SM_90),
                                 x, residual, weight, 1e-5, y, h)
    ((*tensors, eps),) = kernels.calls
    assert eps == 1e-5
    for position, argument in enumerate(tensors):
        assert argument.is_contiguous() and argument.data_ptr() % 16 == 0, position
    assert_same_values(tensors[:3], (x, residual, weight))
    assert (y == 0.5).all() and (h == 1.5).all() and h_buffer[:, 96:].isnan().all()


def test_varlen_attention_arguments_are_aligned_for_offset_and_qkv_views():
    g = torch.Generator().manual_seed(3)
    spec = VarlenAttentionSpec(64, FP16, FP32)
    qkv = torch.randn(9, 3, 2, 64, generator=g).to(FP16)  # slices of a fused projection: token stride 3 * 2 * 64
    q, k = qkv[:, 0], qkv[:, 1]
    v = offset_view(qkv[:, 2].contiguous())
    cu_seqlens = offset_view(torch.tensor([0, 4, 9], dtype=torch.int32))
    cos, sin = (offset_view(torch.rand(9, 64, generator=g), 2) for _ in range(2))
    inputs, outputs, _, _ = varlen_attention.prepare(spec, q, k, v, cu_seqlens, 5, 0.125, cos, sin)
    arguments = varlen_attention.tilelang_launch_arguments(*inputs, *outputs)
    assert_kernel_ready(arguments)
    assert_same_values(arguments.arguments[:6], (q, k, v, cu_seqlens, cos, sin))
    assert arguments.arguments[6] is outputs[0] and arguments.arguments[7:] == (5, 0.125)


def test_sparse_attention_arguments_are_aligned_for_offset_views():
    g = torch.Generator().manual_seed(7)
    args = dsa_cases.sparse_attention_args([5, 9], [2, 3], heads=4, kv_heads=1, d_qk=64, d_v=32, separate_v=False,
                                           topk=8, page_size=4, device="cpu", generator=g)
    q, k_cache, _, block_table, seq_lens, query_seq, indices, sm_scale, d_v = args
    q, k_cache, block_table, indices = (offset_view(t) for t in (q, k_cache, block_table, indices))
    spec = sparse_attention.spec_for(q, k_cache, None, indices, d_v)
    inputs, (out,), _, _ = sparse_attention.prepare(spec, q, k_cache, None, block_table, seq_lens, query_seq,
                                                    indices, sm_scale, d_v)
    lse = torch.empty(1, 1, 1)
    arguments = sparse_attention.tilelang_launch_arguments(*inputs[:8], out, lse)
    assert_kernel_ready(arguments)
    kernel_inputs = arguments.arguments[:7]
    assert_same_values(kernel_inputs, (q, k_cache, k_cache, block_table, seq_lens, query_seq, indices))
    assert kernel_inputs[1] is kernel_inputs[2], "the cache serving as keys and values is copied once"


# ---------------------------------------------------------------------------------------------------------
# GPU: the real kernels on offset views (the lead runs these on the H200)


def _gpu_profile():
    from dzc.targets import TARGETS
    major, _ = torch.cuda.get_device_capability()
    return {9: TARGETS["cuda:sm_90"], 8: TARGETS["cuda:sm_80"]}[major].profile


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", ["add_layer_norm", "add_rms_norm"])
def test_tilelang_norms_on_offset_views_match_reference(family_name, tmp_path):
    """The fuzzer's crash: fp16 [65, 512] rows one element past an aligned base, affine parameters likewise, and
    offset outputs; outputs NaN-poisoned, compared with the op's reference."""
    family = {"add_layer_norm": add_layer_norm, "add_rms_norm": add_rms_norm}[family_name]
    g = torch.Generator().manual_seed(2026)
    tokens, hidden, eps = 65, 512, 1e-6
    x = offset_view(torch.randn(tokens, hidden, generator=g).to(FP16).cuda())
    residual = offset_view(torch.randn(tokens, hidden, generator=g).to(FP16).cuda(), 3)
    weight = offset_view((1 + 0.1 * torch.randn(hidden, generator=g)).cuda())
    bias = offset_view((0.1 * torch.randn(hidden, generator=g)).cuda())
    y = offset_view(torch.full((tokens, hidden), float("nan"), dtype=FP16, device="cuda"))
    h = offset_view(torch.full((tokens, hidden), float("nan"), dtype=FP16, device="cuda"), 5)
    profile = _gpu_profile()
    if family is add_layer_norm:
        spec = AddLayerNormSpec(hidden, FP16, FP16, FP32, FP32, FP16, FP16, False)
        params = (weight, bias)
        expected_y, expected_h = add_layer_norm_reference(x, residual, weight, bias, eps, False, FP16, FP16)
    else:
        spec = AddRmsNormSpec(hidden, FP16, FP16, FP32, FP16, FP16, False, True)
        params = (weight,)
        expected_y, expected_h = add_rms_norm_reference(x, residual, weight, eps, False, True, FP16, FP16, FP32,
                                                        False)
    path = tmp_path / "kernel.py"
    path.write_text(family.tilelang_source(spec, profile))
    kernels = tilelang_codegen.load(family, path, spec, profile)
    config = family.tilelang_default_config(spec, profile)
    family.tilelang_launch(kernels, config, x, residual, *params, eps, y, h)
    torch.cuda.synchronize()
    torch.testing.assert_close(h, expected_h, atol=0, rtol=0)
    torch.testing.assert_close(y, expected_y, atol=2e-3, rtol=2e-3)
