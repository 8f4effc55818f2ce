"""Batch time learned by batch size (issue 13), and the batcher, pool and admission using the right S.

Pure policy: an injected clock, no server, no threads. The model below is a GPU-like one: a batch of 1 takes
20 ms, a batch of 100 takes 400 ms, so one S per model is wrong for every size but one."""

from __future__ import annotations

import asyncio
import math

import pytest

from batchserve.core.batch import BatchTimes, size_bucket, Batch
from batchserve.errors import ApiError
from batchserve.core.batcher import Batcher
from batchserve.core.admission import Admission
from batchserve.core.wait_prediction import predicted_latency_s
from batchserve.core.fairqueue import Item
from batchserve.gpu_pool import GpuPool, DeviceWorker
from tests.unit.fakes import Clock

M = "m@v1"


def gpu_like(max_batch: int = 100) -> BatchTimes:
    times = BatchTimes(max_batch, {M: 1.0})
    times.observe(M, 1, 0.020)
    times.observe(M, 100, 0.400)
    return times


# -- the estimator --------------------------------------------------------------------------------------------
def test_sizes_fall_in_power_of_two_buckets() -> None:
    assert [size_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 100, 128)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        5,
        6,
        7,
        7,
        7,
    ]


def test_the_seed_holds_until_a_batch_is_measured() -> None:
    times = BatchTimes(100, {M: 0.7})
    assert times.at(M, 1) == times.at(M, 100) == times[M] == 0.7
    times.observe(M, 10, 0.2)
    assert times.at(M, 1) == times.at(M, 100) == 0.2  # one point: flat both ways, the seed is forgotten


def test_the_least_expected_time_is_never_above_the_seed() -> None:
    # One slow first batch must not make every deadline look unmeetable: nothing would run to correct it.
    times = BatchTimes(100, {M: 0.1})
    assert times.lower_bound(M, 1) == 0.1
    times.observe(M, 1, 2.5)  # a cold or hung first batch
    assert times.at(M, 1) == times.at(M, 100) == 2.5 and times.lower_bound(M, 1) == times.lower_bound(M, 100) == 0.1
    for _ in range(30):
        times.observe(M, 1, 0.04)
    assert times.lower_bound(M, 1) == times.at(M, 1) < 0.1  # faster than the seed: what was learned
    assert BatchTimes(100).lower_bound(M, 1) == BatchTimes(100).at(M, 1)  # no seed: the learned (or default)


def test_between_points_the_time_is_interpolated_by_size() -> None:
    times = gpu_like()
    assert times.at(M, 1) == pytest.approx(0.020)
    assert times.at(M, 100) == pytest.approx(0.400)
    assert times.at(M, 34) == pytest.approx(0.020 + 0.380 * 33 / 99)
    assert times[M] == pytest.approx(0.400)  # indexing: a full batch


def test_below_the_smallest_point_it_stays_flat_and_sizes_are_clamped() -> None:
    times = BatchTimes(100)
    times.observe(M, 8, 0.1)
    times.observe(M, 64, 0.3)
    assert times.at(M, 1) == times.at(M, 0) == pytest.approx(0.1)
    assert times.at(M, 500) == times.at(M, 100)


def test_above_the_largest_point_it_extends_the_widest_line_never_down_nor_past_proportional() -> None:
    times = BatchTimes(100)
    times.observe(M, 1, 0.010)
    times.observe(M, 2, 0.011)
    times.observe(M, 8, 0.017)
    # the line through sizes 1 and 8 (1 ms per input), not the noisier 2..8 neighbours
    assert times.at(M, 100) == pytest.approx(0.017 + 0.001 * 92)
    falling = BatchTimes(100)
    falling.observe(M, 1, 0.05)
    falling.observe(M, 10, 0.04)
    assert falling.at(M, 100) == pytest.approx(0.04)  # never extrapolated downwards
    steep = BatchTimes(100)
    steep.observe(M, 1, 0.001)
    steep.observe(M, 10, 0.1)
    assert steep.at(M, 100) == pytest.approx(0.1 * 100 / 10)  # at most proportional to the largest point


def test_each_bucket_is_a_moving_mean_of_its_own_batches() -> None:
    times = BatchTimes(100, alpha=0.5)
    times.observe(M, 60, 0.3)
    times.observe(M, 40, 0.1)  # same bucket (33-64)
    assert times.by_size(M) == {50: pytest.approx(0.2)}
    times.observe(M, 1, 0.01)  # another bucket leaves it alone
    assert times.by_size(M) == {1: 0.01, 50: pytest.approx(0.2)}


# -- the batcher ----------------------------------------------------------------------------------------------


