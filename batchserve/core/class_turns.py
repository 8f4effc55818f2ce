"""When a new input's batch starts, given the length classes' turns.

A costed model has one queue per length class (`bucket_of`), served in turns: among the classes with items waiting,
the one served least recently goes next (`Batcher.most_urgent`), one batch a turn. So a new input waits for its own
class's batches ahead of it and, between two of them, for one batch of every other class with items at that moment,
including items that arrive while it waits: under sustained load a drained class refills and takes a turn every
round (counting only the items queued at admission predicted ~2/3 of the wait, bench/cost_bench.py).

`drain` replays the turns: the current batch ends, then, turn by turn, the least recently served class with items
takes a batch (ties: the other classes before the new input's, the later arrival); the other classes grow by their
arrival rates; the new input's class first serves the rows ahead of it, then its own batch (later arrivals up to
the batch's limit make that batch costlier but no later). Pure arithmetic over numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable

MIN_ROWS = 0.5  # a class expected to hold at least this many items takes its turn (a Poisson queue: likely)
MAX_TURNS = 64  # turns replayed (each a few us: the door runs this per request); past them, extrapolated

BatchSeconds = Callable[[float, float], float]  # (rows, mean cost of a row) -> expected batch time, s


@dataclass
class ClassQueue:
    """Another length class's queue as the new input sees it."""

    rows: float  # its items the new input waits behind (its tier share), growing with arrivals
    unit: float  # the mean cost of its inputs
    per: int  # rows in one of its batches (what the budget holds of `unit`)
    rate: float  # inputs per second joining it
    last: float  # when it was last served (the turn order: least recently first)


@dataclass(frozen=True)
class Own:
    """The new request's class: the rows ahead of it there, and its own inputs."""

    ahead: int  # rows of its class queued ahead of it
    ahead_unit: float  # their mean cost
    ahead_per: int  # rows in one batch of them
    n: int  # its own inputs
    unit: float  # the cost of its longest input (its batches are padded to it)
    per: int  # rows in one batch of its inputs
    rate: float  # inputs per second joining its class (behind it: they only fill its last batch)
    last: float  # when its class was last served


@dataclass(slots=True)  # not frozen: a frozen dataclass is built through object.__setattr__, ~3x slower per request
class WaitPrediction:
    """Seconds from now: the request's first batch starts (`wait_s`, the queue part), its first and last
    inputs are answered."""

    first_s: float
    last_s: float
    wait_s: float = 0.0

    def scaled(self, factor: float) -> WaitPrediction:
        """The same with its queue part multiplied by `factor` (the door's learned error, `WaitCalibration`)."""
        extra = self.wait_s * (factor - 1.0)
        return WaitPrediction(self.first_s + extra, self.last_s + extra, self.wait_s + extra)


def drain(
    now: float, until_free_s: float, share: int, own: Own, others: list[ClassQueue], batch_s: BatchSeconds
) -> WaitPrediction:
    """Replay the class turns from `now` (module docstring). `share`: healthy workers, each batch takes 1/share
    of a worker's time; `until_free_s`: the time until the first of them is free."""
    share = max(1, share)
    t, seconds = _replay_start(until_free_s, others, batch_s)
    own_last, ahead, left = own.last, own.ahead, max(1, own.n)
    wait_s = first_s = -1.0
    own_turns = 0
    for _ in range(MAX_TURNS):
        # The least recently served class with items goes next; the new input's class is always waiting.
        pick: ClassQueue | None = None
        for q in others:
            if q.rows >= MIN_ROWS and q.last <= own_last and (pick is None or q.last < pick.last):
                pick = q
        if pick is not None:
            rows = min(float(pick.per), max(1.0, pick.rows))
            dt = seconds(rows, pick.unit) / share
            pick.rows = max(0.0, pick.rows - rows)
            pick.last = now + t
        elif ahead and ahead + 1 > own.per:  # a batch of the rows ahead leaves without it
            rows = min(own.ahead_per, ahead)
            dt = seconds(rows, own.ahead_unit) / share
            ahead -= rows
            own_last, own_turns = now + t, own_turns + 1
        else:  # a batch holding its inputs: the rows ahead, as many of its own as fit, later arrivals
            mine = min(left, own.per - ahead)
            rows = ahead + mine
            if mine == left:
                rows = min(float(own.per), rows + own.rate * t)
            took = seconds(rows, own.unit)
            if wait_s < 0:
                # Its first input as `wait_prediction.predict` counts it: in a batch of the rows ahead and itself (a
                # request of many inputs is bounded by the objective at its first, by the deadline at its last).
                wait_s, first_s = t, t + (took if left == 1 else seconds(ahead + 1, own.unit))
            left -= mine
            ahead = 0
            if not left:
                return WaitPrediction(first_s, max(first_s, t + took), wait_s)
            dt = took / share
            own_last, own_turns = now + t, own_turns + 1
        for q in others:
            q.rows += q.rate * dt
        t += dt
    # Past the turns replayed (a queue of thousands, or a request of thousands of inputs): the rest at the pace
    # of the turns so far, per batch of its class.
    pace = t / max(1, own_turns)
    rest = math.ceil(ahead / max(1, own.ahead_per)) + math.ceil(left / max(1, own.per))
    end = t + rest * pace
    if wait_s < 0:
        wait_s = t + math.ceil(ahead / max(1, own.ahead_per)) * pace
        first_s = wait_s + seconds(min(own.per, left), own.unit)
    return WaitPrediction(first_s, max(first_s, end), wait_s)


def _replay_start(until_free_s: float, others: list[ClassQueue], batch_s: BatchSeconds) -> tuple[float, BatchSeconds]:
    """Where `drain`'s turns begin, apart so that `drain` reads as the turns alone: the time until the first worker
    is free, the other classes grown by what joins them meanwhile, and `batch_s` memoized (most turns are full
    batches of a few classes: S is read once each)."""
    t = max(0.0, until_free_s)
    memo: dict[tuple[float, float], float] = {}

    def seconds(rows: float, unit: float) -> float:
        got = memo.get((rows, unit))
        if got is None:
            got = memo[(rows, unit)] = batch_s(rows, unit)
        return got

    for q in others:
        q.rows += q.rate * t
    return t, seconds
