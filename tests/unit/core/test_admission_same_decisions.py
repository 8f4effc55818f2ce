"""The door's per-request shortcuts decide exactly as the formula they replace (issue 23, item 5).

The hot path's admission was cut by reading less per request: S is remembered per batch cost between two
batches (`BatchTimes.at`), a one-input request skips the many-batches part of the prediction, the classes' arrival
rates are read only when the model has another length class, an idle worker admits before the prediction, and
without pressure a request whose deadline no prediction could reach is admitted without one; a model's figures
(S of a full batch, the longest batch, the budget, the capacity) are read once per change, not per request.
Each is meant to change no decision. Here the prediction as it was written before those cuts (`reference`, copied
from batchserve at ebee825) and the door with every class rate read are run beside today's code over random
queues, budgets, learned lines and requests, and must give the same numbers and the same refusals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import pytest

from batchserve.core.admission import Admission
from batchserve.core.wait_prediction import WaitPrediction, _by_turns, predict
from batchserve.core.batch import MEMO_KEPT, BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.core.fairqueue import Item
from batchserve.errors import ApiError
from tests.unit.fakes import Clock, Workers

M = "m@v1"


def reference(
    batcher: Batcher,
    model: str,
    until_free_s: float,
    healthy: int,
    ahead: int,
    costs: Sequence[float],
    bucket: int | None = None,
    rates: Mapping[int, float] | None = None,
) -> WaitPrediction:
    """`wait_prediction.predict` as it was before the hot-path cuts (ebee825), line for line."""
    times = batcher.batch_s
    full_n, limit, budget = batcher.costs.full_n(model), batcher.costs.limit(model), batcher.costs.budget(model)
    unit = batcher.costs.unit.get(model, 1.0)

    def per(cost: float) -> int:
        return limit if budget == math.inf else max(1, min(limit, int(budget // cost)))

    own_unit = max(costs, default=1.0)
    per_batch = per(own_unit)
    share = max(1, healthy)
    if bucket is not None and any(
        m == model and b != bucket and (len(q) or (rates and rates.get(b))) for (m, b), q in batcher.queues.items()
    ):
        return _by_turns(batcher, model, until_free_s, share, ahead, costs, bucket, rates or {}, limit, budget)
    full_s = times[model]
    if bucket is not None:
        row = batcher.costs.row_cost.get((model, bucket), 0.0)
        own_q = batcher.queues.get((model, bucket))
        unit = max(own_q.mean_cost() if own_q is not None and len(own_q) else unit, row)
        own_unit = max(own_unit, row)
        full_n, per_batch = per(unit), per(own_unit)
        full_s = times.at(model, batcher.costs.estimate_cost(model, full_n, unit))
    base = until_free_s + (ahead // full_n) * full_s / share
    rem = ahead % full_n
    if rem + 1 > per_batch:
        base += times.at(model, batcher.costs.estimate_cost(model, rem, unit)) / share
        rem = 0
    first = base + times.at(model, batcher.costs.estimate_cost(model, rem + 1, own_unit))
    total = rem + max(1, len(costs))
    k = -(-total // per_batch)
    last_rows = total - (k - 1) * per_batch
    last = (
        base
        + (k - 1) * times.at(model, batcher.costs.estimate_cost(model, per_batch, own_unit)) / share
        + times.at(model, batcher.costs.estimate_cost(model, last_rows, own_unit))
    )
    return WaitPrediction(first, max(first, last), base)


def fresh_s(times: BatchTimes, model: str, cost: float) -> float:
    """S at `cost` read off a line built now (no memo)."""
    copy = BatchTimes(
        times.max_batch_size,
        dict(times.seeds),
        dict(times.full),
        dict(times.caps),
        {m: dict(p) for m, p in times.points.items()},
    )
    return copy.at(model, cost)


def random_batcher(rng: random.Random, clock: Clock, loop) -> Batcher:
    """A model with a learned line (not always rising), maybe a cost budget, and queues in up to three classes."""
    times = BatchTimes(100, {M: rng.uniform(0.01, 0.2)})
    costed = rng.random() < 0.6
    for _ in range(rng.randint(0, 5)):
        cost = rng.uniform(1, 4000) if costed else float(rng.randint(1, 100))
        times.observe(M, cost, rng.uniform(0.005, 0.5))
    budget = rng.choice([0.0, 0.0, rng.uniform(50, 5000)])
    b = Batcher(
        max_batch_size=rng.choice([8, 32, 100]),
        slo_s=0.5,
        margin_s=0.005,
        batch_s=times,
        max_batch_cost=budget,
        clock=clock,
    )
    classes = rng.choice([1, 3]) if costed else 1  # one queue only: other classes known by their rates alone
    for _ in range(rng.randint(0, 250)):
        bucket = rng.randrange(classes)
        cost = rng.uniform(1, 60) * (bucket + 1) if costed else 1.0
        it = Item(
            "x",
            M,
            bucket,
            loop.create_future(),
            clock.t,
            clock.t + 30,
            None,
            rng.randint(0, 2),
            rng.choice("abc"),
            cost=cost,
        )
        b.costs.note_cost(M, cost)
        b.submit(it)
    if costed and rng.random() < 0.5:
        b.costs.row_cost[(M, rng.randint(0, 2))] = rng.uniform(1, 200)
    return b


def test_the_prediction_is_the_formula_it_replaces(loop) -> None:
    rng = random.Random(23)
    clock = Clock()
    for _ in range(250):
        b = random_batcher(rng, clock, loop)
        for _ in range(5):
            costs = [rng.uniform(1, 300) for _ in range(rng.choice([1, 1, 1, 2, 7, 300]))]
            bucket = rng.choice([None, 0, 1, 2])
            rates = rng.choice([None, {}, {0: rng.uniform(0, 500), 2: rng.uniform(0, 50)}])
            args = (b, M, rng.uniform(0, 0.3), rng.randint(0, 3), rng.randint(0, 400), costs, bucket, rates)
            assert predict(*args) == reference(*args)


def test_a_remembered_batch_time_is_the_line_read_again(loop) -> None:
    """The memo is emptied by every observation and forgetting, bounded, and never holds a seed."""
    times = BatchTimes(100, {M: 0.05})
    assert times.at(M, 10) == 0.05  # no point yet: the seed, not remembered
    times.seed(M, 0.07)
    assert times.at(M, 10) == 0.07
    times.observe(M, 10, 0.02)
    times.observe(M, 80, 0.10)
    assert times.at(M, 40) == pytest.approx(0.02 + 0.08 * 30 / 70)
    assert times.at(M, 40) == fresh_s(times, M, 40)
    times.observe(M, 40, 0.2)  # a new point right where the memo held one
    assert times.at(M, 40) == fresh_s(times, M, 40) != pytest.approx(0.02 + 0.08 * 30 / 70)
    times.forget_above(M, 20)
    assert times.at(M, 80) == fresh_s(times, M, 80) == 0.02  # the line without its upper points
    for i in range(3 * MEMO_KEPT):  # a costed model's float costs: the memo stays bounded
        times.at(M, 1 + i / 7)
    assert len(times._lines[M].memo) <= MEMO_KEPT
    times.caps[M] = math.inf  # the clamp is applied before the memo: a raised cap reads past the old one
    assert times.at(M, 500) == fresh_s(times, M, 500)


def random_door(seed: int, loop) -> tuple[random.Random, Clock, Batcher, Workers, Admission]:
    """A door over `random_batcher`'s queues, 1-2 healthy workers maybe busy, and its random stream, from `seed`:
    twin doors made from one seed see the same queues and requests."""
    rng = random.Random(seed)
    clock = Clock()
    b = random_batcher(rng, clock, loop)
    workers = Workers(until_free=rng.choice([0.0, 0.0, rng.uniform(0, 0.2)]), healthy=rng.choice([1, 1, 2]))
    return rng, clock, b, workers, Admission(b, workers, rng.choice([50, 100000]), 0.2, 1.5, clock=clock)


def admit_all(d: Admission, rng: random.Random, clock: Clock) -> list[object]:
    """A few requests through the door: each one's ticket, or the refusal's code and retry hint."""
    out: list[object] = []
    for _ in range(4):
        clock.t += rng.uniform(0, 0.01)
        costs = [rng.uniform(1, 200) for _ in range(rng.choice([1, 1, 3]))]
        try:
            t = d.admit_ticket(
                M, rng.randint(0, 2), rng.choice("abc"), rng.uniform(0.01, 2.0), costs, rng.choice([None, 0, 1, 2])
            )
            out.append((t.probe, t.at, t.wait_s))
        except ApiError as err:
            out.append((err.code, err.message, err.retry_after_ms))
    return out


@pytest.mark.parametrize("forced", ["_classes", "_surely_in_time", "most"])
def test_the_door_decides_the_same_as_with_every_prediction_made(loop, monkeypatch, forced: str) -> None:
    """Rates read lazily (only with another class), the idle worker's early yes, the skipped prediction of a
    request that no prediction could make late, and the skipped quickest-answer check of a deadline past the
    model's longest batch change no decision: the same random requests on twin doors, one forced to read every
    rate, predict every request, or (`most`: no batch time known to bound any other) check every deadline."""
    answer = forced == "_classes"  # True: every rate read (and no skip); False: never surely in time
    skipped = 0
    real = Admission._surely_in_time
    for seed in range(120):
        results = []
        for force in (False, True):
            rng, clock, b, workers, d = random_door(seed, loop)
            if rng.random() < 0.5:  # some arrivals and classes already metered
                for bucket in range(rng.randint(1, 3)):
                    d._joined(M, bucket, clock.t, rng.randint(1, 50))
            if force and forced == "most":
                monkeypatch.setattr(BatchTimes, "most", lambda self, model: math.inf)
            elif force:
                monkeypatch.setattr(Admission, forced, lambda self, *args: answer)
            else:

                def counted(self: Admission, *args: object) -> bool:
                    nonlocal skipped
                    got = real(self, *args)
                    skipped += got
                    return got

                monkeypatch.setattr(Admission, "_surely_in_time", counted)
            results.append(admit_all(d, rng, clock))
            monkeypatch.undo()
        assert results[0] == results[1], seed
    assert skipped >= 5  # the shortcut was taken, not only its fallback


def test_the_reference_is_not_trivially_equal(loop) -> None:
    """The comparison can fail: a formula off by one batch is caught."""
    clock = Clock()
    b = random_batcher(random.Random(5), clock, loop)
    real = predict(b, M, 0.05, 1, 150, [1.0], None, None)
    shifted = reference(b, M, 0.05, 1, 150 + b.costs.full_n(M), [1.0], None, None)
    assert real != shifted


def test_the_longest_batch_bounds_every_read(loop) -> None:
    """`BatchTimes.most` is at least S at any cost (what lets the door skip a prediction), and no bound at all
    for a costed model whose line rises without a cap."""
    rng = random.Random(7)
    for _ in range(200):
        times = BatchTimes(100, {M: rng.uniform(0.01, 0.3)})
        for _ in range(rng.randint(0, 5)):
            times.observe(M, rng.uniform(1, 100), rng.uniform(0.005, 0.5))
        top = times.most(M)
        assert all(times.at(M, c) <= top for c in [rng.uniform(0, 300) for _ in range(50)] + [1, 100, 1e9])
        times.caps[M] = math.inf
        line = times._lines[M]
        assert times.most(M) == (math.inf if line.slope > 0 else max(line.seconds, default=times.seeds[M]))


class NeverKept(dict):
    """A door's store of figures that keeps nothing: every request reads them afresh."""

    def get(self, key, default=None):
        return default


