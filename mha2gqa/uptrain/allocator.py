"""Freed tensor memory goes back to the system during training (glibc's malloc, Linux).

A training step allocates and frees gigabytes of activations. glibc serves a block of at least its mmap
threshold with mmap (and returns it when freed), but it raises that threshold to the size of every such
block freed, up to 32 MiB: from the second step on, the activations (4.5-12 MiB each for SmolLM2 at 4 x 512
tokens) come from the heap, which keeps what is freed. Measured on SmolLM2-135M distilling (4 x 512 tokens):
peak RSS 4.63 GiB by the second step with the default, 3.62 GiB with the threshold fixed at 1 MiB, where it
stays step after step (docs/uptrain.md, "Memory"). Setting the threshold once fixes it for the process
(no change to any number computed: only where the memory comes from).
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 1 << 20  # blocks of 1 MiB or more are mapped, and unmapped when freed


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD; False where the C library is not glibc (nothing changed)."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
