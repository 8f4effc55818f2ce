"""Prefill priced and shared: which prompt pieces the slot stepper prefills before its next decode step, and how
many prompt tokens a lane may prefill while another lane's rows decode. Pure policy, no torch.

Why: a prompt's prefill runs between two decode steps, so every sequence decoding waits on it, and on a CPU it is
dear: 256 prompt tokens of SmolLM2 take over a second against a decode step's ~60 ms. Chunking alone bounded only
the size of that wait (at most the step budget, 256 tokens on a CPU, between two steps, oldest prompt first), not who
paid for it: another key's 1,538-token prompts (`max_tokens` 1) made a short chat wait behind their whole queue
for its own prefill and then on up to 512 of their tokens before each of its tokens (one answer in 20 s, 0.8 s
alone); a chat batch's long prompts did the same through every step the batch ledger let batch rows into (p50
16.2 s), their time charged only after it was spent and forgiven past the ledger's debt floor.

Chosen: a per-step prefill budget, priced in time and shared by lane, on the chunked prefill the stepper already
does (pieces of at most the decoder's chunk, at most `step_tokens` a step). Not chunking alone: it was there, and
a chunk small enough to keep a decode step within a bound on a CPU would be a few tokens, which would also slow a
tenant alone in the engine with nothing to protect; a budget that applies only while another lane decodes costs
nothing then. Not transformers' manager: it chunks to its `max_batch_tokens` but schedules every request in every
step by its own rules, so the budget lives in the slot stepper; with `--generation-engine manager` the engine's
share of the places is all that holds (`shares.py`).

- **Order.** Pieces go to the lane (tenant x interactive/batch, as `shares.Lane`) with the fewest prompt tokens
  charged: each piece prefilled is charged to its lane in tokens (`LaneCharges`); a lane that starts prefilling
  begins at the least charge among those prefilling, so time without prefill banks nothing; at equal charges the
  shorter piece first. Interactive lanes go before batch lanes; within a lane, oldest first. A piece past the
  step's budget is cut to the room left, or, with less than `MIN_PIECE` left, ends the plan (nothing overtakes
  it). So a short prompt is prefilled in the next step, not behind another key's queue of long ones, and two
  tenants prefilling alternate.
- **Priced beside decodes.** While rows of another interactive lane decode, a lane's prefill is time those rows
  wait. Interactive prefill then draws on a ledger (`PrefillLedger`) that earns `BESIDE_DECODE` x each decode
  step's measured time and spends each prefill's measured time: the decoding rows' time in steps and waiting on
  others' prefill stays within (1 + `BESIDE_DECODE`) x their steps' time (2x: the prefilling lanes and the
  decoding ones halve the device, as two equal shares do; another key's long completions cost a CPU step about
  that much too, a second row adds ~66%). Batch prefill beside interactive rows draws on the batch slowdown ledger
  (`step_share.StepShare`, `--generation-batch-slowdown`), before it runs, as batch rows do: what the credit left
  after the coming step affords. So a batch tier's long prompts and its rows together keep to the one bound.
- **In tokens.** A ledger's seconds become tokens at the learned seconds per prompt token (an EMA of measured
  prefills; not yet measured: one `MIN_PIECE` to measure). A piece is cut to what its pool affords; less than
  `MIN_PIECE` waits for more credit (a forward has a fixed cost).
- **Never starved.** After `MAX_SKIP` steps in a row in which a pool's prefill waited and got nothing, one
  `MIN_PIECE` goes whatever the credit, and is charged (the debt is paid back before more goes).
- With no other lane decoding (a tenant alone, or beside batch rows only) the step budget alone holds, as before.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from batchserve.decoding.shares import INTERACTIVE, SPARE, Lane
from batchserve.decoding.step_share import MAX_SKIP

BESIDE_DECODE = 1.0  # another interactive lane's prefill: at most this x the decode steps' time it sits between
MIN_PIECE = 16  # the fewest prompt tokens a budgeted piece carries (fewer waits for more credit)
CREDIT_STEPS = 4  # interactive prefill credit is capped at this many decode steps' earning
EMA_WEIGHT = 0.2  # weight of each new measurement in the seconds per prompt token


@dataclass(frozen=True)
class Piece:
    """The part of one prompt a step prefills: `index` into the prefilling list, tokens [start, start+length)."""

    index: int
    start: int
    length: int
    last: bool  # this piece ends the prompt: its forward draws the sequence's first token


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt being prefilled, as the plan sees it: its lane, and tokens done of its length."""

    lane: Lane
    done: int
    total: int


@dataclass
class LaneCharges:
    """Prompt tokens prefilled by each lane that has prefill waiting (see the module's doc: Order)."""

    tokens: dict[Lane, float] = field(default_factory=dict)

    def present(self, lanes: Collection[Lane]) -> None:
        """`lanes` have prefill waiting now: a lane new to it starts at the least charge among them (others
        forgotten)."""
        kept = {lane: self.tokens[lane] for lane in lanes if lane in self.tokens}
        floor = min(kept.values(), default=0.0)
        self.tokens = {lane: kept.get(lane, floor) for lane in lanes}

    def charge(self, lane: Lane, tokens: int) -> None:
        self.tokens[lane] = self.tokens.get(lane, 0.0) + tokens


