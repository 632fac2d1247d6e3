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
import json
import math
import os
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from mha2gqa import provenance
from mha2gqa.convert.options import ConvertOptions, current_refine_fields
from mha2gqa.corpus import textdata
from mha2gqa.corpus.probe import PROBE, parse_domains
from mha2gqa.embedded import expand_corpus_name
from mha2gqa.errors import InputError
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.eval import schema
from mha2gqa.eval.domains import geomean
from mha2gqa.eval.schema import write_result
from mha2gqa.eval.sweep_schema import SWEEP_SCHEMA
from mha2gqa.layouts import AttentionShape, attention_shape, layout_for, read_config
from mha2gqa.reading import read_json
from mha2gqa.run_folder import check_folder, continued_folder, run_folder, scratch_folder
from mha2gqa.sources import resolve_model_dir
from mha2gqa.sweep.options import BROKEN_SLACK, SweepOptions
from mha2gqa.sweep.render import QUALITY_PNG, SENSITIVITY_PNG
from mha2gqa.sweep.timing import candidate_stage, sweep_clock
from mha2gqa.writing import check_room

UPTRAIN_RECIPE = Path(__file__).resolve().parent.parent / "demo" / "demo-uptrain.yaml"
SCRATCH = ".sweep-"  # OUT/.sweep-PID: the statistics and temporary models of a running sweep
# What a sweep writes into OUT (run_folder's rule: anything else there is the user's and is refused).
RUN_ENTRIES = frozenset({"sweep.json", "sweep.md", "sweep.html", QUALITY_PNG, SENSITIVITY_PNG, "models", SCRATCH + "*"})
# Settings that change a candidate's numbers: a resumed sweep must have the same ones.
SAME_ON_RESUME = ("calibration", "data", "refine", "max_tokens", "calibration_tokens", "seed")


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
    sizes = [plan.bytes_written + plan.scratch_bytes for plan in plans.values()] or [0]
    statistics = shape.layers * (shape.hidden + 1) ** 2 * 8
    return statistics + (sum(sizes) if keep else max(sizes)) + (1 << 20)


def _check_room(out: Path, needed: int) -> None:
    check_room(out, needed, f"--out {out}", "calibration statistics and converted models; or drop --keep to need less")


def _check_out(out: Path, options: SweepOptions) -> None:
    """OUT by the rule of every output folder (run_folder.check_folder); with --resume, an OUT holding the
    sweep to continue."""
    if options.resume:
        if not (out / "sweep.json").is_file():
            raise InputError(f"--resume: {out} holds no sweep.json to continue: run without --resume")
    else:
        check_folder(out, "--out", "sweep", RUN_ENTRIES, options.force)
    schema.check_writable(out / "sweep.json", "--out")


def _earlier(out: Path, record: dict) -> dict:
    """The sweep --resume continues: OUT/sweep.json, checked against this run's source and settings."""
    path = out / "sweep.json"
    found = read_json(path, "pass an --out written by `mha2gqa sweep`, or run without --resume")
    if (
        not isinstance(found, dict)
        or found.get("schema") != SWEEP_SCHEMA
        or not isinstance(found.get("settings"), dict)
    ):
        raise InputError(f"--resume: {path} is not a sweep.json written by `mha2gqa sweep`: run without --resume")
    if (found.get("source") or {}).get("config_sha256") != record["source"]["config_sha256"]:
        raise InputError(f"--resume: {path} swept another source (its config.json differs): pass the same SRC")
    for key in SAME_ON_RESUME:  # compared as JSON holds them (a tuple reads back as a list)
        recorded = found["settings"].get(key)
        if key == "refine" and isinstance(recorded, dict):  # a sweep.json from before a refine field retired
            recorded = current_refine_fields(recorded)
        if recorded != json.loads(json.dumps(record["settings"][key])):
            flag = "--" + key.replace("_", "-")
            raise InputError(
                f"--resume: {flag} differs from the sweep in {out} (it ran with {found['settings'].get(key)!r}): "
                f"pass the same {flag}, or start a new sweep with --force"
            )
    return found


def _resumed(record: dict, earlier: dict) -> None:
    """The earlier sweep's parent and finished candidates that this run plans, kept in `record`."""
    rows = [r for r in earlier.get("candidates") or [] if isinstance(r, dict) and r.get("name") in record["planned"]]
    parent = earlier.get("parent")
    if isinstance(parent, dict) and isinstance(parent.get("result"), dict):
        record["parent"], record["candidates"], record["calibration"] = parent, rows, earlier.get("calibration")


def _folder(out: Path, options: SweepOptions):
    if options.resume:
        return continued_folder(out, "--out", scratch=SCRATCH)
    return run_folder(out, "--out", "sweep", RUN_ENTRIES, options.force, scratch=SCRATCH)


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
        seed=options.seed,
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
        **_domain_columns(result, parent),
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


