"""A signal that comes while torch is being imported is held until the import is done, then unwinds as
Interrupted: raised inside torch's C++ start-up it aborted the process instead (exit -6, no cleanup)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from contextlib import contextmanager

import pytest

from mha2gqa.runtime.errors import Interrupted, import_torch, signals_as_interrupts, signals_deferred


@contextmanager
def another_thread_alive():
    """A second thread that sleeps until the test ends, as tqdm's monitor or a data loader does: the
    kernel may hand a process's signal to it rather than to the main thread."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        done.set()
        thread.join()


@contextmanager
def wakeup_socket():
    """The socket Python's C-level handler writes each signal number to, in whichever thread the kernel
    chose: reading it tells the test that the signal has arrived, with no sleep and no timing."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old = signal.set_wakeup_fd(writer.fileno())
    try:
        yield reader
    finally:
        signal.set_wakeup_fd(old)
        reader.close()
        writer.close()


def after_the_signal_arrived(reader: socket.socket) -> bool:
    # Waits until the C-level handler has run; the Python-level one runs at the next call from here,
    # so an old handler that was not held raises before this function returns.
    assert reader.recv(1)[0] == signal.SIGTERM
    return True


def test_a_signal_inside_the_block_is_delivered_after_it():
    reached_end_of_block = False
    with pytest.raises(Interrupted) as caught, signals_as_interrupts():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            reached_end_of_block = True  # not interrupted in here
    assert reached_end_of_block
    assert caught.value.signum == signal.SIGTERM


def test_a_signal_the_kernel_gives_to_another_thread_is_held_too():
    # The signal goes to the other thread (pthread_kill), as the kernel does when the main thread
    # blocks it: a blocked mask held the main thread only and the handler ran inside the block.
    reached_end_of_block = False
    with another_thread_alive() as other, wakeup_socket() as reader:
        with pytest.raises(Interrupted) as caught, signals_as_interrupts():
            with signals_deferred():
                signal.pthread_kill(other.ident, signal.SIGTERM)
                reached_end_of_block = after_the_signal_arrived(reader)
    assert reached_end_of_block
    assert caught.value.signum == signal.SIGTERM


def test_two_signals_of_a_kind_while_held_are_delivered_once():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        with another_thread_alive(), wakeup_socket() as reader:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                after_the_signal_arrived(reader)
                os.kill(os.getpid(), signal.SIGTERM)
                after_the_signal_arrived(reader)
                assert seen == []
            after_the_signal_arrived(reader)  # the delivery after the block goes through the C handler too
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]


def test_without_a_signal_nothing_is_raised_and_the_handlers_are_restored():
    before = {kind: signal.getsignal(kind) for kind in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert import_torch().__name__ == "torch"
    assert {kind: signal.getsignal(kind) for kind in before} == before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
