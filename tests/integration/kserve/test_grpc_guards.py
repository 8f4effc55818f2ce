"""The gRPC listener held to HTTP's limits, tried as a hostile client on a live server (`--grpc-port`): a cap on
its connections that keeps HTTP answering, connections without a call closed after the idle limit, a half-sent
call ended at the body timeout (raw HTTP/2 with `h2`), the FIRST `authorization` entry read as HTTP reads it, an
empty model name and garbage refused INVALID_ARGUMENT without Python's names, and a protobuf that cannot build
the messages said in one line (exit 2). The limits are scaled down by their flags so each test takes seconds."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.kserve.test_grpc import grpc_port

CAP = 20
IDLE_S = 2.0
BODY_S = 1.0
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    config = tmp_path_factory.mktemp("grpc_guards") / "bs.toml"
    digest = hashlib.sha256(b"sk-good").hexdigest()
    config.write_text(f'[[keys]]\ntenant = "good"\ntier = "paid"\nsha256 = "{digest}"\nrate = 1000\n')
    s = start_server(
        "--config",
        str(config),
        "--grpc-port",
        "0",
        "--grpc-max-connections",
        str(CAP),
        "--keep-alive-timeout-s",
        str(IDLE_S),
        "--header-timeout-s",
        str(IDLE_S),
        "--body-timeout-s",
        str(BODY_S),
        "--sim-batch-ms",
        "5",
    )
    yield s
    s.stop()


def h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


def idle_connection(port: int) -> socket.socket:
    """A connection that says HTTP/2's preface and SETTINGS, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(h2_client().data_to_send())
    return sock


def is_closed(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether the server has closed `sock` (its SETTINGS and GOAWAY read and thrown away), waiting up to `wait_s`."""
    sock.settimeout(max(wait_s, 0.01))
    give_up = time.monotonic() + wait_s
    try:
        while True:
            if not sock.recv(65536):
                return True
            sock.settimeout(max(give_up - time.monotonic(), 0.01))
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def raw_call(server: LiveServer, payload: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.RpcError:
    """ModelInfer with `payload` as its message, bytes as they are; the error it ends with."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(server)}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(INFER)(payload, metadata=metadata, timeout=10)
    return caught.value


def answered(server: LiveServer, payload: bytes, metadata: tuple[tuple[str, str], ...]) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(server)}") as channel:
        return channel.unary_unary(INFER)(payload, metadata=metadata, timeout=10)


