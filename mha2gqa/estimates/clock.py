"""A long run's time: its estimate before it starts, the remaining time corrected as stages finish, and what
it took at the end (issue 39: eval, uptrain and a refining convert printed no overall estimate at all, and
the ones printed were off by 3.7x on a busy machine).

The command makes a Clock, `begin`s it with its Estimate (costs.py) once it knows its work, marks each stage
as it starts (`stage`), may report progress inside a long stage (`partial`), and `finish`es it. After the
first stage that carries a fair share of the estimate, the rest is scaled by how the finished stages ran
against their estimates, and said once; it is said again only when it moves by more than a third. Lines go
above any progress bar (progress.write_line). A finished run's record (every stage's estimate, its measured
seconds and its work) goes to the callbacks `observe` registered: the one seam for instruments (the benchmarks
that re-make the rates and check estimates against wall times build their timing files on it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mha2gqa.estimates.costs import Estimate, duration, took
from mha2gqa.estimates.stages import START
from mha2gqa.runtime.progress import write_line

FIRST_SHARE = 0.05  # finished stages worth this share of the estimate (or FIRST_SECONDS) make the first correction
FIRST_SECONDS = 10.0
PARTIAL_FRACTION = 0.1  # inside a long stage, the share done before its one progress correction
MOVED = 1 / 3  # a corrected remaining time said again only when it moves by more than this


def process_started() -> float:
    """When the run started, on the time.time() clock: the process's start when the process is the command (`mha2gqa
    ...` or `python -m mha2gqa ...`: its start-up and imports are the run's time), else now (a test or a notebook
    calling the CLI in a process that has lived for a while)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    is_command = (spec is not None and spec.name == "mha2gqa.__main__") or Path(sys.argv[0]).name == "mha2gqa"
    if not is_command:
        return time.time()
    started = _linux_start()
    if started is not None:
        return started
    try:
        import psutil

        return psutil.Process().create_time()
    except (ImportError, OSError):
        return time.time()


def _linux_start() -> float | None:
    """The process's start on the time.time() clock from /proc/self/stat's start time (clock ticks after boot) and
    the time since boot now, to a tick (10 ms); None off Linux. Why not psutil's create_time: it adds that start
    to the boot time /proc/stat gives in whole seconds, so it read up to a second early (0.47 s on the development
    machine), which the "start" stage of every timing carried (issue 59's 1.73 s of a 2.77 s run)."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(after_name[19])  # field 22, starttime; the fields after the name start at field 3
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Clock:
    """The stages of one run, timed against its estimate."""

    def __init__(self, echo=write_line, started: float | None = None):
        self.echo = echo
        self.started = process_started() if started is None else started
        self.estimate: Estimate | None = None
        self.finished: list[tuple[str, float]] = []  # (stage, seconds) in order
        self.peak_rss: list[int | None] = []  # the process's peak RSS so far as each finished stage ended
        self.current, self.current_started = START.name, self.started
        self.said_remaining: tuple[float, float] | None = None  # (remaining, when said)
        self.partial_said: set[str] = set()
        self.load_at_begin = _load()

    def begin(self, estimate: Estimate | Callable[[], Estimate]) -> None:
        """Say the estimate: time, peak memory, each stage's share and what the rates were scaled by. A callable
        is called here (NO_CLOCK never calls it: a library call pays for no probe)."""
        self.estimate = estimate if isinstance(estimate, Estimate) else estimate()
        if self.estimate is None:  # the work is not known (a model's size): nothing to say, nothing corrected
            return
        self.load_at_begin = _load()
        self.echo(self.estimate.line())

    def stage(self, name: str) -> None:
        """Stage `name` starts now; the one before it ends."""
        now = time.time()
        self.finished.append((self.current, now - self.current_started))
        self.peak_rss.append(_peak_rss())
        self.current, self.current_started = name, now
        self._correct(now)

    def partial(self, fraction: float) -> None:
        """`fraction` of the current stage is done: once per stage, past PARTIAL_FRACTION, the rest corrected."""
        now = time.time()
        elapsed = now - self.current_started
        if self.estimate is None or self.current in self.partial_said or fraction < PARTIAL_FRACTION:
            return
        planned = self._estimated(self.current)
        if not planned or elapsed < min(FIRST_SECONDS, FIRST_SHARE * self.estimate.seconds()):
            return
        self.partial_said.add(self.current)
        ratio = elapsed / (planned * fraction)
        remaining = planned * (1 - fraction) * ratio + ratio * self._later(self.current)
        self._say(now, remaining, f"{self.current}: {100 * fraction:.0f}% in {took(elapsed)}", force=True)

    def finish(self) -> float:
        """The last stage ends: say what the run took, beside the estimate; returns the seconds."""
        now = time.time()
        self.finished.append((self.current, now - self.current_started))
        self.peak_rss.append(_peak_rss())
        total = now - self.started
        if self.estimate is not None:
            self.echo(f"took {took(total)} (estimated {duration(self.estimate.seconds())})")
            record = self.record(total)
            for callback in _OBSERVERS:
                callback(record)
        return total

    # ---- the correction ----

    def _estimated(self, name: str) -> float:
        stages = self.estimate.stages if self.estimate else ()
        return sum(s for stage, s in zip(stages, self.estimate.stage_seconds()) if stage.name == name) if stages else 0

    def _later(self, name: str) -> float:
        """The estimate of every stage after `name` (all of them when `name` is not one)."""
        names = [stage.name for stage in self.estimate.stages]
        later = names[names.index(name) + 1 :] if name in names else names
        done = {stage for stage, _ in self.finished}
        return sum(self._estimated(n) for n in later if n not in done)

    def _correct(self, now: float) -> None:
        if self.estimate is None:
            return
        done = {name for name, _ in self.finished}
        planned = sum(self._estimated(name) for name in done)
        if planned <= 0 or planned < min(FIRST_SECONDS, FIRST_SHARE * self.estimate.seconds()):
            return
        ratio = (now - self.started) / planned
        remaining = ratio * (self._estimated(self.current) + self._later(self.current))
        self._say(now, remaining, f"{len(done)} stage{'s' if len(done) > 1 else ''} in {took(now - self.started)}")

    def _say(self, now: float, remaining: float, what: str, force: bool = False) -> None:
        if self.said_remaining is not None and not force:
            before, when = self.said_remaining
            expected = max(0.0, before - (now - when))
            if abs(remaining - expected) <= MOVED * max(expected, 30.0):
                return
        self.said_remaining = (remaining, now)
        self.echo(f"{what}: about {duration(remaining)[6:]} left (corrected from how the run went so far)")

    def record(self, total: float) -> dict:
        """What the finished run took, stage by stage, beside its estimate and its work (what observers get)."""
        estimated = dict(zip((s.name for s in self.estimate.stages), self.estimate.stage_seconds()))
        costs = {s.name: s for s in self.estimate.stages}
        stages = [  # peak_rss_bytes: the stage whose end raised it first is where the run's memory peaked
            {"name": name, "seconds": seconds, "estimated_s": estimated.get(name, 0.0), "peak_rss_bytes": rss}
            | (costs[name].record() if name in costs else {"parts": []})
            for (name, seconds), rss in zip(self.finished, self.peak_rss)
        ]
        record = {
            "command": sys.argv,
            "took_s": total,
            "estimate_s": self.estimate.seconds(),
            "factor": self.estimate.machine.factor,
            "fine_factor": self.estimate.machine.fine_factor,
            "probe_s": self.estimate.machine.probe_s,
            "probe": self.estimate.machine.kind,
            "threads": _threads(),
            "load": [self.load_at_begin, _load()],
            "peak_bytes": self.estimate.peak_bytes,
            "stages": stages,
        }
        return record


_OBSERVERS: list[Callable[[dict], None]] = []


def observe(callback: Callable[[dict], None]) -> Callable[[], None]:
    """Call `callback(record)` (Clock.record) as each command's run in this process finishes, quiet runs too;
    returns the function that removes it."""
    _OBSERVERS.append(callback)
    return lambda: _OBSERVERS.remove(callback)


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _peak_rss() -> int | None:
    """The process's peak resident memory so far, in bytes (Linux counts ru_maxrss in KiB, macOS in bytes)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


class _NoClock:
    """What a library call gets when no command times it: every mark does nothing."""

    def begin(self, estimate) -> None:
        pass

    def stage(self, name: str) -> None:
        pass

    def partial(self, fraction: float) -> None:
        pass

    def finish(self) -> float:
        return 0.0


NO_CLOCK = _NoClock()


def command_clock(quiet: bool = False, echo=write_line):
    """A command's clock: one that speaks; with --quiet, one that keeps its lines to itself but still records the
    run where an observer listens (a benchmark's runs are quiet), else none."""
    if not quiet:
        return Clock(echo=echo)
    return Clock(echo=lambda line: None) if _OBSERVERS else NO_CLOCK
