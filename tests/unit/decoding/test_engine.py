"""The Engine's scheduling around its stepper, with a fake stepper: KV admission, tiers, cancel, expiry, stops.

The fake records what the engine adds and cancels, and the test plays the stepper's thread by delivering
steps' tokens to the engine (as a stepper does, on the loop)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batchserve.errors import ApiError
from batchserve.decoding.build import EngineConfig
from batchserve.decoding.engine import Engine
from batchserve.decoding.stepper import SamplingParams
from batchserve.decoding.shares import lane_of
from batchserve.decoding.stepper import KvCapacity, TokenUpdate
from bench.engine_loop import FeedStepper
from tests.unit.decoding.test_units import CHARS, char_tokenizer

EOS = CHARS.index("!")


class FakeStepper(FeedStepper):
    """Records what the engine adds and cancels; `emit` plays a step's output, on the loop as a stepper does."""

    def __init__(self, blocks: int, max_seqs: int, page_size: int) -> None:
        super().__init__(
            KvCapacity(blocks=blocks, page_size=page_size, max_seqs=max_seqs, max_sequence_tokens=blocks * page_size),
            step_s=0.01,
        )
        self.added: list[str] = []
        self.cancelled: list[str] = []
        self.tenants: dict[str, str] = {}

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        self.added.append(seq_id)
        self.tenants[seq_id] = tenant

    def cancel(self, seq_id: str) -> None:
        self.cancelled.append(seq_id)

    def emit(self, seq_id: str, text: str, finished: bool = False) -> None:
        self.deliver([TokenUpdate(seq_id, [CHARS.index(c) for c in text], finished)])


def engine(
    blocks: int = 8,
    max_seqs: int = 1,
    step_s: float = 0.01,
    queue_timeout_s: float = 5.0,
    registry: CollectorRegistry | None = None,
) -> Engine:
    cfg = EngineConfig(max_tokens=64, max_seqs=max_seqs, page_size=16, queue_timeout_s=queue_timeout_s)
    tokenizer = SimpleNamespace(backend_tokenizer=char_tokenizer(), eos_token_id=EOS)
    stepper = FakeStepper(blocks, max_seqs, page_size=16)
    stepper.step_s = step_s
    e = Engine(cfg, tokenizer, stepper, registry or CollectorRegistry(), max_position=4096, vocab_size=len(CHARS))
    stepper.start(None, e._on_updates)
    return e


