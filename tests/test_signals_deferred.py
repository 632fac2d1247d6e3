"""A signal that comes while torch is being imported is held until the import is done, then unwinds as
Interrupted: raised inside torch's C++ start-up it aborted the process instead (exit -6, no cleanup)."""

from __future__ import annotations

import os
import signal

import pytest

from mha2gqa.errors import Interrupted, import_torch, signals_as_interrupts, signals_deferred


def test_a_signal_inside_the_block_is_delivered_after_it():
    reached_end_of_block = False
    with pytest.raises(Interrupted) as caught, signals_as_interrupts():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            reached_end_of_block = True  # not interrupted in here
    assert reached_end_of_block
    assert caught.value.signum == signal.SIGTERM


def test_without_a_signal_nothing_is_raised_and_the_mask_is_restored():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert import_torch().__name__ == "torch"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
