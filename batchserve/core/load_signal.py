"""Autoscaling signals that lead the SLO, exported as gauges read at scrape time (nothing runs per request).

Not GPU busy or queue depth: with the paced batcher a device runs a batch every S/G whenever anything waits, so it
is "busy" from a small fraction of its capacity on, and the queue stays under a batch until the node is already at
its limit. What leads is demand against capacity:

- `batchserve_load_ratio` = arrivals/s (admission's ~2 s average, refused requests included: they are demand too)
  over what the healthy workers serve at full batches (healthy x max_batch_size / learned batch time). 1.0 is the
  node's ceiling; latency degrades before it (docs/capacity.md puts the SLO's limit near 0.95), so an autoscaler
  targets ~0.7-0.8.
- `batchserve_predicted_wait_ratio` = the wait a new request would face before its batch leaves (the first healthy
  worker's time to free + the full batches queued ahead) over the wait the SLO leaves it (slo - batch time). Above
  1 a request arriving now misses the SLO; it is instantaneous, so it spikes.

With several models the slowest batch time is used, against that model's own SLO. With no healthy worker but
demand, both read `SATURATED`, a large finite number (an autoscaler's arithmetic should not meet +Inf). The
generation engine's work, which never reaches the batcher, is read as its own demand against its own capacity
(`EngineLoad`); each signal is the larger of the two: the node needs more replicas when either is short.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchserve.metrics import per_model

SATURATED = 100.0


def _ratio(demand: float, supply: float) -> float:
    """`demand / supply`, at most SATURATED; with no supply, SATURATED once there is any demand."""
    if supply <= 0:
        return SATURATED if demand > 0 else 0.0
    return min(SATURATED, demand / supply)


@dataclass(frozen=True)
class EngineLoad:
    """The generation engine's side of the reading: the sequences it holds, its slots, the wait its admission
    predicts for a new sequence (`Engine.predicted_start_s`: a replay of its queue, so asked only by the signal
    that needs it, not by the load ratio) and the answer time a sequence takes once started."""

    running: int
    waiting: int
    slots: int
    predicted_start_s: Callable[[], float]
    answer_s: float
    healthy: bool = True
    slo_s: float | None = None  # the engine's model's own SLO (None: the reading's)

    def load_ratio(self) -> float:
        return _ratio(self.running + self.waiting, self.slots if self.healthy else 0)

    def predicted_wait_ratio(self, slo_s: float) -> float:
        if not self.healthy:
            return _ratio(self.running + self.waiting, 0)
        return _ratio(self.predicted_start_s(), slo_s - self.answer_s)  # an answer alone past the SLO: saturated


@dataclass(frozen=True)
class Reading:
    """What the signals are computed from, read from the runtime in one go."""

    arrivals_per_s: float
    healthy: int
    max_batch: int
    batch_s: float  # the slowest model's learned batch time
    until_free_s: float  # until the first healthy worker is free
    depth: int  # items queued, every model
    slo_s: float  # the SLO of the model whose batch time is read (the slowest's own)
    engine: EngineLoad | None = None  # the generation engine, when it is on

    def load_ratio(self) -> float:
        supply = self.healthy * self.max_batch / self.batch_s if self.batch_s > 0 else 0  # inputs/s at full batches
        batcher = _ratio(self.arrivals_per_s, supply)
        return batcher if self.engine is None else max(batcher, self.engine.load_ratio())

    def predicted_wait_ratio(self) -> float:
        if self.healthy <= 0:
            batcher = _ratio(self.depth + self.arrivals_per_s, 0)
        else:  # a batch alone past the SLO (a real model on a CPU): saturated
            wait = self.until_free_s + (self.depth // self.max_batch) * self.batch_s / self.healthy
            batcher = _ratio(wait, self.slo_s - self.batch_s)
        engine = self.engine
        if engine is None:
            return batcher
        return max(batcher, engine.predicted_wait_ratio(self.slo_s if engine.slo_s is None else engine.slo_s))


def export(load_ratio: Gauge, predicted_wait_ratio: Gauge, read: Callable[[], Reading]) -> None:
    """Compute both gauges from `read()` whenever /metrics is scraped."""
    load_ratio.set_function(lambda: read().load_ratio())
    predicted_wait_ratio.set_function(lambda: read().predicted_wait_ratio())


# -- gateway gauges -------------------------------------------------------------------------------------------
# Kubernetes' Gateway API Inference Extension (its endpoint picker) sends each request to the replica with the
# fewest waiting and running requests and the emptiest KV cache, reading gauges named as vLLM's
# (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`); docs/deploy.md's
# EndpointPickerConfig declares batchserve as an engine whose gauges are these.


@dataclass(frozen=True)
class ModelLoad:
    """One model's requests now: queued for a batch (or, for generation, for KV capacity), and running."""

    waiting: int
    running: int
    kv_usage: float | None = None  # share of the KV cache in use (0..1), generation models only


class GatewayGauges(Collector):
    """`batchserve_num_requests_waiting{model}`, `batchserve_num_requests_running{model}` and
    `batchserve_kv_cache_usage_perc{model}` (a 0..1 share, as vLLM's), computed from `read()` at scrape time:
    nothing is counted per request."""

    def __init__(self, read: Callable[[], dict[str, ModelLoad]], registry: CollectorRegistry) -> None:
        self.read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:  # registering must not call `read` (the runtime is not up yet)
        return iter(self._families({}))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.read()))

    @staticmethod
    def _families(loads: dict[str, ModelLoad]) -> Sequence[Metric]:
        helps = {
            "batchserve_num_requests_waiting": "Requests waiting for a batch (generation: for KV capacity), per model",
            "batchserve_num_requests_running": "Requests in a running batch (generation: decoding), per model",
            "batchserve_kv_cache_usage_perc": "Share of the generation model's KV cache in use (0..1)",
        }
        return per_model(GaugeMetricFamily, helps, {m: (x.waiting, x.running, x.kv_usage) for m, x in loads.items()})
