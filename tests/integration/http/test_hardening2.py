"""Issue 28's second hardening round, each finding through a live server (items 2, 4, 6 and 7; the rest of the
issue is tested beside its own code). Each test failed before its fix; docs/hardening.md states the guarantee.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
import threading
import time

import httpx
import orjson
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.http.test_hardening import BOOM_SERVER, _free_port, _try_get, connect, read_answer
from tests.integration.jobs.test_routes import wait_for


def owned_by(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory):
    """One sim server with no option under test (1 device, 5 ms batches, its own jobs store), for the tests that
    need only a server: a start and stop each is ~0.7 s of the suite. They leave nothing another reads: no
    batch job (one test checks that none was stored), request ids of their own."""
    s = start_server(
        "--devices", "1", "--sim-batch-ms", "5", "--jobs-db", str(tmp_path_factory.mktemp("plain") / "j.db")
    )
    yield s
    s.stop()


# -- item 4: proxy headers only from the proxies the operator names ----------------------------------------------
def test_forwarded_for_is_believed_only_from_named_proxies(plain: LiveServer, server_factory):
    with plain.client() as c:
        # A local caller poses as 10.0.0.9: by default that header is ignored, the record is its own address's.
        assert (
            c.post(
                "/v1/inference", json={"input": "ab"}, headers={**owned_by("10.0.0.9"), "X-Request-ID": "posed"}
            ).status_code
            == 200
        )
        assert c.get("/v1/requests/posed").status_code == 200
        assert c.get("/v1/requests/posed", headers=owned_by("10.0.0.9")).status_code == 200
    behind = server_factory(
        "--devices", "1", "--sim-batch-ms", "5", "--forwarded-allow-ips", "127.0.0.1", "--request-history", "20"
    )
    with behind.client() as c:
        assert (
            c.post(
                "/v1/inference", json={"input": "ab"}, headers={**owned_by("10.0.0.9"), "X-Request-ID": "kept"}
            ).status_code
            == 200
        )
        assert c.get("/v1/requests/kept").status_code == 404  # the proxy's own address is another caller
        assert c.get("/v1/requests/kept", headers=owned_by("10.0.0.9")).status_code == 200
        # item 7: the request history is kept per caller: another caller's 60 requests (3 x the history)
        # evict its own oldest records, not 10.0.0.9's one.
        for i in range(60):
            r = c.post("/v1/inference", json={"input": "x"}, headers={**owned_by("10.0.0.8"), "X-Request-ID": f"f{i}"})
            assert r.status_code == 200
        assert c.get("/v1/requests/kept", headers=owned_by("10.0.0.9")).status_code == 200
        assert c.get("/v1/requests/f59", headers=owned_by("10.0.0.8")).status_code == 200
        assert c.get("/v1/requests/f0", headers=owned_by("10.0.0.8")).status_code == 404


def test_a_bad_forwarded_allow_ips_stops_the_start():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchserve",
            "serve",
            "--port",
            "0",
            "--forwarded-allow-ips",
            "127.0.0.1,not-an-address",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--forwarded-allow-ips" in done.stderr and "not-an-address" in done.stderr


# -- item 7: outputs checked per output kind -----------------------------------------------------------------------
PLUGINS = {
    "kinds": """
        import math

        HUGE = "x" * (5 << 20)


        def _one(text):
            return {"nan": math.nan, "none": None, "inf": {"deep": [1.0, math.inf]}}.get(text, {"ok": text})


        class Json:
            output_kind = "json"

            def batch(self, inputs):
                if "raise-huge" in inputs:
                    raise ValueError(HUGE)
                return [_one(t) for t in inputs]


        class Text:
            output_kind = "text"

            def batch(self, inputs):
                return [5 if t == "int" else t.upper() for t in inputs]


        class Vectors:
            output_kind = "embedding"

            def batch(self, inputs):
                table = {"short": [1.0, 2.0], "strings": ["a", "b", "c"], "bools": [True, 1.0, 2.0],
                         "nan": [math.nan, 1.0, 2.0], "huge": [1e300, 0.0, 0.0], "none": None}
                return [table.get(t, [0.5, 0.25, -1.0]) for t in inputs]
    """,
}
CONFIG = """
[[models]]
name = "json"
backend = "kinds:Json"

