"""KV-cache capacity as the admission resource of generation.

A sequence is admitted to the engine only when its worst case fits: ceil((prompt + max_tokens) / page_size)
cache blocks, and one of `max_seqs` sequence slots. Reserving the worst case up front means the library's
scheduler never runs out of blocks mid-generation (it would otherwise offload and re-prefill sequences, or stop),
so once a sequence starts it runs at full speed to its end. Sequences that do not fit wait, highest tier first.

`predicted_wait_s` answers "when would a new sequence start?" by replaying the future: running sequences free
their blocks after their remaining tokens (at the measured time per decode step, an upper bound since EOS only
ends them sooner), and the sequences queued ahead are admitted in order before the new one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass
class KvBudget:
    total_blocks: int
    page_size: int
    max_seqs: int
    used_blocks: int = 0
    running: int = 0

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.page_size))

    def fits(self, blocks: int, spare_blocks: int = 0, spare_seqs: int = 0) -> bool:
        """Whether `blocks` more fit, leaving `spare_blocks` and `spare_seqs` free (batch lines' headroom)."""
        return (
            self.running + 1 + spare_seqs <= self.max_seqs
            and self.used_blocks + blocks + spare_blocks <= self.total_blocks
        )

    def take(self, blocks: int) -> None:
        self.used_blocks += blocks
        self.running += 1

    def give(self, blocks: int) -> None:
        self.used_blocks -= blocks
        self.running -= 1

    @property
    def reserved_ratio(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Claim:
    """One sequence as the predictor sees it: the blocks it holds or needs, and the decode steps it has left."""

    blocks: int
    steps: int


class Replay:
    """The future as `predicted_wait_s` replays it, kept so that the queue's next arrival continues it instead of
    replaying every sequence ahead again (a burst of n queued arrivals would cost n^2/2 placements)."""

    def __init__(self, budget: KvBudget, running: list[Claim], step_s: float) -> None:
        self.total_blocks = budget.total_blocks
        self.free_blocks = budget.total_blocks - budget.used_blocks
        self.free_slots = budget.max_seqs - budget.running
        self.ends = [(c.steps * step_s, c.blocks) for c in running]  # (time it frees its blocks, blocks): a heap
        heapq.heapify(self.ends)
        self.step_s = step_s
        self.now = 0.0
        self.stuck = False  # a claim could never start: so could none after it

    def place(self, claim: Claim, commit: bool = True) -> float:
        """When `claim` starts, after everything placed before it; `commit` False leaves the replay as it was."""
        if self.stuck or claim.blocks > self.total_blocks:
            self.stuck = self.stuck or commit
            return math.inf
        freed: list[tuple[float, int]] = []
        free_blocks, free_slots, now = self.free_blocks, self.free_slots, self.now
        while free_blocks < claim.blocks or free_slots < 1:
            if not self.ends:
                now = math.inf
                break
            end = heapq.heappop(self.ends)
            freed.append(end)
            now = max(now, end[0])
            free_blocks += end[1]
            free_slots += 1
        if not commit or now == math.inf:
            for end in freed:
                heapq.heappush(self.ends, end)
            self.stuck = commit and now == math.inf
            return now
        self.free_blocks, self.free_slots, self.now = free_blocks - claim.blocks, free_slots - 1, now
        heapq.heappush(self.ends, (now + claim.steps * self.step_s, claim.blocks))
        return now


def predicted_wait_s(budget: KvBudget, running: list[Claim], ahead: list[Claim], need: Claim, step_s: float) -> float:
    """Seconds until `need` would be admitted, after every claim in `ahead` (in queue order)."""
    replay = Replay(budget, running, step_s)
    for claim in ahead:
        replay.place(claim)
    return replay.place(need)
