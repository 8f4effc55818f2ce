"""The slowdown ledger (`step_share.StepShare`) with injected step times: whether batch (background) rows go
into a decode step beside interactive (foreground) rows. Driven as the slot stepper drives it: decide, book the
step at launch, and learn its measured time one step later."""

from __future__ import annotations

import random
from collections.abc import Callable

from batchserve.decoding.step_share import MAX_SKIP, StepShare

FG, ALL = 1, 8  # rows of a step of the interactive rows alone, and of one with the batch rows (high slots)


def drive(
    share: StepShare, cost: Callable[[int], float], steps: int, prefill: Callable[[int], float] | None = None
) -> tuple[list[float], list[bool]]:
    """`steps` steps of one interactive row beside batch rows: each step's time (with any batch prefill run
    before it) and whether the batch rows were in it. `prefill(n)`: the batch prefill run before the n-th step
    that includes the batch rows."""
    times: list[float] = []
    included: list[bool] = []
    pending = None
    for _ in range(steps):
        inc = share.include(FG, ALL)
        extra = 0.0
        if inc and prefill is not None:  # batch prefill runs only before steps with the batch rows
            extra = prefill(sum(included))
            share.charge(extra)
        rows = ALL if inc else FG
        booking = share.book(rows, FG, inc)
        if pending is not None:  # the previous step's time comes back after this one is launched
            share.measured(*pending)
        seconds = cost(rows)
        pending = (rows, seconds, booking)
        times.append(seconds + extra)
        included.append(inc)
    return times, included


def cpu(rows: int) -> float:
    """This 2-core CPU's shape: a second row adds ~66% to a one-row step, eight cost barely more than two."""
    return 0.010 if rows == 1 else 0.0175


def test_dear_full_steps_keep_the_interactive_steps_within_the_slowdown_over_every_window() -> None:
    share = StepShare(1.25)
    times, included = drive(share, cpu, 600)
    alone = cpu(FG)
    one_step = cpu(ALL) - 1.25 * alone  # the ledger books at launch: at most one step's excess ahead
    times = times[4:]  # the first steps time a full step and an interactive-only one (the warm-up seeds them)
    for width in (3, 9, 30, 596):
        for start in range(0, len(times) - width + 1):
            assert sum(times[start : start + width]) <= 1.25 * alone * width + one_step + 1e-9, (start, width)
    duty = sum(included) / len(included)
    assert 0.25 <= duty <= 0.4, duty  # about one full step in three: (2 x 10 + 17.5) / 3 = 12.5 ms = 1.25 x 10
    assert share.full_steps == sum(included) and share.foreground_steps == len(included) - sum(included)


def test_where_a_full_step_costs_about_an_interactive_only_one_every_step_includes_the_batch_rows() -> None:
    def gpu(rows: int) -> float:
        return 0.0050 if rows == FG else 0.0052

    share = StepShare(1.25)
    _, included = drive(share, gpu, 300)
    assert included.count(False) <= 2  # the steps that time the interactive rows alone
    assert all(included[5:])


def test_the_batch_rows_are_never_left_out_of_more_than_max_skip_steps_in_a_row() -> None:
    def dear(rows: int) -> float:  # a full step ten times an interactive-only one: the credit never pays for one
        return 0.010 if rows == FG else 0.100

    share = StepShare(1.25)
    _, included = drive(share, dear, 400)
    run = longest = 0
    for inc in included:
        run = 0 if inc else run + 1
        longest = max(longest, run)
    assert longest <= MAX_SKIP
    assert sum(included) >= len(included) // (MAX_SKIP + 1)
    assert share.forced_steps > 0
    share = StepShare(1.0, max_skip=3)  # no slowdown allowed at all: only the bound lets them on
    _, included = drive(share, dear, 100)
    assert sum(included) >= 100 // 4 and "".join("x" if i else "." for i in included).count("....") == 0


def test_with_noisy_step_times_the_mean_stays_within_the_slowdown() -> None:
    rng = random.Random(5)

    def noisy(rows: int) -> float:
        return cpu(rows) * rng.uniform(0.7, 1.3)

    share = StepShare(1.25)
    times, included = drive(share, noisy, 3000)
    assert sum(times) / len(times) <= 1.25 * 0.010 * 1.03
    assert 0.2 <= sum(included) / len(included) <= 0.45


def test_batch_prefill_run_beside_interactive_rows_is_paid_for_with_fewer_full_steps() -> None:
    def prefill(n: int) -> float:  # a batch line's prompt prefilled before every third full step
        return 0.012 if n % 3 == 0 else 0.0

    plain = StepShare(1.25)
    _, without = drive(plain, cpu, 600)
    share = StepShare(1.25)
    times, with_prefill = drive(share, cpu, 600, prefill)
    assert sum(with_prefill) < sum(without)
    assert sum(times) / len(times) <= 1.25 * 0.010 * 1.05


def test_a_slowdown_loose_enough_for_every_full_step_includes_them_all() -> None:
    share = StepShare(2.0)  # 17.5 ms <= 2 x 10 ms
    _, included = drive(share, cpu, 200)
    assert included.count(False) <= 2 and all(included[5:])


def test_the_warm_up_times_seed_the_ledger_so_it_does_not_explore() -> None:
    share = StepShare(1.25, seed={FG: cpu(FG), ALL: cpu(ALL)})
    _, included = drive(share, cpu, 3)
    assert included == [False, False, True]  # credit first: two interactive-only steps pay for a full one


def test_a_full_step_is_dear_only_past_the_slowdown_or_while_not_yet_timed() -> None:
    share = StepShare(1.25, seed={1: 0.010, 2: 0.0166, 8: 0.0120})
    assert share.dear(1, 2) and not share.dear(1, 8) and share.dear(1, 5)
