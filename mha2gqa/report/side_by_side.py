"""`write_report`: many eval results side by side, as report.md, a self-contained report.html,
report.json (the table's numbers) and PNG plots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import matplotlib

from mha2gqa.eval.reference_result import reference_of
from mha2gqa.eval.schema import validate_writable
from mha2gqa.files import jsontext
from mha2gqa.files.writing import remove_dead, swap_in
from mha2gqa.report import measured_on, plots, render, serving_section
from mha2gqa.report.compare import comparison_rows, pick_baseline
from mha2gqa.report.results import load_results
from mha2gqa.runtime.errors import InputError, user_file_error
from mha2gqa.serving import schema as serve_schema


def _unique_labels(results: list[dict]) -> None:
    """Two results with one label would be indistinguishable in the table: number the repeats."""
    seen: dict[str, int] = {}
    for r in results:
        seen[r["label"]] = seen.get(r["label"], 0) + 1
        if seen[r["label"]] > 1:
            r["label"] = f"{r['label']} ({seen[r['label']]})"


REPORT_FILES = ("report.md", "report.html", "report.json", "quality_vs_kv.png", "speed_vs_batch.png")


def write_report(
    result_paths,
    out_dir,
    baseline: str | None = None,
    metrics=None,
    speedup_apart: bool = False,
    force: bool = False,
) -> dict[str, Path]:
    """Compare the results in `result_paths` (files written by `mha2gqa eval`, or a `mha2gqa sweep` sweep.json:
        its parent and every finished candidate).

        baseline: a label or path among them (default: the first). metrics: an uptrain metrics.jsonl
        (or a list of them) to plot as a training curve. speedup_apart: a speed-up also from speeds timed in
        separate eval runs (warned in the notes); by default only from speeds timed side by side. force: replace an
    earlier report in `out_dir` (without it, one is refused, as convert and eval --out refuse). Returns {name: path} of every file written:
        markdown, html, json, and the plots quality_vs_kv, speed_vs_batch, training_curve* when drawn.
    """
    paths = [str(p) for p in result_paths]
    if not paths:
        raise InputError("report needs at least one results.json (written by `mha2gqa eval --out`)")
    serve_paths = [p for p in paths if serve_schema.is_serve_file(p)]  # serve-bench's files: their own section
    served = [(p, serve_schema.load(p)) for p in serve_paths]
    paths = [p for p in paths if p not in serve_paths]
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {out_dir} is a file: pass a directory for the report")
    _validate_no_earlier_report(out_dir, force)
    loaded = [(p, result) for p in paths for result in load_results(p)]  # a sweep.json holds many results
    paths, results = [p for p, _ in loaded], [r for _, r in loaded]
    reference = reference_of(results[0]) if len(results) == 1 else None
    if reference is not None:  # one result: compared with its own reference, never with itself
        results, paths = [reference, *results], [f"{paths[0]} (its reference's numbers)", *paths]
    base = pick_baseline(results, paths, baseline) if results else None
    metric_paths = [] if metrics is None else [metrics] if isinstance(metrics, (str, Path)) else list(metrics)
    for m in metric_paths:
        plots.read_metrics(m)  # refuse a bad file before anything is written
    _unique_labels(results)
    rows, meta = comparison_rows(results, base, speedup_apart) if results else ([], {})

    validate_writable(out_dir / "report.json", "--out")  # read-only or full: say so before drawing anything
    # Drawn in a staging folder beside --out, then moved in: a failure leaves no half report, no PNG.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name[:100]}.partial-{os.getpid()}"
    remove_dead(out_dir.parent, f".{out_dir.name[:100]}.partial-")  # a killed report's staging (kill -9)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        # Labels are text, never mathtext: a model named "$\\frac{" must not be parsed by matplotlib.
        with matplotlib.rc_context({"text.parse_math": False}):
            written = _write(staging, rows, meta, results, paths, metric_paths, (base, speedup_apart), served)
        if out_dir.exists():
            swap_in(staging, out_dir, files_first="*.png", files_last=("report.json",))
        else:
            swap_in(staging, out_dir)
    except OSError as err:  # the disk filled up mid-way: one line
        raise user_file_error(err, out_dir) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: out_dir / path.name for name, path in written.items()}


def _validate_no_earlier_report(out_dir: Path, force: bool) -> None:
    """An earlier report's files in `out_dir` are replaced only with --force: a second report into the same
    folder silently overwrote the first one's tables and plots."""
    if force or not out_dir.is_dir():
        return
    found = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name in REPORT_FILES or p.match("training_curve*.png") or p.match("serving_throughput*.png")
    )
    if found:
        raise InputError(
            f"--out {out_dir} holds an earlier report ({', '.join(found)}): pass --force to replace it, "
            "or choose another --out"
        )


def _write(out_dir: Path, rows, meta, results, paths, metric_paths, speed: tuple[int, bool], served) -> dict[str, Path]:
    """speed: (the baseline's index, --speedup-apart), what the speed plot compares by, as the table does;
    served: the serve-bench results, their own section."""
    drawn = {
        "quality_vs_kv": plots.quality_vs_kv(rows, out_dir / "quality_vs_kv.png", measured_on.perplexity(results)),
        "speed_vs_batch": plots.speed_vs_batch(results, out_dir / "speed_vs_batch.png", *speed),
    }
    for i, m in enumerate(metric_paths):
        name = "training_curve" if len(metric_paths) == 1 else f"training_curve_{i + 1}"
        drawn[name] = plots.training_curve(Path(m), out_dir / f"{name}.png")
    drawn = {k: v for k, v in drawn.items() if v is not None}
    written = {
        "markdown": out_dir / "report.md",
        "html": out_dir / "report.html",
        "json": out_dir / "report.json",
    }
    serving_md, serving_html, serving_drawn = serving_section.sections([found for _, found in served], out_dir)
    page = render.html_page(rows, meta, results, drawn) if results else render.empty_page()
    written["markdown"].write_text(
        (render.markdown(rows, meta, results, drawn, out_dir) if results else render.HEADING) + serving_md
    )
    written["html"].write_text(page.replace("</body>", serving_html + "</body>"))
    record = {**meta, "rows": rows, "results": paths, "serving": [path for path, _ in served]}
    written["json"].write_text(jsontext.dumps(record, indent=2) + "\n")
    return {**written, **drawn, **serving_drawn}
