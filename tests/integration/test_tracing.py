"""OpenTelemetry traces (issue 26 item 3): a live server with an OTLP endpoint in its environment sends its spans
over OTLP/HTTP to a receiver this test starts (decoded with opentelemetry-proto): a SERVER span per request whose
parent is the caller's `traceparent`, its queue wait as a child span, and a span per batch linked to the request
spans it carried. With no endpoint, tracing is off: the app is not even wrapped."""

from __future__ import annotations

import concurrent.futures
import http.server
import secrets
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.conftest import start_server


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: keeps every span it is sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), ReceiverHandler)


class ReceiverHandler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in request.resource_spans:
                self.server.resources.append({a.key: a.value.string_value for a in resource_spans.resource.attributes})
                for scope in resource_spans.scope_spans:
                    self.server.spans.extend(scope.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def attrs(span: Span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = (
            v.string_value
            if v.HasField("string_value")
            else v.int_value
            if v.HasField("int_value")
            else (v.double_value if v.HasField("double_value") else v.bool_value)
        )
    return out


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    threading.Thread(target=r.serve_forever, daemon=True).start()
    yield r
    r.shutdown()
    r.server_close()


@pytest.fixture(scope="module")
def server(receiver: Receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    s = start_server("--devices", "1", "--sim-batch-ms", "50", "--slo-ms", "2000", "--timeout-ms", "10000", env=env)
    yield s
    s.stop()


def wait_for(receiver: Receiver, found, timeout: float = 15.0):
    give_up = time.monotonic() + timeout
    while True:
        with receiver.lock:
            spans = list(receiver.spans)
        result = found(spans)
        if result or time.monotonic() > give_up:
            return result, spans
        time.sleep(0.05)


def test_spans_reach_the_receiver_linked_and_parented(server, receiver):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # company in the batch, from other traces
        others = [
            pool.submit(httpx.post, server.url + "/v1/inference", json={"input": f"other {i}"}, timeout=30)
            for i in range(3)
        ]
        r = httpx.post(
            server.url + "/v1/inference",
            json={"input": "traced"},
            timeout=30,
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
        assert r.status_code == 200 and all(f.result().status_code == 200 for f in others)

    def complete(spans: list[Span]):
        mine = [s for s in spans if s.trace_id.hex() == trace_id]
        request = [s for s in mine if s.kind == Span.SPAN_KIND_SERVER]
        queue = [s for s in mine if s.name == "queue"]
        batch = [
            s
            for s in spans
            if s.name == "batch sim@v1" and request and any(link.span_id == request[0].span_id for link in s.links)
        ]
        return (request[0], queue[0], batch[0]) if request and queue and batch else None

    found, spans = wait_for(receiver, complete)
    assert found, [(s.name, s.trace_id.hex()) for s in spans]
    request, queue, batch = found
    # The request span: a child of the caller's span, named by its route, with the model, tier and outcome.
    assert request.parent_span_id.hex() == parent_id and request.name == "POST /v1/inference"
    a = attrs(request)
    assert a["http.route"] == "/v1/inference" and a["http.response.status_code"] == 200
    assert a["gen_ai.request.model"] == "sim@v1" and a["batchserve.tier"] == "paid" and a["batchserve.outcome"] == "ok"
    # Its queue wait: a child span, inside the request, linked to the batch that took it.
    assert queue.parent_span_id == request.span_id
    assert request.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
    assert queue.end_time_unix_nano <= request.end_time_unix_nano
    assert [link.span_id for link in queue.links] == [batch.span_id]
    # The batch: its own trace (it serves many), linked to every request it carried, with its size.
    b = attrs(batch)
    assert b["batchserve.batch.size"] == len(batch.links) >= 1 and b["batchserve.model"] == "sim@v1"
    assert batch.trace_id != request.trace_id and batch.parent_span_id == b""
    assert batch.end_time_unix_nano - batch.start_time_unix_nano >= 45e6  # the sim's 50 ms batch
    with receiver.lock:
        assert {"service.name": "batchserve"}.items() <= receiver.resources[0].items()


def test_v2_infer_and_a_refusal_are_traced_by_route(server, receiver):
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]}
    trace_id = secrets.token_hex(16)
    tp = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert httpx.post(server.url + "/v2/models/sim/infer", json=body, headers=tp, timeout=30).status_code == 200
    missing = secrets.token_hex(16)
    r = httpx.post(
        server.url + "/v1/inference",
        json={"input": "x", "model": "nope"},
        headers={"traceparent": f"00-{missing}-{secrets.token_hex(8)}-01"},
    )
    assert r.status_code == 404

    def both(spans: list[Span]):
        v2 = [s for s in spans if s.trace_id.hex() == trace_id and s.kind == Span.SPAN_KIND_SERVER]
        refused = [s for s in spans if s.trace_id.hex() == missing]
        return (v2[0], refused) if v2 and refused else None

    found, _ = wait_for(receiver, both)
    assert found
    v2, refused = found
    assert v2.name == "POST /v2/models/{model}/infer" and attrs(v2)["http.route"] == "/v2/models/{model}/infer"
    _, spans = wait_for(
        receiver, lambda spans: len([s for s in spans if s.trace_id.hex() == trace_id and s.name == "queue"]) == 3
    )
    assert len([s for s in spans if s.trace_id.hex() == trace_id and s.name == "queue"]) == 3  # one per element
    assert [s.name for s in refused] == ["POST /v1/inference"]  # no queue span: it never waited
    assert attrs(refused[0])["http.response.status_code"] == 404


def test_openai_routes_carry_the_genai_operation(server, receiver):
    trace_id = secrets.token_hex(16)
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": "x"},  # the sim makes no vectors: 404/400
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    assert r.status_code in (400, 404)
    found, _ = wait_for(receiver, lambda spans: [s for s in spans if s.trace_id.hex() == trace_id])
    assert found and attrs(found[0])["gen_ai.operation.name"] == "embeddings"
    assert attrs(found[0])["http.response.status_code"] == r.status_code
