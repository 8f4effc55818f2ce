"""The slot decoder's warm-up line (decoding/slot_decoder.py): on CPU nothing is captured, and "checked 0
decode steps and 0 prefills" read as if nothing had warmed."""

from __future__ import annotations

from batchserve.decoding.slot_decoder import warm_summary


def test_the_warm_line_says_what_was_done_with_and_without_graphs() -> None:
    assert warm_summary(True, 12, 5) == "captured 12 decode steps and 5 prefills as CUDA graphs"
    eager = warm_summary(False, 0, 0)
    assert "0 decode steps" not in eager and "eagerly" in eager and "no CUDA graphs" in eager
