"""OpenAI's Files + Batches API (issue 26, item 1) through real HTTP with the official `openai` client, on the
durable job store, SQLite and PostgreSQL alike: a 300-line embeddings batch from input file to output file
(each line answered with the body the online route gives), a bad line in the error file, /v1/inference lines,
cancel, list with a cursor, the file limits, and refusals of a bad input file. The embeddings come from a small
plugin (exact float32 values, no model to load), as in tests/integration/embeddings/test_routes.py."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import httpx

import orjson
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.embeddings.test_routes import EMBED_PLUGIN

if TYPE_CHECKING:
    import openai

CONFIG = (
    '[[models]]\nname = "embed"\nbackend = "embedplug:Embed"\n\n'
    '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n\n'
    '[[models]]\nname = "slow"\nbackend = "sim"\nsim_batch_ms = 300\n'
)


def launch(tmp: Any, *args: str, models: str = "") -> LiveServer:
    """A server of CONFIG's models, and `models` (more [[models]] tables, their plugins written in `tmp`)."""
    (tmp / "embedplug.py").write_text(EMBED_PLUGIN)
    (tmp / "bs.toml").write_text(CONFIG + models)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
    return start_server(
        "--config",
        str(tmp / "bs.toml"),
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "10000",
        "--jobs-max-inflight",
        "8",
        "--files-max-bytes",
        "100000",
        *args,
        env=env,
    )


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("oai-batch")
    db = request.getfixturevalue("pg_server").fresh_url() if request.param == "postgres" else str(tmp / "jobs.db")
    s = launch(tmp, "--jobs-db", db)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0, timeout=30)


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[dict], name: str = "input.jsonl") -> str:
    f = client.files.create(file=(name, jsonl(lines), "application/jsonl"), purpose="batch")
    assert f.id.startswith("file-") and f.purpose == "batch" and f.bytes == len(jsonl(lines))
    return f.id


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    give_up = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "failed", "expired"):
            return batch
        assert time.monotonic() < give_up, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines()]


def unbatched(body: dict) -> dict:
    """An embeddings body with each vector's second value (the plugin's batch size) set to 0: how inputs were
    batched differs from run to run; everything else must be the same."""
    for d in body["data"]:
        d["embedding"][1] = 0.0
    return body


