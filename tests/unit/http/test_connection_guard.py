"""The connection guard in process (issue 28's second hardening round): the heap is trimmed once per flood, not per
close, on a stand-in loop."""

from __future__ import annotations


def test_the_heap_is_trimmed_once_per_flood_not_per_close():
    from batchserve.http.uvicorn_protocol import TRIM_PEAK, ConnectionGuard, ConnectionLimits

    class Loop:
        def __init__(self) -> None:
            self.ran: list[object] = []

        def run_in_executor(self, executor: object, fn: object) -> None:
            self.ran.append(fn)

    guard, loop = ConnectionGuard.create(ConnectionLimits()), Loop()
    for open_now in (10, 500, 400, 5, 0):  # a small peak: nothing to give back
        guard._after_a_flood(loop, open_now)  # type: ignore[arg-type]
    assert loop.ran == []
    for open_now in (TRIM_PEAK * 2, TRIM_PEAK, TRIM_PEAK // 2, TRIM_PEAK // 4, 3):  # still falling: not yet
        guard._after_a_flood(loop, open_now)  # type: ignore[arg-type]
    assert loop.ran == []
    for open_now in (3, 4, 0, 0):  # stopped falling: once
        guard._after_a_flood(loop, open_now)  # type: ignore[arg-type]
    assert len(loop.ran) == 1 and guard.trims == 1
    guard._after_a_flood(loop, 0)  # type: ignore[arg-type]  # all gone at the first look: also once
    for open_now in (TRIM_PEAK * 4, 0):
        guard._after_a_flood(loop, open_now)  # type: ignore[arg-type]
    assert len(loop.ran) == 2
