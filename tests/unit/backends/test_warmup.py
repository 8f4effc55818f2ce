"""Defaults that fit the backend (issue 9 §3): the warm-up runs until the batch time is stable, SLO and timeout
follow from it where the user set neither, and a batch whose callers all left stops early and frees its worker.

The policy has unit tests with an injected clock; the early stop runs through a live sim server (the sim honours
the same hook as the real model's generation, which tests/integration/backends/test_real_defaults.py checks on the
weights).
"""

from __future__ import annotations


import pytest

from batchserve.config import Settings
from batchserve.backends.warmup import MAX_ROUNDS, derive_deadlines, warm_until_stable


class FakeModel:
    """A warm-up whose rounds take the given times on a clock that only it moves."""

    def __init__(self, rounds: list[float]) -> None:
        self.rounds, self.now, self.calls = list(rounds), 0.0, 0

    def clock(self) -> float:
        return self.now

    def warm(self) -> None:
        self.now += self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1


def test_a_cold_first_batch_is_not_the_batch_time() -> None:
    model = FakeModel([15.0, 2.0, 1.1, 1.0, 9.0])
    warm = warm_until_stable(model.warm, model.clock)
    assert warm.stable and model.calls == 4
    assert warm.batch_s == pytest.approx(1.1)  # the slower of the two that agree, never the cold 15 s


def test_an_unsteady_warm_up_stops_at_its_bound() -> None:
    model = FakeModel([1.0, 2.0] * 10)
    warm = warm_until_stable(model.warm, model.clock)
    assert not warm.stable and model.calls == MAX_ROUNDS and warm.batch_s == 2.0
    slow = FakeModel([100.0, 50.0, 20.0, 10.0])
    assert len(warm_until_stable(slow.warm, slow.clock, budget_s=120).rounds_s) == 2  # 150 s spent: stop


def test_deadlines_derive_from_the_batch_time_unless_set() -> None:
    derived = derive_deadlines(Settings(backend="smollm2"), batch_s=1.5)
    assert (derived.slo_ms, derived.timeout_ms) == (4500, 15000)
    fast = derive_deadlines(Settings(backend="smollm2"), batch_s=0.01)  # never under the sim's defaults
    assert (fast.slo_ms, fast.timeout_ms) == (200, 2000)
    capped = derive_deadlines(Settings(backend="smollm2", max_timeout_ms=8000), batch_s=1.5)
    assert capped.timeout_ms == 8000
    chosen = derive_deadlines(
        Settings(backend="smollm2", given={"slo_ms": "--slo-ms", "timeout_ms": "BATCHSERVE_TIMEOUT_MS"}), 1.5
    )
    assert (chosen.slo_ms, chosen.timeout_ms) == (None, None)


def test_one_slow_last_round_does_not_become_the_batch_time() -> None:
    """Issue 22: a round slowed by a busy machine (here the last, 100 s among 50-80 ms ones) set the figure when
    it was the slower of the last two rounds, and the model refused every request it could have served. The
    median of the rounds after the cold first shrugs it off, whichever round it is."""
    rounds = [0.05, 0.08] * 3 + [0.05, 100.0]
    model = FakeModel(rounds)
    warm = warm_until_stable(model.warm, model.clock)
    assert not warm.stable and warm.rounds_s == pytest.approx(rounds)
    assert warm.batch_s == pytest.approx(0.08)
    for at in range(1, 7):  # the outlier anywhere after the first round
        shifted = FakeModel(rounds[:at] + [100.0] + rounds[at:-1])
        assert warm_until_stable(shifted.warm, shifted.clock).batch_s <= 0.08


def test_sub_millisecond_rounds_are_stable_and_logged_with_their_digits() -> None:
    """A plugin whose batch takes ~0.1 ms jittered by more than 15 % from round to round: eight "0 ms" rounds
    and "(not stable)". Rounds within 1 ms of each other now agree, and the log shows their digits."""
    from batchserve.backends.warmup import ms

    model = FakeModel([0.004, 0.0001, 0.0003])
    warm = warm_until_stable(model.warm, model.clock)
    assert warm.stable and model.calls == 3
    assert [ms(t) for t in (0.0001, 0.00042, 0.0042, 0.042, 1.5)] == ["0.1", "0.42", "4.2", "42", "1500"]
