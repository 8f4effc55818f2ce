"""Bad input through real HTTP (issue 3 §7): property-based, against a live server.

Hypothesis throws malformed JSON, wrong types, huge and deeply nested bodies, invalid UTF-8 and odd content
types at `POST /v1/inference`. For every example an oracle written from docs/contract.md#errors (not the handler) says
which statuses are right; the answer must be one of them, an error must have exactly the error shape of the
OpenAPI document, and a 200 must carry the input reversed (the sim contract). Afterwards the server must still be
alive, have logged no traceback, and answer a correct request correctly.
"""

from __future__ import annotations

import json
import select
import socket
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from tests.conftest import LiveServer, start_server

MAX_BODY = 1 << 20  # the server's defaults, which this module does not change
MAX_INPUT = 16384
MAX_TIMEOUT_MS = 60000
COMFORTABLE_MS = 5000  # a deadline this long is always enough on the idle test server
MODELS_OK = {"sim", "sim@v1"}

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


# -- the live server and the schemas it publishes ------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    # 5 ms batches keep the valid examples fast; the limits are the defaults under test.
    s = start_server("--devices", "2", "--sim-batch-ms", "5", "--slo-ms", "1000", "--timeout-ms", "10000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer):
    with server.client(timeout=30) as c:
        yield c


class Schemas(dict):
    """The validators; a short repr keeps hypothesis' failure reports readable."""

    def __repr__(self) -> str:
        return "<schemas from /openapi.json>"


@pytest.fixture(scope="module")
def schemas(client: httpx.Client) -> Schemas:
    """Validators for the success and error bodies, taken from the server's own /openapi.json."""
    doc = client.get("/openapi.json").json()

    responses = doc["paths"]["/v1/inference"]["post"]["responses"]

    def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator({**doc, **schema})  # the document is the root for its $refs

    by_status = {
        int(k): validator(v["content"]["application/json"]["schema"])
        for k, v in responses.items()
        if k.isdigit() and k != "200"
    }
    return Schemas(
        error=validator({"$ref": "#/components/schemas/Error"}),
        by_status=by_status,
        ok=validator({"$ref": "#/components/schemas/InferenceResponse"}),
    )


# -- the oracle: docs/contract.md#errors, field by field ---------------------------------------------------------------
def allowed(body: bytes, content_type: str | None) -> set[int]:
    """Every status docs/contract.md#errors allows for this body: each problem found is a valid reason for its status.
    The media type application/json or application/<anything>+json (any parameters), or none at all, means
    JSON; any other (text/json, application/notjson) 400."""
    content_type = (content_type or "").strip()  # HTTP trims header values; an empty one says nothing
    media = content_type.split(";")[0].strip().lower()
    if (
        media
        and media != "application/json"
        and not (media.startswith("application/") and media.endswith("+json") and len(media) > len("application/+json"))
    ):
        return {400}
    if len(body) > MAX_BODY:
        return {413}
    try:
        data = orjson.loads(body)  # strict RFC 8259 in UTF-8: no NaN, no BOM, no lone surrogates
    except orjson.JSONDecodeError:
        return {400}
    if not isinstance(data, dict):
        return {400}
    reasons: set[int] = set()
    text = data.get("input")
    if not isinstance(text, str) or not text:
        reasons.add(400)
    elif len(text) > MAX_INPUT:
        reasons.add(413)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        reasons.add(400)
    timeout = data.get("timeout_ms", 10000)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT_MS:
        reasons.add(400)
    if reasons:
        return reasons
    if model is not None and model not in MODELS_OK:
        return {404}
    if timeout < COMFORTABLE_MS:  # too short a deadline: shorter than a batch (400), refused (503) or expired (504)
        return {200, 400, 503, 504}
    return {200}


def check_answer(schemas: dict[str, Any], resp: httpx.Response, body: bytes, content_type: str | None) -> None:
    ok = allowed(body, content_type)
    if currently_in_test_context():
        event(f"status {resp.status_code}")  # shown by --hypothesis-show-statistics
    assert resp.status_code in ok, f"{resp.status_code} {resp.text[:300]!r} for {body[:200]!r} ({content_type!r})"
    assert resp.headers.get("content-type", "").startswith("application/json")
    payload = resp.json()
    if resp.status_code == 200:
        schemas["ok"].validate(payload)
        assert payload["output"] == orjson.loads(body)["input"][::-1]
    else:
        # The published shape for this status, including which codes it may carry.
        schemas["by_status"][resp.status_code].validate(payload)
    assert resp.headers["x-request-id"] == payload["request_id"]


def post(client: httpx.Client, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post("/v1/inference", content=body, headers=headers)


def assert_alive_and_correct(server: LiveServer, client: httpx.Client) -> None:
    assert server.proc.poll() is None, "the server exited:\n" + server.log()
    assert client.get("/healthz").status_code == 200
    r = client.post("/v1/inference", json={"input": "still here ✓"})
    assert r.status_code == 200, r.text
    assert r.json()["output"] == "✓ ereh llits"
    assert "Traceback" not in server.log(), server.log()


# -- strategies -----------------------------------------------------------------------------------------------
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
inputs = st.one_of(
    st.text(min_size=1, max_size=60),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=60),
    st.sampled_from(["", " ", "\x00", "a" * MAX_INPUT, "é" * MAX_INPUT, "a" * (MAX_INPUT + 1), "😀" * 9000]),
)
timeouts = st.one_of(
    st.sampled_from([0, -1, 1, 0.5, 5000, 60000, 60000.5, 60001, 1e300, True, False, "100"]),
    st.integers(-10, 120000),
    st.floats(allow_nan=False, allow_infinity=False),
)
models = st.one_of(st.sampled_from(["sim", "sim@v1", "sim@v2", "nope", "", "@", "sim@"]), json_values)
content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/vnd.api+json",
            "text/json",
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/octet-stream",
            "",
            ";",
            "json",
            "application/notjson",
            "application/+json",
            "application/problem+json; charset=utf-8",
            "application/json;;;",
            "*/*",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip),
)  # stripped: HTTP trims header values and h11 refuses to send untrimmed ones


