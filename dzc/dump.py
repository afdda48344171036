"""dzc-dump: show what dzc does to a model, for either target, on a machine without a GPU.

    dzc-dump llama_decoder --target cuda             # captured graph, graph after each pass, report
    dzc-dump llama_decoder --target musa --kernels   # ... and the generated MUSA kernel sources
    dzc-dump pkg.module:factory --after fuse_residual_norm --json

MODEL is a name from --list-models or `package.module:factory`, where factory() returns (model, example_inputs).
A thin front end: it compiles with dzc.compile and prints the report's stages; it has no compiler logic.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import dzc
from dzc.models import MODELS, build_model
from dzc.options import CompileOptions
from dzc.runtime import NotRunnableError


def load_model(spec: str, **kwargs):
    """MODEL (a dzc.models name or package.module:factory) -> (model, example_inputs); kwargs go to the factory."""
    if ":" in spec:
        module_name, factory = spec.split(":", 1)
        return getattr(importlib.import_module(module_name), factory)(**kwargs)
    return build_model(spec, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dzc-dump", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a name from --list-models, or package.module:factory")
    parser.add_argument("--target", default="cuda", help="cuda | musa | a profile such as musa:mp_22")
    parser.add_argument("--codegen", default="auto", choices=("auto", "triton", "tilelang"))
    parser.add_argument("--after", metavar="PASS", help="print only the graph after this pass ('capture', "
                                                        "a pass name, or 'lowered')")
    parser.add_argument("--kernels", action="store_true", help="also print the generated kernel sources")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--cache-dir", help="where generated sources go (default: $DZC_CACHE_DIR)")
    parser.add_argument("--moe-fp8", action="store_true",
                        help="compile MXFP4 MoE layers as W4A8 (CompileOptions.moe_fp8_activations)")
    parser.add_argument("--list-models", action="store_true")
    args = parser.parse_args(argv)

    if args.list_models:
        for name, (_, description) in sorted(MODELS.items()):
            print(f"{name:24s} {description}")
        return 0
    if not args.model:
        parser.error("MODEL is required (see --list-models)")

    model, inputs = load_model(args.model)
    # Dumps show what would run; tuning on the CPU interpreter would only slow them down.
    options = CompileOptions(codegen=args.codegen, autotune=False, cache_dir=args.cache_dir,
                             moe_fp8_activations=args.moe_fp8)
    compiled = dzc.compile(model, target=args.target, options=options)
    run_note = "ran"
    try:
        compiled(*inputs)
    except NotRunnableError as err:
        run_note = f"compiled, not run: {err}"
    report = compiled.report

    stages = [(f"graph {g.compile_id}", name, text) for g in report.graphs for name, text in g.stages]
    if args.after:
        names = {name for _, name, _ in stages}
        if args.after not in names:
            parser.error(f"--after {args.after!r}: stages are {', '.join(sorted(names))}")
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
