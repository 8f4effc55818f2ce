"""Prefill priced and shared (`prefill_share.py`): the per-step plan by lane, and the slot stepper driven turn by
turn over a stand-in decoder on an injected clock (a decode step 60 ms, 5 ms a prompt token: this CPU's
proportions), so a long prompt's effect on another tenant's short chat is counted in steps and in the clock's
seconds, never in wall time. The decoder prefilling in pieces on a model is
tests/integration/decoding/test_sizing.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.decoding.prefill_share import (
    BESIDE_DECODE,
    MIN_PIECE,
    LaneCharges,
    Piece,
    PrefillLedger,
    Prompt,
    TokenRate,
    limited_lanes,
    plan_prefill,
)
from batchserve.decoding.shares import INTERACTIVE, SPARE
from batchserve.decoding.slot_decoder import LaunchedStep
from batchserve.decoding.slot_map import Join
from batchserve.decoding.slot_stepper import Pending, SlotStepper
from batchserve.decoding.step_share import MAX_SKIP
from batchserve.decoding.stepper import SamplingParams, TokenUpdate

A, B = (INTERACTIVE, "a"), (INTERACTIVE, "b")
BATCH_A = (SPARE, "a")
STEP_S, TOKEN_S = 0.060, 0.005  # a one-row decode step; a prompt token of prefill
ROW_S = 0.040  # each further row of a decode step
LONG, SHORT, CHAT_TOKENS = 1538, 8, 20  # the long prompts; a short chat's prompt and answer


def one_lane(progress: list[tuple[int, int]]) -> list[Prompt]:
    return [Prompt(A, done, total) for done, total in progress]


def test_one_lane_keeps_order_and_the_step_budget() -> None:
    # (tokens done, prompt length), oldest first; a step of 100 tokens, pieces of 40
    got = plan_prefill(one_lane([(0, 30), (0, 90), (40, 90), (0, 10)]), 100, 40)
    # 30 + 40, and the next piece cut to the 30 left of the step
    assert got == [Piece(0, 0, 30, True), Piece(1, 0, 40, False), Piece(2, 40, 30, False)]
    assert plan_prefill(one_lane([(80, 90), (0, 10)]), 100, 40) == [Piece(0, 80, 10, True), Piece(1, 0, 10, True)]
    # one piece always goes, even over a budget smaller than a chunk
    assert plan_prefill(one_lane([(0, 500)]), 64, 128) == [Piece(0, 0, 128, False)]
    # a piece that cannot keep MIN_PIECE ends the plan: later, shorter pieces do not overtake it
    assert plan_prefill(one_lane([(0, 90), (0, 60), (0, 5)]), 100, 90) == [Piece(0, 0, 90, True)]
    assert plan_prefill([], 100, 40) == []
    # a prompt of n tokens in pieces of c takes ceil(n / c) steps when alone
    steps, done = 0, 0
    while done < 130:
        (piece,) = plan_prefill(one_lane([(done, 130)]), 1000, 40)
        done, steps = piece.start + piece.length, steps + 1
    assert steps == 4


def test_the_lane_with_fewer_prompt_tokens_charged_goes_first_interactive_before_batch() -> None:
    prompts = [Prompt(A, 0, 500), Prompt(A, 0, 500), Prompt(BATCH_A, 0, 8), Prompt(B, 0, 8)]
    # a's two prompts came first, but b has been charged less: b's piece goes, then a's (the step holds 520)
    got = plan_prefill(prompts, 520, 512, {A: 1000.0, B: 0.0})
    assert got == [Piece(3, 0, 8, True), Piece(0, 0, 500, True)]
    # equal charges: the shorter piece first; the batch lane's goes last, when the step has room
    got = plan_prefill(prompts, 2000, 512, {A: 0.0, B: 0.0})
    assert [p.index for p in got] == [3, 0, 1, 2]


def test_a_limited_lane_takes_only_its_pool_and_an_empty_pool_holds_its_lanes() -> None:
    prompts = [Prompt(A, 0, 500), Prompt(B, 0, 40)]
    got = plan_prefill(prompts, 512, 512, {A: 0.0, B: 10.0}, {INTERACTIVE: 24}, {A})
    assert got == [Piece(0, 0, 24, False), Piece(1, 0, 40, True)]  # a cut to its 24 tokens; b is not limited
    got = plan_prefill(prompts, 512, 512, {A: 0.0, B: 10.0}, {INTERACTIVE: MIN_PIECE - 1}, {A})
    assert got == [Piece(1, 0, 40, True)]  # under MIN_PIECE: a waits for more credit


def test_charges_start_a_new_lane_at_the_least_charge_of_those_prefilling() -> None:
    charges = LaneCharges()
    charges.present({A})
    charges.charge(A, 3000)
    charges.present({A, B})
    assert charges.tokens == {A: 3000, B: 3000}  # b's idle time banked nothing
    charges.charge(B, 8)
    charges.present({B})
    assert charges.tokens == {B: 3008}


def test_limited_lanes_are_those_beside_another_tenants_decoding_rows() -> None:
    assert limited_lanes({A, B, BATCH_A}, decoding={"b"}) == {A, BATCH_A}
    assert limited_lanes({A, BATCH_A}, decoding={"a"}) == {BATCH_A}  # its own rows: a alone is not held back
    assert limited_lanes({A}, decoding=set()) == set()
    # nothing decodes: the lane served first is not held back, the others (and batch prompts) are
    assert limited_lanes({A, B, BATCH_A}, decoding=set(), first=B) == {A, BATCH_A}
    assert limited_lanes({BATCH_A}, decoding=set()) == set()


def test_the_ledger_and_the_rate_turn_decode_time_into_prompt_tokens() -> None:
    ledger, rate = PrefillLedger(), TokenRate()
    assert rate.afford(0.0, 0) == MIN_PIECE  # not measured yet: one piece to measure
    rate.measured(0.08, 16)
    ledger.earn(STEP_S)
    assert rate.afford(ledger.credit, 0) == 0  # 60 ms of credit at 5 ms a token: 12, under MIN_PIECE
    ledger.earn(STEP_S)
    assert rate.afford(ledger.credit, 0) == 24
    ledger.spend(0.2)
    assert rate.afford(ledger.credit, 0) == 0 and rate.afford(ledger.credit, MAX_SKIP) == MIN_PIECE
    for _ in range(100):
        ledger.earn(STEP_S)
    assert ledger.credit == 4 * BESIDE_DECODE * STEP_S  # capped: an idle stretch banks no burst


# -- the slot stepper, turn by turn --------------------------------------------------------------------------


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimDecoder:
    """What the stepper asks of a SlotDecoder, with costs on the injected clock: a prefill `TOKEN_S` a prompt
    token, a decode step `STEP_S` plus `ROW_S` a further row. Each slot makes tokens up to its max_tokens."""

    clock: Clock
    slots: int = 8
    slot_tokens: int = 2048
    prefill_tokens: int = 512
    chunk_tokens: int = 512
    fixed_shapes: bool = False
    use_graphs: bool = False
    device: str = "cpu"
    row_growth: float = 0.0
    step_times: dict[int, float] = field(default_factory=dict)
    made: dict[int, int] = field(default_factory=dict)  # slot -> tokens made
    limit: dict[int, int] = field(default_factory=dict)  # slot -> max_tokens
    prefilled: list[tuple[str, int]] = field(default_factory=list)  # (lane's tenant, tokens) of each piece
    launched: list[tuple[int, float]] = field(default_factory=list)  # (rows, clock at launch)

    def shape(self, rows: int, span: int) -> tuple[int, int]:
        return rows, span

    def prefill_fits(self, joins: int, width: int, continued: bool = False) -> bool:
        return joins * width <= self.prefill_tokens

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[SamplingParams],
        starts: list[int],
        last: list[bool],
    ) -> tuple[list[int], list[bool]]:
        self.clock.now += TOKEN_S * sum(len(p) for p in prompts)
        done = []
        for slot, prompt, q, end in zip(slots, prompts, params, last):
            self.prefilled.append((chr(prompt[0]), len(prompt)))
            if end:
                self.made[slot], self.limit[slot] = 1, q.max_tokens
            done.append(not end or q.max_tokens <= 1)
        return [0] * len(slots), done

    def launch(self, rows: int, span: int, sampling: bool) -> LaunchedStep:
        seconds = STEP_S + ROW_S * (rows - 1)
        self.launched.append((rows, self.clock.now))
        self.clock.now += seconds
        for slot in range(rows):
            if slot in self.made:
                self.made[slot] += 1
        return LaunchedStep(rows, 0, seconds=seconds)

    @staticmethod
    def step_seconds(ticket: LaunchedStep) -> float:
        return ticket.seconds

    def collect(self, ticket: LaunchedStep) -> tuple[list[int], list[bool]]:
        rows = range(ticket.rows)
        return [0] * ticket.rows, [slot in self.made and self.made[slot] >= self.limit[slot] for slot in rows]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.made.pop(slot, None)

    def move(self, sources: list[int], targets: list[int], span: int) -> None:
        for s, t in zip(sources, targets):
            self.made[t], self.limit[t] = self.made.pop(s), self.limit.pop(s)

    def swap(self, a: int, b: int, span: int) -> None:
        self.made[a], self.made[b] = self.made[b], self.made[a]
        self.limit[a], self.limit[b] = self.limit[b], self.limit[a]


@dataclass
class Chat:
    """The short chat timed: the clock and the step count when it joined and when its last token came."""

    joined: float = 0.0
    joined_step: int = 0
    ended: float | None = None
    ended_step: int = 0


def drive(long_from: str | None, long_background: bool = False, turns: int = 400) -> tuple[SlotStepper, Chat]:
    """Tenant b's short chat (SHORT prompt tokens, CHAT_TOKENS tokens) joins a stepper in which tenant `long_from`
    keeps four LONG-token prompts with max_tokens 1 waiting (a new one joins as each ends; background: the batch
    tier), or alone (None). Turn by turn, as the stepper's thread runs them."""
    clock = Clock()
    dec = SimDecoder(clock)
    stepper = SlotStepper(dec, step_s=STEP_S, join_batch=1, clock=clock)  # type: ignore[arg-type]
    one = SamplingParams(max_tokens=1, temperature=0)
    made = 0

    def long_join() -> Join:
        nonlocal made
        made += 1
        return Join(f"long{made}", [ord("a")] * LONG, one, stepper.steps, long_background, "a")

    joins = [long_join() for _ in range(4)] if long_from else []
    pending: Pending | None = None
    if joins:  # the long prompts are under way when the chat arrives
        _, pending = stepper._turn([], joins, pending)
        joins = []
    chat = Chat(clock.now, stepper.steps)
    joins.append(Join("chat", [ord("b")] * SHORT, SamplingParams(max_tokens=CHAT_TOKENS, temperature=0), 0, False, "b"))
    for _ in range(turns):
        updates: list[TokenUpdate]
        updates, pending = stepper._turn([], joins, pending)
        joins = [long_join() for u in updates if u.finished and u.seq_id.startswith("long")] if long_from else []
        if any(u.seq_id == "chat" and u.finished for u in updates):
            chat.ended, chat.ended_step = clock.now, stepper.steps
            break
    assert chat.ended is not None, "the short chat never finished"
    return stepper, chat


