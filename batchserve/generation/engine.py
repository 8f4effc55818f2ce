"""Token generation with continuous batching: transformers' `ContinuousBatchingManager`, bridged to asyncio.

Why this shape:
- The manager runs its own generation thread that schedules at the iteration level: a finished sequence frees
  its place at the next step, a new one joins mid-flight. We only feed it and read it.
- Results come back through the library's own bridge (`register_result_handler`): its thread hands each step's
  outputs to the event loop with one `call_soon_threadsafe`, so the loop never blocks on model work and never
  polls. Every sequence is submitted as `streaming=True`, so the loop sees each token as it is made (time to
  first token, inter-token latency, stop strings, early cancel) even when the HTTP answer is not streamed.
- KV-cache capacity is the admission resource (`kv_budget.py`): a sequence enters the manager only when its
  worst case fits; otherwise it waits here, highest tier first, and is refused at the door (503) when the
  predicted wait passes its deadline.
- Cancelling (client gone, stop string reached) tells the manager to drop the sequence and frees its blocks
  and slot at once for the next waiting sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchserve import errors
from batchserve.config import Settings
from batchserve.errors import ApiError
from batchserve.generation.kv_budget import Claim, KvBudget, predicted_wait_s

log = logging.getLogger("batchserve.generation")

TICK_S = 0.25  # gauges, tokens/s and queue expiry are refreshed this often
CPU_KV_TOKENS = 16384  # KV capacity on a CPU when none is configured (~720 MB for SmolLM2 in float32)
CPU_MAX_BATCH_TOKENS = 512  # tokens per forward step on a CPU: bounds a prefill chunk's latency hit on decodes
GPU_MEMORY_SHARE = 0.5  # share of free GPU memory the library may give the KV cache (the static path needs room)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


def enabled(settings: Settings) -> bool:
    """Generation runs with the real model, or when asked for: the sim server stays light."""
    if settings.generation != "auto":
        return settings.generation == "on"
    return any(spec.backend == "smollm2" for spec in settings.models)


@dataclass
class EngineConfig:
    model_id: str = "SmolLM2-135M-Instruct"
    max_tokens: int = 512  # cap on a request's max_tokens, and its default
    kv_tokens: int = 0  # KV capacity in tokens; 0 = auto (GPU: from free memory, CPU: CPU_KV_TOKENS)
    max_seqs: int = 64  # sequences decoding at once
    max_batch_tokens: int = 0  # tokens per forward step; 0 = auto
    page_size: int = 32  # tokens per KV block: the granularity of reservations
    queue_timeout_s: float = 30.0  # longest wait for KV capacity before a sequence starts
    max_waiting: int = 1000  # sequences waiting for capacity before 503
    cuda_graphs: bool = True  # on CUDA, the manager replays its step as CUDA graphs

    @classmethod
    def from_settings(cls, s: Settings) -> "EngineConfig":
        return cls(model_id=s.generation_model, max_tokens=s.generation_max_tokens, kv_tokens=s.generation_kv_tokens,
                   max_seqs=s.generation_max_seqs, queue_timeout_s=s.generation_queue_timeout_ms / 1000,
                   max_waiting=s.max_queue, cuda_graphs=s.generation_cuda_graphs)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 (below 1e-5) = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def processor_kwargs(self) -> dict[str, Any]:
        """Per-request arguments of the engine's logits processors (see sampling.py)."""
        from batchserve.generation import sampling  # torch: imported only where generation runs

        if self.temperature < 1e-5:  # 0, or so close that scores / temperature would overflow: greedy
            return {"temperature": 1.0, "top_p": 1.0, sampling.SEED_KEY: sampling.GREEDY}
        choice = sampling.SAMPLE if self.seed is None else self.seed & sampling.MASK31
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), sampling.SEED_KEY: choice}


@dataclass
class Delta:
    """What the loop hands a caller: new text, and at the end a finish reason (or an error)."""

    text: str
    tokens: int  # completion tokens so far
    finish_reason: str | None = None  # "stop" | "length" once finished
    error: ApiError | None = None


WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    tier: int
    blocks: int
    arrived: float
    deadline: float  # latest start (admission into the manager)
    text: Any  # textstream.TextStream
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = WAITING
    tokens: int = 0
    started: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.state == DONE

    def claim(self) -> Claim:
        return Claim(self.blocks, max(0, self.params.max_tokens - self.tokens))


@dataclass
class GenerationMetrics:
    ttft: Histogram
    itl: Histogram
    output_tokens: Counter
    tokens_per_second: Gauge
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    kv_reserved: Gauge
    requests: Counter
    cancelled: Counter
    rejected: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "GenerationMetrics":
        p = "batchserve_generation_"
        return cls(
            ttft=Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token (queue + prefill)",
                           buckets=TTFT_BUCKETS, registry=registry),
            itl=Histogram(p + "inter_token_latency_seconds", "Gap between consecutive tokens of one sequence",
                          buckets=ITL_BUCKETS, registry=registry),
            output_tokens=Counter(p + "output_tokens", "Generated tokens", registry=registry),
            tokens_per_second=Gauge(p + "output_tokens_per_second", "Generated tokens per second over the last 0.25 s",
                                    registry=registry),
            running=Gauge(p + "running_sequences", "Sequences holding KV blocks in the engine", registry=registry),
            waiting=Gauge(p + "waiting_sequences", "Sequences waiting for KV capacity", registry=registry),
            kv_usage=Gauge(p + "kv_cache_usage_ratio", "Share of KV-cache blocks in use by the library",
                           registry=registry),
            kv_reserved=Gauge(p + "kv_cache_reserved_ratio", "Share of KV-cache blocks reserved by admitted sequences",
                              registry=registry),
            requests=Counter(p + "requests", "Finished generation requests", ["endpoint", "status"],
                             registry=registry),
            cancelled=Counter(p + "cancelled", "Sequences dropped before their end, freeing their slot", ["reason"],
                              registry=registry),
            rejected=Counter(p + "rejected", "Generation requests refused at the door", ["reason"], registry=registry),
        )


def default_device(settings: Settings) -> str:
    from batchserve.backends import pick_devices

    return pick_devices(settings.devices)[0]


