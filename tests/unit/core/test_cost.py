"""Cost, not count (issue 22; issue 28 item 1): the learned batch time by cost, batches formed within a cost
budget, the door predicting a request as the batches it will make, a budget lowered to fit the longest timeout,
and the watchdog's limit following each batch's expected time.

Pure policy: an injected clock, no server, no threads. The model below is a CPU-like token model: a batch takes
10 ms plus 0.5 ms per padded token, so a batch of 60 long inputs (256 tokens) takes 7.7 s and one of 60 short
inputs (16 tokens) 0.49 s — one time per batch size is wrong for both."""

from __future__ import annotations

import logging
import math

import pytest

from batchserve.core.batcher import Batcher
from batchserve.core.batch import Batch, BatchTimes
from batchserve.core.admission import FAST_SPIKE, Admission
from batchserve.core.wait_prediction import predict
from batchserve.core.fairqueue import Item
from batchserve import errors
from batchserve.errors import ApiError
from batchserve.gpu_pool import GPU_TIMEOUT_BATCHES, GPU_TIMEOUT_FLOOR_S, GpuPool
from tests.unit.fakes import Clock, Workers as FakeWorkers, token_s

M = "minilm@v1"


def learned(max_batch: int = 100) -> BatchTimes:
    """Two measured points, as minilm's warm-up gives them: a small and a large token count."""
    times = BatchTimes(max_batch, {M: token_s(200)})
    times.observe(M, 200, token_s(200))
    times.observe(M, 3200, token_s(3200))
    return times


def make_batcher(
    clock: Clock, budget: float = 0, max_batch: int = 100, slo_s: float = 0.2, max_batch_s: float = math.inf
) -> Batcher:
    return Batcher(
        max_batch_size=max_batch,
        slo_s=slo_s,
        margin_s=0.005,
        batch_s=learned(max_batch),
        max_batch_cost=budget,
        max_batch_s=max_batch_s,
        clock=clock,
    )


def item(loop, cost: float, at: float = 100.0, tenant: str = "t", deadline: float = 1e9, bucket: int = 0) -> Item:
    return Item(f"x{cost}", M, bucket, loop.create_future(), at, deadline, None, 1, tenant, cost=cost)


def submit(b: Batcher, it: Item) -> None:
    b.costs.note_cost(M, it.cost)  # as the door does for every admitted input
    b.submit(it)


