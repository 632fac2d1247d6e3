"""`convert --config FILE`: convert's options as a YAML file, and the convert.yaml written beside each conversion.

The file's keys are the flags' names as click names their parameters (options.CONVERT_FLAGS' Flag.key:
--refine-steps is `refine_steps`; the hyphenated form is refused with the key to write), plus `source` and
`destination` for SRC and DST. Each value is handed to click as the word(s) the command line would carry
(`groups: 8` -> "8", `calibration: [a, b]` -> two --calibration values), through the command's default_map, so
the file's values meet the flags' own types and checks with the flags' own messages, and a flag given on the
command line overrides the file's value. What can be told from the file alone (its size, its YAML, its keys, a
value's shape) is refused here, in one line, before anything is read or written and before torch is imported.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import yaml

from mha2gqa.convert.options import CONVERT_FLAGS, ConvertOptions, Flag, changed_flags
from mha2gqa.corpus.mix import PARENT, as_words, renamed
from mha2gqa.files.embedded import CORPUS_NAME
from mha2gqa.files.reading import read_yaml_mapping
from mha2gqa.runtime.errors import InputError

CONFIG_NAME = "convert.yaml"  # written into every converted folder (run.execute)
MAX_CONFIG_BYTES = 64 << 10  # every option at once is under 1 KB; a larger file is not a convert config
FLAGS = {flag.key: flag for flag in CONVERT_FLAGS}
PATHS = {"source": "SRC", "destination": "DST"}
_FIX = "a convert config is a mapping of option: value (e.g. groups: 2), see docs/convert.md#a-config-file"


@dataclass
class ConvertConfig:
    """A read config file: `defaults` maps each Flag.key the file sets to the command-line word(s) of its
    value (click's default_map); source and destination are SRC and DST when the file names them."""

    path: Path
    defaults: dict[str, str | list[str]] = field(default_factory=dict)
    source: str | None = None
    destination: str | None = None


def read_config(path: str | os.PathLike) -> ConvertConfig:
    """The config file at `path`, refused in one line when it is missing, too large, not YAML, not a mapping,
    or holds an unknown key or a value of the wrong shape (every such problem named together)."""
    path = Path(path)
    raw = _load(path)
    config, problems = ConvertConfig(path), []
    for key, value in raw.items():
        key = str(key)
        if key in PATHS:
            if isinstance(value, (dict, list)) or value is None:
                problems.append(f"{key}: must be one path or hub id ({PATHS[key]} on the command line)")
            else:
                setattr(config, key, str(value))
        elif key in FLAGS:
            words = _words(FLAGS[key], key, value, problems)
            if words is not None:
                config.defaults[key] = words
        else:
            problems.append(_unknown(key))
    if problems:
        raise InputError(f"--config {path}: " + "; ".join(problems))
    return config


def _load(path: Path) -> dict:
    size_fix = "every option at once is under 1 KB of YAML: check that it is the config you meant"
    return read_yaml_mapping(path, f"--config {path}", "a convert config", MAX_CONFIG_BYTES, size_fix, _FIX)


def _words(flag: Flag, key: str, value, problems: list[str]) -> str | list[str] | None:
    """`value` as the word(s) the command line gives click for `flag` (None: a problem, appended)."""
    if flag.repeat:  # a list, one value, or a {source: share} mix as in Python
        try:  # a {source: share} mapping, or YAML's `[a.txt: 0.5]` (a list of one-entry mappings), as words
            value = as_words(value, key)
        except InputError as err:
            problems.append(str(err))
            return None
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) or v is None for v in values):
            problems.append(f"{key}: give a list of values, each as one {flag.flag} takes it")
            return None
        return [_word(v) for v in values]
    if isinstance(value, (dict, list)):
        problems.append(f"{key}: {flag.flag} takes one value, not a {type(value).__name__}")
        return None
    if value is None:
        problems.append(f"{key}: has no value: give one as {flag.flag} takes it, or leave the key out")
        return None
    if flag.switch and not isinstance(value, bool):  # click would read "yes", "on", "1", "" alike
        problems.append(f"{key}: {value!r} is not true or false ({flag.flag} is a switch)")
        return None
    return _word(value)


def _word(value) -> str:
    """A YAML scalar as it is typed on the command line: true/false for a switch (click's boolean words), a
    float by its repr (it round-trips); 8.5 for an integer flag stays 8.5, so the flag's type refuses it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _unknown(key: str) -> str:
    """An unknown key, named with the closest key (refine-steps -> refine_steps)."""
    keys = [*FLAGS, *PATHS]
    close = difflib.get_close_matches(key.replace("-", "_").lstrip("_"), keys, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (
        f"unknown key {key!r}{hint}: the keys are convert's flags with underscores (refine_steps for "
        "--refine-steps), plus source and destination; see 'mha2gqa convert --help'"
    )


def paths(src: str | None, dst: str | None, config: ConvertConfig | None) -> tuple[str, str]:
    """SRC and DST: the command line's, else the file's. One path alone on the command line is DST when the
    file names the source (mergekit's habit: the file names the models, the command line the output)."""
    given = [p for p in (src, dst) if p is not None]
    source, destination = (config.source, config.destination) if config else (None, None)
    if len(given) == 1 and source is not None and destination is not None:
        raise InputError(
            f"convert got one path ({given[0]}) and --config {config.path} names both source and destination: "
            "give both SRC and DST to replace them, or neither"
        )
    if len(given) == 1:
        given = [source, given[0]] if source is not None else [given[0], destination]
    elif not given:
        given = [source, destination]
    for name, value in zip(PATHS.values(), given):
        if value is None:
            where = (
                f", or as {'source' if name == 'SRC' else 'destination'}: in --config {config.path}" if config else ""
            )
            raise InputError(f"convert needs {name}: give it on the command line (mha2gqa convert SRC DST ...){where}")
    return given[0], given[1]


def values(options: ConvertOptions) -> dict:
    """The config file's mapping of `options`: every option that changes the output and is not at its default
    (the same set as the command line of the card's Reproduce line), each as YAML writes it plainly."""
    out = {}
    for flag, value in changed_flags(options):
        if isinstance(value, Enum):
            value = value.value
        if flag.repeat:
            value = list(value) if isinstance(value, (list, tuple)) else [value]
        out[flag.key] = value
    return out


def anywhere(config: dict) -> dict:
    """`config` (values' mapping plus source) with every local path made absolute: the source folder and each
    calibration file or folder, so that DST/convert.yaml replays from DST, or from any other folder, as it
    did where it was written. A hub id, a hub dataset, `parent` and `austen` stay as they are."""
    out = {**config, "source": _absolute(config["source"])}
    if out.get("calibration") is not None:
        out["calibration"] = renamed(out["calibration"], _absolute, "calibration")
    return out


def _absolute(entry: str) -> str:
    """An existing local path, absolute (symbolic links kept, as typed); anything else as it is."""
    if entry in (PARENT, CORPUS_NAME) or not Path(entry).expanduser().exists():
        return entry
    return os.path.abspath(Path(entry).expanduser())


def render(config: dict) -> str:
    """convert.yaml's text: the command that runs it, then the mapping (source: SRC as it was converted)."""
    header = (
        f"# mha2gqa convert --config {CONFIG_NAME} DST\n"
        "# (or SRC DST for another source; a flag on the command line replaces its key's value)\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)
