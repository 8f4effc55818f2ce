"""Staging (docs/architecture.md): the next full batch put into a busy worker's inbox shortly before its batch
ends, so that the device's thread begins it the moment the batch ends instead of idling until the loop hears of
the end. Asked by an arrival within `--stage-lead-ms` of the end (`Batcher.stage_after`) or by the worker's
staging timer, armed while a full batch waits (closed-loop callers send nothing near a batch's end).

Apart from the pool because the hand-off works the same without it (`--stage-lead-ms 0`) and its timers are its
own. `DeviceWorker`, the state both share, lives here so the two modules do not import each other.
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
    # `batch.cost`, read once when handed: admission reads it per request, and the property walks every item.
    batch_cost: float = 1.0
    busy_s: float = 0.0  # completed batch time, for the busy ratio
    batches: int = 0
    generation: int = 0  # bumped when the worker is abandoned, so a late answer is recognised and dropped
    # Written by the worker thread, read by the watchdog (a stalled loop may not have heard of `finished` yet).
    running: Batch | None = None
    running_since: float = 0.0
    finished: Batch | None = None
    thread: DeviceThread | None = None  # the device's own thread: setup and warm-up ran on it too
    watchdog: asyncio.TimerHandle | None = None  # fires at started + gpu_timeout unless the batch ends first
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    staged: Batch | None = None  # a full batch already in the inbox, begun the moment `batch` ends
    staged_cost: float = 1.0
    ends: float = math.inf  # when `batch` is expected to end (this clock)
    stage_timer: asyncio.TimerHandle | None = None  # `Staging._arm`; `timed` is the batch it was armed for
    timed: Batch | None = None
    free_at: float = math.inf  # `ends` plus the staged batch's expected time (read on every admission)

    def busy_total(self, now: float) -> float:
        return self.busy_s + (now - self.started if self.batch is not None else 0.0)


@dataclass(eq=False)
class Staging:
    """The pool's staging. The pool calls `open` whenever a batch begins or a worker idles, `disarm` when a batch
    ends, `withdraw` when one hangs; the batcher calls `stage` (`Batcher.on_stage`)."""

    workers: list[DeviceWorker]  # `GpuPool.workers` itself: extended in place, never replaced
    batcher: Batcher
    metrics: Metrics
    loop: asyncio.AbstractEventLoop
    clock: Clock
    count: Callable[[Batch], None]  # `GpuPool._count`
    lead_s: float = 0.0  # --stage-lead-ms: how long before a batch's expected end its successor may form
    _timer_late: float = 0.0  # how late the loop ran staging timers lately (a decaying maximum, at most the lead)

    def open(self) -> None:
        """Tell the batcher from when an arrival may stage (`Batcher.stage_after`), and arm a busy worker's
        staging timer while a full batch waits; while none does, ask the batcher to call again when an arrival
        fills a queue (`Batcher.stage_when_full`)."""
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
        """Stage the full batch waiting behind `w`'s `lead_s` before its expected end even if no arrival comes then
        to ask (closed-loop callers wait for answers: the device would idle between batches). One timer per batch,
        so an idle loop is never woken for it; set early by the loop's recent lateness in running timers
        (`_timer_late`): on a busy machine they run late, often after the batch has ended."""
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
        """`w` hung: take its staged batch back from the inbox (its items run elsewhere) and its timer off. False
        when the thread ended the batch just now and began the staged one: not hung after all."""
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
        """`w`'s staging timer: stage into `w` if the batch it was armed for still runs with nothing behind it."""
        w.stage_timer = None
        now, lead = self.clock(), self.lead_s
        # Set early by the most recent lateness, decaying: being early costs little (a full batch holds nearly
        # the same a few ms later), being late the whole hop.
        late = min(max(0.0, now - at), lead)
        self._timer_late = max(late, self._timer_late * (1.0 - TIMER_LATE_DECAY))
        if w.batch is batch and self._stageable(w, now) and self._stage_into(w, now):
            self.open()

    def stage(self) -> None:
        """An item arrived within `lead_s` of a busy worker's expected end, or filled a queue while a busy worker
        has no staging timer yet: stage into that worker, then `open` (which arms the timer)."""
        now, lead = self.clock(), self.lead_s
        for w in self.workers:
            if w.staged is None and w.batch is not None and now >= w.ends - lead and self._stageable(w, now):
                self._stage_into(w, now)  # none when no full batch waits (or a retry or an idle worker goes
                break  # first): an arrival asks again
        self.open()

    def _stage_into(self, w: DeviceWorker, now: float) -> bool:
        """Put the next full batch into busy `w`'s inbox; False when none is staged. Only a full batch: it holds
        nearly what it would hold formed a moment later, while a partial batch formed early would leave out what
        arrives meanwhile."""
        staged = self.batcher.take_full(w.index, starts=max(now, w.ends))
        if staged is None:
            return False
        w.staged, w.staged_cost = staged, staged.cost
        w.free_at = w.ends + self.batcher.batch_s.at(staged.model, w.staged_cost)  # begun as `batch` ends
        w.inbox.put(staged)
        self.count(staged)
        self.metrics.batches_staged.labels(staged.model).inc()
        return True

    def _stageable(self, w: DeviceWorker, now: float) -> bool:
        """Whether a batch may be staged behind busy `w`'s: not when it is unhealthy or has one staged, nor behind a
        batch overdue by more than the lead and still running (a long batch, a hang): it could wait long, while
        higher-tier work arriving meanwhile would go first in a batch formed later."""
        return w.healthy and w.staged is None and (now <= w.ends + self.lead_s or w.finished is w.batch)
