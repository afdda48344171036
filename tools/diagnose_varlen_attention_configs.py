"""Which Triton varlen_attention configs fault on this GPU, each run in a fresh process.

    python tools/diagnose_varlen_attention_configs.py [--head-dim 80] [--dtype bfloat16] [--rope]
        [--lengths 1 1000 0 257 4096 64 64 7 2304] [--heads 4] [--config "BLOCK_M=64 ... num_stages=1"]

An illegal memory access poisons the CUDA context, so in one process (as test_triton_on_gpu runs them) the first
faulting config hides every later result. Here every legal config (or the one given) runs in its own child
process on the same seeded pack; the table says, per config: ok (worst error against the reference, NaN count),
or the child's last error line. To see which access faults (global or shared, and the kernel source line, which
Triton's line info carries), run one config under compute-sanitizer:

    compute-sanitizer --tool memcheck --print-limit 5 python tools/diagnose_varlen_attention_configs.py \\
        --rope --config "BLOCK_M=64 BLOCK_N=64 D_HI=16 D_LO=64 num_warps=4 num_stages=1" --in-process

--poison-shared first runs a kernel that leaves NaN across every SM's shared memory: a config whose MMAs read
shared memory outside their tiles (the Triton 3.6 fault of a V tile with 32-byte rows, session 15) then returns
NaN instead of passing by luck on clean memory. --config takes configs the family excludes too (a positive
control: "BLOCK_M=64 BLOCK_N=64 D_HI=16 D_LO=64 num_warps=4 num_stages=2").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import dzc  # noqa: F401  (first: it decides Triton's mode)
import torch
import triton

from dzc.ops.varlen_attention import varlen_attention_reference
from dzc.targets import triton_codegen
from dzc.targets import varlen_attention as family
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import SM_90
from dzc.targets.stale_shared_memory import poison_shared_memory

# Without a GPU the kernels run in Triton's interpreter (a smoke test of this script on small --lengths).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# An output row is a convex combination of value rows: its error is bounded in units of the dtype's epsilon times
# max|v|, as in tests/test_varlen_attention_kernels.py.
MAX_EPSILONS = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 16.0}


def _parse_config(text: str):
    values = dict(item.split("=") for item in text.split())
    return KernelConfig.make(num_warps=int(values.pop("num_warps")), num_stages=int(values.pop("num_stages")),
                             **{name: int(value) for name, value in values.items()})


def run_config(args, config_text: str) -> str:
    """Launch one config on the pack and compare with the reference; a fault raises on the synchronize."""
    dtype = getattr(torch, args.dtype)
    spec = family.make_spec(args.head_dim, dtype, torch.float32 if args.rope else None)
    config = _parse_config(config_text)
    generator = torch.Generator(device=DEVICE).manual_seed(args.seed)
    pack = family.random_pack(tuple(args.lengths), args.heads, args.head_dim, dtype, args.rope, DEVICE, generator)
    path = Path(tempfile.mkdtemp()) / "varlen_attention.py"
    path.write_text(family.triton_source(spec, SM_90))
    kernel = triton_codegen.load(family, path, spec, SM_90)
    inputs, (out,), _work, result = family.prepare(spec, *pack)
    out.fill_(float("nan"))
    if args.poison_shared and DEVICE == "cuda":
        poison_shared_memory()
    family.triton_launch(kernel, config, *inputs, out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    expected = varlen_attention_reference(*pack)
    error = (result.float() - expected.float()).abs().nan_to_num(float("inf")).max().item()
    bound = MAX_EPSILONS[dtype] * torch.finfo(dtype).eps * pack[2].float().abs().max().item()
    verdict = "matches" if error <= bound else "WRONG"
    return f"{verdict}: max abs error {error:.3g} (bound {bound:.3g}), NaN {int(result.isnan().sum())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rope", action="store_true", help="with cos/sin (float32)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 1000, 0, 257, 4096, 64, 64, 7, 2304])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", nargs="+",
                        help="configs as printed (str(KernelConfig)), excluded ones too; default: every legal one")
    parser.add_argument("--poison-shared", action="store_true",
                        help="fill shared memory with NaN before each launch (shows reads outside a tile)")
    parser.add_argument("--in-process", action="store_true", help="run one --config here (for compute-sanitizer)")
    args = parser.parse_args()
    if args.in_process:
        [config] = args.config
        print(run_config(args, config))
        return
    spec = family.make_spec(args.head_dim, getattr(torch, args.dtype), torch.float32 if args.rope else None)
    configs = args.config or [str(c) for c in legal_configs(family, "triton", spec, SM_90)[0]]
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}; {spec.describe()}, lengths "
          f"{args.lengths}, {args.heads} heads, seed {args.seed}"
          f"{'; shared memory poisoned with NaN before each launch' if args.poison_shared else ''}\n")
    print("| config | result |\n|---|---|")
    child = [sys.executable, __file__, "--head-dim", str(args.head_dim), "--dtype", args.dtype, "--heads",
             str(args.heads), "--seed", str(args.seed), "--lengths", *map(str, args.lengths), "--in-process"]
    for config in configs:
        flags = [*(["--rope"] if args.rope else []), *(["--poison-shared"] if args.poison_shared else [])]
        proc = subprocess.run([*child, *flags, "--config", config],
                              capture_output=True, text=True, timeout=600)
        lines = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
        verdict = lines[-1] if proc.returncode == 0 else "FAILED: " + next(
            (line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1])
        print(f"| {config} | {verdict[:200]} |", flush=True)


if __name__ == "__main__":
    main()
