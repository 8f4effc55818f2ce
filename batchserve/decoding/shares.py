"""How the generation engine shares its KV capacity between tenants and tiers: pure policy, no I/O.

Why: in plain arrival order one tenant's long chats, or a batch's lines, can hold every slot and lock others out.
So capacity is shared by lane, and a running sequence may be paused (preempted) to honour the shares.

- A **lane** is a tenant in a class: `INTERACTIVE` (every tier a key may have) or `SPARE` (the `batch` tier, the
  lines of batch jobs). A tenant's interactive work and its batch lines are two lanes.
- The **cost** counted is KV capacity held now: slots with the slot stepper, KV blocks with the manager (a
  sequence reserves its worst case, prompt + max_tokens, when it starts, so blocks held is what it costs the
  others while it runs; over time this is slot-seconds).
- **Shares**: the interactive lanes with work (running or waiting) split all the capacity, in proportion to their
  weight (the tier table's `weight` if it has one, else 1 each: equal shares); one alone may use it all. The
  spare lanes split what the interactive lanes leave, less a headroom (`BATCH_HEADROOM`) kept free so an
  interactive arrival starts at once.
- **Order**: the next sequence admitted is of the lane furthest under its share, read as (held + this
  sequence's blocks) / share; interactive lanes before spare ones; ties by tier, then arrival.
- **Lingering**: an interactive lane whose last sequence just ended keeps its share, and one free place, for
  `LINGER_S`, so a closed-loop client's next request finds its place free instead of pausing someone again. Only
  a lane under its share may take a kept place; past `LINGER_S` it goes to whoever waits.
- **Rows beside interactive work** (`batch_row_cap`): while any interactive lane has work or lingers, the spare
  lanes together hold at most a fraction of the places (`--generation-batch-beside-interactive`, at least one
  row, so every batch line progresses): on a CPU a step's time grows with its rows, and every interactive token
  waits on that step. The slot stepper holds `--generation-batch-slowdown` by leaving batch rows out of some
  steps (`step_share.py`); a stepper that cannot (the manager) keeps batch lines to fewer rows where rows are
  dear (`rows_within_slowdown`). Spare lanes over the cap when interactive work arrives are paused down to it
  (`batch_excess`).
- **Preemption** (`victim_lane`): an interactive sequence that cannot start pauses a spare-lane sequence if one
  runs; otherwise a sequence of a lane under its share pauses one of the lane furthest over its share, if that
  lane stays at least as far along its share as the taker becomes (so two lanes never trade a slot back and
  forth). Within a lane the victim is its lowest-priority tier, most recently (re)started: the least work to
  recompute.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from batchserve.core.tiers import TIERS

INTERACTIVE, SPARE = 0, 1
BATCH_HEADROOM = 0.125  # share of the capacity spare-lane (batch) work leaves free for interactive arrivals
LINGER_S = 1.0  # an interactive lane keeps its share (and one free place) this long after its last sequence ends
BATCH_BESIDE_INTERACTIVE = 0.25  # of the places, the most batch lines hold while interactive work is there
TINY_SHARE = 1e-9  # a lane left no share at all (spare lanes while interactive work fills everything)

Lane = tuple[int, str]  # (INTERACTIVE or SPARE, tenant)


def lane_of(tenant: str, tier: int) -> Lane:
    """The lane of a sequence: its tenant, in the class of its tier."""
    spare = 0 <= tier < len(TIERS) and not TIERS[tier].interactive
    return (SPARE if spare else INTERACTIVE, tenant)


def tier_weight(tier: int) -> float:
    """A tier's weight in the shares: the tier table's `weight` where it has one, else 1."""
    if 0 <= tier < len(TIERS):
        return float(getattr(TIERS[tier], "weight", 1.0))
    return 1.0


WEIGHTED = len({tier_weight(rank) for rank in range(len(TIERS))}) > 1  # else every lane weighs 1: skip the look


def headroom(total: int) -> int:
    """Of `total` blocks (or sequences), how many spare-lane work leaves free: at least one when there are two."""
    return math.ceil(total * BATCH_HEADROOM) if total > 1 else 0


def batch_row_cap(places: int, fraction: float) -> int:
    """The most decode rows the spare lanes may hold beside interactive work: `fraction` of `places` rounded down,
    at least 1; a fraction of 1 or more: no cap."""
    if fraction >= 1:
        return places
    return max(1, min(places, math.floor(places * max(0.0, fraction))))


def rows_within_slowdown(row_growth: float, slowdown: float, places: int) -> int:
    """The most batch rows that keep an interactive row's step within `slowdown` x its time alone, each row
    lengthening a step by `row_growth`: at least 1, `places` where rows cost nothing measurable."""
    if row_growth <= 0:
        return places
    return max(1, min(places, math.floor((slowdown - 1) / row_growth + 1e-9)))


def batch_excess(spare_running: int, cap: int, interactive: bool) -> int:
    """How many running batch lines to pause now: those over `cap` while interactive work is there, else none."""
    return max(0, spare_running - cap) if interactive else 0


@dataclass(frozen=True, slots=True)
class LaneLoad:
    """A lane with work, as the shares see it."""

    held: int  # blocks (slots) its running sequences hold
    weight: float = 1.0


def shares(lanes: dict[Lane, LaneLoad], total: int) -> dict[Lane, float]:
    """Each lane's share of `total` blocks (module doc: Shares)."""
    interactive = {lane: load for lane, load in lanes.items() if lane[0] == INTERACTIVE}
    spare = {lane: load for lane, load in lanes.items() if lane[0] == SPARE}
    weights = sum(load.weight for load in interactive.values())
    out = {lane: total * load.weight / weights for lane, load in interactive.items()}
    room = max(0, total - headroom(total) - sum(load.held for load in interactive.values()))
    weights = sum(load.weight for load in spare.values())
    return out | {lane: max(TINY_SHARE, room * load.weight / weights) for lane, load in spare.items()}


