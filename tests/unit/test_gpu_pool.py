"""Staging (`Staging.stage`, `Batcher.take_full`) on an injected clock: no server, no threads.

A full batch waiting while a worker is busy goes into that worker's inbox shortly before its batch ends (asked
by an arrival, or by the worker's staging timer), so the thread begins it without waiting for the loop; these
pin when one is staged, what admission then reads, how the loop takes it up, and that a hang gives its items
back. The staging timer runs on the real loop's time: the tests read its delay and run its callback by hand
(`fire`) after moving the injected clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from batchserve.core.batch import Batch
from batchserve.gpu_pool import GpuPool
from batchserve.gpu_pool_staging import DeviceWorker
from batchserve.metrics import make_metrics
from tests.unit.core.test_policy import S, make_batcher, make_item
from tests.unit.fakes import Clock

LEAD_S = 0.01


def staging_pool(loop: asyncio.AbstractEventLoop, clock: Clock, workers: int = 1, max_batch: int = 4) -> GpuPool:
    b = make_batcher(clock, workers=workers, max_batch=max_batch)
    pool = GpuPool(
        {},
        b,
        make_metrics(),
        loop,
        [f"d{i}" for i in range(workers)],
        gpu_timeout_s=1.0,
        clock=clock,
        stage_lead_s=LEAD_S,
    )
    pool.workers.extend(DeviceWorker(i, f"d{i}") for i in range(workers))  # the list its staging reads too
    pool._update_health()
    return pool


def running(pool: GpuPool, loop: asyncio.AbstractEventLoop, clock: Clock, n: int = 4) -> tuple[DeviceWorker, Batch]:
    """Worker 0 running a batch of `n` handed now (taken from its inbox, as its thread would)."""
    w = pool.workers[0]
    batch = Batch("m", [make_item(loop, f"run-{i}", arrived=clock.now) for i in range(n)], clock.now, "full")
    pool._hand(w, batch)
    assert w.inbox.get_nowait() is batch
    return w, batch


def queue(pool: GpuPool, loop: asyncio.AbstractEventLoop, clock: Clock, n: int, deadline: float = 1e9) -> None:
    for i in range(n):
        pool.batcher.submit(make_item(loop, f"q-{i}", arrived=clock.now, deadline=deadline))


def near_its_end(
    loop: asyncio.AbstractEventLoop, clock: Clock, workers: int = 1
) -> tuple[GpuPool, DeviceWorker, Batch]:
    """A pool whose worker 0 runs a batch that is expected to end within the lead from now."""
    pool = staging_pool(loop, clock, workers=workers)
    w, batch = running(pool, loop, clock)
    clock.now += S - LEAD_S
    return pool, w, batch


def staged(
    loop: asyncio.AbstractEventLoop, clock: Clock, queued: int, workers: int = 1
) -> tuple[GpuPool, DeviceWorker, Batch]:
    """A pool whose worker 0 runs a batch and has staged the next one: `queued` items arrived near its end."""
    pool, w, batch = near_its_end(loop, clock, workers)
    queue(pool, loop, clock, queued)
    assert w.staged is not None
    return pool, w, batch


def staged_count(pool: GpuPool) -> float:
    return pool.metrics.batches_staged.labels("m")._value.get()


def test_an_arrival_near_the_end_stages_the_full_queue_into_the_busy_workers_inbox(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, batch = running(pool, loop, clock)
    assert pool.batcher.stage_after == pytest.approx(clock.now + S - LEAD_S)  # opened when the batch began
    queue(pool, loop, clock, 5)  # a full queue, but long before the batch's end: nothing staged yet
    assert w.staged is None and w.inbox.empty()
    clock.now += S - LEAD_S
    queue(pool, loop, clock, 1)  # an arrival within the lead
    assert w.staged is not None and [i.text for i in w.staged.items] == ["q-0", "q-1", "q-2", "q-3"]
    assert w.inbox.get_nowait() is w.staged  # what the thread begins the moment `batch` ends
    assert pool.batcher.depth["m"] == 2 and staged_count(pool) == 1
    # Admission's "until free" counts the staged batch after the running one: its items left the queue.
    assert pool.seconds_until_free(clock.now) == pytest.approx(LEAD_S + S)
    assert pool.batcher.stage_after == math.inf  # one staged batch per worker: arrivals stop asking


def test_a_partial_queue_is_not_staged_until_an_arrival_fills_it(loop):
    clock = Clock(1000.0)
    pool, w, batch = near_its_end(loop, clock)
    queue(pool, loop, clock, 3)  # one short of a full batch: formed early it would leave out what comes next
    assert w.staged is None and pool.batcher.depth["m"] == 3 and w.inbox.empty()
    queue(pool, loop, clock, 1)
    assert w.staged is not None and len(w.staged.items) == 4


def test_nothing_is_staged_for_an_idle_worker_or_with_staging_off(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, _ = running(pool, loop, clock)
    w.batch = None  # it ended and nothing was due: the worker waits in `next_batch`
    pool.staging.open()
    assert pool.batcher.stage_after == math.inf  # idle: a free worker takes its own batch
    off = staging_pool(loop, clock)
    off.staging.lead_s = 0.0
    w_off, _ = running(off, loop, clock)
    clock.now += S - LEAD_S
    queue(off, loop, clock, 8)
    assert w_off.staged is None and off.batcher.stage_after == math.inf


def test_nothing_is_staged_behind_an_overdue_batch(loop):
    # A batch running past its expected end by more than the lead (a long one, a hang) may run on for long: a
    # batch staged behind it would keep later work of a higher tier waiting (tests/integration/http/test_tenancy.py).
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, _ = running(pool, loop, clock)
    clock.now += S + 2 * LEAD_S
    queue(pool, loop, clock, 4)
    assert w.staged is None and pool.batcher.depth["m"] == 4
    w.finished = w.batch  # its thread has ended it; the loop has not heard yet: the device is free now
    queue(pool, loop, clock, 1)
    assert w.staged is not None and len(w.staged.items) == 4


def test_a_waiting_retry_is_not_passed_by_a_staged_batch(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, batch = running(pool, loop, clock)
    pool.batcher.requeue(Batch("m", [make_item(loop, "half")], clock.now, "retry"))
    clock.now += S - LEAD_S
    queue(pool, loop, clock, 4)
    assert w.staged is None  # a retry goes first, to a worker as it frees


def test_an_idle_worker_takes_the_full_batch_instead(loop):
    clock = Clock(1000.0)
    pool, w, batch = near_its_end(loop, clock, workers=2)

    async def with_a_worker_waiting() -> None:
        async with pool.batcher._turn:  # worker 1 waits for its turn in `next_batch`
            queue(pool, loop, clock, 4)
            await asyncio.sleep(0.005)  # the staging timer, armed by the full queue and due now, runs meanwhile

    loop.run_until_complete(with_a_worker_waiting())
    assert w.staged is None and pool.batcher.depth["m"] == 4


def test_a_staged_batch_skips_an_item_whose_deadline_passes_before_it_could_end(loop):
    clock = Clock(1000.0)
    pool, w, batch = near_its_end(loop, clock)
    # Formed now it would end within its deadline; begun when the running batch ends (LEAD_S on), it would not.
    late = make_item(loop, "late", arrived=clock.now, deadline=clock.now + S + LEAD_S / 2)
    pool.batcher.submit(late)
    queue(pool, loop, clock, 4)
    assert late.future.done() and late.future.exception().status == 504
    assert w.staged is not None and "late" not in [i.text for i in w.staged.items]


def test_the_loop_takes_up_the_staged_batch_without_handing_another(loop):
    clock = Clock(1000.0)
    pool, w, batch = staged(loop, clock, 8)
    next_batch = w.inbox.get_nowait()  # the thread went straight on to it
    clock.now += S
    pool._turnaround(w, (w.generation, batch, [i.text[::-1] for i in batch.items], None, {}, S, False))
    assert [i.future.result().output for i in batch.items] == [i.text[::-1] for i in batch.items]
    assert w.batch is next_batch and w.staged is None and w.started == clock.now
    assert w.inbox.empty() and pool.batcher.depth["m"] == 4  # nothing more handed: the thread is busy with it
    assert pool.batcher.stage_after == pytest.approx(w.ends - LEAD_S) and w.ends > clock.now  # open for its end


def test_a_hang_gives_the_staged_batch_back_to_the_queue(loop):
    clock = Clock(1000.0)
    pool, w, batch = staged(loop, clock, 4, workers=2)
    given_back = w.staged
    assert given_back is not None and pool.batcher.depth["m"] == 0
    w.running, w.running_since = batch, clock.now  # the thread began it ...
    clock.now += 2.0  # ... and is still in it past the 1 s limit
    pool._abandon(w, batch, 1.0)
    assert not w.healthy and w.staged is None and w.inbox.empty()
    assert pool.batcher.depth["m"] == 4  # the staged items wait for the healthy worker
    assert not any(i.future.done() for i in given_back.items)


def test_a_batch_that_ends_as_its_watchdog_fires_is_not_taken_for_a_hang(loop):
    clock = Clock(1000.0)
    pool, w, batch = staged(loop, clock, 4)
    w.running, w.running_since = batch, clock.now
    clock.now += 2.0
    w.inbox.get_nowait()  # the thread ended `batch` this instant and took the staged one
    pool._abandon(w, batch, 1.0)
    assert w.healthy and w.staged is not None  # its turnaround, already queued, settles it


# -- the staging timer: a full batch staged with no arrival near the end (closed-loop callers) -----------------
def delay(loop: asyncio.AbstractEventLoop, w: DeviceWorker) -> float:
    """How long until `w`'s staging timer runs (loop time)."""
    assert w.stage_timer is not None and not w.stage_timer.cancelled()
    return w.stage_timer.when() - loop.time()