def infer_message(model: str) -> bytes:
    """A one-string ModelInferRequest, as Triton's own messages write it."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a cat")
    return request.SerializeToString()


def test_idle_connections_past_the_grpc_cap_are_closed_while_http_answers(server):
    port = grpc_port(server)
    flood = [idle_connection(port) for _ in range(CAP + 30)]
    opened = time.monotonic()
    try:
        with server.client() as http:
            assert http.get("/healthz").status_code == 200
            r = http.post("/v1/inference", json={"input": "x"}, headers={"Authorization": "Bearer sk-good"})
            assert r.status_code == 200, r.text
        open_ones = list(flood)
        while len(open_ones) > CAP and time.monotonic() < opened + IDLE_S / 2:  # before the idle limit
            open_ones = [sock for sock in open_ones if not is_closed(sock, 0.01)]
        closed = len(flood) - len(open_ones)
        # well before the idle limit, the connections past the cap are gone and those under it are not
        assert 30 <= closed <= 30 + CAP // 2, f"{closed} of {len(flood)} closed at once (cap {CAP})"
    finally:
        for sock in flood:
            sock.close()


def test_a_connection_without_a_call_is_closed_after_the_idle_limit(server):
    give_up = time.monotonic() + 10
    while True:  # a flood before this test may still hold the cap a moment: past it, a connection closes at once
        sock = idle_connection(grpc_port(server))
        started = time.monotonic()
        if not is_closed(sock, 0.2) or time.monotonic() > give_up:
            break
        sock.close()
        time.sleep(0.2)
    try:
        assert is_closed(sock, IDLE_S * 4), f"still open {IDLE_S * 4:g} s after its preface"
        assert time.monotonic() - started >= IDLE_S / 2
    finally:
        sock.close()


def test_a_half_sent_call_ends_at_the_body_timeout(server):
    """HEADERS without END_STREAM and no message: the server ends the call (DEADLINE_EXCEEDED) at the body
    timeout, as HTTP ends a body that stops coming."""
    sock = socket.create_connection(("127.0.0.1", grpc_port(server)), timeout=BODY_S * 8)
    conn = h2_client()
    stream = conn.get_next_available_stream_id()
    head = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", INFER),
        (":authority", "batchserve"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("authorization", "Bearer sk-good"),
    ]
    conn.send_headers(stream, head, end_stream=False)
    conn.send_data(stream, b"\x00\x00\x00\x00\x10half", end_stream=False)  # 4 of the 16 bytes it announces
    sock.sendall(conn.data_to_send())
    started, status, ended = time.monotonic(), None, False
    try:
        while not ended:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = dict(event.headers).get(b"grpc-status", status)
                ended = ended or isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset))
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    took = time.monotonic() - started
    assert ended and status == b"4", f"status {status!r} after {took:.1f} s"  # DEADLINE_EXCEEDED
    assert BODY_S * 0.9 <= took < BODY_S * 6


def test_the_first_authorization_entry_is_the_callers(server):
    """As HTTP reads a repeated header: the first entry wins, whichever a proxy appended after it."""
    good, bad = ("authorization", "Bearer sk-good"), ("authorization", "Bearer sk-bad")
    assert answered(server, infer_message("sim"), (good, bad))
    err = raw_call(server, infer_message("sim"), (bad, good))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and err.details() == "unknown API key", err.details()
    err = raw_call(server, infer_message("sim"), (("authorization", "sk-good"),))  # HTTP's Bearer parsing
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in err.details(), err.details()


def test_an_empty_model_name_is_refused_naming_the_field(server):
    err = raw_call(server, infer_message(""), (("authorization", "Bearer sk-good"),))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'model_name'" in err.details(), err.details()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x00" * 7])
def test_garbage_is_invalid_argument_without_internals(server, payload: bytes):
    err = raw_call(server, payload, (("authorization", "Bearer sk-good"),))
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), details)
    assert "ModelInferRequest" in details and not any(w in details for w in ("Error", "Exception", "<class")), details
    with httpx.Client(base_url=server.url) as http:  # and nothing else was hurt
        assert http.get("/healthz").status_code == 200


def test_a_protobuf_that_cannot_build_the_messages_is_one_line_and_exit_2(tmp_path):
    """A `google.protobuf` without what the messages need (here a stand-in first on the path; in the field an old
    release that another package's pin brought): one line naming the install that fixes it, exit 2."""
    fake = tmp_path / "google" / "protobuf"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '3.19.0'\n")
    out = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))},
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len([ln for ln in lines if "batchserve: error" in ln]) == 1, out.stderr
    assert lines[-1].startswith("batchserve: error: --grpc-port") and "pip install 'protobuf>=" in lines[-1]
    assert "3.19.0" in lines[-1]


@pytest.mark.parametrize("trusted", [True, False])
def test_a_gateways_fairness_id_and_objective_hold_over_grpc_from_its_address_only(tmp_path, trusted: bool):
    """ModelInfer identifies its caller as the HTTP skeleton does (`http/endpoint.identify`, whose unit test shows
    the fairness id naming the fair queue's lane): behind a `--gateway-ips` peer llm-d's objective is the tier the
    request runs at (said back in `x-service-tier`, and booked so); from any other peer it is ignored. Either way
    the key's tenant is who the usage ledger books."""
    config = tmp_path / "bs.toml"
    admin = hashlib.sha256(b"sk-admin").hexdigest()
    app = hashlib.sha256(b"sk-app").hexdigest()
    config.write_text(
        f'[[keys]]\ntenant = "ops"\ntier = "paid"\nsha256 = "{admin}"\nadmin = true\n\n'
        f'[[keys]]\ntenant = "app"\ntier = "paid"\nsha256 = "{app}"\n'
    )
    network = "127.0.0.0/8" if trusted else "10.0.0.0/8"
    s = start_server("--config", str(config), "--grpc-port", "0", "--gateway-ips", network, "--sim-batch-ms", "5")
    try:
        gateway = (
            ("authorization", "Bearer sk-app"),
            ("x-llm-d-inference-fairness-id", "team-7"),
            ("x-llm-d-inference-objective", "flex"),
        )
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port(s)}") as channel:
            _, call = channel.unary_unary(INFER).with_call(infer_message("sim"), metadata=gateway, timeout=10)
        head = dict(call.initial_metadata())
        usage = httpx.get(s.url + "/v1/usage", headers={"Authorization": "Bearer sk-admin"}).json()["data"]
        served = {u["tenant"]: u["since_start"]["requests"]["met"] for u in usage}
        assert served.get("app") == 1, served
        metrics = httpx.get(s.url + "/metrics").text
        ran = "batch" if trusted else "paid"  # anyone else could name another tier
        assert re.search(rf'batchserve_slo_requests_total\{{[^}}]*tier="{ran}"[^}}]*\}} 1', metrics), metrics
        if trusted:
            assert head.get("x-service-tier") == "batch", head
        else:
            assert "x-service-tier" not in head, head
    finally:
        s.stop()