def use(held: float, share: float) -> float:
    """How far along its share a lane holding `held` is (1 = exactly its share)."""
    return held / max(share, TINY_SHARE)


def victim_lane(
    taker: Lane, blocks: int, lanes: dict[Lane, LaneLoad], share: dict[Lane, float], running: dict[Lane, int]
) -> Lane | None:
    """The lane to pause a sequence of so that `taker`'s next sequence (of `blocks`) can start, or None.
    `running`: lanes with running sequences -> the blocks of the one that lane would give up first."""
    if taker[0] == INTERACTIVE:
        spare = [lane for lane in running if lane[0] == SPARE]
        if spare:  # interactive work goes before batch lines: the spare lane furthest over its share pays
            return max(spare, key=lambda lane: (use(lanes[lane].held, share[lane]), lane[1]))
    held = lanes[taker].held if taker in lanes else 0
    if held >= share.get(taker, 0.0):
        return None  # at or over its share: it waits for a place to free
    after = use(held + blocks, share[taker])
    best: Lane | None = None
    for lane, give in running.items():
        if lane == taker or lane[0] != taker[0]:
            continue
        load = lanes[lane]
        if load.held <= share[lane] or use(load.held - give, share[lane]) < after:
            continue  # within its share, or would end up further under it than the taker: no gain in fairness
        if best is None or use(load.held, share[lane]) > use(lanes[best].held, share[best]):
            best = lane
    return best


def order_key(lane: Lane, held: float, share: float, blocks: int, tier: int, order: int) -> tuple[int, float, int, int]:
    """Where a lane's next waiting sequence (of `blocks`, after `held` held or queued ahead of it in its lane; then
    its tier and arrival `order`) stands in the admission order: lower first."""
    return (lane[0], use(held + blocks, share), tier, order)


@dataclass(frozen=True, slots=True)
class Queued:
    """A waiting sequence as the replay sees it: its blocks, the decode steps it will take, and its place."""

    blocks: int
    steps: int
    tier: int
    order: int


def replay_wait(
    free_blocks: int,
    free_seqs: int,
    running: list[tuple[Lane, int, float]],
    queues: dict[Lane, list[Queued]],
    share: dict[Lane, float],
    held: dict[Lane, int],
    target: Queued,
    step_s: float,
) -> float:
    """Seconds until `target` (in one of `queues`) would start, replaying admission as it will run as places free
    up (`running`: (lane, blocks, seconds left)), so a tenant under its share is seen to take the places its own
    short sequences free rather than wait behind a hog's queue. inf: it never fits."""
    ends = [(left, blocks, lane) for lane, blocks, left in running]
    heapq.heapify(ends)
    holding = dict(held)
    heads = {lane: 0 for lane, queue in queues.items() if queue}
    now = 0.0

    def rank(lane: Lane) -> tuple[int, float, int, int]:
        head = queues[lane][heads[lane]]
        return order_key(lane, holding.get(lane, 0), share.get(lane, TINY_SHARE), head.blocks, head.tier, head.order)

    while heads:
        lane = min(heads, key=rank)
        nxt = queues[lane][heads[lane]]
        if free_blocks < nxt.blocks or free_seqs < 1:  # the next place to free; then who is furthest under again
            if not ends:
                return math.inf
            end, blocks, owner = heapq.heappop(ends)
            now = max(now, end)
            free_blocks, free_seqs = free_blocks + blocks, free_seqs + 1
            holding[owner] = holding.get(owner, 0) - blocks
            continue
        if nxt is target:
            return now
        free_blocks, free_seqs = free_blocks - nxt.blocks, free_seqs - 1
        holding[lane] = holding.get(lane, 0) + nxt.blocks
        heapq.heappush(ends, (now + nxt.steps * step_s, nxt.blocks, lane))
        heads[lane] += 1
        if heads[lane] == len(queues[lane]):
            del heads[lane]
    return math.inf
