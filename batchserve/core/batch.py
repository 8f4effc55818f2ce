"""A batch: the items one worker runs together, and what it costs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from batchserve.core.fairqueue import Item


@dataclass(eq=False)
class Batch:
    model: str
    items: list[Item]
    formed: float
    cause: str  # full | deadline | pace | hold | burst | drain | retry | isolated
    avoid_worker: int = -1  # a retry prefers another worker than the one that failed it
    after_hang: bool = False  # items of a batch whose worker hung: not retried a second time
    held: list[Item] = field(default_factory=list)  # bisection: the other half, waiting on this one's outcome
    isolated: bool = False  # items of a job isolated for failing: never mixed into regular batches, halves included

    @property
    def cost(self) -> float:
        """What this batch costs to run: the backend's `cost_of_batch` when it declares one (e.g. the sum of
        tokens, or quadratic attention), else rows x the longest row (padded), 1 per input when inputs cost 1."""
        fn = self.items[0].batch_cost if self.items else None
        if fn is not None:
            return float(fn([item.text for item in self.items]))
        return len(self.items) * max([item.cost for item in self.items]) if self.items else 0.0


@dataclass(frozen=True)
class BatchRun:
    """One batch run as tracing sees it: a span's figures, linked to its requests' spans (`attributes`: the
    path's own, e.g. a stepper sequence's rows and tokens)."""

    model: str
    size: int
    worker: str
    cause: str
    started: float
    ended: float
    requests: Iterable[object]
    failed: str | None = None
    attributes: Mapping[str, str | int | float] | None = None


class BatchTracer(Protocol):
    """What the paths that run batches ask of tracing (`batchserve.tracing.Tracing`, present only when it is on)."""

    def batch(self, run: BatchRun) -> object: ...
