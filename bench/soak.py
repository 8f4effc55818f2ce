"""Soak: hostile clients and a failing job beside steady interactive load (issue 12, docs/hardening.md).

One sim server (2 devices by default) on 127.0.0.1; for `--duration` seconds, all at once:
- interactive: open-loop Poisson at `--load` × capacity (capacity = devices × max batch / batch time), each
  answer checked (output = input reversed);
- idle flood: `--idle` connections that never send a byte, re-opened as the server closes them (the hostile
  clients run in a process of their own, apart from the interactive client);
- slowloris: `--slowloris` connections sending a header byte every 0.5 s;
- oversized heads: a 1 MiB header line, `--oversized-rate` per second (each must get 431);
- a failing job: `--job-items` inputs that all fail (`--sim-fail-marker`).
Goals: interactive p95 within the SLO, 0 connection resets or failures on interactive requests, 0 false hang
detections (`batchserve_worker_healthy` never 0, no `batch_retries{cause="hang"}`), server RSS bounded
(`--rss-growth-mb` over its start). Prints a table; writes bench/results/soak-<time>.{md,json} only with
`--record` (to DIR with `--out DIR`). Bounded: every loop ends with the window, every request has a client timeout.

    python -m bench.soak                       # ~1 minute
    python -m bench.soak --duration 10 --idle 500 --slowloris 50   # a quick smoke
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import uvloop

from bench import common, report, servers
from bench.procstat import raise_fd_limit

@dataclass
class Tally:
    statuses: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)  # the server's own latency_ms of each 200
    resets: int = 0
    failures: int = 0
    wrong: int = 0
    idle_opened: int = 0
    idle_closed_by_server: int = 0
    slowloris_answers: dict[str, int] = field(default_factory=dict)
    oversized_answers: dict[str, int] = field(default_factory=dict)
    rss_mb: list[float] = field(default_factory=list)
    unhealthy_seen: int = 0
    healthz_ms: list[float] = field(default_factory=list)

    def count(self, table: dict[str, int], key: object) -> None:
        table[str(key)] = table.get(str(key), 0) + 1


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def first_status(reader: asyncio.StreamReader) -> str:
    line = await reader.readline()
    return line.split()[1].decode() if len(line.split()) > 1 else "closed"


async def interactive(base: str, rate: float, until: float, t: Tally) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=10)) as session:
        async def one(i: int) -> None:
            text = f"live-{i}-{random.random():.6f}"
            start = time.monotonic()
            try:
                async with session.post(base + "/v1/inference", json={"input": text}) as r:
                    body = await r.read()
                    t.count(t.statuses, r.status)
                    if r.status == 200:
                        t.latencies_ms.append((time.monotonic() - start) * 1000)
                        answer = orjson.loads(body)
                        t.server_ms.append(answer["latency_ms"])
                        t.wrong += answer["output"] != text[::-1]
            except (aiohttp.ClientOSError, ConnectionResetError, aiohttp.ServerDisconnectedError):
                t.resets += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                t.failures += 1

        tasks = []
        next_at = time.monotonic()
        i = 0
        while next_at < until:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            next_at += random.expovariate(rate)
        await asyncio.gather(*tasks)


async def idle_flood(host: str, port: int, n: int, until: float, t: Tally) -> None:
    async def holder() -> None:
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            t.idle_opened += 1
            try:
                data = await asyncio.wait_for(reader.read(1), max(0.01, until - time.monotonic()))
                if not data:
                    t.idle_closed_by_server += 1
            except (asyncio.TimeoutError, OSError):
                pass
            writer.close()

    await asyncio.gather(*(holder() for _ in range(n)))


async def slowloris(host: str, port: int, n: int, until: float, t: Tally) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000

    async def one() -> None:
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                answer = asyncio.ensure_future(first_status(reader))
                for byte in head:
                    if answer.done() or time.monotonic() >= until:
                        break
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.5)
                if time.monotonic() < until:
                    t.count(t.slowloris_answers, await asyncio.wait_for(answer, max(0.01, until - time.monotonic())))
                answer.cancel()
                writer.close()
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(0.2)

    await asyncio.gather(*(one() for _ in range(n)))


async def oversized(host: str, port: int, rate: float, until: float, t: Tally) -> None:
    line = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (1 << 20) + b"\r\n\r\n"
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(line)
            t.count(t.oversized_answers, await asyncio.wait_for(first_status(reader), 10))
            writer.close()
        except (OSError, asyncio.TimeoutError) as exc:
            t.count(t.oversized_answers, type(exc).__name__)
        await asyncio.sleep(1 / rate)


def attack(host: str, port: int, idle: int, slow: int, oversized_rate: float, duration: float,
           results: "multiprocessing.Queue[dict]") -> None:
    """The hostile clients, in their own process; their tallies go back through `results`."""
    async def main() -> None:
        t = Tally()
        until = time.monotonic() + duration
        await asyncio.gather(idle_flood(host, port, idle, until, t), slowloris(host, port, slow, until, t),
                             oversized(host, port, oversized_rate, until, t))
        results.put({"idle_opened": t.idle_opened, "idle_closed_by_server": t.idle_closed_by_server,
                     "slowloris_answers": t.slowloris_answers, "oversized_answers": t.oversized_answers})

    raise_fd_limit()
    uvloop.run(main())


async def watch(base: str, pid: int, until: float, t: Tally) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < until:
            t.rss_mb.append(rss_mb(pid))
            start = time.monotonic()
            try:
                async with session.get(base + "/healthz") as r:
                    await r.read()
                t.healthz_ms.append((time.monotonic() - start) * 1000)
                async with session.get(base + "/metrics") as r:
                    text = await r.text()
                t.unhealthy_seen += sum(1 for line in text.splitlines()
                                        if line.startswith("batchserve_worker_healthy{") and line.endswith(" 0.0"))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                t.healthz_ms.append(float("inf"))
            await asyncio.sleep(0.5)


async def run(a: argparse.Namespace, server: servers.Server) -> tuple[Tally, str]:
    t = Tally()
    host, port = "127.0.0.1", server.port
    capacity = a.devices * a.max_batch_size / (a.sim_batch_ms / 1000)
    async with aiohttp.ClientSession() as session:
        inputs = [f"FAIL-{i}" for i in range(a.job_items)]
        async with session.post(server.base + "/v1/batches", json={"inputs": inputs}) as r:
            assert r.status == 202, await r.text()
        start = time.monotonic()
        t.rss_mb.append(rss_mb(server.pid))
        until = start + a.duration
        # The hostile clients run in a process of their own, as attackers do: in the interactive client's
        # event loop their thousands of connections would delay its sends and be measured as server latency.
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        attackers = ctx.Process(target=attack, args=(host, port, a.idle, a.slowloris, a.oversized_rate,
                                                     a.duration, results), daemon=True)
        attackers.start()
        try:
            await asyncio.gather(
                interactive(server.base, a.load * capacity, until, t),
                watch(server.base, server.pid, until, t),
            )
            hostile: dict = await asyncio.to_thread(results.get, True, 60)
        finally:
            attackers.join(timeout=5)
            if attackers.is_alive():
                attackers.kill()
        t.idle_opened, t.idle_closed_by_server = hostile["idle_opened"], hostile["idle_closed_by_server"]
        t.slowloris_answers, t.oversized_answers = hostile["slowloris_answers"], hostile["oversized_answers"]
        async with session.get(server.base + "/metrics") as r:
            metrics = await r.text()
    return t, metrics


def summarize(a: argparse.Namespace, t: Tally, metrics: str) -> dict:
    lat = np.array(t.latencies_ms) if t.latencies_ms else np.array([float("nan")])
    hang_retries = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("batchserve_batch_retries_total{") and 'cause="hang"' in line)
    job_failed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("batchserve_job_items_processed_total{") and 'outcome="failed"' in line)
    p95 = float(np.percentile(lat, 95))
    rss_growth = max(t.rss_mb) - t.rss_mb[0]
    ok_share = t.statuses.get("200", 0) / max(1, sum(t.statuses.values()) + t.resets + t.failures)
    goals = {
        "interactive p95 within the SLO": p95 <= a.slo_ms,
        "0 resets or failed interactive requests": t.resets == 0 and t.failures == 0,
        "0 false hang detections": hang_retries == 0 and t.unhealthy_seen == 0,
        f"RSS growth under {a.rss_growth_mb} MB": rss_growth < a.rss_growth_mb,
        "every answer its own": t.wrong == 0,
        "oversized heads answered 431": set(t.oversized_answers) <= {"431"},
    }
    server_p95 = float(np.percentile(t.server_ms, 95)) if t.server_ms else float("nan")
    return {"config": vars(a), "p95_ms": p95, "p50_ms": float(np.percentile(lat, 50)), "ok_share": ok_share,
            "server_p95_ms": server_p95,
            "hang_retries": hang_retries, "job_items_failed": job_failed, "rss_start_mb": t.rss_mb[0],
            "rss_max_mb": max(t.rss_mb), "healthz_max_ms": max(t.healthz_ms or [float("nan")]),
            "tally": {k: v for k, v in asdict(t).items()
                      if k not in ("latencies_ms", "server_ms", "rss_mb", "healthz_ms")},
            "goals": goals, "passed": all(goals.values())}


def table(s: dict) -> str:
    t = s["tally"]
    rows = [
        ("interactive answers", f"{t['statuses']}  (200 share {s['ok_share']:.2%})"),
        ("interactive p50 / p95", f"{s['p50_ms']:.1f} / {s['p95_ms']:.1f} ms (SLO {s['config']['slo_ms']:g}); "
                                  f"the server's own p95 {s['server_p95_ms']:.1f} ms"),
        ("resets / other failures / wrong outputs", f"{t['resets']} / {t['failures']} / {t['wrong']}"),
        ("idle connections opened / closed by the server", f"{t['idle_opened']} / {t['idle_closed_by_server']}"),
        ("slowloris answers", str(t["slowloris_answers"])),
        ("oversized-head answers", str(t["oversized_answers"])),
        ("failing job items recorded failed", f"{s['job_items_failed']:.0f}"),
        ("hang retries / unhealthy samples", f"{s['hang_retries']:.0f} / {t['unhealthy_seen']}"),
        ("server RSS start / max", f"{s['rss_start_mb']:.0f} / {s['rss_max_mb']:.0f} MB"),
        ("slowest /healthz", f"{s['healthz_max_ms']:.0f} ms"),
    ]
    out = ["| measure | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "", "| goal | met |",
           "| --- | --- |", *(f"| {k} | {'yes' if v else 'NO'} |" for k, v in s["goals"].items())]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_load_flags(p, duration=45.0, warmup=None, seed=None, timeout=None)
    common.add_sim_flags(p, devices=2, max_batch_size=20, server_arg=False)
    p.add_argument("--load", type=float, default=0.5, help="interactive rate as a share of capacity")
    p.add_argument("--idle", type=int, default=3000)
    p.add_argument("--slowloris", type=int, default=200)
    p.add_argument("--oversized-rate", type=float, default=2.0)
    p.add_argument("--job-items", type=int, default=5000)
    p.add_argument("--max-connections", type=int, default=0,
                   help="the server's cap (0: its default, above the idle flood; a flood past the cap that reconnects at once "
                        "is a reconnect storm, met at the network layer: docs/hardening.md)")
    p.add_argument("--rss-growth-mb", type=float, default=200.0)
    common.add_output_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    raise_fd_limit()
    stamp = common.stamp()
    name = f"soak-{stamp}"
    logs = common.log_dir(a, name)
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))  # the job store: never kept
    cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, a.max_batch_size, [
        "--slo-ms", f"{a.slo_ms:g}", "--sim-fail-marker", "FAIL", "--jobs-db", str(workdir / "jobs.db"),
        "--header-timeout-s", "5", "--body-timeout-s", "5", "--keep-alive-timeout-s", "5",
        "--max-connections", str(a.max_connections)])
    with common.guarded():
        server = servers.start("soak", cmd, logs)
        tally, metrics = uvloop.run(run(a, server))
    summary = summarize(a, tally, metrics)
    text = table(summary)
    print(text)
    directory = common.out_dir(a)
    if directory is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
        summary.update(commit=commit, dirty=dirty, command=" ".join(sys.argv))
        text = (f"# Soak {stamp} (commit {commit}{', dirty' if dirty else ''})\n\n"
                f"`{' '.join(sys.argv)}`\n\n{text}")
    print("\n" + report.written(report.write(name, summary, text, directory), logs))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
