"""Issue 23's "a request, followed through the code, returns to a module it already left at most twice",
measured instead of hand-counted (docs/architecture.md, "The request path, module by module").

One request answered 200 on `/v1/inference` and one on `/v1/embeddings`, each driven through the real app
(`create_app`: the sim backend and a small embedding plugin, in-process, no sockets, as `bench/hotpath.py`
drives it), traced with `sys.setprofile` on the loop's thread. The path is the batchserve module of every
Python function the route's own module calls, in order:
- the route is the spine: the one request path (`http/endpoint`) and the wing's module, whose functions are the
  skeleton's declared parts (parse, handle, render) and its helpers (`pick_model`, `prompt_tokens`), so a call
  from one of them counts as the route's, and a call into one is not a step;
- only the route's callees are steps: what the guard or the door call in turn (`core/admission`, `core/ledger`) is
  inside that step (the door, `core/service`, is the other spine: its own path is its own business);
- starlette, asyncio, orjson and the standard library are not modules of the path (only `batchserve.*` is);
- consecutive repeats collapse. Resuming a coroutine also fires a 'call' event: when the door's frame resumes
  after its `await`, its caller is the route's frame, so `core/service` is recorded again right after itself
  and collapses; nothing else of the route runs in between;
- a module that appears again after another one came between is a **return**.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from types import FrameType
from typing import Any
from collections.abc import AsyncIterator, Iterator

import orjson

from bench.hotpath import Cycle as HotpathCycle
from batchserve.app import create_app
from batchserve.config import ModelSpec, Settings
from batchserve.http.guards import digest

MAX_RETURNS = 2  # issue 23's "Done when"
SMALL_KEY = "bs_small-key"  # a bucket of one token, refilled once in 100 s


class Embed:
    """A tiny embedding plugin (the integration tests' EMBED_PLUGIN, without its sleep): loaded from this module."""

    output_kind = "embedding"
    max_batch_size = 8

    def batch(self, inputs: list[str]) -> list[list[float]]:
        return [[float(len(text)), float(len(inputs)), 0.5, -1.25] for text in inputs]

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(text.split()) for text in texts]


def module_of(frame: FrameType) -> str | None:
    """'inference/routes' for batchserve.inference.routes; None outside batchserve."""
    name = frame.f_globals.get("__name__", "")
    return name[len("batchserve.") :].replace(".", "/") if name.startswith("batchserve.") else None


SKELETON = "http/endpoint"  # the one request path every route runs through (issue 35)


@contextlib.contextmanager
def route_path(route: str) -> Iterator[list[str]]:
    """The modules the route calls, in order, consecutive repeats collapsed (see the docstring). The route is
    the skeleton (`http/endpoint`) and the wing's module together: the wing's functions are the skeleton's
    declared parts (parse, handle, render), so neither is a step of the other."""
    path: list[str] = []
    spine = {route, SKELETON}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        caller = frame.f_back
        if caller is None or module_of(caller) not in spine:
            return
        callee = module_of(frame)
        if callee is not None and callee not in spine and (not path or path[-1] != callee):
            path.append(callee)

    sys.setprofile(profile)
    try:
        yield path
    finally:
        sys.setprofile(None)


def returns(path: list[str]) -> list[str]:
    """The modules of `path` entered again after the request had left them for another."""
    seen: set[str] = set()
    back = []
    for module in path:
        if module in seen:
            back.append(module)
        seen.add(module)
    return back


