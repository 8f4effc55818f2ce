"""Feeds batch-job items into the batcher from spare capacity, and writes their results back.

Job items enter the batcher at tier `batch` (the lowest), with the job's owner as tenant, so they only fill the
places interactive requests leave in each batch; how many may be in flight is `refill.py`'s, and `feeder.py` puts
them through the door. They never make a batch go sooner than the workers' pace (`FairQueue.paced_by_jobs`), so
interactive latency is unaffected. Places are shared round-robin between tenants, so a tenant whose items fail or
retry cannot crowd the others out; a tenant's jobs run oldest first, and a failing job runs isolated (`job_state.py`).

A failure is final (poison after bisection, a second hang since each try of a hanging input costs a worker, or its
attempts spent: `JobState.failed_for_good`) or retried with exponential backoff and jitter. Results are written in
batches of rows every `FLUSH_S` or `FLUSH_ROWS`, to keep commits cheap. An item not recorded when the process died
is still `pending` and runs again after a restart (at-least-once execution, results recorded once).

Many nodes may share one store. Items are claimed under a lease (`jobs_lease_s`) that this node renews every third
of it for every item it holds, so no other node takes them while it lives; a dead node's leases run out and others
claim its items. The store is polled every `jobs_poll_s` (`poll`). On stop, the leases of items not run are
released so another node takes them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from batchserve.config import Settings
from batchserve.core.service import JobRoom
from batchserve.errors import ApiError
from batchserve.jobs.feeder import Feeder
from batchserve.jobs.job_state import ItemRetry, JobState
from batchserve.jobs.lines import Entrance, LineResult, LineRunner, failed_response, line_texts, window_end
from batchserve.jobs.refill import Budget, model_spare, places, shares
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.store import Job, JobStore, Outcome, StoreDown
from batchserve.http.guards import lane_of

log = logging.getLogger("batchserve.jobs")


class Door(Entrance, Protocol):
    """What the scheduler needs of the inference service (`core.service.InferenceService`)."""

    @property
    def draining(self) -> bool: ...
    @property
    def max_batch_size(self) -> int: ...
    def healthy_workers(self) -> int: ...
    def models(self) -> list[str]: ...
    def job_room(self, model: str) -> JobRoom | None: ...
    async def pretokenize(self, model: str, texts: list[str], tenant: str = "") -> None: ...


FEED_TICK_S = 0.1  # the feed loop looks again at least this often (healthy workers, drain)
FLUSH_S = 0.05
STOP_RETRY_S = 1.0  # a lease release refused at stop is tried again this much later (the breaker's OPEN_S)
FLUSH_ROWS = 1000
RETRY_CAP_S = 60.0


@dataclass(eq=False)
class Scheduler:
    store: JobStore
    door: Door
    settings: Settings
    metrics: JobMetrics
    lines: LineRunner | None = None  # runs the lines of OpenAI Batch API jobs
    jobs: dict[str, JobState] = field(default_factory=dict)  # unfinished, oldest first
    retries: list[ItemRetry] = field(default_factory=list)  # a heap by due time
    outcomes: list[Outcome] = field(default_factory=list)  # waiting to be recorded
    _model_tenants: dict[str, set[str]] = field(default_factory=dict)  # per model: tenants with work, this refill
    _seq: int = 0
    _turn: int = 0  # rotates which tenant is served first
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _flush_now: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    feeder: Feeder = field(init=False)  # puts job work through the door and keeps the places it holds

    def __post_init__(self) -> None:
        self.feeder = Feeder(self.door, self.lines, self._wake, self._answered)
        self.metrics.active_jobs.set_function(lambda: len(self.jobs))  # read at scrape time

    async def start(self) -> None:
        """Resume every unfinished job on a model served here, then start feeding and flushing."""
        for job in await self.store.active(self.models()):
            self.add(job)
        if self.jobs:
            log.info("resuming %d unfinished batch job(s)", len(self.jobs))
        self._tasks = [
            asyncio.create_task(self._feed_loop(), name="jobs-feed"),
            asyncio.create_task(self._flush_loop(), name="jobs-flush"),
            asyncio.create_task(self._lease_loop(), name="jobs-leases"),
            asyncio.create_task(self._poll_loop(), name="jobs-poll"),
        ]

    async def stop(self) -> None:
        """Stop feeding, forget what is in flight (it stays pending, and runs again on restart or on another
        node), write the rest, and give back the leases of what was not recorded."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for item in [item for job in self.jobs.values() for item in job.inflight.values()]:
            item.future.cancel()
        try:
            await self.flush()
        finally:
            for job in [j for j in self.jobs.values() if j.held and not j.cancelled]:
                await release_on_stop(self.store, job, self.settings.jobs_lease_s)

    def add(self, job: Job) -> None:
        if job.id not in self.jobs:
            endpoint = job.openai.get("endpoint") if job.openai else None
            self.jobs[job.id] = JobState(
                job.id, lane_of(job.tenant), job.model, endpoint, expires_at=window_end(job.created_at, job.openai)
            )
            self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The store has cancelled the job: drop its queued items from the batcher (running ones finish unrecorded)."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        job.cancelled = True
        job.buffer.clear()
        job.open.clear()
        for item in list(job.inflight.values()):
            item.future.cancel()
        self._wake.set()

    def models(self) -> list[str]:
        """Models whose jobs run here: the door's, and the generation model (its chat and completions lines)."""
        return self.door.models() + (self.lines.models() if self.lines is not None else [])

    def isolated_limit(self) -> int:
        """Inputs of isolated jobs in flight at once, all of them together: a batch's worth per worker (their
        batches take a small share of the workers anyway; more waiting would only hold leases and memory), within
        the places one tenant sees (`refill.places`)."""
        rows, workers = self.door.max_batch_size, self.door.healthy_workers()
        return min(places(self.settings.jobs_max_inflight, rows, workers), rows * max(1, workers))

    @property
    def inflight(self) -> int:
        """Job inputs riding in shared batches, in the batcher or on a worker."""
        return self.feeder.ledger.shared

    def model_room(self, model: str) -> int | None:
        """Job inputs of `model` that may be added now (`refill.model_spare`); None where the door does not queue it."""
        room = self.door.job_room(model)
        if room is None:
            return None
        return model_spare(
            room,
            self.feeder.job_unit.get(model, 1.0),
            self.feeder.ledger.models.get(model, 0),
            self.settings.jobs_max_inflight,
            len(self._model_tenants.get(model, ())),
        )

    # -- feeding ---------------------------------------------------------------------------------------------
    async def _feed_loop(self) -> None:
        while True:
            due = self.retries[0].due - time.monotonic() if self.retries else FEED_TICK_S
            await woken(self._wake, min(FEED_TICK_S, max(0.0, due)))
            await guarded(self._feed, "batch job feeding failed; retrying")

    async def _feed(self) -> None:
        self.metrics.inflight.set(self.feeder.ledger.total)  # here, not per item: the loop's time is the SLO's
        if self.door.draining:
            self.feeder.release_queued(self.jobs.values())
        else:
            await self._refill()

    async def _refill(self) -> None:
        """Feed what the bounds allow (`refill.py`): due retries first in their job, isolated jobs on their own
        budget, the others by tenant in turn within their shares."""
        now = time.monotonic()
        while self.retries and self.retries[0].due <= now:
            r = heapq.heappop(self.retries)
            r.job.retrying -= 1
            if not r.job.cancelled:
                r.job.buffer.appendleft((r.index, r.text))
        isolated, by_tenant = self._with_work()
        iso_free = self.isolated_limit() - self.feeder.ledger.isolated
        if iso_free > 0 and isolated:
            await self._refill_isolated(isolated, Budget(iso_free, self.model_room))
        total = places(
            self.settings.jobs_max_inflight, self.door.max_batch_size, self.door.healthy_workers(), len(by_tenant)
        )
        allowed = shares(total, self.feeder.ledger.tenants, list(by_tenant))
        budget = Budget(sum(allowed.values()), self.model_room, allowed)
        if budget.free <= 0:  # no tenant with work, no places, or every share held
            return
        for tenant, tenant_jobs in by_tenant.items():  # read enough of each tenant's oldest jobs for its share
            need: float = allowed[tenant]
            for job in tenant_jobs:
                if need <= 0:
                    break
                ready = job.ready_inputs()
                if ready < need and not job.exhausted:
                    await self._read(job, job.claim_size(need - ready))
                need -= job.ready_inputs()
        queues = [(t, deque(j for j in jobs if j.ready() and not self._isolated(j))) for t, jobs in by_tenant.items()]
        rotation = deque((t, q) for t, q in queues if q and allowed[t] > 0)
        rotation.rotate(-(self._turn % max(1, len(rotation))))
        self._turn += 1
        while rotation:
            tenant, q = rotation.popleft()
            job = q[0]
            if job.cancelled or not job.ready():
                q.popleft()
            else:
                can = min(budget.can(tenant, job.model), self._chunk(job.model))
                if can <= 0:
                    continue  # its share, the places or its model's room are spent: its turn is over
                budget.take(tenant, self.feeder.feed(job, can, alone=False))
            if q:
                rotation.append((tenant, q))

    def _with_work(self) -> tuple[list[JobState], dict[str, list[JobState]]]:
        """The jobs with work: the isolated ones, and the others by tenant, oldest first (and each model's tenants
        with work noted); idle jobs are forgotten."""
        by_tenant: dict[str, list[JobState]] = {}
        isolated: list[JobState] = []
        self._model_tenants = {}
        for job in list(self.jobs.values()):
            if job.idle():
                del self.jobs[job.id]
            elif job.has_work():
                self._model_tenants.setdefault(job.model, set()).add(job.tenant)
                if self._isolated(job):
                    isolated.append(job)
                else:
                    by_tenant.setdefault(job.tenant, []).append(job)
        return isolated, by_tenant

    async def _refill_isolated(self, jobs: list[JobState], budget: Budget) -> None:
        """Feed isolated jobs in turn, a group of their own at a time (a line's inputs each alone)."""
        rotation = deque(jobs)
        rotation.rotate(-(self._turn % len(rotation)))
        while rotation:
            job = rotation.popleft()
            can = min(budget.can(job.tenant, job.model), self._chunk(job.model))
            if can <= 0:
                continue
            size = min(can, job.group_size(self.door.max_batch_size) or 1)
            if job.ready_inputs() < size and not job.exhausted:
                await self._read(job, job.claim_size(size))
            if job.cancelled:
                continue
            if job.endpoint is not None and self.lines is not None:  # lines: fed an input at a time, alone
                fed = self.feeder.feed(job, size, alone=True)
            else:
                group = [job.buffer.popleft() for _ in range(min(size, len(job.buffer)))]
                if group:
                    self.feeder.submit_group(job, group)
                fed = len(group)
            budget.take(job.tenant, fed)
            if fed and job.ready():
                rotation.append(job)

    def _chunk(self, model: str) -> int:
        """Inputs fed in one turn: a batch's worth; one while the model's job inputs have no known cost yet,
        so the room (which reads their cost) is read again once it is known."""
        return self.door.max_batch_size if model in self.feeder.job_unit else 1

    def _isolated(self, job: JobState) -> bool:
        return job.group_size(self.door.max_batch_size) > 0

    async def _read(self, job: JobState, n: int) -> None:
        rows = await self.store.claim(job.id, n, self.settings.jobs_lease_s, time.time())
        if job.cancelled:
            return
        # Tokenized now on the tokenizer stage's thread, so feeding later costs a look-up, not the event loop's time.
        if job.endpoint is not None and self.lines is not None:
            texts = [t for _, line in rows for t in line_texts(job.endpoint, line)]
        else:
            texts = [text for _, text in rows]
        if texts:
            await self.door.pretokenize(job.model, texts, job.tenant)
            if job.cancelled:
                return
        for index, text in rows:
            if index not in job.held:  # not one of ours whose lease ran out under us: that one is still running
                job.held.add(index)
                job.buffer.append((index, text))
        if len(rows) < n:
            job.exhausted = True

    # -- outcomes --------------------------------------------------------------------------------------------
    def _answered(self, job: JobState, index: int, text: str, fut: asyncio.Future) -> None:
        """A row of a job still wanted was answered (its places already given back): record or retry it."""
        exc = fut.exception()
        if exc is None:
            result = fut.result()
            job.recent.append(False)  # a line refused for its body (4xx) is no sign the inputs fail batches
            if isinstance(result, LineResult):
                status = "completed" if result.error is None else "failed"
                self._outcome(job, Outcome(job.id, index, status, result.response_json(), result.error, result.message))
            else:  # any JSON value, stored as JSON text
                self._outcome(job, Outcome(job.id, index, "completed", orjson.dumps(result.output).decode()))
            return
        costly = isinstance(exc, ApiError) and exc.costly
        was_isolated = self._isolated(job)
        job.recent.append(costly)
        if costly and not was_isolated and self._isolated(job):
            self.feeder.reroute(job)
        code = exc.code if isinstance(exc, ApiError) else "INTERNAL"
        if job.failed_for_good(index, exc, self.settings.jobs_max_attempts):
            message = exc.message if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}"
            output = None
            if job.endpoint is not None and isinstance(exc, ApiError):  # the line's response, for the error file
                output = failed_response(exc, job.endpoint)
            self._outcome(job, Outcome(job.id, index, "failed", output=output, error=code, message=message))
            return
        attempts = job.attempts[index]
        job.retrying += 1
        delay = min(RETRY_CAP_S, self.settings.jobs_retry_base_ms / 1000 * 2 ** (attempts - 1))
        self._seq += 1
        heapq.heappush(
            self.retries, ItemRetry(time.monotonic() + delay * random.uniform(0.5, 1.0), self._seq, job, index, text)
        )
        self.metrics.count(job.model, "retried")
        log.info("batch %s item %d: %s, retry %d in %.1fs", job.id, index, code, attempts, delay)

    def _outcome(self, job: JobState, outcome: Outcome) -> None:
        job.attempts.pop(outcome.index, None)
        job.hung.discard(outcome.index)
        self.metrics.count(job.model, outcome.status)
        self.outcomes.append(outcome)
        if len(self.outcomes) >= FLUSH_ROWS:
            self._flush_now.set()

    # -- writing ---------------------------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await woken(self._flush_now, FLUSH_S)
            await guarded(self.flush, "writing batch job results failed; retrying")  # the rows wait for the next try

    async def flush(self) -> None:
        if not self.outcomes:
            return
        rows, self.outcomes = self.outcomes, []
        try:
            progress = await self.store.record(rows, time.time())
        except BaseException:
            self.outcomes[:0] = rows
            raise
        for o in rows:
            job = self.jobs.get(o.job_id)
            if job is not None:
                job.held.discard(o.index)  # final in the store: no lease to keep
        for p in progress:
            self.metrics.progress(p)

    # -- leases and the shared store -------------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        while True:
            lease_s = self.settings.jobs_lease_s
            await asyncio.sleep(lease_s / 3)
            for job in list(self.jobs.values()):
                if not job.held or job.cancelled:
                    continue
                try:
                    kept = await self.store.renew(job.id, sorted(job.held), lease_s)
                except StoreDown:
                    continue
                except Exception:
                    log.exception("renewing the leases of batch %s failed; retrying", job.id)
                    continue
                if kept < len(job.held):  # recorded meanwhile, or a lease ran out and another node took it
                    log.debug("batch %s: %d of %d leases renewed", job.id, kept, len(job.held))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.jobs_poll_s)
            await guarded(self.poll, "reading the unfinished batch jobs failed; retrying", pause_s=0.0)

    async def poll(self) -> None:
        """Pick up jobs created on other nodes, look again at jobs whose items were all leased (a lease may
        have run out), and drop jobs finished or cancelled elsewhere."""
        started = time.monotonic()
        active = await self.store.active(self.models())
        for job in active:  # the new ones added, and every one claimed from again
            self.add(job)
            self.jobs[job.id].exhausted = False
        ids = {job.id for job in active}
        for state in list(self.jobs.values()):
            if state.id not in ids and state.added < started:
                self.cancel(state.id)
        self._wake.set()


async def woken(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for `event` at most `timeout_s`, then clear it; not wait_for: on 3.11 it can drop stop()'s cancellation."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    event.clear()


async def guarded(step: Callable[[], Awaitable[None]], failed: str, pause_s: float = 1.0) -> None:
    """One round of a loop: an error is logged, a store outage not (the store logged it once as it began), and
    either is followed by `pause_s`, so a failing round is not retried in a tight loop."""
    try:
        await step()
    except StoreDown:
        await asyncio.sleep(pause_s)
    except Exception:
        log.exception(failed)
        await asyncio.sleep(pause_s)


async def release_on_stop(store: JobStore, job: JobState, lease_s: float) -> None:
    """Give back the leases of `job`'s unrecorded items; once more a breaker's open time later if the store
    refused (the cancelled loops may have cut a connection under it): no node should wait the leases out."""
    for last in (False, True):
        try:
            return await store.release(job.id, sorted(job.held))
        except Exception:  # noqa: BLE001 - the leases then run out by themselves
            if not last:
                await asyncio.sleep(STOP_RETRY_S)
    log.warning("batch %s: leases not given back; they expire in %.0fs", job.id, lease_s)
