"""How faults reach the user: the exception for user mistakes, the rule that turns faults of the
user's files or machine into one, and signals that unwind like Ctrl-C.

Anything raised as InputError is the user's to fix: the CLI prints its message as a single line
and exits with code 2. Its message names the value, the rule and the fix. An OSError that the
user's files or machine cause (a full or read-only disk, a permission, a missing file) is the
user's too: `user_file_error` words it as one line naming the file; `is_user_fault` tells the CLI
which OSErrors those are. Anything else is a bug in mha2gqa and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager


class InputError(ValueError):
    """Bad input from the user (a flag, a path, a recipe key); never a bug in mha2gqa."""


class WeightWarning(UserWarning):
    """Weights that convert but deserve a look (e.g. non-finite values); the CLI prints one line each."""


class InputWarning(WeightWarning):
    """Input that is used but deserves a word (a calibration text shorter than asked for); one line too."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP, raised as a KeyboardInterrupt so that every cleanup written for Ctrl-C
    runs for all three. A subclass, not KeyboardInterrupt itself: CPython flags an exact
    KeyboardInterrupt it sees leaving certain C calls as unhandled and then ends the process by SIGINT
    at exit. With the bare one, 3 of 11 runs of the signal tests ended that way (exit -2) although the
    CLI had caught it and printed its line; with the subclass every run exited 130."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# errno -> (what went wrong, the fix): the faults a user's files or machine cause, not our bugs.
_USER_FAULTS = {
    errno.ENOSPC: ("no space left on the device", "free space or choose a location with room"),
    errno.EDQUOT: ("disk quota exceeded", "free space or choose a location with room"),
    errno.EFBIG: ("file too large for this filesystem", "choose another filesystem or a smaller shard size"),
    errno.EROFS: ("the filesystem is read-only", "choose a writable location"),
    errno.EACCES: ("permission denied", "fix its permissions or choose another location"),
    errno.EPERM: ("operation not permitted", "fix its permissions or choose another location"),
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.ENOTDIR: ("a part of the path is not a directory", "check the path"),
    errno.EISDIR: ("it is a directory where a file was expected", "pass a file"),
    errno.ENAMETOOLONG: ("the name is too long", "choose a shorter path"),
    errno.ELOOP: ("too many levels of symbolic links", "check the links on the path"),
    errno.EEXIST: ("it already exists", "choose a new path or remove it"),
    errno.ENOTEMPTY: ("the directory is not empty", "choose a new path or remove it"),
    errno.EIO: ("input/output error", "check the disk (dmesg) and try again"),
    errno.ENXIO: ("no such device", "check the path"),
}


def first_line(err: BaseException | str, limit: int | None = None, default: str = "") -> str:
    """The first line of an error's message (libraries' messages often run to many lines), at most `limit`
    characters; `default` when the message is empty."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else default


def is_user_fault(err: BaseException) -> bool:
    """True for an OSError that the user's files or machine cause (see _USER_FAULTS)."""
    return isinstance(err, OSError) and err.errno in _USER_FAULTS


def user_file_error(err: OSError, path: str | os.PathLike | None = None) -> InputError:
    """`err` as one line: the file (err.filename, else `path`), what went wrong, the fix.
    Use it where the failing file is the user's: `except OSError as err: raise user_file_error(err, dst) from err`."""
    what, fix = _USER_FAULTS.get(err.errno, (err.strerror or type(err).__name__, "check the file and try again"))
    where = err.filename if err.filename is not None else path
    where = f"{os.fsdecode(where)}: " if where is not None else ""
    return InputError(f"{where}{what}: {fix}")


def one_line(text: str) -> str:
    """`text` as one printable line whatever it quotes: a newline in a path shows as \\n, bytes of a
    name that are not UTF-8 as \\xNN (a DST named so gave a two-line error or a UnicodeEncodeError)."""
    text = text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")
    return "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in text)


def exit_report(err: BaseException) -> tuple[str, int] | None:
    """The line a fault ends the program with and its exit code, the same for every entry point (the
    `mha2gqa` CLI, `python -m mha2gqa.uptrain` under accelerate): a user mistake (InputError, a user's
    OSError) -> `Error: ...`, 2; Ctrl-C, SIGTERM, SIGHUP -> `Interrupted by SIG...` on a new line (a
    progress bar or ^C may hold the cursor), 128 + the signal number; None for anything else, a bug
    in mha2gqa that keeps its traceback."""
    if isinstance(err, InputError):
        return f"Error: {one_line(str(err))}", 2
    if is_user_fault(err):
        return f"Error: {one_line(str(user_file_error(err)))}", 2
    if isinstance(err, KeyboardInterrupt):
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        return f"\nInterrupted by {signal.Signals(signum).name}", 128 + signum
    return None


