"""Who of the waiting sequences runs, and whose running sequence is paused for it: the engine's admission from
its queue into the stepper under the shares (`shares.py`).

The one place that weighs lanes against each other, and the one place a sequence joins the stepper or leaves it
for capacity (`_start`, `_preempt`); the engine calls `admit` whenever a place may have freed or work arrived.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from batchserve.decoding.build import EngineConfig
from batchserve.decoding.forecast import WaitForecast
from batchserve.decoding.lanes import LaneBooks, victim_order
from batchserve.decoding.metrics import GenerationMetrics
from batchserve.decoding.sequence import RUNNING, WAITING, EngineSequence
from batchserve.decoding.shares import (
    SPARE,
    Lane,
    LaneLoad,
    batch_excess,
    batch_row_cap,
    headroom,
    order_key,
    rows_within_slowdown,
    victim_lane,
)
from batchserve.decoding.stepper import Stepper


class Admitter:
    """Starts waiting sequences and pauses (preempts) running ones, as the shares say."""

    def __init__(
        self,
        cfg: EngineConfig,
        lanes: LaneBooks,
        forecast: WaitForecast,
        stepper: Stepper,
        metrics: GenerationMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.lanes = lanes
        self.budget = lanes.budget
        self.forecast = forecast
        self.stepper = stepper
        self.metrics = metrics
        self.clock = clock  # the engine's: a sequence's start is compared with its arrival
        self.draining = False  # the engine is stopping: nothing more starts
        self.preemptions = 0
        # the most batch lines running beside interactive work (`shares.batch_row_cap`); a stepper that does not
        # share steps also keeps them within the slowdown (`rows_within_slowdown`)
        self.batch_cap = batch_row_cap(self.budget.max_seqs, cfg.batch_beside_interactive)
        if not stepper.shares_steps:
            self.batch_cap = min(
                self.batch_cap, rows_within_slowdown(stepper.row_growth, cfg.batch_slowdown, self.budget.max_seqs)
            )

    @property
    def resumable(self) -> bool:
        """Whether the stepper can resume a dropped sequence (so the engine may preempt)."""
        return bool(getattr(self.stepper, "resumable", False))

    def admit(self) -> None:
        """Start waiting sequences while they fit, in the shares' order; when the next does not fit, pause one for
        it if the policy allows, else stop (the next freed place serves it). Batch lines over their cap go first."""
        if not self.draining:
            self._pause_batch_to_cap()
        pauses = len(self.lanes.running)  # each pause lets one more start: never more than there are running
        while self.lanes.waiting_count and not self.draining:
            lanes, share = self.lanes.shares()
            lane, seq = min(
                ((lane, queue[0][2]) for lane, queue in self.lanes.queues.items()),
                key=lambda ls: order_key(ls[0], lanes[ls[0]].held, share[ls[0]], ls[1].blocks, ls[1].tier, ls[1].order),
            )
            if not self._fits(seq, lanes, share):
                victim = self._victim(lane, seq, lanes, share) if pauses > 0 else None
                if victim is None:
                    break
                pauses -= 1
                self._preempt(victim, "batch" if victim.lane[0] == SPARE and lane[0] != SPARE else "share")
                continue
            self.lanes.pop(lane)
            self.forecast.forget()
            self._start(seq)
        self.gauges()

    def _fits(self, seq: EngineSequence, lanes: dict[Lane, LaneLoad], share: dict[Lane, float]) -> bool:
        """Whether `seq` may start now: its worst case fits, a batch line leaves the interactive headroom, and a
        lane at or over its share leaves one place for each lingering lane (`shares.LINGER_S`)."""
        lane = seq.lane
        kept = 0 if lanes[lane].held < share[lane] else len(self.lanes.idle_since)  # shares() pruned it just now
        if lane[0] == SPARE:
            if self.lanes.spare_running() >= self.batch_cap and self.lanes.interactive_present():
                return False  # the rows batch lines may hold beside interactive work (`shares.batch_row_cap`)
            return self.budget.fits(
                seq.blocks, headroom(self.budget.total_blocks) + kept, headroom(self.budget.max_seqs) + kept
            )
        return self.budget.fits(seq.blocks, kept, kept)

    def _start(self, seq: EngineSequence) -> None:
        """Put `seq` in the stepper; a resumed (preempted) one under a new run id, with the tokens it had made."""
        now = self.clock()
        seq.state, seq.run_started = RUNNING, now
        seq.runs += 1
        prompt, params = seq.prompt_ids, seq.params
        if seq.runs == 1:
            seq.started, seq.run_id = now, seq.id
        else:
            seq.run_id, seq.resumed = f"{seq.id}.{seq.runs}", True
            prompt, params = seq.prompt_ids + seq.made, dataclasses.replace(seq.params, resumed=len(seq.made))
        self.lanes.run(seq)
        self.stepper.add(seq.run_id, prompt, params, background=seq.lane[0] == SPARE, tenant=seq.tenant)
        if seq.on_start is not None and seq.runs == 1:
            seq.on_start(seq)
        self.gauges()

    def _preempt(self, seq: EngineSequence, reason: str) -> None:
        """Pause a running sequence: it waits again at its old place and resumes by recomputing; it never expires."""
        self.lanes.unrun(seq)
        self.stepper.cancel(seq.run_id)
        seq.state, seq.deadline = WAITING, math.inf
        self.preemptions += 1
        self.metrics.preempted.labels(reason).inc()
        self.lanes.queue(seq)
        self.forecast.forget()

    def _pause_batch_to_cap(self) -> None:
        """Pause the batch lines over their cap beside interactive work (`shares.batch_excess`), the latest
        started of the lane holding the most first (the least to recompute)."""
        if not self.resumable or self.batch_cap >= self.budget.max_seqs:
            return
        running = self.lanes.spare_running()
        if running <= self.batch_cap:
            return
        for _ in range(batch_excess(running, self.batch_cap, self.lanes.interactive_present())):
            lane = max(
                (lane for lane in self.lanes.lane_running if lane[0] == SPARE),
                key=lambda ln: (self.lanes.lane_held.get(ln, 0), ln[1]),
            )
            self._preempt(max(self.lanes.lane_running[lane].values(), key=victim_order), "batch")

    def _victim(
        self, lane: Lane, seq: EngineSequence, lanes: dict[Lane, LaneLoad], share: dict[Lane, float]
    ) -> EngineSequence | None:
        """The running sequence to pause so that `seq` (of `lane`) can start, or None (`shares.victim_lane`)."""
        if not self.resumable:
            return None
        # the blocks each lane would give up; the victim is looked for in the chosen lane only (O(lanes))
        gives = {other: next(reversed(runs.values())).blocks for other, runs in self.lanes.lane_running.items()}
        chosen = victim_lane(lane, seq.blocks, lanes, share, gives)
        if chosen is None:
            return None
        return max(self.lanes.lane_running[chosen].values(), key=victim_order)

    def gauges(self) -> None:
        """The running and waiting counts and the KV use, set after every change here (and on the engine's tick)."""
        self.metrics.running.set(len(self.lanes.running))
        self.metrics.waiting.set(self.lanes.waiting_count)
        self.metrics.kv_reserved.set(self.budget.reserved_ratio)
        self.metrics.kv_usage.set(self.stepper.kv_usage())