# -- the cost model ---------------------------------------------------------------------------------------------
def test_batch_time_is_read_at_the_batch_cost_not_its_size(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    for _ in range(3):
        submit(b, item(loop, 256))
    long3 = Batch(M, [item(loop, 256) for _ in range(3)], clock.t, "full")
    short3 = Batch(M, [item(loop, 16) for _ in range(3)], clock.t, "full")
    assert long3.cost == 3 * 256 and short3.cost == 3 * 16
    mixed = Batch(M, [item(loop, 16), item(loop, 16), item(loop, 200)], clock.t, "full")
    assert mixed.cost == 3 * 200  # padded: rows x the longest row
    # interpolated on the line through the measured points, well above the 100-input clamp of a count model
    assert b.batch_s.at(M, long3.cost) == pytest.approx(token_s(768))
    assert b.batch_s.at(M, 3200) > 10 * b.batch_s.at(M, 200)


def test_a_model_whose_inputs_cost_one_keeps_its_count_model(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    b.costs.note_cost(M, 1.0)
    assert M not in b.costs.unit and M not in b.batch_s.caps and M not in b.batch_s.full  # nothing changed
    assert b.costs.full_n(M) == 100 and b.batch_s[M] == b.batch_s.at(M, 100)


def test_a_full_batch_is_read_at_the_mean_input_cost(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    for _ in range(500):
        b.costs.note_cost(M, 30.0)
    assert b.costs.unit[M] == pytest.approx(30.0)
    assert b.costs.full_n(M) == 100
    assert b.batch_s[M] == pytest.approx(token_s(100 * 30), rel=1e-3)  # capacity reads S at a full batch's cost


# -- budgeted formation -------------------------------------------------------------------------------------
def test_a_batch_stops_filling_at_the_cost_budget(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, budget=100)
    for _ in range(5):
        submit(b, item(loop, 30))
    batch = b.form((M, 0), clock.t, "full")
    assert batch is not None and len(batch.items) == 3 and batch.cost == 90  # a fourth would cost 120
    assert b.depth[M] == 2  # the rest wait for the next batch, counted
    assert len(b.form((M, 0), clock.t, "full").items) == 2


def test_the_budget_counts_padding_and_an_input_alone_still_runs(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, budget=100)
    for cost in (10, 10, 50, 10):
        submit(b, item(loop, cost))
    first = b.form((M, 0), clock.t, "full")
    assert [i.cost for i in first.items] == [10, 10]  # with the 50 the batch would cost 3 x 50 = 150
    second = b.form((M, 0), clock.t, "full")
    assert [i.cost for i in second.items] == [50, 10] and second.cost == 100  # padded to the 50: just fits
    b.costs.set_max_batch_cost(40)
    submit(b, item(loop, 60))
    alone = b.form((M, 0), clock.t, "full")
    assert [i.cost for i in alone.items] == [60]  # over the budget alone (lowered since it was admitted): runs


def test_a_queue_at_its_budget_is_full(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, budget=100)
    b.last_dispatch = clock.t + 60
    submit(b, item(loop, 60))
    _, _, cause = b.most_urgent(clock.t)
    assert cause != "full"
    submit(b, item(loop, 60))
    _, due, cause = b.most_urgent(clock.t)
    assert cause == "full" and due == clock.t


def test_inputs_of_another_length_class_wait_in_their_own_queue(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    submit(b, item(loop, 10, bucket=0))
    submit(b, item(loop, 250, bucket=4))
    submit(b, item(loop, 12, bucket=0))
    batch = b.form((M, 0), clock.t, "full")
    assert sorted(i.cost for i in batch.items) == [10, 12] and batch.cost == 24  # not 3 x 250


def test_a_queue_full_by_cost_takes_turns_with_a_short_one(loop) -> None:
    # Long inputs fill their queue's budget at every turn; a short input in its own length class must not wait
    # for them until its deadline (issue 28: one tenant's long inputs, another's short ones).
    clock = Clock()
    b = make_batcher(clock, budget=300)
    for _ in range(20):
        submit(b, item(loop, 256, bucket=4))
    formed = []
    for _ in range(2):
        key, due, cause = b.most_urgent(clock.t)
        formed.append(b.form(key, clock.t, cause, due))
        clock.t += 0.1
        if len(formed) == 1:
            submit(b, item(loop, 10, at=clock.t, bucket=0))
    assert [len(x.items) for x in formed] == [1, 1]  # a long input alone: two would cost 512
    assert [x.items[0].bucket for x in formed] == [4, 0]  # then the short one, not the next long one


def test_the_dispatch_deadline_reads_the_cost_of_the_batch_formed_now(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, slo_s=5.0)
    b.healthy_workers = 2
    b.last_dispatch = clock.t + 60  # pacing out of the way
    for _ in range(10):
        submit(b, item(loop, 200, bucket=3))
    _, due, cause = b.most_urgent(clock.t)
    assert cause == "deadline"
    assert due == pytest.approx(clock.t + 5.0 - token_s(10 * 200) - 0.005, rel=1e-3)


# -- the budget lowered to fit the longest timeout, and raised back ----------------------------------------------
def test_a_full_batch_past_the_longest_timeout_lowers_the_budget_then_it_comes_back(loop, caplog) -> None:
    clock = Clock()
    b = make_batcher(clock, max_batch_s=1.0)
    for _ in range(200):
        b.costs.note_cost(M, 100.0)  # a full batch: 100 x 100 tokens, expected 5 s
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        b.costs.observe(M, token_s(3200), 3200)
    limited = b.costs.cost_limits[M]
    assert b.batch_s.at(M, limited) <= 1.0 and limited >= 100
    assert b.costs.full_n(M) < 100 and b.batch_s[M] <= 1.0
    assert sum("its batches are limited to cost" in r.getMessage() for r in caplog.records) == 1
    b.costs.observe(M, token_s(3200), 3200)  # the same figure again: no second line
    assert sum("its batches are limited to cost" in r.getMessage() for r in caplog.records) == 1
    # The figure was wrong (the machine was busy): batches within the budget run ten times faster, the line
    # above them no longer says a full batch misses, and the budget goes back: step by step, each step at most
    # twice the costliest batch that ran (batches fill to the budget of the moment, as traffic would fill them).
    rises = []
    for _ in range(30):
        now_limit = b.costs.cost_limits.get(M, 100 * 100.0)
        rises.append(now_limit)
        b.costs.observe(M, token_s(now_limit) / 10, now_limit)
        b.costs.observe(M, token_s(100) / 10, 100)
    assert all(b2 <= 2 * a2 for a2, b2 in zip(rises, rises[1:]))
    assert M not in b.costs.cost_limits and b.costs.full_n(M) == 100


def test_a_lowered_budget_rises_no_faster_than_twice_the_costliest_batch_measured(loop) -> None:
    """The soak's first request of 60 long inputs: after one cheap long-input batch the line past the points said
    a batch of 59 of them fitted the latency objective; it took 4.3 s and the only worker was marked hung."""
    clock = Clock()
    b = Batcher(
        max_batch_size=100,
        slo_s=0.2,
        margin_s=0.005,
        batch_s=BatchTimes(100, {M: 0.045}),
        latency_fit_s=0.125,
        clock=clock,
    )
    b.batch_s.observe(M, 300, 0.045)  # warm-up: short inputs, batches costing 300 and 1,200 tokens
    b.batch_s.observe(M, 1200, 0.060)
    for _ in range(50):
        b.costs.note_cost(M, 12.0)
    b.costs.note_cost(M, 256.0)  # a long input: a full batch of them would not fit, the budget is lowered
    lowered = b.costs.cost_limits[M]
    assert lowered < 100 * 256
    b.costs.observe(M, 0.058, 256)  # one long input alone, about as slow as the big short batch: a flat line...
    assert b.batch_s.at(M, 100 * 256) <= 0.125  # ...which promises that a whole batch of them fits
    assert b.costs.cost_limits.get(M, math.inf) <= max(lowered, 2 * 1200)  # but the budget rises to twice what ran
    b.costs.observe(M, 0.09, 2400)  # a batch that costly ran in time: the next may be twice as costly
    assert b.costs.cost_limits.get(M, math.inf) <= max(lowered, 2 * 2400)


# -- the door -------------------------------------------------------------------------------------------------
def door(b: Batcher, clock: Clock, capacity: FakeWorkers | None = None, slo_s: float = 0.2) -> Admission:
    return Admission(b, capacity or FakeWorkers(), max_queue=100_000, slo_s=slo_s, slack=1.25, clock=clock)


def test_a_request_of_many_inputs_is_predicted_as_the_batches_it_will_make(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    for _ in range(200):
        b.costs.note_cost(M, 12.0)
    p = predict(b, M, 0.0, 1, 0, [12.0] * 2048)
    full_s = b.batch_s[M]
    assert p.first_s == pytest.approx(b.batch_s.at(M, 12.0))
    assert p.last_s == pytest.approx(20 * full_s + b.batch_s.at(M, 48 * 12.0))  # 20 full batches, then 48
    d = door(b, clock, FakeWorkers(until_free=0.01))
    assert d.admit_ticket(M, 1, "t", deadline_s=60.0, costs=[12.0] * 2048).probe is False  # fits its 60 s: served
    with pytest.raises(ApiError) as refused:
        d.admit_ticket(M, 1, "t", deadline_s=p.last_s / 2, costs=[12.0] * 2048)
    assert refused.value.status == 503 and refused.value.code == "SERVICE_OVERLOADED"


def test_other_length_classes_ahead_count_as_the_batches_they_will_make(loop) -> None:
    # 60 short and 30 long inputs queued under a budget of 1,000 tokens: the short class (10 tokens) makes one
    # batch of 60, the long one (100 tokens) three of 10. Counted as one queue of 90 inputs of the mean cost, the
    # wait was neither: the classes take turns, so a short input waits for one long batch (never all three)
    # and then its class's batch, and a long one for its class's 3 batches and the short class's one.
    clock = Clock()
    b = make_batcher(clock, budget=1000)
    for i in range(60):
        submit(b, item(loop, 10.0, bucket=0))
        if i < 30:
            submit(b, item(loop, 100.0, bucket=1))
    ahead = b.ahead_of(1, "t")  # the same tenant: behind every queued input
    short = predict(b, M, 0.0, 1, ahead, [10.0], bucket=0)
    long_batch_s = b.batch_s.at(M, 1000.0)
    assert short.first_s == pytest.approx(long_batch_s + b.batch_s.at(M, 610.0))  # one long batch, then its own
    # A long input waits behind its own class's 3 batches and the short class's one batch (turns again).
    long = predict(b, M, 0.0, 1, ahead, [100.0], bucket=1)
    assert long.first_s == pytest.approx(b.batch_s.at(M, 600.0) + 3 * long_batch_s + b.batch_s.at(M, 100.0))
    # A model of one class (the sim, any plugin without bucket_of) is predicted exactly as before.
    one = make_batcher(clock, budget=1000)
    for _ in range(60):
        submit(one, item(loop, 10.0, bucket=0))
    ahead = one.ahead_of(1, "t")
    assert predict(one, M, 0.0, 1, ahead, [10.0], bucket=0) == predict(one, M, 0.0, 1, ahead, [10.0])


def test_pressure_reads_what_a_costed_models_batches_really_serve(loop) -> None:
    # The full batch says 1,000 tokens of 10-token inputs, 100 inputs in ~0.5 s: 200 a second. Its length
    # classes and padding made batches of 10 taking 0.2 s: 50 a second. 80 arrivals a second is overload once
    # the queue grows past the next batch's 10 inputs; while each batch takes all that waits, it is chance.
    clock = Clock()
    b = make_batcher(clock, budget=1000)
    for _ in range(50):
        b.costs.note_cost(M, 10.0)
    d = door(b, clock)
    assert b.costs.full_n(M) / b.batch_s[M] > 150
    assert not d.under_pressure(M, 80.0, 80.0)  # nothing measured yet: the full batch's figure
    for _ in range(20):
        b.costs.observe(M, 0.2, 10 * 10.0, rows=10)
    assert b.costs.served_rate(M) == pytest.approx(50.0)
    assert not d.under_pressure(M, 80.0, 80.0)  # nothing waits past the next batch
    for depth in range(1, 12):
        submit(b, item(loop, 10.0, bucket=0))
        assert d.under_pressure(M, 80.0, 80.0) == (depth > 10), depth
    assert not d.under_pressure(M, 40.0, 40.0)
    # The short horizon's flood reads the same backlog: a worker that takes all that waits is not flooded.
    fast = d.arrivals_fast.tick(clock.t, 30)  # 30 at once: 120 a second on the 0.25 s horizon
    assert fast > FAST_SPIKE * 50.0 and d.under_pressure(M, 40.0, fast)
    b.drop_all(errors.draining())  # the worker took all that waited
    assert b.depth.get(M, 0) == 0 and not d.under_pressure(M, 40.0, fast)
    # A model whose inputs all cost 1 (the sim, a plugin without cost_of) keeps the full batch's figure.
    sim = Batcher(max_batch_size=100, slo_s=0.2, margin_s=0.005, batch_s=BatchTimes(100, {"sim": 0.1}), clock=clock)
    sim.costs.observe("sim", 0.1, 10, rows=10)
    assert sim.costs.served_rate("sim") is None


def test_a_flood_of_many_inputs_still_admits_what_fits_its_deadline(loop) -> None:
    # 2,048 arrivals at once look like a spike (pressure); the objective bounds when its first input is answered,
    # its deadline when its last is: an idle server serves it.
    clock = Clock()
    b = make_batcher(clock)
    for _ in range(200):
        b.costs.note_cost(M, 12.0)
    d = door(b, clock, FakeWorkers(until_free=0.01))
    d.admit_ticket(M, 1, "t", deadline_s=60.0, costs=[12.0] * 2048)
    assert d.under_pressure(M, d.arrivals.current(clock.t), d.arrivals_fast.current(clock.t))
    d.admit_ticket(M, 1, "t2", deadline_s=60.0, costs=[12.0] * 10)  # behind the first: its objective, not its size


def test_refusal_is_by_the_cost_of_the_work_ahead_with_a_truthful_retry(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    for _ in range(300):
        submit(b, item(loop, 200))  # 300 long inputs queued: 3 batches of 100 x 200 tokens, ~10 s each
    d = door(b, clock, FakeWorkers(until_free=0.5))
    ahead_s = 0.5 + 3 * b.batch_s[M]
    assert b.batch_s[M] > 9
    with pytest.raises(ApiError) as refused:
        d.admit_ticket(M, 1, "t", deadline_s=2.0, costs=[10.0])
    retry_ms = refused.value.retry_after_ms
    assert retry_ms is not None and 0 < retry_ms <= (ahead_s + b.batch_s[M]) * 1000
    d.admit_ticket(M, 1, "t", deadline_s=ahead_s + b.batch_s[M] + 1.0, costs=[10.0])  # a deadline past it: admitted
    # Another tenant waits behind one input of each busy tenant (its fair share), not the whole queue.
    d.admit_ticket(M, 1, "new", deadline_s=2.0, costs=[10.0])


def test_an_input_costlier_than_a_whole_batch_is_refused_413(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, budget=1000)
    with pytest.raises(ApiError) as refused:
        door(b, clock).admit_ticket(M, 1, "t", deadline_s=60.0, costs=[12.0, 1500.0])
    assert refused.value.status == 413 and "1500" in refused.value.message
    door(b, clock).admit_ticket(M, 1, "t", deadline_s=60.0, costs=[12.0, 1000.0])
    # No budget set, but alone it would outlast half the longest timeout (1 s here): it can never run in time.
    unbounded = make_batcher(clock, max_batch_s=1.0)
    with pytest.raises(ApiError) as refused:
        door(unbounded, clock).admit_ticket(M, 1, "t", deadline_s=60.0, costs=[2500.0])
    assert refused.value.status == 413
    door(unbounded, clock).admit_ticket(M, 1, "t", deadline_s=60.0, costs=[1500.0])  # 0.76 s alone: it runs


def test_one_tenants_long_inputs_are_shed_before_anothers_short_ones(loop) -> None:
    # The issue-28 scenario: one tenant floods long inputs, another sends a short one now and then.
    clock = Clock()
    b = make_batcher(clock, budget=1024, slo_s=0.4)
    for _ in range(30):
        submit(b, item(loop, 256, tenant="long"))
    d = door(b, clock, FakeWorkers(until_free=0.1), slo_s=0.4)
    d.arrivals_fast.tick(clock.t, 200)  # a flood: pressure
    assert d.under_pressure(M, 0.0, d.arrivals_fast.current(clock.t))
    with pytest.raises(ApiError) as refused:
        d.admit_ticket(M, 1, "long", deadline_s=30.0, costs=[256.0] * 4)
    assert refused.value.status == 503 and "latency objective" in refused.value.message
    d.admit_ticket(M, 1, "short", deadline_s=30.0, costs=[16.0])


# -- the watchdog's limit per batch -------------------------------------------------------------------------
def test_the_watchdog_limit_follows_the_batch_cost_between_floor_and_ceiling(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    b.costs.note_cost(M, 256.0)
    pool = GpuPool({}, b, None, loop, ["cpu"], clock=clock, gpu_timeout_ceiling_s=60.0)  # type: ignore[arg-type]
    short = Batch(M, [item(loop, 16) for _ in range(4)], clock.t, "full")
    long = Batch(M, [item(loop, 256) for _ in range(30)], clock.t, "full")
    assert pool.timeout_s(short) == pytest.approx(max(GPU_TIMEOUT_FLOOR_S, GPU_TIMEOUT_BATCHES * b.batch_s.at(M, 64)))
    assert pool.timeout_s(short) < 2.0
    assert pool.timeout_s(long) == pytest.approx(GPU_TIMEOUT_BATCHES * token_s(30 * 256), rel=1e-3)
    assert pool.timeout_s(long) > 30 * token_s(256)  # not the short batch's limit: no false hang mark
    huge = Batch(M, [item(loop, 256) for _ in range(100)], clock.t, "full")
    assert pool.timeout_s(huge) == 60.0  # the ceiling
    pool.gpu_timeout_s = 3.0
    assert pool.timeout_s(long) == 3.0  # set by hand: as set


# -- a backend's own batch cost (cost_of_batch) -----------------------------------------------------------------
def words_sum(texts: list[str]) -> float:
    """A backend whose batch costs the sum of its inputs' tokens (no padding): a word is a token here."""
    return float(sum(len(t.split()) for t in texts))


def words_item(loop, words: int, deadline: float = 1e9) -> Item:
    text = " ".join(["w"] * words)
    return Item(
        text, M, 0, loop.create_future(), 100.0, deadline, None, 1, "t", cost=words_sum([text]), batch_cost=words_sum
    )


def test_a_declared_batch_cost_is_what_the_batch_costs_and_what_fills_it(loop) -> None:
    clock = Clock()
    b = make_batcher(clock, budget=100)
    submit(b, words_item(loop, 30))
    for _ in range(20):
        submit(b, words_item(loop, 5))
    batch = b.form((M, 0), clock.t, "full")
    # Padded (rows x longest) a fourth row would pass 100: 3 inputs. Summed: 30 + 14 x 5 = 100: 15 inputs.
    assert batch is not None and len(batch.items) == 15
    assert batch.cost == 100.0
    assert b.depth[M] == 6
    padded = Batch(M, [item(loop, 30)] + [item(loop, 5) for _ in range(14)], clock.t, "full")
    assert padded.cost == 15 * 30  # a backend that declares nothing keeps the padded formula


def test_without_a_budget_a_declared_batch_cost_is_asked_once_per_batch(loop) -> None:
    calls: list[int] = []

    def counted(texts: list[str]) -> float:
        calls.append(len(texts))
        return words_sum(texts)

    clock = Clock()
    b = make_batcher(clock)  # no budget: formation asks nothing of the backend
    for _ in range(10):
        it = words_item(loop, 5)
        it.batch_cost = counted
        submit(b, it)
    batch = b.form((M, 0), clock.t, "full")
    # No per-input call while filling: one call for the whole batch (its cost, read to pace the next one).
    assert batch is not None and len(batch.items) == 10 and calls == [10]
    assert batch.cost == 50.0


def test_the_door_costs_inputs_by_the_declared_batch_cost(loop) -> None:
    from batchserve.core.service import batch_cost_of

    class Summed:
        def cost_of(self, text: str) -> float:
            return 1.0

        def cost_of_batch(self, texts: list[str]) -> float:
            return words_sum(texts)

    class Plain:
        def cost_of(self, text: str) -> float:
            return 1.0

    assert batch_cost_of(Plain()) is None
    fn = batch_cost_of(Summed())
    assert fn is not None and fn(["a b", "c"]) == 3.0
    # Admission reads the costs the door got from it: an input alone over the budget is refused 413.
    clock = Clock()
    b = make_batcher(clock, budget=100)
    d = door(b, clock)
    with pytest.raises(ApiError) as refused:
        d.admit_ticket(M, 1, "t", deadline_s=30.0, costs=[fn([" ".join(["w"] * 120)])])
    assert refused.value.status == 413


def test_the_watchdog_reads_a_declared_batch_cost(loop) -> None:
    clock = Clock()
    b = make_batcher(clock)
    b.costs.note_cost(M, 256.0)
    pool = GpuPool({}, b, None, loop, ["cpu"], clock=clock, gpu_timeout_ceiling_s=60.0)  # type: ignore[arg-type]
    summed = Batch(M, [words_item(loop, 256)] + [words_item(loop, 4) for _ in range(29)], clock.t, "full")
    assert summed.cost == 256 + 29 * 4
    expected = max(GPU_TIMEOUT_FLOOR_S, GPU_TIMEOUT_BATCHES * b.batch_s.at(M, 256 + 29 * 4))
    assert pool.timeout_s(summed) == pytest.approx(expected)
    assert expected < GPU_TIMEOUT_BATCHES * token_s(30 * 256) / 2  # not the padded batch's limit


# -- smollm2's cost: prompt tokens + the new tokens it decodes -------------------------------------------------
class WordTokenizer:
    """Stands in for SmolLM2's tokenizer (loading the real one means the GGUF): a word is a token, and the chat
    template adds three; counts how often it is asked."""

    def __init__(self) -> None:
        self.calls = 0

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "system user assistant " + messages[0]["content"]

    def __call__(self, prompts: list[str]) -> dict[str, list[list[str]]]:
        self.calls += 1
        return {"input_ids": [p.split() for p in prompts]}


def test_smollm2_costs_prompt_tokens_plus_new_tokens_counted_once() -> None:
    from batchserve.backends.smollm2 import SHELL_PROMPT_TOKENS, SmolLM2Backend

    tok = WordTokenizer()
    backend = SmolLM2Backend(devices=["cpu"], max_new_tokens=64, tokenizer=tok)
    assert backend.cost_of("one two three") == 3 + 3 + 64
    assert backend.cost_of("one two three") == 70 and tok.calls == 1  # cached: the door does not tokenize again
    long = " ".join(["w"] * 40)
    # The static decoder's padded shape: every row runs to the longest prompt plus max_new_tokens.
    assert backend.padded_cost(["hi", long]) == 2 * (3 + 40 + 64)
    shell = SmolLM2Backend(devices=["cpu"], max_new_tokens=64)  # --executor process: no tokenizer here
    assert shell.cost_of("x" * 400) == SHELL_PROMPT_TOKENS + 100 + 64
