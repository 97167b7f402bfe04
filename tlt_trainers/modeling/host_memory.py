"""Giving freed host memory back to the system, which glibc's allocator otherwise keeps.

A policy forward on a CPU allocates and frees activations of a few megabytes each, while the drafter's buffer keeps
each conversation's features, allocated between them; reading cached features does the same with each file's float32
copy, and so does training, whose micro-steps free their batches and activations between the optimizer's and the
metrics' small allocations. glibc serves these transient blocks from its heap once its dynamic mmap threshold has
risen (it does after the first large free) and returns a heap's free pages to the system only from its top, which
the kept tensors pin: the process grows by the transients of every batch, by several times the features it keeps,
until a feature pass over a data folder runs out of memory. ``malloc_trim(0)`` after a batch gives the free pages
back and stops that growth; it does not bring the process down to its live tensors, since small live allocations
still pin pages inside freed chunks (drafter training on a CPU levelled off at about 2.5 times the features it kept).
PyTorch's CPU performance guide recommends jemalloc or tcmalloc for the same reason; this needs neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> bool:
    """Return the allocator's free pages to the system (glibc's ``malloc_trim(0)``); False where it cannot.
    Costs milliseconds: call it after a batch of work, not inside one."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
