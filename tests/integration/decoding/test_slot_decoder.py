"""The slot decoder and its stepper thread (issue 13): continuous batching whose greedy tokens are `generate`'s
whatever joins, leaves or shares the step; per-request sampling on the device; a step that can be captured.

The fast tests use a 2-layer Llama with random weights; the slow one SmolLM2's real weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import pytest

from batchserve.decoding.stepper import SamplingParams, TokenUpdate
from tests.integration.backends.test_static_decode import PAD, an_eos, prompts, reference

if TYPE_CHECKING:
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def alone(model: Any, prompt: list[int], eos: int | None, new: int) -> list[int]:
    """`generate` on the prompt by itself (no padding), cut after its first eos."""
    return reference(model, [prompt], eos, new)[0]


def drive(dec: SlotDecoder, work: list[tuple[int, list[int], SamplingParams]]) -> dict[int, list[int]]:
    """Play a stepper by hand: work item i joins at step `join` into the lowest free slot; every step advances
    all live slots. Returns each item's tokens."""
    free, live, got = list(range(dec.slots)), {}, {i: [] for i in range(len(work))}
    pending = sorted(range(len(work)), key=lambda i: work[i][0])
    step = 0
    while pending or live:
        while pending and work[pending[0]][0] <= step and free:
            i = pending.pop(0)
            slot = free.pop(0)
            first, done = dec.prefill([slot], [work[i][1]], [work[i][2]])
            got[i].append(first[0])
            if done[0]:
                free.append(slot)
                free.sort()
            else:
                live[slot] = [i, len(work[i][1])]
        if live:
            tokens, done = dec.collect(
                dec.launch(
                    max(live) + 1,
                    max(p for _, p in live.values()) + 1,
                    any(not work[i][2].greedy for i, _ in live.values()),
                )
            )
            for slot in list(live):
                got[live[slot][0]].append(tokens[slot])
                live[slot][1] += 1
                if done[slot]:
                    del live[slot]
                    free.append(slot)
                    free.sort()
        step += 1
    return got


def test_greedy_tokens_are_generates_whatever_joins_and_leaves(model: Any) -> None:
    """Six prompts of mixed lengths through three slots: they join at different steps, reuse freed slots, end
    at an EOS or at their own max_tokens, and each gets exactly what `generate` gives it alone."""
    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (5, 9, 3, 12, 1, 7))
    eos = an_eos(model, batch)
    limits = [12, 5, 12, 9, 12, 3]
    work = [
        (join, p, SamplingParams(max_tokens=n, temperature=0)) for join, p, n in zip((0, 0, 2, 3, 3, 7), batch, limits)
    ]
    dec = SlotDecoder(model, slots=3, slot_tokens=32, eos_ids=[eos], pad_id=PAD)
    dec.warm()
    got = drive(dec, work)
    want = [alone(model, p, eos, n) for p, n in zip(batch, limits)]
    assert any(len(w) < n for w, n in zip(want, limits))  # some end at the eos, some at their limit
    assert [got[i] for i in range(len(batch))] == want


def test_the_gpu_layout_pads_rows_and_spans_without_changing_a_token(model: Any) -> None:
    """The shapes CUDA graphs use, checked on the CPU: rows padded up to a row bucket (idle slots run along,
    held by their done flag) and the attended span up to a span bucket (masked)."""
    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (5, 9, 3, 12, 1, 7, 2, 6, 4, 8), seed=4)
    work = [(join, p, SamplingParams(max_tokens=10, temperature=0)) for join, p in zip(range(0, 20, 2), batch)]
    dec = SlotDecoder(model, slots=12, slot_tokens=160, eos_ids=[], pad_id=PAD, fixed_shapes=True)
    assert dec.shape(3, 17) == (8, 128) and dec.shape(9, 129) == (12, 160) and not dec.use_graphs
    assert (12, 160) in dec.shapes() and (8, 128) in dec.shapes() and all(r <= 12 for r, _ in dec.shapes())
    got = drive(dec, work)
    assert [got[i] for i in range(len(batch))] == [alone(model, p, None, 10) for p in batch]


