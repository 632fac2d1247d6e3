"""The result file `mha2gqa eval` writes and `mha2gqa report` reads.

Top-level keys (sections that were not measured are null):
  schema          "mha2gqa.eval/1"
  label, role     short name; parent | converted | uptrained
  model           path, model_type, layers, heads, kv_heads, head_dim, hidden, params, dtype, provenance
  reference       path, resolved, label (when --reference was given); since 2026-12 also its kv_heads, heads,
                  layers, head_dim, params, dtype and kv_formula_bytes_per_token (a one-result report
                  compares with it: eval/reference_result.py)
  data            source, path or name, documents, tokens, text_sha256, ids_sha256, tokenizer
  perplexity      perplexity, nll_per_token, tokens_scored, context, stride, windows
  agreement       kl_mean, top1_agreement, tokens, reference_perplexity
  domains         {name: {data, perplexity, agreement}}: each text of --data measured apart (added in
                  2026-12 without a schema bump: older results lack it and read as one unnamed domain).
                  With one text, data/perplexity/agreement above are that text's; with several, they
                  pool all texts token-weighted (pooled_over names them) and data.source is "domains"
  quality         geomean_perplexity_ratio (over the domains, of perplexity / the reference's),
                  perplexity_ratios {name: ratio}, worst_domain, worst_ratio, domains; null without
                  --reference (eval/domains.py)
  retrieval       (eval --retrieval; added 2026-12 without a schema bump) recall, answer_logprob, items,
                  and beside --reference reference_recall, reference_answer_logprob, answer_probability_kept;
                  the same numbers per task (tasks: {needle, kv}), per length (lengths: [{length, ...}]) and per
                  cell (cells: [{task, length, depth, ...}]); grid {lengths, depths, samples}, seed, haystack
                  (scoring/retrieval.py)
  kv_cache        formula_bytes_per_token, measured_bytes_per_token, match, cached_heads, ...
  speed           grid, points: [{batch, context, new_tokens, tokens_per_s, peak_memory_bytes, ...}];
                  since 2026-12 decode_path: {name, cache, attention, copied_per_step, steps} (eval/decode_path.py)
  attention_maps  png, layer
  lm_eval         harness ("lm-eval 0.4.x"), limit, bootstrap_iters, tasks: {task: {samples,
                  metrics: {metric: {value, stderr, higher_is_better}}}} (see eval/lmeval.py)
  warnings        [str]: anything a reader must not miss (e.g. a KV-cache mismatch)
  env             device, device_name, versions, seed, created
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mha2gqa.files import jsontext
from mha2gqa.files.reading import did_you_mean, read_json
from mha2gqa.files.writing import write_atomic
from mha2gqa.runtime.errors import InputError, user_file_error

SCHEMA = "mha2gqa.eval/1"
REQUIRED = ("label", "role", "model", "kv_cache", "env")
MODEL_REQUIRED = ("kv_heads", "heads", "layers", "head_dim")


# Reading a result: one accessor per value a comparison needs, None where the section was not measured.
def _value(result: dict, section: str, key: str):
    part = result.get(section)
    return part.get(key) if isinstance(part, dict) else None


def field(result: dict, dotted: str):
    """The value at a dotted path ("perplexity.perplexity"), None where a section or key is absent."""
    node = result
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def perplexity(result: dict) -> float | None:
    return _value(result, "perplexity", "perplexity")


def perplexity_window(result: dict) -> tuple[int | None, int | None]:
    """(context, stride) of the perplexity windows."""
    return _value(result, "perplexity", "context"), _value(result, "perplexity", "stride")


def data_digest(result: dict) -> str | None:
    """sha256 of the token ids scored: equal digests mean the same token stream."""
    return _value(result, "data", "ids_sha256")


def kl_mean(result: dict) -> float | None:
    return _value(result, "agreement", "kl_mean")


def top1_agreement(result: dict) -> float | None:
    return _value(result, "agreement", "top1_agreement")


def kv_bytes_per_token(result: dict) -> int | None:
    """The live KV cache's bytes per token, as measured (not the formula)."""
    return _value(result, "kv_cache", "measured_bytes_per_token")


