"""How many CPU threads torch uses: `mha2gqa --threads N`, else MHA2GQA_THREADS, else the command's default.

Torch starts one thread per core. On a small model (the embedded one of the demo, `reproduce` and the
tests) the matrices are too small to share out, and on a machine that other processes keep busy the
extra thread spins against them: on the 2-core development machine at load 14-19, `demo --quick` took
288 s with one thread against 346 s with torch's two, and `uptrain --recipe recipes/tiny-cpu.yaml` 177 s
against over 1,214 s for three quarters of it with two (docs/benchmarks.md, `python bench/threads.py`). So `demo`, `reproduce`, and `eval` and
`uptrain` of a local model under SMALL_MODEL_BYTES default to one thread; a larger model (whose CPU work
does share out) keeps torch's default. A user's own OMP_NUM_THREADS is respected as it is. The count
also reaches the processes a command starts (an `accelerate launch`), through OMP_NUM_THREADS.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mha2gqa.errors import InputError

ENV = "MHA2GQA_THREADS"
SMALL_MODEL_THREADS = 1  # the embedded 6M-parameter model (demo, reproduce) and other small ones


# A model this small (its float32 weights) runs faster on one thread on a shared CPU (docs/benchmarks.md).
SMALL_MODEL_BYTES = 1 << 30


def for_model(source: str | os.PathLike | None) -> int | None:
    """SMALL_MODEL_THREADS for a local model of under SMALL_MODEL_BYTES: a directory's safetensors, or a
    config (file, or a directory without weights) sized as float32; None (torch's default) otherwise."""
    if source is None:
        return None
    path = Path(source).expanduser()
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0
    if not weights:
        config = path / "config.json" if path.is_dir() else path
        weights = _config_bytes(config) if config.is_file() else 0
    return SMALL_MODEL_THREADS if 0 < weights < SMALL_MODEL_BYTES else None


def _config_bytes(config_file: Path) -> int:
    """float32 bytes of a decoder this config describes (embeddings + 12 d^2 per layer): an estimate,
    enough to tell a small model from a large one; 0 when the file does not say."""
    try:
        config = json.loads(config_file.read_text()[:1_000_000])
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab = int(config.get("vocab_size", 0))
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
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
