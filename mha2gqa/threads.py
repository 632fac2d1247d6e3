"""How many CPU threads torch uses: `mha2gqa --threads N`, else MHA2GQA_THREADS, else the command's default.

Torch starts one thread per core. On the small embedded model (the demo, `reproduce`, the tests) the
matrices are too small to share out, and on a machine that other processes keep busy the extra thread
spins against them: `demo --quick` took 288 s with one thread and 346 s with torch's two on the 2-core
development machine at load 14-18, with 2.3x less CPU time (`python bench/threads.py` gives the
per-step ratios; docs/benchmarks.md). So `demo` and `reproduce` default to one thread; every other
command keeps torch's default (its model may be a large one, whose CPU work does share out). A user's
own OMP_NUM_THREADS is respected as it is. The count also reaches the processes a command starts (an
`accelerate launch`), through OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
import sys

from mha2gqa.errors import InputError

ENV = "MHA2GQA_THREADS"
SMALL_MODEL_THREADS = 1  # demo and reproduce: the embedded 6M-parameter model


def parse(value: str | int, where: str) -> int:
    """A thread count: a whole number of at least 1."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise InputError(
            f"{where} {value!r} must be a whole number of threads, at least 1 (e.g. 1 or {os.cpu_count()})"
        )
    return count


def requested() -> int | None:
    """The count the user asked for (--threads sets MHA2GQA_THREADS), or None."""
    value = os.environ.get(ENV)
    return parse(value, ENV) if value not in (None, "") else None


def apply(default: int | None = None) -> int | None:
    """Use the user's count, else `default` unless OMP_NUM_THREADS says otherwise; None: torch's own.
    Returns the count set (or None when torch's default stands)."""
    count = requested()
    if count is None and default is not None and "OMP_NUM_THREADS" not in os.environ:
        count = default
    if count is None:
        return None
    os.environ["OMP_NUM_THREADS"] = str(count)  # read when torch starts, and by child processes
    if "torch" in sys.modules:  # already started (an in-process caller): set it directly
        sys.modules["torch"].set_num_threads(count)
    return count
