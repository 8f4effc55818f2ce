"""Job lines priced by the inputs they hold (issue 33, item 4): another tenant's interactive /v1/embeddings beside
an OpenAI embeddings batch of 2,048-input lines, on the real minilm model, in one command:

    python -m bench.job_pricing                                    # this checkout: ~3-4 minutes on 2 cores
    git worktree add /tmp/bs-base b6ba887                           # the commit before the change (once)
    python -m bench.job_pricing --base /tmp/bs-base --record        # before and after, side by side

Per checkout, a fresh server (minilm, two keyed tenants, a SQLite job store in a temporary directory) gets:
the interactive tenant's open-loop load (`--rate` requests/s of one short input each) alone for `--alone-s`,
then the batch tenant uploads a file of `--lines` lines of `--inputs` short inputs and creates the batch, and
the interactive load goes on beside it for `--beside-s`. Reported per phase: requests, 200s, 503s (and their
message), p50/p95 of the 200s; and the batch's progress at the window's end, its completion time (waited for
up to `--job-wait-s`, then cancelled) and its embeddings counted in the output file. Issue 33 measured, before:
the minilm queue reached 409,570 items and the interactive tenant got 225 x 503 of 251.

The machine is shared and noisy: quote one run's figures with its load average (in the table). Results
(markdown + JSON, machine, commit, settings) go to bench/results/job-pricing-<time>.{md,json} with --record
only. Servers are stopped by PID however the run ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/job_pricing.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from bench import common, report, servers


@dataclass
class Phase:
    name: str
    sent: int = 0
    ok: int = 0
    refused: int = 0  # 503
    other: int = 0
    p50_ms: float = float("nan")
    p95_ms: float = float("nan")
    messages: dict[str, int] = field(default_factory=dict)  # 503 messages, digits folded


@dataclass
class Run:
    label: str
    repo: str
    commit: str
    alone: Phase
    beside: Phase
    batch_inputs: int = 0
    batch_status: str = ""
    lines_done_in_window: int = 0
    batch_s: float = float("nan")  # creation to completed (nan: not within --job-wait-s, then cancelled)
    embeddings: int = 0  # counted in the output file
    load_avg: str = ""
    error: str = ""


def start_server(repo: Path, tmp: Path, log_dir: Path, name: str) -> servers.Server:
    """`batchserve serve` of the checkout at `repo` (its own package: cwd and PYTHONPATH), port from the log."""
    cmd = [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--config", str(tmp / "bs.toml")]
    cmd += ["--jobs-db", str(tmp / "jobs.db"), "--drain-grace-s", "0", "--log-level", "info"]
    return servers.start(name, cmd, log_dir, 300, {"PYTHONPATH": str(repo)}, cwd=repo)


def summarize(name: str, rows: list[tuple[int, float, str]]) -> Phase:
    lat = np.array([ms for status, ms, _ in rows if status == 200])
    msgs = Counter(re.sub(r"\d[\d,.]*", "N", m) for status, _, m in rows if status == 503)
    return Phase(
        name,
        len(rows),
        int(sum(s == 200 for s, _, _ in rows)),
        int(sum(s == 503 for s, _, _ in rows)),
        int(sum(s not in (200, 503) for s, _, _ in rows)),
        report.pct(lat, 50),
        report.pct(lat, 95),
        dict(msgs.most_common(3)),
    )


async def interactive(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    rate: float,
    seconds: float,
) -> list[tuple[int, float, str]]:
    """Open loop: one short input every 1/rate s, whatever the answers; (status, ms, 503 message) each."""
    rows: list[tuple[int, float, str]] = []

    async def one(i: int) -> None:
        t0 = time.monotonic()
        try:
            async with session.post(
                url + "/v1/embeddings",
                json={"input": f"a short sentence, number {i}"},
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                body = await r.read()
                message = ""
                if r.status == 503:
                    message = str(json.loads(body).get("error", {}).get("message", ""))[:120]
                rows.append((r.status, (time.monotonic() - t0) * 1000, message))
        except (TimeoutError, aiohttp.ClientError) as exc:
            rows.append((0, (time.monotonic() - t0) * 1000, type(exc).__name__))

    tasks, start, i = [], time.monotonic(), 0
    while time.monotonic() - start < seconds:
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    await asyncio.gather(*tasks)
    return rows


def input_file(lines: int, inputs: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "minilm", "input": [f"w{k}" for k in range(inputs)]},
            }
        ).encode()
        + b"\n"
        for n in range(lines)
    )


async def scenario(url: str, keys: dict[str, str], a: argparse.Namespace, run: Run) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for i in range(5):  # warm the path
            async with s.post(
                url + "/v1/embeddings", json={"input": f"warm {i}"}, headers={"Authorization": f"Bearer {keys['web']}"}
            ) as r:
                await r.read()
        run.alone = summarize("alone", await interactive(s, url, keys["web"], a.rate, a.alone_s))
        batch_auth = {"Authorization": f"Bearer {keys['batch']}"}
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", input_file(a.lines, a.inputs), filename="in.jsonl", content_type="application/jsonl")
        async with s.post(url + "/v1/files", data=form, headers=batch_auth) as r:
            file_id = (await r.json())["id"]
        created = time.monotonic()
        async with s.post(
            url + "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
            headers=batch_auth,
        ) as r:
            batch = await r.json()
            if r.status != 202:
                raise RuntimeError(f"batch refused: {r.status} {batch}")
        run.batch_inputs = a.lines * a.inputs
        run.beside = summarize("beside the batch", await interactive(s, url, keys["web"], a.rate, a.beside_s))
        give_up = created + a.job_wait_s
        while True:
            async with s.get(url + f"/v1/batches/{batch['id']}", headers=batch_auth) as r:
                batch = await r.json()
            if not run.lines_done_in_window:
                run.lines_done_in_window = batch["request_counts"]["completed"] or -1
            if batch["status"] in ("completed", "failed", "cancelled") or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.5)
        run.lines_done_in_window = max(0, run.lines_done_in_window)
        run.batch_status = batch["status"]
        if batch["status"] == "completed":
            run.batch_s = time.monotonic() - created
            async with s.get(url + f"/v1/files/{batch['output_file_id']}/content", headers=batch_auth) as r:
                body = await r.read()
            run.embeddings = sum(len(json.loads(line)["response"]["body"]["data"]) for line in body.splitlines())
        else:
            async with s.post(url + f"/v1/batches/{batch['id']}/cancel", headers=batch_auth) as r:
                await r.read()


def git_commit(repo: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def one_checkout(label: str, repo: Path, a: argparse.Namespace, logs: Path, commit: str = "") -> Run:
    run = Run(label, str(repo), commit or git_commit(repo), Phase("alone"), Phase("beside the batch"))
    with tempfile.TemporaryDirectory(prefix="job-pricing-") as d:
        tmp = Path(d)
        (tmp / "bs.toml").write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n')
        keys = {t: servers.add_key(tmp / "bs.toml", t, "paid", root=repo) for t in ("web", "batch")}
        server = start_server(repo, tmp, logs, f"job-pricing-{label}")
        try:
            asyncio.run(scenario(server.base, keys, a, run))
        except Exception as exc:  # noqa: BLE001 - reported in the row, the other checkout still runs
            run.error = f"{type(exc).__name__}: {exc}"
        finally:
            run.load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
            servers.stop(server)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--base",
        type=Path,
        default=None,
        help="a checkout of the commit before (e.g. `git worktree add /tmp/bs-base b6ba887`): run it first",
    )
    p.add_argument(
        "--base-commit",
        default="",
        help="the base checkout's commit, for the table (default: its HEAD; "
        "give it when the checkout is an export, not a worktree)",
    )
    p.add_argument("--lines", type=int, default=6, help="lines in the batch's input file (default %(default)s)")
    p.add_argument("--inputs", type=int, default=2048, help="inputs per line (default %(default)s)")
    p.add_argument("--rate", type=float, default=5.0, help="interactive requests/s (default %(default)s)")
    p.add_argument("--alone-s", type=float, default=8.0, help="interactive load alone (default %(default)s)")
    p.add_argument(
        "--beside-s", type=float, default=20.0, help="interactive load beside the batch (default %(default)s)"
    )
    p.add_argument(
        "--job-wait-s",
        type=float,
        default=240.0,
        help="wait this long for the batch from its creation, then cancel it (default %(default)s)",
    )
    common.add_output_flags(p, name="job-pricing", tag=True)
    a = p.parse_args()
    name = common.run_name(a, "job-pricing")
    logs = common.log_dir(a, name)
    runs: list[Run] = []
    with common.guarded():
        if a.base is not None:
            runs.append(one_checkout("before", a.base.resolve(), a, logs, a.base_commit))
        runs.append(one_checkout("after", servers.REPO, a, logs))
    rows = []
    for r in runs:
        for ph in (r.alone, r.beside):
            rows.append(
                [
                    f"{r.label} ({r.commit})",
                    ph.name,
                    ph.sent,
                    ph.ok,
                    ph.refused,
                    ph.other,
                    ph.p50_ms,
                    ph.p95_ms,
                    "; ".join(f"{n} x {m}" for m, n in ph.messages.items()) or "–",
                ]
            )
    batch_rows = [
        [
            f"{r.label} ({r.commit})",
            r.batch_inputs,
            r.lines_done_in_window,
            r.batch_status,
            r.batch_s,
            r.embeddings,
            r.load_avg,
            r.error or "–",
        ]
        for r in runs
    ]
    md = (
        f"# Job pricing: interactive /v1/embeddings beside an embeddings batch of {a.lines} x {a.inputs}-input "
        f"lines (minilm)\n\ninteractive {a.rate:g} req/s of one short input, {a.alone_s:g} s alone then "
        f"{a.beside_s:g} s beside the batch; shared 2-core machine, noisy\n\n"
        + report.table(["checkout", "phase", "sent", "200", "503", "other", "p50 ms", "p95 ms", "503 says"], rows)
        + "\n\n"
        + report.table(
            [
                "checkout",
                "batch inputs",
                "lines done in the window",
                "batch status",
                "batch s",
                "embeddings",
                "load avg (1/5/15 min)",
                "error",
            ],
            batch_rows,
        )
    )
    print(md)
    rep = {
        "bench": "job_pricing",
        "settings": vars(a) | {"base": str(a.base)},
        "provenance": report.provenance(),
        "runs": [asdict(r) for r in runs],
    }
    print(report.written(report.write(name, rep, md, common.out_dir(a)), logs if common.out_dir(a) else None))


if __name__ == "__main__":
    main()
