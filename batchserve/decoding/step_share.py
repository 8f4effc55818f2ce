"""Which decode steps batch rows take part in, beside interactive ones: pure policy, no torch.

Why: on a CPU a decode step's time grows with its first extra rows (a second row adds ~66% to a one-row step),
and every interactive token waits on its step, so even one batch row can cost more than the slowdown allows and
capping rows cannot help. So the slot stepper seats background rows (the `batch` tier) in high slots and may run
a step over the foreground prefix alone; this ledger decides, step by step, whether the background rows go in.

The slowdown ledger learns each row count's step time (an EMA of measured steps) and keeps a credit in seconds.
Each step run while foreground rows are live and background work waits is booked at its cost less `slowdown` x
a foreground-only step's: a foreground-only step earns credit, a full step spends it, and background prefill
spends its time too (`prefill_room`). The background rows go in when the credit stays >= 0 after booking, so the
foreground rows' time stays within `slowdown` x foreground-only steps', to within one step. A step is booked at
launch, at its estimate, and corrected when its measured time comes back (one step later).

- With no foreground rows live every step runs all rows.
- Where rows are nearly free (a GPU) a full step earns credit too, and every step includes the background rows.
- Credit is capped at what one full step spends, so idle stretches bank no burst; debt is floored likewise.
- Never starved: after `max_skip` foreground-only steps in a row the next includes the background rows whatever
  the credit (a batch line's window is hours, a step tens of milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SKIP = 8  # foreground-only steps in a row at most while background work waits (see the module's doc)
EMA_WEIGHT = 0.2  # weight of each new measurement in a row count's step time
DEBT_STEPS = 4  # the deepest debt: this many slowdown x foreground-only steps


@dataclass(frozen=True, slots=True)
class Booking:
    """A launched step as the ledger booked it: its rows, its foreground rows, and the credit it took."""

    rows: int
    foreground_rows: int
    booked: float  # estimated step time less slowdown x a foreground-only step (0: not yet estimable)


class StepShare:
    """The slowdown ledger: whether background rows go into the next decode step (see the module's doc)."""

    def __init__(self, slowdown: float, max_skip: int = MAX_SKIP, seed: dict[int, float] | None = None) -> None:
        """`slowdown` (>= 1): see the module doc; `seed`: step times by rows already measured (the warm-up)."""
        self.slowdown = max(1.0, slowdown)
        self.max_skip = max(0, max_skip)
        self.seconds: dict[int, float] = dict(seed or {})  # a step's time by rows (EMA)
        self.credit = 0.0
        self.skipped = 0  # foreground-only steps in a row while background work waited
        self.full_steps = 0  # steps with foreground and background rows (booked)
        self.foreground_steps = 0  # steps of the foreground rows alone while background work waited
        self.forced_steps = 0  # full steps taken for the starvation bound, against the credit
        self._timing: set[int] = set()  # row counts booked but not yet measured

    def include(self, foreground_rows: int, rows: int) -> bool:
        """Whether the next step covers all `rows` or only `foreground_rows`; an unmeasured step is timed first."""
        if self.skipped >= self.max_skip or (rows not in self.seconds and rows not in self._timing):
            return True
        cost = self._cost(foreground_rows, rows)  # None: one step is being timed; meanwhile the cheap one
        return cost is not None and self.credit - cost >= 0

    def dear(self, foreground_rows: int, rows: int) -> bool:
        """Whether `rows` may cost over slowdown x `foreground_rows` (unknown: may): only then are moves worth it."""
        cost = self._cost(foreground_rows, rows)
        return cost is None or cost > 0

    def book(self, rows: int, foreground_rows: int, background: bool) -> Booking:
        """Book a step launched while background work waits, at its estimate; `background`: its rows took part."""
        booked = self._cost(foreground_rows, rows) or 0.0
        if rows not in self.seconds:
            self._timing.add(rows)
        if background:
            if self.skipped >= self.max_skip and self.credit - booked < 0:
                self.forced_steps += 1
            self.full_steps += 1
            self.skipped = 0
        else:
            self.foreground_steps += 1
            self.skipped += 1
        self.credit -= booked
        return Booking(rows, foreground_rows, booked)

    def measured(self, rows: int, seconds: float, booking: Booking | None = None) -> None:
        """A step of `rows` rows took `seconds`: learn it; if it was booked, correct the booking with it."""
        self._timing.discard(rows)  # even a step whose time could not be read: include() must not wait on it
        if seconds <= 0:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + EMA_WEIGHT * (seconds - old)
        if booking is None or (alone := self.seconds.get(booking.foreground_rows)) is None:
            return
        self.credit += booking.booked - (seconds - self.slowdown * alone)
        # bounded: enough for the dearest step known, or one foreground-only step's earning, whichever is more
        top = max(max(self.seconds.values()) - self.slowdown * alone, (self.slowdown - 1) * alone, 0.0)
        self.credit = min(top, max(self.credit, -self._debt_floor()))

    def prefill_room(self, foreground_rows: int, rows: int) -> float:
        """Seconds of background prefill the credit affords once a step of `rows` rows is booked, so the prefill
        keeps to the slowdown as the rows do."""
        cost = self._cost(foreground_rows, rows)
        return self.credit if cost is None else self.credit - cost

    def _cost(self, foreground_rows: int, rows: int) -> float | None:
        """A step of `rows`' estimated time less slowdown x one of `foreground_rows` (None: either unmeasured)."""
        full, alone = self.seconds.get(rows), self.seconds.get(foreground_rows)
        return None if full is None or alone is None else full - self.slowdown * alone

    def charge(self, seconds: float) -> None:
        """Background work outside the steps (its prefill) held the foreground rows up `seconds`."""
        self.credit = max(self.credit - seconds, -self._debt_floor())

    def _debt_floor(self) -> float:
        return DEBT_STEPS * self.slowdown * max(self.seconds.values(), default=0.0)