def test_prefill_of_several_prompts_at_once_gives_the_same_tokens(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (4, 11, 2))
    dec = SlotDecoder(model, slots=4, slot_tokens=32, eos_ids=[], pad_id=PAD)
    first, done = dec.prefill([2, 0, 3], batch, [GREEDY] * 3)
    assert first == [alone(model, p, None, 1)[0] for p in batch] and done == [False] * 3


def test_a_padded_prefill_writes_its_padding_rows_to_the_scratch_slot_only(model: Any) -> None:
    """The GPU's prefill layout on the CPU: three joins padded up to 4 rows and 16 tokens; the padding row
    writes into the scratch slot past the last real one, and the three sequences decode as `generate` does."""
    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (4, 11, 2), seed=12)
    dec = SlotDecoder(model, slots=6, slot_tokens=48, eos_ids=[], pad_id=PAD, fixed_shapes=True)
    assert dec.prefill_shape(3, 11) == (4, 32) and dec.scratch == 6
    assert dec.prefill_rows == (1, 4, 6) and dec.prefill_shape(6, 20) == (6, 32)
    assert dec.prefill_shape(7, 8) is None and not dec.prefill_fits(7, 8) and dec.prefill_fits(6, 48)
    exact = SlotDecoder(model, slots=200, slot_tokens=48, eos_ids=[], pad_id=PAD, prefill_tokens=10_000)
    assert exact.prefill_fits(128, 8) and not exact.prefill_fits(129, 8)  # no more joins than the buffers hold
    with pytest.raises(ValueError, match="129 joins"):
        exact.prefill(list(range(129)), [[5]] * 129, [GREEDY] * 129)
    first, done = dec.prefill([4, 0, 2], batch, [SamplingParams(max_tokens=10, temperature=0)] * 3)
    assert first == [alone(model, p, None, 1)[0] for p in batch] and done == [False] * 3
    assert dec.done[[1, 3, 5]].all()  # untouched slots stay held
    got = {slot: [tok] for slot, tok in zip((4, 0, 2), first)}
    pos = {4: 4, 0: 11, 2: 2}
    for _ in range(9):
        tokens, _ = dec.collect(dec.launch(5, max(pos.values()) + 1, False))
        for slot in got:
            got[slot].append(tokens[slot])
            pos[slot] += 1
    assert [got[4], got[0], got[2]] == [alone(model, p, None, 10) for p in batch]


def test_a_released_slot_is_held_still(model: Any) -> None:
    """A cancelled sequence's row stops where it is (a row left running would walk its position past the slot)."""
    from batchserve.decoding.slot_decoder import SlotDecoder

    dec = SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD)
    dec.prefill([0, 1], prompts(model, (3, 4)), [GREEDY] * 2)
    dec.release([1])
    before = dec.pos.tolist()
    tokens, done = dec.collect(dec.launch(2, 6, False))
    assert dec.pos.tolist()[:2] == [before[0] + 1, before[1]] and tokens[1] == PAD and done == [False, True]


def test_seeded_sampling_is_repeatable_whatever_shares_the_step(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder

    prompt = prompts(model, (6,))[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, seed=1234)
    dec = SlotDecoder(model, slots=4, slot_tokens=32, eos_ids=[], pad_id=PAD)
    by_itself = drive(dec, [(0, prompt, seeded)])[0]
    crowd = [(0, p, SamplingParams(max_tokens=10, temperature=1.0)) for p in prompts(model, (3, 8), seed=5)]
    beside = drive(dec, [*crowd, (2, prompt, seeded)])[2]  # joins later, into another slot, beside draws
    assert by_itself == beside
    other = drive(dec, [(0, prompt, SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, seed=99))])[0]
    assert other != by_itself  # 10 draws at temperature 1.5 over this vocabulary: a clash is ~impossible
    assert by_itself != alone(model, prompt, None, 10)  # and it is not simply the greedy answer


