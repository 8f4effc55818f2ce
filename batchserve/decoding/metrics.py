"""The decoding engine's Prometheus series: time to first token, inter-token latency, tokens, sequences, the KV
cache, refusals and preemptions (`batchserve_generation_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchserve.metrics import LoopHistogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "batchserve_generation_"
        # written on the event loop only: per token, a locked prometheus Histogram cost ~5 us
        self.ttft = LoopHistogram(
            p + "time_to_first_token_seconds",
            "Arrival to first generated token (queue + prefill)",
            (),
            TTFT_BUCKETS,
            registry,
        ).labels()
        self.itl = LoopHistogram(
            p + "inter_token_latency_seconds",
            "Gap between consecutive tokens of one sequence",
            (),
            ITL_BUCKETS,
            registry,
        ).labels()
        self.output_tokens = Counter(p + "output_tokens", "Generated tokens", registry=registry)
        self.tokens_per_second = Gauge(
            p + "output_tokens_per_second", "Generated tokens per second over the last 0.25 s", registry=registry
        )
        self.running = Gauge(p + "running_sequences", "Sequences holding KV blocks in the engine", registry=registry)
        self.waiting = Gauge(p + "waiting_sequences", "Sequences waiting for KV capacity", registry=registry)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Share of the KV cache in use", registry=registry)
        self.kv_reserved = Gauge(
            p + "kv_cache_reserved_ratio", "Share of KV-cache blocks reserved by admitted sequences", registry=registry
        )
        self.requests = Counter(
            p + "requests", "Finished generation requests", ["endpoint", "status"], registry=registry
        )
        self.cancelled = Counter(
            p + "cancelled", "Sequences dropped before their end, freeing their slot", ["reason"], registry=registry
        )
        self.rejected = Counter(
            p + "rejected", "Generation requests refused at the door", ["reason"], registry=registry
        )
        self.preempted = Counter(
            p + "preempted",
            "Running sequences paused to honour a share (resumed later by recomputing their prompt and tokens)",
            ["reason"],
            registry=registry,
        )
