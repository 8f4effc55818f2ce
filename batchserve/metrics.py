"""Prometheus metrics (docs/contract.md#observability), through prometheus-client, on a registry of the app's own.

Queue wait and compute are separate histograms so "slow because we wait to batch" and "slow because the model
is slow" can be told apart.

The series touched once per request or per item are `LoopCounter` / `LoopHistogram`: plain counts kept by the
event-loop thread, their only writer, and rendered at scrape time. prometheus-client's own Counter and Histogram
take a lock per increment, which costs several microseconds per request for nothing.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from batchserve.errors import ApiError

REFUSALS = (401, 413, 429, 503)  # answers counted in rejected_total too: refused before reaching a batch

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.175,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100, 128, 256)


class HistogramChild:
    """One label set's bucket counts and sum (a `LoopHistogram`'s child, or a label-less one's only one)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket `le`: the first bound >= value
        self.sum += value

    def observe_all(self, values: Iterable[float]) -> None:
        """`observe` of each value (a batch's items' queue waits): one call, not one per value."""
        counts, bounds, where, total = self.counts, self.bounds, bisect.bisect_left, self.sum
        for value in values:
            counts[where(bounds, value)] += 1
            total += value
        self.sum = total


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


C = TypeVar("C", HistogramChild, _CounterChild)


class _LoopFamily(Collector, Generic[C]):
    """A labelled family written only by the event-loop thread (no lock), rendered at scrape time."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        registry: CollectorRegistry,
        child: Callable[[], C],
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._new_child: Callable[[], C] = child
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def labels(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child


class LoopHistogram(_LoopFamily[HistogramChild]):
    """Exposed as a Prometheus histogram."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.buckets = buckets  # before `register` collects
        super().__init__(name, documentation, labelnames, registry, lambda: HistogramChild(buckets))

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        for values, child in list(self._children.items()):
            cumulative, running = [], 0
            for bound, count in zip((*self.buckets, float("inf")), child.counts):
                running += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


# A model's 200s of one tier and outcome: its status count, its duration, and its SLO ledger's three children.
OkChildren = tuple[_CounterChild, HistogramChild, _CounterChild, _CounterChild, _CounterChild]


