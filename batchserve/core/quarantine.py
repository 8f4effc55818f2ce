"""Inputs that failed alone, remembered for a while so a retry of one is answered at once.

Finding a poison input among its batch-mates costs re-runs (bisection: about two batch runs per halving), and
every new batch the same input rides in fails again and pays that price again, for everyone in it. So an input
that bisection isolated and that failed again on a retry of its own is quarantined: the door answers it 500
`INFERENCE_FAILED` without queueing it, until the entry expires. Inputs a backend reported failed by index (an
exception in place of their output) are not quarantined: naming them cost nothing, and such a failure may be
transient (a remote call that timed out).

Memory is bounded: at most `capacity` entries of a 16-byte digest of (model, input), the oldest evicted first,
each for `ttl_s`; the input text itself is not kept.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable

QUARANTINE_ENTRIES = 10_000  # ~1.5 MB at most: digests and a float each
QUARANTINE_TTL_S = 600.0  # a fixed model or a redeployed backend is given a new chance within minutes


def _key(model: str, text: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(model.encode())
    h.update(b"\x00")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


@dataclass
class Quarantine:
    capacity: int = QUARANTINE_ENTRIES
    ttl_s: float = QUARANTINE_TTL_S
    clock: Callable[[], float] = time.monotonic
    entries: OrderedDict[bytes, tuple[float, str]] = field(default_factory=OrderedDict)  # key -> (until, why)

    def add(self, model: str, text: str, why: str) -> None:
        """`text` failed alone on `model` (after bisection and a retry): answer it at once from now on."""
        key = _key(model, text)
        self.entries.pop(key, None)
        self.entries[key] = (self.clock() + self.ttl_s, why)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def reason(self, model: str, text: str) -> str | None:
        """Why `text` is quarantined on `model`, or None when it is not (or no longer)."""
        if not self.entries:  # the common case: one dict-length check per request
            return None
        key = _key(model, text)
        entry = self.entries.get(key)
        if entry is None:
            return None
        until, why = entry
        if until <= self.clock():
            del self.entries[key]
            return None
        return why

    def __len__(self) -> int:
        return len(self.entries)
