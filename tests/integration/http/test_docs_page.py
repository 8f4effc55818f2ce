"""`GET /docs` (issue 26 item 6): Swagger UI renders the live /openapi.json in a real headless Chromium (Debian's
`chromium`, installed by scripts/chromium.py when missing), and every request the page sends, as the browser's
DevTools protocol reports them, goes to this server."""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from scripts.chromium import ChromiumUnavailable, ensure_chromium, load_page
from tests.conftest import LiveServer, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = start_server("--devices", "1", "--sim-batch-ms", "5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def chromium() -> str:
    try:
        return ensure_chromium()
    except ChromiumUnavailable as exc:  # not root and not installed: say how, do not pass silently
        pytest.fail(str(exc))


def test_docs_renders_in_chromium_with_nothing_leaving_the_machine(server: LiveServer, chromium):
    page = load_page(server.url + "/docs", "document.querySelectorAll('.opblock').length > 20")
    # Rendered by Swagger UI's scripts (the served HTML holds none of these): operations of every wing.
    paths = set(re.findall(r'data-path="([^"]+)"', page.dom))
    assert {
        "/v1/inference",
        "/v1/embeddings",
        "/v1/batches",
        "/v2/models/{model}/infer",
        "/v2/health/ready",
        "/metrics",
        "/docs",
    } <= paths, sorted(paths)
    assert "One input, one synchronous answer" in page.dom  # an operation's summary
    assert "jsonSchemaDialect" not in page.dom and "Failed to load API definition" not in page.dom
    # Every request the page sent went to this server (the page, its assets, the document), none was blocked.
    host = urlsplit(server.url).netloc
    outside = [u for u in page.requested if urlsplit(u).netloc != host and not u.startswith("data:")]
    assert not outside and not page.blocked, (outside, page.blocked)
    asked = {urlsplit(u).path for u in page.requested}
    assert {
        "/docs",
        "/docs/init.js",
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
        "/openapi.json",
    } <= asked, asked


def test_docs_assets_are_local_and_only_the_pages_own(server: LiveServer):
    with server.client() as c:
        page = c.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources and all(s.startswith("/docs/") for s in sources), sources  # no outside URL at all
        for src in sources:
            assert c.get(src).status_code == 200, src
        assert "validatorUrl: null" in c.get("/docs/init.js").text  # the badge would call validator.swagger.io
        r = c.get("/docs/assets/swagger-editor-bundle.js")  # in the package, but not the page's
        assert r.status_code == 404 and r.json()["error"] == "NOT_FOUND"
        assert c.get("/docs/assets/..%2F__init__.py").status_code == 404
