"""The app (`app.py`): its state (`AppState`, what Starlette's State holds, each value also a plain attribute, so
the per-request read of `app.state.rt` skips State's `__getattr__` fallback), and the routes `FastPath` serves
ahead of Starlette's router."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.datastructures import State

from batchserve.app import AppState, FastPath, create_app
from batchserve.config import Settings
from tests.unit.http.test_request_path import Cycle, post, running, scope_for


def test_the_state_reads_as_starlettes_and_as_plain_attributes() -> None:
    app = create_app(Settings())
    state = app.state
    assert isinstance(state, AppState) and isinstance(state, State)
    runtime = object()
    state.rt = runtime
    assert state.rt is runtime
    assert vars(state)["rt"] is runtime  # found by the ordinary lookup, not State.__getattr__
    assert state._state["rt"] is runtime  # and where Starlette keeps it
    assert isinstance(state.openapi, bytes) and vars(state)["openapi"] is state._state["openapi"]
    del state.rt
    assert not hasattr(state, "rt")
    assert "rt" not in state._state


class RouterSpy:
    """Starlette's app, counting the requests that reach it (FastPath falls back to it)."""

    def __init__(self, app: Starlette) -> None:
        self.app, self.paths = app, []

    @property
    def state(self) -> State:
        return self.app.state

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)  # type: ignore[arg-type]


def test_skeleton_routes_at_a_fixed_path_are_answered_without_starlettes_router(loop) -> None:
    """`fast_routes` by construction: every `Endpoint` route with no path parameter, every method but HEAD, is
    answered by its endpoint ahead of the router; a route with a parameter, and HEAD, still reach the router.
    Through the real app, started, with real answers."""

    async def main() -> tuple[RouterSpy, dict[str, int]]:
        async with running() as app:
            assert isinstance(app, FastPath)
            spy = RouterSpy(app.app)
            app.app = spy  # type: ignore[assignment]
            statuses = {
                "embeddings": (await post(app, "/v1/embeddings", {"input": ["a b"], "model": "embed"})).status,
                "inference": (await post(app, "/v1/inference", {"input": "x", "model": "echo"})).status,
                "job": (await get(app, "/v1/batches/batch_nothing")).status,
            }
            return spy, statuses

    spy, statuses = loop.run_until_complete(main())
    assert statuses["embeddings"] == 200 and statuses["inference"] == 200, statuses
    assert statuses["job"] == 404, statuses  # answered, by the router's route with its {batch_id}
    assert spy.paths == [("GET", "/v1/batches/batch_nothing")]
    fast = create_app(Settings())
    assert isinstance(fast, FastPath)
    assert {("POST", "/v1/embeddings"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")} <= set(fast.fast)
    assert not any(method == "HEAD" or "{" in path for method, path in fast.fast)


async def get(app: FastPath, path: str) -> Cycle:
    cycle = Cycle(b"")
    scope = scope_for(path, b"") | {"method": "GET", "headers": [(b"host", b"127.0.0.1")]}
    await app(scope, cycle.receive, cycle.send)
    return cycle
