"""Job items fill batches but never hurry them (issue 28, the soak): in-process, on an injected clock.

With several workers, a queue made full (or due) only by batch-job items used to go the moment a worker
freed; the workers then fell into step and an interactive item waited up to a whole batch time for the next
one (the soak: a clean 5,000-item job beside interactive load at half the capacity moved its p95 from 150 to
196 ms). Such a queue now goes at the pace S/G, or at its oldest interactive item's deadline.
"""

from __future__ import annotations


import pytest

from batchserve.core.batcher import Batcher
from batchserve.core import tiers
from batchserve.core.batch import BatchTimes
from batchserve.core.fairqueue import Item
from tests.unit.fakes import Clock

PAID, BATCH = tiers.BY_NAME["paid"].rank, tiers.BATCH.rank
S = 0.1  # the learned batch time


def item(loop, text: str, arrived: float, tier: int = PAID, tenant: str = "live") -> Item:
    return Item(text, "m", 0, loop.create_future(), arrived, 1e9, None, tier, tenant)


def batcher(clock: Clock, workers: int, max_batch: int = 4) -> Batcher:
    b = Batcher(
        max_batch_size=max_batch,
        slo_s=0.2,
        margin_s=0.005,
        batch_s=BatchTimes(max_batch, {"m": S}),
        healthy_workers=workers,
        clock=clock,
    )
    b.last_dispatch = clock.now  # a batch just went out: the pace S/G is ahead
    return b


def test_a_queue_full_only_by_job_items_waits_for_the_pace(loop):
    clock = Clock(1000.0)
    b = batcher(clock, workers=2)
    b.submit(item(loop, "live", clock.now))
    for i in range(6):  # old job items: full by count, and their deadline long passed
        b.submit(item(loop, f"job-{i}", clock.now - 5.0, tier=BATCH, tenant="acme"))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "pace" and due == pytest.approx(clock.now + S / 2)
    assert b.take_now(0) is None
    clock.now += S / 2
    batch = b.take_now(0)
    assert batch is not None and len(batch.items) == 4 and batch.items[0].text == "live"


def test_job_items_alone_go_at_the_pace(loop):
    clock = Clock(1000.0)
    b = batcher(clock, workers=2)
    for i in range(6):
        b.submit(item(loop, f"job-{i}", clock.now - 5.0, tier=BATCH, tenant="acme"))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "pace" and due == pytest.approx(clock.now + S / 2)


def test_the_interactive_items_deadline_still_comes_before_a_later_pace(loop):
    clock = Clock(1000.0)
    b = batcher(clock, workers=2)
    b.slo_s = 0.14  # 140 ms - S - 5 ms margin: 35 ms of waiting for company, before the pace (50 ms)
    b.submit(item(loop, "live", clock.now))
    for i in range(6):
        b.submit(item(loop, f"job-{i}", clock.now - 5.0, tier=BATCH, tenant="acme"))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "deadline" and due == pytest.approx(clock.now + 0.035)


def test_interactive_items_that_fill_a_batch_go_at_once_beside_jobs(loop):
    clock = Clock(1000.0)
    b = batcher(clock, workers=2)
    for i in range(4):
        b.submit(item(loop, f"live-{i}", clock.now))
    b.submit(item(loop, "job", clock.now, tier=BATCH, tenant="acme"))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "full" and due == clock.now


def test_one_worker_takes_a_job_filled_batch_at_once(loop):
    # One device: the worker asking is the device; there is nothing to stagger.
    clock = Clock(1000.0)
    b = batcher(clock, workers=1)
    for i in range(4):
        b.submit(item(loop, f"job-{i}", clock.now, tier=BATCH, tenant="acme"))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "full" and due == clock.now


def test_under_steady_interactive_load_a_background_batch_still_gets_its_floor(loop):
    """An isolated job's groups went only in gaps: with interactive items always waiting they never ran (the
    soak's 10 %-failing job with a pass/fail backend). Now one dispatch in BACKGROUND_FLOOR_EVERY + 1."""
    from batchserve.core.retries import BACKGROUND_FLOOR_EVERY

    clock = Clock(1000.0)
    b = batcher(clock, workers=1, max_batch=2)
    b.submit_group([item(loop, "iso", clock.now, tier=BATCH, tenant="acme")])
    kinds = []
    for i in range(2 * (BACKGROUND_FLOOR_EVERY + 1)):
        for j in range(2):  # the interactive queue is never empty
            b.submit(item(loop, f"live-{i}-{j}", clock.now))
        if i == BACKGROUND_FLOOR_EVERY + 1:
            b.submit_group([item(loop, "iso-2", clock.now, tier=BATCH, tenant="acme")])
        batch = b.take_now(0)
        assert batch is not None
        kinds.append("iso" if batch.isolated else "live")
    assert kinds == (["live"] * BACKGROUND_FLOOR_EVERY + ["iso"]) * 2
