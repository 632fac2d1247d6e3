"""The one way mha2gqa puts a file or a folder in place: whole or not at all, with room checked first.

- write_atomic: a file's new content goes to a temporary file beside it, then is renamed over it
  (mha2gqa.json, the model card, config.json, eval results, progress.json, the embedded corpus).
- swap_in: a finished staging folder becomes the destination: the whole folder (convert's DST, by
  renameat2(RENAME_EXCHANGE) where the platform has it) or its files moved into a folder that holds
  other things too (uptrain's output_dir: checkpoints and metrics stay).
- check_room: the nearest existing folder must be a writable folder with `needed` bytes free.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import tempfile
from pathlib import Path

from mha2gqa.errors import InputError, is_user_fault, user_file_error


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` via a temporary file in the same folder; a failure
    leaves the old file (or none) and no temporary file. A full or read-only disk is one line naming
    `path`."""
    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:80]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if is_user_fault(err):
            raise user_file_error(OSError(err.errno, err.strerror), path) from err
        raise
    return path


def swap_in(staging: Path, dst: Path, replace: bool = False, files_first=None, files_last=()) -> None:
    """Make the finished `staging` folder's content `dst`'s.

    Whole folder (files_first is None): `dst` becomes `staging`. With `replace` and an existing
    `dst`, the two are exchanged in one renameat2(RENAME_EXCHANGE), so `dst` is at every instant the
    old or the new folder; where the platform lacks it, two renames (a kill between them leaves no
    `dst`; the new one waits in `staging` for the next run's debris removal). The old folder is removed.

    Files into a shared folder (files_first: a glob of the files to move first, e.g. the weights):
    each file is renamed into `dst` (atomic each), `files_last` names last (the record that vouches
    for the rest), and files matching files_first that the new set lacks are removed from `dst`."""
    if files_first is not None:
        _move_files(staging, dst, files_first, set(files_last))
        return
    if not (replace and dst.exists()):
        os.rename(staging, dst)  # over an empty directory at most: rename refuses a non-empty one
        return
    if not _exchange(staging, dst):
        old = staging.with_name(staging.name + "-old")
        os.rename(dst, old)
        os.rename(staging, dst)
        staging = old
    shutil.rmtree(staging)  # the old dst, now under the staging name: a kill here leaves debris, not loss


def _move_files(staging: Path, dst: Path, first: str, last: set[str]) -> None:
    new = sorted(staging.iterdir(), key=lambda p: (not p.match(first), p.name in last, p.name))
    for path in new:
        os.replace(path, dst / path.name)
    names = {p.name for p in new}
    for old in dst.glob(first):
        if old.name not in names:
            old.unlink()
    staging.rmdir()


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where the platform or
    the filesystem does not offer it (the caller falls back to two renames)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fsdecode(b))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def nearest_existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(path: Path, needed: int, what: str, purpose: str = "") -> Path:
    """Before a long write under `path` (`what`: how the user named it, e.g. "DST x"): its nearest
    existing folder must be a folder, writable (a read-only mount is refused even as root) and hold
    `needed` more bytes (`purpose`: what they are for, said in the message). Returns that folder."""
    folder = nearest_existing(path)
    if not folder.is_dir():
        raise InputError(f"{what}: {folder} is a file, so nothing can be created below it: choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(
            f"{what}: {folder} is not writable (read-only filesystem or no permission): choose a writable location"
        )
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise InputError(
            f"{what} needs {needed / 2**20:,.1f} MiB{f' ({purpose})' if purpose else ''} but its filesystem has "
            f"{free / 2**20:,.1f} MiB free: "
            "free space or choose another location"
        )
    return folder
