"""The README demo: compile the multimodal reference model for target "cuda", run requests of images + text and
decode steps, and show what dzc did (report, coverage, error against eager, where the generated kernels are).

The model (dzc.models.multimodal, tiny config): a Qwen2.5-VL-style vision encoder whose packed image attention
becomes dzc.varlen_attention, and a decoder of DeepSeek-V3.2-style sparse attention (DSA) over a paged KV cache and
an MoE with MXFP4 experts. It runs as serving engines run it: one compiled vision encoder, one compiled decoder step
for prefill and decode. Without a GPU the generated Triton kernels run through Triton's interpreter on CPU tensors
(the report says so; untuned default configs there, since timing the interpreter means nothing).
"""

import argparse

import dzc  # first: it turns Triton's interpreter on when no GPU is present
import torch

from dzc.models.multimodal import CONFIGS, MultimodalSession, build_multimodal, new_cache, request_ids
from dzc.models.vision import pack_images

# Two requests: 3 images of different sizes, then 1 image (another count and size: no recompile), each with text
# around its images; (rows, columns) of 14-pixel-style patches of the tiny config.
REQUESTS = (([(2, 2), (2, 4), (4, 2)], [3, 2, 2, 4]), ([(4, 4)], [2, 3]))
DECODE_STEPS = 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the model, the compiled session and the first request's inputs; run nothing "
                             "(the whole demo takes minutes through Triton's interpreter)")
    parser.add_argument("--requests", type=int, default=len(REQUESTS), choices=range(1, len(REQUESTS) + 1),
                        help="how many of the requests to run (default: all)")
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS, help="decode steps after each prefill")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = CONFIGS["tiny"]
    model = build_multimodal(cfg, torch.bfloat16, device=device)
    eager = MultimodalSession(model, new_cache(cfg, 2, len(REQUESTS), False, torch.bfloat16, device))
    options = dzc.CompileOptions(autotune=device == "cuda")
    compiled = MultimodalSession.compiled(model, new_cache(cfg, 2, len(REQUESTS), False, torch.bfloat16, device),
                                          args.target, options)
    if args.dry_run:
        grids, text = REQUESTS[0]
        ids = request_ids(cfg, grids, text, torch.Generator().manual_seed(0))
        print(f"dry run: {args.requests} requests (the first: {len(grids)} images, {ids.shape[1]} tokens), "
              f"{args.decode_steps} decode steps each, on {device} for target {args.target}")
        return
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for sequence, (grids, text) in enumerate(REQUESTS[:args.requests]):
            images = pack_images(grids, cfg.vision, torch.bfloat16, generator)
            images = type(images)(*(t.to(device) for t in images.inputs()))
            input_ids = request_ids(cfg, grids, text, generator).to(device)
            label = f"request {sequence}: {len(grids)} image(s) {grids} + text, {input_ids.shape[1]} tokens, prefill"
            expected, actual = eager.prefill(sequence, input_ids, images), compiled.prefill(sequence, input_ids, images)
            for step in range(args.decode_steps + 1):
                error = (actual.float() - expected.float()).abs().max().item()
                print(f"{label}: max |dzc - eager| = {error:.3g} (logits up to {expected.abs().max().item():.3g}, "
                      f"{actual.dtype})")
                if step == args.decode_steps:
                    break
                tokens = expected.argmax(-1, keepdim=True)
                label = f"request {sequence}: decode step {step + 1}"
                expected, actual = eager.decode(tokens, [sequence]), compiled.decode(tokens, [sequence])
    for name, part in (("vision encoder", compiled.vision), ("decoder step", compiled.decoder)):
        print(f"\n===== {name} =====")
        print(part.report)
        print(part.report.coverage)  # what runs in dzc kernels, what was left to the fallback, and why
    print("\nkernel sources:")
    for path in dict.fromkeys(k.source_path for k in compiled.vision.report.kernels + compiled.decoder.report.kernels):
        print(f"  {path}")
    print("\nThe MUSA code for the same model (the whole prefill in one graph):\n"
          "  dzc-dump multimodal --target musa --kernels")


if __name__ == "__main__":
    main()