def test_another_tenants_long_prompts_hold_a_short_chat_within_the_bound() -> None:
    # (a) Alone the chat takes its 8-token prefill and 19 decode steps. Beside another key's 1,538-token
    # prompts it is prefilled first (b is charged less), decodes in every step, and each of its steps waits on at
    # most BESIDE_DECODE x the steps' time of a's prefill (plus one forced MIN_PIECE): within 2x its time alone.
    # Before, its prefill queued behind a's (oldest first) and each step waited on up to 512 of a's tokens.
    _, alone = drive(None)
    stepper, beside = drive("a")
    alone_s, beside_s = alone.ended - alone.joined, beside.ended - beside.joined  # type: ignore[operator]
    assert alone.ended_step - alone.joined_step == CHAT_TOKENS - 1
    assert beside.ended_step - beside.joined_step == CHAT_TOKENS - 1  # in every step: no step lost to a's prefill
    assert beside_s <= (1 + BESIDE_DECODE) * alone_s + MIN_PIECE * TOKEN_S, (alone_s, beside_s)
    assert stepper.charges.tokens[A] > 0  # a's prefill went on meanwhile, in what the ledger afforded


def test_a_batch_tiers_long_prompts_count_against_the_batch_slowdown() -> None:
    # (b) The same prompts from the batch tier: their prefill beside the interactive chat draws on the slowdown
    # ledger, as batch rows do, so the chat keeps within --generation-batch-slowdown (1.25) of its time alone,
    # give or take one forced MIN_PIECE. Before, batch prefill ran a whole step budget (512 tokens) in any step
    # the ledger let batch rows into, and only then was charged.
    _, alone = drive(None)
    stepper, beside = drive("a", long_background=True)
    alone_s, beside_s = alone.ended - alone.joined, beside.ended - beside.joined  # type: ignore[operator]
    assert beside.ended_step - beside.joined_step == CHAT_TOKENS - 1
    assert beside_s <= stepper.share.slowdown * alone_s + MIN_PIECE * TOKEN_S, (alone_s, beside_s)
    assert stepper.charges.tokens.get(BATCH_A, 0) > 0  # batch prefill still moved (never starved)


