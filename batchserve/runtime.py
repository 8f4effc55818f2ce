"""What one server process holds while it runs, and its life: load and warm, serve, drain, stop.

The runtime wires the wings together: the batcher and its door (`core.service.InferenceService`, which owns
admission), the worker pool, the batch jobs and the generation engine. Route modules read it from
`app.state.rt`; the wings themselves receive only the narrow parts they need.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from batchserve import errors
from batchserve.backends import Backend, make_backend
from batchserve.batch_time import BatchTimes
from batchserve.batcher import Batcher
from batchserve.config import Settings
from batchserve.core.admission import Admission
from batchserve.core.requests_log import RequestLog
from batchserve.core.service import InferenceService
from batchserve.generation.engine import Engine, start_generation
from batchserve.gpu_pool import GpuPool
from batchserve.jobs.service import JobService
from batchserve.metrics import Metrics, make_metrics
from batchserve.models import ModelRegistry
from batchserve.tenancy import Tenancy

log = logging.getLogger("batchserve")

TICK_S = 1.0  # how often rates and busy ratios are refreshed


@dataclass
class Runtime:
    settings: Settings
    registry: ModelRegistry
    metrics: Metrics
    requests: RequestLog
    batcher: Batcher
    admission: Admission
    service: InferenceService
    tenancy: Tenancy
    backends: dict[str, Backend]
    pool: GpuPool | None = None
    jobs: JobService | None = None  # batch jobs (/v1/batches), started once the workers are
    generation: Engine | None = None  # token generation (/v1/chat/completions), when enabled
    ready: bool = False
    startup_error: str = ""
    answered: int = 0  # requests answered since start, any status
    requests_per_second: float = 0.0
    gpu_utilization: float = 0.0
    busy_ratios: dict[str, float] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def create(cls, settings: Settings) -> "Runtime":
        batcher = Batcher(
            max_batch_size=settings.max_batch_size,
            slo_s=settings.slo_ms / 1000,
            margin_s=settings.dispatch_margin_ms / 1000,
            batch_s=BatchTimes(settings.max_batch_size,
                               {spec.id: spec.sim_batch_ms / 1000 for spec in settings.models}),
        )
        admission = Admission(batcher, None, settings.max_queue, settings.slo_ms / 1000, settings.admission_slack)
        requests = RequestLog(settings.request_history)
        backends: dict[str, Backend] = {}
        service = InferenceService(batcher, admission, backends, requests)
        rt = cls(settings, ModelRegistry(settings.models), make_metrics(), requests, batcher, admission, service,
                 Tenancy.from_settings(settings), backends)
        rt.metrics.inflight.set_function(lambda: service.inflight)  # read at scrape time: nothing per request
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
            for spec in self.settings.models:
                backend = self.backends[spec.id]
                for device in range(len(devices)):
                    started = time.monotonic()
                    timings = await asyncio.to_thread(backend.warm, device)
                    if spec.backend != "sim":  # a real model's batch time is learned, starting from warm-up
                        for size, seconds in (timings or {1: time.monotonic() - started}).items():
                            self.batcher.batch_s.observe(spec.id, size, seconds)
            self.pool = GpuPool(self.backends, self.batcher, self.metrics, asyncio.get_running_loop(), devices,
                                self.settings.gpu_timeout_ms / 1000)
            self.pool.demand = self.admission.arrival_rate
            self.pool.start()
            self.service.attach(self.pool)
            self.jobs = await JobService.start(self.service, self.settings, self.metrics.registry)
            self.generation = await start_generation(self.settings, self.metrics.registry)
            self.ready = True
            self._tasks.append(asyncio.create_task(self._tick()))
            log.info("ready: %d worker(s) on %s; models %s", len(devices), ", ".join(devices),
                     ", ".join(self.registry.by_id))
        except Exception as exc:  # noqa: BLE001 - reported on /readyz and in the log, the process stays up
            self.startup_error = f"{type(exc).__name__}: {exc}"
            log.exception("start-up failed; /readyz stays 503")

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
        log.info("draining: %d request(s) in flight", self.service.inflight)
        self.batcher.start_drain()
        give_up = time.monotonic() + self.settings.drain_timeout_s
        while self.service.inflight > 0 and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        if self.service.inflight > 0:
            err = errors.draining("the server stopped before this request could run")
            left = self.batcher.drop_all(err)
            if self.pool is not None:
                for w in self.pool.workers:
                    if w.batch is not None:
                        for item in w.batch.items:
                            if not item.future.done():
                                item.future.set_exception(err)
                                left += 1
            log.warning("drain timeout: %d request(s) answered 503 DRAINING", left)
            while self.service.inflight > 0 and time.monotonic() < give_up + 1.0:
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
