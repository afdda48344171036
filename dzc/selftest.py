"""dzc-selftest: generate every kernel dzc has for a target, check it, and (on the device) run and time it.

    dzc-selftest --target musa --json selftest_musa.json     # on a MUSA machine: the first thing to run
    dzc-selftest --target cuda --dry-run                      # anywhere: generate, check legality, compile here

For every dzc op with kernels (targets.KERNEL_FAMILIES) × its code generators × case its family offers for the
profile (`selftest_cases(profile)`: named small cases with the dtypes the profile allows), it lowers the op
through dzc's own lowering (the path dzc.compile takes), checks every legal config and the generated source
statically (targets/static_check.py), and then:
  on the device: calls the op with the kernel bound, on fresh random inputs (the seed is in the report), compares
    with the op's reference (dzc.ops.OPS) and times both;
  with --dry-run (no device needed): compiles what this machine can compile: Triton ahead of time when the
    installed Triton targets the profile's backend, plus, for MUSA profiles, the same source for sm_90 with the
    same threads per block (a proxy that checks Triton's shared-memory use against the MUSA limit); TileLang
    lowered to device source where the installed TileLang has the target (tilelang_musa for MUSA).
A family without selftest_cases is listed as "no selftest cases", and a code generator the machine lacks (TileLang
without tilelang_musa on a MUSA card) as "unavailable": neither is a failure (families land before their cases;
Triton alone runs every op), but the summary names them; nor is an op with no legal config on the profile
("not on this profile": W4A8 MoE needs native FP8). Exit status: 0 when nothing failed; 1 when something
did; 2 when the device asked for is not here.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dzc
from dzc.dump import find_target, run_cli
from dzc.lowering import PREFERRED_CODEGENS, Execution, NoLegalConfig, dzc_op_name, lower_graph
from dzc.ops import OPS
from dzc.options import CompileOptions
from dzc.targets import KERNEL_FAMILIES, Target, musa_triton, resolve_target, static_check, tilelang_codegen
from dzc.targets import external_kernels
from dzc.targets.device_runtime import DeviceRuntime, dsl_versions
from dzc.targets.profiles import SM_90

# (atol, rtol) of an output against the reference, by dtype: about two units in the last place at unit
# magnitude for 16-bit types (a fused kernel rounds once where the reference rounds at each step), and a
# reduction-order allowance for fp32. A family may set SELFTEST_TOLERANCES to override entries.
DEFAULT_TOLERANCES = {
    torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 2**-6),
    torch.float8_e4m3fn: (0.125, 0.125), torch.float8_e5m2: (0.25, 0.25),
}

NO_CASES = "no selftest cases"
UNSUPPORTED = "not on this profile"


# ---------------------------------------------------------------------------------------------------------
# One case through dzc's lowering


def lower_op(op: str, args: tuple, target: Target, options: CompileOptions, execution: Execution):
    """Trace a call of dzc op `op` on `args` (fake tensors: nothing runs) and lower it for `target`.

    Returns (kernel record, spec): the kernel is registered under record.kernel_id, so `op(*args,
    kernel_id=record.kernel_id)` runs it, exactly as a compiled graph does.
    """
    op_overload = OPS[op][0]
    graph_module = make_fx(lambda *a: op_overload(*a), tracing_mode="fake")(*args)
    [node] = [n for n in graph_module.graph.nodes if dzc_op_name(n) == op]
    spec = KERNEL_FAMILIES[op].spec_from_node(node)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    [record] = lower_graph(graph_module.graph, target, options, execution, device)
    return record, spec


def _flatten(value) -> list:
    if isinstance(value, (tuple, list)):
        return [item for v in value for item in _flatten(v)]
    return [value]


def compare_outputs(actual, expected, tolerances: dict) -> dict:
    """Each output against the reference: shape, dtype, no NaN the reference lacks, within tolerance."""
    actual, expected = _flatten(actual), _flatten(expected)
    if len(actual) != len(expected):
        return {"ok": False, "why": f"{len(actual)} outputs, the reference has {len(expected)}"}
    worst = 0.0
    for index, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(e, torch.Tensor):
            if a != e:
                return {"ok": False, "why": f"output {index}: {a!r} != {e!r}"}
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            return {"ok": False, "why": f"output {index}: {a.dtype} {tuple(a.shape)}, reference "
                                        f"{e.dtype} {tuple(e.shape)}"}
        if not e.is_floating_point():
            if not torch.equal(a.cpu(), e.cpu()):
                return {"ok": False, "why": f"output {index}: {int((a != e).sum())} elements differ"}
            continue
        a32, e32 = a.float().cpu(), e.float().cpu()
        if (a32.isnan() & ~e32.isnan()).any():
            return {"ok": False, "why": f"output {index}: NaN where the reference has none"}
        atol, rtol = tolerances.get(e.dtype, DEFAULT_TOLERANCES[torch.float32])
        error = (a32 - e32).abs()
        excess = (error - (atol + rtol * e32.abs())).nan_to_num(0.0)
        worst = max(worst, float(error.nan_to_num(0.0).max()) if error.numel() else 0.0)
        if (excess > 0).any():
            return {"ok": False, "max_abs_error": worst,
                    "why": f"output {index} ({e.dtype}): {int((excess > 0).sum())} of {e.numel()} elements "
                           f"beyond atol={atol} rtol={rtol}; max error {float(error.max()):.3g}"}
    return {"ok": True, "max_abs_error": worst}


def _run_on_device(op: str, args: tuple, record, runtime: DeviceRuntime, device: torch.device, family,
                   externals: list) -> dict:
    op_overload, reference = OPS[op]

    def dzc_call():
        return op_overload(*args, kernel_id=record.kernel_id)

    def eager_call():
        return reference(*args)

    start = time.perf_counter()
    actual = runtime.launch(dzc_call, device)  # first call: compiles and tunes
    runtime.synchronize(device)
    first_call_s = time.perf_counter() - start
    tolerances = {**DEFAULT_TOLERANCES, **getattr(family, "SELFTEST_TOLERANCES", {})}
    expected = eager_call()
    numerics = compare_outputs(actual, expected, tolerances)
    result = {"numerics": numerics, "first_call_seconds": round(first_call_s, 3), "tuned": record.tuned}
    if numerics["ok"]:
        dzc_s, eager_s = runtime.bench(dzc_call, device), runtime.bench(eager_call, device)
        result["timing"] = {"dzc_us": round(dzc_s * 1e6, 2), "eager_us": round(eager_s * 1e6, 2),
                            "speedup_vs_eager": round(eager_s / dzc_s, 3) if dzc_s > 0 else None}
    # Other libraries' kernels for the op (MATE on MUSA), checked and timed on their own: the tuner picks them by
    # speed alone, so a wrong one must show here (dzc's timing above is theirs where one won: see "tuned").
    for candidate in externals:
        def external_call(candidate=candidate):
            return candidate.fn(*args)
        try:
            outcome = compare_outputs(runtime.launch(external_call, device), expected, tolerances)
        except Exception as err:
            outcome = {"ok": False, "why": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
        if outcome["ok"]:
            outcome["us"] = round(runtime.bench(external_call, device) * 1e6, 2)
        result.setdefault("externals", {})[candidate.name] = outcome
    return result


# ---------------------------------------------------------------------------------------------------------
# Dry run: what can be compiled on this machine


def _kernel_signatures(family, spec, config) -> dict[str, tuple[dict, dict, int]] | None:
    """Kernel name -> (signature, constexprs, num_warps) of what the config launches, from the family's
    triton_signature (one kernel) or triton_signatures (several; num_warps optional per kernel); None when the
    family defines neither."""
    if hasattr(family, "triton_signatures"):
        return {name: (sig[0], sig[1], sig[2] if len(sig) > 2 else config.num_warps)
                for name, sig in family.triton_signatures(spec, config).items()}
    if hasattr(family, "triton_signature"):
        return {family.TRITON_KERNEL_NAME: (*family.triton_signature(spec, config), config.num_warps)}
    return None


def _triton_aot_jobs(family, spec, target: Target, source_path: str) -> list[dict]:
    """Ahead-of-time compiles of the default config's kernels: for the profile itself when the installed Triton
    targets its backend, and for MUSA profiles also for sm_90 with the same threads per block (the proxy)."""
    profile = target.profile
    config = family.triton_default_config(spec, profile)
    kernels = _kernel_signatures(family, spec, config)
    if kernels is None:
        return []
    flavour = musa_triton.detect_flavour()
    kinds = []
    if flavour.targets_musa == (profile.triton_backend == "musa"):
        kinds.append(("target", profile, 1))
    if profile.triton_backend == "musa":
        kinds.append(("cuda_proxy", SM_90, profile.warp_size // SM_90.warp_size))
    return [dict(kind=kind, profile=compile_profile.name, path=source_path, kernel_name=name, signature=signature,
                 constexprs=constexprs, num_warps=num_warps * warp_scale, num_stages=config.num_stages,
                 limit=profile.shared_memory_per_block, config=str(config))
            for kind, compile_profile, warp_scale in kinds
            for name, (signature, constexprs, num_warps) in kernels.items()]


_AOT_WORKER = """
import json, sys
import dzc
from dzc.targets import TARGETS, triton_codegen
jobs = json.load(open(sys.argv[1]))
results = []
for job in jobs:
    try:
        kernel = triton_codegen.compile_ahead_of_time(job["path"], job["kernel_name"], job["signature"],
                                                      job["constexprs"], job["num_warps"],
                                                      TARGETS[job["profile"]].profile, job["num_stages"])
        results.append({"shared": kernel.metadata.shared, "compiled_num_warps": kernel.metadata.num_warps})
    except Exception as err:
        results.append({"error": f"{type(err).__name__}: {err}"[:2000]})
