"""Start-up of the models: build every backend, start one thread per device, and run each backend's `setup`
and warm-up on that thread. The server runs this behind an open port (/readyz 503 meanwhile); a plugin that
fails says so in one line and the process exits with status 2, rather than answering 503 forever. Each stage
logs a line as it ends: a real model's start takes minutes on a CPU and must not look hung.

A backend that declares its batch time (`initial_batch_s`) is warmed once; any other until two rounds agree
(`warmup.warm_until_stable`: a cold first batch pays one-off costs). The learned batch time starts from the
median of the later rounds, and the model's unset SLO and default timeout follow from it
(`warmup.deadlines_for`), until real batches take over.

A model whose batches never reach the workers (`elsewhere`: answered by the generation engine's stepper) is built
as its plugin's `shell` only, never set up, warmed nor checked, so it costs no start-up time or replica memory.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable, Collection, Iterator
from typing import TypeVar

from batchserve.backends import Backend, PluginError, describe, OutputRule, check_warm_answer
from batchserve.errors import short as errors_short
from batchserve.backends.plugin import make_backend
from batchserve.config import Settings
from batchserve.backends.device_thread import DeviceThread
from batchserve.backends.warmup import WarmUp, ms, robust, warm_until_stable

log = logging.getLogger("batchserve")
T = TypeVar("T")

# The batch whose answer is checked before the port opens: two inputs, so an answer of the wrong length (n+1,
# or always one) shows. Checked once per device after the warm-up.
CHECK_INPUTS = ("warm-up check", "a second warm-up input")

EXIT_STARTUP_FAILED = 1  # the server could not start (a store, a port, the generation engine)
EXIT_BACKEND_FAILED = 2  # a backend that cannot be served (PluginError): the same status as a usage mistake
LOAD_THREAD = "load-models"  # the daemon thread the models load and warm on (runtime.in_daemon_thread's name)


def loading_abandoned() -> bool:
    """Whether a model load is still running (the server stopped before it finished)."""
    return any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())


@dataclass
class LoadedModels:
    backends: dict[str, Backend]  # model id -> backend, set up and warmed on every device
    devices: list[str]  # the default model's devices: one worker each
    threads: list[DeviceThread]  # one per device, where its setup, warm-up and batches run
    batch_s: dict[str, float]  # model id -> batch time to start from
    batch_s_by_size: dict[str, dict[int, float]]  # model id -> batch seconds by size the warm-up measured
    max_batch: dict[str, int]  # model id -> most inputs per batch (the server's, or the plugin's if lower)
    rules: dict[str, OutputRule] | None = None  # model id -> its outputs' rule, checked on the warm-up answers
    # model id -> its stable warm-up batch time, for the measured models (`warmup.deadlines_for`)
    measured: dict[str, float] = field(default_factory=dict)


def load_models(settings: Settings, elsewhere: Collection[str] = ()) -> LoadedModels:
    """Everything the workers need, ready to serve; PluginError (one line) when a backend cannot be served.
    The models in `elsewhere` are answered by another path: their backend is a shell, not loaded or warmed."""
    backends: dict[str, Backend] = {}  # set up, warmed and checked on the default model's devices
    every: dict[str, Backend] = {}  # and the shells, in the models' order
    for spec in settings.models:
        if spec.id in elsewhere:
            every[spec.id] = make_backend(spec, settings, shell=True)
            log.info("not loading %s's batch backend: its /v1/inference runs elsewhere (--inference-path)", spec.id)
            continue
        log.info("loading %s (backend %s)", spec.id, spec.backend)
        started = time.perf_counter()
        backends[spec.id] = every[spec.id] = make_backend(spec, settings)
        log.info("loaded %s in %.1f s", spec.id, time.perf_counter() - started)
    devices = every[settings.models[0].id].device_names()
    for model, backend in every.items():
        if len(backend.device_names()) < len(devices):
            raise backend.source.error(
                f"model {model} has {len(backend.device_names())} device(s) but the default model has "
                f"{len(devices)}; each worker runs every model on its own device"
            )
    threads = [DeviceThread(name) for name in devices]
    _on_every_device(threads, lambda device: _set_up(backends, device))
    by_size: dict[str, dict[int, float]] = {model: {} for model in backends}
    warm_s = _on_every_device(threads, lambda device: _warm(backends, device, by_size))
    rules = {model: OutputRule(b.output_kind) for model, b in every.items()}
    _on_every_device(threads, lambda device: _check(backends, device, rules))
    batch_s = {
        model: b.initial_batch_s if b.initial_batch_s is not None else max(w[model] for w in warm_s)
        for model, b in backends.items()
    }
    measured = {model: batch_s[model] for model, b in backends.items() if b.initial_batch_s is None}
    max_batch = {
        model: min(settings.max_batch_size, b.max_batch_size or settings.max_batch_size) for model, b in every.items()
    }
    return LoadedModels(every, devices, threads, batch_s, by_size, max_batch, rules, measured)


def _on_every_device(threads: list[DeviceThread], step: Callable[[int], T]) -> list[T]:
    """Run `step(device)` for every device, each on its own thread (in parallel); the results by device. The
    first failure raises PluginError."""
    futures = [t.call(step, i) for i, t in enumerate(threads)]
    return [future.result() for future in futures]


@contextmanager
def _failure_named(backend: Backend, step: str, where: str) -> Iterator[None]:
    """A plugin's setup or warm-up that raises (or exits) becomes one PluginError line naming the step and device."""
    try:
        yield
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one line, then the process exits 2
        raise backend.source.error(f"{step} on {where} raised {describe(exc)}") from None