@st.composite
def request_objects(draw: st.DrawFn) -> dict[str, Any]:
    """An object near the contract: each field present or not, right or wrong type, plus stray keys."""
    obj: dict[str, Any] = {}
    if draw(st.booleans()) or draw(st.booleans()):
        obj["input"] = draw(inputs | json_values)
    if draw(st.booleans()):
        obj["model"] = draw(models)
    if draw(st.booleans()):
        obj["timeout_ms"] = draw(timeouts)
    obj.update(draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k not in obj), json_values, max_size=3)))
    return obj


@st.composite
def mangled_json(draw: st.DrawFn) -> bytes:
    """Valid JSON with bytes cut, swapped in or spliced: truncation, invalid UTF-8, stray controls."""
    body = json.dumps(draw(request_objects()), ensure_ascii=False).encode()
    cut = draw(st.integers(0, len(body)))
    splice = draw(
        st.sampled_from(
            [
                b"",
                b"\xff",
                b"\xc3",
                b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80",
                b"\x00",
                b"\\ud800",
                b"\\",
                b'"',
                b",",
                b"}",
                b"]",
                b"NaN",
                b"\xef\xbb\xbf",
                b"\xc0\xaf",
                b"\r\n",
            ]
        )
    )
    how = draw(st.sampled_from(["cut", "insert", "replace", "prefix"]))
    if how == "cut":
        return body[:cut]
    if how == "insert":
        return body[:cut] + splice + body[cut:]
    if how == "replace":
        return body[:cut] + splice + body[cut + len(splice) :]
    return splice + body


def nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"input":' + b"[" * depth + b'"x"' + b"]" * depth + b"}"  # nested inside the input field


# -- properties -----------------------------------------------------------------------------------------------
@FUZZ
@given(obj=request_objects(), content_type=content_types, ascii_only=st.booleans())
def test_wrong_types_and_values(server, client, schemas, obj, content_type, ascii_only):
    body = json.dumps(obj, ensure_ascii=ascii_only).encode()  # json, not orjson: it writes ints past 64 bits
    check_answer(schemas, post(client, body, content_type), body, content_type)


@FUZZ
@given(body=mangled_json())
def test_malformed_json_and_invalid_utf8(server, client, schemas, body):
    check_answer(schemas, post(client, body, "application/json"), body, "application/json")


@settings(max_examples=150, deadline=None, database=None)
@given(body=st.binary(max_size=2000), content_type=content_types)
def test_arbitrary_bytes(server, client, schemas, body, content_type):
    check_answer(schemas, post(client, body, content_type), body, content_type)


@settings(max_examples=60, deadline=None, database=None)
@given(depth=st.integers(1, 200_000), kind=st.sampled_from(["list", "object", "input"]))
def test_deeply_nested(server, client, schemas, depth, kind):
    body = nested(depth, kind)
    check_answer(schemas, post(client, body, "application/json"), body, "application/json")


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps({"input": "x" * (MAX_BODY - 20)}),  # body under the limit, input over its own
        orjson.dumps({"input": "ok", "pad": "x" * MAX_BODY}),  # body just over the limit
        orjson.dumps({"input": "é" * MAX_INPUT}),  # at the input limit in characters
        orjson.dumps({"input": "é" * (MAX_INPUT + 1)}),  # just over it
        b"[" + b"1," * (MAX_BODY // 2 - 2) + b"1]",  # a huge array, just under the limit
    ],
    ids=["input-over", "body-over", "input-at-limit", "input-over-multibyte", "huge-array"],
)
def test_huge_bodies(server, client, schemas, body):
    check_answer(schemas, post(client, body, "application/json"), body, "application/json")