def fire(w: DeviceWorker) -> None:
    """Run `w`'s staging timer now, as the loop would (its callback directly, so an error fails the test)."""
    handle = w.stage_timer
    assert handle is not None and not handle.cancelled()
    callback, args = handle._callback, handle._args  # type: ignore[attr-defined]
    handle.cancel()
    callback(*args)


def test_a_full_queue_is_staged_by_the_timer_with_no_arrival_near_the_end(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, batch = running(pool, loop, clock)
    assert w.stage_timer is None and pool.batcher.stage_when_full  # nothing waits: no timer yet
    queue(pool, loop, clock, 3)
    assert w.stage_timer is None  # a partial queue: formed early it would leave out what comes next
    queue(pool, loop, clock, 3)  # the fourth fills it: the pool arms the timer for the batch's end
    assert delay(loop, w) == pytest.approx(S - LEAD_S, abs=0.005) and not pool.batcher.stage_when_full
    assert w.staged is None and pool.batcher.depth["m"] == 6
    clock.now += S - LEAD_S  # nothing arrives near the end: closed-loop callers wait for their answers
    fire(w)
    assert w.staged is not None and [i.text for i in w.staged.items] == ["q-0", "q-1", "q-2", "q-0"]
    assert w.inbox.get_nowait() is w.staged and staged_count(pool) == 1 and pool.batcher.depth["m"] == 2
    assert pool.seconds_until_free(clock.now) == pytest.approx(LEAD_S + S)
    assert pool.batcher.stage_after == math.inf  # one staged batch per worker


def test_the_timer_is_armed_when_a_batch_begins_with_a_full_batch_waiting(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    queue(pool, loop, clock, 9)  # a backlog, no worker busy yet: no timer
    w, batch = running(pool, loop, clock)  # formed from elsewhere: two full batches still wait
    assert delay(loop, w) == pytest.approx(S - LEAD_S, abs=0.005)
    clock.now += S - LEAD_S
    fire(w)
    assert w.staged is not None and len(w.staged.items) == 4
    # The loop takes the staged batch up when it hears of the end: a full batch still waits, so a new timer.
    w.inbox.get_nowait()
    clock.now += LEAD_S
    pool._turnaround(w, (w.generation, batch, [i.text for i in batch.items], None, {}, S, False))
    assert w.batch is not None and w.batch is not batch and w.staged is None
    assert delay(loop, w) == pytest.approx(S - LEAD_S, abs=0.005)


def test_no_timer_while_nothing_waits_or_only_a_partial_batch(loop):
    # The in-process hot path's idle loop (bench/hotpath) must not be woken for nothing.
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, batch = running(pool, loop, clock)
    assert w.stage_timer is None
    queue(pool, loop, clock, 3)
    clock.now += S - LEAD_S
    assert w.stage_timer is None and w.staged is None
    off = staging_pool(loop, clock)
    off.staging.lead_s = 0.0
    queue(off, loop, clock, 8)
    w_off, _ = running(off, loop, clock)
    assert w_off.stage_timer is None and not off.batcher.stage_when_full


def test_the_timer_stages_nothing_more_behind_a_batch_already_staged(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    w, batch = running(pool, loop, clock)
    queue(pool, loop, clock, 9)  # the timer is armed
    assert w.stage_timer is not None
    clock.now += S - LEAD_S / 2
    queue(pool, loop, clock, 1)  # an arrival near the end stages first
    first = w.staged
    assert first is not None and pool.batcher.depth["m"] == 6
    fire(w)
    assert w.staged is first and pool.batcher.depth["m"] == 6 and staged_count(pool) == 1


def test_the_timer_is_cancelled_when_its_batch_ends_or_hangs(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock, workers=2)
    queue(pool, loop, clock, 8)
    w, batch = running(pool, loop, clock)
    handle = w.stage_timer
    assert handle is not None
    clock.now += S  # it ends, the timer not yet run (the loop was busy)
    pool._turnaround(w, (w.generation, batch, [i.text for i in batch.items], None, {}, S, False))
    assert handle.cancelled()  # and the new batch's own timer armed (a full batch still waits)
    assert w.batch is not batch and delay(loop, w) == pytest.approx(S - LEAD_S, abs=0.005)
    hung = w.batch
    handle = w.stage_timer
    w.inbox.get_nowait()
    w.running, w.running_since = hung, clock.now
    clock.now += 2.0
    pool._abandon(w, hung, 1.0)
    assert not w.healthy and handle.cancelled() and w.stage_timer is None and w.staged is None


def test_the_timer_stages_nothing_behind_an_overdue_batch(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    queue(pool, loop, clock, 4)
    w, batch = running(pool, loop, clock)
    clock.now += S + 2 * LEAD_S  # the loop ran the timer very late, and the batch still runs
    fire(w)
    assert w.staged is None and pool.batcher.depth["m"] == 4
    w.finished = batch  # had the thread ended it, the device would be free: staged, and begun at once
    w.timed = None
    pool.staging.open()
    fire(w)
    assert w.staged is not None


def test_a_late_loop_sets_the_next_timer_early_by_its_lateness(loop):
    clock = Clock(1000.0)
    pool = staging_pool(loop, clock)
    queue(pool, loop, clock, 12)
    w, batch = running(pool, loop, clock)
    clock.now += S - LEAD_S + 0.004  # the loop ran the timer 4 ms late
    fire(w)
    assert pool.staging._timer_late == pytest.approx(0.004)
    staged_batch = w.inbox.get_nowait()
    # The thread began the staged batch as `batch` ended (it runs); the loop hears of it 3 ms later.
    w.running, w.running_since = staged_batch, clock.now + LEAD_S - 0.004
    clock.now += LEAD_S - 0.004 + 0.003
    pool._turnaround(w, (w.generation, batch, [i.text for i in batch.items], None, {}, S, False))
    assert w.batch is staged_batch
    # Its end reckoned from the thread's start (3 ms earlier) and the timer set 4 ms earlier again.
    assert delay(loop, w) == pytest.approx(w.ends - clock.now - 0.003 - LEAD_S - 0.004, abs=0.002)
    # Lateness beyond the lead counts as the lead: the timer never runs more than twice the lead early.
    clock.now = w.ends - LEAD_S - pool.staging._timer_late + 0.5
    w.finished = w.batch  # (ended, so not overdue: it stages)
    fire(w)
    assert pool.staging._timer_late == pytest.approx(LEAD_S)
