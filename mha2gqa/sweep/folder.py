"""The sweep's OUT folder and its record: what OUT may hold and needs, sweep.json as it starts, and the sweep
that --resume continues. OUT follows the rule of every output folder (mha2gqa/files/run_folder.py)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from mha2gqa.architecture.layouts import AttentionShape, attention_shape
from mha2gqa.convert.inputs import stats_bytes
from mha2gqa.convert.options import REFINE_TOKENS_PER_HIDDEN, REFINE_TOKENS_PER_HIDDEN_BEFORE, current_refine_fields
from mha2gqa.eval import schema
from mha2gqa.files import jsontext
from mha2gqa.files.reading import read_json
from mha2gqa.files.run_folder import continued_folder, run_folder, validate_folder
from mha2gqa.files.writing import validate_room
from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError
from mha2gqa.sweep.options import SweepOptions
from mha2gqa.sweep.schema import SWEEP_SCHEMA

QUALITY_PNG = "sweep_quality_vs_kv.png"  # the plots report/sweep_plots.py draws into OUT
SENSITIVITY_PNG = "sweep_layer_sensitivity.png"
SCRATCH = ".sweep-"  # OUT/.sweep-PID: the statistics and temporary models of a running sweep
# What a sweep writes into OUT (run_folder's rule: anything else there is the user's and is refused).
RUN_ENTRIES = frozenset({"sweep.json", "sweep.md", "sweep.html", QUALITY_PNG, SENSITIVITY_PNG, "models", SCRATCH + "*"})
# Settings that change a candidate's numbers: a resumed sweep must have the same ones.
SAME_ON_RESUME = ("calibration", "data", "refine", "max_tokens", "calibration_tokens", "seed", "retrieval")


def bytes_needed(plans: dict, shape: AttentionShape, keep: bool) -> int:
    """What OUT must hold at the worst moment: the calibration statistics, and every kept model or the
    largest temporary one (each is removed before the next is written), each with its scratch files (the
    dry run's plan, made from the data, counts statistics there too: an overestimate of one copy)."""
    sizes = [plan.bytes_written + plan.scratch_bytes for plan in plans.values()] or [0]
    statistics = shape.layers * stats_bytes(shape.hidden)
    return statistics + (sum(sizes) if keep else max(sizes)) + (1 << 20)


def require_room(out: Path, needed: int) -> None:
    validate_room(
        out, needed, f"--out {out}", "calibration statistics and converted models; or drop --keep to need less"
    )


def validate_out(out: Path, options: SweepOptions) -> None:
    """OUT by the rule of every output folder (run_folder.validate_folder); with --resume, an OUT holding the
    sweep to continue."""
    if options.resume:
        if not (out / "sweep.json").is_file():
            raise InputError(f"--resume: {out} holds no sweep.json to continue: run without --resume")
    else:
        validate_folder(out, "--out", "sweep", RUN_ENTRIES, options.force)
    schema.validate_writable(out / "sweep.json", "--out")


def open_folder(out: Path, options: SweepOptions):
    if options.resume:
        return continued_folder(out, "--out", scratch=SCRATCH, command="sweep")
    return run_folder(out, "--out", "sweep", RUN_ENTRIES, options.force, scratch=SCRATCH)


def new_record(src, source: Path, config: dict, options: SweepOptions, candidates: list) -> dict:
    """sweep.json as the sweep starts (sweep/schema.py): the source, the settings, the planned candidates."""
    from mha2gqa.eval.environment import versions

    settings = asdict(options)
    settings["refine"] = asdict(options.refine) if options.refine else None
    settings["tokens_per_hidden"] = REFINE_TOKENS_PER_HIDDEN  # what unset token counts meant (earlier_sweep)
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


def earlier_sweep(out: Path, record: dict) -> dict:
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
        if key == "retrieval" and recorded is None:  # a sweep.json from before --retrieval: it ran without
            recorded = False
        if recorded != json.loads(jsontext.dumps(record["settings"][key])):
            flag = "--" + key.replace("_", "-")
            raise InputError(
                f"--resume: {flag} differs from the sweep in {out} (it ran with {found['settings'].get(key)!r}): "
                f"pass the same {flag}, or start a new sweep with --force"
            )
    validate_default_tokens(out, found["settings"], record["settings"])
    return found


def validate_default_tokens(out: Path, recorded: dict, now: dict) -> None:
    """Unset token counts (--calibration-tokens; --refine's tokens, which a sweep does not set) meant
    tokens_per_hidden x hidden when the earlier sweep ran: a sweep.json without the key ran at the default
    before it was recorded. Continuing it under another default would mix candidates fitted on other counts."""
    before = recorded.get("tokens_per_hidden", REFINE_TOKENS_PER_HIDDEN_BEFORE)
    unset = now["calibration_tokens"] is None or (now["refine"] is not None and now["refine"]["tokens"] is None)
    if unset and before != now["tokens_per_hidden"]:
        raise InputError(
            f"--resume: the sweep in {out} ran when unset calibration and --refine token counts meant {before} x "
            f"hidden; they mean {now['tokens_per_hidden']} x hidden now: start a new sweep with --force"
        )


def keep_finished(record: dict, earlier: dict) -> None:
    """The earlier sweep's parent and finished candidates that this run plans, kept in `record`."""
    rows = [r for r in earlier.get("candidates") or [] if isinstance(r, dict) and r.get("name") in record["planned"]]
    parent = earlier.get("parent")
    if isinstance(parent, dict) and isinstance(parent.get("result"), dict):
        record["parent"], record["candidates"], record["calibration"] = parent, rows, earlier.get("calibration")
        record["not_asked"] = earlier.get("not_asked") or []  # checked by trust.trusted, marked asked: false
