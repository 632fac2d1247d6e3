"""What the serving tests share: a "Python with vLLM" that runs the fake server (tests/fake_vllm), a parent and
its GQA-2 conversion, and a check that no process of a server's group lives on."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

FAKE = Path(__file__).resolve().parent / "fake_vllm"
EMBEDDED = Path(__file__).resolve().parent.parent / "mha2gqa" / "data" / "austen-mha"
QUICK = ["--greedy-tokens", "4", "--prompts-per-domain", "1", "--context", "256", "--eager"]


def fake_python(folder: Path) -> Path:
    """An executable that is this test run's Python with the fake vllm package first on its path."""
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script


def convert_child(dst: Path) -> Path:
    """The embedded parent (8 kv heads) converted to 2 kv heads by mean pooling, written once per call."""
    subprocess.run(
        [sys.executable, "-m", "mha2gqa", "convert", str(EMBEDDED), str(dst), "--groups", "2", "-q"],
        check=True,
        capture_output=True,
    )
    return dst


def core_pids(log_folder: Path) -> list[int]:
    """The pids of the sleeping children the fake servers logged ("fake engine core pid=N")."""
    return [
        int(pid) for log in log_folder.glob("*.log") for pid in re.findall(r"engine core pid=(\d+)", log.read_text())
    ]


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` has ended (a zombie awaiting its reaper counts as ended), within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False
