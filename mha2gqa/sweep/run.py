"""`sweep`: which kv-head count (and method) to pick, answered before any training.

Every candidate (kv-head count x method) is checked and planned by convert itself (a dry run) before
anything is written; then the parent is evaluated once, the calibration statistics are gathered once,
and each candidate is converted with those statistics, evaluated against the parent and, unless
--keep, removed. sweep.json is rewritten after every candidate, so an interrupted sweep keeps the
candidates it finished; the temporary models live inside OUT and go with it on any exit.

The KL and top-1 agreement of each candidate come from eval's own pass, which runs the parent beside
the candidate over the same windows: caching the parent's full next-token distributions instead would
take tokens x vocabulary floats (GBs for a real model), so the parent runs once per candidate there.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from mha2gqa import estimates, provenance, textdata
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.embedded import expand_corpus_name
from mha2gqa.errors import InputError
from mha2gqa.eval import schema
from mha2gqa.eval.schema import SWEEP_SCHEMA, write_result
from mha2gqa.layouts import AttentionShape, attention_shape, layout_for, read_config
from mha2gqa.sources import resolve_model_dir
from mha2gqa.sweep.options import SweepOptions
from mha2gqa.writing import check_room

UPTRAIN_RECIPE = Path(__file__).resolve().parent.parent / "demo" / "demo-uptrain.yaml"


@dataclass(frozen=True)
class Candidate:
    groups: int
    method: str

    @property
    def name(self) -> str:
        return f"kv{self.groups}-{self.method}"


def kv_head_counts(shape: AttentionShape, wanted: tuple[int, ...] | None, echo=print) -> list[int]:
    """The kv-head counts to try, largest first: every divisor of the source's kv heads below it, or those
    of `wanted` that are (the others are named and skipped)."""
    valid = [g for g in shape.valid_groups() if g < shape.kv_heads]
    if wanted is None:
        chosen = valid
    else:
        chosen = [g for g in dict.fromkeys(wanted) if g in valid]
        skipped = [g for g in dict.fromkeys(wanted) if g not in valid]
        if skipped and chosen:
            echo(f"note: skipping --groups {','.join(map(str, skipped))}: not a divisor of {shape.kv_heads} below it")
    if not chosen:
        asked = "" if wanted is None else f"--groups {','.join(map(str, wanted))} leaves "
        raise InputError(
            f"{asked}no kv-head count to try: a candidate must divide the source's {shape.kv_heads} kv heads and be "
            f"below it (valid: {', '.join(map(str, valid)) or 'none, the source has one kv head already'})"
        )
    return sorted(chosen, reverse=True)


def _conversion_options(candidate: Candidate, calibration, options: SweepOptions, dry_run: bool) -> ConvertOptions:
    return ConvertOptions(
        groups=candidate.groups,
        method=candidate.method,
        seed=options.seed,
        calibration=calibration,
        calibration_tokens=options.calibration_tokens,
        refine=options.refine,
        dry_run=dry_run,
        progress=False,
    )


def _convert(source: Path, dst: Path, candidate: Candidate, calibration, options: SweepOptions, dry_run=False):
    """The sweep's one call of convert (its checks, plan and writer, unchanged). `calibration` is the data
    for a dry run and the CalibrationStats gathered once for a real one (convert's `stats`)."""
    from mha2gqa.convert.run import convert

    data, stats = (calibration, None) if dry_run else (None, calibration)
    return convert(source, dst, options=_conversion_options(candidate, data, options, dry_run), stats=stats)


def _bytes_needed(plans: dict, shape: AttentionShape, keep: bool) -> int:
    """What OUT must hold at the worst moment: the calibration statistics, and every kept model or the
    largest temporary one (each is removed before the next is written), each with its scratch files (the
    dry run's plan, made from the data, counts statistics there too: an overestimate of one copy)."""
    sizes = [plan.bytes_written + plan.scratch_bytes for plan in plans.values()]
    statistics = shape.layers * (shape.hidden + 1) ** 2 * 8
    return statistics + (sum(sizes) if keep else max(sizes)) + (1 << 20)


def _check_room(out: Path, needed: int) -> None:
    check_room(out, needed, f"--out {out}", "calibration statistics and converted models; or drop --keep to need less")


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file: pass a directory for the sweep")
    if (out / "sweep.json").exists():
        raise InputError(f"--out {out} already holds a sweep.json: choose a new directory or remove it")
    schema.check_writable(out / "sweep.json", "--out")


def _eval_options(options: SweepOptions, label: str, role: str, reference: Path | None = None):
    from mha2gqa.eval.options import EvalOptions

    return EvalOptions(
        data=options.data,
        reference=str(reference) if reference else None,
        max_tokens=options.max_tokens,
        speed_preset=None,
        role=role,
        label=label,
        seed=options.seed,
        progress=False,
    )


def _gather_statistics(source: Path, calibration, options: SweepOptions, out_dir: Path):
    """The one calibration pass of the sweep: every candidate's conversion reads these statistics."""
    from mha2gqa.convert.calibration import calibrate

    config = read_config(source)
    out_dir.mkdir()
    return calibrate(
        source,
        layout_for(config),
        attention_shape(config),
        calibration,
        options.calibration_tokens,
        out_dir,
        progress=options.progress,
    )


def _kv(result: dict, context: int | None) -> dict:
    per_token = schema.kv_bytes_per_token(result)
    return {"kv_bytes_per_token": per_token, "kv_bytes_per_sequence": per_token * context if context else None}


def _run_candidate(source, candidate, stats, options, models_dir, parent, context) -> dict:
    """Convert, measure the conversion's wall time and peak memory, evaluate against the parent."""
    import torch

    from mha2gqa.eval.memory import PeakMemory
    from mha2gqa.eval.run import evaluate

    dst = models_dir / candidate.name
    started = time.perf_counter()
    with PeakMemory(torch.device("cpu")) as peak:
        converted = _convert(source, dst, candidate, stats, options)
    convert_s = time.perf_counter() - started
    started = time.perf_counter()
    result = evaluate(dst, options=_eval_options(options, candidate.name, "converted", source))
    eval_s = time.perf_counter() - started
    ppl, parent_ppl = schema.perplexity(result), schema.perplexity(parent)
    return {
        "name": candidate.name,
        "groups": candidate.groups,
        "method": candidate.method,
        "perplexity": ppl,
        "perplexity_change": ppl / parent_ppl - 1.0,
        "kl_mean": schema.kl_mean(result),
        "top1_agreement": schema.top1_agreement(result),
        **_kv(result, context),
        "kv_saving": schema.kv_bytes_per_token(parent) / schema.kv_bytes_per_token(result),
        "convert_wall_s": round(convert_s, 3),
        "convert_peak_rss_bytes": peak.peak_bytes,
        "eval_wall_s": round(eval_s, 3),
        "model": str(dst) if options.keep else None,
        "merge_layers": converted.layers,
        "refine": converted.refine,
        "result": result,
    }


def sweep(src, options: SweepOptions, echo=print) -> dict:
    """Run the sweep of `options` on the model at `src`; returns the record written to OUT/sweep.json.
    Every refusal (groups, methods, data, OUT, room) comes before anything is written."""
    source = resolve_model_dir(src)
    config = read_config(source)
    shape = attention_shape(config)
    candidates = [Candidate(g, m) for g in kv_head_counts(shape, options.groups, echo) for m in options.methods]
    out = Path(options.out).expanduser()
    calibration = expand_corpus_name(options.calibration)
    textdata.resolve("--calibration", calibration)
    textdata.resolve("--data", options.data)
    _check_out(out)
    models_dir = out / "models"
    plans = {
        c: _convert(source, models_dir / c.name, c, calibration, options, dry_run=True).conversion for c in candidates
    }
    _check_room(out, _bytes_needed(plans, shape, options.keep))
    echo(estimates.sweep_start_line(list(plans.values()), options.data, options.max_tokens, options.calibration_tokens))
    started = time.perf_counter()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    record = _record(src, source, config, options, candidates)
    try:
        with tempfile.TemporaryDirectory(prefix=".sweep-", dir=out) as work:
            _measure(source, calibration, options, candidates, record, out, Path(work), started, echo)
    except KeyboardInterrupt:
        if record["parent"] is None:  # nothing measured yet: leave nothing behind
            if created:
                shutil.rmtree(out, ignore_errors=True)
            echo("\nsweep interrupted before any candidate ran: nothing written")
            raise
        record["interrupted"] = True
        _finish(record, out)
        echo(
            f"\nsweep interrupted: {out / 'sweep.json'} keeps the {len(record['candidates'])} of "
            f"{len(candidates)} candidates that finished; no temporary model is left"
        )
        raise
    record["wall_s"] = round(time.perf_counter() - started, 2)
    _finish(record, out)
    return record


def _measure(source, calibration, options, candidates, record, out: Path, work: Path, started: float, echo) -> None:
    """The parent once, the statistics once, then every candidate; sweep.json is rewritten after each."""
    from mha2gqa.eval.run import evaluate

    echo(f"sweep: {len(candidates)} candidates; evaluating the parent on {options.data}")
    # With bars (time left): the parent's evaluation and the calibration pass can take many minutes.
    parent = evaluate(source, options=replace(_eval_options(options, "parent", "parent"), progress=options.progress))
    echo(f"sweep: gathering calibration statistics once ({options.calibration_tokens:,} tokens)")
    stats = _gather_statistics(source, calibration, options, work / "calibration")
    record["calibration"] = stats.record
    record["parent"] = {"perplexity": schema.perplexity(parent), **_kv(parent, record["context"]), "result": parent}
    models_dir = out / "models" if options.keep else work
    with tqdm(candidates, desc="sweep", unit="candidate", disable=not options.progress) as bar:
        for candidate in bar:
            bar.set_postfix_str(candidate.name)
            row = _run_candidate(source, candidate, stats, options, models_dir, parent, record["context"])
            if not options.keep:
                shutil.rmtree(models_dir / candidate.name)
            record["candidates"].append(row)
            record["wall_s"] = round(time.perf_counter() - started, 2)
            write_result(record, out / "sweep.json")  # after every candidate: even a kill keeps the finished ones


def _finish(record: dict, out: Path) -> None:
    from mha2gqa.sweep.render import write_pages

    record["recommendation"] = recommend(record)
    write_result(record, out / "sweep.json")
    write_pages(record, out)


def _record(src, source: Path, config: dict, options: SweepOptions, candidates: list[Candidate]) -> dict:
    from mha2gqa.eval.provenance import versions

    settings = asdict(options)
    settings["refine"] = asdict(options.refine) if options.refine else None
    return {
        "schema": SWEEP_SCHEMA,
        "source": {
            "path": str(src),
            "resolved": str(source.resolve()),
            "config_sha256": hashlib.sha256((source / "config.json").read_bytes()).hexdigest(),
            "model_type": config.get("model_type"),
            "kv_heads": attention_shape(config).kv_heads,
            "lineage": provenance.lineage(source),
        },
        "settings": settings,
        "context": config.get("max_position_embeddings"),
        "planned": [c.name for c in candidates],
        "parent": None,
        "calibration": None,
        "candidates": [],
        "interrupted": False,
        "recommendation": None,
        "versions": versions(),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": None,
    }


def recommend(record: dict) -> dict:
    """Per method, the smallest KV cache whose perplexity is within the tolerance of the parent's; when no
    candidate is, the uptraining command to try next, from the candidate of lowest perplexity."""
    rows, settings = record["candidates"], record["settings"]
    tolerance, parent_ppl = settings["tolerance"], record["parent"]["perplexity"]
    limit = parent_ppl * (1 + tolerance)
    chosen = {}
    for method in settings["methods"]:
        fits = [r for r in rows if r["method"] == method and r["perplexity"] <= limit]
        chosen[method] = min(fits, key=lambda r: (r["kv_bytes_per_token"], r["perplexity"]))["name"] if fits else None
    head = f"within {100 * tolerance:g}% of the parent's perplexity {parent_ppl:.2f}"
    if not rows:
        summary = f"no candidate finished: nothing to recommend ({head})"
        return {"per_method": chosen, "next": None, "summary": summary, "line": summary}
    by_name = {r["name"]: r for r in rows}
    parts = [
        f"{method}: "
        + (
            f"{_heads(by_name[name]['groups'])} ({by_name[name]['kv_saving']:g}x smaller KV, "
            f"{100 * by_name[name]['perplexity_change']:+.1f}%)"
            if name
            else "none"
        )
        for method, name in chosen.items()
    ]
    next_command = None
    if not any(chosen.values()):
        best = min(rows, key=lambda r: (r["perplexity"], r["kv_bytes_per_token"]))
        next_command = uptrain_command(record, best)
        parts.append(f"none is: try uptraining the closest, {best['name']} ({100 * best['perplexity_change']:+.1f}%)")
    summary = f"recommended ({head}): " + "; ".join(parts)
    line = f"{summary}: {next_command}" if next_command else summary  # what the command prints: one line
    return {"per_method": chosen, "next": next_command, "summary": summary, "line": line}


def _heads(count: int) -> str:
    return f"{count} kv head" + ("" if count == 1 else "s")


def uptrain_command(record: dict, row: dict) -> str:
    """The commands that rebuild `row`'s model (unless --keep kept it) and uptrain it with the shipped recipe,
    on the calibration text, evaluated on the sweep's data, distilled from the parent."""
    settings, source = record["settings"], record["source"]["path"]
    model = row["model"] or f"{row['name']}"
    calibration = settings["calibration"]
    steps = []
    if row["model"] is None:
        convert = ["mha2gqa", "convert", source, model, "--groups", str(row["groups"]), "--method", row["method"]]
        convert += ["--calibration", calibration if isinstance(calibration, str) else "DATA"]  # the CLI takes one
        convert += ["--calibration-tokens", str(settings["calibration_tokens"]), "--seed", str(settings["seed"])]
        convert += ["--refine"] if settings["refine"] else []
        steps.append(convert)
    train = [str(p) for p in _as_list(expand_corpus_name(calibration))]
    steps.append(
        ["mha2gqa", "uptrain", "--recipe", str(UPTRAIN_RECIPE), f"model={model}", f"output_dir={model}-uptrained"]
        + [f"data.train=[{','.join(train)}]", f"data.eval=[{settings['data']}]", f"distill.teacher={source}"]
    )
    return " && ".join(shlex.join(step) for step in steps)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
