"""A signal under signals_as_interrupts ends the run even where Python would drop its Interrupted: raised inside
a finalizer (printed as 'Exception ignored in ...' and lost: serve-bench then waited on its servers), or
swallowed by a library that later fails with an error of its own."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mha2gqa.runtime.errors import Interrupted, signals_as_interrupts


class SignalledInItsFinalizer:
    """An object whose __del__ sends SIGTERM and then calls a Python function: the handler runs there, inside
    the finalizer, as it did inside the regex module's Group.__del__ while transformers imported."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(i for i in range(100))  # a call: Python runs the pending handler here


def test_an_interrupt_raised_inside_a_finalizer_is_sent_again_after_it(capfd):
    started = time.monotonic()
    with pytest.raises(Interrupted) as caught, signals_as_interrupts():
        SignalledInItsFinalizer()  # made and dropped at once: its __del__ runs on this line
        while time.monotonic() - started < 10:
            time.sleep(0.01)
    assert caught.value.signum == signal.SIGTERM
    assert caught.value.__cause__ is None  # sent again and raised in the loop, not made from another error
    assert time.monotonic() - started < 5
    assert "Exception ignored" not in capfd.readouterr().err  # the dropped one is not printed either


def test_an_error_after_a_swallowed_interrupt_leaves_as_the_interrupt():
    def a_library_that_catches_too_much():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted here
        except BaseException:
            pass
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'")  # what a cut-short import gave

    with pytest.raises(Interrupted) as caught, signals_as_interrupts():
        a_library_that_catches_too_much()
    assert caught.value.signum == signal.SIGTERM
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_without_a_signal_errors_and_the_hooks_are_left_as_they_were():
    import sys

    hook = sys.unraisablehook
    with pytest.raises(ValueError, match="ours"), signals_as_interrupts():
        raise ValueError("ours")
    assert sys.unraisablehook is hook
    assert signal.getsignal(signal.SIGTERM) is not None
