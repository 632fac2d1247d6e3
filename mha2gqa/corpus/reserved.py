"""Names the text notations reserve: `parent` (text sampled from the model) and `austen` (the embedded
novels) in a mix (mix.py), `probe` (the probe set) in --data (probe.py). A reserved name means what the
tool says even where a file or folder of that name lies in the working folder, so that a command reads
the same on every machine; that path is never read silently in its place: one warning line names it and
says how to read it (`./parent`)."""

from __future__ import annotations

import warnings
from pathlib import Path

from mha2gqa.runtime.errors import InputWarning


def warn_if_shadowing(name: str, flag: str, meaning: str) -> None:
    """One warning line when the reserved `name` is also a path in the working folder."""
    path = Path(name)
    if not (path.exists() or path.is_symlink()):
        return
    kind = "folder" if path.is_dir() else "file"
    warnings.warn(
        f"{flag} {name} means {meaning} (a name mha2gqa reserves), not ./{name} in the working folder: to read "
        f"that {kind}, write ./{name}",
        InputWarning,
        stacklevel=3,
    )
