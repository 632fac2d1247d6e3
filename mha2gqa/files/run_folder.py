"""The one rule for an output folder that a command fills in place (demo, reproduce, sweep's OUT).

These commands cannot build their folder aside and rename it at the end as convert does: their stages
record the final paths in what they write (results name their model, the card its results). So:

- validate_folder (torch-free, part of every plan step): OUT is not `.`, `..` or the home folder, not a
  link or a file, and holds nothing but what this command writes. A user's file there is never
  overwritten, moved or deleted, with or without --force; an earlier run of the command is replaced
  only with --force. An earlier run is known by the MARKER file every run writes first into OUT, naming
  its command: files that only carry the names a run writes (a user's own ablations.md) are not one,
  and --force is never offered for them. A folder marked by another command is called that command's run
  (a demo's folder is never "an earlier sweep run") and is not replaced by this one, --force or not; a
  MARKER that no run wrote (a folder, a long file) is a user's file.
- run_folder: under the output's lock (writing.claim, with the PID), an earlier run is moved aside to
  `.OUT.replaced-PID` (or, where OUT held nothing, an empty `.OUT.created-PID` marks it as new) before
  anything is written. `commit()` makes the new run the one that stays (the earlier one is deleted);
  any failure or interruption before it removes the new files and puts the earlier run back.
- A run killed with -9 leaves those markers: the next start of any of these commands on the same OUT
  restores the earlier run (or removes the half-made new one) for every marker whose PID is gone.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path

from mha2gqa.files.reading import resolve
from mha2gqa.files.writing import beside, claim, dead_entries, make_parents, remove_dead, validate_room
from mha2gqa.runtime.errors import InputError, is_user_fault, one_line, user_file_error

_REPLACED, _CREATED, _OLD = "replaced", "created", "old"
MARKER = ".mha2gqa-run"  # written first into OUT by every run, holding the command's name


def validate_folder(out: Path, flag: str, command: str, entries, force: bool) -> Path:
    """Refuse an OUT that a run of `command` may not fill; `entries` are the names it writes there (a
    name ending in '*' is a prefix). What killed runs left beside OUT is undone first (recover), so that
    OUT is judged by what it held before them. Returns OUT with `~` expanded."""
    out = Path(out).expanduser()
    if out.is_symlink():
        raise InputError(f"{flag} {out} is a symbolic link (to {os.readlink(out)}): pass the folder it points to")
    if out.name in ("", ".", "..") or resolve(out) == resolve(Path.home()):
        raise InputError(f"{flag} {out}: pass a folder of its own for the {command} run, e.g. ./mha2gqa-{command}")
    if _dead_markers(out):
        with claim(out, f"{flag} {out}"):
            recover(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out} is a file: pass a directory for the {command} run")
    held = sorted(p.name for p in out.iterdir() if p.name != MARKER) if out.is_dir() else []
    foreign = [name for name in held if not _ours(name, entries)]
    if os.path.lexists(out / MARKER) and _marked(out) is None:  # a marker no run wrote: a file of the user's
        foreign.insert(0, MARKER)
    if foreign:
        raise InputError(
            f"{flag} {out} holds files that are not a {command} run ({', '.join(foreign[:3])}): mha2gqa never "
            f"overwrites them; choose another {flag}"
        )
    marked = _marked(out)
    if marked not in (None, command):  # the run of another command: named as what it is, never replaced
        raise InputError(
            f"{flag} {out} holds an earlier {one_line(marked)} run (its {MARKER} says so), not a {command} run: "
            f"mha2gqa replaces a run only with a run of the same command; choose another {flag}"
        )
    if held and marked != command:
        raise InputError(
            f"{flag} {out} holds {', '.join(held[:3])}, which no {command} run wrote (a run marks its folder with "
            f"{MARKER}): mha2gqa never overwrites a file it did not write; move them or choose another {flag}"
        )
    if (held or marked) and not force:
        raise InputError(
            f"{flag} {out} holds an earlier {command} run: pass --force to replace it, or choose another {flag}"
        )
    return out


def _marked(out: Path) -> str | None:
    """The command whose run OUT holds, by its MARKER; None when there is none."""
    marker = out / MARKER
    if not marker.is_file() or marker.is_symlink() or marker.stat().st_size > 64:
        return None
    return marker.read_text(errors="replace").strip() or None


def mark(out: Path, command: str) -> None:
    """OUT holds a run of `command` (validate_folder offers --force only for a marked folder)."""
    (out / MARKER).write_text(f"{command}\n")


def _under(err: BaseException, out: Path) -> bool:
    name = getattr(err, "filename", None)
    return is_user_fault(err) and name is not None and os.fsdecode(name).startswith(f"{out}{os.sep}")


def _ours(name: str, entries) -> bool:
    return any(name == e or (e.endswith("*") and name.startswith(e[:-1])) for e in entries)


class RunFolder:
    """OUT while a run fills it; `commit()` once the new run is worth more than the earlier one."""

    def __init__(self, out: Path, command: str):
        self.path, self.command = out, command
        stem = out.parent / f"{beside(out)}."
        self._replaced = Path(f"{stem}{_REPLACED}-{os.getpid()}")
        self._created = Path(f"{stem}{_CREATED}-{os.getpid()}")
        self._old = Path(f"{stem}{_OLD}-{os.getpid()}")
        self.committed = False

    def begin(self) -> None:
        if self.path.is_dir():  # an earlier run, or an empty folder of the user's: kept aside in one rename
            os.rename(self.path, self._replaced)
        else:
            self._created.mkdir()
        self.path.mkdir()
        mark(self.path, self.command)

    def commit(self) -> None:
        if self.committed:
            return
        self.committed = True
        if self._replaced.exists():
            os.rename(self._replaced, self._old)  # a kill during the removal leaves `old` debris, not a doubt
            shutil.rmtree(self._old)
        with suppress(FileNotFoundError):
            self._created.rmdir()

    def roll_back(self) -> None:
        if not self.committed:
            _restore(self.path, self._replaced if self._replaced.exists() else self._created)


def _restore(out: Path, marker: Path) -> None:
    """Undo an unfinished run: its files go, and the earlier OUT (a `replaced` marker) comes back."""
    shutil.rmtree(out, ignore_errors=True)
    if marker.name.split(".")[-1].startswith(_REPLACED):
        os.rename(marker, out)
    else:
        shutil.rmtree(marker, ignore_errors=True)


def _dead_markers(out: Path) -> list:
    stem = f"{beside(out)}."
    return [m for kind in (_REPLACED, _CREATED, _OLD) for m in dead_entries(out.parent, f"{stem}{kind}-")]


def recover(out: Path) -> None:
    """What runs on OUT that were killed left: each dead PID's unfinished run undone, its old copy removed."""
    stem = f"{beside(out)}."
    for kind in (_REPLACED, _CREATED):
        for marker, _pid in dead_entries(out.parent, f"{stem}{kind}-"):
            _restore(out, marker)
    remove_dead(out.parent, f"{stem}{_OLD}-")


