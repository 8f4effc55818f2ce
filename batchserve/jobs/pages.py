"""A job's results sent as pages bounded in bytes: the native NDJSON results and an OpenAI job's output and
error files alike.

The store hands rows out by their stored sizes (`JobStore.results`, at most `PAGE_BYTES` a page), leaving an
output too large for a page in the store (`ItemRow.held`); such a row's line is sent as its head, its output
read `PAGE_BYTES` at a time (`JobStore.output_piece`), and its tail. So what one reader holds is a page or a
piece, whatever the sizes of the job's inputs and outputs (an embeddings line of 2,048 inputs answers ~16 MB).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from batchserve.jobs.store import PAGE_BYTES, PIECE_BYTES, ItemRow, JobStore

RESULTS_PAGE = 2000  # rows read from the store at most per page

# The stand-in for a held output while its line is rendered: a JSON string token, which cannot occur outside
# a string in any line (a quote inside a string is escaped), so the line splits exactly there.
MARK = b'"\x01batchserve-output-in-store\x01"'

Render = Callable[[ItemRow], bytes | None]  # a row's line (with its "\n"); None: the row has no line here


def render_rows(render: Render, rows: list[ItemRow]) -> bytes:
    return b"".join(line for row in rows if (line := render(row)) is not None)


def around_output(render: Render, row: ItemRow) -> tuple[bytes, bytes] | None:
    """(head, tail) of a held row's line around its output; None: the line does not show the output (a failed
    native item shows its error), so the row renders whole; b"" for both: no line."""
    line = render(replace(row, output=MARK.decode()))
    if line is None:
        return b"", b""
    head, found, tail = line.partition(MARK)
    return (head, tail) if found else None


async def pages(store: JobStore, job_id: str, render: Render, with_input: bool = False) -> AsyncIterator[bytes]:
    """The job's lines in input order: pages of at most about `PAGE_BYTES` (rendered on a worker thread), and
    pieces of `PIECE_BYTES` of a held output."""
    after = -1
    while rows := await store.results(job_id, after, RESULTS_PAGE, with_input, PAGE_BYTES):
        run: list[ItemRow] = []
        for row in rows:
            parts = around_output(render, row) if row.held else None
            if parts is None:
                run.append(row)
                continue
            if run:
                page = await asyncio.to_thread(render_rows, render, run)
                run = []
                if page:
                    yield page
                page = b""  # not held while the output's pieces go out
            head, tail = parts
            if not head:
                continue
            yield head
            start = 0
            while True:
                piece = await store.output_piece(job_id, row.index, start, PIECE_BYTES)
                if piece is None:
                    return  # the job was deleted meanwhile: its lines end here
                size = len(piece)
                if piece:
                    yield piece
                piece = b""  # not held while the next one is read
                if size < PIECE_BYTES:
                    break
                start += size
            yield tail
        if run and (page := await asyncio.to_thread(render_rows, render, run)):
            yield page
        after = rows[-1].index
