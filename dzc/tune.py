"""dzc-tune: tune every kernel a model needs on the present device, and write a tuning database to ship with it.

    dzc-tune llama_decoder --target musa --out llama_mp31.json        # on the lab card
    dzc-tune pkg.module:factory --target cuda --seq-lens 1,128,4096 --out db.json
    DZC_TUNING_DB=llama_mp31.json python serve.py                        # on the deployment (or tuning_db=)

MODEL is as for dzc-dump: a name from dzc.models, or `package.module:factory` where factory(**kwargs) returns
(model, example_inputs). --seq-lens calls the factory with seq=N for each N (token counts fall into separate
tuning buckets). The database records the device's tuning identity (arch, multiprocessor count, toolkit,
Triton flavour, TileLang version); dzc refuses it on any other device.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch

import dzc
from dzc.autotune import TuningDatabase, export_database
from dzc.dump import UsageError, find_model, find_target, load_model, run_cli
from dzc.options import CompileOptions
from dzc.targets import resolve_target
from dzc.targets.device_runtime import DeviceRuntime


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def tune_model(model, input_sets: list[tuple], target_name: str, out: str | Path, *, runtime: DeviceRuntime,
               device: torch.device, model_name: str, cache_dir: str | None = None) -> dict:
    """Compile `model` for the target with tuning on, run it on each input set on `device` (kernels execute
    through `runtime`), and export what was tuned there to `out`. Returns a summary (entries, kernels)."""
    cache = cache_dir or tempfile.mkdtemp(prefix="dzc-tune-")
    options = CompileOptions(autotune=True, cache_dir=cache)
    model = model.to(device)
    compiled = dzc.compile(model, target=target_name, options=options)
    for inputs in input_sets:
        compiled(*_to_device(inputs, device))
    runtime.synchronize(device)
    report = compiled.report
    not_run = [k.kernel_id for k in report.kernels if k.execution.startswith("not runnable")]
    if not_run:
        raise RuntimeError(f"dzc-tune: kernels {not_run} did not run on {device}, so nothing was tuned for them: "
                           f"{report.kernels[0].execution}")
    identity = runtime.tuning_identity(device)
    count = export_database(
        TuningDatabase(Path(cache) / "tuning.json"), identity, out, model=model_name,
        target=resolve_target(target_name).name, dzc=dzc.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return {"entries": count, "identity": identity,
            "kernels": {k.kernel_id: {str(b): t for b, t in k.tuned.items()} for k in report.kernels}}


def main(argv: list[str] | None = None) -> int:
    return run_cli("dzc-tune", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="dzc-tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a name from dzc-dump --list-models, or package.module:factory")
    parser.add_argument("--target", default="cuda", help="cuda | musa | a profile such as musa:mp_22")
    parser.add_argument("--out", required=True, help="the tuning database to write (JSON)")
    parser.add_argument("--seq-lens", help="comma-separated sequence lengths to tune for (factory(seq=N))")
    parser.add_argument("--device-index", type=int, default=0)
    parser.add_argument("--cache-dir", help="reuse this cache's local tuning results (default: tune afresh)")
    args = parser.parse_args(argv)

    target = find_target(args.target)
    find_model(args.model)  # a mistyped model is an error before the device is looked for
    try:
        target.runtime.check_available()
    except RuntimeError as missing:
        print(f"dzc-tune: tuning measures kernels on the device itself: {missing}", file=sys.stderr)
        return 2
    device = target.runtime.device(args.device_index)
    if args.seq_lens:
        try:
            seq_lens = [int(n) for n in args.seq_lens.split(",")]
        except ValueError:
            raise UsageError(f"--seq-lens {args.seq_lens!r}: expected comma-separated integers") from None
        builds = [load_model(args.model, seq=n) for n in seq_lens]
    else:
        builds = [load_model(args.model)]
    model = builds[0][0]
    summary = tune_model(model, [inputs for _, inputs in builds], args.target, args.out, runtime=target.runtime,
                         device=device, model_name=args.model, cache_dir=args.cache_dir)
    identity = summary["identity"]
    print(f"dzc-tune: {summary['entries']} tuning entries for {identity['device']} ({identity['arch']}, "
          f"{identity['multiprocessors']} multiprocessors) written to {args.out}")
    for kernel_id, buckets in summary["kernels"].items():
        for bucket, entry in buckets.items():
            print(f"  {kernel_id} tokens<={bucket}: {entry['config']} ({entry['how']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
