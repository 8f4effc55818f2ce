"""The generation engine's shares of its slots by tenant and tier, and preemption by recompute (issue 33): the
pure policy (`shares.py`), and the engine around a fake stepper with an injected clock.

Every engine test here failed before the shares: `submit` took no tenant, sequences waited in arrival order by
tier, and a running sequence was never paused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batchserve.core.tiers import BATCH
from batchserve.errors import ApiError
from batchserve.decoding import engine as engine_module
from batchserve.decoding import forecast as forecast_module
from batchserve.decoding import lanes as lanes_module
from batchserve.decoding.build import EngineConfig
from batchserve.decoding.engine import Engine
from batchserve.decoding.stepper import SamplingParams
from batchserve.decoding.shares import (
    BATCH_BESIDE_INTERACTIVE,
    INTERACTIVE,
    LINGER_S,
    SPARE,
    LaneLoad,
    batch_excess,
    batch_row_cap,
    rows_within_slowdown,
    headroom,
    shares,
    victim_lane,
)
from tests.unit.fakes import Clock
from tests.unit.decoding.test_engine import CHARS, EOS, FakeStepper, drain, engine, params
from tests.unit.decoding.test_units import char_tokenizer

A, B, C = (INTERACTIVE, "a"), (INTERACTIVE, "b"), (INTERACTIVE, "c")
BA = (SPARE, "a")


# -- the policy ---------------------------------------------------------------------------------------------
def test_interactive_lanes_split_everything_and_a_lone_lane_may_use_it_all() -> None:
    assert shares({A: LaneLoad(8)}, 8) == {A: 8.0}
    assert shares({A: LaneLoad(8), B: LaneLoad(0)}, 8) == {A: 4.0, B: 4.0}
    assert shares({A: LaneLoad(8), B: LaneLoad(0), C: LaneLoad(0)}, 9) == {A: 3.0, B: 3.0, C: 3.0}


def test_weights_split_in_proportion() -> None:
    # the tier table has no weights today (all 1); a weight, where one is given, scales the share
    assert shares({A: LaneLoad(0, weight=3.0), B: LaneLoad(0, weight=1.0)}, 8) == {A: 6.0, B: 2.0}


def test_batch_lanes_share_what_interactive_work_leaves_less_the_headroom() -> None:
    room = 16 - headroom(16)  # 14
    assert shares({BA: LaneLoad(3)}, 16) == {BA: room}
    got = shares({A: LaneLoad(5), BA: LaneLoad(3), (SPARE, "b"): LaneLoad(0)}, 16)
    assert got[A] == 16 and got[BA] == got[(SPARE, "b")] == (room - 5) / 2
    assert shares({A: LaneLoad(16), BA: LaneLoad(0)}, 16)[BA] < 1e-6  # nothing spare


def test_a_lane_under_its_share_takes_from_the_lane_furthest_over_its_own() -> None:
    lanes = {A: LaneLoad(5), B: LaneLoad(3), C: LaneLoad(0)}  # 8 slots: shares 8/3 each
    share = shares(lanes, 8)
    assert victim_lane(C, 1, lanes, share, {A: 1, B: 1}) == A
    # at or over its share, a lane takes nothing: it waits for a place to free
    assert victim_lane(B, 1, lanes, share, {A: 1, B: 1}) is None


def test_no_slot_is_traded_back_and_forth() -> None:
    # 3 slots, two lanes of 2 and 1: shares 1.5; the lane of 1 is under its share, but taking one would leave
    # the other further under its share (1/1.5) than it gets (2/1.5): no gain, so no preemption
    lanes = {A: LaneLoad(2), B: LaneLoad(1)}
    assert victim_lane(B, 1, lanes, shares(lanes, 3), {A: 1, B: 1}) is None
    lanes = {A: LaneLoad(3), B: LaneLoad(0)}  # 3 to 0: one moves
    assert victim_lane(B, 1, lanes, shares(lanes, 3), {A: 1}) == A


def test_an_interactive_caller_pauses_a_batch_line_before_anything_else() -> None:
    lanes = {A: LaneLoad(4), B: LaneLoad(0), BA: LaneLoad(3)}
    assert victim_lane(B, 1, lanes, shares(lanes, 8), {A: 1, BA: 1}) == BA
    # a batch line never pauses interactive work
    lanes = {A: LaneLoad(8), (SPARE, "b"): LaneLoad(0)}
    assert victim_lane((SPARE, "b"), 1, lanes, shares(lanes, 8), {A: 1}) is None


def test_batch_lines_hold_a_fraction_of_the_places_beside_interactive_work_and_at_least_one() -> None:
    assert batch_row_cap(8, 0.25) == 2 and batch_row_cap(8, 0.5) == 4
    assert batch_row_cap(8, 0.05) == 1  # never none: every batch line keeps moving toward its window
    assert batch_row_cap(8, 1.0) == 8 and batch_row_cap(830, BATCH_BESIDE_INTERACTIVE) == 207
    assert batch_excess(7, 2, interactive=True) == 5
    assert batch_excess(7, 2, interactive=False) == 0  # alone, batch lines fill what is spare
    assert batch_excess(2, 2, interactive=True) == 0


def test_where_rows_are_dear_batch_lines_keep_only_the_rows_that_fit_the_slowdown_and_at_least_one() -> None:
    # a second row adding 20% of a one-row step (a CPU): one batch row fits 1.25x, two would make it 1.4x
    assert rows_within_slowdown(0.2, 1.25, 8) == 1
    assert rows_within_slowdown(0.1, 1.25, 8) == 2 and rows_within_slowdown(0.05, 1.25, 8) == 5
    assert rows_within_slowdown(0.6, 1.25, 8) == 1  # never none: batch lines keep moving toward their window
    assert rows_within_slowdown(0.0, 1.25, 8) == 8  # rows that cost nothing measurable (a GPU): no bound here
    assert rows_within_slowdown(0.001, 1.25, 8) == 8  # and never more than the places
    assert rows_within_slowdown(0.2, 1.0, 8) == 1


def test_the_engine_keeps_batch_rows_to_the_fewer_of_its_share_and_what_the_slowdown_allows() -> None:
    def cap(row_growth: float, beside: float, slowdown: float, shares_steps: bool = False) -> int:
        cfg = EngineConfig(
            max_tokens=64, max_seqs=8, page_size=16, batch_beside_interactive=beside, batch_slowdown=slowdown
        )
        stepper = Recording(8, 8, 16)
        stepper.row_growth, stepper.shares_steps = row_growth, shares_steps
        tokenizer = SimpleNamespace(backend_tokenizer=char_tokenizer(), eos_token_id=EOS)
        e = Engine(cfg, tokenizer, stepper, CollectorRegistry(), max_position=4096, vocab_size=len(CHARS))
        return e.admitter.batch_cap

    assert cap(row_growth=0.3, beside=0.25, slowdown=1.25) == 1  # the CPU: dear rows
    assert cap(row_growth=0.0, beside=0.25, slowdown=1.25) == 2  # a GPU: the share of the places
    assert cap(row_growth=0.1, beside=1.0, slowdown=1.25) == 2
    assert cap(row_growth=0.3, beside=0.25, slowdown=2.0) == 2  # a looser slowdown: the share rules again
    # a stepper that leaves batch rows out of steps holds the slowdown itself (`step_share`): more batch rows in
    # fewer steps cost the interactive callers least, so the share of the places alone bounds them
    assert cap(row_growth=0.66, beside=0.25, slowdown=1.25, shares_steps=True) == 2


# -- the engine ---------------------------------------------------------------------------------------------
class Recording(FakeStepper):
    """Also records the prompt and parameters of each add (a resumed run's prompt ends with its tokens)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.runs: dict[str, tuple[list[int], SamplingParams]] = {}
        self.background: dict[str, bool] = {}

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        super().add(seq_id, prompt_ids, params, background)
        self.runs[seq_id] = (list(prompt_ids), params)
        self.background[seq_id] = background


def slots(
    n: int, step_s: float = 0.01, queue_timeout_s: float = 5.0, resumable: bool = True, beside: float = 1.0
) -> Engine:
    """An engine of `n` one-block slots (as the slot stepper's), on a recording fake stepper. `beside`: the share
    of the slots batch lines may hold beside interactive work (`--generation-batch-beside-interactive`; 1 = no
    cap, as every test here but the cap's own assumes)."""
    e = engine(blocks=n, max_seqs=n, step_s=step_s, queue_timeout_s=queue_timeout_s)
    e.admitter.batch_cap = batch_row_cap(n, beside)
    stepper = Recording(n, n, 16)
    stepper.step_s, stepper.resumable = step_s, resumable
    e.stepper = e.admitter.stepper = stepper
    e.budget.page_size, e.max_context = 4096, 4096  # every sequence one block: a slot
    stepper.start(None, e._on_updates)
    return e


@pytest.fixture
def clock(monkeypatch: Any) -> Clock:
    c = Clock()
    for module in (engine_module, lanes_module, forecast_module):  # the engine, its books and its forecast
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=c))
    return c