def test_greedy_rows_beside_sampled_rows_keep_generates_tokens(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (5, 7, 2))
    work = [
        (0, batch[0], GREEDY),
        (0, batch[1], SamplingParams(max_tokens=12, temperature=1.0)),
        (1, batch[2], SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-6)),
    ]
    got = drive(SlotDecoder(model, slots=3, slot_tokens=32, eos_ids=[], pad_id=PAD), work)
    assert got[0] == alone(model, batch[0], None, 12)
    assert got[2] == alone(model, batch[2], None, 12)  # top_p that small keeps only the top token: greedy


def test_the_decode_step_traces_as_one_graph(model: Any) -> None:
    """What a CUDA graph capture needs of the step: no host sync and no branch on tensor values anywhere in it,
    transformers' forward included. torch.compile(fullgraph=True) fails on exactly those. The sampling variant
    runs every op the greedy one does (its last op is the same argmax)."""
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (3, 6))
    for sampling in (True,):
        traced = SlotDecoder(model, slots=4, slot_tokens=16, eos_ids=[], pad_id=PAD)
        eager = SlotDecoder(model, slots=4, slot_tokens=16, eos_ids=[], pad_id=PAD)
        params = [SamplingParams(max_tokens=8, temperature=0.0 if not sampling else 1.0, seed=7)] * 2
        with torch.inference_mode():
            for dec in (traced, eager):
                dec.prefill([0, 1], batch, params)
            torch.compile(traced._decode_step, backend="eager", fullgraph=True)(4, 16, sampling)
            eager._decode_step(4, 16, sampling)
        assert traced.out.tolist() == eager.out.tolist() and traced.pos.tolist() == eager.pos.tolist()


def test_the_prefill_traces_as_one_graph(model: Any) -> None:
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder

    batch = prompts(model, (3, 6))
    for sampling in (True,):  # as for the step: the greedy variant's ops are a subset
        params = [SamplingParams(max_tokens=8, temperature=0.0 if not sampling else 1.0, seed=7)] * 2
        traced = SlotDecoder(model, slots=4, slot_tokens=16, eos_ids=[], pad_id=PAD, fixed_shapes=True)
        eager = SlotDecoder(model, slots=4, slot_tokens=16, eos_ids=[], pad_id=PAD, fixed_shapes=True)
        eager.prefill([0, 2], batch, params)
        traced._prefill_step = torch.compile(traced._prefill_step, backend="eager", fullgraph=True)
        traced.prefill([0, 2], batch, params)
        assert traced.out.tolist() == eager.out.tolist() and traced.pos.tolist() == eager.pos.tolist()


def test_no_cuda_capture_without_cuda(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder

    def refuse(*a: Any, **kw: Any) -> None:
        raise AssertionError("a CUDA graph was asked for on the CPU")

    for name in ("CUDAGraph", "graph", "graph_pool_handle", "Stream"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    dec = SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD)
    assert not dec.use_graphs and dec.warm() > 0 and not dec.graphs
    assert dec.shape(3, 17) == (3, 17)  # exact shapes on a CPU
    with pytest.raises(ValueError, match="CUDA"):
        SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD, use_graphs=True)


def test_a_failed_capture_leaves_the_steps_eager(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder

    dec = SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD)
    dec.use_graphs = dec.fixed_shapes = True  # as on CUDA

    def broken() -> None:
        dec.graphs[(1, 32, False)] = "half-made"
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(dec, "_capture", broken)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert dec.warm() > 0 and not dec.graphs and not dec.use_graphs and dec.shape(3, 17) == (3, 17)
    batch = prompts(model, (4, 6))
    got = drive(dec, [(0, p, SamplingParams(max_tokens=6, temperature=0)) for p in batch])
    assert [got[0], got[1]] == [alone(model, p, None, 6) for p in batch]


