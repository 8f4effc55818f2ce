"""Staging (docs/architecture.md): the next full batch put into a busy worker's inbox shortly before its batch
ends, so that the device's thread begins it the moment the batch ends instead of idling until the loop hears of
the end. Asked by an arrival within `--stage-lead-ms` of the end (`Batcher.stage_after`) or by the worker's
staging timer, armed while a full batch waits (closed-loop callers send nothing near a batch's end).

Apart from the pool (`gpu_pool.py`): the hand-off works the same without it (`--stage-lead-ms 0` turns it off),
and it keeps state of its own (one timer per busy worker, the loop's lateness in running them). `DeviceWorker`
lives here too, below both, as the state they share: in `gpu_pool.py` it would make the two modules import each
other.
"""

from __future__ import annotations

import asyncio
import math
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from batchserve.backends.device_thread import DeviceThread
from batchserve.core.batcher import Batcher, Clock
from batchserve.core.batch import Batch
from batchserve.metrics import Metrics

TIMER_LATE_DECAY = 0.2  # `Staging._timer_late` loses this share of itself with each staging timer run in time


@dataclass(eq=False)
class DeviceWorker:
    index: int
    name: str
    healthy: bool = True
    batch: Batch | None = None
    started: float = 0.0
    # `batch.cost`, read once when the batch is handed: admission asks every request how long the running
    # batch has left, and the property walks every item (or tokenizes, for a model with cost_of_batch).
    batch_cost: float = 1.0
    busy_s: float = 0.0  # completed batch time, for the busy ratio
    batches: int = 0
    generation: int = 0  # bumped when the worker is abandoned, so a late answer is recognised and dropped
    # Written by the worker thread, read by the watchdog: the batch it runs and when it began it, by the
    # thread's own clock, and the last batch it finished (a stalled loop may not have heard of it yet).
    running: Batch | None = None
    running_since: float = 0.0
    finished: Batch | None = None
    thread: DeviceThread | None = None  # the device's own thread: setup and warm-up ran on it too
    watchdog: asyncio.TimerHandle | None = None  # fires at started + gpu_timeout unless the batch ends first
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # the loop hands batches to the thread
    # A full batch formed while `batch` runs and already in the inbox (`Staging.stage`): the thread begins it the
    # moment `batch` ends, without waiting for the loop to hear of the end. Its cost, read once as `batch_cost`.
    staged: Batch | None = None
    staged_cost: float = 1.0
    ends: float = math.inf  # when `batch` is expected to end (this clock): staging opens `lead_s` before
    # The staging timer (`Staging._arm`): at most one per batch, armed while a full batch waits behind `batch`
    # (`timed` is the batch it was armed for) and fired `lead_s` before `ends`.
    stage_timer: asyncio.TimerHandle | None = None
    timed: Batch | None = None
    # When the worker is expected to be free: `ends`, plus the staged batch's expected time (read on every admission).
    free_at: float = math.inf

    def busy_total(self, now: float) -> float:
        return self.busy_s + (now - self.started if self.batch is not None else 0.0)


