"""What `mha2gqa serve-bench` writes: the result file serving/schema.py describes (and `mha2gqa report` reads)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from mha2gqa.files import jsontext
from mha2gqa.files.writing import write_atomic
from mha2gqa.serving.options import GREEDY_PROMPT_TOKENS
from mha2gqa.serving.schema import SCHEMA
from mha2gqa.version import __version__


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


def _model(m, kv, greedy, points, startup_s, timed) -> dict:
    s = m.shape
    decode, bound = timed["decode"], timed["capacity"]
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
        "fits_requests": timed["fits"][m.label],
        "decode": decode[m.label] if decode else None,
        "capacity": bound["points"][m.label] if bound["points"] else None,
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def _get(model: dict, point: str, key: str):
    found = model.get(point)
    return found.get(key) if found else None


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
                # > 1: the child's decode step is that much faster (the parent's time per token over the child's)
                "decode_tpot_speedup": _ratio(_get(parent, "decode", "tpot_ms"), _get(child, "decode", "tpot_ms")),
                # the same once every request has its first token: no prefill chunk between the steps
                "decode_steady_tpot_speedup": _ratio(
                    _get(parent, "decode", "steady_tpot_ms"), _get(child, "decode", "steady_tpot_ms")
                ),
                "capacity_throughput_ratio": _ratio(
                    _get(child, "capacity", "output_tokens_per_s"), _get(parent, "capacity", "output_tokens_per_s")
                ),
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


def timing_warnings(models: list[dict], timed: dict) -> list[str]:
    """Timed points that do not measure what they are named for: servers still busy, a decode point some model
    does not fit (it queues), a capacity point the parent fits (nothing queues)."""
    found = []
    quiet = timed.get("settle")
    if quiet and not quiet["settled"]:
        found.append(
            f"the servers were not quiet when timing began (cores in use, last windows: {quiet['cores'][-3:]}): "
            "their times include another server's work"
        )
    for m in models:
        held, decode, bound = m.get("fits_requests"), m.get("decode"), m.get("capacity")
        if decode and held is not None and decode["concurrency"] > held:
            found.append(
                f"{m['label']}: the decode point runs {decode['concurrency']} requests, its KV cache fits {held}: "
                "its time per token includes queueing; lower --decode-concurrency"
            )
        elif decode and any(r.get("preemptions") for r in decode.get("runs", [])):  # the engine's own count
            found.append(
                f"{m['label']}: the engine preempted requests during the decode point: its time per token includes "
                "recomputed prefills; lower --decode-concurrency or raise --kv-cache-memory"
            )
        if m["role"] == "parent" and bound and held is not None and bound["concurrency"] <= held:
            found.append(
                f"the capacity point runs {bound['concurrency']} requests and the parent fits {held}: nothing queues; "
                "lower --kv-cache-memory or raise --capacity-concurrency"
            )
    return found


def build(plan, options, greedy_set, references, texts, kv, points, startup, load_before, timed) -> dict:
    """The result dict of one run (see the module docstring)."""
    parent = plan.models[0].label
    models = [
        _model(
            m,
            kv[m.label],
            _greedy(greedy_set, texts[m.label], references[m.label], texts[parent]),
            points[m.label],
            startup[m.label],
            timed,
        )
        for m in plan.models
    ]
    settings = {
        "dtype": plan.args.dtype,
        "context": plan.args.context,
        "kv_budget_bytes": plan.args.kv_cache_bytes,  # the key older results hold (serving/schema.py)
        "eager": plan.args.eager,
        "greedy_tokens": options.greedy_tokens,
        "greedy_prompt_tokens": GREEDY_PROMPT_TOKENS,
        "prompts_per_domain": options.prompts_per_domain,
        "prompt_tokens": options.prompt_tokens,
        "output_tokens": options.output_tokens,
        "concurrency": list(options.concurrency or []),
        "waves": options.waves,
        "repeats": options.repeats,
        "decode_concurrency": options.decode_concurrency,
        "capacity_concurrency": timed["capacity"]["concurrency"],
        "capacity_concurrency_why": timed["capacity"]["why"],
        "settle_timeout": options.settle_timeout,
    }
    e = plan.engine
    return {
        "schema": SCHEMA,
        "engine": {"name": "vllm", "version": e.version, "distribution": e.distribution, "python": e.python},
        "settings": settings,
        "models": models,
        "comparison": comparison(models),
        "load": {"before": list(load_before), "after": list(os.getloadavg()), "cpu_count": os.cpu_count()},
        "settle": timed["settle"],
        "warnings": warnings_of(models) + timing_warnings(models, timed),
        "machine": platform.machine(),
        "mha2gqa": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write(found: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, jsontext.dumps(found, indent=2) + "\n")
