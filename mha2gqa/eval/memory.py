"""Peak memory during a measured region: the CUDA allocator's peak on GPU, sampled RSS on CPU."""

from __future__ import annotations

import threading

import psutil
import torch


class PeakMemory:
    """Context manager; `.peak_bytes` and `.kind` are set on exit.

    On CPU the process RSS is sampled every `interval` seconds by a thread (the OS keeps only a
    lifetime peak, which cannot be reset between grid points).
    """

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval = device, interval
        self.peak_bytes, self.kind = 0, "cuda_max_allocated" if device.type == "cuda" else "cpu_rss"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._process = psutil.Process()
            self.peak_bytes = self._process.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
        return False
