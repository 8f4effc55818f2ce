"""Re-runs and the background share: the batches that do not come from the queues.

Retried sub-batches (bisection after a failure, a hang's re-runs: `gpu_pool`) of interactive items go before new
work; those of batch-job items, and the groups of a job isolated for failing, go after it as background batches (a
failing job must not hold the workers): at most one dispatch in `BACKGROUND_EVERY + 1` while other work is due, so
another tenant's clean job keeps most of the workers and the failing job still moves, and one in
`BACKGROUND_FLOOR_EVERY + 1` while interactive items wait.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchserve import errors
from batchserve.core import tiers
from batchserve.core.batch import Batch, BatchTimes
from batchserve.core.fairqueue import Item

BACKGROUND_EVERY = 4  # regular dispatches between two background batches while both wait (a 1/5 share)
# Even while interactive items wait, a background batch goes after this many regular dispatches: a floor, so an
# isolated job (or a job's re-runs) always moves under steady interactive load, at the cost of one dispatch in
# 51 to the interactive items then waiting (2 %: below what moves their p95).
BACKGROUND_FLOOR_EVERY = 50


@dataclass
class Retries:
    """The re-runs waiting, interactive and background, and how many regular dispatches went since the last
    background batch."""

    interactive: deque[Batch] = field(default_factory=deque)  # re-runs holding interactive items: before new work
    background: deque[Batch] = field(default_factory=deque)  # re-runs of job items, isolated jobs: after all of it
    since_background: int = 0

    def requeue(self, batch: Batch, now: float) -> None:
        """Run these items again as they are: before any new work when the batch holds an interactive item,
        else (only batch-job items) in the background share."""
        batch.formed = now
        background = all(item.tier >= tiers.BATCH.rank for item in batch.items)
        (self.background if background else self.interactive).append(batch)

    def isolate(self, items: list[Item], now: float) -> None:
        """Batch-job items of one job that run as a batch of their own, in the background share."""
        self.background.append(Batch(items[0].model, items, now, "isolated", isolated=True))

    def background_turn(self, interactive_waiting: int) -> bool:
        """A background batch goes before due regular work: its share is due and no interactive item waits, or
        its floor is due whatever waits (`BACKGROUND_FLOOR_EVERY`: only gaps would starve it under steady load)."""
        if not self.background:
            return False
        return self.since_background >= BACKGROUND_FLOOR_EVERY or (
            self.since_background >= BACKGROUND_EVERY and not interactive_waiting
        )

    def take(self, worker: int, now: float, background: bool, healthy: int, batch_s: BatchTimes) -> Batch | None:
        """The oldest re-run (interactive, or `background`) this worker may run: one that failed on it goes to
        another healthy worker, unless none has taken it within two batch times (any busy worker is free by
        then)."""
        waiting = self.background if background else self.interactive
        for batch in list(waiting):
            batch.items = [i for i in batch.items if i.alive(now)]
            if not batch.items:
                waiting.remove(batch)
                continue
            if (
                batch.avoid_worker == worker
                and healthy > 1
                and now - batch.formed < 2 * batch_s.at(batch.model, batch.cost)
            ):
                continue
            waiting.remove(batch)
            batch.formed = now
            for item in batch.items:
                item.dispatched = now
            self.since_background = 0 if background else self.since_background + 1
            return batch
        return None

    def drop_all(self, err: errors.ApiError) -> int:
        """Answer every waiting re-run's items with `err`; returns how many were answered."""
        answered = 0
        for batch in (*self.interactive, *self.background):
            for item in batch.items:
                if not item.future.done():
                    item.future.set_exception(err)
                    answered += 1
        self.interactive.clear()
        self.background.clear()
        return answered