_HELD_SIGNALS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


@contextmanager
def signals_deferred():
    """Holds SIGINT, SIGTERM and SIGHUP until the block ends; one that came meanwhile is delivered then,
    to the handler that was in place before. For importing torch: its C++ start-up runs Python code,
    and an Interrupted raised there by `signals_as_interrupts` aborts the process ('terminate called
    after throwing an instance of pybind11::error_already_set', exit -6, no cleanup) instead of unwinding.

    A handler that only notes the signal, not a blocked signal mask: a mask holds the calling thread
    only, and while another thread lives (tqdm's monitor, a data loader, a tokenizer pool) the kernel
    hands the signal to that one and Python ran the old handler inside the block all the same. Python
    runs every handler in the main thread, whichever thread the kernel picked, so noting it there holds."""
    came: list[int] = []

    def note(signum, _frame):
        if signum not in came:  # like a blocked signal: two of a kind while held are delivered once
            came.append(signum)

    # getsignal is None for a handler set from C, which Python could not put back: that one stays.
    kinds = [kind for kind in _HELD_SIGNALS if signal.getsignal(kind) is not None]
    try:
        with _handling(kinds, note):
            yield
    finally:  # the earlier handlers are back by now: each held signal goes to its own
        for signum in came:
            signal.raise_signal(signum)


@contextmanager
def _handling(kinds, handler):
    """`handler` for each signal of `kinds` while the block runs, the earlier handlers put back after it.
    In the main thread only: signal.signal works there alone, and Python runs every handler there, so
    in another thread the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {kind: signal.signal(kind, handler) for kind in kinds}
    try:
        yield
    finally:
        for kind, earlier in previous.items():
            signal.signal(kind, earlier)


def import_torch():
    """`import torch` with the interrupt signals held until it is done (see `signals_deferred`)."""
    with signals_deferred():
        import torch
    return torch


REDELIVER_AFTER_S = 0.05


@contextmanager
def signals_as_interrupts():
    """While active (main thread only), SIGINT, SIGTERM and SIGHUP raise Interrupted, so `except
    KeyboardInterrupt` / `finally` cleanups run for all three. A second signal of the same kind gets the
    default action (kills at once); later runs remove what that leaves (see checkpoint.py).

    Python runs a handler between any two bytecodes of the main thread, finalizers included (a __del__, a
    weakref callback), and an exception leaving a finalizer is printed as 'Exception ignored in ...' and
    dropped: the Interrupted would be lost and the run go on (found in serve-bench: a SIGINT while
    transformers imported its modules landed in the regex module's Group.__del__; the run then waited on
    its servers until the test gave up). Such a one is sent again, once the finalizer has returned. And an
    error that leaves the block after a signal was raised is the signal's doing (an import it cut short
    fails later as ModuleNotFoundError, say): it leaves as the Interrupted, the error as its cause."""
    owner = os.getpid()
    received: list[int] = []
    active = threading.Event()
    active.set()

    def raise_interrupted(signum, _frame):
        signal.signal(signum, signal.SIG_DFL)
        if os.getpid() != owner:  # a forked worker (e.g. a multiprocessing pool) inherits the handler:
            os.kill(os.getpid(), signum)  # it dies as it would have, with no cleanup of the parent's
            return
        received.append(signum)
        raise Interrupted(signum)

    def send_again(signum: int) -> None:
        if active.is_set():
            os.kill(owner, signum)

    earlier_hook = sys.unraisablehook

    def dropped(unraisable) -> None:
        err = unraisable.exc_value
        if not isinstance(err, Interrupted) or os.getpid() != owner:
            earlier_hook(unraisable)
            return
        signal.signal(err.signum, raise_interrupted)
        # from another thread, a moment later: a signal raised here would run its handler here, still
        # inside the finalizer's unwinding
        threading.Timer(REDELIVER_AFTER_S, send_again, (err.signum,)).start()

    sys.unraisablehook = dropped
    try:
        with _handling(_HELD_SIGNALS, raise_interrupted):
            yield
    except Exception as err:
        if received:
            raise Interrupted(received[-1]) from err
        raise
    finally:
        active.clear()
        sys.unraisablehook = earlier_hook
