"""KServe Open Inference Protocol v2 over HTTP (Triton's clients, perf_analyzer, KServe's platform)."""
