"""Which rewrite makes the multimodal reference model's decode steps wrong: each call's logits against the fp32
oracle (the same bf16-rounded weights computing in fp32), for dzc as it compiles by default and with one pass
left out at a time. A row whose decode errors fall back to eager's size names the pass at fault.

    python tools/diagnose_multimodal_decode.py [--seed N] [--passes fuse_mxfp4_experts ...] [--dry-run]

Session 41 (H100): tests/test_multimodal_model.py's GPU test found every decode step 30-70% off the oracle while
every prefill matched (eager: 1-8%), in 3 runs of 3 with the repeated layers outlined for Inductor
(DZC_OUTLINE_FOR_INDUCTOR=1) and in none with it off; the CPU host (Triton's interpreter, Inductor's C++ backend
with --fallback inductor) matches either way. The requests and steps are the test's. One call off by 30% alone
can be a near-tie (a DSA top-k or router choice flipping at a bf16 rounding); a wrong rewrite is off in every
decode step. Every row gets the same images and tokens (from --seed); before session 46 each row drew its own from
the global generator, so its rows were not comparable with each other.
"""
from __future__ import annotations

import argparse
import copy
import tempfile

import torch

import dzc
from dzc import runtime
from dzc.models.moe import MoEExperts
from dzc.models.multimodal import CONFIGS, MultimodalSession, build_multimodal, new_cache, request_ids
from dzc.models.vision import ImagePack, pack_images

CFG = CONFIGS["tiny"]
REQUESTS = (([(2, 2), (2, 4), (4, 2)], [2, 1, 2, 3]),
            ([(4, 4)], [1, 2]),
            ([(2, 4), (2, 2)], [3, 1, 1]))
DECODE_STEPS = (3, 2, 0)  # tests/test_multimodal_model.py's
PASSES = ("fuse_mxfp4_experts", "fuse_sparse_attention", "fuse_residual_norm", "reinplace_cache_writes",
          "canonicalize_graph")


def runs(passes) -> list[tuple[str, dict | None]]:
    """(label, CompileOptions fields) of each row: eager (None), dzc as it compiles, dzc without CUDA graphs (a
    wrong step there is the compiled code's, not the replay's), dzc with each of `passes` left out."""
    return [("eager", None), ("dzc", {}), ("dzc without CUDA graphs", {"cuda_graph_max_tokens": 0}),
            *((f"dzc without {name}", {"disable_passes": (name,)}) for name in passes)]


def oracle_of(model):
    oracle = copy.deepcopy(model).float()
    for module in oracle.modules():
        if isinstance(module, MoEExperts):
            module.compute_dtype = torch.float32
    return oracle


class KeyLog:
    """Stands in for a compiled decoder's CUDA-graph runner and logs, per call, its graph key (a short hash), the
    frames Dynamo compiled before and after it, and the key's state after it."""

    def __init__(self, runner: runtime.CudaGraphRunner):
        self.runner = runner
        self.lines: list[str] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs):
        padded, padded_kwargs = self.runner._pad_block_table(args, kwargs)
        key = runtime.graph_key(runtime.flatten_call(padded, padded_kwargs))
        before = runtime._compiles()
        result = self.runner(*args, **kwargs)
        signature = self.runner.signatures.get(key)
        state = "no key" if signature is None else (
            f"warm {signature.warm} (at {signature.warm_at} frames), {signature.graphs} graphs"
            + (f", refused: {signature.refused}" if signature.refused else ""))
        shapes = " ".join(str(tuple(a.shape)) for a in padded if isinstance(a, torch.Tensor))
        self.lines.append(f"key {hash(str(key)) % 10**6:06d} {shapes}: Dynamo frames {before} -> "
                          f"{runtime._compiles()}; {state}; runner holds {len(self.runner.graphs)} graphs")
        return result