json.dump(results, open(sys.argv[2], "w"))
"""


def _compile_triton_ahead_of_time(jobs: list[dict], workdir: Path) -> list[dict]:
    """Run the jobs in one subprocess without TRITON_INTERPRET (this process may have it on)."""
    if not jobs:
        return []
    jobs_path, results_path = workdir / "aot_jobs.json", workdir / "aot_results.json"
    jobs_path.write_text(json.dumps(jobs))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(workdir / "triton-cache"))
    proc = subprocess.run([sys.executable, "-c", _AOT_WORKER, str(jobs_path), str(results_path)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return [{"error": f"the compile worker failed: {proc.stderr[-2000:]}"}] * len(jobs)
    return json.loads(results_path.read_text())


def _record_compile(entry: dict, job: dict, outcome: dict) -> None:
    """Fold one kernel's ahead-of-time compile into entry["compile"][kind] (a case may launch several kernels)."""
    compiled = entry["compile"].setdefault(job["kind"], {"status": "compiled", "config": job["config"],
                                                          "shared": 0, "shared_limit": job["limit"], "kernels": {}})
    compiled["kernels"][job["kernel_name"]] = {"num_warps": job["num_warps"], **outcome}
    if "error" in outcome:
        compiled["status"] = "failed"
        compiled["why"] = f"{job['kernel_name']}: {outcome['error']}"
    else:
        compiled["shared"] = max(compiled["shared"], outcome["shared"])
        if outcome["shared"] > job["limit"]:
            compiled["status"] = "failed"
            compiled["why"] = (f"{job['kernel_name']}: Triton allocates {outcome['shared']} B shared memory > "
                               f"{job['limit']} B")
    if compiled["status"] == "failed":
        entry["status"] = "failed"