def items(loop: asyncio.AbstractEventLoop, n: int, at: float, bucket: int = 0) -> list[Item]:
    return [Item(f"x{i}", M, bucket, loop.create_future(), arrived=at, deadline=at + 60) for i in range(n)]


def batcher(clock: Clock, times: BatchTimes, slo_s: float = 1.0, workers: int = 1) -> Batcher:
    b = Batcher(max_batch_size=times.max_batch_size, slo_s=slo_s, margin_s=0.01, batch_s=times, clock=clock)
    b.healthy_workers = workers
    return b


def test_the_dispatch_deadline_uses_the_time_of_the_batch_formed_now(loop) -> None:
    clock = Clock()
    b = batcher(clock, gpu_like(), workers=2)  # (one device would take its batch as soon as it frees)
    b.last_dispatch = clock.t + 60  # pacing out of the way: the deadline decides
    b.submit(items(loop, 1, clock.t)[0])
    _, due, cause = b.most_urgent(clock.t)
    assert cause == "deadline" and due == pytest.approx(clock.t + 1.0 - 0.020 - 0.01)  # a lone item: S(1)
    for item in items(loop, 59, clock.t):
        b.submit(item)
    _, due, _ = b.most_urgent(clock.t)
    assert due == pytest.approx(clock.t + 1.0 - b.batch_s.at(M, 60) - 0.01)  # sixty waiting: S(60)
    assert b.batch_s.at(M, 60) > 0.2


def test_pacing_spaces_dispatches_by_the_time_of_the_batch_formed_now(loop) -> None:
    clock = Clock()
    b = batcher(clock, gpu_like(), slo_s=10.0, workers=2)
    b.last_dispatch = clock.t
    for item in items(loop, 5, clock.t):
        b.submit(item)
    _, due, cause = b.most_urgent(clock.t)
    assert cause == "pace" and due == pytest.approx(clock.t + b.batch_s.at(M, 5) / 2)
    clock.t = due
    batch = b.take_now(0)
    assert batch is not None and len(batch.items) == 5 and batch.cause == "pace"


def test_a_finished_batch_teaches_the_bucket_of_its_size(loop) -> None:
    b = batcher(Clock(), BatchTimes(100, {M: 1.0}))
    b.costs.observe(M, 0.05, 3)
    b.costs.observe(M, 0.5, 90)
    assert b.batch_s.by_size(M) == {3: 0.05, 90: 0.5}


# -- the pool and admission -----------------------------------------------------------------------------------
def test_a_small_running_batch_frees_its_worker_after_its_own_time(loop) -> None:
    clock = Clock()
    times = gpu_like()
    b = batcher(clock, times)
    pool = GpuPool({}, b, None, loop, ["gpu:0"], clock=clock)  # type: ignore[arg-type]
    w = DeviceWorker(0, "gpu:0")
    pool.workers.append(w)
    batch = Batch(M, items(loop, 1, clock.t), clock.t, "deadline")
    pool._begin(w, batch, batch.cost)
    assert pool.seconds_until_free(clock.t + 0.005) == pytest.approx(0.015)  # S(1) = 20 ms, not S(100)
    assert w.watchdog is not None
    w.watchdog.cancel()


class Idle:
    def healthy_count(self) -> int:
        return 1

    def worker_count(self) -> int:
        return 1

    def seconds_until_free(self, now: float) -> float:
        return 0.0


def test_admission_predicts_a_lone_item_by_its_own_small_batch(loop) -> None:
    clock = Clock()
    b = batcher(clock, gpu_like())
    door = Admission(b, Idle(), max_queue=1000, slo_s=0.2, slack=1.0, clock=clock)
    door.admit_ticket(M, tier=1, tenant="", deadline_s=0.1)  # S(1) = 20 ms fits a 100 ms deadline: admitted
    for item in items(loop, 150, clock.t):
        b.submit(item)
    with pytest.raises(ApiError) as refused:  # a full batch ahead (400 ms) plus its own: past the deadline
        door.admit_ticket(M, tier=1, tenant="", deadline_s=0.3)
    assert refused.value.code == "SERVICE_OVERLOADED"


def test_predicted_latency_adds_full_batches_ahead_and_its_own_batch() -> None:
    assert predicted_latency_s(
        0.1, ahead=250, max_batch_size=100, batch_s=0.4, healthy=2, own_batch_s=0.2
    ) == pytest.approx(0.1 + 2 * 0.4 / 2 + 0.2)
    assert predicted_latency_s(0.0, 0, 100, 0.4, 1) == 0.4  # no own size given: a full batch
    assert not math.isnan(predicted_latency_s(0.0, 0, 100, 0.4, 0))
