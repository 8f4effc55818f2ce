"""Warm a real model until its batch time is stable, and derive the deadlines it needs from that time.

Why: a real model's first batches pay one-off costs (allocator, kernel selection, CUDA context) that would make
an idle server refuse requests, and the sim's default deadlines would cut its longer answers off. So rounds run
until two agree, the learned batch time starts from the median after the cold first one, and each model's unset
SLO and default timeout follow from its own batch time. The sim's batch time is known, so it is warmed once.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from collections.abc import Callable

from batchserve.config import Settings
from batchserve.slo import DERIVED, Deadlines

log = logging.getLogger("batchserve")

STABLE_WITHIN = 0.15  # two rounds within 15% of each other: the one-off costs are paid
STABLE_ABS_S = 0.001  # or within 1 ms: sub-millisecond rounds jitter by more than 15 % and never settle
MAX_ROUNDS = 8
BUDGET_S = 120.0  # stop warming after this long (at least 2 rounds), stable or not
SLO_BATCHES = 3  # a request may wait for the batch running when it arrives, then run in its own, plus headroom
TIMEOUT_BATCHES = 10  # the default deadline: room for a queue of a few batches, and a fuller batch than warm-up's


@dataclass
class WarmUp:
    rounds_s: list[float]
    stable: bool

    @property
    def batch_s(self) -> float:
        return robust(self.rounds_s)


def robust(rounds: list[float]) -> float:
    """The median of the rounds after the cold first one (the first alone when there is only one), which shrugs
    off one round slowed by a busy machine."""
    return statistics.median(rounds[1:] or rounds)


def ms(seconds: float) -> str:
    """A duration for the log in milliseconds, with the precision a sub-millisecond one needs ("0.042 ms")."""
    value = seconds * 1000
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}" if value >= 0.01 else f"{value:.1g}"


def warm_until_stable(
    warm: Callable[[], float | None],
    clock: Callable[[], float] = time.monotonic,
    max_rounds: int = MAX_ROUNDS,
    budget_s: float = BUDGET_S,
) -> WarmUp:
    """Run `warm` until two consecutive rounds agree within STABLE_WITHIN, at most `max_rounds` times and `budget_s`
    in all; a round is the batch time `warm` returns when it timed its batches (graph capture is slow), else its
    own time."""
    rounds: list[float] = []
    began = clock()
    while True:
        started = clock()
        reported = warm()
        rounds.append(reported if reported is not None else clock() - started)
        if len(rounds) >= 2:
            last, previous = rounds[-1], rounds[-2]
            if abs(last - previous) <= max(STABLE_WITHIN * min(last, previous), STABLE_ABS_S):
                return WarmUp(rounds, True)
            if len(rounds) >= max_rounds or clock() - began >= budget_s:
                return WarmUp(rounds, False)


@dataclass(frozen=True)
class Derived:
    slo_ms: float | None  # None: the user set it
    timeout_ms: float | None


def derive_deadlines(settings: Settings, batch_s: float) -> Derived:
    """SLO and default timeout from the measured batch time, for the ones the user left unset. Never below the
    sim's defaults, and the timeout never past `--max-timeout-ms`."""
    defaults = Settings()
    batch_ms = batch_s * 1000
    slo = None if "slo_ms" in settings.given else round(max(defaults.slo_ms, SLO_BATCHES * batch_ms))
    timeout = None
    if "timeout_ms" not in settings.given:
        timeout = round(
            min(settings.max_timeout_ms, max(defaults.timeout_ms, TIMEOUT_BATCHES * batch_ms, slo or settings.slo_ms))
        )
    return Derived(slo, timeout)


def deadlines_for(settings: Settings, batch_s: float, measured: str = "the warm-up batch time") -> Deadlines:
    """One model's SLO and default timeout, where unset, from its own measured time (`measured`), never the
    slowest model's; the rest as set, or their defaults."""
    derived = derive_deadlines(settings, batch_s)
    got = Deadlines.of_settings(settings)
    got.measured_s, got.measured = batch_s, measured
    if derived.slo_ms is not None:
        got.slo_s, got.slo_from = derived.slo_ms / 1000, DERIVED
    if derived.timeout_ms is not None:
        got.timeout_s, got.timeout_from = derived.timeout_ms / 1000, DERIVED
    return got


def log_deadlines(model: str, d: Deadlines) -> None:
    """The model's figures in force, one line (with a warning when no request of it could ever be served in time)."""
    log.info(
        "deadlines of %s%s: slo_ms=%.0f (%s) timeout_ms=%.0f (%s) max_timeout_ms=%.0f (%s)",
        model,
        f" from {d.measured} {d.measured_s * 1000:.0f} ms" if d.measured else "",
        d.slo_s * 1000,
        d.slo_from,
        d.timeout_s * 1000,
        d.timeout_from,
        d.max_timeout_s * 1000,
        d.max_timeout_from,
    )
    if d.measured and d.measured_s >= d.max_timeout_s:
        log.warning(
            "a batch of %s takes %.0f ms, longer than --max-timeout-ms %.0f: every request of it will be refused "
            "(fewer --max-new-tokens, a GPU, or a larger --max-timeout-ms)",
            model,
            d.measured_s * 1000,
            d.max_timeout_s * 1000,
        )
