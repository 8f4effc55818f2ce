"""batchserve as a Ray Serve deployment: each replica is one batchserve runtime (its batcher, admission and
workers) behind Ray's HTTP proxy, built from batchserve's own ASGI app factory (`batchserve.app.create_app`).

    serve run deploy.rayserve.app:build_app args='--backend sim --max-batch-size 32'

or from Python: `serve.run(build_app({"args": "--backend sim"}))`. Why each setting: docs/deploy.md ("Ray Serve").

- `max_ongoing_requests` = `max_batch_size` x workers x `ONGOING_PER_BATCH`: Ray's default (5) would let a
  replica hold 5 requests, so no batch would ever pass 5 items; a replica needs a full batch running and the
  next one filling behind it.
- Backpressure: past `max_ongoing_requests`, Ray holds requests at the proxy; past `max_queued_requests` it
  answers 503 itself (`backpressure_config`: 503 with a Retry-After of 1 s, as batchserve's own
  SERVICE_OVERLOADED). batchserve's refusals (503 with `retry_after_ms`, 429 for a tier's rate) pass through as
  the replica answered them.
- Autoscaling on batchserve's load signal: each replica reports `batchserve_load_ratio`
  (`record_autoscaling_stats`) and `load_ratio_policy` asks for sum(ratio) / `TARGET_LOAD_RATIO` replicas, as
  deploy/k8s/hpa.yaml does; Ray's built-in policy on ongoing requests is the fallback it is not.
"""

from __future__ import annotations

import asyncio
import math
import shlex
from typing import TYPE_CHECKING

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy, BackpressureConfig

from batchserve.app import create_app
from batchserve.cli import build_parser, settings_from
from batchserve.config import Settings

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from batchserve.runtime import Runtime

ONGOING_PER_BATCH = 3  # a batch running, the next filling, one more arriving: in flight per worker, in batches
TARGET_LOAD_RATIO = 0.75  # per replica, as deploy/k8s/hpa.yaml: room for a burst and for losing one replica
LOAD_RATIO = "batchserve_load_ratio"


def settings_of(args: str) -> Settings:
    """`batchserve serve`'s flags (and BATCHSERVE_* variables) as the CLI reads them."""
    parser, commands = build_parser()
    return settings_from(commands["serve"].parse_args(shlex.split(args)))


def max_ongoing(settings: Settings) -> int:
    """Requests one replica may hold: enough for every worker to run a full batch while the next one fills."""
    workers = max(1, settings.devices)  # 0 = every GPU the replica sees: ray_actor_options gives it one
    return settings.max_batch_size * workers * ONGOING_PER_BATCH


class ReadyWhenWarm:
    """Ray routes to a replica as soon as its ASGI startup has ended, but batchserve's startup returns at once
    and loads and warms behind it (503 "warming up" meanwhile). This holds the lifespan's startup-complete
    until the runtime is ready, so Ray sends a replica nothing it would refuse; a failed start fails it."""

    def __init__(self, app: ASGIApp, failures: list[str]) -> None:
        self.app = app
        self.failures = failures  # create_app's on_startup_failure appends the reason

    def runtime(self) -> Runtime | None:
        state = getattr(self.app, "state", None)
        return getattr(state, "rt", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_when_ready(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                while not self.failures and ((rt := self.runtime()) is None or rt.not_ready_reason()):
                    await asyncio.sleep(0.05)
                if self.failures:
                    message = {"type": "lifespan.startup.failed", "message": self.failures[0]}
            await send(message)

        await self.app(scope, receive, send_when_ready)


@serve.ingress()
class Batchserve:
    """One replica: one batchserve runtime, its app built on the replica (`__serve_build_asgi_app__`)."""

    def __init__(self, args: str = "") -> None:
        self.settings = settings_of(args)
        self.ready: ReadyWhenWarm | None = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        failures: list[str] = []
        app = create_app(self.settings, on_startup_failure=lambda reason, status: failures.append(reason))
        self.ready = ReadyWhenWarm(app, failures)
        return self.ready

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load signal for `load_ratio_policy`: arrivals over what it serves at full batches."""
        rt = self.ready.runtime() if self.ready is not None else None
        return {LOAD_RATIO: rt.load_reading().load_ratio() if rt is not None else 0.0}

    def check_health(self) -> None:
        """Ray restarts a replica whose check raises: one whose every worker is hung (not one that drains)."""
        rt = self.ready.runtime() if self.ready is not None else None
        reason = rt.not_ready_reason() if rt is not None else None
        if reason is not None and reason != "draining" and rt is not None and rt.pool is not None:
            if rt.pool.healthy_count() == 0:
                raise RuntimeError(f"batchserve replica not serving: {reason}")


def load_ratio_policy(ctx: AutoscalingContext) -> tuple[int, dict]:
    """Replicas for the fleet's load: the sum of the replicas' load ratios over the per-replica target (what an
    HPA on batchserve_load_ratio with an average target asks for), within the configured bounds."""
    reported = (ctx.aggregated_metrics or {}).get(LOAD_RATIO, {})
    if not reported:  # nothing reported yet (replicas starting): keep what is wanted
        return ctx.target_num_replicas, {}
    wanted = math.ceil(sum(reported.values()) / TARGET_LOAD_RATIO)
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, wanted)), {}


def build_app(
    config: dict[str, str | int] | None = None,
) -> serve.Application:
    """`serve run deploy.rayserve.app:build_app args='...' replicas=N max_replicas=M` (or a dict from Python):
    a fixed `replicas` count, or autoscaling between 1 and `max_replicas` on the load signal."""
    config = config or {}
    args = str(config.get("args", ""))
    settings = settings_of(args)
    ongoing = max_ongoing(settings)
    options: dict = dict(
        max_ongoing_requests=ongoing,
        # Held at Ray's proxy beyond the replicas' places; then 503 from Ray, as batchserve's own overload answer.
        max_queued_requests=int(config.get("max_queued", ongoing * 4)),
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        # Ray waits for a stopping replica's requests this long: batchserve's whole drain.
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 5,
        health_check_period_s=10,
        ray_actor_options={"num_cpus": float(config.get("num_cpus", 1)), "num_gpus": float(config.get("num_gpus", 0))},
    )
    if "replicas" in config:
        options["num_replicas"] = int(config["replicas"])
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=1,
            max_replicas=int(config.get("max_replicas", 4)),
            # Ray's own target, used by its default policy; kept consistent with the load target: a replica at
            # the target has about that share of its places busy.
            target_ongoing_requests=max(1, int(ongoing * TARGET_LOAD_RATIO)),
            upscale_delay_s=0,
            downscale_delay_s=300,  # a GPU replica loads and warms for minutes: do not flap
            policy=AutoscalingPolicy(policy_function=load_ratio_policy),
        )
    return serve.deployment(name="batchserve", **options)(Batchserve).bind(args)
