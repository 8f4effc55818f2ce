"""A caller whose requests keep being refused for what they hold waits its turn before the next is read.

Why: a refusal is cheap only once. Clients looping ~1 MB bodies, each refused at once, make the server read and
parse hundreds of MB a second only to throw them away, taking the event loop from every other caller. So each
caller has a bucket of refusals (`--refused-per-s` a second, a burst of twice that): while it is empty, its next
request on the guarded routes waits until a refusal is due again (at most `MAX_WAIT_S`) BEFORE its body is read, so
its unread bytes stay in the socket and the client is slowed to the rate, not the server. Other callers never wait;
a caller that is refused rarely never notices.

A caller is its key's tenant, or its address when anonymous. The table is bounded (`MAX_CALLERS`, the least
recently refused forgotten first), and policy only: the clock is injected, the unit tests drive it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable

MAX_WAIT_S = 1.0  # the longest one request waits: the client still gets its answer, a little later
MAX_CALLERS = 10_000  # callers remembered (each a few numbers); the least recently refused go first


@dataclass
class RefusalThrottle:
    """Token buckets of refusals, one per caller: `rate` a second, `burst` at most (0 rate: off)."""

    rate: float
    burst: float = 0.0
    clock: Callable[[], float] = time.monotonic
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # caller -> (tokens, at)

    def __post_init__(self) -> None:
        if self.burst <= 0:
            self.burst = max(1.0, 2 * self.rate)

    def _tokens(self, caller: str, now: float) -> float:
        tokens, at = self._buckets.get(caller, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def wait_s(self, caller: str) -> float:
        """How long this caller's next request waits before it is read: 0 unless its refusals ran out."""
        if self.rate <= 0 or caller not in self._buckets:
            return 0.0
        tokens = self._tokens(caller, self.clock())
        return 0.0 if tokens >= 1 else min(MAX_WAIT_S, (1 - tokens) / self.rate)

    def refused(self, caller: str) -> None:
        """Count a refusal of this caller's request (a 4xx for what it sent)."""
        if self.rate <= 0:
            return
        now = self.clock()
        tokens = self._tokens(caller, now)
        self._buckets[caller] = (max(-self.burst, tokens - 1), now)  # a debt of at most one burst
        self._buckets.move_to_end(caller)
        while len(self._buckets) > MAX_CALLERS:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
