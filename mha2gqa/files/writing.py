"""The one way mha2gqa puts a file or a folder in place: whole or not at all, with room checked first.

- write_atomic: a file's new content goes to a temporary file beside it, then is renamed over it
  (mha2gqa.json, the model card, config.json, eval results, progress.json, the embedded corpus), with
  the mode a plain open() would give (the umask honoured) or the mode of the file it replaces.
- swap_in: a finished staging folder becomes the destination: the whole folder (convert's DST, by
  renameat2(RENAME_EXCHANGE) where the platform has it) or its files moved into a folder that holds
  other things too (uptrain's output_dir: checkpoints and metrics stay).
- validate_room: the nearest existing folder must be a writable folder with `needed` bytes free.
- claim / remove_dead: the rule of every command that writes a folder: an flock on `.OUT.lock`
  holding the writer's PID (a second run is refused, naming it), and debris named `.OUT.*-PID` of
  PIDs that are gone removed (or restored) at the next start. convert's atomic_directory and the run
  folders of demo, reproduce and sweep (mha2gqa/files/run_folder.py) both use it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

from mha2gqa.runtime.errors import InputError, is_user_fault, user_file_error


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` via a temporary file in the same folder; a failure
    leaves the old file (or none) and no temporary file. A full or read-only disk is one line naming
    `path`."""
    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:80]}.", suffix=".tmp")
        os.fchmod(fd, _mode_for(path))  # mkstemp makes 0600: another user serving the model could not read it
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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc, 4.7+): setting and
    restoring it would race with another thread creating a file."""
    with suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """The permission bits of the file being replaced, or what open() would create under the umask."""
    with suppress(OSError):
        return os.stat(path).st_mode & 0o7777
    return 0o666 & ~current_umask()


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


def validate_room(path: Path, needed: int, what: str, purpose: str = "") -> Path:
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


def make_parents(directory: Path, what: str) -> list[Path]:
    """mkdir -p, after checking that the nearest existing ancestor is writable; returns what it created
    (for the caller to remove after a failure)."""
    missing = []
    existing = validate_room(directory, 0, what)
    while directory != existing:
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


def beside(path: Path) -> str:
    """The stem of the names a run puts beside `path` (`.NAME.partial-PID`, `.NAME.lock`): `.NAME`, or
    for a name near the 255-byte limit a shortened one with a digest of the name, so that any legal
    name works."""
    name = f".{path.name}"
    if len(os.fsencode(name)) <= 255 - len(".partial-4194304-old"):  # the longest name made from it
        return name
    digest = hashlib.sha256(os.fsencode(path.name)).hexdigest()[:16]
    return f".{os.fsencode(path.name)[:160].decode(errors='ignore')}-{digest}"


@contextmanager
def claim(path: Path, what: str):
    """Hold an exclusive flock on `.NAME.lock` beside `path` for the whole write, with this PID in it;
    `what` names the output as the user gave it ("DST x", "--out x"). The kernel releases the lock when
    a process dies, so a lock file left by a kill -9 claims nothing. The file is removed at the end while
    still locked; a run that locked the removed file notices (different inode) and retries."""
    lock_path = path.parent / f"{beside(path)}.lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _refuse_held(fd, lock_path, what)
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


def _refuse_held(fd: int, lock_path: Path, what: str):
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    os.close(fd)
    raise InputError(
        f"{what} is being written by another mha2gqa run (PID {holder}, lock {lock_path}): "
        f"wait for it to finish or choose another {what.split()[0]}"
    ) from None


def validate_unclaimed(path: Path, what: str) -> None:
    """claim's refusal without claiming (a dry run writes nothing, not even the lock file): another run that
    holds `path`'s lock is named as claim would name it."""
    lock_path = path.parent / f"{beside(path)}.lock"
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or none readable): no run holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        _refuse_held(fd, lock_path, what)
    os.close(fd)  # closing releases the shared lock it took


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def dead_entries(folder: Path, prefix: str) -> list[tuple[Path, int]]:
    """Entries `PREFIXPID[-...]` of `folder` whose PID is gone (never this process's), with the PID."""
    found = []
    if not folder.is_dir():
        return found
    for path in folder.iterdir():
        pid = path.name[len(prefix) :].split("-")[0] if path.name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            found.append((path, int(pid)))
    return found


def remove_dead(folder: Path, prefix: str) -> None:
    """Remove the debris `PREFIXPID*` of runs whose PID is gone. The caller holds the output's lock, so
    no live mha2gqa run is writing them; a live PID's entry is left alone, whatever it is."""
    for path, _pid in dead_entries(folder, prefix):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
