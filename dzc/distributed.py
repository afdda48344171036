"""dzc on several devices: what capture needs to know about collectives, and ranks simulated on the CPU (the
reference sharded models are dzc.models.distributed).

dzc has no communication layer: models communicate through torch.distributed (functional collectives, which
Dynamo traces into the graph as `_c10d_functional.*` + `wait_tensor`; DTensor's parallel styles desugar to them),
on the backend the profile names (`DeviceProfile.collective_backend`), or gloo for CPU tensors.

The rewrite check (dzc/capture.py) runs a graph twice on its first call; a graph with collectives issues them twice
then, on every rank, which is right only if every rank runs the same sequence. `rank_agreement` makes the check's
decisions (skip, passed, which pass to drop) the same on every rank of the graph's process group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx


_COLLECTIVE_NAMESPACE = "_c10d_functional"
_GROUP_ARGUMENT = "group_name"


def collective_groups(graph: torch.fx.Graph) -> list[str]:
    """The process-group names the graph's collectives run over (functional collectives, and dzc ops that
    communicate: those with a `group_name` argument), in order of first use."""
    groups: dict[str, None] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != _COLLECTIVE_NAMESPACE and target.namespace != "dzc":
            continue
        for position, argument in enumerate(target._schema.arguments):
            if argument.name == _GROUP_ARGUMENT:
                value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
                if isinstance(value, str):
                    groups[value] = None
    return list(groups)


def rank_agreement(graph: torch.fx.Graph, device) -> tuple[Callable[[bool], bool] | None, str]:
    """For the rewrite check of `graph`: (any_rank, ""), where any_rank(flag) is whether `flag` holds on any rank
    of the graph's process group (every rank calls it at the same points and gets the same answer), or (None, why)
    where the ranks cannot agree. A graph without collectives agrees with itself."""
    groups = collective_groups(graph)
    if not groups:
        return (lambda flag: flag), ""
    if len(groups) > 1:
        return None, (f"the graph communicates over {len(groups)} process groups ({', '.join(groups)}): the ranks "
                      "running it cannot agree on what the check runs, and a rank running a collective that another "
                      "skips would wait for it forever")
    group = dist.distributed_c10d._resolve_process_group(groups[0])
    device = torch.device(device) if device is not None else torch.device("cpu")

    def any_rank(flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    return any_rank, ""


def rank_tag() -> str:
    """"rank<r>" in a process of an initialised process group with more than one rank, else "" (dump paths)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank{dist.get_rank()}"
    return ""


def backend_for(device: torch.device, profile=None) -> str:
    """The torch.distributed backend for tensors on `device`: gloo for CPU tensors, else the profile's."""
    if device.type == "cpu":
        return "gloo"
    return profile.collective_backend if profile is not None and profile.collective_backend else "nccl"


# ---------------------------------------------------------------------------------------------------------------
# Simulated ranks: processes on this machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    device = None
    if backend != "gloo":  # one GPU per rank
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable, world: int, *args, backend: str = "gloo") -> None:
    """Run fn(rank, world, *args) in `world` new processes joined by a process group and wait for them; an
    exception in a rank is raised here. gloo: CPU tensors; another backend (nccl): rank r on GPU r. `fn` must be
    importable (a module-level function). Without a GPU, TRITON_INTERPRET=1 is set for the ranks: Triton imported
    by torch.distributed before dzc would miss it."""
    import torch.multiprocessing as mp  # noqa: PLC0415 (only the launcher needs it)

    if backend == "gloo" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    mp.spawn(_run_rank, args=(world, free_port(), backend, fn, args), nprocs=world, join=True)
