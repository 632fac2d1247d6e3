"""The precision of the global stage's fit steps (`--refine-global-precision`): bfloat16 autocast where this
machine's bfloat16 products pay, float32 elsewhere.

Why: on a CPU with bfloat16 matrix units (Intel AMX, Sapphire Rapids and later) a bfloat16 product of the
global stage's shapes ran 6x its float32 twin (2,039 against 327 GFLOP/s, 512 x 576 x 1536, 2 threads), and
one step of SmolLM2's global stage (the parent's forward, the converted model's forward and backward of one
block) took 1.56 s against 2.49 s. The stage does the same work in less time, which the default spends on more
steps (docs/refine.md "The fit steps in bfloat16 where it pays"). On a CPU without such units bfloat16 is emulated and
slower, so `auto` asks this machine (bf16_speedup) rather than trusting a flag of torch's.

What stays float32 either way: the parameters and Adam's state (the masters, global_stage._step), the KL and
its gradient (kl.py turns autocast off inside), and the held-out checks that pick the step kept, so the
measure a run is judged by does not move with the machine. A GPU runs float32 under `auto`: not measured here.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

AUTO_MIN_SPEEDUP = 2.0  # bfloat16 products at least this much faster than float32 ones: `auto` picks bfloat16
PROBE_SHAPE = (256, 576, 1536)  # rows x hidden x MLP width: SmolLM2's, the model the choice was measured on
PROBE_ROUNDS = 5


def fit_autocast_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype the global stage's fit steps autocast to on `device` (None: float32, no autocast)."""
    if precision == "bfloat16":
        return torch.bfloat16
    if precision == "float32" or torch.device(device).type != "cpu":
        return None
    return torch.bfloat16 if bf16_speedup() >= AUTO_MIN_SPEEDUP else None


@functools.cache
def bf16_speedup() -> float:
    """How many times faster this CPU multiplies in bfloat16 than in float32, with torch's current threads: the
    median of PROBE_ROUNDS timed products of PROBE_SHAPE each (a few milliseconds in all with AMX; under a
    second without). Asked once a process."""
    rows, inner, outer = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(rows, inner, generator=generator), torch.randn(inner, outer, generator=generator)
    return _median_seconds(left, right) / _median_seconds(left.bfloat16(), right.bfloat16())


def _median_seconds(left: torch.Tensor, right: torch.Tensor) -> float:
    left @ right  # the first call pays for the kernel's setup
    rounds = []
    for _ in range(PROBE_ROUNDS):
        started = time.perf_counter()
        for _ in range(4):
            left @ right
        rounds.append(time.perf_counter() - started)
    return statistics.median(rounds)