def held(e: Engine, tenant: str, lane: int = INTERACTIVE) -> int:
    return e.lanes.lane_held.get((lane, tenant), 0)


def test_a_tenant_holding_every_slot_gives_them_up_to_its_share_as_another_arrives(clock: Clock) -> None:
    async def main() -> None:
        e = slots(4)
        hog = []
        for _ in range(4):
            hog.append(e.submit([1], params(60), tenant="a"))
            clock.t += 1
        queued = e.submit([1], params(60), tenant="a")  # a's own queue does not help it either
        assert held(e, "a") == 4 and queued.state == "waiting"
        first = e.submit([1], params(5), tenant="b")
        # b starts at once: a's latest started sequence is paused (its run dropped in the stepper)
        assert first.state == "running" and hog[3].state == "waiting" and e.stepper.cancelled == [hog[3].id]
        second = e.submit([1], params(5), tenant="b")
        assert second.state == "running" and hog[2].state == "waiting"
        third = e.submit([1], params(5), tenant="b")  # b holds its share (2 of 4): it waits
        assert third.state == "waiting" and held(e, "a") == held(e, "b") == 2 and e.admitter.preemptions == 2
        assert all(s.state != "done" for s in hog)  # paused, never failed

    asyncio.run(main())


def test_a_freed_slot_goes_to_the_lane_furthest_under_its_share_not_the_oldest_arrival(clock: Clock) -> None:
    async def main() -> None:
        e = slots(4, resumable=False)  # no preemption here: only the order of admission
        a = [e.submit([1], params(60), tenant="a") for _ in range(3)]
        b = e.submit([1], params(60), tenant="b")
        a_next = e.submit([1], params(60), tenant="a")  # arrived first
        clock.t += 1
        b_next = e.submit([1], params(60), tenant="b")
        e.stepper.emit(a[0].id, "ab!", finished=True)  # a: 2 held, b: 1 held of shares 2
        assert (b_next.state, a_next.state) == ("running", "waiting")
        assert b.state == "running"

    asyncio.run(main())


