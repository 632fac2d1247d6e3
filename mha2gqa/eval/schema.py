"""The result file `mha2gqa eval` writes and `mha2gqa report` reads.

Top-level keys (sections that were not measured are null):
  schema          "mha2gqa.eval/1"
  label, role     short name; parent | converted | uptrained
  model           path, model_type, layers, heads, kv_heads, head_dim, hidden, params, dtype, provenance
  reference       path, label (when --reference was given)
  data            source, path or name, documents, tokens, text_sha256, ids_sha256, tokenizer
  perplexity      perplexity, nll_per_token, tokens_scored, context, stride, windows
  agreement       kl_mean, top1_agreement, tokens, reference_perplexity
  kv_cache        formula_bytes_per_token, measured_bytes_per_token, match, cached_heads, ...
  speed           grid, points: [{batch, context, new_tokens, tokens_per_s, peak_memory_bytes, ...}]
  attention_maps  png, layer
  lm_eval         harness ("lm-eval 0.4.x"), limit, bootstrap_iters, tasks: {task: {samples,
                  metrics: {metric: {value, stderr, higher_is_better}}}} (see eval/lmeval.py)
  warnings        [str]: anything a reader must not miss (e.g. a KV-cache mismatch)
  env             device, device_name, versions, seed, created
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from mha2gqa.errors import InputError

SCHEMA = "mha2gqa.eval/1"
REQUIRED = ("label", "role", "model", "kv_cache", "env")
MODEL_REQUIRED = ("kv_heads", "heads", "layers", "head_dim")


def write_result(result: dict, out: Path) -> Path:
    """Write atomically: a reader never sees half a file, and a failed run leaves none."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, out)
    return out


def load_result(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such result file (write one with `mha2gqa eval MODEL --out {path}`)")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{path} is not JSON ({err.msg} at line {err.lineno}): pass a file written by `mha2gqa eval`") from err
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        found = result.get("schema") if isinstance(result, dict) else type(result).__name__
        raise InputError(f"{path} has schema {found!r}, expected {SCHEMA!r}: pass a file written by `mha2gqa eval`")
    model = result.get("model") if isinstance(result.get("model"), dict) else {}
    missing = [k for k in REQUIRED if k not in result] + [f"model.{k}" for k in MODEL_REQUIRED if k not in model]
    if missing:
        raise InputError(f"{path} lacks {', '.join(missing)}: re-run `mha2gqa eval` to write a complete result")
    return result
