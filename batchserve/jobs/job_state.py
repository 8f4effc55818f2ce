"""What the job scheduler (`scheduler.py`) holds for each unfinished job on this node, and the per-job policy read
from it: how much to claim from the store at a time, when a failed item is final, and when a failing job's items
run in groups of their own.

A job whose inputs fail often enough to cost re-runs (failures found by failing batches, not named by the backend)
is isolated: its items run in small groups of their own (`group_size`) in the workers' background share
(`core/retries.py`), on a budget of its own (`Scheduler.isolated_limit`). So another tenant's clean job never shares
a batch with the failing inputs and keeps most of the workers, and the failing job still moves.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from batchserve.core.fairqueue import Item
from batchserve.errors import ApiError
from batchserve.jobs.lines import LineRun

CLAIM_CHUNK = 128  # fewest pending inputs claimed from the store at a time, per job (more leased = less shared)
FIRST_LINES = 4  # lines of an OpenAI batch claimed before any of its lines has shown how many inputs a line holds
FAILING_WINDOW = 64  # the last outcomes of a job looked at
ISOLATE_FAILURES = 2  # isolated while at least this many of them were costly failures


@dataclass(eq=False)
class JobState:
    """What the scheduler holds for one unfinished job on this node."""

    id: str
    tenant: str  # the scheduling lane of the job's owner (`http/guards.lane_of`)
    model: str
    endpoint: str | None = None  # an OpenAI Batch API job: each item is a line for this endpoint (`lines.py`)
    exhausted: bool = False  # the last claim found nothing more to lease; the next poll of the store clears it
    buffer: deque[tuple[int, str]] = field(default_factory=deque)  # read, not yet submitted
    inflight: dict[int, Item | LineRun] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)  # leased to this node and not yet recorded: renewed
    added: float = field(default_factory=time.monotonic)
    attempts: dict[int, int] = field(default_factory=dict)  # transient failures per index
    hung: set[int] = field(default_factory=set)  # indexes that were in a hung batch once already
    shared: set[int] = field(default_factory=set)  # indexes in flight on the shared path (`Feeder.feed`)
    open: dict[int, LineRun] = field(default_factory=dict)  # lines in flight with inputs not fed yet, oldest first
    charged: dict[int, int] = field(default_factory=dict)  # per index in flight: its inputs holding places
    line_inputs: float = 1.0  # the mean inputs of its lines started so far (1 for a native job): a row's price
    lines_seen: int = 0
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=FAILING_WINDOW))  # True = costly failure
    retrying: int = 0
    cancelled: bool = False
    expires_at: float | None = None  # an OpenAI batch's completion window closes (`lines.window_end`)

    def group_size(self, limit: int) -> int:
        """0 while the job rides in shared batches; once isolated, how many of its items share a batch: about
        1 / (2 x failure rate), so most groups hold no culprit and answer in one run (a group of g with one culprit
        costs about 2 log2 g more runs)."""
        failed = sum(self.recent)
        if failed < ISOLATE_FAILURES:
            return 0
        return max(1, min(limit, int(0.5 * len(self.recent) / failed)))

    def failed_for_good(self, index: int, exc: BaseException, max_attempts: int) -> bool:
        """A run of item `index` failed with `exc`: whether that is final (its attempts spent, failed alone after
        bisection, or hung again), else its attempt is counted for the retry."""
        attempts = self.attempts.get(index, 0) + 1
        final = attempts >= max_attempts
        if isinstance(exc, ApiError):
            final = final or exc.status == 500 or exc.hung == "again" or (exc.hung == "once" and index in self.hung)
            if exc.hung:
                self.hung.add(index)
        if not final:
            self.attempts[index] = attempts
        return final

    def has_work(self) -> bool:
        return not self.cancelled and (bool(self.buffer) or bool(self.open) or not self.exhausted)

    def ready_inputs(self) -> float:
        """Inputs read and waiting to be fed: its open lines' unfed inputs, and its rows at their mean price."""
        return len(self.buffer) * self.line_inputs + sum(run.unfed for run in self.open.values())

    def claim_size(self, deficit: float) -> int:
        """Rows to claim for `deficit` more inputs: at least `CLAIM_CHUNK` inputs' worth, as rows of its mean
        price, so a node leases a few lines of 2,048 inputs, not 128 of them; `FIRST_LINES` while the price
        of its lines is unknown."""
        if self.endpoint is not None and not self.lines_seen:
            return FIRST_LINES
        return max(1, math.ceil(deficit / self.line_inputs), math.ceil(CLAIM_CHUNK / self.line_inputs))

    def ready(self) -> bool:
        """Something read is waiting to be fed: a row, or a line's next inputs."""
        return not self.cancelled and (bool(self.buffer) or bool(self.open))

    def idle(self) -> bool:
        return self.cancelled or (
            self.exhausted and not self.buffer and not self.inflight and not self.retrying and not self.held
        )


@dataclass(order=True)
class ItemRetry:
    due: float
    seq: int
    job: JobState = field(compare=False)
    index: int = field(compare=False)
    text: str = field(compare=False)
