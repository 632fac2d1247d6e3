"""The file `mha2gqa serve-bench` writes (serving/result.py builds it) and `mha2gqa report` shows beside eval
results: its layout, and the reader. It lives beside its writer; the report, above serving, imports it.

Top-level keys:
  schema      "mha2gqa.serve/1"
  engine      name ("vllm"), version, distribution, python
  settings    dtype, context, kv_budget_bytes, eager, greedy_tokens, greedy_prompt_tokens, prompt_tokens,
              output_tokens, concurrency, waves, repeats, decode_concurrency, capacity_concurrency (the one
              run, None when left out), capacity_concurrency_why, settle_timeout
  models      [{label, role, path, layers, heads, kv_heads, head_dim, startup_s, log,
                kv: {engine: {device, tokens, context, max_concurrency, block_size, budget_bytes},
                     formula: {bytes_per_token, tokens, max_concurrency}, match},
                greedy: {equal, prompts: [{domain, prompt, engine, reference, equal, first_difference,
                         follows_parent}], follows_parent_mean},
                throughput: [point], fits_requests, decode: point or None, capacity: point or None}]
              the parent first; follows_parent: how many leading greedy tokens equal the parent's (engine's text);
              a point: {concurrency, requests, output_tokens_per_s, total_tokens_per_s, tpot_ms (decode alone:
              (last - first token) / (tokens - 1), median over requests), steady_tpot_ms (the same
              after the load's last first token: no prefill in flight), itl_ms (median gap between streamed
              tokens), ttft_ms, running_max, running_mean, waiting_max (the engine's /metrics gauges while the
              load ran), runs: [...]}; fits_requests: requests of prompt + output tokens its KV cache holds
  comparison  [{label, kv_tokens_ratio, formula_ratio, max_concurrency_ratio, throughput_ratio: {c: ratio},
              decode_tpot_speedup (the parent's decode TPOT over the child's), decode_steady_tpot_speedup (the same
              of the steady TPOTs), capacity_throughput_ratio}],
              each child over the parent
  settle      {settled, waited_s, cores: [each second's CPU use of all servers], quiet_cores, windows} or None
  load        before, after: the 1/5/15-minute load averages around the run; cpu_count
  warnings    [str]
  created     UTC, ISO 8601
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mha2gqa.files.reading import MAX_JSON_BYTES, read_json
from mha2gqa.runtime.errors import InputError

SCHEMA = "mha2gqa.serve/1"


def is_serve_file(path: str | os.PathLike) -> bool:
    """Whether `path` holds a serve-bench result (its schema says so); False for anything else, which the
    eval-result reader then judges and refuses in its own words."""
    if not Path(path).is_file():  # a FIFO or a device would block the read: the result reader refuses it
        return False
    try:
        with open(path, "rb") as f:
            found = json.loads(f.read(MAX_JSON_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(found, dict) and found.get("schema") == SCHEMA


def load(path: str | os.PathLike) -> dict:
    """A serve-bench result, checked enough to be drawn: InputError naming the file otherwise."""
    found = read_json(Path(path), "pass a file written by `mha2gqa serve-bench`")
    models = found.get("models") if isinstance(found, dict) else None
    if not isinstance(found, dict) or found.get("schema") != SCHEMA or not isinstance(models, list) or not models:
        raise InputError(
            f"{path} is not a serve-bench result ({SCHEMA} with models): pass a file written by "
            "`mha2gqa serve-bench`, unedited"
        )
    for m in models:
        if not isinstance(m, dict) or not all(k in m for k in ("label", "kv_heads", "kv", "greedy", "throughput")):
            raise InputError(
                f"{path}: a model entry lacks label, kv_heads, kv, greedy or throughput: re-run `mha2gqa serve-bench`"
            )
    return found
