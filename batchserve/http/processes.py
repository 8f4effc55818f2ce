"""`batchserve serve --processes N`: N whole servers on one port, the devices split evenly between them.

Why: a process runs one event loop on one core at a fixed CPU cost per request, so it saturates its core before a
host with many GPUs runs out of devices (docs/capacity.md). Each child is a whole server (its own batcher,
admission and workers over its share of the devices); the port is shared with SO_REUSEPORT and the kernel deals
each new connection to one child. Drains, replacements and per-child metrics:
docs/deploy.md#several-processes-on-one-host---processes-n.

- A child listens on the shared port only once ready (`server.DrainingServer.join_when_ready`): the kernel deals
  connections to every listening socket at once, so a child warming up would answer its share 503.
- Each child also listens on a port of its own, where its /metrics, /readyz and /internal/health are its alone.
  (Not Prometheus' multiprocess mode: a merged view would hide one child's readiness.)
- A child that exits after it joined, or is killed, is replaced (at most one start a second); one that exits by
  itself before it ever joined (a model that cannot load, a port in use) would fail again, so it stops the group.
- A hung child (no answer on its own port's /healthz for `--process-hang-s`; `liveness.py`) is killed with its
  process group and replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.synchronize import Event
from types import FrameType
from typing import TYPE_CHECKING

from batchserve import logsafe
from batchserve.config import ChildPlace, Settings
from batchserve.config import is_postgres_url
from batchserve.http.liveness import Prober

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized

    from batchserve.http.server import AppFactory

log = logging.getLogger("batchserve")

RESPAWN_GAP_S = 1.0  # the least time between two starts of one child: a crashing child does not spin
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Share:
    """One child's devices: how many, and (on CUDA) which GPUs it may see."""

    devices: int
    cuda_visible: str | None