def build_manager(model: Any, tokenizer: Any, cfg: EngineConfig) -> Any:
    """A started-ready (not started) manager with per-request temperature, top_p, greedy and seed."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from batchserve.generation import sampling

    on_cpu = model.device.type == "cpu"
    kv_tokens = cfg.kv_tokens or (CPU_KV_TOKENS if on_cpu else 0)
    # Greedy: sampling.py's processors turn the argmax into each request's own draw.
    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=cfg.max_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    # transformers >= 5.18 calls it page_size, 5.17 block_size
    size_field = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} \
        else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{size_field: cfg.page_size},
        num_blocks=math.ceil(kv_tokens / cfg.page_size) if kv_tokens else None,
        max_batch_tokens=cfg.max_batch_tokens or (CPU_MAX_BATCH_TOKENS if on_cpu else None),
        max_memory_percent=None if on_cpu else GPU_MEMORY_SHARE,
        max_requests_per_batch=cfg.max_seqs,
        safety_margin=0.0,  # admission already guarantees every admitted sequence's worst case fits
        per_request_processors=True,
        # On CUDA the step (forward, our sampling, the pick) is replayed as a CUDA graph, one per padded shape;
        # the library would leave graphs off with SDPA (its masks make the padding cost more).
        use_cuda_graph=False if on_cpu else cfg.cuda_graphs,
    )
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=cb_config)
    manager.logit_processor = sampling.processors(sync_free=not on_cpu)
    manager.warmup()  # builds the cache and batch processor (and CUDA graphs where used)
    return manager


async def start_generation(settings: Settings, registry: CollectorRegistry) -> "Engine | None":
    """The engine, when generation is enabled, on a model replica and tokenizer of its own.

    Never the batch backend's objects: transformers' forward wrapper writes each call's `is_causal` into the
    shared `model.config` for the length of the call and restores it after (transformers/utils/generic.py). The
    engine's steps pass `is_causal=False` (SDPA with an explicit mask) from their own thread, so a `generate` in a
    worker thread that overlaps one builds a non-causal mask (garbage), and two overlapping restores can leave
    `config.is_causal = False` for good (every later answer wrong). The tokenizer is not shared either: a padded
    batch call sets padding on the fast tokenizer that an unpadded call from the loop then clears."""
    if not enabled(settings):
        return None
    return await Engine.start(settings, registry)


class Engine:
    """One continuous-batching manager on one device, fed and read from the event loop."""

    def __init__(self, cfg: EngineConfig, tokenizer: Any, manager: Any, registry: CollectorRegistry,
                 step_s: float) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.manager = manager
        self.metrics = GenerationMetrics.create(registry)
        cache = manager.batch_processor.cache
        self.budget = KvBudget(total_blocks=cache.num_blocks, page_size=cfg.page_size, max_seqs=cfg.max_seqs)
        self.max_context = int(getattr(manager.model.config, "max_position_embeddings", 8192))
        self.vocab_size = int(manager.model.config.vocab_size)
        self.step_s = step_s  # time per decode step, learned from every inter-token gap
        self.eos_ids = {tokenizer.eos_token_id}
        self.running: dict[str, Sequence] = {}
        self.waiting: list[tuple[int, int, Sequence]] = []  # heap of (tier, arrival order, sequence)
        self.draining = False
        self._order = itertools.count()
        self._tick_task: asyncio.Task | None = None
        self._tokens_at_tick = 0
        self.generated_tokens = 0
        self.cancelled = 0

    # -- life -----------------------------------------------------------------------------------------------
    @classmethod
    async def start(cls, settings: Settings, registry: CollectorRegistry) -> "Engine":
        """Load its own model replica off the loop, build the manager, warm it with one request, start it."""
        cfg = EngineConfig.from_settings(settings)

        def load() -> tuple[Any, Any, Any, float]:
            from batchserve.backends.smollm2 import load_model, load_tokenizer, source_dir

            source = source_dir(settings)
            tok = load_tokenizer(source)
            mdl = load_model(default_device(settings), source)
            manager = build_manager(mdl, tok, cfg)
            manager.start()
            step_s = warm(manager, tok)
            return tok, mdl, manager, step_s

        tok, mdl, manager, step_s = await asyncio.to_thread(load)
        engine = cls(cfg, tok, manager, registry, step_s)
        engine._tick_task = asyncio.create_task(engine._tick())
        log.info("generation ready: %s on %s, KV %d blocks x %d tokens, %d sequences at most, %.1f ms/step",
                 cfg.model_id, mdl.device, engine.budget.total_blocks, cfg.page_size, cfg.max_seqs, step_s * 1000)
        return engine

    async def stop(self) -> None:
        self.draining = True
        if self._tick_task is not None:
            self._tick_task.cancel()
        err = errors.draining("the server stopped before this generation finished")
        for seq in [*self.running.values(), *(s for _, _, s in self.waiting)]:
            self._finish(seq, error=err)
        await asyncio.to_thread(self.manager.stop, block=True, timeout=10)

    @property
    def healthy(self) -> bool:
        return self.manager.is_running()

    # -- requests -------------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, prompt_ids: list[int], params: SamplingParams, tier: int = 1) -> Sequence:
        """Queue a sequence, or raise the 400/503 that fits. It starts at once when its worst case fits."""
        if self.draining:
            raise errors.draining()
        if not self.healthy:
            raise errors.no_healthy_worker("the generation engine has stopped")
        total = len(prompt_ids) + params.max_tokens
        if not prompt_ids:
            raise errors.invalid("the prompt is empty")
        if total > self.max_context:
            raise errors.invalid(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                                 f"over the model's context of {self.max_context} tokens")
        blocks = self.budget.blocks_for(total)
        if blocks > self.budget.total_blocks:
            raise errors.invalid(f"the prompt plus max_tokens ({total} tokens) is over this server's KV-cache "
                                 f"capacity of {self.budget.capacity_tokens} tokens")
        if len(self.waiting) >= self.cfg.max_waiting:
            self.metrics.rejected.labels("queue_full").inc()
            raise errors.overloaded(f"{len(self.waiting)} sequences are already waiting for KV-cache capacity",
                                    retry_after_ms=self.step_s * 1000 * 16)
        from batchserve.generation.textstream import TextStream

        now = time.monotonic()
        seq = Sequence(id="gen_" + secrets.token_hex(8), prompt_ids=prompt_ids, params=params, tier=tier,
                       blocks=blocks, arrived=now, deadline=now + self.cfg.queue_timeout_s,
                       text=TextStream(self.tokenizer.backend_tokenizer, params.stop))
        if not (self.waiting or not self.budget.fits(blocks)):
            self._start(seq)
            return seq
        wait_s = self.predicted_wait_s(seq)
        if wait_s > self.cfg.queue_timeout_s:
            self.metrics.rejected.labels("kv_capacity").inc()
            retry_ms = 1000 * (self.step_s * 16 if math.isinf(wait_s) else wait_s - self.cfg.queue_timeout_s)
            raise errors.overloaded(f"predicted wait for KV-cache capacity {wait_s:.1f} s would pass the "
                                    f"{self.cfg.queue_timeout_s:.0f} s limit", retry_after_ms=max(retry_ms, 100))
        heapq.heappush(self.waiting, (tier, next(self._order), seq))
        self.metrics.waiting.set(len(self.waiting))
        return seq

    def predicted_wait_s(self, seq: Sequence) -> float:
        ahead = [s.claim() for _, _, s in sorted(self.waiting) if s.tier <= seq.tier]  # finished ones leave it
        return predicted_wait_s(self.budget, [s.claim() for s in self.running.values()], ahead, seq.claim(),
                                self.step_s)

    def cancel(self, seq: Sequence, reason: str = "client_disconnect") -> None:
        """Drop a sequence that nobody will read: its KV blocks and slot go to the next waiting sequence now."""
        if seq.finished:
            return
        self.cancelled += 1
        self.metrics.cancelled.labels(reason).inc()
        if seq.state == RUNNING:
            self.manager.cancel_request(seq.id)
        self._finish(seq, finish_reason="cancelled")

    async def stream(self, seq: Sequence) -> AsyncIterator[Delta]:
        """The sequence's deltas, up to and including the one with its finish reason or error."""
        while True:
            delta: Delta = await seq.deltas.get()
            yield delta
            if delta.finish_reason is not None or delta.error is not None:
                return

    # -- inside ---------------------------------------------------------------------------------------------
    def _start(self, seq: Sequence) -> None:
        self.budget.take(seq.blocks)
        seq.state, seq.started = RUNNING, time.monotonic()
        self.running[seq.id] = seq
        self.manager.register_result_handler(seq.id, lambda out, s=seq: self._on_output(s, out))
        self.manager.add_request(seq.prompt_ids, request_id=seq.id, max_new_tokens=seq.params.max_tokens,
                                 streaming=True, eos_token_id=-1 if seq.params.ignore_eos else None,
                                 **seq.params.processor_kwargs())
        self._gauges()

    def _admit_waiting(self) -> None:
        while self.waiting and not self.draining:
            _, _, seq = self.waiting[0]
            if not self.budget.fits(seq.blocks):
                break
            heapq.heappop(self.waiting)
            self._start(seq)
        self._gauges()

    def _on_output(self, seq: Sequence, out: Any) -> None:
        """Runs on the loop (via the library's call_soon_threadsafe) with the sequence's tokens so far."""
        try:
            self._take_output(seq, out)
        except Exception as exc:  # noqa: BLE001 - one sequence's failure must not stop the others' callbacks
            log.exception("generation output handling failed for %s", seq.id)
            self._finish(seq, error=errors.inference_failed(f"{type(exc).__name__}: {exc}"))

    def _take_output(self, seq: Sequence, out: Any) -> None:
        if seq.state != RUNNING:
            return
        if out.error is not None:
            self._finish(seq, error=errors.inference_failed(out.error))
            return
        now = time.monotonic()
        new = out.generated_tokens[seq.tokens:]
        if not new:
            if out.is_finished():
                self._finish(seq, finish_reason="length")
            return
        if seq.tokens == 0:
            seq.first_token = now
            self.metrics.ttft.observe(now - seq.arrived)
        else:
            gap = (now - seq.last_token) / len(new)
            for _ in new:
                self.metrics.itl.observe(gap)
            self.step_s = 0.98 * self.step_s + 0.02 * gap
        seq.last_token = now
        seq.tokens += len(new)
        self.generated_tokens += len(new)
        self.metrics.output_tokens.inc(len(new))
        text = "".join(seq.text.push(t) for t in new)
        if seq.text.stopped:
            self.manager.cancel_request(seq.id)
            self.metrics.cancelled.labels("stop_string").inc()
            self._finish(seq, text=text, finish_reason="stop")
        elif out.is_finished():
            eos = new[-1] in self.eos_ids and not seq.params.ignore_eos
            self._finish(seq, text=text + seq.text.flush(), finish_reason="stop" if eos else "length")
        elif text:
            seq.deltas.put_nowait(Delta(text, seq.tokens))

    def _finish(self, seq: Sequence, text: str = "", finish_reason: str | None = None,
                error: ApiError | None = None) -> None:
        if seq.finished:
            return
        if seq.state == RUNNING:
            self.running.pop(seq.id, None)
            self.budget.give(seq.blocks)
            forget_handler(self.manager, seq.id)
        elif seq.state == WAITING:
            self.waiting = [entry for entry in self.waiting if entry[2] is not seq]
            heapq.heapify(self.waiting)
        seq.state, seq.finish_reason = DONE, finish_reason
        seq.deltas.put_nowait(Delta(text, seq.tokens, finish_reason, error))
        self._admit_waiting()

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.metrics.tokens_per_second.set((self.generated_tokens - self._tokens_at_tick) / (now - last))
            self._tokens_at_tick, last = self.generated_tokens, now
            for _, _, seq in list(self.waiting):
                if now > seq.deadline:
                    self.metrics.rejected.labels("queue_timeout").inc()
                    self._finish(seq, error=errors.deadline_exceeded())
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.kv_reserved.set(self.budget.reserved_ratio)
        self.metrics.kv_usage.set(kv_usage(self.manager))

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model_id,
            "healthy": self.healthy,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "running_ids": sorted(self.running),
            "kv_blocks": self.budget.total_blocks,
            "kv_blocks_reserved": self.budget.used_blocks,
            "kv_page_tokens": self.budget.page_size,
            "max_seqs": self.budget.max_seqs,
            "step_ms": round(self.step_s * 1000, 2),
            "generated_tokens": self.generated_tokens,
            "cancelled": self.cancelled,
        }


