"""Each model its own SLO and timeouts (issue 46 item 7), in process on injected figures: an embedder beside a chat
model logged `slo_ms=205`, then ran under the chat model's `slo_ms=29411 ... timeout_ms=60000`. The derivation
from each model's own measured time, the runtime's one table of them, and every reader of it: the batcher's
dispatch deadline, admission's objective under pressure and its 400/504 line, the SLO ledger, /v1/models and
/internal/health. (A live server with two models: tests/integration/core/test_model_deadlines.py.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from batchserve.backends.warmup import deadlines_for
from batchserve.config import ModelSpec, Settings
from batchserve.core import tiers
from batchserve.core.admission import Admission
from batchserve.core.batch import BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.errors import ApiError
from batchserve.inference.routes import models as model_cards
from batchserve.slo import DEFAULT, DERIVED, SET, Deadlines
from batchserve.ops.routes import internal_health
from batchserve.runtime import Runtime
from tests.unit.core.test_policy import FakeCapacity, make_item
from tests.unit.fakes import Clock
from tests.unit.http.test_guards import guard, ledger_sample, peer

FAST, SLOW = "embed@v1", "chat@v1"
FAST_S, SLOW_S = 0.0683, 9.8037  # the finding's warm-up batch times: 3 x them are its 205 and 29411 ms
FREE, ENT = tiers.BY_NAME["free"].rank, tiers.BY_NAME["enterprise"].rank


def two_models(**kw: object) -> Settings:
    return Settings(models=[ModelSpec("embed"), ModelSpec("chat")], devices=1, **kw)  # type: ignore[arg-type]


def figures(slo_s: float, timeout_s: float = 2.0, max_timeout_s: float = 60.0) -> Deadlines:
    return Deadlines(slo_s, timeout_s, max_timeout_s)


def test_each_model_derives_its_figures_from_its_own_batch_time() -> None:
    s = two_models()
    fast, slow = deadlines_for(s, FAST_S), deadlines_for(s, SLOW_S)
    assert (fast.slo_s, fast.timeout_s, fast.max_timeout_s) == (0.205, 2.0, 60.0)  # its own, above the floors
    assert (slow.slo_s, slow.timeout_s, slow.max_timeout_s) == (29.411, 60.0, 60.0)  # 10 x 9.8 s, capped
    assert (fast.slo_from, fast.timeout_from, fast.max_timeout_from) == (DERIVED, DERIVED, DEFAULT)
    assert (fast.measured_s, fast.measured) == (FAST_S, "the warm-up batch time")


def test_a_set_figure_applies_to_every_model_and_the_rest_stay_their_own() -> None:
    s = two_models(slo_ms=500.0, max_timeout_ms=30000.0, given={"slo_ms": "--slo-ms", "max_timeout_ms": "--x"})
    fast, slow = deadlines_for(s, FAST_S), deadlines_for(s, SLOW_S)
    assert fast.slo_s == slow.slo_s == 0.5 and fast.slo_from == slow.slo_from == SET
    assert (fast.timeout_s, slow.timeout_s) == (2.0, 30.0)  # derived each, the slow one's within the set max
    assert fast.max_timeout_s == slow.max_timeout_s == 30.0 and fast.max_timeout_from == SET
    unmeasured = Deadlines.of_settings(s)  # a model declaring its batch time (the sim): the settings' figures
    assert (unmeasured.slo_s, unmeasured.timeout_s, unmeasured.slo_from, unmeasured.timeout_from) == (
        0.5,
        2.0,
        SET,
        DEFAULT,
    )


def test_the_runtime_keeps_one_table_every_reader_shares(caplog: pytest.LogCaptureFixture) -> None:
    rt = Runtime.create(two_models())
    table = rt.registry.deadlines
    assert set(table) == {FAST, SLOW}
    assert rt.batcher.deadlines is table and rt.admission.deadlines is table and rt.guard.deadlines is table
    with caplog.at_level(logging.INFO, logger="batchserve"):
        rt.derive_deadlines({FAST: FAST_S, SLOW: SLOW_S}, "the warm-up batch time")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deadlines of ")]
    assert lines == [
        f"deadlines of {FAST} from the warm-up batch time 68 ms: slo_ms=205 (derived) timeout_ms=2000 (derived) "
        "max_timeout_ms=60000 (default)",
        f"deadlines of {SLOW} from the warm-up batch time 9804 ms: slo_ms=29411 (derived) timeout_ms=60000 "
        "(derived) max_timeout_ms=60000 (default)",
    ]
    assert (rt.batcher.slo_of(FAST), rt.batcher.slo_of(SLOW)) == (0.205, 29.411)
    slack = rt.settings.admission_slack
    assert rt.batcher.costs.latency_fits == pytest.approx({FAST: 0.205 * slack / 2, SLOW: 29.411 * slack / 2})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchserve"):
        rt.derive_deadlines({FAST: None}, "the warm-up batch time")  # nothing measured: its figures stay
    assert table[FAST].slo_s == 0.205 and "deadlines of embed@v1: " not in caplog.text
    assert f"deadlines of {FAST} from the warm-up batch time 68 ms" in caplog.text


def test_models_and_health_show_each_models_own_figures() -> None:
    rt = Runtime.create(two_models())
    rt.derive_deadlines({FAST: FAST_S, SLOW: SLOW_S}, "the warm-up batch time")
    cards = {c["id"]: c for c in asyncio.run(model_cards(rt, None, None))}  # type: ignore[arg-type]
    assert {k: cards[FAST][k] for k in ("slo_ms", "timeout_ms", "max_timeout_ms")} == {
        "slo_ms": 205.0,
        "timeout_ms": 2000.0,
        "max_timeout_ms": 60000.0,
    }
    assert (cards[SLOW]["slo_ms"], cards[SLOW]["timeout_ms"]) == (29411.0, 60000.0)
    health = asyncio.run(internal_health(rt, None, None))  # type: ignore[arg-type]
    assert health["slo_ms"] == {FAST: 205.0, SLOW: 29411.0}
    assert health["timeout_ms"] == {FAST: 2000.0, SLOW: 60000.0}
    assert health["max_timeout_ms"] == {FAST: 60000.0, SLOW: 60000.0}


def batcher(clock: Clock) -> Batcher:
    b = Batcher(100, 0.5, 0.005, BatchTimes(100, {FAST: 0.1, SLOW: 0.1, "other@v1": 0.1}), clock=clock)
    b.deadlines = {FAST: figures(0.2), SLOW: figures(3.0)}
    return b


def test_the_batcher_gives_each_models_oldest_item_its_own_dispatch_deadline(loop) -> None:
    clock = Clock(1000.0)
    b = batcher(clock)
    assert b.dispatch_delay(FAST, 1) == pytest.approx(0.2 - 0.1 - 0.005)
    assert b.dispatch_delay(SLOW, 1) == pytest.approx(3.0 - 0.1 - 0.005)
    assert b.dispatch_delay("other@v1", 1) == pytest.approx(0.5 - 0.1 - 0.005)  # no figures: the server's
    # Two workers, one batch just gone: the pace is S/2 = 50 ms away. The fast model's item may wait 45 ms for
    # company (its 150 ms SLO), so its deadline comes first; the slow model's waits for the pace.
    b.deadlines[FAST] = figures(0.15)
    b.healthy_workers, b.last_dispatch = 2, clock.now
    b.submit(make_item(loop, arrived=clock.now, model=SLOW))
    assert b.most_urgent(clock.now)[1:] == (pytest.approx(clock.now + 0.05), "pace")
    b.submit(make_item(loop, arrived=clock.now, model=FAST))
    key, due, cause = b.most_urgent(clock.now)
    assert key == (FAST, 0) and (due, cause) == (pytest.approx(clock.now + 0.045), "deadline")


def test_under_pressure_admission_sheds_by_the_models_own_slo(loop) -> None:
    clock = Clock(1000.0)
    b = batcher(clock)
    for model in (FAST, SLOW):  # a full batch ahead of each: predicted 0.05 + 0.1 + 0.1 = 0.25 s
        for _ in range(150):
            b.submit(make_item(loop, arrived=clock.now, model=model))
    # A worker lost is pressure; the bound is the model's SLO x 1.25 x the tier's factor.
    door = Admission(b, FakeCapacity(healthy=1, workers=2, until_free=0.05), 10000, 0.5, 1.25, clock=clock)
    door.deadlines = b.deadlines
    assert door.tier_bound_s(FREE, FAST) < 0.25 < door.tier_bound_s(FREE, SLOW)
    with pytest.raises(ApiError) as refused:
        door.admit_ticket(FAST, FREE, "t", deadline_s=2.0)
    assert refused.value.status == 503 and "latency objective" in refused.value.message
    door.admit_ticket(SLOW, FREE, "t", deadline_s=2.0)  # the same wait is well within the slow model's objective


def test_a_timeout_too_short_is_judged_by_the_models_own_longest_timeout(loop) -> None:
    clock = Clock(1000.0)
    b = batcher(clock)
    b.deadlines[SLOW] = figures(3.0, max_timeout_s=0.08)  # no timeout it may be asked for fits one batch
    door = Admission(b, FakeCapacity(until_free=0.05), 10000, 0.5, 1.25, clock=clock)
    door.deadlines = b.deadlines
    with pytest.raises(ApiError) as own_fault:
        door.admit_ticket(FAST, ENT, "t", deadline_s=0.05)  # it could ask for a timeout that fits: its mistake
    assert (own_fault.value.status, own_fault.value.code) == (400, "TIMEOUT_TOO_SHORT")
    with pytest.raises(ApiError) as unmeetable:
        door.admit_ticket(SLOW, ENT, "t", deadline_s=0.05)  # nothing it may ask for fits: not the caller's fault
    assert unmeetable.value.status == 504


def test_the_ledger_holds_each_models_answers_to_its_own_slo() -> None:
    g = guard()
    g.deadlines = {FAST: figures(0.2), SLOW: figures(3.0)}
    caller = g.identify(None, peer("10.0.0.1"))
    g.ok(FAST, 0.5, caller)
    g.ok(SLOW, 0.5, caller)
    g.settle(FAST, caller, 200, 0.5)  # a route that counts its own answers (the generation engine's)
    series = "batchserve_slo_requests_total"
    assert ledger_sample(g, series, model=FAST, tier="paid", outcome="slow") == 2
    assert ledger_sample(g, series, model=SLOW, tier="paid", outcome="met") == 1
    assert ledger_sample(g, series, model=FAST, tier="paid", outcome="met") == 0
