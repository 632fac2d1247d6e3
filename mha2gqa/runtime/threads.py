"""How many CPU threads torch uses: `mha2gqa --threads N`, else MHA2GQA_THREADS, else the command's default.

Torch starts one thread per core. On a small model (the embedded one of the demo, `reproduce` and the
tests) that is right on an idle machine and wrong on a busy one. Measured with `python bench/threads.py`
on the 2-core development machine (docs/benchmarks.md): at load 0.9, two threads ran an eval forward
1.75x and a training step 1.64x faster than one; at load 14-19 one thread was 2.5x / 1.2x faster, since
the extra thread spins against the other processes (`demo --quick` 288 s with one against 346 s with
two; `uptrain --recipe recipes/tiny-cpu.yaml` 177 s against over 1,214 s for three quarters of it). So
`demo`, `reproduce`, and `eval` and `uptrain` of a local model under SMALL_MODEL_BYTES use one thread
when the machine is busy (`machine_busy`: other processes already keep every core occupied) and torch's
default otherwise; a larger model (whose CPU work shares out) keeps torch's default. A user's own count
(--threads, MHA2GQA_THREADS, OMP_NUM_THREADS) is respected as it is. The count also reaches the
processes a command starts (an `accelerate launch`), through OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mha2gqa.files.reading import read_json
from mha2gqa.runtime.errors import InputError

ENV = "MHA2GQA_THREADS"
MAX_THREADS = 4096  # the largest CPU machines have a few hundred cores
SMALL_MODEL_THREADS = 1  # the embedded 6M-parameter model (demo, reproduce) and other small ones


# A model this small (its float32 weights) runs faster on one thread on a shared CPU (docs/benchmarks.md).
SMALL_MODEL_BYTES = 1 << 30


def machine_busy() -> bool:
    """Whether other processes already occupy every core: the 1-minute load average is at least the core
    count less half a core. (Read when a command starts, before it adds load of its own.)"""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return False
    return load >= (os.cpu_count() or 1) - 0.5


def small_model_default() -> int | None:
    """The count for a small model: SMALL_MODEL_THREADS on a busy machine, torch's default (None) otherwise."""
    return SMALL_MODEL_THREADS if machine_busy() else None


def for_model(source: str | os.PathLike | None) -> int | None:
    """`small_model_default()` for a local model of under SMALL_MODEL_BYTES: a directory's safetensors, or
    a config (file, or a directory without weights) sized as float32; None (torch's default) otherwise."""
    if source is None:
        return None
    path = Path(source).expanduser()
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0
    if not weights:
        config = path / "config.json" if path.is_dir() else path
        weights = _config_bytes(config) if config.is_file() else 0
    return small_model_default() if 0 < weights < SMALL_MODEL_BYTES else None


def _config_bytes(config_file: Path) -> int:
    """float32 bytes of a decoder this config describes (embeddings + 12 d^2 per layer): an estimate,
    enough to tell a small model from a large one; 0 when the file does not say."""
    try:  # the bounded reader: a hostile config is refused later, where the model is read for real
        config = read_json(config_file, "fix the model's config.json")
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab = int(config.get("vocab_size", 0))
    except (InputError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    return 4 * (2 * vocab * hidden + 12 * layers * hidden * hidden)


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
    if count > MAX_THREADS:  # torch takes a C int, and more threads than this is a typo, not a machine
        raise InputError(
            f"{where} {value!r} is more than {MAX_THREADS:,} threads: give at most the machine's cores "
            f"(this one has {os.cpu_count()})"
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