def _tilelang_lowering(family, spec, target: Target, source_path: str) -> dict:
    try:
        tilelang_codegen.tvm_target(target.profile)  # raises naming the TileLang build the target needs
    except RuntimeError as missing:
        return {"status": "not compiled here", "why": str(missing)}
    config = family.tilelang_default_config(spec, target.profile)
    path = Path(source_path)
    kernels = tilelang_codegen.factory_configs(family, spec, config)
    factory = tilelang_codegen.load_factory(path, family.TILELANG_FACTORY_NAME)
    for name, kernel_config in kernels.items():
        given = {param.lower() for param, _ in kernel_config.params}
        missing = [p.name for p in inspect.signature(factory).parameters.values()
                   if p.default is inspect.Parameter.empty and p.name not in given]
        if missing:  # the launch derives more arguments than the config holds (several kernels per config)
            return {"status": "not compiled here",
                    "why": f"TileLang factory {family.TILELANG_FACTORY_NAME}() also needs {missing}, which the "
                           f"family's launch derives; a family that launches several TileLang kernels names their "
                           f"configs with tilelang_kernel_configs(spec, config)"}
    lines = {}
    try:
        for name, kernel_config in kernels.items():
            source = tilelang_codegen.lower_to_device_source(path, family.TILELANG_FACTORY_NAME, kernel_config,
                                                             target.profile)
            lines[name] = source.count("\n")
    except Exception as err:  # a lowering error in the kernel itself
        return {"status": "failed", "why": f"{type(err).__name__}: {err}"[:2000]}
    return {"status": "lowered to device source", "config": str(config), "device_source_lines": lines}


