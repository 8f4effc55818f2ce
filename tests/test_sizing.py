"""Rows to the memory and prefill in pieces (issue 25): the slot count and KV budget from free device memory
(made-up free-memory figures, no device), the row buckets up to it, the per-step prefill plan; and on the
CPU, that a prompt prefilled in pieces, between the decode steps of others, still gives `generate`'s greedy
tokens, and that a burst of joins never puts more than one step's prefill budget between two steps.

In-process unit tests (no server); the decoder tests use the 2-layer random Llama of tests/test_static_decode.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.generation.engine import EngineConfig, slot_plan
from batchserve.generation.sizing import (GPU_MAX_SEQS, Piece, auto_gpu_slots, kv_tokens_for, plan_prefill,
                                          row_buckets)
from batchserve.generation.slot_decoder import SlotDecoder
from batchserve.generation.slot_stepper import SlotStepper
from batchserve.generation.stepper import SamplingParams
from tests.test_slot_decoder import alone, run_stepper
from tests.test_static_decode import PAD, model, prompts  # noqa: F401 - model is a fixture

GB = 10**9
SMOLLM2_TOKEN = 30 * 2 * 3 * 64 * 2  # bytes of K and V a token: 30 layers x K,V x 3 heads x 64 x bf16 = 23,040


def test_slots_follow_the_free_memory() -> None:
    """SmolLM2 at 2,048 tokens a slot: an H200 (~138 GB free) gets over 1,024 rows, an H100 (~79 GB) over
    800, a small card what half its memory holds; never more than GPU_MAX_SEQS."""
    gpu = True
    h200 = slot_plan(EngineConfig(), gpu, 138 * GB, SMOLLM2_TOKEN, 8192)
    # 138e9 / 2 / 23,040 = 2,994,791 tokens = 1,462 slots of 2,048, rounded down to a multiple of 64
    assert h200 == (1408, 2048)
    assert slot_plan(EngineConfig(), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (832, 2048)
    assert slot_plan(EngineConfig(), gpu, 4 * GB, SMOLLM2_TOKEN, 8192) == (42, 2048)  # under 64: as many as fit
    assert slot_plan(EngineConfig(), gpu, 10_000 * GB, SMOLLM2_TOKEN, 8192)[0] == GPU_MAX_SEQS
    # shorter contexts, more slots from the same memory
    assert slot_plan(EngineConfig(max_context=1024), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (1664, 1024)
    # asked for: kept when the memory holds them, cut to what it holds when not
    assert slot_plan(EngineConfig(max_seqs=1024), gpu, 138 * GB, SMOLLM2_TOKEN, 8192) == (1024, 2048)
    assert slot_plan(EngineConfig(max_seqs=1024), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (837, 2048)
    # an explicit KV budget wins over the free memory
    assert slot_plan(EngineConfig(kv_tokens=2048 * 300), gpu, 138 * GB, SMOLLM2_TOKEN, 8192) == (256, 2048)


def test_auto_slots_round_down_and_cap() -> None:
    assert [auto_gpu_slots(n) for n in (0, 1, 63, 64, 127, 1462, 5000)] == [1, 1, 63, 64, 64, 1408, GPU_MAX_SEQS]
    assert kv_tokens_for(138 * GB, 0.5, SMOLLM2_TOKEN) == 2_994_791
    assert kv_tokens_for(GB, 0.5, 0) == GB // 2  # no division by zero on a degenerate model config


def test_row_buckets_reach_the_slots() -> None:
    assert row_buckets(1408) == [1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1408]
    assert row_buckets(20) == [1, 8, 16, 20]
    assert row_buckets(2048)[-3:] == [1024, 1536, 2048]


def test_a_decoder_captures_row_buckets_up_to_its_slots(model: Any) -> None:  # noqa: F811
    dec = SlotDecoder(model, slots=1100, slot_tokens=128, eos_ids=[], pad_id=PAD, fixed_shapes=True)
    rows = sorted({r for r, _ in dec.shapes()})
    assert rows[-3:] == [768, 1024, 1100] and dec.shape(1025, 5) == (1100, 128) and dec.shape(300, 5) == (384, 128)


def test_prefill_plan_keeps_order_and_the_step_budget() -> None:
    # (tokens done, prompt length), oldest first; a step of 100 tokens, pieces of 40
    got = plan_prefill([(0, 30), (0, 90), (40, 90), (0, 10)], 100, 40)
    assert got == [Piece(0, 0, 30, True), Piece(1, 0, 40, False)]  # 30 + 40; the next 40 would pass 100
    assert plan_prefill([(80, 90), (0, 10)], 100, 40) == [Piece(0, 80, 10, True), Piece(1, 0, 10, True)]
    # one piece always goes, even over a budget smaller than a chunk
    assert plan_prefill([(0, 500)], 64, 128) == [Piece(0, 0, 128, False)]
    # later, shorter pieces do not overtake one that does not fit
    assert plan_prefill([(0, 60), (0, 60), (0, 5)], 100, 64) == [Piece(0, 0, 60, True)]
    assert plan_prefill([], 100, 40) == []
    # a prompt of n tokens in pieces of c takes ceil(n / c) steps when alone
    steps, progress = 0, [(0, 130)]
    while progress[0][0] < 130:
        (piece,) = plan_prefill(progress, 1000, 40)
        progress = [(piece.start + piece.length, 130)]
        steps += 1
    assert steps == 4


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "gpu-layout"])
def test_a_prompt_prefilled_in_pieces_between_steps_decodes_as_generate(model: Any, fixed: bool) -> None:  # noqa: F811
    """A 23-token prompt prefilled in pieces of 7, 7, 7, 2 while another sequence decodes in a lower slot
    (and its held row runs along in the steps between pieces), then both decode to the end: each gets what
    `generate` gives it alone. `gpu-layout`: padded rows, widths and spans as CUDA graphs run them, later
    pieces attending to the whole slot."""
    short, long = prompts(model, (5, 23), seed=31)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    dec = SlotDecoder(model, slots=4, slot_tokens=40, eos_ids=[], pad_id=PAD, fixed_shapes=fixed, chunk_tokens=7)
    got = {0: [], 2: []}
    first, _ = dec.prefill([0], [short], [greedy])
    got[0] += first
    done_tokens = 0
    steps = 0
    while len(got[0]) < 10 or len(got[2]) < 10:
        if done_tokens < len(long):
            n = min(7, len(long) - done_tokens)
            first, ended = dec.prefill([2], [long[done_tokens:done_tokens + n]], [greedy], [done_tokens],
                                       [done_tokens + n == len(long)])
            done_tokens += n
            if done_tokens == len(long):
                got[2] += first
            else:
                assert ended == [True]  # held until its last piece
        live = [s for s in got if got[s] and len(got[s]) < 10]
        if live:
            span = max(len(short) + len(got[0]), len(long) + len(got[2]))
            tokens, done = dec.collect(dec.launch(max(live) + 1, span, False))
            for s in live:
                got[s].append(tokens[s])
            # slot 2's held row runs along (rows 0..2) while it is prefilled, and its tokens are ignored
            steps += 1
    assert steps >= 10
    assert got[0] == alone(model, short, None, 10)
    assert got[2] == alone(model, long, None, 10)


def test_the_stepper_spreads_a_burst_over_steps_and_keeps_generates_tokens(model: Any) -> None:  # noqa: F811
    """One sequence runs; then a burst of eight joins, two of them longer than a piece, arrives with more
    sequences than slots. Between two decode steps the stepper prefills at most its step budget (the old
    behaviour prefilled the whole burst before the next step), long prompts go in pieces, and every sequence
    ends with `generate`'s tokens."""
    batch = prompts(model, (3, 6, 5, 19, 4, 7, 22, 2, 5), seed=41)
    limits = [14, 6, 6, 6, 6, 6, 6, 6, 6]
    dec = SlotDecoder(model, slots=6, slot_tokens=48, eos_ids=[], pad_id=PAD, prefill_tokens=64, chunk_tokens=8)
    stepper = SlotStepper(dec, step_s=0.01, join_batch=1, prefill_step_tokens=10)
    events: list[tuple[str, int]] = []
    real_prefill, real_launch = dec.prefill, dec.launch

    def prefill(slots: Any, pieces: Any, *args: Any) -> Any:
        events.append(("prefill", sum(len(p) for p in pieces)))
        return real_prefill(slots, pieces, *args)

    def launch(*args: Any) -> Any:
        events.append(("step", 0))
        return real_launch(*args)

    dec.prefill, dec.launch = prefill, launch  # type: ignore[method-assign]
    work = [(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(batch, limits)]
    got = run_stepper(stepper, work)
    for i, (p, n) in enumerate(zip(batch, limits)):
        assert got[str(i)] == alone(model, p, None, n), i
    assert stepper.pieces > len(batch)  # the 19- and 22-token prompts went in pieces of 8
    between, worst = 0, 0
    for kind, tokens in events[events.index(("step", 0)):]:
        between = 0 if kind == "step" else between + tokens
        worst = max(worst, between)
    assert 0 < worst <= 10


def test_a_sequence_cancelled_between_its_pieces_frees_its_slot(model: Any) -> None:  # noqa: F811
    """Driven by hand (no thread): a 13-token prompt prefilled 4 tokens a step is cancelled after its first
    piece; its slot is free and held, nothing is reported for it, and the next sequence in that slot gets
    `generate`'s tokens."""
    from batchserve.generation.slot_stepper import Join

    dec = SlotDecoder(model, slots=2, slot_tokens=48, eos_ids=[], pad_id=PAD, chunk_tokens=4)
    stepper = SlotStepper(dec, step_s=0.01, prefill_step_tokens=4)
    long, short = prompts(model, (13, 5), seed=51)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    stepper._take_slots([Join("long", long, greedy, 0)])
    assert stepper._prefill() == [] and stepper._filling[0].done == 4  # one piece, no token yet
    assert stepper.kv_usage() == 0.5
    stepper._drop(["long"])
    assert stepper._filling == [] and sorted(stepper._free) == [0, 1] and stepper.kv_usage() == 0
    assert bool(dec.done[0])
    got = run_stepper(stepper, [(short, greedy)])
    assert got["0"] == alone(model, short, None, 6)
