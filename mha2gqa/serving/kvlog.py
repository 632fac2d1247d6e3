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

_SIZE = re.compile(r"\b(?P<device>[A-Z]+) KV cache size: (?P<tokens>[\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for (?P<context>[\d,]+) tokens per request: (?P<times>[\d.]+)x")
_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def from_log(text: str) -> dict:
    """{device, tokens, context, max_concurrency} from the server's log, each None when the log lacks it
    (the last report wins: a restarted engine reports again)."""
    sizes, concurrencies = list(_SIZE.finditer(text)), list(_CONCURRENCY.finditer(text))
    size, concurrency = (sizes or [None])[-1], (concurrencies or [None])[-1]
    return {
        "device": size["device"] if size else None,
        "tokens": _number(size["tokens"]) if size else None,
        "context": _number(concurrency["context"]) if concurrency else None,
        "max_concurrency": float(concurrency["times"]) if concurrency else None,
    }


def cache_info(metrics: str | None) -> dict:
    """The labels of `vllm:cache_config_info` in a /metrics page ({} when absent): block_size, num_gpu_blocks
    (the KV blocks, whatever the device), kv_cache_memory_bytes, kv_cache_size_tokens, ..."""
    found = _INFO.search(metrics or "")
    return dict(_LABEL.findall(found["labels"])) if found else {}


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


def engine_kv(log_text: str, metrics: str | None) -> dict:
    """What the engine reports: the log's numbers, with the block size and KV budget from /metrics."""
    info = cache_info(metrics)
    found = from_log(log_text)
    found["block_size"] = _int_or_none(info.get("block_size"))
    found["budget_bytes"] = _int_or_none(info.get("kv_cache_memory_bytes"))
    if found["tokens"] is None:  # a release that logs differently: the metrics' count, if it has one
        found["tokens"] = _int_or_none(info.get("kv_cache_size_tokens"))
    return found


def formula_kv(bytes_per_token: int, budget_bytes: int, context: int, block_size: int | None) -> dict:
    """The KV tokens and the concurrency at `context` that `budget_bytes` holds by our formula, rounded down to
    whole blocks as the engine allocates them when the block size is known."""
    tokens = budget_bytes // bytes_per_token
    if block_size:
        tokens = tokens // block_size * block_size
    return {"bytes_per_token": bytes_per_token, "tokens": tokens, "max_concurrency": tokens / context}
