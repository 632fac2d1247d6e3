"""What a recipe's data entries are: local files of one format, or one hub dataset name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mha2gqa.sources import hub_offline

# File suffix -> the `datasets` builder that reads it. Compressed variants are read transparently.
BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


@dataclass(frozen=True)
class DataSource:
    """Either `builder` + `files` (local) or `hub` (a dataset name on the Hugging Face hub)."""

    builder: str | None = None
    files: tuple[str, ...] = ()
    hub: str | None = None


def _builder(path: Path) -> str | None:
    suffixes = [s for s in path.suffixes if s not in COMPRESSIONS]
    return BUILDERS.get(suffixes[-1].lower()) if suffixes else None


def _looks_local(entry: str) -> bool:
    """A missing path the user meant as a file (so 'no such file', not 'unknown hub dataset')."""
    return entry.startswith((".", "/", "~")) or _builder(Path(entry)) is not None


def classify(key: str, entries: list[str], problems: list[str], check_files: bool = True) -> DataSource | None:
    """Resolve data entries to a DataSource, appending one message per problem (each naming `key`)."""
    if not entries:
        problems.append(f"{key} is empty: give a file, a folder or a hub dataset name")
        return None
    files: list[str] = []
    for entry in entries:
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and _builder(p))
            if not found:
                problems.append(f"{key}: folder {entry} holds no {'/'.join(sorted(BUILDERS))} files")
            files += found
        elif path.is_file():
            if _builder(path) is None:
                problems.append(f"{key}: {entry} has an unknown suffix (use one of {', '.join(sorted(BUILDERS))})")
            files.append(str(path))
        elif not check_files:
            if _looks_local(entry):
                files.append(str(path))
            elif len(entries) == 1:
                return DataSource(hub=entry)
        elif _looks_local(entry):
            problems.append(f"{key}: no such file or folder {entry}")
        elif len(entries) > 1:
            problems.append(f"{key}: {entry} is neither a local path nor usable as a hub name among several entries")
        elif hub_offline():
            problems.append(f"{key}: {entry} is not a local path and the hub is offline (HF_HUB_OFFLINE=1): pass local files")
        else:
            return DataSource(hub=entry)
    builders = {_builder(Path(f)) for f in files} - {None}
    if len(builders) > 1:
        problems.append(f"{key} mixes formats ({', '.join(sorted(builders))}): use files of one format")
        return None
    return DataSource(builder=builders.pop(), files=tuple(files)) if builders else None
