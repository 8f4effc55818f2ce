"""How job work goes through the door, and the account of it while it is there: the scheduler decides which jobs
feed and how many inputs (`refill.py`); the feeder puts them in, as rows, lines or groups of their own.

Every write to the places (`Ledger`) and to a job's rows in flight (`JobState.inflight`, `charged`, `open`,
`shared`) is here, so what the scheduler reads of them is always what the batcher holds: an input takes its place
as it is fed and gives it back when it is answered or withdrawn, whichever way it went in.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batchserve.core.fairqueue import Item
from batchserve.jobs.job_state import JobState
from batchserve.jobs.lines import Entrance, LineRun, LineRunner
from batchserve.jobs.refill import Ledger, mean_cost

log = logging.getLogger("batchserve.jobs")

ITEM_DEADLINE_S = 600.0  # a job item is in no hurry; past this in the queue it is answered 504 and retried


Answered = Callable[[JobState, int, str, asyncio.Future], None]  # (job, index, row text, its done future)


@dataclass(eq=False)
class Feeder:
    """The one writer of the places job inputs hold, kept apart so the scheduler's refill reads as policy alone."""

    door: Entrance
    lines: LineRunner | None  # runs the lines of OpenAI Batch API jobs
    wake: asyncio.Event  # the scheduler's feed loop: set whenever places come free
    answered: Answered  # a row answered for a job still wanted: the scheduler records or retries it
    ledger: Ledger = field(default_factory=Ledger)  # job inputs in flight, by path, tenant and model
    job_unit: dict[str, float] = field(default_factory=dict)  # per model: the mean cost of its job inputs

    def feed(self, job: JobState, n: int, alone: bool) -> int:
        """Feed up to `n` of the job's inputs: its open lines' next inputs first, then its next rows (a row
        after a hang goes alone, in the isolated count). Returns the inputs fed on this budget."""
        fed = 0
        while fed < n:
            if job.open:
                index, run = next(iter(job.open.items()))
                fed += self._feed_line(job, index, run, n - fed, alone or index not in job.shared)
                continue
            if not job.buffer:
                break
            index, text = job.buffer.popleft()
            if index in job.hung:  # after a hang, an item runs alone: the culprit hangs only itself
                self.submit_group(job, [(index, text)])
                continue
            if job.endpoint is not None and self.lines is not None:  # rows go alone by `submit_group`, not here
                self._start_line(job, index, text, shared=not alone)
                continue
            item = self.door.submit_background(text, job.model, job.tenant, ITEM_DEADLINE_S)
            self._track(job, index, text, item, shared=True)
            self._priced(job, index, item)
            fed += 1
        return fed

    def submit_group(self, job: JobState, rows: list[tuple[int, str]]) -> None:
        """Items of one job as a batch of their own, in the background share (isolated job, or after a hang);
        a line is started and fed alone, an input at a time, by the isolated path (`feed`)."""
        if job.endpoint is not None and self.lines is not None:
            for index, text in rows:
                self._feed_line(job, index, self._start_line(job, index, text, shared=False), 1, alone=True)
            return
        items = self.door.submit_group([text for _, text in rows], job.model, job.tenant, ITEM_DEADLINE_S)
        for (index, text), item in zip(rows, items):
            self._track(job, index, text, item, shared=False)
            self._priced(job, index, item)

    def reroute(self, job: JobState) -> None:
        """The job was just isolated: take its items no batch has taken yet off the shared path (each would
        cost its batch-mates re-runs there) and give them back to the job, to run in groups of its own."""
        back = []
        for index in sorted(job.shared):
            item = job.inflight[index]
            if not item.dispatched and not item.future.done():
                self._forget(job, index)
                item.future.cancel()  # the batcher drops it (a line: every input it fed)
                back.append((index, item.text))
            else:  # running, or in a bisection re-run (background batches): counted with the isolated now
                self.ledger.isolate(job.tenant, job.charged.get(index, 0))
        job.shared.clear()
        job.buffer.extendleft(reversed(back))
        log.info(
            "batch %s: isolated after %d costly failures in its last %d items; %d queued item(s) moved to "
            "its own batches",
            job.id,
            sum(job.recent),
            len(job.recent),
            len(back),
        )

    def release_queued(self, jobs: Iterable[JobState]) -> None:
        """Draining: take back the items no batch has taken yet (they stay pending for the next start)."""
        for job in jobs:
            for item in list(job.inflight.values()):
                if not item.dispatched:
                    item.future.cancel()

    def _feed_line(self, job: JobState, index: int, run: LineRun, n: int, alone: bool) -> int:
        """Feed up to `n` inputs of one line, each priced as it goes in (its place held until it is answered)."""
        fed = 0
        while fed < n and run.unfed:
            item = run.feed(alone)
            self._priced(job, index, item)
            if item is not None:
                item.future.add_done_callback(functools.partial(self._input_done, job, index, run))
            fed += 1
        if not run.unfed:
            job.open.pop(index, None)
        return fed

    def _start_line(self, job: JobState, index: int, text: str, shared: bool) -> LineRun:
        assert job.endpoint is not None and self.lines is not None
        run = self.lines.start(job.endpoint, text, job.model, job.tenant, ITEM_DEADLINE_S, job.expires_at)
        self._track(job, index, text, run, shared)
        return run

    def _track(self, job: JobState, index: int, text: str, item: Item | LineRun, shared: bool) -> None:
        """The row is in flight (its inputs priced as they are fed); a line with inputs to feed is open."""
        job.inflight[index] = item
        job.charged[index] = 0
        if shared:
            job.shared.add(index)
        if isinstance(item, LineRun):
            if item.inputs:  # a line's price, learned: how many rows to claim for the inputs wanted
                job.lines_seen += 1
                job.line_inputs += (item.inputs - job.line_inputs) / min(job.lines_seen, 20)
            if item.unfed:
                job.open[index] = item
        item.future.add_done_callback(functools.partial(self._done, job, index, text))

    def _priced(self, job: JobState, index: int, item: Item | None) -> None:
        """One more input of the row is in flight: it takes a place (shared, or isolated) and its model's room."""
        job.charged[index] = job.charged.get(index, 0) + 1
        self.ledger.add(job.tenant, job.model, 1, index in job.shared)
        self.job_unit[job.model] = mean_cost(self.job_unit.get(job.model), item.cost if item is not None else 1.0)

    def _release(self, job: JobState, index: int, n: int | None = None) -> None:
        """`n` (None: all) of the row's priced inputs are answered or withdrawn: their places are free."""
        held = job.charged.get(index, 0)
        n = held if n is None else min(n, held)
        if n <= 0:
            return
        job.charged[index] = held - n
        self.ledger.add(job.tenant, job.model, -n, index in job.shared)
        self.wake.set()

    def _forget(self, job: JobState, index: int) -> None:
        """The row is no longer in flight: its places are given back."""
        self._release(job, index)
        del job.inflight[index]
        job.charged.pop(index, None)
        job.open.pop(index, None)
        job.shared.discard(index)

    def _input_done(self, job: JobState, index: int, run: LineRun, fut: asyncio.Future) -> None:
        if job.inflight.get(index) is run:  # not a line taken back (`reroute`) or answered already
            self._release(job, index, 1)

    def _done(self, job: JobState, index: int, text: str, fut: asyncio.Future) -> None:
        """The row's future is done: its places are given back, and an answer for a job still wanted goes on."""
        current = job.inflight.get(index)
        if current is None or current.future is not fut:
            return  # taken off the shared path by `reroute` (which settled its counts), perhaps resubmitted
        self._forget(job, index)
        self.wake.set()
        if fut.cancelled() or job.cancelled:
            return
        self.answered(job, index, text, fut)