def _domain_columns(result: dict, parent: dict) -> dict:
    """Per domain of --data: the candidate's perplexity, its ratio to the parent's on the same text, KL and
    top-1; with the geometric mean of the ratios and the worst domain (recommend reads these)."""
    domains = {}
    for name, d in (result.get("domains") or {}).items():
        ppl = d["perplexity"]["perplexity"]
        agreement = d.get("agreement") or {}
        domains[name] = {
            "perplexity": ppl,
            "ratio": ppl / parent["domains"][name]["perplexity"]["perplexity"],
            "kl_mean": agreement.get("kl_mean"),
            "top1_agreement": agreement.get("top1_agreement"),
        }
    ratios = {name: d["ratio"] for name, d in domains.items()}
    worst = max(ratios, key=ratios.get) if ratios else None
    return {
        "domains": domains,
        "domains_ratio": geomean(ratios.values()),
        "worst_domain": worst,
        "worst_ratio": ratios.get(worst),
    }


def sweep(src, options: SweepOptions, echo=print) -> dict:
    """Run the sweep of `options` on the model at `src`; returns the record written to OUT/sweep.json.
    Every refusal (groups, methods, data, OUT, room) comes before anything is written. OUT follows the
    rule of every output folder (mha2gqa/run_folder.py): until the first candidate is recorded, a failure
    or a kill leaves what was there before; after it, sweep.json keeps the finished candidates."""
    source = resolve_model_dir(src)
    config = read_config(source)
    shape = attention_shape(config)
    candidates = [Candidate(g, m) for g in kv_head_counts(shape, options.groups, echo) for m in options.methods]
    out = Path(options.out).expanduser()
    calibration = options.calibration  # each candidate's dry run below resolves and checks it (prepare)
    for path in parse_domains(options.data).values():
        textdata.resolve("--data", path)
    _check_out(out, options)
    record = _record(src, source, config, options, candidates)
    earlier = _earlier(out, record) if options.resume else None
    models_dir = out / "models"
    done = {r.get("name") for r in (earlier or {}).get("candidates") or [] if isinstance(r, dict)}
    plans = {  # what is left to convert (a resumed sweep's finished models are not planned again)
        c: _convert(source, models_dir / c.name, c, calibration, options, dry_run=True).conversion
        for c in candidates
        if c.name not in done
    }
    if plans:  # the token count every dry run resolved (unset: the default of the calibration's kind)
        options = replace(options, calibration_tokens=next(iter(plans.values())).calibration.tokens)
    if plans:
        parameters = sum(math.prod(info.shape) for info in next(iter(plans.values())).checkpoint.tensors.values())
        record["source"]["pretrain_tokens"] = pretrain_tokens(source, parameters)
    record["convert_commands"] = {  # the cards' Reproduce lines (a resumed sweep's finished ones: as it wrote them)
        **(earlier or {}).get("convert_commands", {}),
        **{c.name: plan.command() for c, plan in plans.items()},
    }
    needed = _bytes_needed(plans, shape, options.keep)
    _check_room(out, needed)
    domains = list(parse_domains(options.data).values())
    clock = sweep_clock({c.name: plan for c, plan in plans.items()}, domains, options, echo) if plans else NO_CLOCK
    if options.dry_run:
        echo(f"would sweep {len(plans)} candidates into {out}: {', '.join(c.name for c in plans) or 'none left'}")
        echo(f"  {out} needs {needed / 2**20:,.1f} MiB at the worst moment (statistics and converted models)")
        return record
    started = time.perf_counter()
    with _folder(out, options) as folder:
        if earlier is not None:
            _resumed(record, earlier)
            echo(f"sweep: resuming {out}: {len(record['candidates'])} of {len(candidates)} candidates already finished")
        try:
            with scratch_folder(out, SCRATCH) as work:
                run = (work, started, echo, folder.commit, clock)
                _measure(source, calibration, options, candidates, record, out, run)
        except KeyboardInterrupt:
            _interrupted(record, out, len(candidates), folder, echo)
            raise
        record["interrupted"] = False
        record["wall_s"] = round(time.perf_counter() - started, 2)
        folder.commit()
        _finish(record, out)
    clock.finish()
    return record


def _interrupted(record: dict, out: Path, total: int, folder, echo) -> None:
    """A sweep stopped by Ctrl-C or a signal: the finished candidates are kept in sweep.json (committed),
    unless none had run, when the folder goes back to what it was."""
    if record["parent"] is None:  # nothing measured yet: the folder goes back to what it was
        echo("\nsweep interrupted before any candidate ran: nothing written")
        return
    record["interrupted"] = True
    folder.commit()
    _finish(record, out)
    echo(
        f"\nsweep interrupted: {out / 'sweep.json'} keeps the {len(record['candidates'])} of "
        f"{total} candidates that finished (continue with --resume); no temporary model is left"
    )


