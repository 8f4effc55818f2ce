"""Device workers: one thread per device, each pulling one batch at a time (docs/contract.md#workers-and-failures).

A worker asks the batcher for its next batch only when it is free (pull, never push), calls the backend in its
own thread, and hands the outcome back to the event loop, where every future is resolved. A batch that raised or
answered a malformed list is bisected (`_retry_or_fail`) so a poison input fails alone; a backend that reports a
failure per input (an exception object in place of that output) already names the culprit, so only that input is
answered 500 and nothing is re-run. A watchdog abandons a worker whose batch runs past its limit (`_abandon`):
the limit scales with the batch's expected time, so a batch of long inputs is not taken for a hang.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import InitVar, dataclass, field, replace
from collections.abc import Callable

from prometheus_client import Counter

from batchserve import errors
from batchserve.backends import Backend, running_batch, OutputRule, check_outputs
from batchserve.core.batcher import Batcher, Clock
from batchserve.core.batch import Batch, BatchRun, BatchTracer
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.quarantine import Quarantine
from batchserve.core.tiers import BATCH
from batchserve.backends.device_thread import DeviceThread
from batchserve.gpu_pool_staging import DeviceWorker, Staging
from batchserve.metrics import Metrics

log = logging.getLogger("batchserve.pool")
GPU_TIMEOUT_FLOOR_S = 1.0
GPU_TIMEOUT_BATCHES = 10  # derived gpu_timeout: this many learned batch times, at least the floor
LOGGED_CHARS = 4096  # most characters of a backend's exception text kept (the log line; the retry's reason)


def callers_gone(items: list[Item]) -> bool:
    """Has every caller an answer or hung up? Read from the worker thread, safely: a future's state is a plain
    attribute read."""
    return all(item.future.done() or (item.gone is not None and item.gone()) for item in items)


@dataclass
class GpuPool:
    backends: dict[str, Backend]  # model id -> backend
    batcher: Batcher
    metrics: Metrics
    loop: asyncio.AbstractEventLoop
    device_names: list[str]
    gpu_timeout_s: float = 0.0  # 0 = derived per batch from its expected time
    gpu_timeout_ceiling_s: float = 60.0  # a derived limit never passes this
    threads: list[DeviceThread] = field(default_factory=list)  # one per device (made here when not given)
    workers: list[DeviceWorker] = field(default_factory=list)  # `staging` holds this list too: never rebound
    demand: Callable[[], float] = lambda: 0.0  # recent arrivals per second
    clock: Clock = time.monotonic  # injected in the policy's unit tests
    tracing: BatchTracer | None = None  # OpenTelemetry on: a span per batch, linked to its requests
    quarantine: Quarantine | None = None  # inputs that failed alone: a retry is answered at the door, not run
    rules: dict[str, OutputRule] = field(default_factory=dict)  # model id -> its outputs' rule (warm-up's)
    stage_lead_s: InitVar[float] = 0.0  # --stage-lead-ms: how long before a batch's expected end its successor may form
    _healthy: int = 0
    # batchserve_batches_total's child per (model, cause): prometheus-client's `labels()` costs several µs a call
    _counts: dict[tuple[str, str], Counter] = field(default_factory=dict)
    staging: Staging = field(init=False)  # the next full batch into a busy worker's inbox

    def __post_init__(self, stage_lead_s: float) -> None:
        self.staging = Staging(
            self.workers, self.batcher, self.metrics, self.loop, self.clock, self._count, stage_lead_s
        )
        self.batcher.on_stage = self.staging.stage  # asked only while `stage_after` is finite (`Staging.open`)

    def start(self) -> None:
        for model, backend in self.backends.items():
            self.rules.setdefault(model, OutputRule(backend.output_kind))
        if not self.threads:
            self.threads = [DeviceThread(name) for name in self.device_names]
        for i, name in enumerate(self.device_names):
            self.workers.append(DeviceWorker(i, name, thread=self.threads[i]))
            self.metrics.worker_healthy.labels(name).set(1)
        self._update_health()
        for w, thread in zip(self.workers, self.threads):
            thread.call(self._work, w)

    def stop(self) -> None:
        self.batcher.close()
        for w in self.workers:
            if w.watchdog is not None:
                w.watchdog.cancel()
            self.staging.disarm(w)

    # -- capacity, for admission and health ----------------------------------------------------------------
    def healthy_count(self) -> int:
        """Workers taking batches now (cached by `_update_health`: read on every admission)."""
        return self._healthy

    def worker_count(self) -> int:
        return len(self.workers)

    def seconds_until_free(self, now: float) -> float:
        """Time until the first healthy worker should be free again (0 when one is idle; `DeviceWorker.free_at`)."""
        soonest = math.inf  # read on every admission: a loop, not a list and min()
        for w in self.workers:
            if w.healthy:
                if w.batch is None:
                    return 0.0
                if w.free_at < soonest:
                    soonest = w.free_at
        return max(0.0, soonest - now)  # inf when no worker is healthy

    def timeout_s(self, batch: Batch | None = None, cost: float | None = None) -> float:
        """How long `batch` may run before its worker is taken for hung: --gpu-timeout-ms when set, else
        GPU_TIMEOUT_BATCHES x its expected time at its cost (without a batch: the slowest model's full batch),
        between the floor and the ceiling."""
        if self.gpu_timeout_s > 0:
            return self.gpu_timeout_s
        times = self.batcher.batch_s
        if batch is not None:
            expected = times.at(batch.model, batch.cost if cost is None else cost)
        else:
            expected = max((times[m] for m in times), default=0.0)
        return max(GPU_TIMEOUT_FLOOR_S, min(self.gpu_timeout_ceiling_s, GPU_TIMEOUT_BATCHES * expected))

    # -- the worker thread -----------------------------------------------------------------------------------
    def _work(self, w: DeviceWorker) -> None:
        finished: tuple | None = None
        while True:
            try:
                # One hop to the loop per batch: hand back the last outcome; the next batch arrives in the inbox.
                self.loop.call_soon_threadsafe(self._turnaround, w, finished)
            except RuntimeError:  # the loop is closed: the process is exiting
                return
            batch = w.inbox.get()
            if batch is None:
                return
            generation = w.generation
            started = time.monotonic()
            w.running_since, w.running = started, batch
            outputs: object = None
            with running_batch(functools.partial(callers_gone, batch.items)) as running:
                try:
                    outputs = self.backends[batch.model].run(w.index, [item.text for item in batch.items])
                    elapsed = time.monotonic() - started
                    problem, bad = check_outputs(outputs, len(batch.items), self.rules[batch.model])
                except BaseException as exc:  # noqa: BLE001 - any backend failure is isolated, never fatal
                    elapsed = time.monotonic() - started
                    problem, bad = errors.short(f"{type(exc).__name__}: {exc}", LOGGED_CHARS), {}
            w.finished, w.running = batch, None
            finished = (generation, batch, outputs, problem, bad, elapsed, running.stopped_early)

    def _turnaround(self, w: DeviceWorker, finished: tuple | None) -> None:
        """Settle the batch just run, and give the worker its next one at once when one is due. Resolving
        futures only schedules the handlers, so the worker thread is woken before they run."""
        answer = self._finish(w, *finished) if finished is not None else None
        self.staging.disarm(w)  # the batch it was armed for has ended
        staged, w.staged = w.staged, None
        if staged is not None:  # the thread went straight on to it
            self._begin(w, staged, w.staged_cost)
        elif (batch := self.batcher.take_now(w.index)) is not None:
            self._hand(w, batch)
        else:
            self.staging.open()  # this worker is idle now
            self.loop.create_task(self._wait_and_hand(w))
        if answer is not None:  # after the hand-off: the worker runs its next batch while the loop answers
            answer()

    async def _wait_and_hand(self, w: DeviceWorker) -> None:
        self._hand(w, await self.batcher.next_batch(w.index))

    def _hand(self, w: DeviceWorker, batch: Batch | None) -> None:
        if batch is None:
            w.inbox.put(None)
            return
        self._begin(w, batch, batch.cost)
        w.inbox.put(batch)
        self._count(batch)

    def _begin(self, w: DeviceWorker, batch: Batch, cost: float) -> None:
        """Start `batch`'s clock and watchdog (handed, or staged and begun by the thread)."""
        w.batch, w.started, w.batch_cost = batch, self.clock(), cost
        w.ends = w.free_at = w.started + self.batcher.batch_s.at(batch.model, cost)
        limit = self.timeout_s(batch, cost)
        w.watchdog = self.loop.call_later(limit, self._abandon, w, batch, limit)
        self.staging.open()

    # -- back on the event loop --------------------------------------------------------------------------
    def _count(self, batch: Batch) -> None:
        """A batch formed for a worker, in the metrics."""
        self.metrics.batch_size.labels(batch.model).observe(len(batch.items))
        counted = self._counts.get((batch.model, batch.cause))
        if counted is None:
            counted = self._counts[(batch.model, batch.cause)] = self.metrics.batches.labels(batch.model, batch.cause)
        counted.inc()
        formed, interactive = batch.formed, BATCH.rank  # job items wait for spare capacity by design: no queue delay
        self.metrics.queue_wait.labels(batch.model).observe_all(
            [formed - item.arrived for item in batch.items if item.tier < interactive]
        )

    def _finish(
        self,
        w: DeviceWorker,
        generation: int,
        batch: Batch,
        outputs: object,
        problem: str | None,
        bad: dict[int, str],
        elapsed: float,
        stopped_early: bool = False,
    ) -> Callable[[], None] | None:
        """Book the batch's outcome; a failure is re-queued here. For a success, returns the function that
        answers its items, for the caller to run once the worker has its next batch."""
        if generation != w.generation:
            # An abandoned (hung) call came back: its items were already retried or answered.
            log.warning("worker %s returned after %.1fs and is taken back", w.name, elapsed)
            w.healthy = True
            self.metrics.worker_healthy.labels(w.name).set(1)
            self._update_health()
            return None
        if w.watchdog is not None:
            w.watchdog.cancel()
        # The batch time as the loop sees it (hand-offs and GIL waits included) paces dispatch and admission;
        # the backend's own time goes to the compute histogram and the answers.
        cycle = self.clock() - w.started
        n = len(batch.items)
        if self.tracing is not None and not stopped_early:  # the batch's span, linked to its requests' spans
            traces = (item.trace for item in batch.items)
            span = self.tracing.batch(
                BatchRun(batch.model, n, w.name, batch.cause, w.started, self.clock(), traces, problem)
            )
            for item in batch.items:
                item.batch_trace = span
        w.batch = None
        w.busy_s += elapsed
        w.batches += 1
        if stopped_early:  # every caller had left: nobody to answer, nothing learned about the batch time
            self._stopped_early(batch)
            return None
        if problem is not None:
            log.warning("batch of %d on %s failed: %s", n, w.name, problem)
            self._retry_or_fail(batch, w, problem, "error")
            return None
        self.batcher.costs.observe(batch.model, cycle, batch.cost, n)
        assert isinstance(outputs, list)
        if batch.held:  # this half was clean: the culprit is in the other one, which now runs alone
            self.batcher.requeue(Batch(batch.model, batch.held, self.clock(), "retry", isolated=batch.isolated))

        if bad:
            log.warning(
                "batch of %d on %s: %d input(s) failed or broke the model's output rule: %s",
                n,
                w.name,
                len(bad),
                next(iter(bad.values())),
            )

        return self._answers(batch, outputs, bad, elapsed)

    def _stopped_early(self, batch: Batch) -> None:
        self.metrics.batches_stopped_early.labels(batch.model).inc()
        self.batcher.freed_early(batch.model)
        if batch.held:
            self.batcher.return_items(batch.held)
        for item in batch.items:
            if not item.future.done():
                item.future.set_exception(errors.ClientGone())

    def _answers(self, batch: Batch, outputs: list, bad: dict[int, str], elapsed: float) -> Callable[[], None]:
        """The function that answers a clean batch's items and books the cost served."""
        n = len(batch.items)

        def answer() -> None:
            account = self.batcher.account  # core/ledger.py
            formed = batch.formed
            # Items are mostly one tenant's in a row: the account row is looked up once per run, as `CostAccount.add`.
            model, tier, tenant = batch.model, -1, ""
            row = None
            for i, (item, output) in enumerate(zip(batch.items, outputs)):
                if not item.future.done():
                    if bad and i in bad:
                        item.future.set_exception(errors.inference_failed(bad[i]))
                    else:
                        item.future.set_result(ItemResult(output, formed - item.arrived, elapsed, n))
                        if row is None or item.tenant != tenant or item.tier != tier:
                            tier, tenant = item.tier, item.tenant
                            row = account.row(model, tier, tenant)
                        row.inputs += 1
                        row.cost += item.cost
            self.metrics.batch_compute.labels(batch.model).observe(elapsed)

        return answer

    def _retry_or_fail(self, batch: Batch, w: DeviceWorker, problem: str, cause: str, parts: int = 2) -> None:
        """Find the input that broke a batch, re-running as little as possible.

        After an error, bisect one half at a time: the first half runs alone while the second is held. If it
        fails, the held half is presumed clean and rides in the next regular batch (no extra batch of its own);
        if it succeeds, the held half runs alone next. A lone failing input is retried once on another worker (a
        transient fault), then answered 500 and quarantined. Retries prefer another worker, so a broken device
        fails nothing alone. After a hang (`_abandon`) the items are spread over `parts` groups at once."""
        now = self.clock()
        if batch.held:
            self._release_held(batch, now)
        items = [i for i in batch.items if i.alive(now)]
        if not items:
            return
        jobs = [i for i in items if i.tier >= BATCH.rank]
        if jobs and len(jobs) < len(items):
            # Interactive items and job items are isolated apart: the job items' re-runs go behind interactive
            # work (the batcher's background retries), so a job full of failing inputs cannot hold the workers.
            for part in ([i for i in items if i.tier < BATCH.rank], jobs):
                self._retry_or_fail(replace(batch, items=part, held=[]), w, problem, cause, parts)
            return
        if cause == "hang" and jobs:
            # Job items are not re-run in groups here: the job scheduler retries each one alone (it is in no
            # hurry), so its innocent items succeed and the hanging one costs one more worker at most.
            for item in items:
                item.future.set_exception(errors.worker_hung(again=batch.after_hang))
            return
        self.metrics.batch_retries.labels(batch.model, cause).inc()
        if len(items) > 1 and cause == "hang":
            parts = max(2, min(parts, len(items)))
            for k in range(parts):
                group = items[k * len(items) // parts : (k + 1) * len(items) // parts]
                self.batcher.requeue(Batch(batch.model, group, now, "retry", w.index, after_hang=True))
            return
        if len(items) > 1:
            mid = len(items) // 2
            self.batcher.requeue(
                Batch(batch.model, items[:mid], now, "retry", w.index, held=items[mid:], isolated=batch.isolated)
            )
            return
        item = items[0]
        if cause == "hang":
            item.future.set_exception(errors.worker_hung(again=batch.after_hang))
        elif item.attempts == 0 and self.healthy_count() > 1 and not batch.after_hang:  # perhaps a transient fault
            item.attempts += 1
            self.batcher.requeue(Batch(batch.model, [item], now, "retry", w.index, isolated=batch.isolated))
        else:
            if self.quarantine is not None:
                self.quarantine.add(batch.model, item.text, problem)
            err = errors.inference_failed(problem)
            err.costly = True  # found by failing batches, not named by the backend: jobs that hit it are isolated
            item.future.set_exception(err)

    def _release_held(self, batch: Batch, now: float) -> None:
        """A failed or hung half's held sibling, presumed clean, back to the queue; a failing job's half stays in
        batches of its own (it may hold a culprit too)."""
        if batch.isolated:
            self.batcher.requeue(Batch(batch.model, batch.held, now, "retry", isolated=True))
        else:
            self.batcher.return_items(batch.held)

    # -- hung workers ----------------------------------------------------------------------------------------
    def _abandon(self, w: DeviceWorker, batch: Batch, limit: float) -> None:
        """The batch ran past gpu_timeout: give up on this worker (its thread cannot be killed) until its call
        returns.

        Which input hung it cannot be known, so its items are re-run once, spread over every healthy worker: the
        groups without the culprit are answered one batch later, and the culprit takes down at most one more
        worker. That loss is risked only while the workers left could still serve twice the recent arrival rate;
        otherwise the items are answered 504 at once and capacity is kept."""
        if w.batch is not batch or not w.healthy or w.finished is batch:
            return  # ended (`finished`: in time, the loop not yet at its turnaround, busy or stalled) or given up
        # Its time runs from when the thread began it (a late timer is no evidence); handed over but not begun yet
        # (the thread waited for the interpreter), it starts later.
        ran = self.clock() - w.running_since if w.running is batch else 0.0
        if ran < limit:  # `limit` > 0: `timeout_s` is at least its floor
            w.watchdog = self.loop.call_later(limit - ran, self._abandon, w, batch, limit)
            return
        if not self.staging.withdraw(w):  # its staged batch back from the inbox: its items run elsewhere
            return  # the thread began the staged one just now: not hung after all
        log.error(
            "worker %s ran a batch of %d for %.2fs (gpu_timeout %.2fs): marked unhealthy",
            w.name,
            len(batch.items),
            self.clock() - w.started,
            limit,
        )
        w.healthy = False
        w.generation += 1
        w.busy_s += self.clock() - w.started
        w.batch = None
        w.watchdog = None
        self.metrics.worker_healthy.labels(w.name).set(0)
        self._update_health()
        healthy = self.healthy_count()
        if batch.held:  # a bisection half hung: its held sibling is presumed clean
            self._release_held(batch, self.clock())
            batch.held = []
        batch_s = self.batcher.batch_s[batch.model]
        spare_after_loss = (healthy - 1) * self.batcher.costs.full_n(batch.model) / batch_s
        if batch.after_hang or healthy == 0 or spare_after_loss < 2 * self.demand():
            # Already hung once, no worker left, or too little spare capacity: answer rather than risk another.
            for item in batch.items:
                if not item.future.done():
                    item.future.set_exception(errors.worker_hung(again=batch.after_hang))
            return
        self._retry_or_fail(batch, w, "worker hung", "hang", parts=healthy)

    def _update_health(self) -> None:
        self._healthy = sum(1 for w in self.workers if w.healthy)
        self.batcher.healthy_workers = self._healthy
        self.batcher.wake()
