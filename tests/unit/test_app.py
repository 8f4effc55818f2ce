"""The app (`app.py`): its state (`AppState`, what Starlette's State holds, each value also a plain attribute, so
the per-request read of `app.state.rt` skips State's `__getattr__` fallback), and the routes `FastPath` serves
ahead of Starlette's router."""

from __future__ import annotations

from starlette.datastructures import State
from starlette.routing import Route

from batchserve.app import AppState, FastPath, create_app
from batchserve.config import Settings
from batchserve.http.endpoint import Endpoint


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


def test_every_skeleton_route_at_a_fixed_path_is_served_ahead_of_the_router() -> None:
    """`fast_routes` by construction: each `Endpoint` route with no path parameter, every method but HEAD (which
    Starlette answers from GET); a route of another kind, or with a parameter, stays with the router."""
    app = create_app(Settings())
    assert isinstance(app, FastPath)
    skeleton = [r for r in app.routes if isinstance(r, Route) and isinstance(r.endpoint, Endpoint)]
    fixed = [r for r in skeleton if "{" not in r.path]
    assert {"/v1/inference", "/v1/embeddings", "/v1/chat/completions", "/v1/rerank"} <= {r.path for r in fixed}
    expected = {(m, r.path): r.endpoint for r in fixed for m in r.methods or () if m != "HEAD"}
    assert app.fast == expected
    assert all("{" not in path for _, path in app.fast) and ("HEAD", "/healthz") not in app.fast
    assert any("{" in r.path for r in skeleton)  # e.g. /v1/batches/{batch_id}: left to the router
    others = [r for r in app.routes if isinstance(r, Route) and not isinstance(r.endpoint, Endpoint)]
    assert not any((m, r.path) in app.fast for r in others for m in r.methods or ())
