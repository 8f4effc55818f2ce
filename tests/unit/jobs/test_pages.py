"""Results read back in pages bounded in bytes (`jobs/pages.py`) on a real SQLite store: whatever the sizes of
the job's outputs (small inputs, outputs of up to 12 MB each), a reader never holds more than about a page
and a piece of a large output."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest

from batchserve.jobs.openai_batch import file_line
from batchserve.jobs.pages import Render, pages
from batchserve.jobs.sqlite_store import SQLiteStore
from batchserve.jobs.store import ERRORS, OUTPUT, PAGE_BYTES, PIECE_BYTES, ItemRow, NewJob, Outcome

MB = 1 << 20
SIZES = [200, 3 * MB, 50_000, 12 * MB + 7, 300_000, 300_000, 300_000, 300_000, 10, 6 * MB]
FAILED = {2, 3, 5}


def output(size: int, seed: int) -> str:
    """A JSON list of floats of about `size` bytes, as an embeddings response is."""
    return orjson.dumps([((seed * 7919 + j) % 1000003) / 1000003.123 for j in range(size // 20)]).decode()


def renderer(job_id: str, kind: str | None) -> Render:
    """The native results' line (kind None), or the line of an OpenAI job's output or error file."""
    if kind is None:
        return lambda row: orjson.dumps(row.public()) + b"\n"
    return lambda row: file_line(job_id, row, kind)


async def send_all(path: Path, kind: str | None) -> tuple[bytes, bytes, int]:
    """(digest of what `pages` sent, of the lines rendered from whole rows, the most Python held meanwhile)."""
    lines = [
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}).decode()
        for i in range(len(SIZES))
    ]
    store = await SQLiteStore.open(str(path))
    try:
        job, _ = await store.create(NewJob("batch_big", "t", "m", lines, None, None, "h", time.time()))
        outs = [output(size, i) for i, size in enumerate(SIZES)]
        await store.record(
            [
                Outcome(job.id, i, "failed", out, "BAD", "no") if i in FAILED else Outcome(job.id, i, "completed", out)
                for i, out in enumerate(outs)
            ],
            time.time(),
        )
        render = renderer(job.id, kind)
        rows = [
            ItemRow(i, "failed", out, "BAD", "no", lines[i])
            if i in FAILED
            else ItemRow(i, "completed", out, None, None, lines[i])
            for i, out in enumerate(outs)
        ]
        expected = hashlib.sha256(b"".join(line for r in rows if (line := render(r)) is not None)).digest()
        del outs, rows
        sent = hashlib.sha256()
        tracemalloc.start()
        try:
            async for chunk in pages(store, job.id, render, with_input=kind is not None):
                assert len(chunk) <= max(PAGE_BYTES, PIECE_BYTES) + 1024, len(
                    chunk
                )  # a page, a piece, or a line's ends
                sent.update(chunk)
                del chunk  # as the server's stream does once it is sent
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return sent.digest(), expected, peak
    finally:
        await store.close()


@pytest.mark.parametrize("kind", [None, OUTPUT, ERRORS], ids=["native", "output-file", "error-file"])
def test_results_are_sent_whole_a_page_bounded_in_bytes_at_a_time(tmp_path: Path, kind: str | None) -> None:
    sent, expected, peak = asyncio.run(send_all(tmp_path / "jobs.db", kind))
    assert sent == expected
    assert peak < PIECE_BYTES + 2 * PAGE_BYTES, f"a reader held {peak / MB:.1f} MB"  # a piece, a page and its render


def test_a_store_file_whose_items_have_no_rowid_reads_a_held_output_in_pieces_too(tmp_path: Path) -> None:
    """Files made before items became a rowid table keep their WITHOUT ROWID table: no incremental I/O there."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE items (job_id TEXT NOT NULL, idx INTEGER NOT NULL, input TEXT NOT NULL, status TEXT NOT NULL "
        "DEFAULT 'pending', output TEXT, error TEXT, message TEXT, writes INTEGER NOT NULL DEFAULT 0, "
        "finished_at REAL, PRIMARY KEY (job_id, idx)) WITHOUT ROWID"
    )
    conn.close()
    out = output(9 * MB, 1)  # three pieces

    async def main() -> tuple[bool, bytes, bytes | None]:
        store = await SQLiteStore.open(str(path))
        try:
            job, _ = await store.create(NewJob("batch_old", "t", "m", ["a"], None, None, "h", time.time()))
            await store.record([Outcome(job.id, 0, "completed", out)], time.time())
            held = (await store.results(job.id, -1, 10))[0].held
            got = b"".join([chunk async for chunk in pages(store, job.id, renderer(job.id, None))])
            return held, got, await store.output_piece(job.id, 1, 0, 10)
        finally:
            await store.close()

    held, got, missing = asyncio.run(main())
    assert held and got == orjson.dumps({"index": 0, "status": "completed", "output": orjson.Fragment(out)}) + b"\n"
    assert missing is None
