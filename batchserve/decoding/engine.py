"""Token generation with continuous batching: who runs, decided on the event loop; a stepper runs them.

- A stepper (`stepper.py`) runs the sequences on a thread of its own and schedules at the iteration level: a
  finished sequence frees its place at the next step, a new one joins mid-flight. The default is the slot
  stepper (`slot_stepper.py`); `--generation-engine manager` runs transformers' `ContinuousBatchingManager`.
- Each step's new tokens come back to the loop with one `call_soon_threadsafe`, so the loop never blocks on
  model work nor polls, and sees each token as it is made (TTFT, stop strings, early cancel) even unstreamed.
- KV-cache capacity is the admission resource (`kv_budget.py`): a sequence enters the stepper only when its
  worst case fits; otherwise it waits here, and is refused at the door (503) when the predicted wait passes
  its deadline.
- The capacity is shared by tenant and tier (`shares.py`); to honour a share a running sequence may be paused
  (preempted) and later resumed by recomputing its tokens, never failed (`admitter.py` decides).
- Cancelling (client gone, stop string reached) frees the sequence's place at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry

from batchserve import errors
from batchserve.config import Settings
from batchserve.core.ledger import CostAccount
from batchserve.core.tiers import TIERS
from batchserve.errors import ApiError
from batchserve.decoding.admitter import Admitter
from batchserve.decoding.kv_budget import KvBudget
from batchserve.decoding.shares import SPARE, Lane, lane_of
from batchserve.decoding import build
from batchserve.decoding.build import (
    EngineConfig,
    end_tokens,
    enabled,
    longest_token_chars,
    sampling_defaults,
)
from batchserve.decoding.forecast import WaitForecast
from batchserve.decoding.lanes import LaneBooks
from batchserve.decoding.metrics import GenerationMetrics
from batchserve.decoding.sequence import DONE, RUNNING, WAITING, Delta, EngineSequence
from batchserve.decoding.stepper import SamplingParams, Stepper, TokenUpdate

log = logging.getLogger("batchserve.generation")

TICK_S = 0.25  # gauges, tokens/s and queue expiry are refreshed this often
TOKENIZE_THREADS = 2  # chat templating and tokenization run here, off the event loop (the tokenizer frees the GIL)
T = TypeVar("T")
R = TypeVar("R")


async def start_generation(settings: Settings, registry: CollectorRegistry) -> Engine | None:
    """The engine, when generation is enabled, on a model replica and tokenizer of its own.

    Never the batch backend's objects: transformers' forward writes each call's `is_causal` into the shared
    `model.config` for the call's length, so the manager stepper's `is_causal=False` steps overlapping a
    worker's `generate` corrupt its mask (or leave the flag False for good). A shared fast tokenizer's padding
    setting would race likewise."""
    if not enabled(settings):
        return None
    return await Engine.start(settings, registry)


class Engine:
    """Continuous batching on one device: admission and streams on the event loop, steps in a stepper."""

    def __init__(
        self,
        cfg: EngineConfig,
        tokenizer: Any,
        stepper: Stepper,
        registry: CollectorRegistry,
        max_position: int,
        vocab_size: int,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.stepper = stepper
        self.metrics = GenerationMetrics(registry)
        cap = stepper.capacity
        self.budget = KvBudget(total_blocks=cap.blocks, page_size=cap.page_size, max_seqs=cap.max_seqs)
        self.max_context = min(max_position, cap.max_sequence_tokens)
        self.vocab_size = vocab_size
        self.step_s = stepper.step_s  # time per decode step, learned from every inter-token gap
        self.eos_ids = {tokenizer.eos_token_id}
        self.longest_token_chars = longest_token_chars(tokenizer)
        self._tokenize_pool: ThreadPoolExecutor | None = None  # made on first use
        self.lanes = LaneBooks(self.budget)  # who waits and who runs, by lane (`shares.py`)
        self.forecast = WaitForecast(self.lanes)
        self.admitter = Admitter(cfg, self.lanes, self.forecast, stepper, self.metrics, time.monotonic)
        # cost served per (model, tier, tenant) (`core/ledger.py`); the runtime hands the service's account in
        self.account = CostAccount()
        self._order = itertools.count()
        self._tick_task: asyncio.Task | None = None
        self._tokens_at_tick = 0
        self.generated_tokens = 0
        self.cancelled = 0

    # -- life -----------------------------------------------------------------------------------------------
    @classmethod
    async def start(
        cls, settings: Settings, registry: CollectorRegistry, model: Any = None, tokenizer: Any = None
    ) -> Engine:
        """Load its own model replica off the loop (or use the one given), build, warm and start the stepper."""
        cfg = EngineConfig.from_settings(settings)

        def load() -> tuple[Any, Any, Stepper]:
            from batchserve.backends import default_threads, pick_devices
            from batchserve.backends.hf import generation_folder
            from batchserve.backends.smollm2 import load_model, load_tokenizer

            device = pick_devices(settings.devices)[0]
            if device == "cpu" and model is None:
                import torch

                # with no batch backend loaded nothing else sets it, and --torch-threads must reach this model
                torch.set_num_threads(settings.torch_threads or default_threads(decode=True))
            source = generation_folder(settings)  # a --model folder, or smollm2's package folder
            tok = tokenizer if tokenizer is not None else load_tokenizer(source)
            mdl = model if model is not None else load_model(device, source)
            cfg.defaults = sampling_defaults(mdl)
            return tok, mdl, build.build_stepper(mdl, tok, cfg)  # looked up now: a bench stands a device in

        tok, mdl, stepper = await asyncio.to_thread(load)
        c = mdl.config
        engine = cls(cfg, tok, stepper, registry, int(getattr(c, "max_position_embeddings", 8192)), int(c.vocab_size))
        engine.eos_ids.update(end_tokens(mdl, tok))
        stepper.start(asyncio.get_running_loop(), engine._on_updates)
        engine._tick_task = asyncio.create_task(engine._tick())
        log.info(
            "generation ready: %s, %s; %d sequences at most, %d tokens each at most, %.1f ms/step; "
            "batch lines keep %d of them beside interactive work; sampling defaults %s",
            cfg.model_id,
            stepper.description,
            engine.budget.max_seqs,
            engine.max_context,
            engine.step_s * 1000,
            engine.admitter.batch_cap,
            cfg.defaults.describe(),
        )
        return engine

    async def stop(self) -> None:
        self.admitter.draining = True
        if self._tick_task is not None:
            self._tick_task.cancel()
        err = errors.draining("the server stopped before this generation finished")
        for seq in [*self.running.values(), *(s for _, _, s in self.waiting)]:
            self._finish(seq, error=err)
        await asyncio.to_thread(self.stepper.stop, 10)
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.stepper.is_running()

    @property
    def running(self) -> dict[str, EngineSequence]:
        return self.lanes.running

    @property
    def waiting(self) -> list[tuple[int, int, EngineSequence]]:
        return self.lanes.waiting  # (tier, arrival order, sequence), in no particular order

    @property
    def waiting_count(self) -> int:
        return self.lanes.waiting_count

    # -- requests -------------------------------------------------------------------------------------------
    def check_prompt_chars(self, chars: int, max_tokens: int) -> None:
        """400 when a prompt of `chars` characters cannot fit however it tokenizes (no token covers more than
        `longest_token_chars`), checked before tokenizing so a huge prompt costs the event loop nothing."""
        self._check_context(-(-chars // self.longest_token_chars), max_tokens, chars)

    def _check_context(self, tokens: int, max_tokens: int, chars: int | None = None) -> None:
        """400 when a prompt of `tokens` (at least, from `chars` characters) plus max_tokens is over one sequence."""
        if tokens + max_tokens > self.max_context:
            size = f"{tokens} tokens" if chars is None else f"{chars} characters, so at least {tokens} tokens"
            raise errors.invalid(
                f"the prompt ({size}) plus max_tokens ({max_tokens}) is over the {self.max_context} tokens "
                "one sequence may hold here (--generation-max-context)"
            )

    async def tokenize(self, prompt: list[dict[str, str]] | str) -> list[int]:
        """The prompt's token ids (chat messages through the chat template), off the loop."""
        return await self.off_loop(self.encode, prompt)

    async def off_loop(self, fn: Callable[[T], R], arg: T) -> R:
        """`fn(arg)` on the engine's small tokenizing pool: a long prompt takes tens of milliseconds that would
        stall the event loop."""
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, arg)

    def encode(self, prompt: list[dict[str, str]] | str) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        enc = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tier: int = 1,
        streamed: bool = True,
        max_wait_s: float | None = None,
        start_by_s: float | None = None,
        keep_tokens: bool = False,
        on_start: Callable[[EngineSequence], None] | None = None,
        tenant: str = "",
    ) -> EngineSequence:
        """Queue a sequence, or raise the 400/503 that fits. `streamed` False: one delta, the whole text, at the
        end (per-token wake-ups are the loop's main cost at high token rates). `max_wait_s`: the longest predicted
        wait admitted (default `--generation-queue-timeout-ms`); `start_by_s`: how long it may then wait before a
        504 (default `max_wait_s`). `keep_tokens`: keep the ids in `token_ids`; `on_start`: called when it joins
        the stepper; `tenant` and `tier`: its lane."""
        wait_limit = self.cfg.queue_timeout_s if max_wait_s is None else max_wait_s
        self._check_room(prompt_ids, params, lane_of(tenant, tier))
        from batchserve.decoding.textstream import TextStream

        now = time.monotonic()
        seq = EngineSequence(
            id="gen_" + secrets.token_hex(8),
            prompt_ids=prompt_ids,
            params=params,
            tier=tier,
            blocks=self.budget.blocks_for(len(prompt_ids) + params.max_tokens),
            arrived=now,
            deadline=now + (wait_limit if start_by_s is None else start_by_s),
            text=TextStream(self.tokenizer.backend_tokenizer, params.stop),
            streamed=streamed,
            token_ids=[] if keep_tokens else None,
            on_start=on_start,
            tenant=tenant,
            order=next(self._order),
        )
        seq.run_id = seq.id
        self.lanes.queue(seq)
        self.admitter.admit()
        if seq.state == RUNNING:
            return seq
        wait_s = self.predicted_wait_s(seq)
        if wait_s > wait_limit:
            self.lanes.unqueue(seq)  # the kept replays never held it: they stay valid
            self.metrics.rejected.labels("kv_capacity").inc()
            retry_ms = 1000 * (self.step_s * 16 if math.isinf(wait_s) else wait_s - wait_limit)
            raise errors.overloaded(
                f"predicted wait for KV-cache capacity {wait_s:.1f} s would pass the {wait_limit:.1f} s limit",
                retry_after_ms=max(retry_ms, 100),
            )
        self.predicted_wait_s(seq, queued=True)
        self.metrics.waiting.set(self.waiting_count)
        return seq

    def _check_room(self, prompt_ids: list[int], params: SamplingParams, lane: Lane) -> None:
        """The 400 or 503 a sequence gets before it queues (waiting batch lines never fill an interactive queue)."""
        if self.admitter.draining:
            raise errors.draining()
        if not self.healthy:
            raise errors.no_healthy_worker("the generation engine has stopped")
        if not prompt_ids:
            raise errors.invalid("the prompt is empty")
        self._check_context(len(prompt_ids), params.max_tokens)
        queued = self.waiting_count if lane[0] == SPARE else self.lanes.interactive_waiting()
        if queued >= self.cfg.max_waiting:
            self.metrics.rejected.labels("queue_full").inc()
            raise errors.overloaded(
                f"{queued} sequences are already waiting for KV-cache capacity", retry_after_ms=self.step_s * 1000 * 16
            )

    def predicted_wait_s(self, seq: EngineSequence, queued: bool = False) -> float:
        """Seconds until `seq` (queued already, or a probe) would start (`forecast.WaitForecast.wait_s`)."""
        return self.forecast.wait_s(seq, self.step_s, self.admitter.resumable, queued)

    def predicted_start_s(self, max_tokens: int) -> float:
        """Seconds until a new sequence of up to `max_tokens` new tokens would start (`WaitForecast.start_s`)."""
        return self.forecast.start_s(max_tokens, self.step_s)

    def cancel(self, seq: EngineSequence, reason: str = "client_disconnect") -> None:
        """Drop a sequence that nobody will read: its KV blocks and slot go to the next waiting sequence now."""
        if seq.finished:
            return
        self.cancelled += 1
        self.metrics.cancelled.labels(reason).inc()
        self._finish(seq, finish_reason="cancelled")

    async def stream(self, seq: EngineSequence) -> AsyncIterator[Delta]:
        """The sequence's deltas, up to and including the one with its finish reason or error."""
        while True:
            delta: Delta = await seq.deltas.get()
            yield delta
            if delta.finish_reason is not None or delta.error is not None:
                return

    # -- inside ---------------------------------------------------------------------------------------------
    def _on_updates(self, updates: list[TokenUpdate]) -> None:
        """One step's new tokens, on the loop: tens of thousands a second pass here, so per-step work is done once."""
        now = time.monotonic()
        before = self.generated_tokens
        for update in updates:
            seq = self.running.get(update.seq_id)
            if seq is None:  # cancelled or finished here already
                continue
            try:
                self._take(seq, update, now)
            except Exception as exc:  # one sequence's failure must not stop the others'
                log.exception("generation output handling failed for %s", seq.id)
                self._finish(seq, error=errors.inference_failed(f"{type(exc).__name__}: {exc}"))
        self.metrics.output_tokens.inc(self.generated_tokens - before)

    def _take(self, seq: EngineSequence, update: TokenUpdate, now: float) -> None:
        if update.error is not None:
            self._finish(seq, error=errors.inference_failed(update.error), ended=True)
            return
        new = update.tokens
        if not new:
            if update.finished:
                self._finish(seq, finish_reason="length", ended=True)
            return
        if seq.tokens == 0:
            self.metrics.ttft.observe(now - seq.arrived)
        else:
            gap = (now - seq.last_token) / len(new)
            for _ in new:
                self.metrics.itl.observe(gap)
            if not seq.resumed:  # after a pause the gap is the wait and the recompute, not a step
                self.step_s = 0.98 * self.step_s + 0.02 * gap
        seq.resumed = False
        seq.last_token = now
        seq.tokens += len(new)
        seq.made.extend(new)
        if seq.token_ids is not None:
            seq.token_ids.extend(new)
        self.generated_tokens += len(new)
        text = seq.text.push(new[0]) if len(new) == 1 else "".join(seq.text.push(t) for t in new)
        if seq.text.stopped:
            self.metrics.cancelled.labels("stop_string").inc()
            self._finish(seq, text=text, finish_reason="stop", ended=update.finished)
        elif update.finished:
            eos = new[-1] in self.eos_ids and not seq.params.ignore_eos
            self._finish(seq, text=text + seq.text.flush(), finish_reason="stop" if eos else "length", ended=True)
        elif text:
            if seq.streamed:
                seq.deltas.put_nowait(Delta(text, seq.tokens))
            else:
                seq.held.append(text)

    def _finish(
        self,
        seq: EngineSequence,
        text: str = "",
        finish_reason: str | None = None,
        error: ApiError | None = None,
        ended: bool = False,
    ) -> None:
        """Hand the caller its last delta and free its place; `ended`: the stepper ended it (else it drops it)."""
        if seq.finished:
            return
        if seq.state == RUNNING:
            self.lanes.unrun(seq)
            if not ended:
                self.stepper.cancel(seq.run_id)
        elif seq.state == WAITING:
            self.lanes.unqueue(seq)
            self.forecast.forget()
        seq.state, seq.finish_reason = DONE, finish_reason
        if error is None and finish_reason in ("stop", "length"):  # answered: its prompt and tokens were served
            self.account.add(self.cfg.model_id, seq.tier, seq.tenant, float(len(seq.prompt_ids) + seq.tokens))
        if seq.held:
            text = "".join(seq.held) + text
            seq.held.clear()
        seq.deltas.put_nowait(Delta(text, seq.tokens, finish_reason, error))
        self.admitter.admit()

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.metrics.tokens_per_second.set((self.generated_tokens - self._tokens_at_tick) / (now - last))
            self._tokens_at_tick, last = self.generated_tokens, now
            for _, _, seq in self.waiting:
                if now > seq.deadline:  # never a preempted one (its deadline is gone): a started one is answered
                    self.metrics.rejected.labels("queue_timeout").inc()
                    self._finish(seq, error=errors.deadline_exceeded())
            if self.lanes.idle_since and self.waiting_count:
                self.admitter.admit()  # a lingering lane's kept place goes to whoever waits once LINGER_S passes
            self.admitter.gauges()

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model_id,
            "engine": self.stepper.description,
            "healthy": self.healthy,
            "running": len(self.running),
            "waiting": self.waiting_count,
            "running_ids": sorted(s.id for s in self.running.values()),
            "lanes": len(self.lanes.with_work()),  # tenants x (interactive, batch) with work
            "preempted": self.admitter.preemptions,
            "batch_running": self.lanes.spare_running(),  # batch lines running (tier batch)
            "batch_rows_beside_interactive": self.admitter.batch_cap,
            # steps with batch rows beside interactive ones, and without them while batch work waited
            "steps": self.stepper.step_mix(),
            # cost served per tier, tenants summed (no tenant ids here; a tenant's own is at /v1/usage)
            "cost_served": {
                tier.name: {"inputs": got.inputs, "cost": got.cost}
                for tier, got in zip(TIERS, self.account.by_tier(self.cfg.model_id))
                if got.inputs
            },
            "kv_blocks": self.budget.total_blocks,
            "kv_blocks_reserved": self.budget.used_blocks,
            "kv_page_tokens": self.budget.page_size,
            "max_seqs": self.budget.max_seqs,
            "step_ms": round(self.step_s * 1000, 2),
            "generated_tokens": self.generated_tokens,
            "cancelled": self.cancelled,
        }
