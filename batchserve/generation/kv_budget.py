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

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.page_size

    def fits(self, blocks: int) -> bool:
        return self.running < self.max_seqs and self.used_blocks + blocks <= self.total_blocks

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


def predicted_wait_s(budget: KvBudget, running: list[Claim], ahead: list[Claim], need: Claim,
                     step_s: float) -> float:
    """Seconds until `need` would be admitted, after every claim in `ahead` (in queue order)."""
    free_blocks = budget.total_blocks - budget.used_blocks
    free_slots = budget.max_seqs - budget.running
    ends = [(c.steps * step_s, c.blocks) for c in running]  # (time it frees its blocks, blocks)
    heapq.heapify(ends)
    now = 0.0
    for claim in [*ahead, need]:
        if claim.blocks > budget.total_blocks:
            return math.inf
        while free_blocks < claim.blocks or free_slots < 1:
            if not ends:
                return math.inf
            ends_at, blocks = heapq.heappop(ends)
            now = max(now, ends_at)
            free_blocks += blocks
            free_slots += 1
        free_blocks -= claim.blocks
        free_slots -= 1
        heapq.heappush(ends, (now + claim.steps * step_s, claim.blocks))
    return now
