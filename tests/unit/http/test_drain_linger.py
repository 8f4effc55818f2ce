"""The drain's linger after the listener closes (`DrainingServer.linger`): it waits for the connections still
open, never for nobody. In process: a uvicorn Server that never starts, its connection set driven by hand."""

from __future__ import annotations

import asyncio

import uvicorn

from batchserve.http import server as http_server
from batchserve.http.server import DrainingServer


def draining_server() -> DrainingServer:
    async def app(scope, receive, send) -> None:  # never called: the server is not started
        raise AssertionError("not served")

    return DrainingServer(uvicorn.Config(app))


def test_the_linger_waits_for_an_open_connection_to_close(loop: asyncio.AbstractEventLoop, monkeypatch) -> None:
    monkeypatch.setattr(http_server, "DRAIN_LINGER_S", 30.0)  # far past the close below: it must end at the close
    server = draining_server()
    connection = object()
    server.server_state.connections.add(connection)  # type: ignore[arg-type]
    closed: list[bool] = []

    def close() -> None:
        server.server_state.connections.discard(connection)  # type: ignore[arg-type]
        closed.append(True)

    loop.call_later(0.1, close)
    loop.run_until_complete(asyncio.wait_for(server.linger(served=0), timeout=2))
    assert closed  # it returned only once the connection had closed, long before the 30 s


def test_with_no_connection_open_the_linger_does_not_wait(loop: asyncio.AbstractEventLoop, monkeypatch) -> None:
    monkeypatch.setattr(http_server, "DRAIN_LINGER_S", 30.0)
    loop.run_until_complete(asyncio.wait_for(draining_server().linger(served=0), timeout=2))


def test_connections_taken_from_the_backlog_get_the_whole_linger(loop: asyncio.AbstractEventLoop, monkeypatch) -> None:
    """Their protocols are still being made (not yet in the connection set): the linger does not end early."""
    monkeypatch.setattr(http_server, "DRAIN_LINGER_S", 0.2)
    began = loop.time()
    loop.run_until_complete(asyncio.wait_for(draining_server().linger(served=3), timeout=2))
    assert loop.time() - began >= 0.19
