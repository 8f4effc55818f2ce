"""Generation's pure parts, without a server or weights: KV admission arithmetic, stop strings, sampling."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from batchserve.decoding.kv_budget import Claim, KvBudget, Replay, predicted_wait_s
from batchserve.decoding.sampling import GREEDY, SAMPLE, TokenChoice, TopP, step_key
from batchserve.decoding.textstream import TextStream

CHARS = list("abcdefghijklmnopqrstuvwxyz ,.!")


def char_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="!"))
    tok.decoder = decoders.Fuse()
    return tok


def stream_text(text: str, stops: tuple[str, ...]) -> tuple[list[str], TextStream]:
    ts = TextStream(char_tokenizer(), stops)
    return [ts.push(CHARS.index(c)) for c in text], ts


# -- KV budget ----------------------------------------------------------------------------------------------
def test_blocks_round_up_and_fit_counts_slots() -> None:
    b = KvBudget(total_blocks=10, page_size=32, max_seqs=2)
    assert b.blocks_for(1) == 1 and b.blocks_for(32) == 1 and b.blocks_for(33) == 2
    b.take(4)
    b.take(4)
    assert not b.fits(1)  # no slot left, though blocks are
    b.give(4)
    assert b.fits(6) and not b.fits(7)


def test_predicted_wait_replays_running_and_queued_sequences() -> None:
    b = KvBudget(total_blocks=10, page_size=32, max_seqs=4)
    for blocks in (4, 4):
        b.take(blocks)
    running = [Claim(4, steps=100), Claim(4, steps=10)]
    step = 0.01
    assert predicted_wait_s(b, running, [], Claim(2, 50), step) == 0  # fits now
    assert predicted_wait_s(b, running, [], Claim(5, 50), step) == pytest.approx(0.1)  # after the 10-step one
    # queued ahead: a 5-block sequence takes the first freed room, so this one waits for the 100-step one
    assert predicted_wait_s(b, running, [Claim(5, 50)], Claim(5, 50), step) == pytest.approx(0.6)
    assert math.isinf(predicted_wait_s(b, running, [], Claim(11, 1), step))


def test_a_kept_replay_continued_gives_what_a_fresh_one_gives() -> None:
    rng = random.Random(7)
    b = KvBudget(total_blocks=40, page_size=32, max_seqs=6)
    running = []
    for _ in range(5):
        running.append(Claim(rng.randint(1, 8), steps=rng.randint(1, 200)))
        b.take(running[-1].blocks)
    queue = [Claim(rng.randint(1, 12), steps=rng.randint(1, 200)) for _ in range(60)]
    kept = Replay(b, running, 0.01)
    for n, claim in enumerate(queue):
        fresh = predicted_wait_s(b, running, queue[:n], claim, 0.01)
        assert kept.place(claim, commit=False) == fresh  # a look leaves the replay as it was
        assert kept.place(claim, commit=False) == fresh
        assert kept.place(claim) == fresh
    assert math.isinf(kept.place(Claim(41, 1), commit=False))  # never fits: the replay is not stuck by a look
    assert kept.place(Claim(1, 1)) == predicted_wait_s(b, running, queue, Claim(1, 1), 0.01)


# -- stop strings -------------------------------------------------------------------------------------------
def test_stop_string_is_never_sent_even_in_part() -> None:
    pieces, ts = stream_text("hello sto world stop here", ("stop",))
    assert "".join(pieces) == "hello sto world "
    assert ts.stopped and ts.flush() == ""


def test_held_back_text_is_flushed_when_no_stop_string_follows() -> None:
    pieces, ts = stream_text("abc st", ("stop",))
    assert "".join(pieces) == "abc " and not ts.stopped
    assert ts.flush() == "st"


def test_earliest_of_several_stop_strings_wins() -> None:
    pieces, _ = stream_text("one, two. three", (".", ","))
    assert "".join(pieces) == "one"


# -- sampling -----------------------------------------------------------------------------------------------
def keys(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def floats(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(dtype=torch.int32)


def test_greedy_rows_are_untouched() -> None:
    scores = torch.randn(3, 50)
    assert torch.equal(TokenChoice()(scores, keys(GREEDY, GREEDY, GREEDY)), scores)


def test_seeded_draw_is_repeatable_and_follows_the_distribution() -> None:
    scores = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).repeat(4000, 1)
    seeded = keys(*[step_key(7, i) for i in range(4000)])
    a = TokenChoice()(scores, seeded).argmax(-1)
    assert torch.equal(a, TokenChoice()(scores, seeded).argmax(-1))
    share = torch.bincount(a, minlength=3) / 4000
    assert torch.allclose(share, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)
    unseeded = TokenChoice()(scores, keys(*[SAMPLE] * 4000)).argmax(-1)
    assert torch.allclose(torch.bincount(unseeded, minlength=3) / 4000, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


def test_sampled_rows_keep_exactly_one_finite_score() -> None:
    scores = torch.randn(2, 50)
    out = TokenChoice()(scores, keys(GREEDY, SAMPLE))
    assert torch.equal(out[0], scores[0])
    assert int(torch.isfinite(out[1]).sum()) == 1


def test_top_p_masks_the_tail_only_where_asked() -> None:
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = TopP()(scores, floats(0.7, 1.0))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.equal(out[1], scores[1])


def test_sync_free_processors_give_the_same_tokens_over_all_rows_at_once() -> None:
    """The CUDA form (every row in one tensor op, no host sync) against the CPU form (only the rows that ask):
    same masks, same seeded draws, greedy rows untouched."""
    torch.manual_seed(0)
    scores = torch.randn(6, 300)
    top_p = floats(0.5, 1.0, 0.9, 1.0, 0.2, 1.0)
    choice = keys(step_key(3, 0), GREEDY, step_key(3, 1), GREEDY, step_key(9, 4), step_key(1, 2))
    assert torch.equal(TopP(sync_free=True)(scores, top_p), TopP()(scores, top_p))
    masked = TopP()(scores, top_p)
    assert torch.equal(TokenChoice(sync_free=True)(masked, choice), TokenChoice()(masked, choice))
    out = TokenChoice(sync_free=True)(masked, choice)
    assert torch.equal(out[1], scores[1]) and torch.equal(out[3], scores[3])
    assert all(int(torch.isfinite(out[i]).sum()) == 1 for i in (0, 2, 4, 5))


def test_sync_free_processors_trace_as_one_graph() -> None:
    """What the manager's CUDA graph capture needs: torch.compile(fullgraph=True) fails on any host sync or
    branch on values, which the CPU form has by design and the CUDA form must not."""
    scores = torch.randn(4, 100)
    top_p, choice = floats(0.5, 1.0, 0.9, 1.0), keys(step_key(3, 0), GREEDY, SAMPLE, GREEDY)

    def step(s: torch.Tensor) -> torch.Tensor:
        return TokenChoice(sync_free=True)(TopP(sync_free=True)(s, top_p), choice)

    out = torch.compile(step, backend="eager", fullgraph=True)(scores)
    assert torch.equal(out[1], scores[1]) and int(torch.isfinite(out[0]).sum()) == 1
    with pytest.raises(Exception, match="(?i)data-dependent|graph break|dynamic"):
        torch.compile(lambda s: TokenChoice()(s, choice), backend="eager", fullgraph=True)(scores)


# -- streaming ------------------------------------------------------------------------------------------------
def test_deltas_already_waiting_go_out_in_one_chunk_and_the_end_stays_last() -> None:
    import asyncio
    from types import SimpleNamespace

    import orjson

    from batchserve import errors
    from batchserve.decoding.sequence import Delta
    from batchserve.generation.render import ResponseShape
    from batchserve.generation.serving import stream_events

    async def events(deltas: list[Delta], later: list[Delta]) -> list[dict]:
        seq = SimpleNamespace(deltas=asyncio.Queue(), tokens=len(deltas) + len(later))
        for d in deltas[1:]:
            seq.deltas.put_nowait(d)  # queued before the stream runs: the loop was behind
        out = []

        async def feed() -> None:
            for d in later:
                await asyncio.sleep(0.01)
                seq.deltas.put_nowait(d)

        feeder = asyncio.create_task(feed())
        async for raw in stream_events(seq, deltas[0], ResponseShape(True, "c", "m", 0, 3), include_usage=True):
            assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
            out.append("[DONE]" if raw == b"data: [DONE]\n\n" else orjson.loads(raw[6:]))
        await feeder
        return out

    def text(chunks: list[Any]) -> str:
        return "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if isinstance(c, dict) and c.get("choices")
        )

    # three waiting at once, then one at a time, then the end
    out = asyncio.run(
        events(
            [Delta("He", 1), Delta("llo", 2), Delta(",", 3)], [Delta(" wor", 4), Delta("ld", 5), Delta("", 5, "stop")]
        )
    )
    assert text(out) == "Hello, world"
    contents = [
        c["choices"][0]["delta"]["content"]
        for c in out[1:]
        if isinstance(c, dict) and c.get("choices") and c["choices"][0]["delta"].get("content")
    ]
    assert contents == ["Hello,", " wor", "ld"]
    assert out[-3]["choices"][0]["finish_reason"] == "stop" and out[-2]["usage"]["completion_tokens"] == 6
    assert out[-1] == "[DONE]"
    # text waiting ahead of the end, and of an error, is sent before it
    out = asyncio.run(events([Delta("a", 1), Delta("b", 2), Delta("", 2, "length")], []))
    assert text(out) == "ab" and out[-3]["choices"][0]["finish_reason"] == "length"
    out = asyncio.run(events([Delta("a", 1), Delta("b", 2), Delta("", 2, error=errors.inference_failed("x"))], []))
    assert text(out) == "ab" and "error" in out[-2] and out[-1] == "[DONE]"
