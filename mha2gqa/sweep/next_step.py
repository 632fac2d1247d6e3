"""The command a sweep suggests when no candidate is within the tolerance: rebuild the closest candidate (its
own convert command, unless --keep kept it) and uptrain it with the shipped recipe."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from mha2gqa.corpus.probe import parse_domains
from mha2gqa.records import provenance

UPTRAIN_RECIPE = Path(__file__).resolve().parent.parent / "demo" / "demo-uptrain.yaml"


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
    from mha2gqa.corpus.calibration import text_files

    return [_shown(p) for p in text_files(calibration)] or ["TRAIN_TEXT"]


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