def device_shares(settings: Settings) -> list[Share]:
    """Split the devices evenly over the processes: CUDA GPUs by index, anything else as a count per child."""
    n = settings.processes
    if all(m.backend == "sim" for m in settings.models):
        return [Share(max(1, settings.devices // n) if settings.devices else 1, None)] * n
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    if not gpus:
        return [Share(settings.devices // n if settings.devices else 0, None)] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    total = settings.devices or gpus
    if total > len(ids) or total % n:
        raise ValueError(f"{total} CUDA device(s) do not split evenly over --processes {n}")
    per = total // n
    return [Share(per, ",".join(ids[k * per : (k + 1) * per])) for k in range(n)]


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound TCP socket (not yet listening: uvicorn listens once the app has started, a child on the shared
    port once it is ready)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _become_child(settings: Settings, index: int, share: Share) -> None:
    """A fresh child's own process group, devices and log lines (each names its process); SIGTERM (a drain) when
    the parent dies, even by SIGKILL: no child outlives its group."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent only, which drains the group in order
    if share.cuda_visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = share.cuda_visible
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [process {index} pid {os.getpid()}] %(message)s",
    )
    logsafe.install()  # as the parent's: a caller's control characters never forge a child's log line


def child_main(
    settings: Settings,
    app_factory: AppFactory,
    index: int,
    share: Share,
    port: int,
    own_port: int,
    draining: Event,
    listening: Event,
    elsewhere: tuple[str, ...] = (),
    own_port_out: Synchronized[int] | None = None,
) -> None:
    """One child: load and warm its models (`elsewhere`: built as shells, `backends/loading.py`), then serve the
    shared port and its own (told to the parent through `own_port_out`, for the liveness probe)."""
    _become_child(settings, index, share)
    from batchserve.backends.loading import PluginError, load_models
    from batchserve.http.server import Group, serve

    try:
        shared = bind_socket(settings.host, port, reuse_port=True)
        own = bind_socket(settings.host, own_port, reuse_port=False)
    except OSError as exc:
        print(f"batchserve: error: process {index}: cannot bind {settings.host}: {exc}", file=sys.stderr)
        sys.exit(1)
    own_port = own.getsockname()[1]
    if own_port_out is not None:
        own_port_out.value = own_port
    slot = ChildPlace(index, settings.processes, own_port)
    from batchserve.backends import default_threads

    # cores split among the children as the devices are (each child's torch would take them all)
    threads = settings.torch_threads or default_threads(settings.processes)
    settings = replace(
        settings, port=port, devices=share.devices, processes=1, process_slot=slot, torch_threads=threads
    )
    try:
        loaded = load_models(settings, elsewhere)
    except PluginError as exc:
        print(f"batchserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    log.info(
        "process %d of %d (pid %d): %d device(s)%s; its own port %s:%d (/metrics, /readyz, /internal/health "
        "of this process alone)",
        index,
        slot.of,
        os.getpid(),
        share.devices,
        f" (CUDA_VISIBLE_DEVICES={share.cuda_visible})" if share.cuda_visible is not None else "",
        settings.host,
        own_port,
    )
    sys.exit(serve(settings, app_factory, loaded, sockets=[shared, own], group=Group(draining.is_set, listening.set)))


@dataclass
class Slot:
    index: int
    share: Share
    process: mp.process.BaseProcess | None = None
    listening: Event | None = None
    started_at: float = 0.0
    own_port: Synchronized[int] | None = None  # the child's own port, once it has bound it
    prober: Prober | None = None  # asks the child's own port, once it listens
    killed_hung: float = 0.0  # > 0: killed as hung after this many silent seconds


def kill_group(pid: int) -> None:
    """SIGKILL a child and its process group (its device workers under `--executor process`), even stopped."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def serve_processes(settings: Settings, app_factory: AppFactory, elsewhere: tuple[str, ...] = ()) -> int:
    """Start the children, replace any that exits on its own, drain them all on SIGTERM/SIGINT. 0 after a
    clean drain; a child's status when one could not start."""
    if settings.jobs_db and not is_postgres_url(settings.jobs_db):
        # The shared port would send a job's GET to a process whose SQLite store never saw it.
        log.warning(
            "--processes %d: batch jobs are off (the default SQLite job store belongs to one process); "
            "give --jobs-db postgresql://... to serve /v1/batches from every process",
            settings.processes,
        )
        settings = replace(settings, jobs_db="")
    # Reserved by the parent (bound, never listening) so port 0 names one port for every child, and a
    # replacement can always bind it again.
    reserve = bind_socket(settings.host, settings.port, reuse_port=True)
    try:
        return Supervisor(settings, app_factory, elsewhere, reserve.getsockname()[1]).run()
    finally:
        reserve.close()


class Supervisor:
    """The parent of `--processes` children: one `Slot` each, started, watched, replaced and drained."""

    def __init__(self, settings: Settings, app_factory: AppFactory, elsewhere: tuple[str, ...], port: int) -> None:
        self.settings, self.app_factory, self.elsewhere, self.port = settings, app_factory, elsewhere, port
        self.ctx = mp.get_context("spawn")  # a fresh interpreter per child: no threads or event loop forked half-way
        self.draining = self.ctx.Event()
        self.shares = device_shares(settings)
        self.slots = [Slot(k, self.shares[k]) for k in range(settings.processes)]
        self.stopping: list[int] = []  # the signal that began the drain, once one has
        self.status = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        log.info(
            "%d processes on %s:%d (SO_REUSEPORT), %s device(s) each",
            len(self.slots),
            self.settings.host,
            self.port,
            self.shares[0].devices or "auto",
        )
        for slot in self.slots:
            self.start(slot)
        try:
            while alive := [s.process.sentinel for s in self.slots if s.process and s.process.exitcode is None]:
                wait(alive, timeout=0.5)
                for slot in self.slots:
                    self.watch(slot)
                    self.reap(slot)
                if self.stopping and all(s.process is None or s.process.exitcode is not None for s in self.slots):
                    break
        finally:
            for slot in self.slots:
                if slot.prober is not None:
                    slot.prober.stop()
        log.info("all processes stopped")
        return self.status

    def start(self, slot: Slot) -> None:
        ctx, settings = self.ctx, self.settings
        slot.listening, slot.own_port, slot.prober, slot.killed_hung = ctx.Event(), ctx.Value("i", 0), None, 0.0
        own = settings.process_port_base + slot.index if settings.process_port_base else 0
        slot.process = ctx.Process(
            target=child_main,
            name=f"batchserve-{slot.index}",
            args=(
                settings,
                self.app_factory,
                slot.index,
                slot.share,
                self.port,
                own,
                self.draining,
                slot.listening,
                self.elsewhere,
                slot.own_port,
            ),
        )
        slot.started_at = time.monotonic()
        slot.process.start()

    def watch(self, slot: Slot) -> None:
        """Probe a child once it listens; kill it (then it is replaced by `reap`) once it has answered nothing
        for --process-hang-s."""
        proc, hang_s = slot.process, self.settings.process_hang_s
        if hang_s <= 0 or self.stopping or proc is None or proc.exitcode is not None or slot.killed_hung:
            return
        if slot.listening is None or not slot.listening.is_set():
            return
        if slot.prober is None:
            assert slot.own_port is not None
            slot.prober = Prober(self.settings.host, slot.own_port.value, hang_s).start()
            return
        if slot.prober.hung() and proc.pid:
            slot.killed_hung = slot.prober.silent_for()
            slot.prober.stop()
            log.error(
                "process %d (pid %s) answered no health probe on its own port for %.1f s (stopped, "
                "deadlocked or its event loop held): killing it (SIGKILL) to replace it",
                slot.index,
                proc.pid,
                slot.killed_hung,
            )
            kill_group(proc.pid)

    def reap(self, slot: Slot) -> None:
        """A child that exited: its status kept while draining, else replaced (or the group stopped)."""
        proc = slot.process
        if proc is None or proc.exitcode is None:
            return
        if slot.prober is not None:
            slot.prober.stop()
            slot.prober = None
        if self.stopping:
            self.status = self.status or (proc.exitcode if proc.exitcode > 0 else 0)
            return
        assert slot.listening is not None
        # Never served and exited by itself: a replacement would fail the same way. Killed by a signal while
        # warming (a lone SIGTERM, the OOM killer), it is replaced like any child.
        if not slot.listening.is_set() and proc.exitcode > 0:
            log.error(
                "process %d (pid %s) exited with %s before it listened: stopping the others",
                slot.index,
                proc.pid,
                proc.exitcode,
            )
            self.status = proc.exitcode
            self.on_signal(signal.SIGTERM, None)
            return
        log.info("process %d (pid %s) exited with %s: starting a replacement", slot.index, proc.pid, proc.exitcode)
        time.sleep(max(0.0, slot.started_at + RESPAWN_GAP_S - time.monotonic()))
        if not self.stopping:
            self.start(slot)

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping:
            if sig == signal.SIGINT:  # a second Ctrl-C: the children stop at once
                self.signal_children(signal.SIGINT)
            return
        self.stopping.append(sig)
        log.info("received %s: draining all %d processes", signal.Signals(sig).name, len(self.slots))
        self.draining.set()
        self.signal_children(signal.SIGTERM)

    def signal_children(self, sig: int) -> None:
        for s in self.slots:
            if s.process is not None and s.process.pid and s.process.is_alive():
                os.kill(s.process.pid, sig)