def _not_compiled_triton(target: Target) -> dict:
    flavour = musa_triton.detect_flavour()
    return {"status": "not compiled here",
            "why": f"compiling Triton for {target.profile.name} needs a Triton build with the "
                   f"{target.profile.triton_backend!r} backend (for MUSA: the vendor's triton with "
                   f"triton.backends.mtgpu, or FlagTree's triton.backends.mthreads); the installed Triton is "
                   f"{flavour.name} {flavour.version}"}


# ---------------------------------------------------------------------------------------------------------
# The whole run


def _environment(target: Target, runtime: DeviceRuntime | None, device: torch.device | None) -> dict:
    flavour = musa_triton.detect_flavour()
    try:
        tilelang_targets = sorted(tilelang_codegen.installed_target_kinds())
    except Exception as err:
        tilelang_targets = f"unknown ({type(err).__name__}: {err})"
    env = {
        "dzc": dzc.__version__, "python": platform.python_version(), "host": platform.node(),
        "torch": torch.__version__, "triton_flavour": flavour.name, "triton_version": flavour.version,
        "triton_backend_module": flavour.backend_module, "triton_tensor_descriptors": flavour.tensor_descriptors,
        "tilelang": dsl_versions()["tilelang"], "tilelang_targets": tilelang_targets,
        "cuda_toolkit": torch.version.cuda, "musa_toolkit": getattr(torch.version, "musa", None),
    }
    if runtime is not None and device is not None:
        env["device"] = runtime.describe(device)
    return env


def run_selftest(target_name: str, *, dry_run: bool, seed: int | None = None, tune: bool = True,
                 cache_dir: str | None = None, runtime: DeviceRuntime | None = None,
                 device: torch.device | None = None, families: list[str] | None = None,
                 quick: bool = False, codegens: list[str] | None = None,
                 log: Callable[[str], None] = lambda line: None) -> dict:
    """The self-test as a report dict (what --json writes).

    quick: compile (dry run) or run (device) only each family's first case per code generator; every case is
    still generated and checked statically. codegens: only these code generators (default all).

    runtime/device: where to run (not for --dry-run); default the target's runtime and its current device,
    which must be available. Tests pass a runtime explicitly to run the MUSA layer over a test double.
    """
    target = resolve_target(target_name)
    profile = target.profile
    if not dry_run and runtime is None:
        runtime = target.runtime
        runtime.check_available()
    if not dry_run and device is None:
        device = runtime.device(0)
    seed = random.randrange(2**31) if seed is None else seed
    # Generated sources, tuning results and compile scratch; kept (the report names it) for inspection.
    workdir = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="dzc-selftest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    options_cache = str(workdir)
    execution = Execution(None, "dry run: generated and checked, not executed") if dry_run else Execution(runtime)

    results: list[dict] = []
    pending_aot: list[tuple[dict, list[dict]]] = []
    selected = families or sorted(KERNEL_FAMILIES)
    for op in selected:
        family = KERNEL_FAMILIES[op]
        cases_for = getattr(family, "selftest_cases", None)
        cases = cases_for(profile) if cases_for is not None else []
        if not cases:  # no selftest_cases, or none whose dtypes the profile has
            results.append({"family": op, "status": NO_CASES})
            log(f"{op}: {NO_CASES}")
            continue
        # The op's code generators (a family may serve several ops, each with its own: W4A8 MoE is Triton-only).
        for codegen in (name for name in target.codegens if name in PREFERRED_CODEGENS[op]
                        and hasattr(family, f"{name}_source") and (codegens is None or name in codegens)):
            options = CompileOptions(codegen=codegen, autotune=tune and not dry_run, cache_dir=options_cache)
            for case_index, (case, make_args) in enumerate(cases):
                case_seed = seed + case_index
                entry = {"family": op, "codegen": codegen, "case": case, "seed": case_seed}
                results.append(entry)
                compile_here = not (quick and case_index > 0)
                try:
                    _run_case(entry, op, family, codegen, make_args, target, options, execution, runtime, device,
                              case_seed, pending_aot, compile_here)
                except NoLegalConfig as err:  # the op does not exist on this profile (W4A8 without FP8)
                    entry.update(status=UNSUPPORTED, why=str(err)[:2000])
                except Exception as err:  # one broken case must not hide the others
                    entry.update(status="failed", why=f"{type(err).__name__}: {err}"[:2000])
                if not (pending_aot and pending_aot[-1][0] is entry):  # logged once its compiles are done
                    log(_describe(entry))
    if pending_aot:
        jobs = [job for _, entry_jobs in pending_aot for job in entry_jobs]
        outcomes = iter(_compile_triton_ahead_of_time(jobs, workdir))
        for entry, entry_jobs in pending_aot:
            for job in entry_jobs:
                _record_compile(entry, job, next(outcomes))
            log(_describe(entry))
    summary: dict[str, int] = {}
    for entry in results:
        summary[entry["status"]] = summary.get(entry["status"], 0) + 1
    return {
        "target": profile.name, "dry_run": dry_run, "seed": seed, "workdir": str(workdir),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": _environment(target, runtime, device),
        "profile": {"arch": profile.arch, "warp_size": profile.warp_size, "max_num_warps": profile.max_num_warps,
                    "shared_memory_per_block": profile.shared_memory_per_block,
                    "native_dtypes": list(profile.native_dtypes)},
        "results": results, "summary": summary,
        "families_without_cases": [e["family"] for e in results if e["status"] == NO_CASES],
        "ok": not any(e["status"] == "failed" for e in results),
    }