[[models]]
name = "text"
backend = "kinds:Text"

[[models]]
name = "vec"
backend = "kinds:Vectors"
"""


@pytest.fixture(scope="module")
def kinds_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server

    root = tmp_path_factory.mktemp("kinds")
    for name, source in PLUGINS.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    (root / "c.toml").write_text(CONFIG)
    env = {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    s = start_server(
        "--config", str(root / "c.toml"), "--devices", "1", "--slo-ms", "5000", "--timeout-ms", "20000", env=env
    )
    yield s
    s.stop()


def infer(c: httpx.Client, model: str, text: str) -> httpx.Response:
    return c.post("/v1/inference", json={"input": text, "model": model})


def test_outputs_that_break_their_kind_are_a_clear_500_never_a_null_200(kinds_server: LiveServer):
    with kinds_server.client() as c:
        for model, text in [
            ("json", "nan"),
            ("json", "none"),
            ("json", "inf"),
            ("text", "int"),
            ("vec", "short"),
            ("vec", "strings"),
            ("vec", "bools"),
            ("vec", "nan"),
            ("vec", "none"),
        ]:
            r = infer(c, model, text)
            assert r.status_code == 500, (model, text, r.text)
            body = r.json()
            assert body["error"] == "INFERENCE_FAILED" and set(body) >= {"message", "request_id"}, body
        assert infer(c, "json", "fine").json()["output"] == {"ok": "fine"}
        assert infer(c, "text", "abc").json()["output"] == "ABC"
        assert infer(c, "vec", "fine").json()["output"] == [0.5, 0.25, -1.0]
        assert infer(c, "vec", "huge").json()["output"][0] == 1e300  # finite: fine as JSON floats

        # On OpenAI's route: OpenAI's error shape, for the wrong vector and for one that does not fit float32.
        for body in (
            {"input": ["fine", "strings"], "model": "vec"},
            {"input": ["huge"], "model": "vec", "encoding_format": "base64"},
        ):
            r = c.post("/v1/embeddings", json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "code"} and "Traceback" not in r.text, r.text
        ok = c.post("/v1/embeddings", json={"input": ["fine"], "model": "vec", "encoding_format": "base64"})
        assert ok.status_code == 200 and ok.json()["data"][0]["embedding"], ok.text


def test_a_backends_exception_text_is_bounded(kinds_server: LiveServer):
    with kinds_server.client() as c:
        r = infer(c, "json", "raise-huge")
    assert r.status_code == 500 and r.json()["error"] == "INFERENCE_FAILED"
    assert len(r.content) < 2000, len(r.content)  # the 5 MB message, cut to 1,000 characters for the caller
    assert "ValueError: xxxx" in r.json()["message"]
    assert len(kinds_server.log()) < 200_000  # and to a few KB in the log, however often it is logged


# -- item 7: absurd numbers and nesting, one input rule, no paths ---------------------------------------------------
def test_absurd_numbers_nesting_and_lone_surrogates_are_4xx(plain: LiveServer):
    s = plain
    digits = "9" * 5000  # Python refuses int() of more than 4,300 digits: once a 500 with a traceback
    for path in ("/v1/inference", "/v1/batches"):
        sock = connect(s)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {digits}\r\n\r\n".encode()
        )
        status, _, body, _ = read_answer(sock)
        sock.close()
        # httptools itself refuses a length past 64 bits (400); the app's checks answer 413 (a shorter one)
        assert status in (400, 413) and orjson.loads(body)["error"] in ("INVALID_REQUEST", "PAYLOAD_TOO_LARGE")
    with s.client() as c:
        r = c.get("/v1/batches", params={"limit": digits})
        assert r.status_code == 400 and r.json()["error"] == "INVALID_REQUEST", r.text
        r = c.post("/v1/batches", content=_deep_body(300), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["message"], r.text
        # One input rule everywhere: a lone surrogate is a 400 on /v1/batches as on /v1/inference.
        for path, body in (
            ("/v1/inference", b'{"input": "a\\ud800b"}'),
            ("/v1/batches", b'{"inputs": ["a\\ud800b"]}'),
            ("/v1/batches", b'{"inputs": ["a"], "metadata": {"k": "\\udc00"}}'),
        ):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"] == "INVALID_REQUEST", (path, r.text)
        assert c.get("/v1/batches").json()["data"] == []  # nothing was stored with a "?" in its place


def _deep_body(depth: int) -> bytes:
    return b'{"inputs": ["x"], "metadata": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


def test_the_corrupt_jobs_database_503_names_no_path(tmp_path, server_factory):
    db = tmp_path / "secret-place" / "j.db"
    db.parent.mkdir()
    db.write_bytes(b"this is not a database" * 100)
    s = server_factory("--devices", "1", "--sim-batch-ms", "5", "--jobs-db", str(db))
    with s.client() as c:
        r = c.post("/v1/batches", json={"inputs": ["a"]})
    assert r.status_code == 503 and r.json()["error"] == "JOBS_UNAVAILABLE", r.text
    assert "secret-place" not in r.text and str(tmp_path) not in r.text, r.text
    assert "secret-place" in s.log()  # the operator still learns which file


def test_a_500_keeps_the_connection_for_the_next_request(tmp_path):
    """An unexpected exception answered 500 used to close the keep-alive connection after the answer, so the
    client's next request, already on its way, was reset."""
    script = BOOM_SERVER
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: _try_get(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"INTERNAL_ERROR" not in data:
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 500") and b"secret" not in data
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        sock.close()
    finally:
        proc.kill()
        log = proc.communicate()[0]
    assert "secret detail" in log


# -- item 6: a refused body is read and discarded, so the client reads its 413 ------------------------------------
def test_a_client_that_writes_the_whole_body_first_reads_its_413(plain: LiveServer):
    s = plain

    async def post_big() -> list[int]:
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            statuses = []
            for _ in range(3):
                r = await c.post(
                    "/v1/inference",
                    content=b'{"input": "' + b"a" * (10 << 20) + b'"}',
                    headers={"Content-Type": "application/json"},
                )
                statuses.append(r.status_code)
                assert r.json()["error"] == "PAYLOAD_TOO_LARGE"
            return statuses

    assert asyncio.run(post_big()) == [413, 413, 413]


# -- item 2: a long prompt is refused by its size, and tokenized off the event loop ---------------------------------
@pytest.mark.slow
@pytest.mark.serial  # health checks' latency (median under 50 ms): other workers' CPU would be measured too
def test_megabyte_chat_prompts_do_not_hold_other_callers(server_factory):
    s = server_factory(
        "--backend",
        "smollm2",
        "--max-new-tokens",
        "4",
        "--generation-max-seqs",
        "2",
        "--generation-max-context",
        "256",
        "--slo-ms",
        "20000",
        "--timeout-ms",
        "60000",
    )
    huge = {"messages": [{"role": "user", "content": "hello world " * 80_000}], "max_tokens": 2}  # ~0.96 MB
    statuses: list[int] = []
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            while not stop.is_set():
                statuses.append(c.post("/v1/chat/completions", json=huge).status_code)

    floods = [threading.Thread(target=flood) for _ in range(2)]
    for t in floods:
        t.start()
    waits = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            wait_for(lambda: len(statuses) >= 2, timeout=60)
            for _ in range(60):
                began = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                waits.append(time.perf_counter() - began)
                time.sleep(0.02)
            # Below the size bound, the prompt is tokenized (in the pool) and refused by its token count; a
            # short one is served.
            long = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 3000}]})
            ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    finally:
        stop.set()
        for t in floods:
            t.join(60)
    assert set(statuses) == {400} and len(statuses) >= 4, statuses
    assert long.status_code == 400 and "tokens" in long.json()["error"]["message"], long.text
    assert ok.status_code == 200, ok.text
    # Each megabyte prompt held the loop ~0.3 s for its tokenizer: with two clients at it, nearly every health
    # check waited 100-400 ms. Now it is parsed and refused in a few milliseconds. (Generous: a shared
    # machine's noise stays far below these.)
    slow = sum(w > 0.15 for w in waits)
    assert statistics.median(waits) < 0.05 and slow <= len(waits) // 5, sorted(round(w * 1000) for w in waits)


