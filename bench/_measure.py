"""Run a command as a child process and measure its wall time, peak RSS and peak anonymous memory."""

from __future__ import annotations

import os
import subprocess
import threading
import time


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def measure(command: list[str], env: dict | None = None) -> dict:
    """Wall seconds, CPU seconds (user + system), peak RSS (the kernel's ru_maxrss of this child alone) and peak anonymous memory
    (RssAnon sampled every 5 ms: file-backed pages such as the page cache or mmaps are not in it)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_anon = 0
    done = threading.Event()

    def sample():
        nonlocal peak_anon
        while not done.is_set():
            try:
                peak_anon = max(peak_anon, _rss_anon_kib(process.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command} failed: {process.stderr.read().decode()[-2000:]}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "peak_anon_mib": peak_anon / 1024,
    }