@dataclass(eq=False)
class Staging:
    """The pool's staging, made by `GpuPool` over its own workers, batcher, loop and clock; apart from it because
    the hand-off works the same without it and its timers and their lateness are its own. The pool calls `open`
    whenever a batch begins or a worker idles, `disarm` when a batch ends, `withdraw` when one hangs; the batcher
    calls `stage` (`Batcher.on_stage`)."""

    workers: list[DeviceWorker]  # the pool's list itself (`GpuPool.workers`): extended in place, never replaced
    batcher: Batcher
    metrics: Metrics
    loop: asyncio.AbstractEventLoop
    clock: Clock
    count: Callable[[Batch], None]  # a batch formed for a worker, into the metrics (`gpu_pool.BatchRecords.count`)
    lead_s: float = 0.0  # --stage-lead-ms: how long before a batch's expected end its successor may form
    _timer_late: float = 0.0  # how late the loop ran the staging timers lately (a decaying maximum, at most the lead)

    def open(self) -> None:
        """Tell the batcher from when an arrival may stage (`Batcher.stage_after`): `lead_s` before the
        soonest expected end of a healthy worker's batch with nothing staged behind it (inf: none). And arm such a
        worker's staging timer (`_arm`) while a full batch waits; while none does, ask the batcher to call again
        when an arrival fills a queue (`Batcher.stage_when_full`)."""
        lead = self.lead_s
        if lead <= 0:
            return
        soonest = math.inf
        full: bool | None = None  # whether a full batch waits: read once, and only for a worker without its timer
        unarmed = False
        for w in self.workers:
            if w.healthy and w.batch is not None and w.staged is None:
                if w.ends < soonest:
                    soonest = w.ends
                if w.timed is not w.batch:
                    if full is None:
                        full = self.batcher.full_waiting()
                    if full:
                        self._arm(w)
                    else:
                        unarmed = True
        self.batcher.stage_after = soonest - lead
        self.batcher.stage_when_full = unarmed

    def _arm(self, w: DeviceWorker) -> None:
        """A full batch waits behind `w`'s batch: stage it `lead_s` before the batch's expected end even
        if no arrival comes then to ask (`stage`). Closed-loop callers send again right after their answers, so
        near a batch's end nothing arrives, and without this every batch waited for the loop to hear of the end
        of the one before (bench/fair_service: the device idle ~5 % of the time while inputs waited). One timer
        per batch, and only while a full batch waits: an idle loop (nothing queued) is never woken for it.

        The end is reckoned from when the thread began the batch where it already has (a staged batch: the loop
        hears of it a hop later), and the timer is set early by the loop's recent lateness in running timers
        (`_timer_late`, at most the lead): on a busy machine they ran 3-8 ms late, often after the batch had
        ended, so that the batch forms about `lead_s` before the end as the lead means."""
        batch = w.batch
        assert batch is not None
        w.timed = batch
        ends = w.ends
        if w.running is batch and w.running_since < w.started:
            ends -= w.started - w.running_since
        now = self.clock()
        at = max(now, ends - self.lead_s - self._timer_late)
        w.stage_timer = self.loop.call_later(at - now, self._stage_on_time, w, batch, at)

    def disarm(self, w: DeviceWorker) -> None:
        if w.stage_timer is not None:
            w.stage_timer.cancel()
            w.stage_timer = None

    def withdraw(self, w: DeviceWorker) -> bool:
        """`w` hung: take its staged batch back from the inbox (its items go back to the head of their queue, to
        run elsewhere) and its timer off. False when the thread ended the batch just now and began the staged
        one: not hung after all (its turnaround, already queued, settles the batch)."""
        if w.staged is not None:
            try:
                w.inbox.get_nowait()
            except queue.Empty:
                return False
            staged, w.staged = w.staged, None
            self.batcher.return_items(staged.items)
        self.disarm(w)
        return True

    def _stage_on_time(self, w: DeviceWorker, batch: Batch, at: float) -> None:
        """`w`'s staging timer: stage into `w` now (`_stage_into`, with all its rules) if the batch it was armed
        for still runs on a healthy worker with nothing staged behind it."""
        w.stage_timer = None
        now, lead = self.clock(), self.lead_s
        # Set early by the most recent lateness, decaying: being early costs little (a full batch holds nearly
        # the same a few ms later), being late the whole hop.
        late = min(max(0.0, now - at), lead)
        self._timer_late = max(late, self._timer_late * (1.0 - TIMER_LATE_DECAY))
        if w.healthy and w.batch is batch and w.staged is None and not self._overdue(w, now):
            if self._stage_into(w, now):
                self.open()

    def stage(self) -> None:
        """An item arrived within `lead_s` of a busy worker's expected end (`Batcher.submit`): when a full
        batch waits, form it and put it in that worker's inbox (`_stage_into`). Also asked by an arrival that
        fills a queue while a busy worker has no staging timer yet (`Batcher.stage_when_full`): `open`
        then arms it (`_arm`)."""
        now, lead = self.clock(), self.lead_s
        for w in self.workers:
            if (
                w.healthy
                and w.batch is not None
                and w.staged is None
                and now >= w.ends - lead
                and not self._overdue(w, now)
            ):
                self._stage_into(w, now)  # none when no full batch waits (or a retry or an idle worker goes
                break  # first): an arrival asks again
        self.open()

    def _stage_into(self, w: DeviceWorker, now: float) -> bool:
        """Put the next full batch into busy `w`'s inbox; False when none is staged. Without it the device idles
        from the end of each batch until the loop has heard of it (a thread hop and a wake-up, more on a busy
        machine: measured ~2 ms a batch on the sim at 950 req/s, up to 14) and handed the next one. Only a full
        batch (`Batcher.take_full`): it holds nearly what it would hold formed a moment later, while a partial
        batch formed early would leave out what arrives meanwhile (the callers asked `_overdue` first)."""
        staged = self.batcher.take_full(w.index, starts=max(now, w.ends))
        if staged is None:
            return False
        w.staged, w.staged_cost = staged, staged.cost
        w.free_at = w.ends + self.batcher.batch_s.at(staged.model, w.staged_cost)  # begun as `batch` ends
        w.inbox.put(staged)
        self.count(staged)
        self.metrics.batches_staged.labels(staged.model).inc()
        return True

    def _overdue(self, w: DeviceWorker, now: float) -> bool:
        """Nothing is staged behind a batch overdue by more than the lead and still running (a long batch, a
        hang): a batch staged behind it could wait long, while work of a higher tier arrives that a batch formed
        when the worker frees would take first. Once its thread has ended it (the loop has not yet heard), the
        device is free and a staged batch begins at once."""
        return now > w.ends + self.lead_s and w.finished is not w.batch