def _set_up(backends: dict[str, Backend], device: int) -> None:
    for model, backend in backends.items():
        where = backend.device_names()[device]
        started = time.perf_counter()
        with _failure_named(backend, "setup", where):
            backend.setup(device)
        log.info("set up %s on %s: %.0f ms", model, where, (time.perf_counter() - started) * 1000)


def _warm(backends: dict[str, Backend], device: int, by_size: dict[str, dict[int, float]]) -> dict[str, float]:
    """`warm` once for a backend that declares its batch time, else until it is stable; batch times by size go
    to `by_size` (the slowest device's)."""
    took = {}
    for model, backend in backends.items():
        where = backend.device_names()[device]
        if backend.initial_batch_s is not None:  # its batch time is known: `took` is not read
            started = time.perf_counter()
            with _failure_named(backend, "warm", where):
                backend.warm(device)
            log.info("warmed %s on %s: %.0f ms", model, where, (time.perf_counter() - started) * 1000)
            continue
        reported: list[dict[int, float]] = []
        with _failure_named(backend, "warm", where):
            warm = _warm_rounds(backend, model, device, where, reported)
        log.info(
            "warmed %s on %s: %s ms%s",
            model,
            where,
            ", ".join(ms(t) for t in warm.rounds_s),
            "" if warm.stable else " (not stable)",
        )
        took[model] = warm.batch_s
        sizes = by_size[model]  # the dicts are per model; devices run in parallel threads
        for size in reported[-1] if reported else ():  # per size or cost: the median of its rounds after the first
            sizes[size] = max(robust([r[size] for r in reported if size in r]), sizes.get(size, 0.0))
    return took


def _warm_rounds(backend: Backend, model: str, device: int, where: str, reported: list[dict[int, float]]) -> WarmUp:
    """`warm_until_stable` over the backend's `warm`; the batch times by size or cost it reports go to `reported`."""
    rounds = 0

    def round_() -> float | None:
        # A backend that timed its batches by size or cost says what a batch takes: its slowest, not the round.
        nonlocal rounds
        began = time.perf_counter()
        timings = backend.warm(device)
        rounds += 1
        log.info("warm-up round %d of %s on %s: %s ms", rounds, model, where, ms(time.perf_counter() - began))
        if timings:
            reported.append(timings)
        return max(timings.values()) if timings else None

    return warm_until_stable(round_)


def _check(backends: dict[str, Backend], device: int, rules: dict[str, OutputRule]) -> None:
    """One batch of CHECK_INPUTS per backend, whose answer must fit the model's output rule."""
    for model, backend in backends.items():
        where = backend.device_names()[device]
        try:
            outputs = backend.run(device, list(CHECK_INPUTS))
        except Exception as exc:  # noqa: BLE001 - a batch that raises is the pool's to isolate (a flaky device)
            log.warning(
                "the warm-up answer check of %s on %s raised %s; its answers are checked as they come",
                model,
                where,
                errors_short(describe(exc)),
            )
            continue
        wrong = check_warm_answer(outputs, len(CHECK_INPUTS), rules[model])
        if wrong is not None:
            raise backend.source.error(f"{wrong} on {where}")


__all__ = ["LoadedModels", "PluginError", "load_models"]
