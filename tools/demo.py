"""The README demo: compile a reference decoder for target "cuda", run it, and show what dzc did.

Without a GPU the generated Triton kernels run through Triton's interpreter on CPU tensors (the report says so).
"""

import argparse

import dzc  # first: it turns Triton's interpreter on when no GPU is present
import torch

from dzc.models import build_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek_decoder")
    parser.add_argument("--target", default="cuda")
    args = parser.parse_args()
    model, (tokens,) = build_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokens = model.to(device), tokens.to(device)
    compiled = dzc.compile(model, target=args.target)
    with torch.no_grad():
        for seq in (16, 24, 40):  # new sequence lengths: no recompile
            tokens = torch.randint(0, 256, (2, seq), device=device)
            out, expected = compiled(tokens), model(tokens)
            error = (out.float() - expected.float()).abs().max().item()
            print(f"seq {seq}: max |dzc - eager| = {error:.3g} (logits up to {expected.abs().max().item():.3g}, "
                  f"{out.dtype})")
    print(compiled.report)
    print("kernel sources:")
    for kernel in compiled.report.kernels:
        print(f"  {kernel.source_path}")


if __name__ == "__main__":
    main()
