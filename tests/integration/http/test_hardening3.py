"""Issue 34's smaller findings (item 5), each through a live server: a forged log line, trailing-slash
redirects built from the caller's Host, the case of the X-RateLimit-* headers. Each test failed before its fix;
docs/hardening.md states the guarantee. (KServe's are in tests/integration/kserve, the client's in test_client.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.http.test_hardening import _free_port, _try_get
from tests.integration.jobs.test_routes import wait_for

# A real server (the real CLI, so its logging as configured) whose router raises on any path it does not know
# (a route's path pattern would not match a newline).
BOOM_CLI = (
    "import sys\n"
    "import batchserve.app as app_module\n"
    "from batchserve import cli\n"
    "real = app_module.create_app\n"
    "async def boom(scope, receive, send): raise RuntimeError('secret detail')\n"
    "def with_boom(*args, **kwargs):\n"
    "    app = real(*args, **kwargs)\n"
    "    app.app.router.default = boom\n"
    "    return app\n"
    "app_module.create_app = with_boom\n"
    "sys.exit(cli.main(['serve', '--port', sys.argv[1], '--devices', '1', '--sim-batch-ms', '5']))\n"
)

FORGED = "2026-01-01 00:00:00,000 INFO batchserve ready: forged by a caller"


def test_an_encoded_newline_in_a_path_cannot_forge_a_log_line():
    """`GET /boom/x%0A<a log line>` reaches a 500; its path (decoded: a real newline) was logged as given, so the
    log showed a line the server never wrote. Now the control characters are escaped: one record, one line."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOM_CLI, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "BATCHSERVE_DRAIN_GRACE_S": "0"},
    )
    try:
        wait_for(lambda: _try_get(f"http://127.0.0.1:{port}/readyz"), timeout=30)
        path = "/boom/x%0A" + FORGED.replace(" ", "%20") + "%0D%1B[31m"
        r = _try_get(f"http://127.0.0.1:{port}{path}")
        assert r is not None and r.status_code == 500 and r.json()["error"] == "INTERNAL_ERROR"
    finally:
        proc.terminate()  # a clean stop: every line the answer's error logged is written before it exits
        log = proc.communicate(timeout=60)[0]
    assert "secret detail" in log  # the traceback still reaches the operator
    assert not any(line.startswith(FORGED) for line in log.splitlines()), log
    assert "unhandled error on GET /boom/x\\x0a" + FORGED + "\\x0d\\x1b[31m" in log and "\x1b" not in log


@pytest.fixture(scope="module")
def plain():
    s = start_server("--devices", "1", "--sim-batch-ms", "5")
    yield s
    s.stop()


@pytest.mark.parametrize(
    "method,path", [("GET", "/readyz/"), ("POST", "/v1/inference/"), ("GET", "/v1/models/"), ("GET", "/nope/")]
)
def test_a_trailing_slash_is_a_404_not_a_redirect_built_from_the_host_header(plain: LiveServer, method, path):
    """It was a 307 whose Location was `http://<the caller's Host>/readyz`: an open redirect off any proxy
    that passes Host through. Now a JSON 404 that names the path without its slash, and no Location."""
    import httpx

    r = httpx.request(
        method, plain.url + path, headers={"Host": "evil.example"}, json={"input": "x"}, follow_redirects=False
    )
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)
    assert r.json()["error"] == "NOT_FOUND" and f"no trailing slash ({path.rstrip('/')})" in r.json()["message"]


def test_rate_limit_headers_have_one_case_on_a_200_and_a_429(tmp_path, server_factory):
    """`X-RateLimit-*` came Title-Case on /v1/inference's 200 (written by the route itself) and lower-case on a
    429 (and on every other route): one spelling now, lower-case like every other header batchserve writes."""
    import httpx

    from tests.integration.http.test_tenancy import add_key, bearer

    config = tmp_path / "bs.toml"
    config.write_text("[tiers.free]\nrate = 1\nburst = 2\n")
    key = add_key(config, "cheap", "free")
    server = server_factory("--config", str(config))
    with httpx.Client(base_url=server.url) as c:
        answers = [c.post("/v1/inference", json={"input": "x"}, headers=bearer(key)) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    for answer in (answers[0], answers[2]):
        names = {name for name, _ in answer.headers.raw if name.lower().startswith(b"x-ratelimit-")}
        assert names == {b"x-ratelimit-limit", b"x-ratelimit-remaining", b"x-ratelimit-reset"}, answer.headers.raw
