"""bench/bf16_numpy_pool.py at its smoke size: numpy's bit-level bf16 pooling stays bit-identical to
the package's group_mean (the script exits 1 if not), so the measurement cannot rot."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_numpy_bf16_pooling_is_bit_identical_at_smoke_size():
    done = subprocess.run(
        [sys.executable, "bench/bf16_numpy_pool.py", "--smoke"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 -> 2 kv heads" in done.stdout and done.stdout.rstrip().endswith("bit-identical: True")
