"""The minilm backend's passes, in process without its weights (the real weights are
tests/integration/backends/test_minilm.py)."""

from __future__ import annotations

from batchserve.backends import minilm


def test_passes_hold_at_most_the_token_budget():
    lengths = [3, 10, 4, 300, 5, 9]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    got = minilm.passes(order, lengths, 20)
    assert got == [[0, 2, 4], [5, 1], [3]]  # 3x5, 2x10, and the long one alone
    assert sorted(i for rows in got for i in rows) == list(range(len(lengths)))