def kv_match(result: dict) -> bool | None:
    """Whether the measured KV cache matches the formula."""
    return _value(result, "kv_cache", "match")


def speed_points(result: dict) -> list[dict]:
    """The decode-speed grid points measured, [] without speed."""
    return _value(result, "speed", "points") or []


def device_name(result: dict) -> str | None:
    return _value(result, "env", "device_name")


def lm_eval_tasks(result: dict) -> dict:
    """{task: {samples, metrics: {metric: {value, stderr, higher_is_better}}}}, {} without lm-eval."""
    return _value(result, "lm_eval", "tasks") or {}


def lm_eval_metric(result: dict, task: str, metric: str) -> dict | None:
    """{value, stderr, higher_is_better} of one task metric, or None when absent or without a value."""
    found = ((lm_eval_tasks(result).get(task) or {}).get("metrics") or {}).get(metric)
    return found if found and found.get("value") is not None else None


def write_result(result: dict, out: Path) -> Path:
    """Write atomically: a reader never sees half a file, and a failed run leaves none (a full or
    read-only disk is one line naming the file)."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise user_file_error(err, out) from err
    return write_atomic(out, jsontext.dumps(result, indent=2, sort_keys=False) + "\n")


def validate_writable(out: Path, flag: str = "--out") -> None:
    """Before any measuring: a file can be written where `out` goes. A probe file in the nearest
    existing folder catches a read-only or full filesystem and permissions (root ignores mode bits,
    not a read-only mount or a full disk); it is removed at once."""
    out = Path(out)
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{flag} {out}: {folder} is a file, not a folder: choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{out.name}.", suffix=".probe")
        try:
            os.write(fd, b"{}\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise InputError(
            f"{flag} {out}: cannot write in {folder} ({os.strerror(err.errno)}): "
            "choose a writable location with free space"
        ) from err


def load_result(path: str | os.PathLike) -> dict:
    return validated(read_result_file(Path(path)), path)


def read_result_file(path: Path):
    """A result file's JSON, unchecked; refused in one line when it is missing or not JSON."""
    if not os.path.lexists(path):
        raise InputError(
            f"{path}: no such result file{did_you_mean(path)} (write one with `mha2gqa eval MODEL --out {path}`)"
        )
    return read_json(path, "pass a file written by `mha2gqa eval`")


def validated(result, path) -> dict:
    """`result` if it is a complete eval result of this schema, else refused in words naming `path`."""
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        found = result.get("schema") if isinstance(result, dict) else type(result).__name__
        raise InputError(f"{path} has schema {found!r}, expected {SCHEMA!r}: pass a file written by `mha2gqa eval`")
    model = result.get("model") if isinstance(result.get("model"), dict) else {}
    missing = [k for k in REQUIRED if k not in result] + [f"model.{k}" for k in MODEL_REQUIRED if k not in model]
    if missing:
        raise InputError(f"{path} lacks {', '.join(missing)}: re-run `mha2gqa eval` to write a complete result")
    wrong = type_problems(result)
    if wrong:
        raise InputError(
            f"{path} has values of the wrong type ({'; '.join(wrong[:4])}): "
            "pass a file written by `mha2gqa eval`, unedited"
        )
    return result


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _maybe(check):
    return lambda v: v is None or check(v)


def _rows(**fields):
    """A list of dicts, each holding every named field and each field passing its check."""
    return lambda v: (
        isinstance(v, list)
        and all(isinstance(row, dict) and all(ok(row.get(k)) for k, ok in fields.items()) for row in v)
    )


def _section(fields: dict):
    """A dict whose listed keys, where present, pass their checks (None for a section: absent is fine)."""
    return lambda v: isinstance(v, dict) and all(k not in v or ok(v[k]) for k, (ok, _) in fields.items())