def test_the_capture_records_every_bucket_of_step_and_prefill(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture's bookkeeping, run on the CPU with CUDA's graph calls stood in for: every (rows, span) step and
    every (joins, width) prefill, greedy and sampling, warmed once and recorded once (on a GPU a slip here
    would only show as the eager fallback's log line)."""
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder

    recorded: list[str] = []

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Graph:
        def replay(self) -> None:
            raise AssertionError("not replayed in this test")

    @contextlib.contextmanager
    def graph(g: Any, pool: Any = None, capture_error_mode: str = "") -> Any:
        recorded.append("capture")
        yield

    for name, fake in (
        ("graph_pool_handle", lambda: "pool"),
        ("Stream", lambda *a: Stream()),
        ("current_stream", lambda *a: Stream()),
        ("stream", lambda s: contextlib.nullcontext()),
        ("graph", graph),
        ("CUDAGraph", Graph),
    ):
        monkeypatch.setattr(torch.cuda, name, fake)
    dec = SlotDecoder(model, slots=20, slot_tokens=300, eos_ids=[], pad_id=PAD, fixed_shapes=True, prefill_tokens=2048)
    dec._capture()
    assert set(dec.graphs) == {(r, s, g) for r, s in dec.shapes() for g in (False, True)}
    assert set(dec.prefill_graphs) == {(r, w, g) for r, w in dec.prefill_shapes() for g in (False, True)}
    # later pieces of chunked prompts: widths up to the chunk (256: the default 512 is over the 300-token slots)
    assert set(dec.chunk_graphs) == {(r, w, g) for r, w in dec.prefill_shapes(continued=True) for g in (False, True)}
    assert dec.chunk_tokens == 300 and max(w for _, w in dec.prefill_shapes(continued=True)) == 300
    assert len(recorded) == len(dec.graphs) + len(dec.prefill_graphs) + len(dec.chunk_graphs)
    assert dec.shapes() == [(r, s) for r in (1, 8, 16, 20) for s in (128, 256, 300)]
    assert (16, 128) in dec.prefill_shapes() and (20, 128) not in dec.prefill_shapes()  # 20 x 128 > 2048 tokens
    assert dec.done[:20].all()  # the warm-up runs left every slot held


def test_the_stepper_thread_runs_more_sequences_than_slots_and_drops_cancelled_ones(model: Any) -> None:
    """Through the thread, with an event loop: 7 sequences, 2 slots, small prefill groups; one is cancelled
    while it runs and one before it could join. The rest end with `generate`'s tokens, one update per token."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    batch = prompts(model, (5, 9, 3, 12, 1, 7, 4), seed=2)
    dec = SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD, prefill_tokens=8)
    stepper = SlotStepper(dec, step_s=dec.warm())

    def cancel_s0(u: TokenUpdate, seen: dict[str, list[TokenUpdate]], waiting_for: set[str]) -> None:
        if u.seq_id == "s0" and len(seen["s0"]) == 3:
            stepper.cancel("s0")
            waiting_for.discard("s0")

    adds = [(f"s{i}", p, SamplingParams(max_tokens=10, temperature=0)) for i, p in enumerate(batch)]
    seen = run_updates(
        stepper,
        adds,
        {f"s{i}" for i in range(len(batch))} - {"s5"},
        react=cancel_s0,
        after_adds=lambda: stepper.cancel("s5"),
    )  # 2 slots: s5 is still waiting to join
    assert not stepper.is_running() and stepper.failure is None and stepper.kv_usage() == 0
    assert "s5" not in seen
    assert 3 <= len(seen["s0"]) < 10 and not any(u.finished for u in seen["s0"])
    for i in (1, 2, 3, 4, 6):
        updates = seen[f"s{i}"]
        assert all(len(u.tokens) == 1 for u in updates) and updates[-1].finished
        assert [t for u in updates for t in u.tokens] == alone(model, batch[i], None, 10)


def run_updates(
    stepper: Any,
    adds: list[tuple[str, list[int], SamplingParams]],
    waiting_for: set[str],
    react: Callable[[TokenUpdate, dict[str, list[TokenUpdate]], set[str]], None] | None = None,
    after_adds: Callable[[], None] | None = None,
    pause_s: float = 0.0,
) -> dict[str, list[TokenUpdate]]:
    """Run a stepper (either kind) on an event loop: add each (id, prompt, params), `pause_s` apart, then call
    `after_adds`; hand every update to `react` (which may cancel, and take the id out of `waiting_for`); stop
    once every id in `waiting_for` has finished. Each id's updates."""

    async def main() -> dict[str, list[TokenUpdate]]:
        seen: dict[str, list[TokenUpdate]] = {}
        done = asyncio.Event()

        def deliver(updates: list[TokenUpdate]) -> None:
            for u in updates:
                seen.setdefault(u.seq_id, []).append(u)
                if react is not None:
                    react(u, seen, waiting_for)
                if u.finished:
                    waiting_for.discard(u.seq_id)
            if not waiting_for:
                done.set()

        stepper.start(asyncio.get_running_loop(), deliver)
        for seq_id, prompt, params in adds:
            stepper.add(seq_id, prompt, params)
            if pause_s:
                await asyncio.sleep(pause_s)
        if after_adds is not None:
            after_adds()
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.sleep(0.05)  # what the stepper still sends for cancelled ones arrives (and must not finish)
        await asyncio.to_thread(stepper.stop, 10)
        return seen

    return asyncio.run(main())


def run_stepper(stepper: SlotStepper, work: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Every item added at once through the stepper's thread; each one's tokens."""
    seen = run_updates(stepper, [(str(i), p, q) for i, (p, q) in enumerate(work)], {str(i) for i in range(len(work))})
    assert all(u.error is None for updates in seen.values() for u in updates)
    return {seq_id: [t for u in updates for t in u.tokens] for seq_id, updates in seen.items()}


def test_long_sequences_left_in_high_slots_move_down_without_changing_a_token(model: Any) -> None:
    """Six short sequences and two long ones (one greedy, one seeded draw) join at once; the long ones have the
    longest prompts, so they take the highest slots. Once the short ones end, the two fit a quarter of the
    rows: they move down into free slots (K/V and row state) mid-flight, and every token is what it would
    have been."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    short = prompts(model, (1, 2, 3, 4, 5, 6), seed=8)
    long = prompts(model, (9, 12), seed=9)
    seeded = SamplingParams(max_tokens=14, temperature=1.3, top_p=0.9, seed=42)
    work = [(p, SamplingParams(max_tokens=3, temperature=0)) for p in short]
    work += [(long[0], SamplingParams(max_tokens=14, temperature=0)), (long[1], seeded)]
    dec = SlotDecoder(model, slots=8, slot_tokens=32, eos_ids=[], pad_id=PAD)
    stepper = SlotStepper(dec, step_s=0.01)
    got = run_stepper(stepper, work)
    assert stepper.moved == 2
    for i, p in enumerate(short):
        assert got[str(i)] == alone(model, p, None, 3)
    assert got["6"] == alone(model, long[0], None, 14)
    by_itself = drive(SlotDecoder(model, slots=1, slot_tokens=32, eos_ids=[], pad_id=PAD), [(0, long[1], seeded)])
    assert got["7"] == by_itself[0]


def test_the_gpu_configuration_end_to_end_on_the_cpu(model: Any) -> None:
    """Everything a GPU runs but the capture: padded rows, spans and prefills (scratch rows), joins gathered
    and grouped by the prefill buckets, moves, through the stepper's thread; 20 sequences through 12 slots,
    greedy and seeded, each against its reference."""
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    batch = prompts(model, tuple(1 + (i * 7) % 15 for i in range(20)), seed=21)
    limits = [4 if i % 3 else 14 for i in range(20)]
    # seeded draws at top_p 0.9: among the likely tokens, where the rounding differences between batch shapes
    # cannot move a draw to a neighbouring token (in a flat tail they can: see sampling.choose_tokens)
    params = [
        SamplingParams(max_tokens=n, temperature=1.1 if i % 4 == 0 else 0, top_p=0.9, seed=i)
        for i, n in enumerate(limits)
    ]
    dec = SlotDecoder(model, slots=12, slot_tokens=40, eos_ids=[], pad_id=PAD, fixed_shapes=True, prefill_tokens=128)
    stepper = SlotStepper(dec, step_s=0.01, join_batch=3)
    got = run_stepper(stepper, list(zip(batch, params)))
    for i, (p, q) in enumerate(zip(batch, params)):
        if q.greedy:
            assert got[str(i)] == alone(model, p, None, q.max_tokens), i
        else:
            solo = drive(SlotDecoder(model, slots=1, slot_tokens=40, eos_ids=[], pad_id=PAD), [(0, p, q)])
            assert got[str(i)] == solo[0], i


def test_a_failing_prefill_fails_its_sequences_only(model: Any) -> None:
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    dec = SlotDecoder(model, slots=2, slot_tokens=32, eos_ids=[], pad_id=PAD)
    stepper = SlotStepper(dec, step_s=0.01)
    good = prompts(model, (4,))[0]
    adds = [
        ("bad", [model.config.vocab_size + 5], SamplingParams(max_tokens=4, temperature=0)),
        ("good", good, SamplingParams(max_tokens=4, temperature=0)),
    ]
    seen = run_updates(stepper, adds, {"bad", "good"}, pause_s=0.2)
    assert seen["bad"][-1].error and seen["bad"][-1].tokens == []
    assert [t for u in seen["good"] for t in u.tokens] == alone(model, good, None, 4)


@pytest.mark.slow
@pytest.mark.parallel  # in process, token for token, no timing: CI runs it in the parallel workers
def test_slot_path_gives_generates_greedy_answers_on_the_real_weights() -> None:
    """SmolLM2's real weights: chat prompts of mixed lengths joining at different steps through fewer slots
    than prompts (one waits for a freed slot), each against `generate` on that prompt alone, token for token
    (EOS ends included)."""
    import torch

    from batchserve.backends.smollm2 import load_model, load_tokenizer, source_dir
    from batchserve.config import Settings
    from batchserve.decoding.slot_decoder import SlotDecoder

    source = source_dir(Settings(backend="smollm2"))
    tok = load_tokenizer(source)
    mdl = load_model("cpu", source)
    questions = [
        "What is the capital of France?",
        "Hi",
        "Write one sentence about the sea and the wind, for a child who has never seen either of them.",
        "2+2=",
    ]
    chats = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]
    new = 24
    want = []
    with torch.inference_mode():
        for ids in chats:
            out = mdl.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
            row = out[0, len(ids) :].tolist()
            want.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    assert any(len(w) < new for w in want) and any(len(w) == new for w in want)
    dec = SlotDecoder(mdl, slots=3, slot_tokens=256, eos_ids=[tok.eos_token_id], pad_id=tok.eos_token_id)
    work = [(join, ids, SamplingParams(max_tokens=new, temperature=0)) for join, ids in zip((0, 0, 1, 4), chats)]
    got = drive(dec, work)
    assert [got[i] for i in range(len(chats))] == want


def test_a_sequence_dropped_and_resumed_from_its_tokens_goes_on_as_it_would_have(model: Any) -> None:
    """Preemption by recompute (issue 33): a sequence run a few steps, dropped (its slot released, then written by
    another sequence), and started again in another slot with its prompt followed by the tokens it had made and
    `resumed` = how many, makes the tokens it would have made without the pause: greedy ones token for token,
    a seeded draw keyed by the same token index, and it ends at the same max_tokens. Without `resumed` the
    seeded draws restart from index 0 and the length end comes max_tokens after the pause."""
    from batchserve.decoding.slot_decoder import SlotDecoder

    prompt, other = prompts(model, (6, 9), seed=11)
    for params in (
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    ):
        dec = SlotDecoder(model, slots=2, slot_tokens=40, eos_ids=[1], pad_id=PAD)
        dec.warm()
        whole = drive(dec, [(0, prompt, params)])[0]
        sampling = not params.greedy
        first, _ = dec.prefill([0], [prompt], [params])
        got = [first[0]]
        for _ in range(4):
            tokens, _ = dec.collect(dec.launch(1, len(prompt) + len(got), sampling))
            got.append(tokens[0])
        dec.release([0])  # preempted: its slot goes to another sequence, which writes over its K/V
        dec.prefill([0], [other], [GREEDY])
        dec.collect(dec.launch(1, len(other) + 1, False))
        dec.release([0])
        resumed = dataclasses.replace(params, resumed=len(got))
        first, done = dec.prefill([1], [prompt + got], [resumed])
        got.append(first[0])
        ended = done[0]
        while not ended:
            tokens, flags = dec.collect(dec.launch(2, len(prompt) + len(got), sampling))
            got.append(tokens[1])
            ended = flags[1]
        assert got == whole, params
