"""KL(parent || model) forward and backward at a model's vocabulary (mha2gqa/scoring/kl.py): the hand-written gradient
the package uses against autograd's chain through the log-softmaxes, on the same random logits, side by side,
alternating, medians of --repeats; with the largest difference of the two gradients.

    python bench/kl_speed.py --positions 512 --vocab 49152 --repeats 7 --out bench/results/kl/smollm2-block.json

512 x 49,152 is one block of SmolLM2's global refine stage. Run it alone on a quiet machine: it times. `--smoke`
runs toy sizes (tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def seconds(parent: torch.Tensor, logits: torch.Tensor, kl) -> tuple[float, torch.Tensor]:
    """One forward and backward of the mean KL; its wall time and the logits' gradient."""
    logits.grad = None
    started = time.perf_counter()
    kl(parent, logits).mean().backward()
    return time.perf_counter() - started, logits.grad


def main(argv=None) -> dict:
    from mha2gqa.scoring.kl import kl_divergence, kl_through_autograd

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=512, help="positions (one block's tokens)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (SmolLM2's by default)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, help="JSON file for the result")
    parser.add_argument("--smoke", action="store_true", help="toy sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.positions, args.vocab, args.repeats = 8, 300, 2
    generator = torch.Generator().manual_seed(0)
    parent = torch.randn(1, args.positions, args.vocab, generator=generator)
    logits = torch.randn(1, args.positions, args.vocab, generator=generator).requires_grad_(True)
    ways = {
        "hand_written": lambda p, q: kl_divergence(p, q, reduction="none"),
        "autograd": lambda p, q: kl_through_autograd(p, q, 1.0),
    }
    times = {name: [] for name in ways}
    gradients = {}
    for _ in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, kl in ways.items():
            took, gradients[name] = seconds(parent, logits, kl)
            times[name].append(took)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    difference = float((gradients["hand_written"] - gradients["autograd"]).abs().max())
    result = {
        "positions": args.positions,
        "vocab": args.vocab,
        "threads": torch.get_num_threads(),
        "seconds": medians,
        "runs": {name: t[1:] for name, t in times.items()},
        "speedup": medians["autograd"] / medians["hand_written"],
        "largest_gradient_difference": difference,
        "largest_gradient": float(gradients["autograd"].abs().max()),
        "load_average": list(os.getloadavg()),
    }
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
