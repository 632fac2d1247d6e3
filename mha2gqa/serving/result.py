"""The file `mha2gqa serve-bench` writes and `mha2gqa report` shows beside eval results.

Top-level keys:
  schema      "mha2gqa.serve/1"
  engine      name ("vllm"), version, distribution, python
  settings    dtype, context, kv_budget_bytes, eager, greedy_tokens, greedy_prompt_tokens, prompt_tokens,
              output_tokens, concurrency, waves, repeats
  models      [{label, role, path, layers, heads, kv_heads, head_dim, startup_s, log,
                kv: {engine: {device, tokens, context, max_concurrency, block_size, budget_bytes},
                     formula: {bytes_per_token, tokens, max_concurrency}, match},
                greedy: {equal, prompts: [{domain, prompt, engine, reference, equal, first_difference,
                         follows_parent}], follows_parent_mean},
                throughput: [{concurrency, requests, output_tokens_per_s, tpot_ms, ttft_ms, runs: [...]}]}]
              the parent first; follows_parent: how many leading greedy tokens equal the parent's (engine's text)
  comparison  [{label, kv_tokens_ratio, formula_ratio, max_concurrency_ratio, throughput_ratio: {c: ratio}}],
              each child over the parent
  load        before, after: the 1/5/15-minute load averages around the run; cpu_count
  warnings    [str]
  created     UTC, ISO 8601
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from mha2gqa import jsontext
from mha2gqa.errors import InputError
from mha2gqa.reading import MAX_JSON_BYTES, read_json
from mha2gqa.serving.options import GREEDY_PROMPT_TOKENS
from mha2gqa.version import __version__
from mha2gqa.writing import write_atomic

SCHEMA = "mha2gqa.serve/1"


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy texts share before they part."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _greedy(greedy_set, engine_ids, reference_ids, parent_ids) -> dict:
    rows = []
    for (domain, prompt), got, want, parents in zip(greedy_set, engine_ids, reference_ids, parent_ids):
        same = leading_equal(got, want)
        rows.append(
            {
                "domain": domain,
                "prompt": prompt,
                "engine": got,
                "reference": want,
                "equal": got == want,
                "first_difference": None if got == want else same,
                "follows_parent": leading_equal(got, parents),
            }
        )
    follows = [r["follows_parent"] for r in rows]
    return {"equal": sum(r["equal"] for r in rows), "prompts": rows, "follows_parent_mean": sum(follows) / len(follows)}


def _model(m, kv, greedy, points, startup_s) -> dict:
    s = m.shape
    return {
        "label": m.label,
        "role": m.role,
        "path": str(m.path),
        "layers": s.layers,
        "heads": s.heads,
        "kv_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "startup_s": startup_s,
        "log": str(m.server.log),
        "kv": kv,
        "greedy": greedy,
        "throughput": points,
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def comparison(models: list[dict]) -> list[dict]:
    """Each child over the parent: engine KV tokens, the formula's, max concurrency, tokens/s per concurrency."""
    parent = models[0]
    speeds = {p["concurrency"]: p["output_tokens_per_s"] for p in parent["throughput"]}
    rows = []
    for child in models[1:]:
        pk, ck = parent["kv"], child["kv"]
        rows.append(
            {
                "label": child["label"],
                "kv_tokens_ratio": _ratio(ck["engine"]["tokens"], pk["engine"]["tokens"]),
                "formula_ratio": _ratio(pk["formula"]["bytes_per_token"], ck["formula"]["bytes_per_token"]),
                "max_concurrency_ratio": _ratio(ck["engine"]["max_concurrency"], pk["engine"]["max_concurrency"]),
                "throughput_ratio": {
                    str(p["concurrency"]): _ratio(p["output_tokens_per_s"], speeds.get(p["concurrency"]))
                    for p in child["throughput"]
                },
            }
        )
    return rows


def warnings_of(models: list[dict]) -> list[str]:
    """What a reader must not miss: greedy text that differs from transformers', KV numbers off the formula."""
    found = []
    for m in models:
        g, kv = m["greedy"], m["kv"]
        if g["equal"] < len(g["prompts"]):
            found.append(
                f"{m['label']}: the engine's greedy text differs from transformers' on "
                f"{len(g['prompts']) - g['equal']} of {len(g['prompts'])} prompts"
            )
        if kv["engine"]["tokens"] is None:
            found.append(f"{m['label']}: the server reported no KV-cache size (its log: {m['log']})")
        elif not kv["match"]:
            found.append(
                f"{m['label']}: the engine holds {kv['engine']['tokens']:,} KV tokens, the formula "
                f"{kv['formula']['tokens']:,}"
            )
    return found


def build(plan, options, greedy_set, references, texts, kv, points, startup, load_before) -> dict:
    """The result dict of one run (see the module docstring)."""
    parent = plan.models[0].label
    models = [
        _model(
            m,
            kv[m.label],
            _greedy(greedy_set, texts[m.label], references[m.label], texts[parent]),
            points[m.label],
            startup[m.label],
        )
        for m in plan.models
    ]
    settings = {
        "dtype": plan.args.dtype,
        "context": plan.args.context,
        "kv_budget_bytes": plan.args.kv_budget_bytes,
        "eager": plan.args.eager,
        "greedy_tokens": options.greedy_tokens,
        "greedy_prompt_tokens": GREEDY_PROMPT_TOKENS,
        "prompts_per_domain": options.prompts_per_domain,
        "prompt_tokens": options.prompt_tokens,
        "output_tokens": options.output_tokens,
        "concurrency": list(options.concurrency or []),
        "waves": options.waves,
        "repeats": options.repeats,
    }
    e = plan.engine
    return {
        "schema": SCHEMA,
        "engine": {"name": "vllm", "version": e.version, "distribution": e.distribution, "python": e.python},
        "settings": settings,
        "models": models,
        "comparison": comparison(models),
        "load": {"before": list(load_before), "after": list(os.getloadavg()), "cpu_count": os.cpu_count()},
        "warnings": warnings_of(models),
        "machine": platform.machine(),
        "mha2gqa": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write(found: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, jsontext.dumps(found, indent=2) + "\n")


def is_serve_file(path: str | os.PathLike) -> bool:
    """Whether `path` holds a serve-bench result (its schema says so); False for anything else, which the
    eval-result reader then judges and refuses in its own words."""
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
