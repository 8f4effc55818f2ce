"""uvicorn's httptools protocol, with DESIGN §2's JSON error body for requests broken at the HTTP level.

A request the HTTP parser cannot read (a bad Content-Length, a malformed request line, bad chunk framing)
never reaches the app: uvicorn answers it itself, in plain text. Clients and tests rely on one error shape, so
this answers the same 400 as JSON `{"error": "INVALID_REQUEST", "message", "request_id"}` (and still closes
the connection, as uvicorn does: after a parse error the stream cannot be trusted).
"""

from __future__ import annotations

import secrets

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        request_id = "req_" + secrets.token_hex(8)
        body = orjson.dumps({"error": "INVALID_REQUEST", "message": f"malformed HTTP request: {msg}",
                             "request_id": request_id})
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head += [b"content-type: application/json\r\n", b"x-request-id: " + request_id.encode() + b"\r\n",
                 b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n", b"\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
