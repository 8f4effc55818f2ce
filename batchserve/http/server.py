"""Run the app on uvicorn + uvloop, with a graceful drain on SIGTERM/SIGINT (docs/contract.md#drain).

uvicorn closes the listening socket at the first signal; we keep serving instead, so `/readyz` says 503 and new
requests get a JSON 503 DRAINING while queued and running work is answered. The listener stays open at least
`--drain-grace-s`: a balancer polling `/readyz` takes the node out meanwhile, and a client that still connects
gets an answer it can retry elsewhere rather than a refused or reset connection. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp

from batchserve.backends.loading import EXIT_BACKEND_FAILED, LoadedModels, loading_abandoned
from batchserve.config import Settings
from batchserve.knobs import proxy_list
from batchserve.gc_tuning import tune_gc
from batchserve.http.budget import connection_budget
from batchserve.http.uvicorn_protocol import ConnectionGuard, ConnectionLimits, GuardedHttpToolsProtocol

log = logging.getLogger("batchserve")


BACKLOG = 4096  # the listen backlog
DRAIN_LINGER_S = 0.5  # after the drain: listener closed, open connections still answered
LINGER_POLL_S = 0.02
JOIN_POLL_S = 0.02  # how often a warming --processes child looks whether its runtime is ready


@dataclass(frozen=True)
class Group:
    """The `--processes` group a child server belongs to (`http/processes.py`)."""

    draining: Callable[[], bool]  # True when the whole group drains (SIGTERM to the parent), not this process alone
    listening: Callable[[], None]  # called once the child listens on the group's shared port


class AppFactory(Protocol):
    """`app.create_app`, handed in by the wiring (cli.py): the HTTP layer imports no wing and not the app."""

    def __call__(
        self,
        settings: Settings,
        loaded: LoadedModels | None = None,
        on_startup_failure: Callable[[str, int], None] | None = None,
    ) -> ASGIApp: ...


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain above. In a `--processes` group, the first socket is the shared port, listened on
    only once the runtime is ready (`join_when_ready`, see `http/processes.py`); its own port opens at once."""

    def __init__(self, config: uvicorn.Config, grace_s: float = 0.0, group: Group | None = None) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.group = group
        self._drain_task: asyncio.Task | None = None
        self._join_task: asyncio.Task | None = None  # held: a task nobody references may be collected
        self.shared: asyncio.Server | None = None  # the group's shared port, once this child listens on it

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        held = sockets[0] if self.group is not None and sockets else None
        await super().startup(sockets=sockets[1:] if sockets and held is not None else sockets)
        if self.should_exit or sockets is None:
            return
        if held is None:
            self.say_listening(sockets[0])
        else:
            self._join_task = asyncio.get_running_loop().create_task(self.join_when_ready(held))

    @staticmethod
    def say_listening(sock: socket.socket) -> None:
        """uvicorn says where it listens only for its own sockets (the tests and benches read this line)."""
        host, port = sock.getsockname()[:2]
        logging.getLogger("uvicorn.error").info(
            "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", f"[{host}]" if ":" in host else host, port
        )

    async def join_when_ready(self, sock: socket.socket) -> None:
        """Listen on the group's shared port once the runtime is ready (never, if start-up fails or a drain
        comes first), then tell the group."""
        while not getattr(self.runtime(), "ready", False):
            if self.should_exit or self._drain_task is not None:
                return
            await asyncio.sleep(JOIN_POLL_S)
        loop = asyncio.get_running_loop()
        self.shared = await loop.create_server(self.protocol, sock=sock, backlog=self.config.backlog)
        self.servers.append(self.shared)
        self.say_listening(sock)
        assert self.group is not None
        self.group.listening()

    def runtime(self) -> Any:
        """The app's runtime (`app.state.rt`), under uvicorn's middleware; None before the lifespan made it."""
        app = self.config.loaded_app
        while hasattr(app, "app") and not hasattr(app, "state"):  # unwrap uvicorn's middleware
            app = app.app
        return getattr(getattr(app, "state", None), "rt", None)

    def protocol(self) -> asyncio.Protocol:
        config = self.config
        return config.http_protocol_class(config=config, server_state=self.server_state, app_state=self.lifespan.state)  # type: ignore[call-arg]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        grace_over = time.monotonic() + self.grace_s
        runtime = self.runtime()
        # One of --processes drained alone: its share of the shared port closes now, so the kernel gives new
        # connections to its siblings (no balancer polls this process's /readyz: a grace would only send 503s).
        if self.group is not None and not self.group.draining():
            log.info(
                "draining this process alone: its listener on the shared port is closed; the other "
                "processes take new connections"
            )
            if self.shared is not None:
                self.shared.close()
            grace_over = time.monotonic()
        try:
            if runtime is not None:
                await runtime.drain()
            await asyncio.sleep(max(0.0, grace_over - time.monotonic()))
            log.info("drain grace over: closing the listener")
            # Keep answering DRAINING a moment on open keep-alive connections, so a request already on its way
            # over one is answered, not reset.
            served = 0
            for listener in self.servers:
                served += self.serve_the_backlog(listener)
                listener.close()
            await self.linger(served)
        finally:
            self.should_exit = True

    async def linger(self, served: int) -> None:
        """Wait DRAIN_LINGER_S for the open connections, or less once none is open (no new one can come).
        Connections taken from the backlog are waited for in full: their protocols are still being made."""
        over = time.monotonic() + DRAIN_LINGER_S
        while time.monotonic() < over and (served or self.server_state.connections):
            await asyncio.sleep(min(LINGER_POLL_S, max(0.0, over - time.monotonic())))

    def serve_the_backlog(self, listener: asyncio.AbstractServer) -> int:
        """Connections the kernel has completed but the loop has not accepted yet are reset when the listening
        socket closes: accept them in the same turn of the loop as the close, and serve them (503 DRAINING).
        Returns how many."""
        loop = asyncio.get_running_loop()
        served = 0
        for listening in getattr(listener, "sockets", None) or ():
            sock = socket.socket(fileno=os.dup(listening.fileno()))  # a duplicate: closing it leaves the listener
            try:
                sock.setblocking(False)
                while served < BACKLOG:
                    try:
                        conn, _ = sock.accept()
                    except OSError:  # BlockingIOError: the backlog is empty
                        break
                    conn.setblocking(False)
                    loop.create_task(loop.connect_accepted_socket(self.protocol, conn))
                    served += 1
            finally:
                sock.close()
        if served:
            log.info("drain: %d connection(s) accepted from the backlog as the listener closed", served)
        return served


