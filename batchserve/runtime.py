"""What one server process holds while it runs, and its life: load and warm, serve, drain, stop.

The runtime wires the wings together: the batcher and its door (`core.service.InferenceService`), the worker
pool, the batch jobs and the generation engine. Route modules read it from `app.state.rt` through a Protocol of
their own wing (`inference.routes.InferenceHost`, ...), so no wing imports this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TypeVar
from collections.abc import Callable

from batchserve import errors
from batchserve.backends import Backend, PluginError
from batchserve.backends.warmup import deadlines_for, log_deadlines
from batchserve.backends.loading import EXIT_BACKEND_FAILED, EXIT_STARTUP_FAILED, LOAD_THREAD, LoadedModels, load_models
from batchserve.core.batch import BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.core import load_signal
from batchserve.config import Settings
from batchserve.http.model_choice import ModelRegistry
from batchserve.knobs import proxy_list
from batchserve.core.admission import Admission
from batchserve.core.refusals import RefusalThrottle
from batchserve.core.ledger import RequestLog
from batchserve.core.service import InferenceService, tokens_in
from batchserve.gc_tuning import freeze_late_startup_objects
from batchserve.decoding.engine import Engine, start_generation
from batchserve.generation.routes import model_cards
from batchserve.generation.inference import StepperInference, serve_on_stepper, stepper_models
from batchserve.generation.inference_records import StepperRecords
from batchserve.gpu_pool import GpuPool
from batchserve.jobs.service import JobService
from batchserve.metrics import AdmissionWaitCollector, Metrics, make_metrics
from batchserve.slo import Deadlines
from batchserve.http.guards import Guard, Tenancy
from batchserve.tracing import Tracing

log = logging.getLogger("batchserve")

TICK_S = 1.0  # how often rates and busy ratios are refreshed
T = TypeVar("T")


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a daemon thread of its own, awaited. Not `asyncio.to_thread`: the loop's default executor is
    joined at exit, so a SIGTERM during a minutes-long model load would wait for the load to finish before
    the process could stop."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if done.set_running_or_notify_cancel():  # False: the server stopped before the thread began
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wrap_future(done)


@dataclass
class Runtime:
    settings: Settings
    registry: ModelRegistry
    metrics: Metrics
    requests: RequestLog
    batcher: Batcher
    admission: Admission
    service: InferenceService
    guard: Guard
    backends: dict[str, Backend]
    loaded: LoadedModels | None = None  # the backends, set up and warmed (given by an embedder, or start's)
    pool: GpuPool | None = None
    jobs: JobService | None = None  # started once the workers are
    generation: Engine | None = None  # when enabled
    stepper: StepperInference | None = None  # /v1/inference of the stepper models, on the engine
    tracing: Tracing | None = None  # when an OTLP endpoint is configured
    refusals: RefusalThrottle = field(default_factory=lambda: RefusalThrottle(0.0))
    ready: bool = False
    startup_error: str = ""
    on_startup_failure: Callable[[str, int], None] | None = None
    requests_per_second: float = 0.0
    gpu_utilization: float = 0.0
    busy_ratios: dict[str, float] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def create(cls, settings: Settings, loaded: LoadedModels | None = None) -> Runtime:
        slo_s, max_timeout_s = settings.slo_ms / 1000, settings.max_timeout_ms / 1000
        batcher = Batcher(
            max_batch_size=settings.max_batch_size,
            slo_s=slo_s,
            margin_s=settings.dispatch_margin_ms / 1000,
            batch_s=BatchTimes(
                settings.max_batch_size, {spec.id: spec.sim_batch_ms / 1000 for spec in settings.models}
            ),
            max_batch_cost=settings.max_batch_tokens,
            max_batch_s=max_timeout_s / 2,
        )
        admission = Admission(
            batcher, None, settings.max_queue, slo_s, settings.admission_slack, max_timeout_s=max_timeout_s
        )
        requests = RequestLog(settings.request_history)
        backends: dict[str, Backend] = {}
        service = InferenceService(batcher, admission, backends, requests)
        metrics = make_metrics()
        registry = ModelRegistry(settings.models)
        gateways = tuple(ipaddress.ip_network(p, strict=False) for p in proxy_list(settings.gateway_ips))
        guard = Guard(Tenancy.from_settings(settings), metrics, settings.metrics_key, slo_s=slo_s, gateways=gateways)
        # Each model's own SLO and timeouts, until its warm-up says otherwise: one dict, shared by every reader.
        registry.deadlines.update((spec.id, Deadlines.of_settings(settings)) for spec in settings.models)
        batcher.deadlines = admission.deadlines = guard.deadlines = registry.deadlines
        rt = cls(settings, registry, metrics, requests, batcher, admission, service, guard, backends, loaded)
        rt.refusals = RefusalThrottle(settings.refused_per_s)
        rt.metrics.inflight.set_function(lambda: service.inflight)  # read at scrape time: nothing per request
        load_signal.export(rt.metrics.load_ratio, rt.metrics.predicted_wait_ratio, rt.load_reading)
        load_signal.GatewayGauges(rt.model_loads, rt.metrics.registry)
        AdmissionWaitCollector(admission.wait_totals, rt.metrics.registry)
        return rt

    def model_loads(self) -> dict[str, load_signal.ModelLoad]:
        """Each model's waiting and running requests now, for the gateway gauges (an element of a multi-input
        request counts as one); for the generation model, its sequences and KV cache."""
        counts = {model: [self.batcher.depth.get(model, 0), 0] for model in self.registry.by_id}
        if self.pool is not None:
            for w in self.pool.workers:
                batch = w.batch
                if batch is not None:
                    counts.setdefault(batch.model, [0, 0])[1] += len(batch.items)
        loads = {model: load_signal.ModelLoad(waiting, running) for model, (waiting, running) in counts.items()}
        engine = self.generation
        if engine is not None:
            loads[engine.cfg.model_id] = load_signal.ModelLoad(
                len(engine.waiting), len(engine.running), engine.stepper.kv_usage()
            )
        return loads

    def load_reading(self) -> load_signal.Reading:
        """What the autoscaling signals are computed from, now: the batcher's, and the generation engine's demand
        against its slots with its predicted wait for a new sequence (None when the engine is off)."""
        now = time.monotonic()
        pool, engine = self.pool, self.generation
        healthy = pool.healthy_count() if pool is not None else 0
        times = self.batch_times()
        slowest = max(times, key=times.__getitem__, default="")  # its batch time is read: so is its SLO
        engine_load = None
        if engine is not None:
            engine_load = load_signal.EngineLoad(
                len(engine.running),
                len(engine.waiting),
                engine.budget.max_seqs,
                lambda: engine.predicted_start_s(self.settings.max_new_tokens),
                self.stepper.run_s() if self.stepper is not None else 0.0,
                engine.healthy,
                self.batcher.slo_of(engine.cfg.model_id),
            )
        return load_signal.Reading(
            self.admission.arrivals.current(now),
            healthy,
            self.batcher.max_batch_size,
            times.get(slowest, 0.0),
            pool.seconds_until_free(now) if pool is not None and healthy else 0.0,
            self.batcher.total_depth(),
            self.batcher.slo_of(slowest),
            engine_load,
        )

    def batch_times(self) -> dict[str, float]:
        """The learned full-batch time of each model the batcher serves (not those another handler answers: their
        batch time is an unused seed)."""
        return {m: v for m, v in self.batcher.batch_s.items() if m not in self.service.handlers}

    def answer_times(self) -> dict[str, float]:
        """The answer time of each model the generation engine's stepper serves."""
        stepper = self.stepper
        return {m: stepper.run_s() for m, h in self.service.handlers.items() if h is stepper} if stepper else {}

    @property
    def draining(self) -> bool:
        return self.batcher.draining

    def not_ready_reason(self) -> str | None:
        """Why the node should not be sent traffic now, or None when it is ready (/readyz, KServe v2's ready)."""
        if self.draining:
            return "draining"
        if self.startup_error:
            return f"start-up failed: {self.startup_error}"
        if not self.ready:
            return "warming up"
        if (self.pool.healthy_count() if self.pool else 0) == 0:
            return "no healthy worker"
        return None

    def model_cards(self) -> list[dict[str, object]]:
        """GET /v1/models' entries for the generation engine's models, with the SLO its answers are held to."""
        cards = model_cards(self.generation)
        for card in cards:
            d = self.registry.deadlines.get(str(card["id"]))
            if d is not None:
                card["slo_ms"] = d.public()["slo_ms"]
        return cards

    def prompt_tokens(self, model: str, texts: list[str]) -> int:
        """The model's token count of these texts (0 when its backend cannot count), for OpenAI's usage."""
        return tokens_in(self.backends.get(model), texts)

    # -- start ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm the backends off the event loop while the port is already open, then start the workers;
        /healthz is 200 throughout, /readyz turns 200 after."""
        try:
            elsewhere = stepper_models(self.settings)  # answered by the engine: their batch backends stay shells
            if self.loaded is None:
                self.loaded = await in_daemon_thread(lambda: load_models(self.settings, elsewhere), LOAD_THREAD)
            loaded = self.loaded
            self.derive_deadlines(
                {m: loaded.measured.get(m) for m in self.registry.by_id if m not in elsewhere}, "the warm-up batch time"
            )
            pool = self.start_pool(loaded)
            await self.start_engine(elsewhere)  # not ready (at /readyz and at the door) until its replica is up
            self.service.attach(pool)
            self.jobs = await JobService.start(
                self.service, self.settings, self.metrics.registry, self.prompt_tokens, self.generation
            )
            freeze_late_startup_objects()  # the generation replica and whatever else loaded here: never garbage
            self.ready = True
            self._tasks.append(asyncio.create_task(self._tick()))
            log.info(
                "ready: %d worker(s) on %s; models %s",
                len(loaded.devices),
                ", ".join(loaded.devices),
                ", ".join(self.registry.by_id),
            )
        except Exception as exc:  # one line, then the process exits (it could never serve)
            plugin = isinstance(exc, PluginError)  # the backend's own line (the CLI prints it last), then exit 2
            self.startup_error = str(exc) if plugin else f"{type(exc).__name__}: {exc}"
            if not plugin:
                log.debug("start-up failed", exc_info=True)
            log.error("start-up failed: %s", self.startup_error)
            if self.on_startup_failure is not None:
                self.on_startup_failure(self.startup_error, EXIT_BACKEND_FAILED if plugin else EXIT_STARTUP_FAILED)

    def start_pool(self, loaded: LoadedModels) -> GpuPool:
        """Seed the batcher with what the warm-up measured, and start a worker per device."""
        self.backends.update(loaded.backends)
        for model, seconds in loaded.batch_s.items():
            self.batcher.batch_s.seed(model, seconds)
        for model, timings in loaded.batch_s_by_size.items():
            for size, seconds in timings.items():
                self.batcher.batch_s.observe(model, size, seconds)
        self.batcher.costs.model_limits.update(loaded.max_batch)
        for model in loaded.backends:  # a full batch the warm-up says would outlast the timeouts: fewer
            self.batcher.costs.fit_budget(model)
        pool = self.pool = GpuPool(
            self.backends,
            self.batcher,
            self.metrics,
            asyncio.get_running_loop(),
            loaded.devices,
            self.settings.gpu_timeout_ms / 1000,
            threads=loaded.threads,
            rules=dict(loaded.rules or {}),
            gpu_timeout_ceiling_s=self.settings.max_timeout_ms / 1000,
            stage_lead_s=self.settings.stage_lead_ms / 1000,
        )
        pool.demand = self.admission.arrival_rate
        pool.tracing = self.tracing
        pool.quarantine = self.service.quarantine
        pool.start()
        return pool

    async def start_engine(self, elsewhere: list[str]) -> None:
        """The generation engine on its own replica, and the models it answers on its stepper."""
        self.generation = await start_generation(self.settings, self.metrics.registry)
        if self.generation is not None:
            self.generation.account = self.service.cost_account  # one account of cost served
            stepper = self.stepper = serve_on_stepper(
                self.service, self.generation, self.settings, StepperRecords(self.metrics, self.tracing)
            )
            if stepper is not None:  # no warm-up batch of theirs: their deadlines follow the stepper's answer
                self.derive_deadlines({m: stepper.run_s() for m in elsewhere}, "the stepper's answer time")
            generating = next((spec.id for spec in self.settings.models if spec.generates), None)
            if generating is not None:
                self.registry.deadlines.setdefault(self.generation.cfg.model_id, self.registry.deadlines[generating])

    def derive_deadlines(self, times: dict[str, float | None], what: str) -> None:
        """Each model's own SLO and default timeout, from its measured time in `times`, for the figures the user
        left unset; a model whose time is None keeps the settings' figures. A costed model's batches are then
        fitted within half of its own SLO with its slack (`BatchBudget.fit_budget`)."""
        for model, seconds in times.items():
            if seconds is not None:
                self.registry.deadlines[model] = deadlines_for(self.settings, seconds, what)
            log_deadlines(model, self.registry.deadlines[model])
        half_slack = self.settings.admission_slack / 2
        self.batcher.deadlines_changed()
        self.batcher.costs.latency_fits = {m: d.slo_s * half_slack for m, d in self.registry.deadlines.items()}

    async def _tick(self) -> None:
        last_answered, last_time = self.guard.answered, time.monotonic()
        last_busy: dict[str, float] = {}
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            elapsed = now - last_time
            self.requests_per_second = (self.guard.answered - last_answered) / elapsed
            last_answered, last_time = self.guard.answered, now
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
        self.service.tokenizing.close()
