"""What the in-process tests inject in place of time and the workers: one copy, shared by every unit test."""

from __future__ import annotations


class Clock:
    """An injected clock: a callable that returns `now`, which the test moves by hand (`t` is the same value)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value


class Workers:
    """The pool as admission sees it (`WorkerCapacity`): how many are healthy and when the first one frees."""

    def __init__(self, until_free: float = 0.0, healthy: int = 1) -> None:
        self.until_free, self.healthy = until_free, healthy

    def healthy_count(self) -> int:
        return self.healthy

    def worker_count(self) -> int:
        return 1

    def seconds_until_free(self, now: float) -> float:
        return self.until_free


def token_s(cost: float) -> float:
    """A costed model's batch time: 10 ms plus 0.5 ms a token."""
    return 0.010 + 0.0005 * cost