def _measure(source, calibration, options, candidates, record, out: Path, run: tuple) -> None:
    """The parent once (unless a resumed sweep measured it), the statistics once, then every candidate not
    finished yet; sweep.json is rewritten after each, and from the first one on it is the sweep that stays
    (`commit`). run: (scratch folder, start time, echo, commit, the estimates clock)."""
    from mha2gqa.eval.run import evaluate

    work, started, echo, commit, clock = run
    done = {row["name"] for row in record["candidates"]}
    todo = [c for c in candidates if c.name not in done]
    if record["parent"] is None:
        echo(f"sweep: {len(candidates)} candidates; evaluating the parent on {data_words(options.data)}")
        clock.stage("evaluate parent")
        # With bars (time left): the parent's evaluation and the calibration pass can take many minutes.
        parent = evaluate(
            source, options=replace(_eval_options(options, "parent", "parent"), progress=options.progress)
        )
        record["parent"] = {
            "perplexity": schema.perplexity(parent),
            "domains": {name: d["perplexity"]["perplexity"] for name, d in (parent.get("domains") or {}).items()},
            **_kv(parent, record["context"]),
            "result": parent,
        }
    parent = record["parent"]["result"]
    if not todo:
        return
    echo(f"sweep: gathering calibration statistics once ({options.calibration_tokens:,} tokens)")
    clock.stage("calibrate")
    stats = _gather_statistics(source, calibration, options, work / "calibration")
    record["calibration"] = stats.record
    models_dir = out / "models" if options.keep else work
    if options.keep:
        models_dir.mkdir(exist_ok=True)
    with tqdm(todo, desc="sweep", unit="candidate", disable=not options.progress) as bar:
        for candidate in bar:
            bar.set_postfix_str(candidate.name)
            clock.stage(candidate_stage(candidate.name))
            row = _run_candidate(source, candidate, stats, options, models_dir, parent, record["context"])
            if not options.keep:
                shutil.rmtree(models_dir / candidate.name)
            record["candidates"].append(row)
            record["candidates"].sort(key=lambda r: record["planned"].index(r["name"]))
            record["wall_s"] = round(time.perf_counter() - started, 2)
            write_result(record, out / "sweep.json")  # after every candidate: even a kill keeps the finished ones
            commit()


def data_words(data) -> str:
    """--data as words (it printed as a Python tuple): the probe set's domains, or each text's name and path."""
    if data == (PROBE,) or data == PROBE:
        return f"the probe set ({', '.join(parse_domains(PROBE))})"
    return ", ".join(f"{name} ({path})" for name, path in parse_domains(data).items())


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


# A candidate good on average and broken on one domain (a conversion that fits its calibration text) is never
# recommended: BROKEN_SLACK (sweep/options.py) says what broken is.


def _ratios(row: dict, parent_ppl: float) -> dict[str, float]:
    """{domain: perplexity ratio to the parent}; one unnamed domain for a record written before domains."""
    return {n: d["ratio"] for n, d in (row.get("domains") or {}).items()} or {"data": row["perplexity"] / parent_ppl}


def verdict(row: dict, parent_ppl: float, tolerance: float) -> str | None:
    """None when the candidate may be recommended, else why not, in words."""
    ratios = _ratios(row, parent_ppl)
    cap = 1 + BROKEN_SLACK * tolerance
    broken = {n: r for n, r in ratios.items() if r > cap}
    if len(ratios) > 1 and broken:
        worst = max(broken, key=broken.get)
        return f"broken on {worst} ({broken[worst]:.2f}x the parent's, above {cap:.2f}x)"
    if len(ratios) == 1:  # one text: the rule it always had
        return None if row["perplexity"] <= parent_ppl * (1 + tolerance) else "outside the tolerance"
    return None if geomean(ratios.values()) <= 1 + tolerance else "outside the tolerance"


