"""Prometheus metrics of batch jobs, on the app's own registry (so `/metrics` shows them beside the server's own).

No series names a job or a tenant: `/metrics` may be scraped by people who must not learn other tenants' job
ids, and a label per job would let any caller grow the exposition without bound. Progress is summed per model over
the unfinished jobs; a finished or cancelled job leaves the sums at once (its items are counted for good in
`batchserve_job_items_processed_total`). A job's own progress is on `GET /v1/batches/{id}`, to its owner.
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchserve.jobs.store import ACTIVE, Progress

COUNTED = ("completed", "failed", "cancelled", "pending")


@dataclass
class JobMetrics:
    items: Gauge  # {model, status}: items of the unfinished jobs of a model
    processed: Counter  # {model, outcome}: completed | failed | retried
    active_jobs: Gauge
    inflight: Gauge
    created: Counter
    unfinished: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)  # job id -> (model, counts)
    _children: dict[tuple[str, str], Any] = field(default_factory=dict)  # labelled `processed`, looked up once

    @classmethod
    def create(cls, registry: CollectorRegistry) -> JobMetrics:
        p = "batchserve_job_"
        return cls(
            items=Gauge(
                p + "items",
                "Items of the unfinished batch jobs of a model, by status",
                ["model", "status"],
                registry=registry,
            ),
            processed=Counter(
                p + "items_processed",
                "Batch job item runs by outcome (completed, failed, retried)",
                ["model", "outcome"],
                registry=registry,
            ),
            active_jobs=Gauge("batchserve_jobs_active", "Batch jobs queued or running on this node", registry=registry),
            inflight=Gauge(p + "inflight_items", "Batch job items in the batcher or on a worker", registry=registry),
            created=Counter("batchserve_jobs_submitted", "Batch jobs accepted", registry=registry),
        )

    def count(self, model: str, outcome: str) -> None:
        child = self._children.get((model, outcome))
        if child is None:
            child = self._children[(model, outcome)] = self.processed.labels(model, outcome)
        child.inc()

    def progress(self, p: Progress) -> None:
        """A job's new counts: kept while it is unfinished, dropped once it is final or cancelled."""
        if p.status in ACTIVE:
            self.unfinished[p.id] = (p.model, p.counts)
        elif self.unfinished.pop(p.id, None) is None:
            return
        total = sum((Tally(counts) for model, counts in self.unfinished.values() if model == p.model), Tally())
        for status in COUNTED:
            self.items.labels(p.model, status).set(total.get(status, 0))
