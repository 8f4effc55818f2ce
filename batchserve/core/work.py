"""One request's value from the door to the device: who asked, for which model, by when, and what it costs.

Made once per request where the caller is identified; the wing's parse names the model and the deadline, and the
door (`InferenceService.infer` / `infer_many`) fills in the inputs and their cost as it prices them. Every path below
reads this value rather than a row of positional arguments; nothing else sets its fields. `DeadlineWatch` answers
504 at a waiting request's deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import msgspec

from batchserve import errors
from batchserve.core import tiers


class Work(msgspec.Struct, eq=False):
    """One request on its way. A Struct: built in C once per request (the hot path), mutable where the door
    fills it in."""

    request_id: str
    arrived: float  # time.monotonic() at the request's first byte
    tier: int = 1  # a tiers.Tier rank: the caller's
    tenant: str = ""  # the fair queue's lane
    owner: str = ""  # whose request records these are (the tenant, or anonymous@<address>)
    model: str = "unknown"  # the model version that answers, once the wing has picked it
    deadline: float = 0.0  # time.monotonic() by which the answer is due (arrived + the request's timeout)
    gone: Callable[[], bool] | None = None  # True once the caller has hung up
    inputs: int = 1  # inputs the request holds, as the door counted them
    cost: float = 1.0  # their cost units (tokens, or 1 an input), as the door priced them
    asked: str = ""  # the priority the request asked for ("": none), so its answer names the tier it ran at

    @property
    def timeout_s(self) -> float:
        """The request's whole timeout, from its first byte."""
        return self.deadline - self.arrived

    def due_in(self, timeout_s: float) -> Work:
        """This request due `timeout_s` after its first byte (the wing's parse reads the timeout)."""
        self.deadline = self.arrived + timeout_s
        return self

    def ask(self, value: str | int | None, tier: int, best: int, field: str) -> int:
        """Run at the priority the request asks for in `field` (a tier name or OpenAI's `service_tier`), within
        what the caller's key allows (its `tier`, up to `best`; above that, capped): the tier it is queued, shed
        and booked under. Returns that tier's rank."""
        if value is None:
            return tier
        rank = tiers.asked(value, tier, best)
        if rank is None:
            raise errors.invalid(
                f"'{field}' must be one of {', '.join(tiers.ASKABLE)}, or a level 0-{tiers.BATCH.rank + 1}"
            )
        self.tier, self.asked = rank, str(value)
        return rank

    @property
    def record_owner(self) -> str:
        """Under whom the request log keeps this request."""
        return self.owner or self.tenant


# -- the deadline watch --------------------------------------------------------------------------------------------
# Answer 504 at each waiting caller's deadline with one loop timer per timeout value, not one per request (a
# `loop.call_at` + `cancel` costs ~4.5 µs on uvloop; an append costs well under one). Callers that share a timeout
# arrive in deadline order, so each value keeps a FIFO of (deadline, future) with one timer armed for its head. An
# entry out of order (its body took longer to read) is answered with the one ahead of it, a few ms late at most; the
# batcher never batches an item past its deadline either way (`Item.alive`).
KEYS_KEPT = 1024  # distinct timeouts whose lane key is remembered (callers may send any timeout_ms)


class DeadlineWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lanes: dict[float, deque[tuple[float, asyncio.Future]]] = {}
        self._timers: dict[float, asyncio.TimerHandle] = {}
        self._keys: dict[float, float] = {}  # timeout -> its lane key, so round() runs once per timeout value

    def watch(self, timeout_s: float, deadline: float, future: asyncio.Future) -> None:
        """Fail `future` with 504 DEADLINE_EXCEEDED at `deadline` unless it is done by then."""
        key = self._keys.get(timeout_s)
        if key is None:  # round() costs ~0.2-0.5 us: once per distinct timeout (at most KEYS_KEPT kept)
            key = round(timeout_s, 3)
            if len(self._keys) < KEYS_KEPT:
                self._keys[timeout_s] = key
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = deque()
        else:
            # The answered entries at its head go now rather than at the sweep: a lane then holds about the
            # requests in flight, not a whole timeout's worth of futures for the collector to scan.
            while lane and lane[0][1].done():
                lane.popleft()
        lane.append((deadline, future))
        if key not in self._timers:
            self._arm(key, deadline)

    def _arm(self, key: float, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(loop.time() + max(0.0, deadline - self.clock()), self._sweep, key)

    def _sweep(self, key: float) -> None:
        del self._timers[key]
        lane = self._lanes[key]
        now = self.clock()
        while lane:
            deadline, future = lane[0]
            if future.done():
                lane.popleft()
            elif deadline <= now:
                lane.popleft()
                future.set_exception(errors.deadline_exceeded())
            else:
                self._arm(key, deadline)
                return
        del self._lanes[key]

    def pending(self) -> int:
        """Entries held, answered or not (for tests and the curious)."""
        return sum(len(lane) for lane in self._lanes.values())
