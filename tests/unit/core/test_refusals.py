"""A caller refused again and again waits its turn before its next body is read (issue 28, the soak's 1 MB
prompts): the policy on an injected clock
(the live server's test is tests/integration/generation/test_refusals.py)."""

from __future__ import annotations

import pytest

from batchserve.core.refusals import MAX_CALLERS, MAX_WAIT_S, RefusalThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_caller_waits_only_once_its_burst_of_refusals_is_spent():
    clock = Clock()
    t = RefusalThrottle(rate=2.0, clock=clock)  # burst 4
    assert t.wait_s("acme") == 0.0
    for _ in range(4):
        t.refused("acme")
    assert t.wait_s("acme") == pytest.approx(0.5)  # one refusal comes back every 1/rate s
    assert t.wait_s("globex") == 0.0  # another caller never waits for acme's refusals
    clock.now += 0.5
    assert t.wait_s("acme") == 0.0


def test_the_wait_is_bounded_and_a_debt_stops_at_one_burst():
    clock = Clock()
    t = RefusalThrottle(rate=2.0, clock=clock)
    for _ in range(1000):  # concurrent requests all refused at once
        t.refused("acme")
    assert t.wait_s("acme") == MAX_WAIT_S
    clock.now += (4 + 4 + 1) / 2.0  # a debt of one burst, then a full burst back: no wait
    assert t.wait_s("acme") == 0.0


def test_off_and_bounded():
    off = RefusalThrottle(rate=0.0)
    for _ in range(10):
        off.refused("acme")
    assert off.wait_s("acme") == 0.0 and len(off) == 0
    t = RefusalThrottle(rate=1.0)
    for i in range(MAX_CALLERS + 5):
        t.refused(f"anonymous@10.0.{i // 256}.{i % 256}")
    assert len(t) == MAX_CALLERS and t.wait_s("anonymous@10.0.0.0") == 0.0  # the oldest forgotten