def test_kept_figures_decide_as_figures_read_afresh(loop, monkeypatch) -> None:
    """The door keeps a model's figures until what they are read from moves (`DoorFigures`): over random
    requests with batches observed, seeds, budgets, costed inputs and workers lost or back in between, it
    decides exactly as a twin door that reads them afresh for every request, and it does keep them."""
    read = asked = 0
    real = Admission.read_figures

    def counted(self: Admission, model: str, healthy: int):
        nonlocal read
        read += not isinstance(self._figures, NeverKept)
        return real(self, model, healthy)

    monkeypatch.setattr(Admission, "read_figures", counted)
    for seed in range(80):
        results = []
        for fresh in (False, True):
            rng, clock, b, workers, d = random_door(seed, loop)
            if fresh:
                d._figures = NeverKept()
            out: list[object] = []
            for _ in range(40):
                step = rng.randrange(24)
                if step == 0:
                    b.costs.observe(M, rng.uniform(0.005, 0.5), rng.uniform(1, 100), rng.randint(1, 100))
                elif step == 1:
                    b.batch_s.seed(M, rng.uniform(0.01, 0.3))
                elif step == 2:
                    workers.healthy = rng.choice([0, 1, 1, 2])
                elif step == 3:
                    b.costs.set_max_batch_cost(rng.choice([0.0, rng.uniform(50, 5000)]))
                elif step == 4:
                    b.costs.note_cost(M, rng.uniform(1, 300))
                elif step == 5:  # as the start-up does: the warm-up's timings, then the budget fitted to them
                    b.batch_s.observe(M, rng.uniform(1, 100), rng.uniform(0.005, 2.0))
                elif step == 6:
                    b.costs.max_batch_s = rng.uniform(0.01, 0.5)
                    b.costs.fit_budget(M)
                clock.t += rng.uniform(0, 0.01)
                asked += not fresh
                costs = [1.0] if rng.random() < 0.7 else [rng.uniform(1, 200) for _ in range(rng.choice([1, 3]))]
                try:
                    t = d.admit_ticket(
                        M, rng.randint(0, 2), rng.choice("abc"), rng.uniform(0.01, 2.0), costs, rng.choice([None, 0])
                    )
                    out.append((t.probe, t.at, t.wait_s))
                except ApiError as err:
                    out.append((err.code, err.message, err.retry_after_ms))
                kept = d._figures.get(M)
                if kept is not None and kept.version == b.batch_s.version and kept.healthy == workers.healthy:
                    assert real(d, M, workers.healthy) == kept, seed  # what it would read now: not stale
            results.append(out)
        assert results[0] == results[1], seed
    assert read < asked / 2  # the kept door read its figures far less than once a request