class Cycle(HotpathCycle):
    """uvicorn's request cycle as the routes see it (bench/hotpath.py's), the answer's headers and body kept."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body)
        self.answer = b""
        self.headers: list[tuple[bytes, bytes]] = []

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [(k.lower(), v) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            self.answer += message.get("body", b"")


def scope_for(path: str, body: bytes, key: str = "") -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", b"path-test"),
    ]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def post(app: Any, path: str, body: dict, key: str = "") -> Cycle:
    raw = orjson.dumps(body)
    cycle = Cycle(raw)
    await app(scope_for(path, raw, key), cycle.receive, cycle.send)
    return cycle


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[Any]:
    """The real app, started (lifespan) and ready: a sim model, the embedding plugin, one small key."""
    settings = Settings(
        slo_ms=5000,
        timeout_ms=30000,
        allow_anonymous=True,
        keys=[{"tenant": "small", "tier": "free", "sha256": digest(SMALL_KEY), "rate": 0.01, "burst": 1}],
        models=[ModelSpec("echo", backend="sim", sim_batch_ms=1), ModelSpec("embed", backend=f"{__name__}:Embed")],
    )
    app = create_app(settings)
    starlette = app.app
    async with starlette.router.lifespan_context(starlette):
        rt = starlette.state.rt
        while not rt.ready:
            await asyncio.sleep(0.01)
        yield app


async def traced_paths() -> dict[str, tuple[list[str], Cycle]]:
    """The path of each request, by the route and body that made it."""
    requests = [
        ("inference/routes", "/v1/inference", {"input": "hello", "model": "echo"}),
        ("embeddings/routes", "/v1/embeddings", {"input": ["one two", "three"], "model": "embed"}),
        ("embeddings/routes", "/v1/embeddings", {"input": "no model named"}),
    ]  # the first that embeds
    traced = {}
    async with running() as app:
        for route, url, body in requests:
            await post(app, url, body)  # warm: the path of a request in the steady state
            with route_path(route) as path:
                cycle = await post(app, url, body)
            traced[f"{route} {orjson.dumps(body).decode()}"] = (path, cycle)
    return traced


def test_a_request_returns_to_a_module_it_already_left_at_most_twice(loop: asyncio.AbstractEventLoop):
    traced = loop.run_until_complete(traced_paths())
    for route, (path, cycle) in traced.items():
        assert cycle.status == 200, (route, cycle.status, cycle.answer)
        shown = f"{route}: {' → '.join(path)}; returns to {returns(path)}"
        print(shown)
        assert "core/service" in path, shown  # the request went through the door: the trace saw the whole path
        assert len(returns(path)) <= MAX_RETURNS, shown


async def refusals() -> dict[str, Cycle]:
    one = {"input": ["one"], "model": "embed"}
    async with running() as app:
        spent = await post(app, "/v1/embeddings", one, SMALL_KEY)  # the bucket's one token
        return {
            "spent": spent,
            "429": await post(app, "/v1/embeddings", one, SMALL_KEY),
            "401": await post(app, "/v1/embeddings", one, "bs_wrong"),
        }


def test_embeddings_refuses_a_caller_before_reading_its_body(loop: asyncio.AbstractEventLoop):
    """The path's order on its refusals: who is calling, and whether its bucket holds a token, is decided
    before the body is read (a list's N tokens are taken only once the body says N); each refusal carries the
    caller's request id."""
    answered = loop.run_until_complete(refusals())
    assert answered["spent"].status == 200 and answered["spent"].sent
    for status, cycle in (("429", answered["429"]), ("401", answered["401"])):
        assert cycle.status == int(status), cycle.answer
        assert not cycle.sent, f"the {status} read the body first"
        assert orjson.loads(cycle.answer)["error"]["message"]
        assert (b"x-request-id", b"path-test") in cycle.headers


# Issue 45's goal: one 2-input /v1/embeddings crosses at most 22 files, every thread counted (the issue counted
# 31 at 2b97623). The test fails when a change adds one to the path, and when one folds away unnoticed.
FILES_CROSSED = 22


async def files_crossed() -> tuple[set[str], set[str], Cycle]:
    """Every batchserve module a function of which runs for one 2-input /v1/embeddings request, on any thread
    (the loop's and the device's: the profile is set before the app starts its threads, and records only while
    the request runs), in the steady state, for three requests in a row: those all three crossed (a timer of the
    server's that fires during one is not counted) and those any crossed (a device thread's tail that ends
    after one answer is written is)."""
    files: set[str] = set()
    seen: list[set[str]] = []
    recording = False

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if recording and event == "call" and (module := module_of(frame)) is not None:
            files.add(module)

    body = {"input": ["one two", "three"], "model": "embed"}
    threading.setprofile(profile)
    try:
        async with running() as app:
            await post(app, "/v1/embeddings", body)
            sys.setprofile(profile)
            for _ in range(3):
                files.clear()
                recording = True
                cycle = await post(app, "/v1/embeddings", body)
                recording = False
                seen.append(set(files))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return set.intersection(*seen), set.union(*seen), cycle


def test_a_two_input_embeddings_request_crosses_no_more_files_than_recorded(loop: asyncio.AbstractEventLoop):
    every, some, cycle = loop.run_until_complete(files_crossed())
    assert cycle.status == 200, cycle.answer
    assert "backends/plugin" in every and "core/service" in every, every  # the device's thread and the loop's
    # Grown: even the files every request crossed are more. Shrunk: even the files any request crossed are fewer
    # (so neither a timer nor a thread's timing can fail it).
    assert len(every) <= FILES_CROSSED, f"{len(every)} files: {sorted(every)}"
    assert len(some) >= FILES_CROSSED, f"fewer files now ({len(some)}): lower FILES_CROSSED to keep the gain"