# -- item 7: memory after an idle-connection flood ----------------------------------------------------------------
def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_heap_an_idle_flood_freed_goes_back_to_the_os(server_factory):
    s = server_factory("--devices", "1", "--sim-batch-ms", "5", "--max-connections", "6000")
    before = rss_mb(s.proc.pid)
    socks = [connect(s) for _ in range(5000)]
    wait_for(lambda: rss_mb(s.proc.pid) > before + 10, timeout=30)
    time.sleep(2)  # every connection accepted and its protocol built
    held = rss_mb(s.proc.pid)
    for sock in socks:
        sock.close()
    # Without the trim, most of what the flood took stayed: 5,000 connections 40 -> 70 -> 61-63 MB (with it:
    # 48-49 MB); 18,000: 40 -> 147 -> 114-128 MB (with it: 55 MB).
    limit = before + (held - before) / 2
    # Within 3 s, as before, but read every 0.1 s: the trim follows the closes within a few hundred ms.
    give_up, after = time.monotonic() + 3, rss_mb(s.proc.pid)
    while after >= limit and time.monotonic() < give_up:
        time.sleep(0.1)
        after = rss_mb(s.proc.pid)
    assert after < limit, (before, held, after)
    with s.client() as c:
        assert c.get("/healthz").status_code == 200


