"""The KV-cache numbers as the engine reports them, and the same numbers by our formula.

vLLM logs, once its cache is allocated, "CPU KV cache size: 87,296 tokens, Maximum concurrency for 512 tokens
per request: 170.50x" (one line on a CPU; "GPU KV cache size: N tokens" and the concurrency on two lines on a
GPU), and its /metrics carries the same in `vllm:cache_config_info`'s labels with the block size. The engine
gives the KV cache whole blocks of `block_size` tokens: tokens = floor(budget / (bytes per token * block)) *
block. So our formula, 2 * layers * kv_heads * head_dim * dtype bytes per token, predicts the engine's count
exactly, and the child/parent ratio of the engine's counts differs from the formula's by the rounding alone.
"""

from __future__ import annotations

import re

# The numbers are caught loosely (anything up to the next space) and read by _count/_times alone, so a number
# the engine wrote in a form we do not know is refused by name, never read as something else or skipped.
_SIZE = re.compile(r"\b(?P<device>[A-Z]+) KV cache size: (?P<tokens>\S+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for (?P<context>\S+) tokens per request: (?P<times>[^\sx]*)x")
_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_COUNT = re.compile(r"\d{1,3}(?:,\d{3})+|\d{1,20}")  # 87,296 or 87296: at most 20 digits, as u64
_TIMES = re.compile(r"\d{1,20}(?:\.\d{1,20})?")  # 170.50


class Unreadable(ValueError):
    """A number the engine reported (its log, its /metrics) that is not one: args[0] says which and what it held."""


def _count(text: str, what: str) -> int:
    """The one reader of a whole number the engine reports (tokens, context, block size, bytes)."""
    if not _COUNT.fullmatch(text):
        raise Unreadable(f"{what} {text[:40]!r} is not a whole number")
    return int(text.replace(",", ""))


def _times(text: str, what: str) -> float:
    """The one reader of a decimal the engine reports (the maximum concurrency, e.g. 170.50)."""
    if not _TIMES.fullmatch(text):
        raise Unreadable(f"{what} {text[:40]!r} is not a decimal number")
    return float(text)


def from_log(text: str) -> dict:
    """{device, tokens, context, max_concurrency} from the server's log, each None when the log lacks it
    (the last report wins: a restarted engine reports again). Unreadable for a report whose number is none."""
    sizes, concurrencies = list(_SIZE.finditer(text)), list(_CONCURRENCY.finditer(text))
    size, concurrency = (sizes or [None])[-1], (concurrencies or [None])[-1]
    return {
        "device": size["device"] if size else None,
        "tokens": _count(size["tokens"], "the KV cache size in its log") if size else None,
        "context": _count(concurrency["context"], "the context in its log's concurrency line") if concurrency else None,
        "max_concurrency": _times(concurrency["times"], "the maximum concurrency in its log") if concurrency else None,
    }


# A line of the Prometheus text format vLLM's /metrics serves: a comment, or a metric name, its labels, a value.
_METRIC_LINE = re.compile(r"#.*|[A-Za-z_:][A-Za-z0-9_:]*(\{.*\})?\s+\S+(\s+\S+)?")


def metrics_page(metrics: str | None) -> str | None:
    """The one reader of a /metrics body: the text as it came when every line is a comment or a metric (None
    stays None: no page); Unreadable for anything else (an HTML page from a proxy, another server on the port)."""
    for line in (metrics or "").splitlines():
        if line.strip() and not _METRIC_LINE.fullmatch(line.strip()):
            shown = " ".join(metrics.split())[:40]
            raise Unreadable(
                f"/metrics answered {shown!r}, not the metrics text vLLM serves: is another server answering on "
                "this port, or a proxy in between?"
            )
    return metrics


def cache_info(metrics: str | None) -> dict:
    """The labels of `vllm:cache_config_info` in a /metrics page ({} when absent): block_size, num_gpu_blocks
    (the KV blocks, whatever the device), kv_cache_memory_bytes, kv_cache_size_tokens, ..."""
    found = _INFO.search(metrics_page(metrics) or "")
    return dict(_LABEL.findall(found["labels"])) if found else {}


def _label_count(info: dict, label: str) -> int | None:
    """A count label of /metrics, None when absent or "None" (a release that leaves it unset); Unreadable else."""
    value = info.get(label)
    return None if value in (None, "", "None") else _count(value, f"/metrics' {label}")


def engine_kv(log_text: str, metrics: str | None) -> dict:
    """What the engine reports: the log's numbers, with the block size, the blocks and the KV budget from
    /metrics."""
    info = cache_info(metrics)
    found = from_log(log_text)
    found["block_size"] = _label_count(info, "block_size")
    found["blocks"] = _label_count(info, "num_gpu_blocks")  # the engine's real blocks: what a request is given
    found["budget_bytes"] = _label_count(info, "kv_cache_memory_bytes")
    if found["tokens"] is None:  # a release that logs differently: the metrics' count, if it has one
        found["tokens"] = _label_count(info, "kv_cache_size_tokens")
    if found["block_size"] == 0:
        raise Unreadable("/metrics' block_size '0' is not a block size")
    return found


def formula_kv(bytes_per_token: int, budget_bytes: int, context: int, block_size: int | None) -> dict:
    """The KV tokens and the concurrency at `context` that `budget_bytes` holds by our formula, rounded down to
    whole blocks as the engine allocates them when the block size is known."""
    tokens = budget_bytes // bytes_per_token
    if block_size:
        tokens = tokens // block_size * block_size
    return {"bytes_per_token": bytes_per_token, "tokens": tokens, "max_concurrency": tokens / context}
