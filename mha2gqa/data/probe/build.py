"""Rebuild the probe set from the files it was taken from (PROVENANCE.md says which and under what
licence): `python mha2gqa/data/probe/build.py` on CPython 3.11.7 with Debian's base-files licences
gives the same bytes (gzip without name or time). Not imported by the package."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = 80_000  # characters a part aims at (each is cut at a blank line past it, or taken whole)
STDLIB_MODULES = ("textwrap", "heapq", "bisect", "fractions")
LICENCES = ("GPL-3", "Apache-2.0", "MPL-2.0")


def cut(text: str, target: int = TARGET) -> str:
    """The text up to the first blank line after `target` characters (all of it when shorter)."""
    end = text.find("\n\n", target)
    return text if end < 0 else text[:end] + "\n"


def prose() -> str:
    """Persuasion from its first chapter: the novel the embedded model and the `austen` corpus hold out."""
    novel = gzip.decompress((HERE.parent / "austen" / "persuasion.txt.gz").read_bytes()).decode("utf-8")
    return cut(novel[novel.index("Chapter 1") :])


def code() -> str:
    """CPython standard-library modules, whole, one after another."""
    parts = []
    for name in STDLIB_MODULES:
        path = Path(importlib.util.find_spec(name).origin)
        parts.append(f"# {name}.py (CPython {sys.version.split()[0]})\n" + path.read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def python_docs() -> str:
    """The language reference topics `help()` shows (pydoc_data.topics), in name order."""
    from pydoc_data.topics import topics

    return cut("\n\n".join(topics[name].strip() + "\n" for name in sorted(topics)))


def licences() -> str:
    """Technical prose: free-software licence texts, verbatim."""
    return "\n\n".join(Path("/usr/share/common-licenses", name).read_text(encoding="utf-8") for name in LICENCES)


PARTS = {"prose": prose, "code": code, "python_docs": python_docs, "licences": licences}


def main() -> None:
    for name, make in PARTS.items():
        data = make().encode("utf-8")
        (HERE / f"{name}.txt.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
        print(f"{name}.txt.gz  {len(data)} bytes  {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
