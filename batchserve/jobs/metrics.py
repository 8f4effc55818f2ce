"""Prometheus metrics of batch jobs, on the app's own registry (so `/metrics` shows them beside DESIGN §6's).

Per-job progress is a gauge labelled by job id; to keep the label set bounded, the series of finished jobs are
kept only for the most recent `KEEP_FINISHED` of them (long enough for a scrape to see the final counts).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchserve.jobs.store import Progress

KEEP_FINISHED = 100
COUNTED = ("completed", "failed", "cancelled", "pending")


@dataclass
class JobMetrics:
    items: Gauge  # {job, status}: one job's progress
    processed: Counter  # {model, outcome}: completed | failed | retried
    active_jobs: Gauge
    inflight: Gauge
    created: Counter
    finished_ids: deque[str] = field(default_factory=deque)
    _children: dict[tuple[str, str], Any] = field(default_factory=dict)  # labelled `processed`, looked up once

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "JobMetrics":
        p = "batchserve_job_"
        return cls(
            items=Gauge(p + "items", "Items of one batch job by status", ["job", "status"], registry=registry),
            processed=Counter(p + "items_processed", "Batch job item runs by outcome (completed, failed, "
                              "retried)", ["model", "outcome"], registry=registry),
            active_jobs=Gauge("batchserve_jobs_active", "Batch jobs queued or running on this node", registry=registry),
            inflight=Gauge(p + "inflight_items", "Batch job items in the batcher or on a worker",
                           registry=registry),
            created=Counter("batchserve_jobs_submitted", "Batch jobs accepted", registry=registry),
        )

    def count(self, model: str, outcome: str) -> None:
        child = self._children.get((model, outcome))
        if child is None:
            child = self._children[(model, outcome)] = self.processed.labels(model, outcome)
        child.inc()

    def progress(self, p: Progress) -> None:
        for status in COUNTED:
            self.items.labels(p.id, status).set(p.counts.get(status, 0))
        if p.status not in ("queued", "running") and p.id not in self.finished_ids:
            self.finished_ids.append(p.id)
            while len(self.finished_ids) > KEEP_FINISHED:
                old = self.finished_ids.popleft()
                for status in COUNTED:
                    try:
                        self.items.remove(old, status)
                    except KeyError:
                        pass
