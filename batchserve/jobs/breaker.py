"""A circuit breaker for the job store: while the store is down, refuse at once instead of letting every call wait
for a connection and pile up.

The first failure that says "unreachable" opens the circuit: for `open_s` every call is refused in microseconds
(`StoreDown`, answered 503 `JOBS_UNAVAILABLE` with a retry hint); then one call goes through as a probe: its success
closes the circuit, its failure opens it for another `open_s`. So a store that comes back is in use again within
about `open_s`, and a dead one costs one attempt per `open_s`, not one per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable

from batchserve.jobs.store import StoreDown

OPEN_S = 1.0


@dataclass
class CircuitBreaker:
    open_s: float = OPEN_S
    clock: Callable[[], float] = time.monotonic
    reason: str = ""  # why it opened, for the refusals
    _open_until: float = 0.0  # 0: closed
    _probing: bool = False

    @property
    def closed(self) -> bool:
        return self._open_until == 0.0

    def before(self) -> bool:
        """Call before using the store: raises `StoreDown` while open; returns True when this call is the
        probe (the caller must then report `success()` or `failure()`)."""
        if self._open_until == 0.0:
            return False
        if self._probing or self.clock() < self._open_until:
            raise StoreDown(f"the job store is unreachable ({self.reason}); tried again every {self.open_s:g} s")
        self._probing = True
        return True

    def success(self) -> None:
        self._open_until, self._probing, self.reason = 0.0, False, ""

    def failure(self, reason: str) -> None:
        self._open_until, self._probing, self.reason = self.clock() + self.open_s, False, reason[:200]

    def abandon_probe(self) -> None:
        """The probe ended without a verdict (cancelled, or an error that says nothing of reachability)."""
        self._probing = False