def test_every_property_left_the_server_alive_and_correct(server, client):
    assert_alive_and_correct(server, client)


# -- bodies over the limit that are never buffered whole ----------------------------------------------------
def port_of(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def check_error(status: int, headers: dict[str, str], body: bytes, want_status: int, want_code: str) -> None:
    assert status == want_status, body
    assert headers["content-type"].startswith("application/json")
    payload = orjson.loads(body)
    assert set(payload) == {"error", "message", "request_id"} and payload["error"] == want_code


def test_chunked_10mb_body_gets_413_before_it_is_all_sent(server, client):
    """A 10 MB chunked body (no Content-Length): the 413 must come once the limit is passed, while most of the
    body is still unsent, which shows the server never buffers it whole."""
    total, chunk = 10_000_000, b"a" * 65536
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    with socket.create_connection(("127.0.0.1", port_of(server))) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.sendall(
            b"POST /v1/inference HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sent = 0
        while sent < total:
            if select.select([sock], [], [], 0.005)[0]:
                break  # the answer is there
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        assert sent < total, "the server let the whole 10 MB body in before answering"
        status, headers, body = read_response(sock)
    check_error(status, headers, body, 413, "PAYLOAD_TOO_LARGE")
    assert sent < total / 2, f"the 413 came only after {sent} bytes"
    assert_alive_and_correct(server, client)


def test_declared_10mb_body_gets_413_at_once(server):
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as sock:
        # Only the headers and a few bytes go out: the answer comes without the body ever being sent.
        sock.sendall(
            b"POST /v1/inference HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 10000000\r\n\r\n{"input": "'
        )
        status, headers, body = read_response(sock)
    check_error(status, headers, body, 413, "PAYLOAD_TOO_LARGE")


def test_malformed_http_gets_the_json_400(server, client):
    """Requests broken at the HTTP level never reach the app: the HTTP protocol answers them (batchserve's
    subclass of uvicorn's), with the same JSON 400 as the app, and the server goes on."""
    for raw in (
        b"POST /v1/inference HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}",
        b"GARBAGE\r\n\r\n",
        b"POST /v1/inference HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/inference HTTP/1.1\r\nHo st: t\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", port_of(server))) as sock:
            sock.sendall(raw)
            status, headers, body = read_response(sock)
        check_error(status, headers, body, 400, "INVALID_REQUEST")
        assert headers["x-request-id"] == orjson.loads(body)["request_id"]
    assert_alive_and_correct(server, client)


# -- other routes and methods ----------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None, database=None)
@given(
    path=st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#?%"), max_size=40),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
)
def test_unknown_routes_and_methods_answer_the_error_shape(server, client, schemas, path, method):
    resp = client.request(method, "/" + path.lstrip("/"), content=b"{}")
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        schemas["error"].validate(resp.json())


SAFE_ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"
MAX_ID = 128


@settings(max_examples=40, deadline=None, database=None)
@given(
    request_id=st.one_of(
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200).map(
            str.strip
        ),  # HTTP trims header values; h11 refuses to send untrimmed ones
        st.text(alphabet=SAFE_ID_CHARS, max_size=MAX_ID + 20),  # safe characters, around the length limit
    )
)
def test_request_id_header_is_echoed_only_when_safe(server, client, request_id):
    resp = client.post("/v1/inference", json={"input": "abc"}, headers={"x-request-id": request_id})
    assert resp.status_code == 200
    echoed = resp.headers["x-request-id"]
    assert echoed == resp.json()["request_id"]
    safe = 1 <= len(request_id) <= MAX_ID and all(c in SAFE_ID_CHARS for c in request_id)
    if safe:  # a safe id is the caller's to keep: echoed exactly
        assert echoed == request_id
    else:  # anything else is replaced by a generated one, never passed through (log and header injection)
        assert echoed != request_id and echoed.startswith("req_")
    assert all(c in SAFE_ID_CHARS for c in echoed)


@pytest.mark.parametrize(
    "request_id, echoed",
    [
        ("trace-42", True),
        ("a" * MAX_ID, True),
        ("ns:svc.v1_x-1", True),
        ("a" * (MAX_ID + 1), False),
        ("two words", False),
        ("a\tb", False),
        ("x<y>", False),
        ("", False),
    ],
)
def test_request_id_examples(client, request_id, echoed):
    r = client.post("/v1/inference", json={"input": "abc"}, headers={"x-request-id": request_id})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["request_id"]
    assert (r.headers["x-request-id"] == request_id) is echoed


def test_server_is_alive_and_correct_at_the_end(server, client):
    assert_alive_and_correct(server, client)