def test_prompt_tokens_are_charged_to_the_tenant_that_sent_them() -> None:
    # (c) Every prompt token prefilled is charged to its lane: a's 1,538-token prompts and b's 8 tokens. The
    # charges are what orders the next step's pieces (the lane charged least first).
    clock = Clock()
    dec = SimDecoder(clock)
    stepper = SlotStepper(dec, step_s=STEP_S, join_batch=1, clock=clock)  # type: ignore[arg-type]
    one = SamplingParams(max_tokens=1, temperature=0)
    joins = [Join(f"long{i}", [ord("a")] * LONG, one, 0, False, "a") for i in range(2)]
    joins.append(Join("chat", [ord("b")] * SHORT, one, 0, False, "b"))
    pending = None
    for _ in range(10):
        _, pending = stepper._turn([], joins, pending)
        joins = []
        if stepper.charges.tokens == {}:
            break
    assert [tenant for tenant, _ in dec.prefilled][:2] == ["b", "a"]  # b's short prompt first, then a's
    assert sum(n for tenant, n in dec.prefilled if tenant == "a") == 2 * LONG
    charged = LaneCharges()
    stepper.charges = charged  # watched from a fresh start: b arrives while a's next long prompt is half done
    joins = [Join("long9", [ord("a")] * LONG, one, 0, False, "a")]
    _, pending = stepper._turn([], joins, pending)
    assert charged.tokens == {A: 512}
    _, pending = stepper._turn([], [Join("chat2", [ord("b")] * SHORT, one, 0, False, "b")], pending)
    # b joined at a's charge and paid its 8 tokens; a, no longer served first, waited for credit
    assert charged.tokens == {A: 512, B: 512 + SHORT}
