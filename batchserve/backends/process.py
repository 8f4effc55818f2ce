"""`--executor process`: each device's backend runs in its own spawned process.

Why: a worker thread shares the server's GIL, so a backend that holds it for long stretches (Python-launched
kernels, per-op dispatch, tokenizing) slows the event loop and is slowed by it. In its own process a batch holds
only its own interpreter; the server's worker thread waits on a pipe with the lock released.

`ProcessBackend` is a Backend, so the pool's contract (one batch at a time per device, bisection, watchdog, hang
handling) is unchanged. Each child is spawned (never forked: CUDA and threads do not survive a fork), sees only
its own GPU (`CUDA_VISIBLE_DEVICES`) and answers `warm` and `run` until the pipe closes. A batch's failure comes
back as an exception in the parent; a child that dies is respawned by the next batch sent to its device.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any
from collections.abc import Callable

from batchserve.config import ModelSpec, Settings

log = logging.getLogger("batchserve.process")

Factory = Callable[[ModelSpec, Settings], Any]  # builds the Backend in the child (a module-level function)


class DeviceProcessError(RuntimeError):
    """A batch failed inside a device process (the child's exception type and message), or the process died."""


def child_settings(settings: Settings, device: int) -> Settings:
    """The settings a device's child builds its backend with: one device, which is its device 0."""
    return dataclasses.replace(
        settings,
        devices=1,
        sim_flaky_device=0 if settings.sim_flaky_device == device else -1,
        models=list(settings.models),
    )


def serve_device(
    conn: Connection, factory: Factory, spec: ModelSpec, settings: Settings, device: int, cuda_device: str
) -> None:
    """The child's main: build the backend for this one device, then answer requests until the pipe closes."""
    if cuda_device:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_device  # before torch is imported: this GPU is its cuda:0
    # Ctrl-C reaches the whole process group: the server drains on it, and still needs its devices meanwhile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s device{device} %(name)s %(message)s"
    )
    try:
        backend = factory(spec, child_settings(settings, device))
        backend.setup(0)  # in the child, on the thread that will run its batches
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails its start-up
        conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        op, args = request
        try:
            result = backend.warm(0) if op == "warm" else backend.run(0, args)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - one batch's failure is the parent's to handle
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


@dataclass
class DeviceProcess:
    """One device's child process and the parent's end of its pipe; used by one thread at a time."""

    factory: Factory
    spec: ModelSpec
    settings: Settings
    index: int
    cuda_device: str  # "" on a CPU or for the sim
    conn: Connection | None = None
    proc: Any = None  # multiprocessing.Process
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve_device,
            name=f"batchserve-device{self.index}",
            daemon=True,
            args=(child, self.factory, self.spec, self.settings, self.index, self.cuda_device),
        )
        self.proc.start()
        child.close()
        self.conn = parent

    def call(self, op: str, args: Any = None) -> Any:
        with self.lock:
            if self.conn is None or not self.proc.is_alive():
                log.warning("device %d's process is gone: starting a new one", self.index)
                self.stop()
                self.start()
                self.answer()  # its backend built
                self._send(("warm", None))  # a fresh process pays its one-time costs before the batch
                self.answer()
            self._send((op, args))
            return self.answer()

    def _send(self, message: tuple) -> None:
        assert self.conn is not None
        try:
            self.conn.send(message)
        except (OSError, ValueError) as exc:
            self.conn = None
            raise DeviceProcessError(f"device {self.index}'s process is gone ({exc})") from None

    def answer(self) -> Any:
        """The child's next reply: its backend built, or a warm-up's or batch's result; its error raised."""
        assert self.conn is not None
        try:
            reply = self.conn.recv()  # blocks with the interpreter lock released
        except (EOFError, OSError):
            self.conn = None
            code = self.proc.exitcode if self.proc is not None else None
            raise DeviceProcessError(f"device {self.index}'s process exited (code {code})") from None
        if reply[0] == "ok":
            return reply[1]
        log.debug("device %d: %s", self.index, reply[2])
        raise DeviceProcessError(reply[1])

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None and self.proc.is_alive():
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.terminate()


@dataclass
class ProcessBackend:
    """A Backend whose batches run in one child process per device; what needs no model is `local`'s own, taken
    as it is (no frame of this class's on the event loop)."""

    local: Any  # the backend's lightweight twin: never asked to run a batch here
    devices: list[DeviceProcess]

    def __post_init__(self) -> None:
        local = self.local
        self.source, self.output_kind = local.source, local.output_kind
        self.max_batch_size, self.initial_batch_s = local.max_batch_size, local.initial_batch_s
        self.device_names, self.count_tokens = local.device_names, local.count_tokens
        self.bucket_of, self.cost_of = local.bucket_of, local.cost_of
        if (batch_cost := getattr(local, "cost_of_batch", None)) is not None:  # only when the twin declares one
            self.cost_of_batch = batch_cost

    @classmethod
    def start(cls, spec: ModelSpec, settings: Settings, local: Any, factory: Factory) -> ProcessBackend:
        """Spawn a child per device of `local`, each building its backend with `factory`."""
        cuda = [name.removeprefix("cuda:") if name.startswith("cuda:") else "" for name in local.device_names()]
        devices = [DeviceProcess(factory, spec, settings, i, gpu) for i, gpu in enumerate(cuda)]
        for d in devices:  # every child loads its model at once
            d.start()
        try:
            for d in devices:
                d.answer()  # its backend built
        except BaseException:
            for d in devices:
                d.stop()
            raise
        log.info("%s runs in %d device process(es)", spec.id, len(devices))
        return cls(local, devices)

    def setup(self, device: int) -> None:
        """Done in the device's process when it starts."""

    def warm(self, device: int) -> dict[int, float] | None:
        return self.devices[device].call("warm")

    def run(self, device: int, inputs: list[str]) -> list[str]:
        return self.devices[device].call("run", inputs)

    def stop(self) -> None:
        for d in self.devices:
            d.stop()
