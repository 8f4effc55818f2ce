"""The request history in process (issue 28's second hardening round): it evicts the largest owner's oldest records."""

from __future__ import annotations


def test_the_request_history_evicts_the_largest_owners_oldest():
    from batchserve.core.ledger import RequestLog

    log = RequestLog(10)
    log.add("a", "a0", "m")
    log.add("b", "b0", "m")
    for i in range(30):  # c floods: only its own oldest records go
        log.add("c", f"c{i}", "m")
    assert len(log) == 10 and log.get("a", "a0") and log.get("b", "b0")
    assert log.get("c", "c29") and not log.get("c", "c21")
    for i in range(8):  # now a grows past c: the largest owner is the one that loses
        log.add("a", f"a{i + 1}", "m")
    assert len(log) == 10 and log.get("b", "b0") and log.get("c", "c29") and log.get("a", "a8")
    assert log.get("a", "a0") is None or log.get("c", "c25") is None


def test_a_history_smaller_than_its_owners_keeps_its_bound():
    """More owners than places: an owner holding one record is as large as any, so its own record goes (its
    entry with it) and the history stays at its capacity."""
    from batchserve.core.ledger import RequestLog

    log = RequestLog(2)
    for owner in ("a", "b", "c"):
        log.add(owner, f"{owner}0", "m")
    assert len(log) == 2 and log.get("a", "a0") and log.get("b", "b0") and log.get("c", "c0") is None
    assert "c" not in log._by_owner