def test_the_predicted_wait_of_a_tenant_under_its_share_counts_its_turn_not_the_hogs_queue(clock: Clock) -> None:
    async def main() -> None:
        e = slots(4, step_s=0.05, queue_timeout_s=3.0)
        for _ in range(4):
            e.submit([1], params(200), tenant="a", max_wait_s=1e6)
        for _ in range(40):  # a long queue of the hog's own (10 s of steps each)
            e.submit([1], params(200), tenant="a", max_wait_s=1e6)
        mine = [e.submit([1], params(10), tenant="b") for _ in range(3)]  # two start by preemption
        assert [s.state for s in mine] == ["running", "running", "waiting"]
        # the third waits for the first of b's short ones (~0.5 s) and one of a's turns, not behind 40 of a's
        assert e.predicted_wait_s(mine[2]) < 1.5
        more = [e.submit([1], params(10), tenant="b") for _ in range(4)]
        assert all(s.state == "waiting" for s in more)  # admitted to wait, none refused

    asyncio.run(main())


def test_a_preempted_sequence_resumes_from_its_tokens_and_its_caller_sees_one_unbroken_answer(clock: Clock) -> None:
    async def main() -> None:
        e = slots(2)
        e.submit([1], params(60), tenant="a")
        clock.t += 1
        seq = e.submit([1, 2], SamplingParams(max_tokens=8, temperature=0.7, seed=5), tenant="a", streamed=False)
        e.stepper.emit(seq.id, "abc")
        other = e.submit([3], params(2), tenant="b")  # b under its share: a's latest started is paused
        assert seq.state == "waiting" and other.state == "running" and e.stepper.cancelled == [seq.id]
        e.stepper.emit(seq.id, "zz")  # a step of the old run still in flight: ignored
        e.stepper.emit(other.id, "x!", finished=True)  # b done: its place is kept for it a moment (LINGER_S)
        assert seq.state == "waiting"
        clock.t += LINGER_S + 0.01
        e.admitter.admit()  # (the engine's tick): a resumes under a new run id
        assert seq.state == "running" and seq.run_id != seq.id and seq.runs == 2
        prompt, resumed = e.stepper.runs[seq.run_id]
        abc = [CHARS.index(c) for c in "abc"]
        assert prompt == [1, 2, *abc]  # recomputed: the prompt and the tokens it had made
        assert resumed.resumed == 3 and resumed.max_tokens == 8 and resumed.seed == 5
        e.stepper.emit(seq.run_id, "defgh", finished=True)
        deltas = drain(seq)
        assert [d.text for d in deltas] == ["abcdefgh"] and deltas[-1].finish_reason == "length"
        assert seq.tokens == 8 and e.admitter.preemptions == 1

    asyncio.run(main())


