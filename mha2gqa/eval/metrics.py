"""The report's metrics as data: one entry per number the comparison shows, saying how it is
computed, where it sits in a result file, its report column and which direction is better.

A metric `mha2gqa eval` measures reads its value from the result at `field`; a derived one is
computed from the table (`derive`: the baseline, the lineage pairs, the speed point, the columns
before it). report/compare.py fills report.json's rows from this list (the demo's summary reads them by these
names), report/render.py draws the columns, report.json carries the list as its legend, and the sweep measures its
candidates by it and takes its columns from it too (sweep/candidates.py, report/sweep_pages.py). A new metric is one
entry here plus the measurement that writes its field (eval/measurements.py); docs/eval.md shows a worked
example.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mha2gqa.eval import domains, schema
from mha2gqa.eval.lineage import Start
from mha2gqa.runtime.units import format_bytes

DASH = "—"


@dataclass(frozen=True)
class Table:
    """What derived metrics are computed from."""

    results: list[dict]
    base: int
    speed_point: tuple[int, int] | None
    starts: list[Start | None]  # lineage.recovery_starts
    speedup_apart: bool = False  # report --speedup-apart: a speed-up from models timed apart too (warned)


@dataclass(frozen=True)
class Metric:
    name: str
    """Key of the value in report.json's rows."""
    column: str | None
    """Header of its report column ({at} becomes the speed point); None: in report.json only."""
    computed: str
    """How the number is computed, in words."""
    field: str | None = None
    """Dotted path of the value in a result file (schema.field); None for a derived metric."""
    direction: str | None = None
    """"lower" or "higher" is better; None when neither is."""
    fmt: Callable[[Any], str] = str
    """A present value as text (a missing one is a dash)."""
    derive: Callable[[Table, list[dict], int], Any] | None = None
    """(table, rows so far, row index) -> value, for a metric not stored in a result."""
    cell: Callable[[dict], str] | None = None
    """The whole cell from the row, when it shows more than the value (a spread, a warning)."""
    applies: Callable[[dict], bool] | None = None
    """The rows it is meant for, when not all: its column stays while one of them is in the table,
    even with no value (the notes say why), instead of being left out as unmeasured."""
    group: str = "main"
    """The report table it is a column of: "main", "domains" (per domain of --data), "retrieval" (per length of
    eval --retrieval) or "lm_eval" (one column per task metric)."""

    def value(self, table: Table, rows: list[dict], i: int):
        if self.derive is not None:
            return self.derive(table, rows, i)
        return schema.field(table.results[i], self.field)

    def text(self, row: dict) -> str:
        if self.cell is not None:
            return self.cell(row)
        value = row.get(self.name)
        return DASH if value is None else self.fmt(value)

    def legend(self) -> dict:
        keys = ("name", "column", "computed", "field", "direction", "group")
        return {key: getattr(self, key) for key in keys}


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt_ppl(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def share(x: float) -> str:
    """A share as a percentage, with two significant digits below 10% (a lost answer keeps 0.18%, not 0%)."""
    return f"{100 * x:.0f}%" if x >= 0.1 else f"{100 * x:.2g}%"


def fmt_tps(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_bytes(n: float) -> str:
    return format_bytes(n, digits=1, largest="MiB")


# ---- decode speed: the median and its spread over the timed repeats ----


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); a single value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def speed_at(result: dict, point: tuple[int, int] | None) -> dict | None:
    return next((p for p in schema.speed_points(result) if point and (p["batch"], p["context"]) == point), None)


def repeat_seconds(p: dict) -> list[float]:
    """The decode seconds of a point's timed repeats (every result since the first keeps them)."""
    return [s for s in p.get("decode_s") or [] if isinstance(s, (int, float)) and s > 0]


def tokens_per_s_iqr(p: dict) -> tuple[float, float] | None:
    """The interquartile range of a point's tokens/s over its timed repeats: stored by eval since the
    spread was recorded, computed from the repeats' decode seconds for older results."""
    if p.get("tokens_per_s_iqr"):
        low, high = p["tokens_per_s_iqr"]
        return low, high
    seconds = repeat_seconds(p)
    if not seconds:
        return None
    fast, _, slow = quartiles(seconds)
    tokens = p["batch"] * p["new_tokens"]
    return tokens / slow, tokens / fast


def _tokens_per_s(t: Table, rows, i):
    p = speed_at(t.results[i], t.speed_point)
    return None if p is None else p["tokens_per_s"]


def _tokens_per_s_iqr(t: Table, rows, i):
    p = speed_at(t.results[i], t.speed_point)
    return None if p is None else tokens_per_s_iqr(p)


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median: the order statistics n/2 -+ 0.98
    sqrt(n) (sign test). Few repeats give the whole min-max range (3 repeats: 75% coverage, the most
    three can say); many narrow it below the interquartile range."""
    ordered = sorted(values)
    k = max(0, math.floor((len(ordered) - 1.96 * math.sqrt(len(ordered))) / 2))
    return ordered[k], ordered[len(ordered) - 1 - k]


def _interval(p: dict | None) -> list[float] | None:
    seconds = repeat_seconds(p or {})
    if not seconds:
        return None
    fast, slow = median_interval(seconds)
    tokens = p["batch"] * p["new_tokens"]
    return [tokens / slow, tokens / fast]


def _tokens_per_s_interval(t: Table, rows, i):
    return _interval(speed_at(t.results[i], t.speed_point))


def _point_in(points: list, point: tuple[int, int] | None) -> dict | None:
    return next((p for p in points or [] if point and (p.get("batch"), p.get("context")) == point), None)


def speed_pair(t: Table, i: int) -> tuple[dict, dict, str] | None:
    """(the row's speed point, the baseline's, how they were timed) when a speed-up may be computed: the two
    timed side by side (the row's eval timed the baseline's model beside it, `eval --speed-side-by-side`,
    or both points come from one such run), else only with report --speedup-apart ("apart")."""
    mine = speed_at(t.results[i], t.speed_point)
    if mine is None or i == t.base:
        return None
    base = t.results[t.base]
    together = (t.results[i].get("speed") or {}).get("side_by_side") or {}
    if together.get("reference_resolved") and together["reference_resolved"] == base["model"].get("resolved"):
        theirs = _point_in(together.get("points"), t.speed_point)
        if theirs is not None:
            return mine, theirs, "side by side"
    theirs = speed_at(base, t.speed_point)
    base_together = (base.get("speed") or {}).get("side_by_side") or {}
    if theirs is not None and together.get("id") and together.get("id") == base_together.get("id"):
        return mine, theirs, "side by side"
    if theirs is not None and t.speedup_apart:
        return mine, theirs, "apart"
    return None


def _speedup(t: Table, rows, i):
    if i == t.base:  # 1x beside the speed-ups it anchors, none when there is none
        return 1.0 if any(speed_pair(t, j) for j in range(len(t.results))) else None
    pair = speed_pair(t, i)
    return None if pair is None else ratio(pair[0]["tokens_per_s"], pair[1]["tokens_per_s"])


def _speedup_measured(t: Table, rows, i):
    pair = speed_pair(t, i)
    return None if pair is None else pair[2]


def _speedup_range(t: Table, rows, i):
    """(low, high) of the speed-up with either median anywhere in its confidence interval."""
    pair = speed_pair(t, i)
    if pair is None:
        return None
    mine, base = _interval(pair[0]), _interval(pair[1])
    if not mine or not base or not base[0]:
        return None
    return [mine[0] / base[1], mine[1] / base[0]]


def speedup_at(t: Table, i: int, point: tuple[int, int]) -> dict | None:
    """Row i's speed-up over the baseline at one (batch, context) point, as the table computes it at its
    speed point: {speedup, low, high, noisy, measured}; None where the table would give none (timed apart
    without --speedup-apart, not measured there, or the baseline itself). The speed plot draws these."""
    at = dataclasses.replace(t, speed_point=point)
    pair = speed_pair(at, i)
    if pair is None:
        return None
    mine, base = _interval(pair[0]), _interval(pair[1])
    low, high = (mine[0] / base[1], mine[1] / base[0]) if mine and base and base[0] else (None, None)
    return {
        "speedup": ratio(pair[0]["tokens_per_s"], pair[1]["tokens_per_s"]),
        "low": low,
        "high": high,
        "noisy": low is not None and low <= 1.0 <= high,
        "measured": pair[2],
    }


def _speedup_noisy(t: Table, rows, i):
    """A speed-up whose range holds 1 is smaller than its uncertainty: none is claimed."""
    span = rows[i]["speedup_range"]
    return None if span is None else span[0] <= 1.0 <= span[1]


def _tps_cell(row: dict) -> str:
    if row["tokens_per_s"] is None:
        return DASH
    iqr = row.get("tokens_per_s_iqr")
    text = fmt_tps(row["tokens_per_s"])
    text = f"{text} ({fmt_tps(iqr[0])}–{fmt_tps(iqr[1])})" if iqr else text
    load = row.get("speed_load")
    return text if not load else f"{text}, load {load[0]:.1f}/{load[1]} CPUs"  # the machine when it was timed


def _speed_load(t: Table, rows, i):
    """[1-minute load average, CPUs] when the point was timed (results since eval recorded them)."""
    p = speed_at(t.results[i], t.speed_point) or {}
    load, cpus = p.get("load_average"), p.get("cpu_count")
    return [load[0], cpus] if load and cpus else None


def _speedup_cell(row: dict) -> str:
    if row["speedup"] is None:
        return DASH
    if row.get("speedup_noisy"):
        low, high = row["speedup_range"]
        return f"noise ({low:.2f}–{high:.2f}×)"
    return f"{row['speedup']:.2f}×"


def _recovery(t: Table, rows, i):
    start = t.starts[i]
    if start is None or start.missing:
        return None
    converted, parent, mine = (rows[j]["perplexity"] for j in (start.converted, start.parent, i))
    if None in (converted, parent, mine) or converted == parent:
        return None
    return (converted - mine) / (converted - parent)


def _domains_ratio(result: dict, base: dict):
    shared = domains.shared_ratios(result, base)
    return domains.geomean(shared.values()) if len(shared) >= 2 else None


def _kv_cell(row: dict) -> str:
    text = DASH if row["kv_bytes_per_token"] is None else fmt_bytes(row["kv_bytes_per_token"])
    return text + " ⚠" if row["kv_match"] is False else text  # the live cache disagrees with the formula


METRICS: list[Metric] = [
    Metric("label", "model", "--label of `mha2gqa eval` (default: the model directory's name)", "label"),
    Metric("role", "role", "--role, else from the model's mha2gqa.json lineage", "role"),
    Metric("heads", None, "query heads, from the model's config", "model.heads"),
    Metric(
        "kv_heads",
        "kv heads",
        "key/value heads, from the model's config",
        "model.kv_heads",
        cell=lambda row: f"{DASH if row['kv_heads'] is None else row['kv_heads']}/{row['heads']}",
    ),
    Metric(
        "perplexity",
        "perplexity",
        "exp of the mean next-token loss over sliding windows of --data, every token scored once",
        "perplexity.perplexity",
        "lower",
        fmt_ppl,
    ),
    Metric(
        "perplexity_change",
        "Δ ppl vs baseline",
        "perplexity / the baseline's - 1",
        direction="lower",
        fmt=lambda x: f"{100 * x:+.1f}%",
        derive=lambda t, rows, i: (
            None if (r := ratio(rows[i]["perplexity"], rows[t.base]["perplexity"])) is None else r - 1.0
        ),
    ),
    Metric(
        "recovery",
        "recovery",
        "(ppl of its converted start - ppl) / (ppl of its converted start - ppl of that start's parent), for "
        "uptrained results, the start and parent found through the lineage (mha2gqa.json)",
        direction="higher",
        fmt=lambda x: f"{100 * x:.0f}%",
        derive=_recovery,
        applies=lambda row: row["role"] == "uptrained",
    ),
    Metric(
        "recovery_from",
        None,
        "label of the converted start the recovery is measured from",
        derive=lambda t, rows, i: (
            None if t.starts[i] is None or t.starts[i].converted is None else rows[t.starts[i].converted]["label"]
        ),
    ),
    Metric(
        "kl_mean",
        "KL(ref‖model)",
        "mean KL(reference || model) per scored token, on the perplexity windows",
        "agreement.kl_mean",
        "lower",
        lambda x: f"{x:.4f}",
    ),
    Metric(
        "top1_agreement",
        "top-1 agree",
        "share of scored tokens where the model's and the reference's most likely next token agree",
        "agreement.top1_agreement",
        "higher",
        lambda x: f"{100 * x:.1f}%",
    ),
    Metric(
        "kv_bytes_per_token",
        "KV / token",
        "bytes per token of the live transformers cache after a prefill (⚠: differs from the formula)",
        "kv_cache.measured_bytes_per_token",
        "lower",
        fmt_bytes,
        cell=_kv_cell,
    ),
    Metric("kv_match", None, "whether the live cache matches 2*layers*kv_heads*head_dim*bytes", "kv_cache.match"),
    Metric(
        "kv_saving",
        "KV saving",
        "the baseline's KV bytes per token / the model's",
        direction="higher",
        fmt=lambda x: f"{x:.2f}×",
        derive=lambda t, rows, i: ratio(rows[t.base]["kv_bytes_per_token"], rows[i]["kv_bytes_per_token"]),
    ),
    Metric(
        "tokens_per_s",
        "decode tok/s, median (IQR){at}",
        "batch * new tokens / the median decode seconds of the timed repeats (after warm-up), at the "
        "largest (batch, context) every result measured",
        direction="higher",
        derive=_tokens_per_s,
        cell=_tps_cell,
    ),
    Metric(
        "decode_path",
        "decode path",
        "how eval's timed decode read the KV cache (eval --decode-path): grouped (each kv head read once for its "
        "group, nothing copied), dynamic (transformers' default, the cache copied every step) or repeat",
        "speed.decode_path.name",
    ),
    Metric(
        "speed_load",
        None,
        "[1-minute load average, CPU count] of the machine when the speed point was timed (eval records both)",
        derive=_speed_load,
    ),
    Metric(
        "tokens_per_s_iqr",
        None,
        "[first, third] quartile of tokens/s over the timed repeats",
        derive=_tokens_per_s_iqr,
    ),
    Metric(
        "tokens_per_s_interval",
        None,
        "~95% confidence interval of the median tokens/s, from the order statistics of the timed repeats",
        derive=_tokens_per_s_interval,
    ),
    Metric(
        "speedup",
        "speed-up",
        "tokens/s / the baseline's (median over median), only for speeds timed side by side (eval "
        "--speed-side-by-side) unless report --speedup-apart; 'noise' when the range below holds 1",
        direction="higher",
        derive=_speedup,
        cell=_speedup_cell,
    ),
    Metric(
        "speedup_measured",
        None,
        "how the speed-up's two speeds were timed: 'side by side' (one run, in turn), or 'apart' (separate runs, "
        "report --speedup-apart only); none is computed otherwise",
        derive=_speedup_measured,
    ),
    Metric(
        "speedup_range",
        None,
        "[low, high] speed-up with either median anywhere in its confidence interval",
        derive=_speedup_range,
    ),
    Metric(
        "speedup_noisy",
        None,
        "true when speedup_range holds 1: the spread is larger than the effect, so no speed-up is claimed",
        derive=_speedup_noisy,
    ),
]
BY_NAME = {m.name: m for m in METRICS}


def entries(results: list[dict]) -> list[Metric]:
    """Every metric of a report on these results: the fixed ones, then the per-domain ones, then lm-eval's."""
    return METRICS + domain_metrics(results) + retrieval_metrics(results) + lm_eval_metrics(results)


def shown(metric: Metric, rows: list[dict]) -> bool:
    """Whether the metric's column is drawn: it has a column and a value, or a row it is meant for."""
    if not metric.column:
        return False
    if metric.name in ("label", "role") or any(row.get(metric.name) is not None for row in rows):
        return True
    return metric.applies is not None and any(metric.applies(row) for row in rows)


def header(metric: Metric, speed_point: tuple[int, int] | None) -> str:
    """The column's header, with the speed point filled in and an arrow for the better direction."""
    at = f" @ B={speed_point[0]}, T={speed_point[1]}" if speed_point else ""
    arrow = {"lower": " ↓", "higher": " ↑"}.get(metric.direction, "")
    return metric.column.format(at=at) + arrow


# ---- quality per domain: one table, three columns per domain, when a result measured several ----


def domain_names(results: list[dict]) -> list[str]:
    """The domains of the results, in first-seen order; [] unless one result measured two or more (a single
    text's numbers are the main table's)."""
    if not any(len(r.get("domains") or {}) >= 2 for r in results):
        return []
    return list(dict.fromkeys(name for r in results for name in (r.get("domains") or {})))


def _domain(result: dict, name: str) -> dict:
    found = (result.get("domains") or {}).get(name)
    return found if isinstance(found, dict) else {}


def _domain_ppl(t: Table, rows, i, name: str):
    mine = (_domain(t.results[i], name).get("perplexity") or {}).get("perplexity")
    if mine is None:
        return None
    ratio_ = domains.shared_ratios(t.results[i], t.results[t.base]).get(name)
    return {"perplexity": mine, "ratio": ratio_}


def _domain_ppl_text(cell: dict | None) -> str:
    if cell is None:
        return DASH
    text = fmt_ppl(cell["perplexity"])
    return text if cell["ratio"] is None else f"{text} ({cell['ratio']:.2f}×)"


DOMAINS_RATIO = Metric(
    "domains_ratio",
    "ppl ratio, geo-mean of domains",
    "geometric mean over the domains (the texts of --data) of perplexity / the baseline's on the same "
    "tokens; given when two or more domains are shared with the baseline",
    direction="lower",
    fmt=lambda x: f"{x:.2f}×",
    derive=lambda t, rows, i: _domains_ratio(t.results[i], t.results[t.base]),
)


def _domain_agreement(name: str, main: Metric, short: str) -> Metric:
    """The main table's agreement metric `main` (its direction and format) on the one domain `name`."""
    field = main.field.split(".")[-1]
    return Metric(
        f"domain:{name}:{main.name}",
        f"{name} {short}",
        f"{main.computed}, on the {name} text",
        direction=main.direction,
        fmt=main.fmt,
        derive=lambda t, rows, i: (_domain(t.results[i], name).get("agreement") or {}).get(field),
        group="domains",
    )


def domain_metrics(results: list[dict]) -> list[Metric]:
    """Per domain: perplexity (with its ratio to the baseline's on the same tokens), KL and top-1 agreement."""
    names = domain_names(results)
    found = [DOMAINS_RATIO] if names else []  # a main-table column, only where there are domains
    for name in names:
        key = f"domain:{name}"
        found += [
            Metric(
                f"{key}:perplexity",
                f"{name} ppl (× baseline)",
                f"perplexity on the {name} text alone, and its ratio to the baseline's on the same tokens",
                direction="lower",
                derive=lambda t, rows, i, name=name: _domain_ppl(t, rows, i, name),
                cell=lambda row, key=key: _domain_ppl_text(row[f"{key}:perplexity"]),
                group="domains",
            ),
            *(
                _domain_agreement(name, BY_NAME[main], short)
                for main, short in (("kl_mean", "KL"), ("top1_agreement", "top-1"))
            ),
        ]
    return found


# ---- retrieval: recall per context length, with the recall at each depth ----


def _retrieval_at(result: dict, length: int) -> dict | None:
    """{recall, depths: {depth: recall}} of one length, pooled over the tasks; None where not measured."""
    section = result.get("retrieval") or {}
    pooled = next((x for x in section.get("lengths") or [] if x.get("length") == length), None)
    if pooled is None:
        return None
    cells = [c for c in section.get("cells") or [] if c.get("length") == length]
    depths = {}
    for c in cells:
        depths.setdefault(c["depth"], []).append((c["recall"], c["items"]))
    by_depth = {d: sum(r * n for r, n in v) / sum(n for _, n in v) for d, v in depths.items()}
    return {"recall": pooled["recall"], "depths": dict(sorted(by_depth.items()))}


def _retrieval_text(cell: dict | None) -> str:
    if cell is None:
        return DASH
    depths = ", ".join(f"{d:g}: {100 * r:.0f}" for d, r in cell["depths"].items())
    return f"{100 * cell['recall']:.0f}% ({depths})"


RETRIEVAL = [  # main-table columns, where some result ran the probe
    Metric(
        "retrieval_recall",
        "retrieval recall",
        "share of the retrieval probe's questions (eval --retrieval: a fact far back in a long context) whose "
        "greedy answer is exact, over every length, depth and task",
        "retrieval.recall",
        "higher",
        lambda x: f"{100 * x:.0f}%",
    ),
    Metric(
        "retrieval_kept",
        "answer prob. kept",
        "exp(mean(answer log-probability - the reference's)) on the retrieval probe: the share of the "
        "reference's probability of the right answers the model keeps",
        "retrieval.answer_probability_kept",
        "higher",
        share,
    ),
]


def retrieval_metrics(results: list[dict]) -> list[Metric]:
    """Where some result ran the retrieval probe: its recall and answer probability kept in the main table, and
    one column per context length any result probed: recall there, then by depth in brackets."""
    lengths = sorted({x["length"] for r in results for x in (r.get("retrieval") or {}).get("lengths") or []})
    return (RETRIEVAL if lengths else []) + [
        Metric(
            f"retrieval:{n}",
            f"recall @ {n} tokens (by depth)",
            f"retrieval probe recall at {n} tokens of context, pooled over tasks, then per depth of the fact",
            direction="higher",
            derive=lambda t, rows, i, n=n: _retrieval_at(t.results[i], n),
            cell=lambda row, n=n: _retrieval_text(row[f"retrieval:{n}"]),
            group="retrieval",
        )
        for n in lengths
    ]


# ---- lm-eval: one value column and one Δ column per task metric any result has ----


def lm_eval_metrics(results: list[dict]) -> list[Metric]:
    """Entries for every lm-eval task metric the results hold, in first-seen order: the value with
    its uncertainty, and Δ vs the baseline (a ratio - 1 for perplexities, whose scale is
    multiplicative; percentage points for accuracies; a plain difference otherwise)."""
    found: dict[tuple[str, str], bool | None] = {}
    for r in results:
        for task, section in schema.lm_eval_tasks(r).items():
            for metric, m in (section.get("metrics") or {}).items():
                found.setdefault((task, metric), m.get("higher_is_better"))
    entries = []
    for (task, metric), higher in found.items():
        values = [m["value"] for r in results if (m := schema.lm_eval_metric(r, task, metric))]
        scale = "relative" if "perplexity" in metric else "percent" if all(0 <= v <= 1 for v in values) else "plain"
        key = f"{task}:{metric}"
        direction = None if higher is None else "higher" if higher else "lower"
        entries += [
            Metric(
                f"lm_eval:{key}",
                f"{task} {metric}",
                f"lm-evaluation-harness {task} {metric}"
                + (", with the 95% interval of exp(mean nll)" if scale == "relative" else ", ± its standard error"),
                direction=direction,
                derive=lambda t, rows, i, task=task, metric=metric: _lm_eval_cell(t.results[i], task, metric),
                cell=lambda row, key=key, scale=scale: _lm_eval_text(row[f"lm_eval:{key}"], scale),
                group="lm_eval",
            ),
            Metric(
                f"lm_eval_delta:{key}",
                f"Δ {metric}",
                f"{task} {metric} vs the baseline's",
                direction=direction,
                fmt=_DELTA[scale],
                derive=lambda t, rows, i, key=key, scale=scale: _lm_eval_delta(rows[i], rows[t.base], key, scale),
                group="lm_eval",
            ),
        ]
    return entries


_ONE = {"relative": fmt_ppl, "percent": lambda x: f"{100 * x:.1f}", "plain": lambda x: f"{x:.4g}"}
_DELTA = {
    "relative": lambda x: f"{100 * x:+.1f}%",
    "percent": lambda x: f"{100 * x:+.1f} pt",
    "plain": lambda x: f"{x:+.4g}",
}


def _lm_eval_cell(result: dict, task: str, metric: str) -> dict | None:
    found = schema.lm_eval_metric(result, task, metric)
    if found is None:
        return None
    return {key: found.get(key) for key in ("value", "stderr", "interval_95")}


def _lm_eval_delta(row: dict, base: dict, key: str, scale: str):
    mine, theirs = row[f"lm_eval:{key}"], base[f"lm_eval:{key}"]
    if mine is None or theirs is None:
        return None
    if scale == "relative":
        r = ratio(mine["value"], theirs["value"])
        return None if r is None else r - 1.0
    return mine["value"] - theirs["value"]


def _lm_eval_text(cell: dict | None, scale: str) -> str:
    """A perplexity with its 95% interval (a ± would be symmetric on a multiplicative scale; results
    written before the interval was recorded show the value alone), anything else ± its stderr."""
    if cell is None:
        return DASH
    one = _ONE[scale]
    text = one(cell["value"]) + ("%" if scale == "percent" else "")
    if scale == "relative":
        low_high = cell.get("interval_95")
        same = (lambda x: f"{x:,.0f}") if cell["value"] >= 1000 else (lambda x: f"{x:.2f}")  # bounds as the value
        return f"{text} ({same(low_high[0])}–{same(low_high[1])})" if low_high else text
    return text if cell.get("stderr") is None else f"{text} ± {one(cell['stderr'])}"


def table_values(table: Table, entries: list[Metric]) -> list[dict]:
    """One row per result of `table`, every entry's value by name."""
    rows: list[dict] = [{} for _ in table.results]
    for entry in entries:  # column by column: a derived metric reads the columns before it
        for i, row in enumerate(rows):
            row[entry.name] = entry.value(table, rows, i)
    return rows


def row_against(result: dict, baseline: dict) -> dict:
    """The main table's metrics (metrics.METRICS, and the retrieval probe's where it ran) of `result` against
    `baseline`, by name: the second row of a report of the two, without a speed point or lineage (a sweep's
    candidate against its parent)."""
    return table_values(Table([baseline, result], 0, None, [None, None]), METRICS + RETRIEVAL)[1]