def params(max_tokens: int = 10, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def drain(seq: Any) -> list[Any]:
    out = []
    while not seq.deltas.empty():
        out.append(seq.deltas.get_nowait())
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_sequence_waits_for_a_slot_and_starts_when_one_frees() -> None:
    async def main() -> None:
        e = engine()
        a, b = e.submit([1, 2], params()), e.submit([1, 2], params())
        assert (a.state, b.state) == ("running", "waiting") and e.stepper.added == [a.id]
        e.stepper.emit(a.id, "hi!", finished=True)
        assert b.state == "running" and e.stepper.added == [a.id, b.id]
        deltas = drain(a)
        # "!" is this tokenizer's EOS id: the finish reason says stop (it is no special token, so it is text)
        assert "".join(d.text for d in deltas) == "hi!" and deltas[-1].finish_reason == "stop"

    run(main())


def test_kv_blocks_not_sequence_count_can_be_the_limit() -> None:
    async def main() -> None:
        e = engine(blocks=4, max_seqs=8)
        big = e.submit([1] * 20, params(40))  # 60 tokens: 4 blocks of 16
        small = e.submit([1], params(1))
        assert big.state == "running" and small.state == "waiting"
        e.stepper.emit(big.id, "a" * 40, finished=True)
        assert small.state == "running"

    run(main())


def test_higher_tier_waiting_sequence_starts_first() -> None:
    async def main() -> None:
        e = engine()
        first = e.submit([1], params())
        low = e.submit([1], params(), tier=3)
        high = e.submit([1], params(), tier=0)
        e.stepper.emit(first.id, "ab!", finished=True)
        assert (high.state, low.state) == ("running", "waiting")

    run(main())


def test_predicted_wait_past_the_timeout_is_refused_at_the_door() -> None:
    async def main() -> None:
        e = engine(step_s=1.0, queue_timeout_s=5.0)
        e.submit([1], params(60))  # frees its slot in ~60 s
        with pytest.raises(ApiError) as err:
            e.submit([1], params())
        assert err.value.status == 503 and err.value.retry_after_ms >= 1000

    run(main())


def test_the_kept_replay_of_the_queue_predicts_what_replaying_everything_predicts(monkeypatch: Any) -> None:
    # The engine continues one replay of the queue per tier from arrival to arrival (a burst would otherwise cost
    # n^2/2 placements); across tiers, admissions and its time limit it must agree with a replay from scratch.
    # (It is kept for a lane alone in the engine: one tenant's interactive tiers.)
    from batchserve.decoding import forecast as forecast_module
    from batchserve.decoding.kv_budget import Claim, predicted_wait_s

    clock = [100.0]
    monkeypatch.setattr(forecast_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    e = engine(blocks=64, max_seqs=2, step_s=0.01, queue_timeout_s=1000)
    first, _ = e.submit([1], params(30)), e.submit([1], params(50))

    def probe(tier: int) -> Any:
        return SimpleNamespace(tier=tier, claim=lambda: Claim(2, 20), lane=lane_of("", tier))

    def fresh(seq: Any) -> float:
        ahead = [s.claim() for _, _, s in sorted(e.waiting) if s.tier <= seq.tier]
        return predicted_wait_s(e.budget, [s.claim() for s in e.running.values()], ahead, seq.claim(), e.step_s)

    def agree() -> None:
        for tier in range(3):
            assert e.predicted_wait_s(probe(tier)) == pytest.approx(fresh(probe(tier)), abs=1e-12), tier

    for i, tier in enumerate([1, 1, 2, 1, 0, 2, 2, 1, 0]):
        agree()
        e.submit([1], params(10 + 7 * i), tier=tier)
    agree()
    assert e.predicted_wait_s(probe(2)) > e.predicted_wait_s(probe(0)) > 0
    e.stepper.emit(first.id, "ab!", finished=True)  # a slot frees: the queue's head starts
    agree()
    clock[0] += forecast_module.REPLAY_TTL_S + 0.01  # past its time limit a replay is made afresh
    e.stepper.emit(next(iter(e.running)), "a")  # its tokens move on
    agree()


def test_a_burst_of_queued_arrivals_replays_the_queue_once(monkeypatch: Any) -> None:
    # Each arrival continues the kept replay: 200 queued arrivals of one tier, within its time limit, make one
    # replay of the queue, not one each (which made a burst quadratic: 3.6 s for 1,536).
    from batchserve.decoding import forecast as forecast_module
    from batchserve.decoding.kv_budget import Replay

    made: list[Replay] = []

    class Counted(Replay):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(forecast_module, "Replay", Counted)
    monkeypatch.setattr(forecast_module, "time", SimpleNamespace(monotonic=lambda: 100.0))
    e = engine(blocks=64, max_seqs=2, step_s=0.01, queue_timeout_s=1000)
    e.submit([1], params(30)), e.submit([1], params(50))
    for _ in range(200):
        e.submit([1], params(10))
    assert len(e.waiting) == 200 and len(made) == 1


def test_cancel_frees_the_slot_for_the_next_and_drops_the_handler() -> None:
    async def main() -> None:
        e = engine()
        a, b = e.submit([1], params()), e.submit([1], params())
        e.cancel(a)
        assert e.stepper.cancelled == [a.id]
        assert b.state == "running" and e.budget.running == 1
        waiting = e.submit([1], params())
        e.cancel(waiting)
        assert not e.waiting and waiting.id not in e.stepper.added

    run(main())


def test_a_sequence_still_waiting_at_its_deadline_gets_504() -> None:
    async def main() -> None:
        e = engine(step_s=0.001, queue_timeout_s=0.05)
        e._tick_task = asyncio.create_task(e._tick())
        e.submit([1], params())  # never finishes: the fake generates nothing
        late = e.submit([1], params())
        delta = await asyncio.wait_for(late.deltas.get(), 2)
        assert delta.error is not None and delta.error.status == 504 and not e.waiting
        e._tick_task.cancel()

    run(main())


def test_stop_string_ends_the_sequence_and_cancels_it_in_the_stepper() -> None:
    async def main() -> None:
        e = engine()
        seq = e.submit([1], params(stop=("c",)))
        e.stepper.emit(seq.id, "ab")
        e.stepper.emit(seq.id, "cd")
        deltas = drain(seq)
        assert "".join(d.text for d in deltas) == "ab" and deltas[-1].finish_reason == "stop"
        assert e.stepper.cancelled == [seq.id] and e.budget.running == 0

    run(main())


def test_length_finish_and_token_counts() -> None:
    async def main() -> None:
        e = engine()
        seq = e.submit([1], params(3))
        e.stepper.emit(seq.id, "a")
        e.stepper.emit(seq.id, "bc", finished=True)
        deltas = drain(seq)
        assert deltas[-1].finish_reason == "length" and seq.tokens == 3 and e.generated_tokens == 3

    run(main())


def test_a_sequence_not_streamed_gets_its_whole_text_in_one_delta() -> None:
    async def main() -> None:
        e = engine(max_seqs=2)
        whole = e.submit([1], params(8, stop=("z",)), streamed=False)
        streamed = e.submit([1], params(8))
        for text in ("he", "ll", "o"):
            e.stepper.emit(whole.id, text)
            e.stepper.emit(streamed.id, text)
        assert whole.deltas.empty() and streamed.deltas.qsize() == 3  # nothing to wake the first caller for
        e.stepper.emit(whole.id, " z!", finished=True)  # the stop string ends it: its text and what follows go
        deltas = drain(whole)
        assert len(deltas) == 1 and deltas[0].text == "hello " and deltas[0].finish_reason == "stop"
        assert deltas[0].tokens == 8

    run(main())


def test_token_timings_reach_the_metrics_exposition() -> None:
    from prometheus_client import generate_latest

    from bench.loadgen import parse_metrics

    async def main() -> None:
        registry = CollectorRegistry()
        e = engine(max_seqs=2, registry=registry)
        text = generate_latest(registry).decode()
        assert 'batchserve_generation_inter_token_latency_seconds_bucket{le="0.002"} 0.0' in text  # before any
        a, b = e.submit([1], params()), e.submit([1], params())
        e.stepper.deliver([TokenUpdate(a.id, [CHARS.index("x")]), TokenUpdate(b.id, [CHARS.index("y")])])
        for step in range(3):
            e.stepper.deliver([TokenUpdate(a.id, [CHARS.index("z")], step == 2)])
        m = parse_metrics(generate_latest(registry).decode())
        assert m["batchserve_generation_time_to_first_token_seconds_count"] == 2  # a's and b's first tokens
        assert m["batchserve_generation_inter_token_latency_seconds_count"] == 3  # a's later three
        assert m["batchserve_generation_output_tokens_total"] == 5

    run(main())


def test_predicted_start_of_a_new_sequence_is_zero_with_a_free_slot_and_the_queue_replayed_without_one() -> None:
    async def main() -> None:
        e = engine(max_seqs=2, step_s=0.01)
        assert e.predicted_start_s(10) == 0  # an empty engine: it would start at once
        e.submit([1], params(10))
        assert e.predicted_start_s(10) == 0  # a slot is still free
        e.submit([1], params(30))
        # both slots held: the next starts when the 10-token one ends (~10 steps of 10 ms)
        first = e.predicted_start_s(10)
        assert 0.05 < first <= 0.11
        e.submit([1], params(10))  # one waiting ahead: it takes the first free slot, a new one the next
        assert e.predicted_start_s(10) > first
        assert len(e.waiting) == 1  # reading the prediction queued nothing

    run(main())


def test_the_stepper_is_told_whose_sequence_it_runs() -> None:
    # the slot stepper shares and prices prefill by tenant (`prefill_share.py`): it must know whose prompt it is
    async def main() -> None:
        e = engine(max_seqs=2)
        a, b = e.submit([1], params(), tenant="acme"), e.submit([1], params(), tenant="globex")
        assert e.stepper.tenants == {a.id: "acme", b.id: "globex"}

    run(main())
