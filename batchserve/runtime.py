"""What one server process holds while it runs, and its life: load and warm, serve, drain, stop."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from batchserve import errors
from batchserve.admission import AdmissionState
from batchserve.backends import Backend, make_backend
from batchserve.batcher import Batcher
from batchserve.config import Settings
from batchserve.generation import Engine, start_generation
from batchserve.gpu_pool import GpuPool
from batchserve.jobs.service import JobService
from batchserve.metrics import Metrics, make_metrics
from batchserve.models import ModelRegistry
from batchserve.requests_log import RequestLog
from batchserve.tenancy import Tenancy
from batchserve.warmup import derive_deadlines, warm_until_stable

log = logging.getLogger("batchserve")

TICK_S = 1.0  # how often rates and busy ratios are refreshed


@dataclass
class Runtime:
    settings: Settings
    registry: ModelRegistry
    metrics: Metrics
    requests: RequestLog
    batcher: Batcher
    tenancy: Tenancy
    pool: GpuPool | None = None
    jobs: JobService | None = None  # batch jobs (/v1/batches), started once the workers are
    generation: Engine | None = None  # token generation (/v1/chat/completions), when enabled
    backends: dict[str, Backend] = field(default_factory=dict)
    ready: bool = False
    startup_error: str = ""
    on_startup_failure: Callable[[str], None] | None = None  # the server exits (non-zero) when start-up fails
    inflight: int = 0
    answered: int = 0  # requests answered since start, any status
    requests_per_second: float = 0.0
    gpu_utilization: float = 0.0
    busy_ratios: dict[str, float] = field(default_factory=dict)
    ok_metrics: dict[str, tuple] = field(default_factory=dict)  # per model: bound 200-counter and histogram
    admission: AdmissionState = field(default_factory=AdmissionState)  # arrival rates, prediction error
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def create(cls, settings: Settings) -> "Runtime":
        registry = ModelRegistry(settings.models)
        batcher = Batcher(
            max_batch_size=settings.max_batch_size,
            slo_s=settings.slo_ms / 1000,
            margin_s=settings.dispatch_margin_ms / 1000,
            batch_s={spec.id: spec.sim_batch_ms / 1000 for spec in settings.models},
        )
        rt = cls(settings, registry, make_metrics(), RequestLog(settings.request_history), batcher,
                 Tenancy.from_settings(settings))
        rt.metrics.inflight.set_function(lambda: rt.inflight)  # read at scrape time: nothing per request
        return rt

    @property
    def draining(self) -> bool:
        return self.batcher.draining

    # -- start ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm every backend off the event loop, then start the workers; /readyz turns 200 after."""
        try:
            for spec in self.settings.models:
                self.backends[spec.id] = await asyncio.to_thread(make_backend, spec, self.settings)
            devices = next(iter(self.backends.values())).device_names()
            await self._warm(devices)
            self.pool = GpuPool(self.backends, self.batcher, self.metrics, asyncio.get_running_loop(), devices,
                                self.settings.gpu_timeout_ms / 1000)
            self.pool.demand = lambda: self.admission.arrivals.current(time.monotonic())
            self.pool.start()
            self.jobs = await JobService.start(self)
            self.generation = await start_generation(self)
            self.ready = True
            self._tasks.append(asyncio.create_task(self._tick()))
            log.info("ready: %d worker(s) on %s; models %s", len(devices), ", ".join(devices),
                     ", ".join(self.registry.by_id))
        except Exception as exc:  # noqa: BLE001 - one line, then the process exits (it could never serve)
            self.startup_error = f"{type(exc).__name__}: {exc}"
            log.debug("start-up failed", exc_info=True)
            log.error("start-up failed: %s", self.startup_error)
            if self.on_startup_failure is not None:
                self.on_startup_failure(self.startup_error)

    async def _warm(self, devices: list[str]) -> None:
        """Warm every model on every device. A real model is warmed until its batch time is stable, the learned
        batch time starts from that, and the SLO and default timeout the user left unset follow from it."""
        slowest = 0.0
        for spec in self.settings.models:
            backend = self.backends[spec.id]
            times = []
            for device in range(len(devices)):
                if spec.backend == "sim":  # its batch time is a setting: once is enough
                    await asyncio.to_thread(backend.warm, device)
                    continue
                warm = await asyncio.to_thread(warm_until_stable, functools.partial(backend.warm, device))
                log.info("warmed %s on %s: %s ms%s", spec.id, devices[device],
                         ", ".join(f"{t * 1000:.0f}" for t in warm.rounds_s), "" if warm.stable else " (not stable)")
                times.append(warm.batch_s)
            if times:
                self.batcher.batch_s[spec.id] = max(times)
                slowest = max(slowest, max(times))
        if slowest:
            derived = derive_deadlines(self.settings, slowest)
            if derived.slo_ms is not None:
                self.settings.slo_ms = derived.slo_ms
                self.batcher.slo_s = derived.slo_ms / 1000
            if derived.timeout_ms is not None:
                self.settings.timeout_ms = derived.timeout_ms
            log.info("deadlines from the warm-up batch time %.0f ms: slo_ms=%.0f (%s) timeout_ms=%.0f (%s)",
                     slowest * 1000, self.settings.slo_ms, "derived" if derived.slo_ms is not None else "set",
                     self.settings.timeout_ms, "derived" if derived.timeout_ms is not None else "set")
            if slowest * 1000 >= self.settings.max_timeout_ms:
                log.warning("a batch takes %.0f ms, longer than --max-timeout-ms %.0f: every request will be "
                            "refused (fewer --max-new-tokens, a GPU, or a larger --max-timeout-ms)",
                            slowest * 1000, self.settings.max_timeout_ms)

    async def _tick(self) -> None:
        last_answered, last_time = self.answered, time.monotonic()
        last_busy: dict[str, float] = {}
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            elapsed = now - last_time
            self.requests_per_second = (self.answered - last_answered) / elapsed
            last_answered, last_time = self.answered, now
            if self.pool is not None:
                for w in self.pool.workers:
                    total = w.busy_total(now)
                    ratio = min(1.0, (total - last_busy.get(w.name, total)) / elapsed)
                    last_busy[w.name] = total
                    self.busy_ratios[w.name] = ratio
                    self.metrics.worker_busy_ratio.labels(w.name).set(ratio)
                healthy = [self.busy_ratios.get(w.name, 0.0) for w in self.pool.workers if w.healthy]
                self.gpu_utilization = sum(healthy) / len(healthy) if healthy else 0.0
            for model in self.registry.by_id:
                self.metrics.queue_depth.labels(model).set(self.batcher.depth.get(model, 0))

    # -- stop ----------------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Refuse new work, answer everything queued and running, within `drain_timeout_s`."""
        log.info("draining: %d request(s) in flight", self.inflight)
        self.batcher.start_drain()
        give_up = time.monotonic() + self.settings.drain_timeout_s
        while self.inflight > 0 and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        if self.inflight > 0:
            err = errors.ApiError(503, "DRAINING", "the server stopped before this request could run",
                                  retry_after_ms=1000)
            left = self.batcher.drop_all(err)
            if self.pool is not None:
                for w in self.pool.workers:
                    if w.batch is not None:
                        for item in w.batch.items:
                            if not item.future.done():
                                item.future.set_exception(err)
                                left += 1
            log.warning("drain timeout: %d request(s) answered 503 DRAINING", left)
            while self.inflight > 0 and time.monotonic() < give_up + 1.0:
                await asyncio.sleep(0.01)
        log.info("drained")

    async def stop(self) -> None:
        if self.generation is not None:
            await self.generation.stop()
        if self.jobs is not None:
            await self.jobs.stop()
        for task in self._tasks:
            task.cancel()
        if self.pool is not None:
            self.pool.stop()