def test_a_lane_that_just_finished_finds_its_place_kept_rather_than_pausing_someone_again(clock: Clock) -> None:
    async def main() -> None:
        e = slots(4)
        for _ in range(6):
            e.submit([1], params(60), tenant="a", max_wait_s=1e6)
            clock.t += 1
        mine = e.submit([1], params(3), tenant="b")
        assert e.admitter.preemptions == 1
        e.stepper.emit(mine.id, "ab!", finished=True)
        assert held(e, "a") == 3 and e.budget.running == 3  # the place b freed stays free a moment: a waits
        clock.t += LINGER_S / 2
        again = e.submit([1], params(3), tenant="b")  # a closed loop's next request: no pause needed
        assert again.state == "running" and e.admitter.preemptions == 1
        e.stepper.emit(again.id, "ab!", finished=True)
        clock.t += LINGER_S + 0.01  # b is gone for good: its place goes to a
        e.admitter.admit()
        assert held(e, "a") == 4

    asyncio.run(main())


def test_a_paused_sequence_never_expires_in_the_queue(clock: Clock, monkeypatch: Any) -> None:
    async def main() -> None:
        monkeypatch.setattr(engine_module, "TICK_S", 0.001)
        e = slots(2, queue_timeout_s=1.0)
        e.submit([1], params(30), tenant="a")
        clock.t += 1
        seq = e.submit([1], params(30), tenant="a")
        e.stepper.emit(seq.id, "a")
        e.submit([1], params(30), tenant="b", max_wait_s=1e6)
        assert seq.state == "waiting"
        clock.t += 100  # far past any queue timeout
        e._tick_task = asyncio.create_task(e._tick())
        await asyncio.sleep(0.05)
        e._tick_task.cancel()
        assert seq.state == "waiting"
        assert [(d.text, d.error, d.finish_reason) for d in drain(seq)] == [("a", None, None)]  # no 504

    asyncio.run(main())


def test_batch_lines_leave_headroom_and_are_paused_first_for_interactive_callers(clock: Clock) -> None:
    async def main() -> None:
        e = slots(8)
        lines = []
        for _ in range(10):
            lines.append(e.submit([1], params(60), tier=BATCH.rank, tenant="a", max_wait_s=1e6))
            clock.t += 1
        assert held(e, "a", SPARE) == 8 - headroom(8) and e.waiting_count == 3  # one slot kept free
        mine = e.submit([1], params(5), tenant="b")
        # the stepper is told which are batch lines (background rows it may leave out of steps: `step_share`)
        assert e.stepper.background == {line.id: True for line in lines[:7]} | {mine.id: False}
        assert mine.state == "running" and e.admitter.preemptions == 0  # the headroom
        again = e.submit([1], params(5), tenant="a")  # the batch's own tenant, interactive: a line pauses
        assert again.state == "running" and lines[6].state == "waiting" and e.admitter.preemptions == 1
        e.stepper.emit(mine.id, "x!", finished=True)  # a place frees: no batch line takes the headroom back
        assert held(e, "a", SPARE) == 6 and lines[6].state == "waiting"

    asyncio.run(main())


def test_without_a_resumable_stepper_nothing_is_paused(clock: Clock) -> None:
    async def main() -> None:
        e = slots(2, resumable=False)
        a = [e.submit([1], params(5), tenant="a") for _ in range(2)]
        b = e.submit([1], params(5), tenant="b")
        assert b.state == "waiting" and all(s.state == "running" for s in a) and not e.stepper.cancelled

    asyncio.run(main())


def test_a_batch_line_waiting_does_not_fill_the_interactive_queue(clock: Clock) -> None:
    async def main() -> None:
        e = slots(1)
        e.cfg.max_waiting = 3
        for _ in range(4):
            e.submit([1], params(5), tier=BATCH.rank, tenant="a", max_wait_s=1e6)
        with pytest.raises(ApiError):  # the batch queue is full for batch lines
            e.submit([1], params(5), tier=BATCH.rank, tenant="a", max_wait_s=1e6)
        e.submit([1], params(5), tenant="b")  # an interactive caller still gets in

    asyncio.run(main())