def recommend(record: dict) -> dict:
    """Per method, the smallest KV cache within the tolerance of the parent (over several domains: the
    geometric mean of the per-domain perplexity ratios within it, and no domain broken); when no candidate
    is, the uptraining command to try next, from the candidate of lowest perplexity (geometric mean)."""
    rows, settings = record["candidates"], record["settings"]
    tolerance, parent_ppl = settings["tolerance"], record["parent"]["perplexity"]
    several = any(len(r.get("domains") or {}) > 1 for r in rows)
    refused = {r["name"]: verdict(r, parent_ppl, tolerance) for r in rows}
    chosen = {}
    for method in settings["methods"]:
        fits = [r for r in rows if r["method"] == method and refused[r["name"]] is None]
        chosen[method] = min(fits, key=lambda r: (r["kv_bytes_per_token"], _score(r)))["name"] if fits else None
    head = (
        f"geometric mean of the per-domain perplexity ratios within {100 * tolerance:g}% of the parent's, no domain "
        f"above {1 + BROKEN_SLACK * tolerance:.2f}x"
        if several
        else f"within {100 * tolerance:g}% of the parent's perplexity {parent_ppl:.2f}"
    )
    if not rows:
        summary = f"no candidate finished: nothing to recommend ({head})"
        return {"per_method": chosen, "next": None, "summary": summary, "line": summary, "refused": {}}
    parts = [f"{method}: " + (_chosen_text(rows, name, several) if name else "none") for method, name in chosen.items()]
    broken = {n: why for n, why in refused.items() if why and why.startswith("broken")}
    if broken:
        parts.append("refused " + ", ".join(f"{n} ({why})" for n, why in broken.items()))
    next_command = None
    if not any(chosen.values()):
        best = min(rows, key=lambda r: (_score(r), r["kv_bytes_per_token"]))
        next_command = uptrain_command(record, best)
        parts.append(f"none is: try uptraining the closest, {best['name']} ({_change(best, several)})")
    summary = f"recommended ({head}): " + "; ".join(parts)
    line = f"{summary}: {next_command}" if next_command else summary  # what the command prints: one line
    return {"per_method": chosen, "next": next_command, "summary": summary, "line": line, "refused": refused}


def _score(row: dict) -> float:
    """What ranks candidates: the geometric mean of the per-domain ratios, else (one text) the perplexity."""
    return row["domains_ratio"] if len(row.get("domains") or {}) > 1 else row["perplexity"]


def _change(row: dict, several: bool) -> str:
    if several and len(row.get("domains") or {}) > 1:
        return (
            f"{row['domains_ratio']:.2f}x on the geometric mean, worst {row['worst_domain']} {row['worst_ratio']:.2f}x"
        )
    return f"{100 * row['perplexity_change']:+.1f}%"


def _chosen_text(rows: list[dict], name: str, several: bool) -> str:
    row = next(r for r in rows if r["name"] == name)
    return f"{_heads(row['groups'])} ({row['kv_saving']:g}x smaller KV, {_change(row, several)})"


def _heads(count: int) -> str:
    return f"{count} kv head" + ("" if count == 1 else "s")


def uptrain_command(record: dict, row: dict) -> str:
    """The commands that rebuild `row`'s model (unless --keep kept it) and uptrain it with the shipped recipe,
    on the calibration text, evaluated on the sweep's data, distilled from the parent."""
    settings, source = record["settings"], record["source"]["path"]
    model = row["model"] or f"{row['name']}"
    calibration = settings["calibration"]
    steps = []
    if row["model"] is None:  # the candidate's own convert command, as its dry-run plan wrote it
        convert = shlex.split(record["convert_commands"][row["name"]])
        steps.append([*convert[:3], model, *convert[4:]])
    pretrain = record["source"].get("pretrain_tokens")
    steps.append(
        ["mha2gqa", "uptrain", "--recipe", _shown(UPTRAIN_RECIPE), f"model={model}", f"output_dir={model}-uptrained"]
        + [
            f"data.train=[{','.join(_train_text(calibration))}]",
            f"data.eval=[{','.join(parse_domains(settings['data']).values())}]",
            f"distill.teacher={source}",
        ]
        + ([f"budget.pretrain_tokens={pretrain}"] if pretrain else [])
    )
    return " && ".join(shlex.join(step) for step in steps)


def _train_text(calibration) -> list[str]:
    """What the next step uptrains on: the calibration's text ('austen' as the embedded novels' files); the
    parent's samples are no uptrain data, so a calibration of them alone leaves TRAIN_TEXT for the user's."""
    from mha2gqa.corpus.mix import PARENT, parse_spec

    names = [name for name, _ in parse_spec(calibration) if name != PARENT]
    return [_shown(p) for name in names for p in _as_list(expand_corpus_name(name))] or ["TRAIN_TEXT"]


def _shown(path) -> str:
    """A path as a suggested command shows it: relative to the working folder when inside it (a command
    copied into docs or to another machine does not carry this one's absolute paths)."""
    path = Path(path)
    return os.path.relpath(path) if path.is_absolute() and Path.cwd() in path.parents else str(path)


def pretrain_tokens(source: Path, parameters: int) -> int:
    """The tokens `source` was pretrained on, for the paper's alpha = 5% budget: what its own mha2gqa.json
    says training saw (the embedded model), else a compute-optimal 20 tokens a parameter (Chinchilla), the
    least a pretrained model has seen."""
    trained = [s.get("tokens_seen") for s in provenance.lineage(source) if s.get("stage") == "uptrain"]
    return int(trained[-1]) if trained and isinstance(trained[-1], int) else 20 * parameters


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