def test_300_line_embeddings_batch_from_file_to_output_file(client: openai.OpenAI, server: LiveServer):
    texts = [f"line {i} " + "w " * (i % 5) for i in range(300)]
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "embed", "input": text}}
        for i, text in enumerate(texts)
    ]
    lines.insert(
        150,
        {"custom_id": "bad-one", "method": "POST", "url": "/v1/embeddings", "body": {"model": "embed", "input": ""}},
    )  # the online route answers this 400
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h", metadata={"run": "300"}
    )
    assert batch.id.startswith("batch_") and batch.status == "in_progress" and batch.input_file_id == file_id
    assert batch.endpoint == "/v1/embeddings" and batch.metadata == {"run": "300"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (301, 300, 1)
    assert batch.output_file_id and batch.error_file_id

    out = lines_of(client, batch.output_file_id)
    assert len(out) == 300 and [o["custom_id"] for o in out] == [f"req-{i}" for i in range(300)]
    assert len({o["id"] for o in out}) == 300 and all(o["error"] is None for o in out)
    with httpx.Client(base_url=server.url) as c:  # the online route, for the same inputs
        for i in (0, 7, 299):
            online = c.post("/v1/embeddings", json=lines[i if i < 150 else i + 1]["body"]).json()
            response = out[i]["response"]
            assert response["status_code"] == 200 and response["request_id"]
            assert unbatched(response["body"]) == unbatched(online)
    assert all(o["response"]["body"]["data"][0]["embedding"][0] == float(len(t)) for o, t in zip(out, texts))

    errors = lines_of(client, batch.error_file_id)
    assert len(errors) == 1 and errors[0]["custom_id"] == "bad-one"
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "input"  # OpenAI's error shape, as online

    meta = client.files.retrieve(batch.output_file_id)
    assert meta.bytes == len(client.files.content(batch.output_file_id).content)


def test_inference_lines_and_the_native_body_beside_them(client: openai.OpenAI, server: LiveServer):
    lines = [
        {
            "custom_id": f"inf-{i}",
            "method": "POST",
            "url": "/v1/inference",
            "body": {"model": "echo", "input": f"abc{i}"},
        }
        for i in range(20)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/inference", completion_window="24h"
    )
    batch = wait_done(client, batch.id)
    out = lines_of(client, batch.output_file_id)
    with httpx.Client(base_url=server.url) as c:
        online = c.post("/v1/inference", json={"model": "echo", "input": "abc3"}).json()
        native = c.post("/v1/batches", json={"inputs": ["xyz"], "model": "echo"})  # batchserve's own body
        assert native.status_code == 202 and native.json()["total"] == 1 and "endpoint" not in native.json()
    body = out[3]["response"]["body"]
    assert out[3]["custom_id"] == "inf-3" and body["output"] == online["output"] and body["model"] == "echo@v1"
    assert set(body) == set(online)
    assert batch.error_file_id is None


def test_an_integer_past_64_bits_fails_its_line_alone(client: openai.OpenAI):
    """JSON has no bound on integers (orjson's 64 bits refused the whole file as 'nested too deeply'): a line
    whose field takes it runs, one whose field cannot is that line's 400, and the others run."""
    big = "123456789012345678901234567890"
    raw = "".join(
        f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/inference", "body": {{"model": "echo", {body}}}}}\n'
        for cid, body in [
            ("plain", '"input": "a"'),
            ("ignored", f'"input": "b", "n": {big}'),
            ("bad", f'"input": "c", "timeout_ms": {big}'),
            ("after", '"input": "d"'),
        ]
    )
    file_id = client.files.create(file=("big.jsonl", raw.encode(), "application/jsonl"), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/inference", completion_window="24h")
    batch = wait_done(client, batch.id)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert [o["custom_id"] for o in lines_of(client, batch.output_file_id)] == ["plain", "ignored", "after"]
    (bad,) = lines_of(client, batch.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert "timeout_ms" in bad["response"]["body"]["message"], bad


def test_cancel_stops_the_lines_not_yet_run(client: openai.OpenAI):
    lines = [
        {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/inference", "body": {"model": "slow", "input": f"x{i}"}}
        for i in range(200)
    ]  # 300 ms per 8 lines: ~8 s
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/inference", completion_window="24h"
    )
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed < 200
    errors = lines_of(client, batch.error_file_id)
    skipped = [e for e in errors if e["error"] is not None]
    assert skipped and all(e["error"]["code"] == "cancelled" and e["response"] is None for e in skipped)
    done = lines_of(client, batch.output_file_id) if batch.output_file_id else []
    assert len(done) + len(errors) == 200
    assert sorted(int(x["custom_id"][2:]) for x in done + errors) == list(range(200))


def test_list_batches_and_files_with_a_cursor(client: openai.OpenAI):
    made = []
    for n in range(3):
        line = [{"custom_id": "only", "method": "POST", "url": "/v1/inference", "body": {"input": f"l{n}"}}]
        made.append(
            client.batches.create(
                input_file_id=upload(client, line, f"l{n}.jsonl"), endpoint="/v1/inference", completion_window="24h"
            ).id
        )
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the client follows the cursor by itself
    assert every[:3] == made[::-1] and len(every) == len(set(every))
    files = client.files.list(limit=2)
    assert len(files.data) == 2 and files.data[0].filename == "l2.jsonl"
    assert [f.filename for f in client.files.list(limit=1, after=files.data[0].id).data] == ["l1.jsonl"]


def test_file_retrieve_content_and_delete(client: openai.OpenAI):
    import openai

    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "q"}}]
    file_id = upload(client, lines, "keep.jsonl")
    assert client.files.retrieve(file_id).filename == "keep.jsonl"
    assert client.files.content(file_id).content == jsonl(lines)
    assert client.files.delete(file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")


@pytest.mark.parametrize(
    "lines, endpoint, says",
    [
        (
            [{"custom_id": "a", "method": "POST", "url": "/v1/inference", "body": {"input": "x"}}],
            "/v1/embeddings",
            "line 1: 'url'",
        ),
        ([{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}] * 2, "/v1/embeddings", "appears twice"),
        ([{"custom_id": "a", "url": "/v1/embeddings", "body": "x"}], "/v1/embeddings", "'body' must be"),
        (
            [{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "model": "echo"}}],
            "/v1/embeddings",
            "does not produce embeddings",
        ),
        (
            [
                {"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "model": "embed"}},
                {"custom_id": "b", "url": "/v1/embeddings", "body": {"input": "x", "model": "echo"}},
            ],
            "/v1/embeddings",
            "different models",
        ),
        (
            [{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}}],
            "/v1/chat/completions",
            "generation engine, which is off",
        ),
    ],
)
def test_a_bad_input_file_is_refused_whole(client: openai.OpenAI, server: LiveServer, lines, endpoint, says):
    file_id = upload(client, lines)
    with httpx.Client(base_url=server.url) as c:
        newest = lambda: [b["id"] for b in c.get("/v1/batches", params={"limit": 1}).json()["data"]]  # noqa: E731
        before = newest()
        r = c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"})
        assert r.status_code == 400 and says in r.json()["message"], r.text
        assert set(r.json()) >= {"error", "message", "request_id"}
        assert newest() == before  # no job stored


def test_file_limits(tmp_path):
    import openai

    s = launch(tmp_path, "--jobs-db", str(tmp_path / "jobs.db"), "--files-max-count", "2")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="any", max_retries=0)
        line = {"custom_id": "a", "url": "/v1/inference", "body": {"input": "x"}}
        with pytest.raises(openai.APIStatusError) as big:
            c.files.create(file=("big.jsonl", jsonl([line]) * 4000), purpose="batch")  # 200 kB > 100 kB
        assert big.value.status_code == 413
        first = upload(c, [line])
        upload(c, [line])
        with pytest.raises(openai.ConflictError):
            upload(c, [line])
        c.files.delete(first)
        upload(c, [line])  # the delete freed a place
        with httpx.Client(base_url=s.url) as h:
            r = h.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
            assert r.status_code == 400 and "purpose" in r.json()["message"]
            r = h.post("/v1/files", json={"file": "x"})
            assert r.status_code == 400 and "multipart" in r.json()["message"]
    finally:
        s.stop()