def errors(seed: int, options: dzc.CompileOptions | None, device: str,
           keys: list[str] | None = None) -> list[tuple[str, float]]:
    """(call, relative error against the oracle) of each prefill and decode step; eager where options is None.
    With `keys` (a list), the compiled decoder's CUDA-graph runner is logged into it (KeyLog)."""
    torch._dynamo.reset()
    model = build_multimodal(CFG, torch.bfloat16, seed=seed, device=device)
    cache = new_cache(CFG, max_pages=3, batch=len(REQUESTS), fp8_index=False, dtype=torch.bfloat16, device=device)
    oracle_cache = new_cache(CFG, max_pages=3, batch=len(REQUESTS), fp8_index=False, dtype=torch.float32,
                             device=device)
    eager = MultimodalSession(model, copy.deepcopy(cache))  # picks the tokens, as the test does
    session = MultimodalSession(model, cache) if options is None else \
        MultimodalSession.compiled(model, cache, "cuda", options)
    oracle = MultimodalSession(oracle_of(model), oracle_cache)
    log = None
    if keys is not None and options is not None and session.decoder._cuda_graphs is not None:
        log = session.decoder._cuda_graphs = KeyLog(session.decoder._cuda_graphs)
    out = []
    # Every row the same images and tokens (the rows are compared with each other; session 46 found each row
    # drawing its own from the global generator).
    inputs_rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sequence, ((grids, text), steps) in enumerate(zip(REQUESTS, DECODE_STEPS)):
            images = pack_images(grids, CFG.vision, torch.bfloat16, generator=inputs_rng)
            images = ImagePack(*(t.to(device) for t in images.inputs()))
            input_ids = request_ids(CFG, grids, text, generator=inputs_rng).to(device)
            calls = [("prefill", (sequence, input_ids, images))]
            for call in range(1 + steps):
                step, args = calls[-1]
                logits = getattr(eager, step)(*args)
                exact = getattr(oracle, step)(*args)
                actual = logits if options is None else getattr(session, step)(*args)
                error = ((actual.float() - exact).abs().max() / exact.abs().max()).item()
                out.append((f"{sequence}:{step}", error))
                calls.append(("decode", (logits.argmax(-1, keepdim=True), [sequence])))
    if log is not None:
        keys += log.lines + [log.runner.describe()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=383913882)
    parser.add_argument("--passes", nargs="*", default=list(PASSES), help="leave out each of these in turn")
    parser.add_argument("--fallback", default="auto", choices=("auto", "inductor", "eager"),
                        help="what runs the ops no pass fused (CompileOptions.fallback; auto: Inductor on a GPU)")
    parser.add_argument("--graph-keys", action="store_true",
                        help="only dzc as it compiles: its decoder's CUDA-graph keys, call by call (a GPU)")
    parser.add_argument("--dry-run", action="store_true", help="build the model and print the plan; run nothing")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = [f"{n}:{step}" for n, steps in enumerate(DECODE_STEPS) for step in ["prefill"] + ["decode"] * steps]
    if args.dry_run:
        build_multimodal(CFG, torch.bfloat16, seed=args.seed)  # tiny: the model builds on the CPU in a second
        labels = [label for label, _ in runs(args.passes)]
        print(f"dry run: {len(calls)} calls ({', '.join(calls)}) x {len(labels)} runs ({', '.join(labels)}) on "
              f"{device}")
        return
    if args.graph_keys:
        keys: list[str] = []
        options = dzc.CompileOptions(autotune=False, cache_dir=tempfile.mkdtemp(prefix="dzc-decode-"),
                                     fallback=args.fallback)
        values = errors(args.seed, options, device, keys)
        print("\n".join(keys))
        print("errors:", " ".join(f"{call} {e:.4f}" for call, e in values))
        return
    print(f"seed {args.seed}, {device}, fallback {args.fallback}, DZC_OUTLINE_FOR_INDUCTOR="
          f"{dzc.config.OUTLINE_FOR_INDUCTOR.get()}; relative error of each call's logits against the fp32 oracle\n")
    print("| run | " + " | ".join(calls) + " |")
    print("|---|" + "---|" * len(calls))
    # Each row as soon as it is measured: a run cut off by a time limit keeps the rows it finished.
    for label, fields in runs(args.passes):
        options = None if fields is None else dzc.CompileOptions(
            autotune=False, cache_dir=tempfile.mkdtemp(prefix="dzc-decode-"), fallback=args.fallback, **fields)
        values = errors(args.seed, options, device)
        print(f"| {label} | " + " | ".join(f"{e:.4f}" for _, e in values) + " |", flush=True)

if __name__ == "__main__":
    main()
