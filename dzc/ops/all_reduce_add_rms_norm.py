"""dzc.all_reduce_add_rms_norm: the all-reduce that ends a row-parallel projection (tensor parallelism), fused with
the residual add + RMSNorm after it.

    h = all_reduce_sum(x, group) + residual;  y = rms_norm(h) * weight      (add_rms_norm's arguments otherwise)

The all-reduce is torch.distributed's (the group's backend: NCCL, MCCL through torch_musa, gloo), as the functional
collective the graph had: the sum is taken in x's dtype, exactly as the captured `wait_tensor(all_reduce(x))`.

Lowering: where no kernel family takes the op (today everywhere), `lower_as_parts` turns a node back into the
functional all-reduce and a dzc.add_rms_norm node, which gets dzc's fused kernel: two launches, correct on every
backend. That stays the default.

A one-shot kernel exists beside it (targets/all_reduce_add_rms_norm.py, template
targets/templates/all_reduce_add_rms_norm.triton.py.tmpl): each rank copies x into a symmetric-memory buffer
(torch.distributed._symmetric_memory), a barrier on the signal pads (system-scope release/acquire atomics; no
multicast), every program sums its rows over all ranks' buffers in rank order in fp32, rounded once to x's dtype
(for 2 ranks bit-identical to the backend's sum; for more, within (WORLD - 2) ulps of x's dtype of the backend's,
whose order the backend chooses), then add + RMSNorm exactly as add_rms_norm's kernel, then a second barrier. It
is gated on the profile's `symmetric_memory` and is not registered as a kernel family of this op, so no graph is
lowered to it; tools/bench_distributed.py calls it directly (OneShotAllReduceAddRmsNorm). Verified on the CPU only:
numerics under Triton's interpreter with 1-4 ranks simulated in one process (the barrier compiled out), and the
kernel with its barrier compiled ahead of time for sm_90 (system-scope CAS in the PTX, no multimem); no GPU has
run it (tests/test_all_reduce_kernel.py: world size 1 on one GPU, 2 ranks on 2 GPUs).
"""

from __future__ import annotations

import torch
import torch.fx

from dzc import runtime
from dzc.ops.add_rms_norm import add_rms_norm_reference

_c10d = torch.ops._c10d_functional


def all_reduce_add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    divide_by_rms: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The functional all-reduce (sum over the process group named `group_name`, in x's dtype), then
    add_rms_norm's reference with the reduced x. Returns (y in out_dtype, h in sum_dtype)."""
    reduced = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))
    return add_rms_norm_reference(reduced, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype,
                                  sum_dtype, compute_dtype, divide_by_rms)


@torch.library.custom_op("dzc::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    sum_in_fp32: bool,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    divide_by_rms: bool,
    group_name: str,
    kernel_id: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype, compute_dtype,
            divide_by_rms, group_name)
    if kernel_id:
        return runtime.launch(kernel_id, *args)
    return all_reduce_add_rms_norm_reference(*args)


@all_reduce_add_rms_norm.register_fake
def _fake(x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype, compute_dtype,
          divide_by_rms, group_name, kernel_id=""):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(shape, dtype=sum_dtype)


def lower_as_parts(node: torch.fx.Node) -> None:
    """Replace a dzc.all_reduce_add_rms_norm node (in place) by what it means: wait_tensor(all_reduce(x, "sum",
    group)) and a dzc.add_rms_norm node of the same arguments, whose kernel lowering then chooses."""
    graph = node.graph
    x, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype, sum_dtype, compute_dtype, \
        divide_by_rms, group_name = node.args[:11]
    with graph.inserting_before(node):
        started = graph.call_function(_c10d.all_reduce.default, (x, "sum", group_name))
        started.meta["val"] = x.meta["val"]
        reduced = graph.call_function(_c10d.wait_tensor.default, (started,))
        reduced.meta["val"] = x.meta["val"]
        fused = graph.call_function(torch.ops.dzc.add_rms_norm.default,
                                    (reduced, residual, weight, eps, sum_in_fp32, cast_before_weight, out_dtype,
                                     sum_dtype, compute_dtype, divide_by_rms))
    for key in ("val", "stack_trace"):
        if key in node.meta:
            fused.meta[key] = node.meta[key]
    node.replace_all_uses_with(fused)
    graph.erase_node(node)