def _tilelang_unavailable(target: Target, runtime: DeviceRuntime) -> str | None:
    """Why TileLang kernels cannot run on this runtime for the target (None when they can)."""
    if not runtime.runs_tilelang:
        return "TileLang kernels need a GPU (TileLang has no CPU interpreter)"
    try:
        tilelang_codegen.tvm_target(target.profile)  # raises naming the TileLang build the target needs
    except RuntimeError as missing:
        return str(missing)
    return None


def _run_case(entry, op, family, codegen, make_args, target, options, execution, runtime, device, seed,
              pending_aot, compile_here: bool) -> None:
    if execution.runtime is not None and not compile_here:
        entry.update(status="skipped", why="--quick runs each family's first case per code generator")
        return
    if execution.runtime is not None and codegen == "tilelang":
        unavailable = _tilelang_unavailable(target, execution.runtime)
        if unavailable:
            entry.update(status="unavailable", why=unavailable)
            return
    # Lowering needs only shapes and dtypes: a dry run traces CPU tensors of the case.
    trace_device = device if device is not None else torch.device("cpu")
    args = make_args(trace_device, torch.Generator(device=trace_device).manual_seed(seed))
    record, spec = lower_op(op, args, target, options, execution)
    source = Path(record.source_path).read_text()
    problems = static_check.kernel_problems(family, codegen, spec, target.profile, source)
    entry.update(kernel_id=record.kernel_id, spec=record.spec, source_path=record.source_path,
                 configs_legal=record.configs_considered - record.configs_illegal,
                 configs_dropped_as_illegal=record.configs_illegal, static_problems=problems)
    if problems:
        entry["status"] = "failed"
        return
    if execution.runtime is None:
        entry["compile"] = {}
        entry["status"] = "checked"
        if not compile_here:
            entry["compile"]["target"] = {"status": "skipped (--quick compiles each family's first case)"}
            return
        if codegen == "tilelang":
            entry["compile"]["target"] = _tilelang_lowering(family, spec, target, record.source_path)
            entry["status"] = "failed" if entry["compile"]["target"]["status"] == "failed" else "checked"
            return
        jobs = _triton_aot_jobs(family, spec, target, record.source_path)
        if not jobs:
            entry["compile"]["target"] = {"status": "not compiled here",
                                          "why": "the family defines no triton_signature(s)"}
        elif not any(job["kind"] == "target" for job in jobs):
            entry["compile"]["target"] = _not_compiled_triton(target)
        entry["status"] = "checked"
        if jobs:
            pending_aot.append((entry, jobs))
        return
    externals = external_kernels.candidates_for(op, spec, target.profile)
    outcome = _run_on_device(op, args, record, runtime, device, family, externals)
    entry.update(outcome)
    external_ok = all(e["ok"] for e in outcome.get("externals", {}).values())
    entry["status"] = "passed" if outcome["numerics"]["ok"] and external_ok else "failed"