@contextmanager
def run_folder(out: Path, flag: str, command: str, entries, force: bool, scratch: str | None = None):
    """Yield a RunFolder for OUT, checked (validate_folder), claimed and cleared of dead runs' debris, then
    set up so that a failure before `commit()` restores what was there. On success it is committed.
    `scratch`: a prefix of hidden work folders inside OUT named with the PID (`.sweep-PID`): a dead
    PID's are removed too."""
    out = validate_folder(out, flag, command, entries, force)
    created = make_parents(out.parent, f"{flag} {out}")
    try:
        with claim(out, f"{flag} {out}"):
            recover(out)
            if scratch:
                remove_dead(out, scratch)
            validate_folder(out, flag, command, entries, force)  # again: the recovery may have restored a run
            validate_room(out.parent, 0, f"{flag} {out}")
            folder = RunFolder(out, command)
            folder.begin()
            try:
                yield folder
            except BaseException as err:
                folder.roll_back()
                if not folder.committed and _under(err, out):
                    # a full or read-only disk under OUT: name OUT, not a file of the run that is gone
                    raise user_file_error(OSError(err.errno, err.strerror), out) from err
                raise
            folder.commit()
    except BaseException:
        for parent in reversed(created):
            with suppress(OSError):
                parent.rmdir()
        raise


class _Continued:
    """An OUT that a run continues (sweep --resume): what it holds already stays, whatever happens."""

    def __init__(self, out: Path):
        self.path = out
        self.committed = True

    def commit(self) -> None:
        pass


@contextmanager
def continued_folder(out: Path, flag: str, scratch: str | None = None, command: str | None = None):
    """OUT claimed for a run that adds to what it holds: the same lock and debris rule as run_folder,
    without moving anything aside. Called only once every check has passed: a refused continuation finds
    and leaves OUT as it was. `command`: OUT is marked as its run (a run made before the MARKER existed)."""
    out = Path(out).expanduser()
    with claim(out, f"{flag} {out}"):
        recover(out)
        if scratch:
            remove_dead(out, scratch)
        if command and _marked(out) is None:
            mark(out, command)
        yield _Continued(out)


@contextmanager
def scratch_folder(out: Path, prefix: str):
    """A hidden work folder `OUT/PREFIXPID`, removed on every exit; a kill -9 leaves it for the next
    start of the command (run_folder's `scratch`) to remove."""
    work = out / f"{prefix}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