# What `report` reads from a result, key -> (check, what it must be). Keys absent from a section are
# fine (older results); a present one of the wrong type would otherwise end in a traceback.
_TYPES = {
    "label": (lambda v: isinstance(v, str), "text"),
    "role": (lambda v: v in ("parent", "converted", "uptrained"), "parent, converted or uptrained"),
    "model.heads": (_count, "a whole number"),
    "model.kv_heads": (_count, "a whole number"),
    "model.layers": (_count, "a whole number"),
    "model.head_dim": (_count, "a whole number"),
    "model.params": (_maybe(_count), "a whole number"),
    "perplexity": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "perplexity.perplexity": (_maybe(_number), "a number"),
    "perplexity.context": (_maybe(_count), "a whole number"),
    "perplexity.stride": (_maybe(_count), "a whole number"),
    "agreement": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "agreement.kl_mean": (_maybe(_number), "a number"),
    "agreement.top1_agreement": (_maybe(_number), "a number"),
    "domains": (
        _maybe(
            lambda v: (
                isinstance(v, dict)
                and all(
                    isinstance(d, dict)
                    and isinstance(d.get("data"), dict)
                    and isinstance(d.get("perplexity"), dict)
                    and _number(d["perplexity"].get("perplexity"))
                    and _maybe(lambda a: isinstance(a, dict) and _number(a.get("kl_mean")))(d.get("agreement"))
                    for d in v.values()
                )
            )
        ),
        "{name: {data: {...}, perplexity: {perplexity: number}, agreement: null or {kl_mean: number}}}",
    ),
    "quality": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "retrieval": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "retrieval.recall": (_maybe(_number), "a number"),
    "retrieval.answer_probability_kept": (_maybe(_number), "a number"),
    "retrieval.lengths": (_rows(length=_count, recall=_number), "[{length: whole number, recall: number}, ...]"),
    "retrieval.cells": (
        _rows(length=_count, depth=_number, recall=_number, items=_count),
        "[{length, depth, recall, items}, ...] with numbers",
    ),
    "kv_cache": (lambda v: isinstance(v, dict), "an object"),
    "kv_cache.measured_bytes_per_token": (_maybe(_number), "a number"),
    "speed": (
        _maybe(_section({"points": (_rows(batch=_count, context=_count, tokens_per_s=_number), "")})),
        "null or {points: [{batch, context, tokens_per_s}, ...]}",
    ),
    "data": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "data.ids_sha256": (_maybe(lambda v: isinstance(v, str)), "text"),
    "data.tokens": (_maybe(_count), "a whole number"),
    "lm_eval": (_maybe(lambda v: isinstance(v, dict)), "an object or null"),
    "lm_eval.tasks": (
        _maybe(
            lambda v: (
                isinstance(v, dict)
                and all(
                    isinstance(t, dict)
                    and isinstance(t.get("metrics"), dict)
                    and all(
                        isinstance(m, dict) and _maybe(_number)(m.get("value")) and _maybe(_number)(m.get("stderr"))
                        for m in t["metrics"].values()
                    )
                    for t in v.values()
                )
            )
        ),
        "{task: {metrics: {name: {value, stderr}}}} with numbers",
    ),
    "warnings": (_maybe(lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v)), "a list of text"),
    "env": (lambda v: isinstance(v, dict), "an object"),
    "env.device_name": (_maybe(lambda v: isinstance(v, str)), "text"),
}


def type_problems(result: dict) -> list[str]:
    """'key is X, must be Y' for every value `report` would trip over."""
    problems = []
    for dotted, (ok, what) in _TYPES.items():
        node, keys = result, dotted.split(".")
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        value = node[keys[-1]]
        if not ok(value):
            problems.append(f"{dotted} is {jsontext.shown(value)[:40]}, must be {what}")
    return problems
