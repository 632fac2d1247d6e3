"""The rates every estimate multiplies its work by, and how this machine compares now with the one they were
measured on.

`python bench/estimate_rates.py` re-makes the rates: it runs the real commands (eval, convert, uptrain) at two
sizes on the embedded model and on SmolLM2-135M, on a quiet machine, reads the seconds of each stage from the
commands' own clocks (clock.py's observers), fits each kind of stage as fixed seconds plus seconds per
unit of work, and writes mha2gqa/data/estimate_rates.json with the probe's time on that machine beside them.
Between and beyond the two models a rate is interpolated on log(parameters) (the nearer one's outside them).

A rate measured on a quiet machine is wrong on a busy one (issue 39: a sweep said 15 min and was on course for
55 at load 4), and a table of "rates at load 3-7" is wrong on both. So a long run times a probe when it starts,
with the torch threads it will use (up to 11 rounds of matrix products, the kind of work most stages do: about
0.6 s on a quiet machine): the probe's seconds here over its seconds on the measuring machine scale every rate.
A run is priced at the stored rates first and probes only when that price is 10 s or more, with rounds sized to
2% of it (this_machine, probe_rounds): a probe must not cost more than the work it prices (issue 59). A quiet twin
of the measuring machine gets about 1; two cores shared with two spinning processes, about 2.3. Which round stands
for the machine (probe_seconds): on several threads the fastest, since the machine's speed moves by 2x from one
second to the next even when it is quiet (the host's other guests) and a round on several threads cannot dodge a
busy machine; on one thread (mha2gqa/runtime/threads.py gives a small model one on a busy machine) the geometric mean
of the fastest and the median, since there the fastest round is one the scheduler left alone (probe_seconds).
A run with refine stages (FINE_KINDS) also times a probe of small products, torch_fine (the median of its rounds),
and it scales those stages alone: thousands of small Adam steps slow down on a shared machine about twice as much
as large products.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

RATES_FILE = Path(__file__).resolve().parent.parent / "data" / "estimate_rates.json"
SMALL, LARGE = 6_163_712, 134_515_008  # the embedded model's parameters and SmolLM2-135M's: the two measured
PROBE_ROUNDS, PROBE_WARMUP = 11, 2
# When a run probes (issue 59: a 1-second probe said that a 2-second plain conversion takes about 5): only when its
# work, priced at the stored rates, is PROBE_AFTER_S or more, and then with as many rounds (up to PROBE_ROUNDS) as
# keep every probe it takes, warmup included, within PROBE_SHARE of that price on the measuring machine; fewer than
# MIN_PROBE_ROUNDS rounds would say nothing steady, so none are taken (the torch probe needs 11 s of priced work,
# numpy's 15 s, torch's with the small products' 23 s). Shorter runs say the stored rates' estimate. Why 10 s and not
# more: SmolLM2's mean conversion, 15 s quiet, took 46 s beside two busy processes, and its probed estimate said 33.
PROBE_AFTER_S = 10.0
PROBE_SHARE = 0.02
MIN_PROBE_ROUNDS = 3


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
        total = between(entry.get("fixed") or (0.0, 0.0), parameters) if fixed else 0.0
        for term, amount in work.items():
            total += amount * between(entry.get("per", {}).get(term) or (0.0, 0.0), parameters)
        return max(0.0, total)


def between(pair, parameters: int) -> float:
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
    """The rates file shipped in the package (re-made by the estimate-rates benchmark; a test points RATES_FILE at
    its own)."""
    return _read(str(RATES_FILE))


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


def _fine_probe() -> float:
    """One round of fine-grained work, refine's kind: eight Adam steps of a small attention block (4 blocks of 64
    tokens, 256 wide, 8 heads), each product microseconds long. On a shared machine every such product waits for
    the slowest of torch's threads, so this work slows down far more than the large products of the torch probe:
    the refine stages of the embedded model ran 4.8x slower beside two spinning processes while the torch probe
    said 2.1x (docs/benchmarks.md)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 256, generator=gen)
    qkv = (torch.randn(768, 256, generator=gen) / 16).requires_grad_()
    out = (torch.randn(256, 256, generator=gen) / 16).requires_grad_()
    optimizer = torch.optim.Adam([qkv, out], lr=1e-3)
    started = time.perf_counter()
    for _ in range(8):
        q, k, v = F.linear(x, qkv).view(4, 64, 3, 8, 32).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(4, 64, 256)
        loss = (F.linear(attended, out) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


PROBES = {"torch": _torch_probe, "numpy": _numpy_probe, "torch_fine": _fine_probe}
FINE_KINDS = frozenset({"refine", "refine_global"})  # stages of many small products: scaled by the torch_fine probe


def probe_seconds(kind: str = "torch", rounds: int = PROBE_ROUNDS) -> float:
    """The probe's time here, from `rounds` rounds after PROBE_WARMUP that start its threads. Which summary
    stands for the machine depends on whether a round can dodge a busy machine (measured beside two spinning
    processes, docs/benchmarks.md "Estimate against wall time"):
    - large products on several threads cannot (each waits for all its threads): the fastest round, the one least
      disturbed by the host's own noise (it read 2.5-3.1x where commands on two threads ran 2.4-3.0x);
    - on one thread (a small model on a busy machine, mha2gqa/runtime/threads.py) the fastest round is one the scheduler
      left alone (1.8-2.2x) and the median is not far from the worst (2.7-4.0x), where commands on one thread ran
      2.4-2.6x: the geometric mean of the two (2.3-2.9x);
    - small products (torch_fine) dodge on any count: the median (3.9-5.1x, as refine's stages ran 4.8x; the fastest
      round read 1.7-2.6x)."""
    probe = PROBES[kind]
    for _ in range(PROBE_WARMUP):
        probe()
    rounds = [probe() for _ in range(rounds)]
    if kind == "torch_fine":
        return statistics.median(rounds)
    if kind == "torch" and _torch_threads() == 1:
        return math.sqrt(min(rounds) * statistics.median(rounds))
    return min(rounds)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@dataclass(frozen=True)
class Machine:
    """This machine now against the measuring one: every rate is multiplied by `factor`, a FINE_KINDS rate by
    `fine_factor` when the run measured one (a run with such stages)."""

    factor: float
    probe_s: float | None
    kind: str
    fine_factor: float | None = None
    why: str = ""  # unprobed: why not (a short run)

    def factor_for(self, kind: str) -> float:
        return self.fine_factor if self.fine_factor is not None and kind in FINE_KINDS else self.factor

    def words(self) -> str:
        if self.probe_s is None:
            return f"rates of a machine with {measured_on()}, not scaled to this one" + (
                f": {self.why}" if self.why else ""
            )
        fine = f", x{self.fine_factor:.2g} for small products" if self.fine_factor is not None else ""
        return (
            f"rates measured on {measured_on()}, x{self.factor:.2g}{fine} for this machine now "
            f"(a {self.kind} probe: {self.probe_s * 1000:.0f} ms here)"
        )


STORED = Machine(1.0, None, "none")
SHORT_RUN = f"a probe would cost more than {PROBE_SHARE:.0%} of a run this short"  # the stored rates as measured: what a run is priced at before any probe


def this_machine(kind: str | None, fine: bool, priced_s: float) -> Machine:
    """This machine now for a run whose work the stored rates price at `priced_s`: the factor of a probe (`kind`
    torch, with the threads the command set; numpy; None: no probe) and, with `fine`, the torch_fine probe's, for a
    run with FINE_KINDS stages (when the rates file has it), each probe sized by probe_rounds; the stored rates,
    unscaled, where the run is too short to be worth a probe. Commands reach it through costs.for_this_machine."""
    if kind is None:
        return STORED
    measured = load().probe_s
    kinds = [kind] + (["torch_fine"] if fine and "torch_fine" in measured else [])
    rounds = probe_rounds(priced_s, kinds)
    if not rounds:
        return Machine(1.0, None, "none", why=SHORT_RUN)
    here = probe_seconds(kind, rounds)
    fine_factor = probe_seconds("torch_fine", rounds) / measured["torch_fine"] if len(kinds) > 1 else None
    return Machine(here / measured[kind], here, kind, fine_factor)


def probe_rounds(priced_s: float, kinds: list[str]) -> int:
    """Timed rounds each probe of `kinds` takes for a run priced at `priced_s`: none under PROBE_AFTER_S; else as
    many as keep them all, warmup included, within PROBE_SHARE of the price (at the probes' stored seconds a round),
    at most PROBE_ROUNDS; none where that is under MIN_PROBE_ROUNDS."""
    if not priced_s >= PROBE_AFTER_S:
        return 0
    measured = load().probe_s
    per_round = sum(measured.get(kind, 0.0) for kind in kinds)
    affordable = int(PROBE_SHARE * priced_s / per_round) - PROBE_WARMUP if per_round > 0 else PROBE_ROUNDS
    rounds = min(PROBE_ROUNDS, affordable)
    return rounds if rounds >= MIN_PROBE_ROUNDS else 0