# -- item 7 (low): connections waiting in the listen backlog when drain closes the listener ----------------------
@pytest.mark.serial  # beside 3 busy workers, 1 connection in ~10,000 was reset at the listener's close
def test_connections_in_the_backlog_when_the_listener_closes_are_answered_not_reset(server_factory):
    s = server_factory("--devices", "1", "--sim-batch-ms", "5", "--drain-grace-s", "1")
    port = int(s.url.rsplit(":", 1)[1])
    outcomes: list[str] = []
    stop = threading.Event()

    def reconnect() -> None:  # a new connection per request, as fast as it is answered
        while not stop.is_set():
            sock = socket.socket()
            sock.settimeout(10)
            try:
                sock.connect(("127.0.0.1", port))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                outcomes.append("answered" if sock.recv(4096).startswith(b"HTTP/1.1 ") else "closed")
            except ConnectionRefusedError:
                outcomes.append("refused")  # the listener is closed: nothing was sent, the client knows it
                time.sleep(0.001)
            except ConnectionResetError:
                outcomes.append("reset")  # accepted by the kernel, then dropped: was it run?
            finally:
                sock.close()

    clients = [threading.Thread(target=reconnect) for _ in range(8)]
    for t in clients:
        t.start()
    time.sleep(1)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(3)  # the grace (1 s), the listener's close, the linger after it
    stop.set()
    for t in clients:
        t.join(15)
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    # Before: 7 resets at every drain (the connections the kernel had completed but the loop not yet accepted).
    assert counts.get("reset", 0) == 0 and counts.get("closed", 0) == 0, counts
    assert counts["answered"] > 0 and counts["refused"] > 0, counts
