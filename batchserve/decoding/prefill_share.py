"""Prefill priced and shared: which prompt pieces the slot stepper prefills before its next decode step, and how
many prompt tokens a lane may prefill while another lane's rows decode. Pure policy, no torch.

Why: a prompt's prefill runs between two decode steps, so every decoding sequence waits on it, and on a CPU it is
dear (256 SmolLM2 prompt tokens take over a second against a ~60 ms step). Chunking bounds the size of that wait,
not who pays for it: without sharing, one key's long prompts made another's short chat wait behind their queue.
A chunk small enough to bound a CPU step would be a few tokens and slow a tenant alone too, so the budget applies
only while another lane decodes. The budget lives in the slot stepper: transformers' manager schedules every
request by its own rules, so there only the engine's share of the places holds (`shares.py`).

- **Order.** Pieces go to the lane (as `shares.Lane`) with the fewest prompt tokens charged (`LaneCharges`); a
  lane that starts prefilling begins at the least charge among those prefilling, so time without prefill banks
  nothing; at equal charges the shorter piece first. Interactive lanes go before batch lanes; within a lane,
  oldest first. A piece past the step's budget is cut to the room left, or, with less than `MIN_PIECE` left, ends
  the plan (nothing overtakes it). So a short prompt is prefilled in the next step and two tenants alternate.
- **Priced beside decodes.** While another interactive lane's rows decode, interactive prefill draws on a ledger
  (`PrefillLedger`) that earns `BESIDE_DECODE` x each decode step's measured time and spends each prefill's, so
  the decoding rows' time stays within (1 + `BESIDE_DECODE`) x their steps' time (2x: two equal shares of the
  device). Batch prefill beside interactive rows draws on the batch slowdown ledger (`step_share.StepShare`,
  `--generation-batch-slowdown`) before it runs, so a batch tier's prompts and its rows keep to the one bound.
- **In tokens.** A ledger's seconds become tokens at the learned seconds per prompt token (an EMA; not yet
  measured: one `MIN_PIECE`). A piece is cut to what its pool affords; less than `MIN_PIECE` waits for more
  credit (a forward has a fixed cost).
- **Never starved.** After `MAX_SKIP` steps in a row in which a pool's prefill waited and got nothing, one
  `MIN_PIECE` goes whatever the credit, and is charged (the debt is paid back before more goes).
- With no other lane decoding the step budget alone holds.
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
        """`lanes` have prefill waiting now: a new one starts at their least charge (others are forgotten)."""
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
    """This step's prefill pieces for `prompts` (oldest first), at most `chunk` tokens each and `step_tokens` in
    all (the first piece always goes), in the module doc's order. A lane in `limited` draws on its class's pool in
    `pools` (tokens): a piece is cut to what is left, and none goes from a pool under `MIN_PIECE`."""
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
    """Seconds of prefill lanes may still run beside another lane's decoding rows (a credit)."""

    credit: float = 0.0
    skipped: int = 0  # steps in a row its prefill waited and got nothing

    def earn(self, step_seconds: float) -> None:
        """A decode step of `step_seconds` ran while this ledger's prefill waited beside decoding rows."""
        if step_seconds > 0:
            self.credit = min(self.credit + BESIDE_DECODE * step_seconds, CREDIT_STEPS * BESIDE_DECODE * step_seconds)

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

    def afford(self, seconds: float, skipped: int) -> int:
        """Prompt tokens `seconds` of credit buys: 0 under `MIN_PIECE`, unless starved or unmeasured (`MIN_PIECE`)."""
        if self.per_token is None:
            return MIN_PIECE
        tokens = math.floor(max(0.0, seconds) / self.per_token) if self.per_token > 0 else MIN_PIECE
        if tokens >= MIN_PIECE:
            return tokens
        return MIN_PIECE if skipped >= MAX_SKIP else 0


def limited_lanes(prefilling: Collection[Lane], decoding: Collection[str], first: Lane | None = None) -> set[Lane]:
    """The lanes whose prefill draws on a pool: an interactive lane while another tenant's interactive rows decode
    (`decoding`) or another interactive lane is served first (`first`); a batch lane while any interactive rows
    decode or any interactive prompt is being prefilled."""
    out: set[Lane] = set()
    for lane in prefilling:
        if lane[0] == SPARE:
            if decoding or any(other[0] == INTERACTIVE for other in prefilling):
                out.add(lane)
        elif any(tenant != lane[1] for tenant in decoding) or (first is not None and first != lane):
            out.add(lane)
    return out
