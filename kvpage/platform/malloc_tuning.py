"""Keep freed activation memory in the process, so a step's tensors do not fault in fresh pages.

A CPU forward allocates and frees the same large tensors every step (activations of a
2048-token prefill chunk are megabytes each; a decode step's logits are ``S x vocab``
floats). glibc's malloc serves blocks above its mmap threshold with a fresh ``mmap`` and
returns them with ``munmap``, and trims the heap's free top back to the kernel, so the next
step touches new pages: the kernel zeroes each one on its first write (docs/performance.md
has the measurements).

``keep_freed_memory()`` raises glibc's mmap threshold to its maximum (32 MiB on 64-bit),
its trim threshold to ``KEEP_BYTES`` and its top pad to ``TOP_PAD_BYTES``, so freed blocks
go back to malloc's free lists and are reused. The cost is resident memory: the process
keeps up to its step's peak of activations after a step, as a caching allocator would.
The engine calls it once when it builds a CPU model; ``KVPAGE_MALLOC_TUNING=0`` turns it
off, and any ``MALLOC_*_`` variable the user set is left to win. Elsewhere than glibc (musl, a preloaded allocator without ``mallopt``) it
does nothing. Torch-free.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("kvpage")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks above it
#: are always mmapped.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
#: Free memory at the heap's top that malloc keeps rather than returns to the kernel.
KEEP_BYTES = 1024 * 1024 * 1024
#: Extra memory asked of the kernel whenever the heap grows, so it grows in few steps.
TOP_PAD_BYTES = 256 * 1024 * 1024
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied = False


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; returns whether they are in force."""
    global _applied
    if _applied:
        return True
    if os.environ.get("KVPAGE_MALLOC_TUNING", "1") == "0" or any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: mallopt's parameters differ elsewhere
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    # Each call returns 1 on success; the mmap threshold first, since setting it also stops
    # glibc from moving it (and the trim threshold) by itself.
    _applied = all(mallopt(param, value) for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                                                              (_M_TRIM_THRESHOLD, KEEP_BYTES),
                                                              (_M_TOP_PAD, TOP_PAD_BYTES)))
    if _applied:
        log.info("malloc: freed blocks up to %d MiB are kept for reuse (KVPAGE_MALLOC_TUNING=0 turns this off)",
                 MMAP_THRESHOLD_MAX >> 20)
    return _applied