def test_beside_interactive_work_batch_lines_are_paused_down_to_their_cap_and_fill_again_after(clock: Clock) -> None:
    async def main() -> None:
        e = slots(8, beside=0.25)  # 2 rows of 8 beside interactive work
        lines = []
        for _ in range(10):
            lines.append(e.submit([1], params(60), tier=BATCH.rank, tenant="a", max_wait_s=1e6))
            clock.t += 1
        assert held(e, "a", SPARE) == 7  # alone: everything but the headroom
        mine = e.submit([1], params(5), tenant="b")
        # the interactive arrival starts at once and the latest started lines are paused down to the cap
        assert mine.state == "running" and held(e, "a", SPARE) == 2 and e.admitter.preemptions == 5
        assert [s.state for s in lines[:2]] == ["running"] * 2 and all(s.state == "waiting" for s in lines[2:])
        assert all(s.state != "done" for s in lines)  # paused, never failed
        e.stepper.emit(lines[0].id, "ab!", finished=True)  # a line ends: another line takes its row, no more
        assert held(e, "a", SPARE) == 2 and e.budget.running == 3
        e.stepper.emit(mine.id, "x!", finished=True)  # b's last sequence ends: it lingers, the cap holds
        e.admitter.admit()
        assert held(e, "a", SPARE) == 2
        again = e.submit([1], params(5), tenant="b")  # a closed loop's next request: nothing to pause
        assert again.state == "running" and e.admitter.preemptions == 5
        e.stepper.emit(again.id, "x!", finished=True)
        clock.t += LINGER_S + 0.01  # b gone for good: batch lines fill all but the headroom again
        e.admitter.admit()
        assert held(e, "a", SPARE) == 7 and e.admitter.preemptions == 5

    asyncio.run(main())


def test_without_pausing_the_cap_holds_back_every_batch_tenants_lines_while_interactive_work_is_there(
    clock: Clock,
) -> None:
    async def main() -> None:
        e = slots(8, beside=0.25, resumable=False)  # nothing can be paused: the cap only holds admission back
        lines = [e.submit([1], params(60), tier=BATCH.rank, tenant=t, max_wait_s=1e6) for t in "acacacacac"]
        assert e.lanes.spare_running() == 7  # 8 slots less the headroom, shared by the two batch tenants
        mine = e.submit([1], params(5), tenant="b")  # the headroom's place
        assert mine.state == "running" and e.lanes.spare_running() == 7
        for line in lines[:2]:
            e.stepper.emit(line.id, "ab!", finished=True)
        assert e.lanes.spare_running() == 5 and e.budget.running == 6  # over the cap: no line takes a freed row
        e.stepper.emit(mine.id, "ab!", finished=True)
        clock.t += LINGER_S + 0.01  # b gone for good: lines fill all but the headroom again, both tenants'
        e.admitter.admit()
        assert e.lanes.spare_running() == 7 and {s.tenant for s in e.running.values()} == {"a", "c"}

    asyncio.run(main())


def test_generation_answers_add_their_prompt_and_tokens_to_the_cost_account(clock: Clock) -> None:
    async def main() -> None:
        e = slots(4)
        done = e.submit([1, 2, 3], params(8), tenant="a")
        line = e.submit([1], params(8), tier=BATCH.rank, tenant="a", max_wait_s=1e6)
        gone = e.submit([1, 2], params(8), tenant="b")
        e.stepper.emit(done.id, "abcd", finished=True)  # 4 tokens + the prompt's 3
        e.stepper.emit(line.id, "ab", finished=True)  # 2 tokens + the prompt's 1
        e.stepper.emit(gone.id, "abc")
        e.cancel(gone)  # a client that hung up: no answer, no cost (as the batcher counts)
        account = e.account.of_tenant("a")
        model = e.cfg.model_id
        assert done.tokens == 4 and account[(model, 1)].inputs == 1 and account[(model, 1)].cost == 3 + 4
        assert account[(model, BATCH.rank)].cost == 1 + 2
        assert e.account.of_tenant("b") == {}
        assert e.stats()["cost_served"]["batch"] == {"inputs": 1, "cost": 3.0}

    asyncio.run(main())
