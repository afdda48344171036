"""Where does an mxfp4_moe call spend its time? Per-kernel GPU time of the whole op (routing, activation reorder,
gate/up GEMM, split-K activation, down GEMM, combine) for a few configs, beside OpenAI's triton_kernels layer, from
torch.profiler's CUDA activity (H200; the same random layers and routing as tools/bench_mxfp4_moe.py).

    python tools/diagnose_mxfp4_moe_kernels.py [--models gpt-oss-120b] [--tokens 1 8 64] \
        [--configs "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,num_stages=3" ...] [--once]
    python tools/diagnose_mxfp4_moe_kernels.py --dry-run   # CPU: the configs checked for legality, no launches

A config is KEY=VALUE pairs (num_warps and num_stages among them; WORKSPACE=0 unless given). Each config is
checked against the op's reference first. Prints, per (model, tokens, variant), each kernel's mean µs per call and
the sum, and, for the GEMMs, the packed weight bytes of the experts touched ÷ the kernel's time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mxfp4_moe as bench  # noqa: E402

from dzc.ops.mxfp4_moe import mxfp4_moe_reference  # noqa: E402
from dzc.targets.kernel_config import KernelConfig  # noqa: E402
from dzc.targets.launch import legal_configs  # noqa: E402
from dzc.targets.profiles import SM_90  # noqa: E402

DEFAULT_CONFIGS = (
    "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,num_warps=4,num_stages=3",
    "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=1,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3",
    "BLOCK_M=16,BLOCK_N=128,BLOCK_K=128,SPLIT_K=1,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3",
)
CALLS = 20


def parse_config(text: str) -> KernelConfig:
    fields = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    warps, stages = fields.pop("num_warps", 4), fields.pop("num_stages", 3)
    fields.setdefault("WORKSPACE", 0)
    return KernelConfig.make(num_warps=warps, num_stages=stages, **fields)


def kernel_times(fn) -> dict[str, float]:
    """Mean GPU µs per call of each kernel `fn` launches (CALLS calls after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / CALLS
    return dict(totals)


def touched_weight_bytes(spec, topk_ids) -> tuple[int, int]:
    """Packed bytes + scales of the touched experts, (gate/up weight, down weight)."""
    experts = int(torch.unique(topk_ids).numel())
    gate_up = 2 * spec.inter * spec.hidden * experts * (1 / 2 + 1 / 32)
    down = spec.hidden * spec.inter * experts * (1 / 2 + 1 / 32)
    return int(gate_up), int(down)


def report(label: str, times: dict[str, float], weight_bytes: tuple[int, int]) -> None:
    print(f"{label}: total {sum(times.values()):.1f} µs")
    for name, us in sorted(times.items(), key=lambda item: -item[1]):
        gemm = ("gate_up" in name and weight_bytes[0]) or ("down" in name and weight_bytes[1]) or 0
        bandwidth = f"  ({gemm / us / 1e6:.2f} TB/s of its weights)" if gemm and us > 0 else ""
        print(f"    {us:8.1f} µs  {name[:100]}{bandwidth}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b"], choices=sorted(bench.MODEL_LAYERS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--once", action="store_true",
                        help="run each variant once, no profiler (for a run under Nsight Compute's ncu)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: parse the configs and check each is a legal Triton config of the models' layers "
                             "on sm_90; nothing launched")
    args = parser.parse_args()
    configs = [parse_config(text) for text in args.configs]
    if args.dry_run:
        for model in args.models:
            spec = bench.model_spec(model)
            legal, _ = legal_configs(bench.family, "triton", spec, SM_90)
            for config in configs:
                if config not in legal:
                    sys.exit(f"{config} is not a legal Triton config of {model} on {SM_90.name}")
                print(f"dry run: {model} T={args.tokens} {config}")
        return
    if not torch.cuda.is_available():
        sys.exit("diagnose_mxfp4_moe_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    tk, tk_origin = bench.load_triton_kernels(None)
    print(f"GPU: {torch.cuda.get_device_name()}; triton_kernels: {tk_origin}")
    workdir = Path(tempfile.mkdtemp(prefix="dzc-diagnose-moe-"))
    for model in args.models:
        layer = bench.random_layer(model, device, generator)
        kernels = bench.DzcKernels(layer.spec, "triton", workdir)
        tk_moe = bench.TritonKernelsMoE(tk, layer) if tk is not None else None
        for tokens in args.tokens:
            hidden, ids, weights = bench.random_routing(layer.spec, tokens, False, device, generator)
            op_args = layer.args(hidden, ids, weights)
            expected = mxfp4_moe_reference(*op_args)
            weight_bytes = touched_weight_bytes(layer.spec, ids)
            for config in configs:
                bench.check(f"dzc {config}", kernels.run(config, op_args), expected)
                if args.once:
                    continue
                report(f"{model} T={tokens} dzc {config}", kernel_times(lambda c=config: kernels.run(c, op_args)),
                       weight_bytes)
            if tk_moe is not None:
                routed = tk_moe.routed(ids, weights)
                if args.once:
                    routed(hidden)
                    continue
                report(f"{model} T={tokens} triton_kernels {tk_moe.describe(tokens)}",
                       kernel_times(lambda: routed(hidden)), weight_bytes)


if __name__ == "__main__":
    main()
