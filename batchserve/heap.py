"""Give the heap that a burst of connections freed back to the operating system (glibc's `malloc_trim`).

Why: memory freed by a flood of connections stays in glibc's free lists, scattered between live blocks, and
`free` only returns the top of the heap; `malloc_trim(0)` hands every free page back, roughly halving the resident
size after a flood. It walks the heap, so it runs on a helper thread, and only after the open connections fell well
below a large peak (`ConnectionGuard`). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("batchserve")


def _load_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _load_trim()


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when glibc did release some."""
    return bool(_TRIM(0)) if _TRIM is not None else False
