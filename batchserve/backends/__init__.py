"""Backends: the `batchstring(inputs) -> outputs` function a worker thread calls, one batch at a time.

A backend is any object with this shape (a Protocol, not a base class):
- `device_names() -> list[str]`: the devices it can run on; the pool starts one worker thread per device.
- `run(device: int, inputs: list[str]) -> list[str]`: one batch on one device, called from that device's thread.
- `bucket_of(text: str) -> int`: inputs of different buckets never share a batch (prompt-length buckets).
- `warm(device: int) -> dict[int, float] | None`: run once per device before the server reports ready; it may
  return batch seconds by batch size measured while warming, which seed the learned batch time.
- `initial_batch_s`: a first guess of the batch time, replaced by measurements as batches run.
"""

from __future__ import annotations

from typing import Protocol

from batchserve.config import ModelSpec, Settings


class Backend(Protocol):
    initial_batch_s: float

    def device_names(self) -> list[str]: ...
    def run(self, device: int, inputs: list[str]) -> list[str]: ...
    def bucket_of(self, text: str) -> int: ...
    def warm(self, device: int) -> dict[int, float] | None: ...


def make_backend(spec: ModelSpec, settings: Settings) -> Backend:
    """The backend of a model version, run in the server's worker threads (`--executor thread`) or in one
    spawned process per device (`--executor process`, see process.py)."""
    if settings.executor == "process":
        from batchserve.backends.process import ProcessBackend

        return ProcessBackend.start(spec, settings, make_local_backend(spec, settings, shell=True),
                                    make_local_backend)
    return make_local_backend(spec, settings)


def make_local_backend(spec: ModelSpec, settings: Settings, shell: bool = False) -> Backend:
    """The backend in this process; a `shell` knows its devices and buckets but loads no model."""
    if spec.backend == "sim":
        from batchserve.backends.sim import SimBackend

        return SimBackend.from_settings(spec, settings)
    if spec.backend == "smollm2":
        from batchserve.backends.smollm2 import SmolLM2Backend

        return SmolLM2Backend.shell(settings) if shell else SmolLM2Backend.from_settings(spec, settings)
    raise ValueError(f"unknown backend {spec.backend!r} (expected 'sim' or 'smollm2')")
