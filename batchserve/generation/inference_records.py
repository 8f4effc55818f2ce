"""What a `/v1/inference` input answered on the generation engine's stepper (`generation/inference.py`) books in
the server's metrics and traces, so that it shows in the same series and spans as one answered by a batch.

Why: dashboards and alerts read these series per model, so a model answered on the stepper must not look idle.
A sequence is its own "batch":
- `batchserve_queue_wait_seconds{model}`: arrival to joining the stepper (interactive tiers only: batch-job items
  wait for spare capacity by design);
- `batchserve_batch_size{model}`: the rows of the step it joined, one observation per sequence;
- `batchserve_batch_compute_seconds{model}`: joining to its last token.

Traces: a `queue` child span of the request, linked to a `batch <model>` span per sequence (worker `stepper`,
cause `joined`, with `batchserve.path`, `batchserve.stepper.rows` and `gen_ai.usage.output_tokens`).

Everything here runs on the event loop, the only writer of the loop-owned histograms (`metrics.LoopHistogram`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchserve.core.batch import BatchRun, BatchTracer
from batchserve.core.tiers import BATCH, NAMES as TIER_NAMES
from batchserve.metrics import Metrics

WORKER = "stepper"  # the `batchserve.worker` of a sequence's span: the engine's stepper, not a batch worker
CAUSE = "joined"  # its `batchserve.batch.cause`: it joined the running batch (no flush made it leave)


class SequenceTracer(BatchTracer, Protocol):
    """What is asked of tracing (`batchserve.tracing.Tracing`, present only when it is on)."""

    def admitted(self, model: str, tier: str) -> object: ...

    def answered(self, model: str, arrived: float, queue_s: float, batch: object, outcome: str) -> None: ...


@dataclass
class StepperRecords:
    """The metrics and tracing a stepper answer feeds; either may be absent (a unit test, tracing off)."""

    metrics: Metrics | None = None  # the batch path's per-model histograms
    tracing: SequenceTracer | None = None

    def admitted(self, model: str, tier: int) -> object:
        """A request arrived at the stepper: its span context for its sequences' spans (None: no tracing)."""
        return self.tracing.admitted(model, TIER_NAMES[tier]) if self.tracing is not None else None

    def joined(self, model: str, tier: int, queue_s: float, rows: int) -> None:
        """A sequence joined the running batch after waiting `queue_s`, sharing its step with `rows` - 1 others."""
        if self.metrics is None:
            return
        self.metrics.batch_size.labels(model).observe(rows)
        if tier < BATCH.rank:  # job items wait for spare capacity by design: not a queue delay
            self.metrics.queue_wait.labels(model).observe(queue_s)

    def ended(
        self, model: str, started: float, ended: float, rows: int, tokens: int, trace: object, failed: str | None = None
    ) -> object:
        """Book a sequence's compute time and span; returns that span's context (for the request's `queue` span)."""
        if self.metrics is not None and failed is None:
            self.metrics.batch_compute.labels(model).observe(max(0.0, ended - started))
        if self.tracing is None:
            return None
        path: dict[str, str | int | float] = {
            "batchserve.path": WORKER,
            "batchserve.stepper.rows": rows,
            "gen_ai.usage.output_tokens": tokens,
        }
        return self.tracing.batch(BatchRun(model, rows, WORKER, CAUSE, started, ended, (trace,), failed, path))

    def answered(self, model: str, arrived: float, queue_s: float, span: object, outcome: str = "ok") -> None:
        """One input of a request answered: its queue wait as a child span of the request, linked to its own; or the
        request failed with `outcome`, its code (at the door, or after joining: `span` is then its sequence's)."""
        if self.tracing is not None:
            self.tracing.answered(model, arrived, queue_s, span, outcome)
