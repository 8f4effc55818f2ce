"""Rows to the memory and prefill in pieces (issue 25): the slot count and KV budget from free device memory
(made-up free-memory figures, no device), the row buckets up to it, the per-step prefill plan; and on the
CPU, that a prompt prefilled in pieces, between the decode steps of others, still gives `generate`'s greedy
tokens, and that a burst of joins never puts more than one step's prefill budget between two steps.

In process (no server), on the 2-layer random Llama of tests/integration/backends/test_static_decode.py; the parts
without a model are tests/unit/decoding/test_sizing.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.decoding.stepper import SamplingParams
from tests.integration.decoding.test_slot_decoder import alone, run_stepper
from tests.integration.backends.test_static_decode import PAD, prompts


def test_a_decoder_captures_row_buckets_up_to_its_slots(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder

    dec = SlotDecoder(model, slots=1100, slot_tokens=128, eos_ids=[], pad_id=PAD, fixed_shapes=True)
    rows = sorted({r for r, _ in dec.shapes()})
    assert rows[-3:] == [768, 1024, 1100] and dec.shape(1025, 5) == (1100, 128) and dec.shape(300, 5) == (384, 128)


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "gpu-layout"])
def test_a_prompt_prefilled_in_pieces_between_steps_decodes_as_generate(model: Any, fixed: bool) -> None:
    """A 23-token prompt prefilled in pieces of 7, 7, 7, 2 while another sequence decodes in a lower slot
    (and its held row runs along in the steps between pieces), then both decode to the end: each gets what
    `generate` gives it alone. `gpu-layout`: padded rows, widths and spans as CUDA graphs run them, later
    pieces attending to the whole slot."""
    from batchserve.decoding.slot_decoder import SlotDecoder

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
            first, ended = dec.prefill(
                [2], [long[done_tokens : done_tokens + n]], [greedy], [done_tokens], [done_tokens + n == len(long)]
            )
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


def test_the_stepper_spreads_a_burst_over_steps_and_keeps_generates_tokens(model: Any) -> None:
    """One sequence runs; then a burst of eight joins, two of them longer than a piece, arrives with more
    sequences than slots. Between two decode steps the stepper prefills at most its step budget (the old
    behaviour prefilled the whole burst before the next step), long prompts go in pieces, and every sequence
    ends with `generate`'s tokens."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

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
    for kind, tokens in events[events.index(("step", 0)) :]:
        between = 0 if kind == "step" else between + tokens
        worst = max(worst, between)
    assert 0 < worst <= 10


def test_a_sequence_cancelled_between_its_pieces_frees_its_slot(model: Any) -> None:
    """Driven by hand (no thread): a 13-token prompt prefilled 4 tokens a step is cancelled after its first
    piece; its slot is free and held, nothing is reported for it, and the next sequence in that slot gets
    `generate`'s tokens."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_map import Join
    from batchserve.decoding.slot_stepper import SlotStepper

    dec = SlotDecoder(model, slots=2, slot_tokens=48, eos_ids=[], pad_id=PAD, chunk_tokens=4)
    stepper = SlotStepper(dec, step_s=0.01, prefill_step_tokens=4)
    long, short = prompts(model, (13, 5), seed=51)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    stepper.slot_map.seat([Join("long", long, greedy, 0)])
    assert stepper._prefill() == [] and stepper.slot_map.filling[0].done == 4  # one piece, no token yet
    assert stepper.kv_usage() == 0.5
    stepper.slot_map.drop(["long"])
    assert stepper.slot_map.filling == [] and sorted(stepper.slot_map.free) == [0, 1] and stepper.kv_usage() == 0
    assert bool(dec.done[0])
    got = run_stepper(stepper, [(short, greedy)])
    assert got["0"] == alone(model, short, None, 6)


def test_another_tenants_long_prompt_is_prefilled_between_a_chats_steps_and_both_decode_as_generate(
    model: Any,
) -> None:
    """Tenant a's 24-token prompt (pieces of 8) is under way when tenant b's 5-token chat joins: b's prompt is
    prefilled first, and from then on a's pieces go only as the prefill ledger affords (`prefill_share`; the
    injected clock makes every prefill look dear, so only the starvation bound lets a piece through), so b gets a
    token at every turn while a's prompt is spread over many of b's steps. a's prompt waited in the highest slot,
    and is moved down next to b's once live; both get `generate`'s tokens. Driven by hand, turn by turn."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_map import Join
    from batchserve.decoding.slot_stepper import SlotStepper

    chat, long = prompts(model, (5, 24), seed=61)
    ticks = iter(range(10**6))
    dec = SlotDecoder(model, slots=4, slot_tokens=48, eos_ids=[], pad_id=PAD, chunk_tokens=8)
    stepper = SlotStepper(dec, step_s=0.01, join_batch=1, clock=lambda: float(next(ticks)))
    greedy = SamplingParams(max_tokens=24, temperature=0)
    got: dict[str, list[int]] = {"a": [], "b": []}
    turns: list[tuple[int, int]] = []  # (a's prompt tokens done, b's tokens) after each turn
    joins = [Join("a", long, SamplingParams(max_tokens=4, temperature=0), 0, False, "a")]
    pending = None
    for turn in range(200):
        updates, pending = stepper._turn([], joins, pending)
        joins = [Join("b", chat, greedy, stepper.steps, False, "b")] if turn == 0 else []
        for u in updates:
            assert u.error is None
            got[u.seq_id] += u.tokens
        filling = {f.join.seq_id: f.done for f in stepper.slot_map.filling}
        turns.append((filling.get("a", len(long)), len(got["b"])))
        if len(got["a"]) == 4 and len(got["b"]) == 24:
            break
    assert got["b"] == alone(model, chat, None, 24) and got["a"] == alone(model, long, None, 4)
    assert stepper.moved >= 1  # a went live in the highest slot and moved down beside b
    spread = [b for done, b in turns if 8 <= done < len(long)]
    assert len(spread) >= 8  # b made tokens through at least 8 turns while a's prompt was half done
    assert all(later - earlier == 1 for earlier, later in zip(spread, spread[1:]))  # one token every turn
