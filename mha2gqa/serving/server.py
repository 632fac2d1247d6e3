"""One engine server as a process group we own: started in its own session, its output kept in a log file,
ready when /health answers 200, and ended with every process it spawned on every way out.

vLLM's server spawns an engine core and a worker; they stay in the server's process group, so the group is
what is signalled: SIGTERM first (vLLM then frees its shared memory), SIGKILL for what is left after a grace
period. The server also gets SIGTERM from the kernel if the thread that started it dies (Linux's parent-death
signal), so even a `kill -9` of mha2gqa does not leave a server running on its own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from mha2gqa.runtime.errors import InputError, one_line
from mha2gqa.serving import client

POLL_S = 0.5
STOP_GRACE_S = 20.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_port_free(port: int, flag: str = "--port") -> None:
    """Refuse a port that something on 127.0.0.1 already holds, before any server starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise InputError(
                f"{flag} {port}: the port is in use ({err.strerror}): choose another, or leave {flag} out "
                "for a free one"
            ) from None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG, Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class Server:
    """`with Server(...) as s:` starts the process; `s.wait_ready()` waits for /health; leaving the block
    (normally, by an exception, by Ctrl-C) ends the whole process group."""

    def __init__(self, label: str, command: list[str], port: int, log: Path, env: dict, startup_timeout_s: float):
        self.label, self.command, self.port, self.log = label, command, port, Path(log)
        self.env, self.startup_timeout_s = env, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.started_at = self.ready_after_s = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:  # the child holds its own copy of the descriptor
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: signalled as one, away from the terminal's ^C
                preexec_fn=_die_with_parent,
            )
        self.started_at = time.monotonic()
        self._healthy_at: float | None = None
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name=f"health of {self.label}", daemon=True).start()
        return self

    def _watch(self) -> None:
        """Note when /health first answers 200, while the caller does other work (transformers' reference
        decode), so the start-up time is the server's own, not the moment the caller came back to look."""
        process = self.process
        while not self._stopping.is_set() and process.poll() is None:
            if client.healthy(self.url):
                self._healthy_at = time.monotonic()
                return
            self._stopping.wait(POLL_S)

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> float:
        """Seconds from start until /health answered 200; InputError if the server exits or the time runs out."""
        deadline = self.started_at + self.startup_timeout_s
        while True:
            if self._healthy_at is not None:
                self.ready_after_s = self._healthy_at - self.started_at
                return self.ready_after_s
            self.ensure_alive("before it was ready")
            if time.monotonic() > deadline:
                raise InputError(
                    f"the server for {self.label} did not answer /health within {self.startup_timeout_s:g} s "
                    f"(--startup-timeout): {self._last_words()}; its log: {self.log}"
                )
            time.sleep(POLL_S)

    def ensure_alive(self, when: str = "during the run", grace_s: float = 0.0) -> None:
        """InputError naming the exit code and the log's last error if the server process has ended (or ends
        within `grace_s`: a server whose connection just broke is often a moment from its exit)."""
        try:
            code = self.process.wait(timeout=grace_s) if grace_s else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise InputError(f"the server for {self.label} {how} {when}: {self._last_words()}; its log: {self.log}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _last_words(self) -> str:
        """The log's last line that reads like an error (else its last line), cut to one short line."""
        lines = deque((ln.strip() for ln in self.log_text().splitlines() if ln.strip()), maxlen=200)
        errors = [ln for ln in lines if any(w in ln for w in ("Error", "error", "Exception", "in use"))]
        last = (errors or list(lines) or ["(the log is empty)"])[-1]
        return "last log line: " + one_line(last)[:300]

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after STOP_GRACE_S to whatever is left, then reap the leader."""
        if self.process is None:
            return
        self._stopping.set()
        group = self.process.pid  # the session leader: its pid is the group id
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _group_alive(group) and time.monotonic() < deadline:
            self.process.poll()  # reap the leader so that it does not count as alive
            time.sleep(0.1)
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
        self.process.wait()
        self.process = None


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    """Whether a process of the group lives (zombies waiting for their reaper do not count)."""
    import psutil

    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return False
