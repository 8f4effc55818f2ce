"""The decoding engine's Prometheus series: time to first token, inter-token latency, tokens, sequences, the KV
cache, refusals and preemptions (`batchserve_generation_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchserve.metrics import HistogramChild, LoopHistogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
PREFIX = "batchserve_generation_"


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=registry)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> HistogramChild:
            # written on the event loop only: per token, a locked prometheus Histogram cost ~5 us
            return LoopHistogram(PREFIX + name, doc, (), buckets, registry).labels()

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token (queue + prefill)", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens of one sequence", ITL_BUCKETS
        )
        self.output_tokens = counter("output_tokens", "Generated tokens")
        self.tokens_per_second = gauge("output_tokens_per_second", "Generated tokens per second over the last 0.25 s")
        self.running = gauge("running_sequences", "Sequences holding KV blocks in the engine")
        self.waiting = gauge("waiting_sequences", "Sequences waiting for KV capacity")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Share of the KV cache in use")
        self.kv_reserved = gauge("kv_cache_reserved_ratio", "Share of KV-cache blocks reserved by admitted sequences")
        self.requests = counter("requests", "Finished generation requests", "endpoint", "status")
        self.cancelled = counter("cancelled", "Sequences dropped before their end, freeing their slot", "reason")
        self.rejected = counter("rejected", "Generation requests refused at the door", "reason")
        self.preempted = counter(
            "preempted",
            "Running sequences paused to honour a share (resumed later by recomputing their prompt and tokens)",
            "reason",
        )
