"""The decoding engine's Prometheus series: time to first token, inter-token latency, tokens, sequences, the KV
cache, refusals and preemptions (`batchserve_generation_*`)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchserve.metrics import HistogramChild, LoopHistogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


@dataclass
class GenerationMetrics:
    ttft: HistogramChild  # written on the event loop only: per token, a locked prometheus Histogram cost ~5 us
    itl: HistogramChild
    output_tokens: Counter
    tokens_per_second: Gauge
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    kv_reserved: Gauge
    requests: Counter
    cancelled: Counter
    rejected: Counter
    preempted: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GenerationMetrics:
        p = "batchserve_generation_"
        return cls(
            ttft=LoopHistogram(
                p + "time_to_first_token_seconds",
                "Arrival to first generated token (queue + prefill)",
                (),
                TTFT_BUCKETS,
                registry,
            ).labels(),
            itl=LoopHistogram(
                p + "inter_token_latency_seconds",
                "Gap between consecutive tokens of one sequence",
                (),
                ITL_BUCKETS,
                registry,
            ).labels(),
            output_tokens=Counter(p + "output_tokens", "Generated tokens", registry=registry),
            tokens_per_second=Gauge(
                p + "output_tokens_per_second", "Generated tokens per second over the last 0.25 s", registry=registry
            ),
            running=Gauge(p + "running_sequences", "Sequences holding KV blocks in the engine", registry=registry),
            waiting=Gauge(p + "waiting_sequences", "Sequences waiting for KV capacity", registry=registry),
            kv_usage=Gauge(p + "kv_cache_usage_ratio", "Share of the KV cache in use", registry=registry),
            kv_reserved=Gauge(
                p + "kv_cache_reserved_ratio",
                "Share of KV-cache blocks reserved by admitted sequences",
                registry=registry,
            ),
            requests=Counter(p + "requests", "Finished generation requests", ["endpoint", "status"], registry=registry),
            cancelled=Counter(
                p + "cancelled", "Sequences dropped before their end, freeing their slot", ["reason"], registry=registry
            ),
            rejected=Counter(p + "rejected", "Generation requests refused at the door", ["reason"], registry=registry),
            preempted=Counter(
                p + "preempted",
                "Running sequences paused to honour a share (resumed later by recomputing their prompt and tokens)",
                ["reason"],
                registry=registry,
            ),
        )
