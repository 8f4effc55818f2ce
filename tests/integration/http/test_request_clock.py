"""A request's clock starts at its first byte (`http/uvicorn_protocol.FIRST_BYTE`), as its client's does: the time
its head took to arrive counts in its latency (the answer's `latency_ms`, the SLO ledger) and in its deadline."""

from __future__ import annotations

import socket
import time

import orjson


def exchange(url: str, parts: list[bytes], pause_s: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause_s)
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0] if b"content-length: " in data else 1 << 30
        ):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), data
    return orjson.loads(body)


def test_a_slow_head_counts_in_latency_and_deadline(server_factory) -> None:
    s = server_factory("--devices", "1", "--sim-batch-ms", "20")
    body = orjson.dumps({"input": "abc", "timeout_ms": 2000})
    head = b"POST /v1/inference HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(
        body
    )
    answer = exchange(s.url, [head[:20], head[20:] + b"\r\n" + body], pause_s=0.4)
    assert answer["output"] == "cba"
    assert answer["latency_ms"] >= 400, answer  # from the first byte, 0.4 s before the head was whole
    # the deadline runs from the first byte too: 0.4 s of a 0.3 s timeout were spent before the app saw it
    short = orjson.dumps({"input": "abc", "timeout_ms": 300})
    head = head.replace(b"%d" % len(body), b"%d" % len(short))
    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head[:20])
        time.sleep(0.4)
        sock.sendall(head[20:] + b"\r\n" + short)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 50"), reply  # refused (503) or expired (504): never answered in time
