"""Give the heap that a burst of connections freed back to the operating system (glibc's `malloc_trim`).

Why: memory freed by a flood of connections stays in glibc's free lists, scattered between live blocks, and
`free` only returns the top of the heap; `malloc_trim(0)` hands every free page back, roughly halving the resident
size after a flood. It walks the heap, so it runs on a helper thread, and only after the open connections fell well
below a large peak (`ConnectionGuard`). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_TRIM: Callable[[int], int] | None
try:  # glibc's; elsewhere there is none
    _TRIM = trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):
    _TRIM = None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when glibc did release some."""
    return bool(_TRIM(0)) if _TRIM is not None else False
