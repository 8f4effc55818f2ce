"""An upload's filename with a control character (issue 34, smaller findings): a 400 on either store. On
PostgreSQL a NUL was a 503 JOBS_UNAVAILABLE with a retry hint and an ERROR line per request (its text type
refuses NUL); the refusal now comes before the store, from `file_routes.upload_filename`."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveServer, start_server


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("file-names")
    db = request.getfixturevalue("pg_server").fresh_url() if request.param == "postgres" else str(tmp / "jobs.db")
    s = start_server("--devices", "1", "--sim-batch-ms", "5", "--jobs-db", db)
    yield s
    s.stop()


LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/inference", "body": {"input": "x"}}\n'


def multipart(filename: bytes) -> tuple[bytes, str]:
    """A form with this filename as raw bytes (httpx would percent-encode a control character)."""
    boundary = "bsboundary7"
    body = (
        b'--bsboundary7\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--bsboundary7\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + LINE + b"\r\n--bsboundary7--\r\n"
    )
    return body, f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(
    "name",
    [b"in\x00put.jsonl", b"\x1b[31mred.jsonl", b"a\x7f.jsonl", b"tab\there.jsonl"],
    ids=["nul", "escape", "del", "tab"],
)
def test_a_control_character_in_an_upload_s_filename_is_a_400(server: LiveServer, name: bytes):
    body, ctype = multipart(name)
    with httpx.Client(base_url=server.url) as c:
        r = c.post("/v1/files", content=body, headers={"Content-Type": ctype})
        assert r.status_code == 400 and r.json()["error"] == "INVALID_REQUEST", r.text
        assert "control character" in r.json()["message"]
        body, ctype = multipart(b"input.jsonl")
        ok = c.post("/v1/files", content=body, headers={"Content-Type": ctype})
        assert ok.status_code == 200 and ok.json()["filename"] == "input.jsonl", ok.text
    assert " ERROR " not in server.log(), server.log()
