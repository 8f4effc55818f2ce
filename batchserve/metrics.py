"""Prometheus metrics (DESIGN §6), through prometheus-client, on a registry of the app's own.

Queue wait and compute are separate histograms so "slow because we wait to batch" and "slow because the model
is slow" can be told apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100, 128, 256)


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    request_duration: Histogram
    queue_wait: Histogram
    batch_compute: Histogram
    batch_size: Histogram
    queue_depth: Gauge
    inflight: Gauge
    worker_busy_ratio: Gauge
    worker_healthy: Gauge
    rejected: Counter
    batch_retries: Counter
    batches: Counter
    batches_stopped_early: Counter


def make_metrics() -> Metrics:
    r = CollectorRegistry()
    p = "batchserve_"
    return Metrics(
        registry=r,
        requests=Counter(p + "requests", "Answered inference requests", ["model", "status"], registry=r),
        request_duration=Histogram(p + "request_duration_seconds", "Arrival to answer", ["model"],
                                   buckets=LATENCY_BUCKETS, registry=r),
        queue_wait=Histogram(p + "queue_wait_seconds", "Arrival to dispatch in a batch", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r),
        batch_compute=Histogram(p + "batch_compute_seconds", "Backend time of one batch", ["model"],
                                buckets=LATENCY_BUCKETS, registry=r),
        batch_size=Histogram(p + "batch_size", "Inputs per dispatched batch", ["model"],
                             buckets=BATCH_SIZE_BUCKETS, registry=r),
        queue_depth=Gauge(p + "queue_depth", "Items waiting for a batch", ["model"], registry=r),
        inflight=Gauge(p + "inflight_requests", "Inference requests admitted and not yet answered", registry=r),
        worker_busy_ratio=Gauge(p + "worker_busy_ratio", "Share of the last second spent running batches",
                                ["worker"], registry=r),
        worker_healthy=Gauge(p + "worker_healthy", "1 while the worker takes batches", ["worker"], registry=r),
        rejected=Counter(p + "rejected", "Requests refused before reaching a batch", ["reason"], registry=r),
        batch_retries=Counter(p + "batch_retries", "Batches re-run after a failure, by cause", ["model", "cause"],
                              registry=r),
        batches=Counter(p + "batches", "Dispatched batches by what flushed them: full, deadline, pace, drain, retry",
                        ["model", "cause"], registry=r),
        batches_stopped_early=Counter(p + "batches_stopped_early", "Batches the backend cut short because every "
                                      "caller had left (answered, timed out or hung up)", ["model"], registry=r),
    )
