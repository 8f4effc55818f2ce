"""The quarantine of failing inputs (issue 28 item 3) in process: bounded, and it forgets."""

from __future__ import annotations

from batchserve.core.quarantine import Quarantine


def test_the_quarantine_is_bounded_and_forgets():
    now = [0.0]
    q = Quarantine(capacity=3, ttl_s=10.0, clock=lambda: now[0])
    for i in range(5):
        q.add("m@v1", f"x{i}", f"boom {i}")
    assert len(q) == 3  # the oldest two were evicted
    assert q.reason("m@v1", "x0") is None and q.reason("m@v1", "x4") == "boom 4"
    assert q.reason("other@v1", "x4") is None  # per model
    now[0] = 10.0
    assert q.reason("m@v1", "x4") is None and len(q) == 2  # expired, and dropped when read
