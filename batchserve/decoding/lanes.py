"""The generation engine's books: who waits and who runs, by lane, and the KV blocks each lane holds.

The engine decides (admit, pause, finish) and the stepper runs; this keeps the counts both read, so that every
place a sequence enters or leaves them is one method here (`queue`, `pop`, `unqueue`, `run`, `unrun`). The lanes,
their shares and lingering are `shares.py`'s policy; this applies it to what is queued and running now.
"""

from __future__ import annotations

import heapq
import time

from batchserve.decoding.kv_budget import KvBudget
from batchserve.decoding.sequence import EngineSequence
from batchserve.decoding.shares import LINGER_S, SPARE, WEIGHTED, Lane, LaneLoad, shares, tier_weight

Waiting = tuple[int, int, EngineSequence]  # (tier, arrival order, sequence): a lane's queue is a heap of these


def victim_order(seq: EngineSequence) -> tuple[int, float, int]:
    """Within a lane, the sequence paused first is the greatest: lowest-priority tier, latest (re)started."""
    return (seq.tier, seq.run_started, seq.order)


class LaneBooks:
    """Waiting sequences in a heap per lane, running ones by run id (`EngineSequence.run_id`) and by lane, the
    blocks each lane holds, and the interactive lanes lingering after their last sequence (`shares.LINGER_S`)."""

    def __init__(self, budget: KvBudget) -> None:
        self.budget = budget
        self.running: dict[str, EngineSequence] = {}
        self.queues: dict[Lane, list[Waiting]] = {}
        self.waiting_count = 0
        self.lane_running: dict[Lane, dict[str, EngineSequence]] = {}
        self.lane_held: dict[Lane, int] = {}
        self.idle_since: dict[Lane, float] = {}

    @property
    def waiting(self) -> list[Waiting]:
        """Every waiting sequence as (tier, arrival order, sequence), in no particular order."""
        return [entry for queue in self.queues.values() for entry in queue]

    def interactive_waiting(self) -> int:
        return sum(len(q) for lane, q in self.queues.items() if lane[0] != SPARE)

    def with_work(self) -> set[Lane]:
        return {*self.queues, *self.lane_running}

    # -- waiting ----------------------------------------------------------------------------------------------
    def queue(self, seq: EngineSequence) -> None:
        heapq.heappush(self.queues.setdefault(seq.lane, []), (seq.tier, seq.order, seq))
        self.waiting_count += 1

    def pop(self, lane: Lane) -> EngineSequence:
        """The head of `lane`'s queue, taken off it (to start)."""
        _, _, seq = heapq.heappop(self.queues[lane])
        if not self.queues[lane]:
            del self.queues[lane]
        self.waiting_count -= 1
        return seq

    def unqueue(self, seq: EngineSequence) -> None:
        lane = seq.lane
        queue = [entry for entry in self.queues.get(lane, []) if entry[2] is not seq]
        self.waiting_count -= len(self.queues.get(lane, [])) - len(queue)
        if queue:
            heapq.heapify(queue)
            self.queues[lane] = queue
        else:
            self.queues.pop(lane, None)
            self.went_idle(lane)

    # -- running ----------------------------------------------------------------------------------------------
    def run(self, seq: EngineSequence) -> None:
        """Book a sequence that starts (its blocks taken from the budget)."""
        self.budget.take(seq.blocks)
        lane = seq.lane
        self.running[seq.run_id] = seq
        self.lane_running.setdefault(lane, {})[seq.run_id] = seq
        self.lane_held[lane] = self.lane_held.get(lane, 0) + seq.blocks

    def unrun(self, seq: EngineSequence) -> None:
        """Take a running sequence off the books (its blocks back to the budget)."""
        lane = seq.lane
        self.running.pop(seq.run_id, None)
        runs = self.lane_running.get(lane, {})
        runs.pop(seq.run_id, None)
        if not runs:
            self.lane_running.pop(lane, None)
        held = self.lane_held.get(lane, 0) - seq.blocks
        if held > 0:
            self.lane_held[lane] = held
        else:
            self.lane_held.pop(lane, None)
        self.budget.give(seq.blocks)
        self.went_idle(lane)

    def spare_running(self) -> int:
        """Batch lines running now (every spare lane's sequences)."""
        return sum(len(runs) for lane, runs in self.lane_running.items() if lane[0] == SPARE)

    # -- shares -----------------------------------------------------------------------------------------------
    def went_idle(self, lane: Lane) -> None:
        """Note when an interactive lane's last sequence left: it lingers (`shares.LINGER_S`)."""
        if lane[0] != SPARE and lane not in self.queues and lane not in self.lane_running:
            self.idle_since[lane] = time.monotonic()

    def lingering(self) -> list[Lane]:
        """Interactive lanes without work whose last sequence ended within LINGER_S (expired ones forgotten)."""
        if self.idle_since:
            now = time.monotonic()
            self.idle_since = {
                lane: since
                for lane, since in self.idle_since.items()
                if now - since <= LINGER_S and lane not in self.queues and lane not in self.lane_running
            }
        return list(self.idle_since)

    def interactive_present(self) -> bool:
        """Whether interactive work runs, waits, or lingers (`shares.LINGER_S`): batch lines keep to their cap."""
        busy = any(lane[0] != SPARE for lanes in (self.lane_running, self.queues) for lane in lanes)
        return busy or bool(self.lingering())

    def alone(self, seq: EngineSequence) -> bool:
        """Whether every running and waiting sequence is of `seq`'s lane (no shares to weigh)."""
        return self.with_work() <= {seq.lane}

    def weight(self, lane: Lane) -> float:
        """A lane's weight: that of the highest tier among its work (1 for all while the tiers have no weights)."""
        if not WEIGHTED:
            return 1.0
        tiers = [s.tier for s in self.lane_running.get(lane, {}).values()]
        if queue := self.queues.get(lane):
            tiers.append(queue[0][0])
        return tier_weight(min(tiers)) if tiers else 1.0

    def shares(self) -> tuple[dict[Lane, LaneLoad], dict[Lane, float]]:
        """The lanes with work, and those lingering, with their shares."""
        lanes = {lane: LaneLoad(self.lane_held.get(lane, 0), self.weight(lane)) for lane in self.with_work()}
        for lane in self.lingering():
            lanes[lane] = LaneLoad(0, 1.0)
        return lanes, shares(lanes, self.budget.total_blocks)