class LoopCounter(_LoopFamily[_CounterChild]):
    """Exposed as `<name>_total`."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry) -> None:
        super().__init__(name, documentation, labelnames, registry, _CounterChild)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class AdmissionWaitCollector(Collector):
    """Admission's prediction against what happened, per model, read at scrape time: the summed queue waits
    predicted and observed for requests admitted under pressure (their ratio over a window is how far the door's
    model was off), and its current factor (`core/wait_calibration.py`) and margin. `read` gives per model
    (predicted s, observed s, requests, factor, margin s)."""

    def __init__(
        self, read: Callable[[], Mapping[str, tuple[float, float, int, float, float]]], registry: CollectorRegistry
    ) -> None:
        self.read = read
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        rows = self.read()
        counters = {
            "batchserve_admission_predicted_wait_seconds": "Queue wait admission predicted for requests admitted "
            "under pressure (before calibration)",
            "batchserve_admission_actual_wait_seconds": "Queue wait those requests had, admission to their first batch",
            "batchserve_admission_calibrated_requests": "Requests admitted under pressure whose wait was compared "
            "with the prediction",
        }
        gauges = {
            "batchserve_admission_wait_factor": "What admission multiplies its predicted queue wait by: the observed "
            "over predicted waits lately, clamped",
            "batchserve_admission_wait_margin_seconds": "What admission keeps below its latency bound under pressure: "
            "the 95th percentile of its corrected wait error",
        }
        yield from per_model(CounterMetricFamily, counters, {m: row[:3] for m, row in rows.items()})
        yield from per_model(GaugeMetricFamily, gauges, {m: row[3:] for m, row in rows.items()})


def per_model(
    kind: type[GaugeMetricFamily | CounterMetricFamily],
    helps: Mapping[str, str],
    rows: Mapping[str, Sequence[float | None]],
) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """Families of `kind` (name: help), one series per model, read at scrape time (None: no series of that
    family for that model)."""
    out: list[GaugeMetricFamily | CounterMetricFamily] = [
        kind(name, text, labels=["model"]) for name, text in helps.items()
    ]
    for model, values in sorted(rows.items()):
        for family, value in zip(out, values):
            if value is not None:
                family.add_metric([model], value)
    return out


class Metrics:
    """The app's metrics on a registry of their own, made in /metrics' order. The series written per request or per
    answer are loop-kept (module docstring); those counted per refusal or per batch take prometheus-client's locked
    Counter."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # process_cpu_seconds_total, ...: `batchserve plan --measure` divides the CPU by the requests answered.
        ProcessCollector(registry=r)
        self.requests = LoopCounter("batchserve_requests", "Answered inference requests", ("model", "status"), r)
        self.request_duration = LoopHistogram(
            "batchserve_request_duration_seconds", "Arrival to answer", ("model",), LATENCY_BUCKETS, r
        )
        self.queue_wait = LoopHistogram(
            "batchserve_queue_wait_seconds", "Arrival to dispatch in a batch", ("model",), LATENCY_BUCKETS, r
        )
        self.batch_compute = LoopHistogram(
            "batchserve_batch_compute_seconds", "Backend time of one batch", ("model",), LATENCY_BUCKETS, r
        )
        self.batch_size = LoopHistogram(
            "batchserve_batch_size",
            "Inputs per dispatched batch",
            ("model",),
            tuple(float(b) for b in BATCH_SIZE_BUCKETS),
            r,
        )
        self._gauges_and_locked_counters(r)
        # the SLO ledger (core/ledger.py): every answer of a model route counts here
        self.slo_requests = LoopCounter(
            "batchserve_slo_requests",
            "Answers of the model routes by SLO outcome: met (2xx within "
            "the SLO), slow (2xx past it), refused (429/503), expired (504), failed (other "
            "5xx); other 4xx are not counted",
            ("model", "tier", "outcome"),
            r,
        )
        self.cost_served = LoopCounter(
            "batchserve_cost_served",
            "Cost units served in 2xx answers: tokens where the model costs by tokens, else inputs",
            ("model", "tier"),
            r,
        )
        self.inputs_served = LoopCounter(
            "batchserve_inputs_served", "Inputs served in 2xx answers", ("model", "tier"), r
        )

        # (model, tier, outcome) of a 200 -> its status count and duration, then its `_ledger` children
        self._ok: dict[tuple[str, str, str], OkChildren] = {}
        # (model, tier, outcome) -> its slo_requests, inputs_served and cost_served children
        self._ledger: dict[tuple[str, str, str], tuple[_CounterChild, _CounterChild, _CounterChild]] = {}

    def _gauges_and_locked_counters(self, r: CollectorRegistry) -> None:
        """Levels, and counts per refusal or per batch (not per answer)."""
        # the node's state as levels; never set per request
        self.queue_depth = Gauge("batchserve_queue_depth", "Items waiting for a batch", ["model"], registry=r)
        self.inflight = Gauge(
            "batchserve_inflight_requests", "Inference requests admitted and not yet answered", registry=r
        )
        self.worker_busy_ratio = Gauge(
            "batchserve_worker_busy_ratio", "Share of the last second spent running batches", ["worker"], registry=r
        )
        self.worker_healthy = Gauge(
            "batchserve_worker_healthy", "1 while the worker takes batches", ["worker"], registry=r
        )
        self.rejected = Counter(
            "batchserve_rejected", "Requests refused before reaching a batch", ["reason"], registry=r
        )
        self.batch_retries = Counter(
            "batchserve_batch_retries", "Batches re-run after a failure, by cause", ["model", "cause"], registry=r
        )
        self.batches = Counter(
            "batchserve_batches",
            "Dispatched batches by what flushed them: full, deadline, pace, burst, hold, drain, retry, isolated",
            ["model", "cause"],
            registry=r,
        )
        # the autoscaling signals, computed at scrape time (core/load_signal.py)
        self.load_ratio = Gauge(
            "batchserve_load_ratio",
            "Arrivals over what the healthy workers serve at full batches (1 = "
            "the node's ceiling): the autoscaling signal",
            registry=r,
        )
        self.predicted_wait_ratio = Gauge(
            "batchserve_predicted_wait_ratio",
            "Predicted wait of a request arriving now before "
            "its batch leaves, over the wait the SLO leaves it (slo - batch time)",
            registry=r,
        )
        self.batches_stopped_early = Counter(
            "batchserve_batches_stopped_early",
            "Batches the backend cut short because every caller had left (answered, timed out or hung up)",
            ["model"],
            registry=r,
        )
        self.batches_staged = Counter(
            "batchserve_batches_staged",
            "Full batches formed while their device was busy and begun by its thread the moment the running "
            "batch ended (--stage-lead-ms)",
            ["model"],
            registry=r,
        )

    def count_ok(
        self, model: str, latency_s: float, tier: str, outcome: str, inputs: int = 0, cost: float = 0.0
    ) -> None:
        """One 200 answer of a model, with its SLO ledger entry: the hot path, so its five labelled children are
        found by one lookup."""
        children = self._ok.get((model, tier, outcome))
        if children is None:
            children = self._ok[(model, tier, outcome)] = (
                self.requests.labels(model, "200"),
                self.request_duration.labels(model),
                *(self._ledger.get((model, tier, outcome)) or self._ledger_children(model, tier, outcome)),
            )
        children[0].value += 1
        duration = children[1]
        duration.counts[bisect.bisect_left(duration.bounds, latency_s)] += 1
        duration.sum += latency_s
        children[2].value += 1
        children[3].value += inputs
        children[4].value += cost

    def count_outcome(self, model: str, tier: str, outcome: str, inputs: int = 0, cost: float = 0.0) -> None:
        """One answer in the SLO ledger; pass `inputs` and `cost` only for a served answer."""
        children = self._ledger.get((model, tier, outcome)) or self._ledger_children(model, tier, outcome)
        children[0].value += 1
        children[1].value += inputs
        children[2].value += cost

    def _ledger_children(
        self, model: str, tier: str, outcome: str
    ) -> tuple[_CounterChild, _CounterChild, _CounterChild]:
        children = self._ledger[(model, tier, outcome)] = (
            self.slo_requests.labels(model, tier, outcome),
            self.inputs_served.labels(model, tier),
            self.cost_served.labels(model, tier),
        )
        return children

    def count_error(self, model: str, err: ApiError) -> None:
        self.requests.labels(model, str(err.status)).inc()
        if err.status in REFUSALS:
            self.rejected.labels(err.code).inc()


def make_metrics() -> Metrics:
    return Metrics()