def plan_prefill(
    prompts: Sequence[Prompt],
    step_tokens: int,
    chunk: int,
    charged: Mapping[Lane, float] | None = None,
    pools: Mapping[int, int] | None = None,
    limited: Collection[Lane] = (),
) -> list[Piece]:
    """This step's prefill pieces for `prompts` (oldest first): each prompt's next `chunk` tokens at most, taken
    lane by lane, the lane with the least `charged` (plus what this plan gives it) first (at equal charges the
    shorter piece), interactive lanes before batch ones, within a lane oldest first, while their sum stays
    within `step_tokens` (the first piece always goes; one past it is cut to the room left, and one that cannot
    keep `MIN_PIECE` ends the plan). A lane in `limited` draws on its class's pool in `pools` (tokens): a piece
    is cut to what is left of it, and none goes from a pool under `MIN_PIECE`."""
    charges = dict(charged or {})
    left = dict(pools or {})
    heads: dict[Lane, list[int]] = {}
    for index, p in enumerate(prompts):
        if p.total > p.done:
            heads.setdefault(p.lane, []).append(index)
    pieces: list[Piece] = []
    used = 0
    while heads:
        lane = min(heads, key=lambda ln: _rank(ln, heads[ln][0], prompts, charges, chunk))
        index = heads[lane].pop(0)
        if not heads[lane]:
            del heads[lane]
        p = prompts[index]
        want = min(max(1, chunk), p.total - p.done)
        least = min(want, MIN_PIECE)  # a piece cut shorter than this waits (a forward has a fixed cost)
        if lane in limited and left.get(lane[0], 0) < least:  # that pool is spent: its lanes wait
            for other in [ln for ln in heads if ln in limited and ln[0] == lane[0]]:
                del heads[other]
            continue
        n = min(want, left[lane[0]]) if lane in limited else want
        if pieces and used + n > step_tokens:
            n = step_tokens - used  # cut to the step's room; too little ends the plan (nothing overtakes it)
            if n < least:
                break
        if lane in limited:
            left[lane[0]] -= n
        pieces.append(Piece(index, p.done, n, p.done + n == p.total))
        used += n
        charges[lane] = charges.get(lane, 0.0) + n
    return pieces


def _rank(lane: Lane, head: int, prompts: Sequence[Prompt], charges: Mapping[Lane, float], chunk: int) -> tuple:
    """Where a lane's next piece (of `prompts[head]`) stands in the plan's order: lower first."""
    p = prompts[head]
    return (lane[0], charges.get(lane, 0.0), min(max(1, chunk), p.total - p.done), head)


def first_lane(prompts: Sequence[Prompt], charges: Mapping[Lane, float], chunk: int) -> Lane | None:
    """The interactive lane `plan_prefill` serves first (the one charged least), or None."""
    heads: dict[Lane, int] = {}
    for index, p in enumerate(prompts):
        if p.total > p.done and p.lane[0] == INTERACTIVE:
            heads.setdefault(p.lane, index)
    return min(heads, key=lambda ln: _rank(ln, heads[ln], prompts, charges, chunk), default=None)


@dataclass
class PrefillLedger:
    """Seconds of prefill that lanes may still run beside another lane's decoding rows (a credit), and the
    learned seconds per prompt token that turns it into tokens (see the module's doc)."""

    beside: float = BESIDE_DECODE
    credit: float = 0.0
    skipped: int = 0  # steps in a row its prefill waited and got nothing

    def earn(self, step_seconds: float) -> None:
        """A decode step of `step_seconds` ran while this ledger's prefill waited beside decoding rows."""
        if step_seconds > 0:
            self.credit = min(self.credit + self.beside * step_seconds, CREDIT_STEPS * self.beside * step_seconds)

    def spend(self, seconds: float) -> None:
        self.credit -= seconds


@dataclass
class TokenRate:
    """Seconds per prompt token of prefill, learned from measured prefills (an EMA)."""

    per_token: float | None = None

    def measured(self, seconds: float, tokens: int) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate = seconds / tokens
        self.per_token = rate if self.per_token is None else self.per_token + EMA_WEIGHT * (rate - self.per_token)

    def afford(self, seconds: float, skipped: int, max_skip: int = MAX_SKIP) -> int:
        """Prompt tokens that `seconds` of credit buys: 0 under `MIN_PIECE` (it waits) unless the pool has waited
        `max_skip` steps in a row, then `MIN_PIECE`; not yet measured, `MIN_PIECE` to measure it."""
        if self.per_token is None:
            return MIN_PIECE
        tokens = math.floor(max(0.0, seconds) / self.per_token) if self.per_token > 0 else MIN_PIECE
        if tokens >= MIN_PIECE:
            return tokens
        return MIN_PIECE if skipped >= max_skip else 0


def limited_lanes(prefilling: Collection[Lane], decoding: Collection[str], first: Lane | None = None) -> set[Lane]:
    """Of the lanes with prefill waiting, those whose prefill draws on a pool: an interactive lane while another
    tenant's interactive rows decode (`decoding`: their tenants) or another interactive lane is served first
    (`first`: the lane charged least, whose sequence's first token would otherwise wait on this one's piece);
    a batch lane while any interactive rows decode or any interactive prompt is being prefilled."""
    out: set[Lane] = set()
    for lane in prefilling:
        if lane[0] == SPARE:
            if decoding or any(other[0] == INTERACTIVE for other in prefilling):
                out.add(lane)
        elif any(tenant != lane[1] for tenant in decoding) or (first is not None and first != lane):
            out.add(lane)
    return out
