"""`sweep`: which kv-head count (and method) to pick, answered before any training.

Every candidate (kv-head count x method, and --kv-budgets value x method) is checked and planned by convert
itself (a dry run, candidates.py) before anything is written; then the parent is evaluated once, the calibration
statistics are gathered once from the calibration the plans resolved (and the budgets' layer losses once per
merge, budgets.py), and each candidate is converted with them, evaluated against the parent and, unless --keep,
removed. sweep.json is rewritten after every candidate, so an interrupted sweep keeps the candidates it finished;
the temporary models live inside OUT and go with it on any exit. This module runs those steps in order; folder.py
holds OUT and its record (and --resume), recommend.py and next_step.py the answer; the pages are the report's
(report/sweep_pages.py), written by the `pages` the caller passes.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

from mha2gqa.architecture.layouts import attention_shape, read_config
from mha2gqa.corpus import textdata
from mha2gqa.corpus.probe import PROBE, parse_domains
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.estimates.stages import SWEEP
from mha2gqa.eval.schema import write_result
from mha2gqa.files.run_folder import scratch_folder
from mha2gqa.files.sources import resolve_model_dir
from mha2gqa.runtime.progress import progress_bar
from mha2gqa.sweep import folder as out_folder
from mha2gqa.sweep.budgets import SharedLosses, validate_budgets
from mha2gqa.sweep.candidates import (
    Candidate,
    eval_options,
    kv_head_counts,
    measure_candidate,
    parent_row,
    plan_candidates,
)
from mha2gqa.sweep.next_step import pretrain_tokens
from mha2gqa.sweep.options import SweepOptions
from mha2gqa.sweep.recommend import recommend
from mha2gqa.sweep.timing import sweep_clock
from mha2gqa.sweep.trust import trusted


def sweep(src, options: SweepOptions, echo=print, pages=None) -> dict:
    """Run the sweep of `options` on the model at `src`; returns the record written to OUT/sweep.json.
    Every refusal (groups, methods, data, OUT, room) comes before anything is written. OUT follows the
    rule of every output folder (mha2gqa/files/run_folder.py): until the first candidate is recorded, a failure
    or a kill leaves what was there before; after it, sweep.json keeps the finished candidates. `pages(record, out)`
    runs once sweep.json is final, at the end or when interrupted: the caller's page writer (the cli passes
    report/sweep_pages.write_pages; the sweep sits below the report and writes only sweep.json)."""
    source = resolve_model_dir(src)
    config = read_config(source)
    shape = attention_shape(config)
    candidates = [Candidate(g, m) for g in kv_head_counts(shape, options.groups, echo) for m in options.methods]
    validate_budgets(options.kv_budgets or (), shape, config)
    budgets = dict.fromkeys(options.kv_budgets or ())
    candidates += [Candidate(None, m, b) for b in budgets for m in options.methods]
    out = Path(options.out).expanduser()
    for path in parse_domains(options.data).values():
        textdata.resolve("--data", path)
    out_folder.validate_out(out, options)
    record = out_folder.new_record(src, source, config, options, candidates)
    earlier = out_folder.earlier_sweep(out, record) if options.resume else None
    if earlier is not None:  # only what it can check: a row that does not hold is run again
        earlier = trusted(earlier, record["planned"], shape, record["context"], echo)
    done = {r.get("name") for r in (earlier or {}).get("candidates") or [] if isinstance(r, dict)}
    # What is left to convert (a resumed sweep's finished models are not planned again); the first plan
    # resolves the calibration and its token count (unset: the default of the calibration's kind).
    todo = [c for c in candidates if c.name not in done]
    plans = plan_candidates(source, todo, options, out / "models")
    if plans:
        first = next(iter(plans.values()))
        options = replace(options, calibration_tokens=first.calibration.tokens)
        parameters = sum(math.prod(info.shape) for info in first.checkpoint.tensors.values())
        record["source"]["pretrain_tokens"] = pretrain_tokens(source, parameters)
    record["convert_commands"] = {  # the cards' Reproduce lines (a resumed sweep's finished ones: as it wrote them)
        **(earlier or {}).get("convert_commands", {}),
        **{c.name: plan.command() for c, plan in plans.items()},
    }
    priced = {c.name: plan for c, plan in plans.items()}
    needed = out_folder.bytes_needed(priced, shape, options.keep)
    out_folder.require_room(out, needed)
    domains = list(parse_domains(options.data).values())
    budget_plans = [plan for c, plan in plans.items() if c.budget is not None]
    statistics = needs_statistics(plans, options)
    clock = sweep_clock(priced, domains, options, echo, budget_plans, statistics) if priced else NO_CLOCK
    if options.dry_run:
        echo(f"would sweep {len(priced)} candidates into {out}: {', '.join(priced) or 'none left'}")
        echo(f"  {out} needs {needed / 2**20:,.1f} MiB at the worst moment (statistics and converted models)")
        return record
    _run(source, options, candidates, plans, record, earlier, out, echo, clock, pages)
    return record


def needs_statistics(candidates, options: SweepOptions) -> bool:
    """Whether the sweep gathers calibration statistics: for any uniform candidate (their reconstruction errors
    are the report's), any calibrated or similarity merge and any refine; a sweep of mean budget candidates alone
    reads its calibration text for the layer losses only."""
    return options.refine is not None or any(c.budget is None or c.method != "mean" for c in candidates)


def _run(source, options, candidates, plans, record, earlier, out: Path, echo, clock=NO_CLOCK, pages=None) -> None:
    """The measuring part, inside OUT's folder: kept whole when it finishes, the finished candidates kept when
    it is interrupted after the first, nothing kept before it."""
    started = time.perf_counter()
    with out_folder.open_folder(out, options) as folder:
        if earlier is not None:
            out_folder.keep_finished(record, earlier)
            echo(f"sweep: resuming {out}: {len(record['candidates'])} of {len(candidates)} candidates already finished")
        try:
            with scratch_folder(out, out_folder.SCRATCH) as work:
                run = (work, started, echo, folder.commit, clock)
                _measure(source, options, candidates, plans, record, out, run)
        except KeyboardInterrupt:
            _interrupted(record, out, len(candidates), folder, echo, pages)
            raise
        record["interrupted"] = False
        record["wall_s"] = round(time.perf_counter() - started, 2)
        folder.commit()
        _finish(record, out, pages)
    clock.finish()


def _interrupted(record: dict, out: Path, total: int, folder, echo, pages=None) -> None:
    """A sweep stopped by Ctrl-C or a signal: the finished candidates are kept in sweep.json (committed),
    unless none had run, when the folder goes back to what it was."""
    if record["parent"] is None:  # nothing measured yet: the folder goes back to what it was
        echo("\nsweep interrupted before any candidate ran: nothing written")
        return
    record["interrupted"] = True
    folder.commit()
    _finish(record, out, pages)
    echo(
        f"\nsweep interrupted: {out / 'sweep.json'} keeps the {len(record['candidates'])} of "
        f"{total} candidates that finished (continue with --resume); no temporary model is left"
    )


def _measure_parent(source, options: SweepOptions, record: dict, count: int, echo) -> None:
    """The parent, once (unless a resumed sweep measured it): every candidate is compared with it."""
    from mha2gqa.eval.run import evaluate

    echo(f"sweep: {count} candidates; evaluating the parent on {data_words(options.data)}")
    # With bars (time left): the parent's evaluation and the calibration pass can take many minutes.
    parent = evaluate(source, options=replace(eval_options(options, "parent", "parent"), progress=options.progress))
    record["parent"] = parent_row(parent, record["context"])


def _gather_statistics(plan, options: SweepOptions, out_dir: Path):
    """The one calibration pass of the sweep, from the calibration its plans resolved: every candidate's
    conversion reads these statistics."""
    from mha2gqa.convert.calibration import statistics

    out_dir.mkdir()
    where = (plan.layout, plan.shape, out_dir, plan.decided.device, plan.calibration_memory)
    return statistics(plan.calibration, plan.source, *where, options.progress, options.seed)


def _measure(source, options, candidates, plans, record, out: Path, run: tuple):
    """The parent, the statistics once, then every candidate not finished yet; sweep.json is rewritten after
    each, and from the first one on it is the sweep that stays (`commit`). run: (scratch folder, start time,
    echo, commit, the estimates clock)."""
    work, started, echo, commit, clock = run
    if record["parent"] is None:
        clock.stage(SWEEP.evaluate_parent.name)
        _measure_parent(source, options, record, len(candidates), echo)
    done = {row["name"] for row in record["candidates"]}
    todo = [c for c in candidates if c.name not in done]
    if not todo:
        return
    plans = {**plans, **plan_candidates(source, [c for c in todo if c not in plans], options, out / "models")}
    stats, calibration = None, None
    if needs_statistics(todo, options):
        plan = plans[todo[0]]
        calibration = plan.calibration
        echo(f"sweep: gathering calibration statistics once ({options.calibration_tokens:,} tokens)")
        clock.stage(SWEEP.calibrate.name)
        stats = _gather_statistics(plan, options, work / "calibration")
        record["calibration"] = stats.record
    losses = SharedLosses([plans[c] for c in todo if c.budget is not None], stats)
    models_dir = out / "models" if options.keep else work
    if options.keep:
        models_dir.mkdir(exist_ok=True)
    parent, context = record["parent"]["result"], record["context"]
    with progress_bar(len(todo), "sweep", options.progress, todo, unit="candidate") as bar:
        for candidate in bar:
            bar.set_postfix_str(candidate.name)
            if candidate.budget is not None and not losses.measured:
                echo(
                    "sweep: measuring each layer's loss at each kv-head count, once per merge for every --kv-budgets value"
                )
                clock.stage(SWEEP.layer_losses.name)
                losses.get(plans[candidate])
            clock.stage(SWEEP.candidate.member(candidate.name))
            shared = (stats, calibration, losses.get(plans[candidate]) if candidate.budget is not None else None)
            row = measure_candidate(source, candidate, options, shared, models_dir, parent, context)
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


def _finish(record: dict, out: Path, pages=None) -> None:
    record["recommendation"] = recommend(record)
    write_result(record, out / "sweep.json")
    if pages is not None:
        pages(record, out)
