"""The one owner of `mha2gqa.json`, the record beside every model this tool writes: what made it,
from what. `convert` and `uptrain` append a stage; `eval` reads the model's role from it.

File schema ("mha2gqa.records.provenance/2"):
  schema    "mha2gqa.records.provenance/2"
  tool      "mha2gqa"
  lineage   [stage, ...], oldest first: the source's lineage, then the stage that wrote this model
Every stage:
  stage     "conversion" | "uptrain"
  version   mha2gqa version that ran it
  date      UTC, ISO 8601, seconds
  ...       the stage's own fields:
            conversion: source, source_config_sha256, model_type, method, groups, source_kv_heads,
                        heads, seed, dtype, grouping, calibration, layers (per-layer errors)
            uptrain:    recipe (as resolved), source, steps, tokens_seen, tokens_per_step, world_size,
                        trainable_params, saved_dtype, resumed_from_step, final_eval_loss, final_eval_ppl

The one chaining rule: a stage's file holds its source's whole lineage plus the new stage, so the
history parent -> converted -> uptrained reads back as a list from the newest model alone.

Files written before this schema are still read (`lineage` turns them into the same list): the
converter wrote {"tool", "version", "conversion": {...}, "parent_provenance": <the source's file>},
the uptrain loop carried the source's keys forward and added {"uptrain": {..., "previous": <the
source's uptrain record>, "mha2gqa_version"}} (the embedded model's file is of this kind).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from mha2gqa.files import jsontext
from mha2gqa.files.reading import read_json
from mha2gqa.files.writing import write_atomic
from mha2gqa.runtime.errors import InputError
from mha2gqa.version import __version__

FILE_NAME = "mha2gqa.json"
SCHEMA = "mha2gqa.records.provenance/2"
STAGES = ("conversion", "uptrain")
ROLES = ("parent", "converted", "uptrained")


def read(model_dir: str | os.PathLike) -> dict | None:
    """MODEL_DIR/mha2gqa.json as stored (any schema), or None when the model has none."""
    path = Path(model_dir) / FILE_NAME
    if not os.path.lexists(path):
        return None
    data = read_json(path, "fix it, or delete it (it only records how the model was made)", root=Path(model_dir))
    if not isinstance(data, dict):
        raise InputError(
            f"{path} is a JSON {type(data).__name__}, not an object: fix it, or delete it "
            "(it only records how the model was made)"
        )
    return data


def lineage(model_dir: str | os.PathLike) -> list[dict]:
    """Every stage that made MODEL_DIR, oldest first ([] for a model without mha2gqa.json)."""
    return lineage_of(read(model_dir))


def lineage_of(record: dict | None) -> list[dict]:
    """The stages of a file's content (either schema), oldest first."""
    if record is None:
        return []
    if "lineage" not in record:
        return _legacy_lineage(record)
    stages = record["lineage"]
    if not isinstance(stages, list) or not all(isinstance(s, dict) and s.get("stage") in STAGES for s in stages):
        raise InputError(
            f"{FILE_NAME}: 'lineage' must be a list of stages, each with a 'stage' of "
            f"{', '.join(STAGES)}: fix it, or delete it (it only records how the model was made)"
        )
    return [dict(stage) for stage in stages]


def latest(model_dir: str | os.PathLike, stage: str) -> dict | None:
    """The newest record of one kind of stage ("conversion" or "uptrain"), or None."""
    return next((s for s in reversed(lineage(model_dir)) if s["stage"] == stage), None)


def role(model_dir: str | os.PathLike) -> str:
    """parent | converted | uptrained, from the lineage."""
    return role_of(read(model_dir))


def role_of(record: dict | None) -> str:
    """A model never converted is a parent (also one `mha2gqa uptrain` pretrained from scratch, like
    the embedded default); after its last conversion, trained -> uptrained, else converted."""
    kinds = [s["stage"] for s in lineage_of(record)]
    if "conversion" not in kinds:
        return "parent"
    last = len(kinds) - 1 - kinds[::-1].index("conversion")
    return "uptrained" if "uptrain" in kinds[last + 1 :] else "converted"


def append(out_dir: str | os.PathLike, stage: str, fields: dict, source: str | os.PathLike | None = None) -> dict:
    """Write OUT_DIR/mha2gqa.json: SOURCE's lineage (none for a model made from scratch) plus this
    stage. Atomic (a reader never sees half a file); returns what was written."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {STAGES}")
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {"schema": SCHEMA, "tool": "mha2gqa", "lineage": lineage(source) if source is not None else []}
    record["lineage"].append({"stage": stage, "version": __version__, "date": now, **fields})
    path = Path(out_dir) / FILE_NAME
    write_atomic(path, jsontext.dumps(record, indent=2) + "\n")
    return record


def _legacy_lineage(record: dict) -> list[dict]:
    """Before schema 2: convert nested the source's file under parent_provenance; uptrain carried the
    source's keys forward and nested the source's uptrain record under uptrain.previous. A carried
    conversion always precedes the uptrain chain beside it (convert writes no uptrain key)."""
    parent = record.get("parent_provenance")
    stages = _legacy_lineage(parent) if isinstance(parent, dict) else []
    if isinstance(record.get("conversion"), dict):
        stages.append({"stage": "conversion", "version": record.get("version"), **record["conversion"]})
    chain, uptrain = [], record.get("uptrain")
    while isinstance(uptrain, dict):
        chain.append(uptrain)
        uptrain = uptrain.get("previous")
    for old in reversed(chain):
        fields = {k: v for k, v in old.items() if k not in ("previous", "mha2gqa_version")}
        stages.append({"stage": "uptrain", "version": old.get("mha2gqa_version"), **fields})
    return stages
