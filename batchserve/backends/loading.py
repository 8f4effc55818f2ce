"""Start-up of the models: build every backend, start one thread per device, and run each backend's `setup`
and warm-up on that thread, all before the server listens (so a plugin that fails says so and the process
exits with status 2, rather than opening a port that answers 503 forever).

A backend that declares its batch time (`initial_batch_s`, as the sim does) is warmed once. Any other is warmed
until two rounds agree (`warmup.warm_until_stable`: a cold first batch pays one-off costs), the batcher's
learned batch time starts from the median of the rounds after the first (per batch size or cost when the
backend timed them), and the SLO and default timeout the user left unset follow
from it (`warmup.apply_deadlines`). From the first real batch on, the batcher's moving average of the batch
cycle as the event loop sees it takes over.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from batchserve.backends import Backend, PluginError, describe
from batchserve.backends.plugin import make_backend
from batchserve.config import Settings
from batchserve.backends.device_thread import DeviceThread
from batchserve.backends.warmup import apply_deadlines, robust, warm_until_stable

log = logging.getLogger("batchserve")


@dataclass
class LoadedModels:
    backends: dict[str, Backend]  # model id -> backend, set up and warmed on every device
    devices: list[str]  # the default model's devices: one worker each
    threads: list[DeviceThread]  # one per device, where its setup, warm-up and batches run
    batch_s: dict[str, float]  # model id -> batch time to start from
    batch_s_by_size: dict[str, dict[int, float]]  # model id -> batch seconds by size the warm-up measured
    max_batch: dict[str, int]  # model id -> most inputs per batch (the server's, or the plugin's if lower)


def load_models(settings: Settings) -> LoadedModels:
    """Everything the workers need, ready to serve; PluginError (one line) when a backend cannot be served."""
    backends = {spec.id: make_backend(spec, settings) for spec in settings.models}
    default = backends[settings.models[0].id]
    devices = default.device_names()
    for model, backend in backends.items():
        if len(backend.device_names()) < len(devices):
            raise backend.source.error(
                f"model {model} has {len(backend.device_names())} device(s) but the default model has "
                f"{len(devices)}; each worker runs every model on its own device")
    threads = [DeviceThread(name) for name in devices]
    _on_every_device(threads, backends, "setup")
    by_size: dict[str, dict[int, float]] = {model: {} for model in backends}
    warm_s = _on_every_device(threads, backends, "warm", by_size)
    batch_s = {model: b.initial_batch_s if b.initial_batch_s is not None else max(warm_s[model])
               for model, b in backends.items()}
    measured = {model: batch_s[model] for model, b in backends.items() if b.initial_batch_s is None}
    if measured:
        apply_deadlines(settings, max(measured.values()))
    max_batch = {model: min(settings.max_batch_size, b.max_batch_size or settings.max_batch_size)
                 for model, b in backends.items()}
    return LoadedModels(backends, devices, threads, batch_s, by_size, max_batch)


def _on_every_device(threads: list[DeviceThread], backends: dict[str, Backend], step: str,
                     by_size: dict[str, dict[int, float]] | None = None) -> dict[str, list[float]]:
    """Run `setup` or `warm` of every backend on every device, each device on its own thread (devices in
    parallel); the seconds each took, per model. The first failure raises PluginError."""
    futures: list[Future[dict[str, float]]] = [t.call(_run_step, backends, i, step, by_size)
                                               for i, t in enumerate(threads)]
    took: dict[str, list[float]] = {model: [] for model in backends}
    for future in futures:
        for model, seconds in future.result().items():
            took[model].append(seconds)
    return took


def _run_step(backends: dict[str, Backend], device: int, step: str,
              by_size: dict[str, dict[int, float]] | None = None) -> dict[str, float]:
    """`setup` once; `warm` once for a backend that declares its batch time, else until it is stable (the
    seconds returned are then the stable batch time). Batch times by size that the last warm-up round
    returned go to `by_size` (the slowest device's, per size)."""
    took = {}
    for model, backend in backends.items():
        where = backend.device_names()[device]
        started = time.perf_counter()
        try:
            if step == "warm" and backend.initial_batch_s is None:
                reported: list[dict[int, float]] = []

                def round_(backend: Backend = backend) -> float | None:
                    # A backend that timed its batches by size or cost (smollm2 on a GPU captures graphs, then
                    # times a batch of each bucket; minilm times two token counts) says what a batch takes: its
                    # slowest, not the whole round.
                    timings = backend.warm(device)
                    if timings:
                        reported.append(timings)
                    return max(timings.values()) if timings else None

                warm = warm_until_stable(round_)
                log.info("warmed %s on %s: %s ms%s", model, where, ", ".join(f"{t * 1000:.0f}" for t in warm.rounds_s),
                         "" if warm.stable else " (not stable)")
                took[model] = warm.batch_s
                if by_size is not None and reported:
                    sizes = by_size[model]  # the dicts are per model; devices run in parallel threads
                    for size in reported[-1]:  # per size or cost: the median of its rounds after the first
                        seconds = robust([r[size] for r in reported if size in r])
                        sizes[size] = max(seconds, sizes.get(size, 0.0))
                continue
            getattr(backend, step)(device)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one line, before the port opens
            raise backend.source.error(f"{step} on {where} raised {describe(exc)}") from None
        took[model] = time.perf_counter() - started
    return took


__all__ = ["LoadedModels", "PluginError", "load_models"]
