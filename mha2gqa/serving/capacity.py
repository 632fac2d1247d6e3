"""How many requests each model's KV cache holds at once, and how many the engine ran while a load was on.

A GQA child's saving in time shows twice: each decode step reads less cache (the decode-only time per output
token, measured at a concurrency every model fits), and at one KV budget it fits more sequences at once, so at a
concurrency above what the parent fits the parent queues requests the child runs (the capacity-bound
throughput). vLLM gives each request whole blocks of `block_size` tokens, prompt and output, so a model fits
floor((KV blocks - 1) / blocks per request) requests (one block is vLLM's null block); a request admitted past that
is preempted and recomputed (`vllm:num_preemptions_total`); the engine's own count of the requests it runs is the gauge
`vllm:num_requests_running` of its /metrics, read by RunningSampler every SAMPLE_S while the load runs.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable

from mha2gqa.serving.kvlog import Unreadable, metrics_page

SAMPLE_S = 0.5
MOST_AUTO = 64  # the most requests in flight --capacity-concurrency auto asks for (minutes of CPU past it)
# `vllm:num_requests_running{engine="0",model_name="smol"} 3.0`: a gauge, labelled or not, its value a float.
_GAUGE = re.compile(r"^(?P<name>vllm:[a-z_]+)(?:\{[^}]*\})?\s+(?P<value>\S+)\s*$", re.MULTILINE)
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "preemptions": "vllm:num_preemptions_total"}  # fmt: skip


def request_gauges(metrics: str | None) -> dict:
    """{running, waiting, preemptions} from a /metrics page, each None when absent (summed over engines: a
    server with several engine cores lists one line each). Unreadable for a value that is no number."""
    found: dict[str, float | None] = dict.fromkeys(GAUGES)
    names = {metric: key for key, metric in GAUGES.items()}
    for line in _GAUGE.finditer(metrics_page(metrics) or ""):
        key = names.get(line["name"])
        if key is None:
            continue
        try:
            value = float(line["value"])
        except ValueError:
            raise Unreadable(f"/metrics' {line['name']} {line['value'][:40]!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise Unreadable(f"/metrics' {line['name']} {line['value'][:40]!r} is not a count")
        found[key] = (found[key] or 0.0) + value
    return found


def requests_fit(
    kv_tokens: int | None, block_size: int | None, tokens_per_request: int, blocks: int | None = None
) -> int | None:
    """How many requests of `tokens_per_request` (prompt + output) a cache runs at once, in whole blocks as vLLM
    allocates them, less the one block its pool keeps as the null block and never gives a request
    (vllm/v1/core/block_pool.py; its log's "Maximum concurrency" counts that block too, so a request more). The
    blocks are the engine's own count (/metrics' num_gpu_blocks) where known, else `kv_tokens` in whole blocks;
    tokens when the block size is unknown; None when neither count is known."""
    if block_size and blocks:
        return max(blocks - 1, 0) // math.ceil(tokens_per_request / block_size)
    if not kv_tokens:
        return None
    if not block_size:
        return kv_tokens // tokens_per_request
    return max(kv_tokens // block_size - 1, 0) // math.ceil(tokens_per_request / block_size)


def auto_concurrency(fits: dict[str, int | None], parent: str) -> tuple[int | None, str]:
    """--capacity-concurrency auto: (the concurrency, why) -- twice what the parent fits, at most what the child
    that fits most runs, so the parent queues and that child does not; (None, why not) when the parent fits all a
    child does, a count is unknown, or the point would need more than MOST_AUTO requests in flight."""
    held = fits.get(parent)
    most = max((n for label, n in fits.items() if label != parent and n), default=None)
    if not held or not most:
        return None, "the engine reported no KV size to count the requests each model fits"
    if most <= held:
        return None, f"no child fits more requests than the parent ({held})"
    wanted = min(2 * held, most)
    if wanted > MOST_AUTO:
        return None, (
            f"the parent fits {held} requests at this --kv-cache-memory: a capacity point needs more than {MOST_AUTO} in "
            "flight; pass a smaller --kv-cache-memory, or --capacity-concurrency N"
        )
    return wanted, f"twice the {held} requests the parent fits, at most the {most} a child fits"


class RunningSampler:
    """`with RunningSampler(read) as s:` reads the gauges (read() returns a /metrics page or None) every
    SAMPLE_S in a thread while the block runs; s.summary() after: how many requests the engine ran."""

    def __init__(self, read: Callable[[], str | None], every_s: float = SAMPLE_S):
        self.read, self.every_s = read, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: str | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(request_gauges(self.read()))
            except Unreadable as err:  # kept for the record; the load's own numbers still stand
                self.error = str(err)
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> RunningSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict:
        """{running_max, running_mean (over samples while any request ran or waited), waiting_max, preemptions
        (over the load), samples, error}; None where the engine's /metrics lacked the gauge."""
        running = [s["running"] for s in self.samples if s["running"] is not None]
        waiting = [s["waiting"] for s in self.samples if s["waiting"] is not None]
        busy = [s["running"] for s in self.samples if s["running"] or s["waiting"]]
        preempted = [s["preemptions"] for s in self.samples if s["preemptions"] is not None]
        return {
            "running_max": max(running) if running else None,
            "running_mean": sum(busy) / len(busy) if busy else None,
            "waiting_max": max(waiting) if waiting else None,
            "preemptions": preempted[-1] - preempted[0] if len(preempted) > 1 else None,
            "samples": len(self.samples),
            "error": self.error,
        }
