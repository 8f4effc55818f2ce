"""The app's state (`app.AppState`): what Starlette's State holds, each value also a plain attribute, so the
per-request read of `app.state.rt` skips State's `__getattr__` fallback."""

from __future__ import annotations

from starlette.datastructures import State

from batchserve.app import AppState, create_app
from batchserve.config import Settings


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
