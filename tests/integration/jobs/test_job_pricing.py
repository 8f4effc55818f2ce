"""Job lines priced by the inputs they hold (issue 33, item 4), through real HTTP on the real minilm model: an
OpenAI embeddings batch of 2,048-input lines runs beside another tenant's interactive /v1/embeddings requests,
and the interactive tenant is never refused while the batch completes with every embedding. Before, each line
counted as one item in flight, so all 2,048 inputs of a line entered minilm's queue at once, past `--max-queue`
(1,500 here: issue 33's 6-line file did the same to the default 10,000), and the interactive tenant got 503 "the
queue for minilm@v1 is full" until the batch had drained below it. And `--jobs-max-items` counts those inputs: a file
of one line more than it allows is refused with a 400 naming the line (before, it counted lines). The in-process
rules: tests/unit/jobs/test_job_pricing.py; the figures, before and after: bench/job_pricing.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import start_server
from tests.conftest import add_key

LINES, INPUTS = 1, 2048
MAX_QUEUE = 1500  # below the file's inputs: all of them at once would fill the queue
RATE = 4.0  # interactive requests/s: a modest load, well within the interactive tenant's share


@pytest.mark.slow
def test_an_embeddings_batch_of_2048_input_lines_beside_interactive_requests(tmp_path: Path) -> None:
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n')
    web, batch_key = (add_key(config, tenant, "paid", "--rate", "100000") for tenant in ("web", "batch"))
    server = start_server(
        "--config",
        str(config),
        "--jobs-db",
        str(tmp_path / "jobs.db"),
        "--max-queue",
        str(MAX_QUEUE),
        "--jobs-max-items",
        str(LINES * INPUTS),
        timeout=300,
    )
    codes: list[int] = []
    refusals: list[str] = []
    done = threading.Event()

    def interactive() -> None:  # open loop: one short input every 1/RATE s, until the batch is over
        with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {web}"}) as c:
            start, i = time.monotonic(), 0
            while not done.is_set():
                time.sleep(max(0.0, start + i / RATE - time.monotonic()))
                r = c.post("/v1/embeddings", json={"input": f"a short sentence, number {i}"})
                codes.append(r.status_code)
                if r.status_code != 200:
                    refusals.append(r.text[:200])
                i += 1

    thread = threading.Thread(target=interactive)
    try:
        thread.start()
        lines = [
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "minilm", "input": [f"w{k} {n}" for k in range(INPUTS)]},
            }
            for n in range(LINES)
        ]
        auth = {"Authorization": f"Bearer {batch_key}"}
        with httpx.Client(base_url=server.url, timeout=60, headers=auth) as c:
            # --jobs-max-items counts inputs: one line more (2 x 2,048 inputs, 2 lines) is refused, naming the line
            more = lines + [{**lines[0], "custom_id": "one-more"}]
            up = c.post(
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": ("more.jsonl", b"\n".join(map(orjson.dumps, more)), "application/jsonl")},
            )
            refused = c.post(
                "/v1/batches",
                json={"input_file_id": up.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            )
            assert refused.status_code == 400, refused.text
            assert f"line {LINES + 1} brings them to {(LINES + 1) * INPUTS}" in refused.json()["message"]
            up = c.post(
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": ("in.jsonl", b"\n".join(map(orjson.dumps, lines)), "application/jsonl")},
            )
            assert up.status_code == 200, up.text
            created = c.post(
                "/v1/batches",
                json={"input_file_id": up.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            )
            assert created.status_code == 202, created.text
            give_up = time.monotonic() + 240
            while (b := c.get(f"/v1/batches/{created.json()['id']}").json())["status"] == "in_progress":
                assert time.monotonic() < give_up, b
                time.sleep(0.5)
            done.set()
            thread.join(timeout=60)
            assert b["status"] == "completed" and b["request_counts"] == {
                "total": LINES,
                "completed": LINES,
                "failed": 0,
            }, b
            out = [orjson.loads(x) for x in c.get(f"/v1/files/{b['output_file_id']}/content").content.splitlines()]
        assert [o["custom_id"] for o in out] == [f"line-{n}" for n in range(LINES)]
        data = [o["response"]["body"]["data"] for o in out]
        assert [len(d) for d in data] == [INPUTS] * LINES
        assert all(len(d[-1]["embedding"]) == 384 and d[-1]["index"] == INPUTS - 1 for d in data)
        assert len(codes) >= 10, codes  # the interactive tenant ran beside the whole batch
        assert codes.count(503) == 0 and set(codes) == {200}, (codes.count(503), len(codes), refusals[:3])
    finally:
        done.set()
        thread.join(timeout=60)
        server.stop()