# Worker threads must get the GIL back at once when their batch ends; at the default 5 ms switch interval a busy
# event loop delays every batch by up to 5 ms.
SWITCH_INTERVAL_S = 0.0001


def uvicorn_config(settings: Settings, app: ASGIApp) -> uvicorn.Config:
    """uvicorn's configuration: uvloop, the guarded httptools protocol, proxy headers from named proxies only. Every
    connection is held to the limits of docs/hardening.md; the cap is HTTP's share of the descriptor budget."""
    guard = ConnectionGuard.create(
        ConnectionLimits(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_connections=connection_budget(settings).http,
        )
    )
    log.info(
        "connections: at most %d open; heads within %g s and %d bytes, bodies within %g s, idle %g s",
        guard.cap,
        settings.header_timeout_s,
        settings.max_header_bytes,
        settings.body_timeout_s,
        settings.keep_alive_timeout_s,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=functools.partial(GuardedHttpToolsProtocol, guard=guard),  # type: ignore[arg-type]
        # Proxy headers are believed only from the proxies the operator names (uvicorn's default believes
        # loopback, so any local caller could pose as another address and own its anonymous jobs).
        proxy_headers=bool(proxy_list(settings.forwarded_allow_ips)),
        forwarded_allow_ips=proxy_list(settings.forwarded_allow_ips) or ["127.0.0.1"],
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        backlog=BACKLOG,
    )


def serve(
    settings: Settings,
    app_factory: AppFactory,
    loaded: LoadedModels | None = None,
    sockets: list[socket.socket] | None = None,
    group: Group | None = None,
) -> int:
    """Run until stopped: 0 after a drain; when start-up failed, 2 for a backend that cannot be served (its one
    line printed last on stderr) and 1 for anything else. The process exits rather than answer 503 for ever: a
    supervisor restarts it or shows the failure. `sockets` (bound, not listening) replace host:port.

    The port opens at once: the models load and warm while /healthz answers 200 and the rest 503 "warming up"."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    failed: list[tuple[str, int]] = []

    def startup_failed(reason: str, status: int) -> None:
        failed.append((reason, status))
        server.should_exit = True

    config = uvicorn_config(settings, app_factory(settings, loaded, on_startup_failure=startup_failed))
    server = DrainingServer(config, grace_s=settings.drain_grace_s, group=group)
    tune_gc()  # before the first request (objects the models leave are frozen once they are up)
    server.run(sockets=sockets)
    status = 0
    if failed:
        reason, status = failed[0]
        if status == EXIT_BACKEND_FAILED:
            print(f"batchserve: error: {reason}", file=sys.stderr)
    if loading_abandoned():
        # Stopped while the models were still loading: that thread may be inside torch, whose C++ runtime aborts
        # the process (SIGABRT) when the interpreter finalizes under it. Leave without finalizing.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
