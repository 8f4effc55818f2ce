"""How long a sequence would wait for KV capacity: the prediction the engine refuses at the door by (503 when it
passes the caller's limit) and the load signal reads. It replays the queue as admission will run it; it
decides nothing."""

from __future__ import annotations

import time

from batchserve.decoding.kv_budget import Claim, Replay
from batchserve.decoding.lanes import LaneBooks, victim_order
from batchserve.decoding.sequence import EngineSequence
from batchserve.decoding.shares import Lane, LaneLoad, Queued, replay_wait, shares, tier_weight

REPLAY_TTL_S = 0.1  # a kept replay of the queue answers arrivals this long (see WaitForecast.wait_s)


class WaitForecast:
    """Predicted waits over the engine's books, with the replays kept per tier between arrivals."""

    def __init__(self, lanes: LaneBooks) -> None:
        self.lanes = lanes
        # tier -> (when made, the replay of the future after every waiting sequence of that tier or one served before)
        self._replays: dict[int, tuple[float, Replay]] = {}

    def forget(self) -> None:
        """The queue changed other than at a tail a kept replay knows of: every kept replay is stale."""
        self._replays.clear()

    def wait_s(self, seq: EngineSequence, step_s: float, resumable: bool, queued: bool = False) -> float:
        """Seconds until `seq` (queued already, or a probe) would start.

        A lane alone in the engine (one tenant's interactive work, the common case and every burst): behind
        the waiting sequences of its tier and of the tiers served before it (`kv_budget.Replay`). That replay is
        kept per tier and continued by the next arrival of that tier, so a burst of n queued arrivals costs n
        placements rather than n^2/2. `queued`: `seq` has just joined the queue's tail, and the kept replay
        takes it. A kept replay is dropped when a sequence leaves the queue or one of a tier served earlier joins
        ahead, and is used for REPLAY_TTL_S at most (its running sequences may end early: that only makes it
        pessimistic meanwhile). Lanes sharing the engine: `shared_wait_s`, made afresh."""
        lanes = self.lanes
        if not lanes.alone(seq):
            self._replays.clear()
            return 0.0 if queued else self.shared_wait_s(seq, step_s, resumable)
        now = time.monotonic()
        kept = self._replays.get(seq.tier)
        if kept is None or now - kept[0] > REPLAY_TTL_S:
            replay = Replay(lanes.budget, [s.claim() for s in lanes.running.values()], step_s)
            for _, _, ahead in sorted(lanes.waiting):
                if ahead.tier <= seq.tier and ahead is not seq:
                    replay.place(ahead.claim())
            kept = self._replays[seq.tier] = (now, replay)
        if queued:  # the tiers served after it replayed without it
            self._replays = {tier: entry for tier, entry in self._replays.items() if tier <= seq.tier}
        made, replay = kept
        return max(0.0, replay.place(seq.claim(), commit=queued) - (now - made))

    def shared_wait_s(self, seq: EngineSequence, step_s: float, resumable: bool) -> float:
        """The wait of `seq` where lanes share the engine, replayed as admission will run (`shares.replay_wait`):
        the running sequences it could not pause stay until their end (those its lane's next preemptions would
        pick free their place now); each freed place goes to the lane furthest under its share, interactive
        lanes before batch lines. So a tenant under its share is predicted to start ahead of a tenant that holds
        every slot and has a long queue, as it will. Made afresh for each arrival: O(running + waiting)."""
        books = self.lanes
        lanes, share = books.shares()
        lane = seq.lane
        if lane not in lanes:
            lanes[lane] = LaneLoad(0, tier_weight(seq.tier))
            share = shares(lanes, books.budget.total_blocks)
        movable = self._movable(lane, lanes, share) if resumable else set()
        stay = [(s.lane, s.blocks, s.claim().steps * step_s) for s in books.running.values() if s.run_id not in movable]
        freed = [s for s in books.running.values() if s.run_id in movable]
        held = {other: load.held for other, load in lanes.items()}
        for s in freed:
            held[s.lane] -= s.blocks
        queues: dict[Lane, list[Queued]] = {}
        target: Queued | None = None
        for other, queue in books.queues.items():
            if other[0] > lane[0]:
                continue  # batch lines wait behind an interactive caller
            queues[other] = []
            for tier, order, s in sorted(queue):
                queues[other].append(Queued(s.blocks, s.claim().steps, tier, order))
                if s is seq:
                    target = queues[other][-1]
        if target is None:  # a probe: at its lane's tail
            target = Queued(seq.blocks, seq.claim().steps, seq.tier, seq.order)
            queues.setdefault(lane, []).append(target)
        budget = books.budget
        return replay_wait(
            budget.total_blocks - budget.used_blocks + sum(s.blocks for s in freed),
            budget.max_seqs - budget.running + len(freed),
            stay,
            queues,
            share,
            held,
            target,
            step_s,
        )

    def _movable(self, lane: Lane, lanes: dict[Lane, LaneLoad], share: dict[Lane, float]) -> set[str]:
        """The run ids `lane`'s next preemptions would pause for it."""
        movable: set[str] = set()
        own = lanes[lane].held
        for other, runs in self.lanes.lane_running.items():
            if other == lane or other[0] < lane[0] or (other[0] == lane[0] and own >= share[lane]):
                continue  # an interactive lane is never paused for a batch line
            left = lanes[other].held
            for run in sorted(runs.values(), key=victim_order, reverse=True):
                if other[0] == lane[0] and left - run.blocks < share[other]:
                    break  # a lane of its class gives up only what it holds past its share
                movable.add(run.run_id)
                left -= run.blocks
        return movable

    def start_s(self, max_tokens: int, step_s: float) -> float:
        """Seconds until a new sequence of up to `max_tokens` new tokens (and a prompt within one KV block) would
        start behind everything running and waiting now, as admission would predict it; queues nothing. The load
        signal's predicted wait (`core/load_signal.py`), read at scrape time: one replay of the queue."""
        books = self.lanes
        blocks = books.budget.blocks_for(max_tokens + 1)
        if not books.waiting_count and books.budget.fits(blocks):
            return 0.0
        replay = Replay(books.budget, [s.claim() for s in books.running.values()], step_s)
        for _, _, ahead in sorted(books.waiting):
            replay.place(ahead.claim())
        return replay.place(Claim(blocks, max_tokens), commit=False)
