"""dzc-dump: show what dzc does to a model, for either target, on a machine without a GPU.

    dzc-dump llama_decoder --target cuda             # captured graph, graph after each pass, report
    dzc-dump llama_decoder --target musa --kernels   # ... and the generated MUSA kernel sources
    dzc-dump pkg.module:factory --after fuse_residual_norm --json
    dzc-dump hf_gpt_oss_mxfp4 --coverage             # what runs in dzc kernels, what was left and why
    dzc-dump dzc.models.distributed:tp_decoder_example --tp 2   # each rank's graphs and report, ranks on the CPU (gloo)

MODEL is a name from --list-models or `package.module:factory`, where factory() returns (model, example_inputs).
A thin front end: it compiles with dzc.compile and prints the report's stages; it has no compiler logic.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import dzc
from dzc import autotune, config
from dzc.models import MODELS
from dzc.options import CompileOptions
from dzc.runtime import NotRunnableError
from dzc.targets import Target, resolve_target


class UsageError(ValueError):
    """A mistake on a dzc command line (an unknown model or target): printed as one line, exit status 2."""


def find_model(spec: str) -> Callable[..., tuple]:
    """MODEL (a dzc.models name or package.module:factory) -> its factory, not called yet."""
    if ":" not in spec:
        if spec not in MODELS:
            raise UsageError(f"unknown model {spec!r}: not a name from --list-models ({', '.join(sorted(MODELS))}) "
                             f"nor package.module:factory")
        return MODELS[spec][0]
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"model {spec!r}: expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name + ".").startswith(err.name + "."):
            raise  # the module is there, and something it imports is not: its traceback says what
        raise UsageError(f"model {spec!r}: no module named {err.name!r} (is it on PYTHONPATH?)") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"model {spec!r}: module {module_name!r} has no "
                         f"{'callable ' if factory is not None else ''}{name!r}")
    return factory


def load_model(spec: str, **kwargs):
    """MODEL (a dzc.models name or package.module:factory) -> (model, example_inputs); kwargs go to the factory."""
    built = find_model(spec)(**kwargs)
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], (tuple, list))):
        raise UsageError(f"model {spec!r}: its factory returned {type(built).__name__}, not (model, "
                         f"example_inputs)")
    return built


def find_target(name: str) -> Target:
    try:
        return resolve_target(name)
    except ValueError as err:
        raise UsageError(str(err)) from None


def run_cli(prog: str, main: Callable[[], int]) -> int:
    """main(), with the mistakes a user makes on the command line or in the environment (UsageError, a DZC_*
    variable not accepted, a tuning database that cannot be used) printed as one line and exit status 2."""
    try:
        return main()
    except (UsageError, config.ConfigError, autotune.TuningDatabaseError) as err:
        print(f"{prog}: error: {str(err).removeprefix('dzc: ')}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_cli("dzc-dump", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="dzc-dump", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a name from --list-models, or package.module:factory")
    parser.add_argument("--target", default="cuda", help="cuda | musa | a profile such as musa:mp_22")
    parser.add_argument("--codegen", default="auto", choices=("auto", "triton", "tilelang"))
    parser.add_argument("--after", metavar="PASS", help="print only the graph after this pass ('capture', "
                                                        "a pass name, or 'lowered')")
    parser.add_argument("--kernels", action="store_true", help="also print the generated kernel sources")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--coverage", action="store_true",
                        help="print only the coverage: the share of FLOPs and bytes in dzc kernels per graph, the "
                             "largest unfused ops, and the near-misses with why each was not rewritten")
    parser.add_argument("--cache-dir", help="where generated sources go (default: $DZC_CACHE_DIR)")
    parser.add_argument("--moe-fp8", action="store_true",
                        help="compile MXFP4 MoE layers as W4A8 (CompileOptions.moe_fp8_activations)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="shard the model's tp_plan over N ranks (processes on this CPU, gloo) with "
                             "torch.distributed's parallel styles and show each rank's graphs and report")
    parser.add_argument("--list-models", action="store_true")
    args = parser.parse_args(argv)

    if args.list_models:
        for name, (_, description) in sorted(MODELS.items()):
            print(f"{name:24s} {description}")
        return 0
    if not args.model:
        parser.error("MODEL is required (see --list-models)")

    find_target(args.target)
    if args.tp > 1:
        return _dump_ranks(args)
    model, inputs = load_model(args.model)
    return _dump(args, model, inputs, parser.error)


def _options(args) -> CompileOptions:
    # Dumps show what would run; tuning on the CPU interpreter would only slow them down.
    return CompileOptions(codegen=args.codegen, autotune=False, cache_dir=args.cache_dir,
                          moe_fp8_activations=args.moe_fp8)


def _dump_ranks(args) -> int:
    """--tp N: the model sharded over N gloo ranks on this CPU, each rank's dump printed in rank order."""
    import tempfile  # noqa: PLC0415

    from dzc import distributed  # noqa: PLC0415

    model, _ = load_model(args.model)
    if not getattr(model, "tp_plan", None):
        raise UsageError(f"model {args.model!r} has no tp_plan (module name pattern -> 'colwise' | 'rowwise') to "
                         f"shard it by; dzc.models.distributed:tp_decoder_example has one")
    with tempfile.TemporaryDirectory() as out:
        distributed.spawn_ranks(_dump_rank, args.tp, args, out)
        texts = [(Path(out) / f"rank{rank}.txt").read_text() for rank in range(args.tp)]
    if args.json:  # one JSON list, rank by rank
        print(json.dumps([json.loads(text) for text in texts], indent=1))
        return 0
    for rank, text in enumerate(texts):
        print(f"######## rank {rank} of {args.tp} ########")
        print(text, end="")
    return 0


def _dump_rank(rank: int, world: int, args, out: str) -> None:
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from dzc.models import distributed as sharded  # noqa: PLC0415

    model, inputs = load_model(args.model)
    sharded.parallelize(model, init_device_mesh("cpu", (world,)))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        _dump(args, model, inputs, lambda message: print(f"dzc-dump: error: {message}"))
    (Path(out) / f"rank{rank}.txt").write_text(text.getvalue())


def _dump(args, model, inputs, error: Callable[[str], None]) -> int:
    compiled = dzc.compile(model, target=args.target, options=_options(args))
    run_note = "ran"
    try:
        compiled(*inputs)
    except NotRunnableError as err:
        run_note = f"compiled, not run: {err}"
    report = compiled.report
    if args.coverage and not args.json:
        print(report.coverage)
        print(f"  model: {run_note}")
        return 0

    stages = [(f"graph {g.compile_id}", name, text) for g in report.graphs for name, text in g.stages]
    if args.after:
        names = {name for _, name, _ in stages}
        if args.after not in names:
            error(f"--after {args.after!r}: stages are {', '.join(sorted(names))}")
        stages = [s for s in stages if s[1] == args.after]
    kernels = {k.kernel_id: Path(k.source_path).read_text() for k in report.kernels} if args.kernels else {}

    if args.json:
        print(json.dumps({"model": args.model, "target": args.target, "run": run_note,
                          "stages": [{"graph": g, "stage": n, "text": t} for g, n, t in stages],
                          "report": report.to_json(), "kernels": kernels}, indent=1, default=str))
        return 0
    for graph, _name, text in stages:
        print(f"==== {graph} ====")
        print(text)
    print(report)
    print(f"  model: {run_note}")
    for kernel_id, source in kernels.items():
        print(f"\n==== kernel {kernel_id} ====")
        print(source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
