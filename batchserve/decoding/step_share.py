"""Which decode steps batch rows take part in, beside interactive ones (issue 33): pure policy, no torch.

Why: on a CPU a decode step's time grows with its first extra rows (on the 2-core machine a second row adds
~66% to a one-row step, eight rows cost barely more than two), and every interactive token waits on its step.
Capping batch rows cannot help once one batch row already costs more than the slowdown allowed: even a single
batch line beside one interactive chat made each of its tokens ~1.6x slower. So the slot stepper keeps the
background rows (spare lanes: the `batch` tier) out of some steps: it places them in high slots and runs a step
over the foreground rows' prefix alone (rows not in a step keep their state and do not advance), and this
ledger decides, step by step, whether the background rows go in.

The ledger (a "slowdown ledger"): it learns what a step of `rows` rows costs (an EMA per row count, from the
stepper's measured step times; a GPU's padded row bucket is the count), and keeps a credit in seconds. Each step
that runs while foreground rows are live and background work waits is booked at its cost less `slowdown` x
what a foreground-only step costs: a foreground-only step earns credit ((slowdown - 1) x its time), a full step
spends it (its extra time over slowdown x a foreground-only step), and background prefill run meanwhile spends
its time too (and may take only what the credit leaves after the step: `prefill_room`, `prefill_share.py`). The
background rows go into a step when the credit, after booking that step, stays at or above zero. So the time
foreground rows spend in steps (and waiting on background prefill) stays within `slowdown` x what
foreground-only steps would have cost, over every stretch of steps, to within one step. A step is booked
when it is launched, at its estimated cost, and corrected when its measured time comes back (one step later).

- With no foreground rows live there is nothing to protect: the stepper does not ask, every step runs all rows.
- Where rows are nearly free (a GPU: a full step costs about a foreground-only one) a full step costs less than
  slowdown x a foreground-only one: it earns credit too, and every step includes the background rows.
- Credit is capped at what one full step spends (never less than one foreground-only step earns), so a long
  stretch without background work does not bank a burst of full steps; debt is floored likewise.
- Never starved: after `max_skip` foreground-only steps in a row the next step includes the background rows
  whatever the credit, so while foreground work runs background rows advance in at least one step of every
  `max_skip` + 1 (`MAX_SKIP` = 8: a batch line's tokens come at least a ninth as often as with every step;
  a batch line's completion window is hours, a step tens of milliseconds). Without foreground work every step.
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
        """`slowdown`: the most background work may lengthen the foreground rows' steps (>= 1); `seed`: step
        times by rows already measured (the decoder's warm-up)."""
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
        """Whether the next step covers the background rows (`rows` rows in all) or only the foreground prefix
        (`foreground_rows`). A step time not yet measured is measured first: the full one, then the other."""
        if self.skipped >= self.max_skip:
            return True
        full, alone = self.seconds.get(rows), self.seconds.get(foreground_rows)
        if full is None and rows not in self._timing:
            return True
        if full is None or alone is None:  # the one step being timed, then the other; meanwhile the cheap one
            return False
        return self.credit + self.slowdown * alone - full >= 0

    def dear(self, foreground_rows: int, rows: int) -> bool:
        """Whether a step of `rows` rows may cost more than slowdown x one of `foreground_rows` (not yet known:
        it may): only then is it worth moving rows so that steps can leave the background ones out."""
        full, alone = self.seconds.get(rows), self.seconds.get(foreground_rows)
        return full is None or alone is None or full > self.slowdown * alone

    def book(self, rows: int, foreground_rows: int, background: bool) -> Booking:
        """A step is launched with foreground rows live while background work waits: `rows` rows, `background`
        whether the background rows (or any) took part. Books its estimated cost now (a step's measured time
        comes back one step later)."""
        full, alone = self.seconds.get(rows), self.seconds.get(foreground_rows)
        booked = full - self.slowdown * alone if full is not None and alone is not None else 0.0
        if full is None:
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
        if booking is None:
            return
        alone = self.seconds.get(booking.foreground_rows)
        if alone is None:
            return
        self.credit += booking.booked - (seconds - self.slowdown * alone)
        self._bound(booking)

    def prefill_room(self, foreground_rows: int, rows: int) -> float:
        """Seconds of background prefill the credit affords before a step of `rows` rows (background prefill
        runs only in steps the background rows go in), once that step is booked: spent before it runs, so the
        prefill keeps to the slowdown as the rows do (`prefill_share`)."""
        full, alone = self.seconds.get(rows), self.seconds.get(foreground_rows)
        if full is None or alone is None:
            return self.credit
        return self.credit + self.slowdown * alone - full

    def charge(self, seconds: float) -> None:
        """Background work outside the steps (its prefill) held the foreground rows up `seconds`."""
        self.credit -= seconds
        self.credit = max(self.credit, -self._debt_floor())

    def _bound(self, booking: Booking) -> None:
        alone = self.seconds.get(booking.foreground_rows, 0.0)
        dearest = max(self.seconds.values())
        # enough for the dearest step known, or one foreground-only step's earning, whichever is more
        top = max(dearest - self.slowdown * alone, (self.slowdown - 1) * alone, 0.0)
        self.credit = min(top, max(self.credit, -self._debt_floor()))

    def _debt_floor(self) -> float:
        return DEBT_STEPS * self.slowdown * max(self.seconds.values(), default=0.0)