def kv_usage(manager: Any) -> float:
    """Share of the cache the library has in use (its API moved between transformers 5.17 and 5.24)."""
    cache = manager.batch_processor.cache if manager.batch_processor is not None else None
    if cache is None:
        return 0.0
    if hasattr(cache, "compute_free_capacity"):
        return 1.0 - cache.compute_free_capacity()
    return 1.0 - cache.get_num_free_blocks() / cache.num_blocks


def forget_handler(manager: Any, request_id: str) -> None:
    """Drop a sequence's result handler; the library removes it only on a finished output, never on cancel."""
    router = manager.output_router
    with router._lock:
        router.result_handlers.pop(request_id, None)


def warm(manager: Any, tokenizer: Any, tokens: int = 8) -> float:
    """Run one short greedy request to the end; return the time per decode step it showed."""
    ids = list(tokenizer("Hello, how are you?", add_special_tokens=False)["input_ids"])
    kwargs = SamplingParams(max_tokens=tokens, temperature=0).processor_kwargs()
    request_id = manager.add_request(ids, request_id="warmup", max_new_tokens=tokens, streaming=True,
                                     eos_token_id=-1, **kwargs)
    first = None
    for out in manager.request_id_iter(request_id):
        if first is None and out.generated_tokens:
            first = time.monotonic()
        if out.is_finished():
            if out.error:
                raise RuntimeError(f"warm-up generation failed: {out.error}")
            break
    if first is None:
        raise RuntimeError("warm-up generation produced nothing")
    return max(1e-4, (time.monotonic() - first) / (tokens - 1))