def _describe(entry: dict) -> str:
    if entry["status"] == NO_CASES:
        return f"{entry['family']}: {NO_CASES}"
    line = f"{entry['family']:<18} {entry['codegen']:<8} {entry['case']:<40} {entry['status']}"
    timing = entry.get("timing")
    if timing:
        line += f"  dzc {timing['dzc_us']:.1f} us, eager {timing['eager_us']:.1f} us"
    for name, outcome in entry.get("externals", {}).items():
        line += f"  {name} {outcome['us']:.1f} us" if outcome["ok"] else f"  {name} FAILED: {outcome.get('why')}"
    compiled = entry.get("compile", {})
    for kind, outcome in compiled.items():
        if outcome["status"] == "compiled":
            line += f"  [{kind}: {outcome['shared']} B shared of {outcome['shared_limit']}]"
        elif not outcome["status"].startswith("skipped"):
            line += f"  [{kind}: {outcome['status']}]"
    why = entry.get("why") or next((o.get("why") for o in compiled.values() if o["status"] == "failed"), None)
    if entry["status"] == "failed":
        line += f"\n    {why or entry.get('numerics', {}).get('why') or entry.get('static_problems')}"
    return line


def main(argv: list[str] | None = None) -> int:
    return run_cli("dzc-selftest", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="dzc-selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="cuda | musa | a profile such as musa:mp_22")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON (send it back from a MUSA card)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no device: generate, check legality, compile what this machine can compile")
    parser.add_argument("--family", action="append", choices=sorted(KERNEL_FAMILIES),
                        help="only these kernel families (repeatable); default all")
    parser.add_argument("--seed", type=int, help="input seed (default: fresh; the report records it)")
    parser.add_argument("--no-tune", action="store_true", help="run each kernel's default config, untuned")
    parser.add_argument("--quick", action="store_true",
                        help="compile (dry run) or run only each family's first case per code generator")
    parser.add_argument("--codegen", action="append", choices=("triton", "tilelang"),
                        help="only this code generator (repeatable); default both")
    parser.add_argument("--cache-dir", help="where sources, tuning results and compile scratch go (default: a "
                                            "fresh temp dir, named in the report)")
    args = parser.parse_args(argv)

    find_target(args.target)
    try:
        report = run_selftest(args.target, dry_run=args.dry_run, seed=args.seed, tune=not args.no_tune,
                              cache_dir=args.cache_dir, families=args.family, quick=args.quick,
                              codegens=args.codegen,
                              log=lambda line: print(line, flush=True))
    except RuntimeError as missing:
        if args.dry_run:
            raise
        print(f"dzc-selftest: {missing}\n(dzc-selftest --target {args.target} --dry-run checks the generated "
              f"kernels without the device)", file=sys.stderr)
        return 2
    environment = report["environment"]
    device = environment.get("device", {})
    print(f"\ndzc-selftest {report['target']}{' (dry run)' if report['dry_run'] else ''}: "
          f"{', '.join(f'{n} {s}' for s, n in sorted(report['summary'].items()))}")
    print(f"  torch {environment['torch']}, triton {environment['triton_version']} ({environment['triton_flavour']})"
          f", tilelang {environment['tilelang']} (targets {environment['tilelang_targets']})")
    if device:
        print(f"  device {device['device']} ({device['arch']}, {device['multiprocessors']} multiprocessors, "
              f"toolkit {device['toolkit']})")
        if device.get("real_musa_run") is False:
            print(f"  NOT A MUSA RUN: torch.musa is provided by {device['torch_musa_provider']}, not torch_musa")
    if report["families_without_cases"]:
        print(f"  untested (no selftest_cases): {', '.join(report['families_without_cases'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"  report: {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
