"""The probe set: small texts of several domains shipped in the package (mha2gqa/data/probe/, licences in
its PROVENANCE.md), the default --data of `eval` and `sweep`; and how --data names several texts.

A conversion fits its calibration text; the probe set measures what it kept elsewhere. It is never part
of a calibration: the prose is Persuasion, the novel the `austen` corpus and the embedded model hold out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from mha2gqa.corpus.reserved import warn_if_shadowing
from mha2gqa.runtime.errors import InputError

PROBE = "probe"  # what a user types for the whole set (--data probe, the default)
PROBE_DIR = Path(__file__).resolve().parent.parent / "data" / "probe"
DOMAINS = ("prose", "code", "python_docs", "licences")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,39}")
NAME_RULE = "a domain name starts with a letter, then letters, digits, _ or -, at most 40 characters (e.g. code)"


def probe_paths() -> dict[str, str]:
    """{domain: path of its compressed text}, in DOMAINS order."""
    return {name: str(PROBE_DIR / f"{name}.txt.gz") for name in DOMAINS}


def _default_name(spec: str) -> str:
    """A text's name when none is given: its file name without suffixes (held.txt.gz -> held), or the
    hub dataset's last part."""
    name = Path(spec.rstrip("/")).name.split(".")[0]
    return name if _NAME.fullmatch(name) else "data"


def _split(spec: str, flag: str) -> tuple[str | None, str]:
    """'name=path' -> (name, path). A spec is all path when it is an existing path (a file whose own name
    holds '='), when it starts with ./, ../, / or ~, or when '/' comes before its first '='; otherwise what
    precedes the first '=' is a domain name, and one that breaks NAME_RULE is refused as a bad name."""
    head, sep, tail = spec.partition("=")
    if not sep or "/" in head or spec.startswith("~") or Path(spec).expanduser().exists():
        return None, spec
    if not _NAME.fullmatch(head):
        shown = repr(head) if head else "the name before '=' is empty:"
        raise InputError(
            f"{flag} {spec}: {shown}{' is not a domain name:' if head else ''} {NAME_RULE}; a path that holds "
            f"'=' is read whole when it exists, or when written ./{spec}"
        )
    if not tail:
        raise InputError(f"{flag} {spec}: names no text after '=': give NAME=PATH, e.g. {flag} {head}=held_out.txt")
    return head, tail


def parse_domains(data, flag: str = "--data") -> dict[str, str] | None:
    """The named texts of --data: None (nothing to score), a path or name, 'probe' (the probe set's
    domains), 'name=path', a list of those, or a {name: path} mapping. Two texts with one name are
    refused: each domain's numbers are reported under its name."""
    if data is None or data == "" or data == () or data == []:
        return None
    if isinstance(data, Mapping):
        items = [(str(k), str(v)) for k, v in data.items()]
    else:
        items = []
        for spec in [data] if isinstance(data, (str, Path)) else list(data):
            if str(spec) == PROBE:
                warn_if_shadowing(PROBE, flag, "the probe set shipped in the package")
                items += list(probe_paths().items())
                continue
            name, path = _split(str(spec), flag)
            items.append((name or _default_name(path), path))
    found: dict[str, str] = {}
    for name, path in items:
        if not _NAME.fullmatch(name):
            raise InputError(f"{flag} {name}={path}: {name!r} is not a domain name: {NAME_RULE}")
        if name in found:
            raise InputError(
                f"{flag}: two texts are named {name!r} ({found[name]} and {path}): name each, e.g. "
                f"{flag} {name}={found[name]} {flag} {name}2={path}"
            )
        found[name] = path
    return found
