"""Backends: the `batchstring(inputs) -> outputs` function a worker thread calls, one batch at a time.

A backend is any object with this shape (a Protocol, not a base class):
- `device_names() -> list[str]`: the devices it can run on; the pool starts one worker thread per device.
- `run(device: int, inputs: list[str]) -> list[str]`: one batch on one device, called from that device's thread.
- `bucket_of(text: str) -> int`: inputs of different buckets never share a batch (prompt-length buckets).
- `warm(device: int) -> None`: run once per device before the server reports ready.
- `initial_batch_s`: a first guess of the batch time, replaced by measurements as batches run.

While `run` executes, `all_callers_gone()` (called from the same thread) says whether every caller of the batch
has its answer or has left; a backend that works in steps may check it between steps and return early, so an
abandoned batch frees its device for the next one. Its outputs are then thrown away, so any will do.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from batchserve.config import ModelSpec, Settings, did_you_mean

BUILTIN_BACKENDS = ("sim", "smollm2")


@dataclass
class RunningBatch:
    """The batch a worker thread is running: how to ask whether its callers are all gone, and whether the
    backend asked and was told yes (then the batch stopped early and its time says nothing about the model)."""

    callers_gone: Callable[[], bool]
    stopped_early: bool = False


_current = threading.local()


@contextlib.contextmanager
def running_batch(callers_gone: Callable[[], bool]) -> Iterator[RunningBatch]:
    """Set by the worker thread around `backend.run`: the batch `all_callers_gone` reports on."""
    batch = RunningBatch(callers_gone)
    _current.batch = batch
    try:
        yield batch
    finally:
        _current.batch = None


def all_callers_gone() -> bool:
    """True when no caller of the running batch waits for its output any more; False outside a batch."""
    batch: RunningBatch | None = getattr(_current, "batch", None)
    if batch is None or not batch.callers_gone():
        return False
    batch.stopped_early = True
    return True


class Backend(Protocol):
    initial_batch_s: float

    def device_names(self) -> list[str]: ...
    def run(self, device: int, inputs: list[str]) -> list[str]: ...
    def bucket_of(self, text: str) -> int: ...
    def warm(self, device: int) -> None: ...


def make_backend(spec: ModelSpec, settings: Settings) -> Backend:
    if spec.backend == "sim":
        from batchserve.backends.sim import SimBackend

        return SimBackend.from_settings(spec, settings)
    if spec.backend == "smollm2":
        from batchserve.backends.smollm2 import SmolLM2Backend

        return SmolLM2Backend.from_settings(spec, settings)
    raise ValueError(unknown_backend(spec.backend))


def unknown_backend(name: str) -> str:
    return f"unknown backend {name!r}{did_you_mean(name, BUILTIN_BACKENDS)} (built-in: {', '.join(BUILTIN_BACKENDS)})"


def backend_name_problem(name: str) -> str | None:
    """Why `name` cannot name a backend, or None: checked with the settings, before the port opens. A name with
    a ':' is left to the loader (a `package.module:attr` plugin)."""
    if name in BUILTIN_BACKENDS or ":" in name:
        return None
    return unknown_backend(name)
