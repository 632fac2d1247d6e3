"""The rates every estimate multiplies its work by, and how this machine compares now with the one they were
measured on.

`python bench/estimate_rates.py` re-makes the rates: it runs the real commands (eval, convert, uptrain) at two
sizes on the embedded model and on SmolLM2-135M, on a quiet machine, reads the seconds of each stage from the
commands' own clocks (clock.py, MHA2GQA_TIMINGS), fits each kind of stage as fixed seconds plus seconds per
unit of work, and writes mha2gqa/data/estimate_rates.json with the probe's time on that machine beside them.
Between and beyond the two models a rate is interpolated on log(parameters) (the nearer one's outside them).

A rate measured on a quiet machine is wrong on a busy one (issue 39: a sweep said 15 min and was on course for
55 at load 4), and a table of "rates at load 3-7" is wrong on both. So a run times a probe when it starts, with
the torch threads it will use (the fastest of 11 rounds of matrix products, the kind of work every stage does:
about 0.6 s on a quiet machine): the probe's seconds here over its seconds on the measuring machine scale every
rate. A quiet twin of the measuring machine gets about 1; two cores shared with two spinning processes, about 2
(while the commands themselves ran 1.9-4x slower: docs/benchmarks.md, "Estimate against wall time").
Why the fastest of many rounds: this machine's speed moves by 2x from one second to the next even when it is
quiet (the host's other guests), and the first rounds after torch starts are slow. Against 80 rounds of the same
work timed right after, in 12 runs at 0-3 spinning processes beside (bench/estimate_probe.py, 2026-12-03), the
fastest of 11 rounds predicted the work's time with a spread (s.d. of the log ratio) of 0.21 and about the same
bias at every count (0.53-0.66, which the rates file's probe, measured the same way, cancels); the median of the
first 5 rounds (about the probe before this one: the median of 3 after one warm-up) 0.31, the median of 15, 0.29.
On one thread (a small model on a busy machine) the fastest round is a lucky one: its bias was 0.28 quiet and
0.47 beside 2 spinners (`--threads 1`), so there it under-states a busy machine by about 1.2x.
A second run of the bench disagreed (fastest 0.21, median 0.14, mean 0.10): the choice is not settled
(docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

RATES_FILE = Path(__file__).resolve().parent.parent / "data" / "estimate_rates.json"
RATES_ENV = "MHA2GQA_ESTIMATE_RATES"  # another rates file (the bench's, a test's)
SMALL, LARGE = 6_163_712, 134_515_008  # the embedded model's parameters and SmolLM2-135M's: the two measured
PROBE_ROUNDS, PROBE_WARMUP = 11, 2


@dataclass(frozen=True)
class Rates:
    """What bench/estimate_rates.py measured: per kind of stage, (at SMALL, at LARGE) fixed seconds and seconds per
    unit of each work term; the probes' seconds on the measuring machine; where and when."""

    kinds: dict
    probe_s: dict  # {"torch": seconds, "numpy": seconds}
    measured: dict  # machine, cores, threads, load before and after, date, command

    def seconds(self, kind: str, parameters: int, work: dict[str, float], fixed: bool = True) -> float:
        """Seconds of one stage on the measuring machine: its fixed part (unless `fixed` is False: a process that
        paid it already) plus each term's work times its rate. A kind or term the bench did not measure (lm-eval
        where it was not installed) counts nothing."""
        entry = self.kinds.get(kind, {})
        total = _between(entry.get("fixed") or (0.0, 0.0), parameters) if fixed else 0.0
        for term, amount in work.items():
            total += amount * _between(entry.get("per", {}).get(term) or (0.0, 0.0), parameters)
        return max(0.0, total)


def _between(pair, parameters: int) -> float:
    """A (SMALL, LARGE) pair at `parameters`, interpolated on log(parameters) (geometrically where both are
    positive), the nearer one's outside; a pair with one value (None for the other) is that value."""
    small, large = pair
    if large is None or small is None:
        return small if large is None else large
    where = min(1.0, max(0.0, math.log(max(parameters, 1) / SMALL) / math.log(LARGE / SMALL)))
    if small > 0 and large > 0:
        return small * (large / small) ** where
    return small + (large - small) * where


def load() -> Rates:
    """The rates file shipped in the package (bench/estimate_rates.py writes it), or MHA2GQA_ESTIMATE_RATES's."""
    return _read(os.environ.get(RATES_ENV) or str(RATES_FILE))


@functools.cache
def _read(path: str) -> Rates:
    if not Path(path).is_file():  # the bench's first run, before any rates exist: every stage costs nothing
        return Rates({}, {"torch": 1.0, "numpy": 1.0}, {"cores": os.cpu_count(), "load": 0.0, "date": "none"})
    raw = json.loads(Path(path).read_text())
    return Rates(raw["kinds"], raw["probe_s"], raw["measured"])


def measured_on() -> str:
    """Where the rates come from, in words: '2 cores at load 0.4, 2026-12-03'."""
    m = load().measured
    return f"{m['cores']} cores at load {m['load']:.1f}, {m['date']}"


# ---- the probe: this machine now against the measuring one ----


def _torch_probe() -> float:
    """One round: the matrix products and activation of a small MLP block, with torch's current threads."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen)
    up, down = torch.randn(512, 1536, generator=gen) / 24, torch.randn(1536, 512, generator=gen) / 40
    started = time.perf_counter()
    with torch.no_grad():
        for _ in range(8):
            x = torch.nn.functional.silu(x @ up) @ down
    return time.perf_counter() - started


def _numpy_probe() -> float:
    """One round of the same block in numpy (the torch-free conversions and dry runs)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 512), dtype=np.float32)
    up = rng.standard_normal((512, 1536), dtype=np.float32) / 24
    down = rng.standard_normal((1536, 512), dtype=np.float32) / 40
    started = time.perf_counter()
    for _ in range(8):
        h = x @ up
        x = (h / (1 + np.exp(-h))) @ down
    return time.perf_counter() - started


PROBES = {"torch": _torch_probe, "numpy": _numpy_probe}


def probe_seconds(kind: str = "torch") -> float:
    """The fastest of PROBE_ROUNDS rounds of the probe (after PROBE_WARMUP rounds that start its threads), in
    seconds."""
    probe = PROBES[kind]
    for _ in range(PROBE_WARMUP):
        probe()
    return min(probe() for _ in range(PROBE_ROUNDS))


@dataclass(frozen=True)
class Machine:
    """This machine now against the measuring one: every rate is multiplied by `factor`."""

    factor: float
    probe_s: float | None
    kind: str

    def words(self) -> str:
        if self.probe_s is None:
            return f"rates of a machine with {measured_on()}, not scaled to this one"
        return (
            f"rates measured on {measured_on()}, x{self.factor:.2g} for this machine now "
            f"(a {self.kind} probe: {self.probe_s * 1000:.0f} ms here)"
        )


def this_machine(kind: str | None = "torch") -> Machine:
    """The factor of a probe run now (`kind` torch, with the threads the command set; numpy; None: no probe, 1)."""
    if kind is None:
        return Machine(1.0, None, "none")
    here = probe_seconds(kind)
    return Machine(here / load().probe_s[kind], here, kind)
