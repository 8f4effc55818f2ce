"""Background (batch) rows left out of decode steps beside foreground (interactive) ones (issue 33), on the
2-layer random Llama of test_slot_decoder.py: a row a step leaves out keeps its K/V, position and counters, and
when it goes on its tokens are token for token what they would have been (greedy: `generate`'s; a seeded draw:
the same as alone), whichever steps it sat out."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any


from batchserve.decoding.stepper import SamplingParams, TokenUpdate
from tests.integration.backends.test_static_decode import PAD, prompts
from tests.integration.decoding.test_slot_decoder import alone, drive

if TYPE_CHECKING:
    from batchserve.decoding.slot_stepper import SlotStepper


def test_a_row_left_out_of_steps_keeps_its_state_and_goes_on_as_it_would_have(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder

    fg, bg = prompts(model, (5, 7), seed=31)
    params = SamplingParams(max_tokens=12, temperature=0)
    dec = SlotDecoder(model, slots=4, slot_tokens=40, eos_ids=[], pad_id=PAD)
    first, _ = dec.prefill([0, 3], [fg, bg], [params, params])
    got: dict[int, list[int]] = {0: [first[0]], 3: [first[1]]}
    for _ in range(4):  # the foreground row alone: the background row in slot 3 sits out
        before = (int(dec.pos[3]), int(dec.count[3]), dec.cache.keys[0][3].clone())
        tokens, _ = dec.collect(dec.launch(1, len(fg) + len(got[0]), False))
        got[0].append(tokens[0])
        assert (int(dec.pos[3]), int(dec.count[3])) == before[:2]
        assert torch_equal(dec.cache.keys[0][3], before[2])
    while len(got[3]) < 12:  # both rows, then the background row's turn to finish
        span = max(len(fg) + len(got[0]), len(bg) + len(got[3]))
        tokens, _ = dec.collect(dec.launch(4, span, False))
        for slot in (0, 3):
            if len(got[slot]) < 12:
                got[slot].append(tokens[slot])
    assert got[0] == alone(model, fg, None, 12)
    assert got[3] == alone(model, bg, None, 12)


def torch_equal(a: Any, b: Any) -> bool:
    return bool((a == b).all())


class Alternate:
    """A ledger stand-in that leaves the background rows out of two steps in three."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, foreground_rows: int, rows: int) -> bool:
        self.calls += 1
        return self.calls % 3 == 0


def run_waves(
    stepper: SlotStepper, waves: list[list[tuple[str, list[int], SamplingParams, bool]]]
) -> dict[str, list[int]]:
    """Add each wave once every sequence of the one before has made a token (so background rows are live when
    foreground ones join); every sequence's tokens once all have finished."""

    async def main() -> dict[str, list[int]]:
        seen: dict[str, list[int]] = {}
        ended: set[str] = set()
        errors: list[str] = []
        total = sum(len(w) for w in waves)
        done = asyncio.Event()

        def deliver(updates: list[TokenUpdate]) -> None:
            for u in updates:
                seen.setdefault(u.seq_id, []).extend(u.tokens)
                if u.error:
                    errors.append(u.error)
                if u.finished:
                    ended.add(u.seq_id)
            if len(ended) == total:
                done.set()

        stepper.start(asyncio.get_running_loop(), deliver)
        for wave in waves:
            for seq_id, prompt, params, background in wave:
                stepper.add(seq_id, prompt, params, background=background)
            while not all(seq_id in seen for seq_id, *_ in wave):
                await asyncio.sleep(0.001)
        await asyncio.wait_for(done.wait(), 120)
        await asyncio.to_thread(stepper.stop, 10)
        assert not errors, errors
        return seen

    return asyncio.run(main())


def test_batch_rows_sitting_out_steps_beside_interactive_ones_answer_token_for_token(model: Any) -> None:
    """Three batch lines (two greedy, one seeded draw) run alone, then interactive sequences join: they take the
    low slots (one swapped below the batch rows), and two steps in three leave the batch rows out. Every
    sequence's tokens are what it makes alone."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    batch = prompts(model, (6, 9, 4), seed=41)
    chats = prompts(model, (3, 8, 5), seed=42)
    seeded = SamplingParams(max_tokens=30, temperature=1.2, top_p=0.9, seed=9, ignore_eos=True)
    long = SamplingParams(max_tokens=30, temperature=0)
    short = SamplingParams(max_tokens=8, temperature=0)
    dec = SlotDecoder(model, slots=6, slot_tokens=48, eos_ids=[], pad_id=PAD)
    stepper = SlotStepper(dec, step_s=0.01)
    alternate = Alternate()
    stepper.share.include = alternate  # type: ignore[method-assign]
    stepper.share.dear = lambda foreground_rows, rows: True  # type: ignore[method-assign]  # rows here cost ~nothing
    waves = [
        [("b0", batch[0], long, True), ("b1", batch[1], long, True), ("b2", batch[2], seeded, True)],
        [("c0", chats[0], short, False), ("c1", chats[1], short, False)],
        [("c2", chats[2], short, False)],
    ]
    got = run_waves(stepper, waves)
    mix = stepper.step_mix()
    assert alternate.calls > 0 and mix["interactive_only"] > 0 and mix["full"] > 0, mix
    assert stepper.moved > 0  # an interactive join above the batch rows was moved below them
    for seq_id, prompt, params, _ in [item for wave in waves for item in wave]:
        if params.greedy:
            assert got[seq_id] == alone(model, prompt, None, params.max_tokens), seq_id
        else:
            solo = drive(SlotDecoder(model, slots=1, slot_tokens=48, eos_ids=[], pad_id=PAD), [(0, prompt, params)])
            assert got[seq_id] == solo[0], seq_id


def test_the_gpu_layout_with_batch_rows_sitting_out_gives_the_same_tokens(model: Any) -> None:
    """Padded rows (the GPU's buckets, on the CPU): batch rows at the top of their bucket, interactive ones
    below; the ledger's real decisions on measured times. Every sequence's tokens are its own alone."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    batch = prompts(model, (6, 9, 4, 7), seed=51)
    chats = prompts(model, (3, 8), seed=52)
    long = SamplingParams(max_tokens=24, temperature=0)
    short = SamplingParams(max_tokens=10, temperature=0)
    dec = SlotDecoder(model, slots=12, slot_tokens=40, eos_ids=[], pad_id=PAD, fixed_shapes=True, prefill_tokens=128)
    stepper = SlotStepper(dec, step_s=0.01, slowdown=1.0)
    waves = [
        [(f"b{i}", p, long, True) for i, p in enumerate(batch)],
        [("c0", chats[0], short, False)],
        [("c1", chats[1], short, False)],
    ]
    got = run_waves(stepper, waves)
    for seq_id, prompt, params, _ in [item for wave in waves for item in wave]:
        assert got[seq_id] == alone(model, prompt, None, params.max_tokens), seq_id
