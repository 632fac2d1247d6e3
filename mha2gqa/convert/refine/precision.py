"""The precision of the global stage's fit steps (`--refine-global-precision`): bfloat16 autocast where this
machine's bfloat16 products pay, float32 elsewhere.

Why: on a CPU with bfloat16 matrix units (Intel AMX, Sapphire Rapids and later) a bfloat16 product of the
global stage's shapes ran 6x its float32 twin (2,039 against 327 GFLOP/s, 512 x 576 x 1536, 2 threads), and
one step of SmolLM2's global stage (the parent's forward, the converted model's forward and backward of one
block) took 1.56 s against 2.49 s. The stage does the same work in less time, which the default spends on more
steps (docs/refine.md "The fit steps in bfloat16 where it pays"). On a CPU without such units bfloat16 is emulated and
slower. What `auto` means on this machine is decided once, by convert's plan, from the CPU's flags
(convert/decide.py, mha2gqa/runtime/machine.py): the run receives `float32` or `bfloat16`, never `auto`, and asks
nothing of the machine.

What stays float32 either way: the parameters and Adam's state (the masters, global_stage._step), the KL and
its gradient (kl.py turns autocast off inside), and the held-out checks that pick the step kept, so the
measure a run is judged by does not move with the machine. A GPU runs float32 under `auto`: not measured here.
"""

from __future__ import annotations

import torch


def fit_autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype the global stage's fit steps autocast to (None: float32, no autocast). `precision` is the plan's
    explicit choice: `auto` here is a caller that skipped the plan (convert/decide.py decides it)."""
    if precision == "bfloat16":
        return torch.bfloat16
    if precision == "float32":
        return None
    raise ValueError(
        f"--refine-global-precision {str(precision)!r} reached the global stage undecided: convert's plan replaces "
        "`auto` by float32 or bfloat16 (mha2gqa.convert.decide.decide)"
    )
