"""MUSA-constrained runs on a CUDA GPU: the kernels dzc generates for mp_22 / mp_31, run with only MUSA-legal
configs at the same threads per block and with MUSA dtypes, checked against the op references, with Triton's
compiled shared memory checked against the MUSA profile's limit.

What it proves: the algorithms and the MUSA-constrained launch shapes are right, and the kernels fit MUSA's shared
memory as compiled by NVIDIA Triton. What it cannot prove: anything about MUSA code generation (see docs/musa.md).

    python tools/musa_constrained_runs.py --out $OUT/musa_constrained.md [--json $OUT/musa_constrained.json]
        [--quick] [--family NAME ...] [--profile musa:mp_22 ...] [--tilelang] [--device cpu]

For every kernel family with selftest_cases and each MUSA profile: every self-test case of the profile (its
dtypes only; --quick: the first), every legal Triton config of the profile (--quick: the default and the widest),
launched with num_warps × warp_size / 32 CUDA warps (one 128-lane mp_22 warp = four CUDA warps). --tilelang also
compiles the MUSA-profile TileLang source for sm_90 with the MUSA pass configs upstream TileLang knows, and runs
its default config. An op with no legal config on a profile (W4A8 MoE on mp_22, which has no FP8) is listed as
"not on this profile", not run. Needs a CUDA GPU; --device cpu is the tool's smoke test (Triton's interpreter on
CPU tensors, with TRITON_INTERPRET=1: no compiled shared memory, no TileLang).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

import dzc
from dzc.lowering import Execution, NoLegalConfig
from dzc.ops import OPS
from dzc.options import CompileOptions
from dzc.selftest import DEFAULT_TOLERANCES, UNSUPPORTED, compare_outputs, lower_op
from dzc.targets import KERNEL_FAMILIES, TARGETS, tilelang_codegen, triton_codegen
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, MP_31, SM_90, DeviceProfile


def cuda_config(config: KernelConfig, profile: DeviceProfile) -> KernelConfig:
    """The same threads per block in 32-lane CUDA warps."""
    return dataclasses.replace(config, num_warps=config.num_warps * profile.warp_size // 32)


def compiled_shared_bytes(loaded) -> int:
    """The largest shared memory of the Triton kernels `loaded` has compiled so far (Triton's metadata)."""
    functions = loaded.values() if isinstance(loaded, dict) else [loaded]
    largest = 0
    for fn in functions:
        compiled = getattr(fn, "_compiled", None)  # dzc's launch cache around the JIT function
        kernels = list(compiled.values()) if compiled is not None else [
            k for cache in fn.device_caches.values() for k in cache[0].values()]
        largest = max([largest, *(k.metadata.shared for k in kernels)])
    return largest


def run_case(family_name: str, profile: DeviceProfile, case: str, make_args, seed: int, quick: bool,
             cache_dir: str, tilelang: bool, device: torch.device) -> list[dict]:
    """Rows for one case. On a CPU device (a smoke test of this tool) Triton runs interpreted: no compiled
    shared memory to read, and no TileLang."""
    family = KERNEL_FAMILIES[family_name]
    target = TARGETS[profile.name]
    args = make_args(device, torch.Generator(device=device).manual_seed(seed))
    reference = OPS[family_name][1](*args)
    tolerances = {**DEFAULT_TOLERANCES, **getattr(family, "SELFTEST_TOLERANCES", {})}
    rows = []
    codegens = ["triton"] + (["tilelang"] if tilelang and hasattr(family, "tilelang_source") else [])
    for codegen in codegens:
        options = CompileOptions(codegen=codegen, autotune=False, cache_dir=cache_dir)
        record, spec = lower_op(family_name, args, target, options, Execution(None, "run here by hand"))
        path = Path(record.source_path)
        legal, _ = legal_configs(family, codegen, spec, profile)
        default = getattr(family, f"{codegen}_default_config")(spec, profile)
        if codegen == "triton":
            loaded = triton_codegen.load(family, path, spec, profile)
            configs = [default, legal[-1]] if quick else legal
            launch_configs = [(c, cuda_config(c, profile)) for c in dict.fromkeys(configs)]
        else:  # the MUSA-profile program compiled for sm_90, with the MUSA pass configs upstream knows
            proxy = dataclasses.replace(SM_90, tilelang_pass_configs=profile.tilelang_pass_configs)
            loaded = tilelang_codegen.KernelsByConfig(path, family.TILELANG_FACTORY_NAME, proxy)
            launch_configs = [(default, default)]  # THREADS is a parameter: the same threads per block
        for musa_config, launched in launch_configs:
            row = {"family": family_name, "profile": profile.name, "codegen": codegen, "case": case,
                   "config": str(musa_config), "cuda_num_warps": launched.num_warps, "seed": seed}
            try:
                inputs, outputs, tokens, results = family.prepare(spec, *args)
                getattr(family, f"{codegen}_launch")(loaded, launched, *inputs, *outputs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row["numerics"] = compare_outputs(results, reference, tolerances)
            except Exception as err:
                row["numerics"] = {"ok": False, "why": f"{type(err).__name__}: {err}"[:500]}
            rows.append(row)
        if codegen == "triton" and device.type == "cuda":
            shared = compiled_shared_bytes(loaded)
            for row in rows:
                if row["codegen"] == "triton":
                    row["shared"], row["shared_limit"] = shared, profile.shared_memory_per_block
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="markdown table")
    parser.add_argument("--json", help="every row as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="each family's first case, with the default and the widest config only")
    parser.add_argument("--family", action="append", choices=sorted(KERNEL_FAMILIES))
    parser.add_argument("--profile", action="append", choices=[MP_22.name, MP_31.name],
                        help="only this MUSA profile (repeatable); default both")
    parser.add_argument("--tilelang", action="store_true", help="also TileLang (compiles take ~10 s each)")
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--cache-dir", default="/tmp/dzc-musa-constrained")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke test of this tool (Triton interpreted; needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("musa_constrained_runs: needs a CUDA GPU (--device cpu smoke-tests the tool)", file=sys.stderr)
        return 2
    if device.type == "cpu" and not triton_codegen.interpreting():
        print("musa_constrained_runs: --device cpu runs Triton through its interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2

    rows = []
    unsupported: list[str] = []
    for family_name in args.family or sorted(KERNEL_FAMILIES):
        family = KERNEL_FAMILIES[family_name]
        if not hasattr(family, "selftest_cases"):
            print(f"{family_name}: no selftest cases, skipped")
            continue
        for profile in (p for p in (MP_22, MP_31) if not args.profile or p.name in args.profile):
            for index, (case, make_args) in enumerate(family.selftest_cases(profile)):
                if args.quick and index > 0:
                    break
                try:
                    case_rows = run_case(family_name, profile, case, make_args, args.seed + index, args.quick,
                                         args.cache_dir, args.tilelang and device.type == "cuda", device)
                except NoLegalConfig as err:  # the op does not exist there (W4A8 MoE needs FP8)
                    print(f"skip {family_name} {profile.name} {case}: {UNSUPPORTED} ({err})", flush=True)
                    unsupported.append(f"{family_name} on {profile.name}: {err}".replace("dzc: ", ""))
                    break
                for row in case_rows:
                    ok = row["numerics"]["ok"] and row.get("shared", 0) <= row.get("shared_limit", 1 << 62)
                    row["ok"] = ok
                    print(f"{'ok  ' if ok else 'FAIL'} {family_name} {profile.name} {row['codegen']} {case} "
                          f"[{row['config']}] {row['numerics'].get('why', '')}", flush=True)
                rows.extend(case_rows)

    failed = [r for r in rows if not r["ok"]]
    where = torch.cuda.get_device_name() if device.type == "cuda" else "the CPU (Triton interpreter: smoke test)"
    lines = [f"# MUSA-constrained runs on {where}",
             "", f"{datetime.date.today()}; torch {torch.__version__}, triton {triton_codegen.VERSION}, "
                 f"tilelang {tilelang_codegen.VERSION}, dzc {dzc.__version__}; seed {args.seed}"
                 f"{'; --quick' if args.quick else ''}", "",
             "| family | profile | codegen | case | configs | numerics ok | max compiled shared / limit (B) |",
             "|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["profile"], row["codegen"], row["case"]), []).append(row)
    for (family_name, profile, codegen, case), group in groups.items():
        ok = sum(r["numerics"]["ok"] for r in group)
        shared = f"{group[0]['shared']} / {group[0]['shared_limit']}" if "shared" in group[0] else "n/a (TileLang)"
        lines.append(f"| {family_name} | {profile} | {codegen} | {case} | {len(group)} | {ok}/{len(group)} | "
                     f"{shared} |")
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} runs passed."]
    lines += [f"- {UNSUPPORTED}: {what}" for what in unsupported]
    lines += [f"- FAIL {r['family']} {r['profile']} {r['codegen']} {r['case']} [{r['config']}]: "
              f"{r['numerics'].get('why', '')} shared {r.get('shared')}" for r in failed]
    Path(args.out).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
