"""Soak: hostile clients and failing jobs beside steady interactive load (issues 12 and 28, docs/hardening.md).

One sim server (2 devices by default) on 127.0.0.1, with API keys for three tenants (`live` sends the
interactive load, `acme` the failing job, `globex` a clean job); for `--duration` seconds, all at once:
- interactive: open-loop Poisson at `--load` × capacity (capacity = devices × max batch / batch time), each
  answer checked (output = input reversed);
- idle flood: `--idle` connections that never send a byte, re-opened as the server closes them (the hostile
  clients run in a process of their own, apart from the interactive client);
- slowloris: `--slowloris` connections sending a header byte every 0.5 s;
- oversized heads: a 1 MiB header line, `--oversized-rate` per second (each must get 431);
- a failing job: `--job-items` inputs of which `--job-fail-share` fail (`--sim-fail-marker`; 1 = all), beside
  another tenant's clean job of `--clean-job-items`; both must complete (waited for up to `--job-wait-s`
  after the window);
- 1 MB prompts (issue 28): `--prompt-clients` loops posting ~1 MB chat prompts to /v1/chat/completions (the
  server then runs SmolLM2's generation engine beside the sim, `--generation on`); each must get a 4xx;
- long embeddings (issue 28): with `--embed-clients N`, a second server (`--backend minilm`) gets N clients
  each sending 60 inputs of 16,384 characters every 5 s, and a neighbour sending one short sentence every
  0.1 s, whose answers must all be 200 (the neighbour's p95 is reported).
Goals: interactive p95 within the SLO, 0 connection resets or failures on interactive requests, 0 false hang
detections (`batchserve_worker_healthy` never 0, no `batch_retries{cause="hang"}`), server RSS bounded
(`--rss-growth-mb` over its start), every job completed, the embedding neighbour all 200. Prints a table;
writes bench/results/soak-<time>.{md,json} only with `--record` (to DIR with `--out DIR`). Bounded: every loop
ends with the window, every request has a client timeout.

    python -m bench.soak                       # ~2 minutes (loads SmolLM2 and MiniLM on the CPU)
    python -m bench.soak --duration 10 --idle 500 --slowloris 50 --prompt-clients 0 --embed-clients 0  # a quick smoke
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

from batchserve.tenancy import digest, new_key
from bench import common, report, servers
from bench.procstat import raise_fd_limit

TENANTS = ("live", "acme", "globex")  # interactive, the failing job, the clean job
PROMPT_BYTES = 1_000_000
EMBED_INPUTS, EMBED_CHARS, EMBED_EVERY_S = 60, 16_384, 5.0
NEIGHBOUR_EVERY_S = 0.1

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
    prompt_answers: dict[str, int] = field(default_factory=dict)
    embed_long_answers: dict[str, int] = field(default_factory=dict)
    neighbour_answers: dict[str, int] = field(default_factory=dict)
    neighbour_ms: list[float] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)  # tenant -> the job as last read, plus seconds to finish

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


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def interactive(base: str, rate: float, until: float, t: Tally, key: str) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=bearer(key),
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


async def big_prompts(base: str, n: int, until: float, t: Tally, key: str) -> None:
    """Clients looping ~1 MB chat prompts (issue 28: tokenizing them on the event loop held every route)."""
    body = orjson.dumps({"messages": [{"role": "user", "content": "word " * (PROMPT_BYTES // 5)}],
                         "max_tokens": 1})

    async def one(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            try:
                async with session.post(base + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    t.count(t.prompt_answers, r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                t.count(t.prompt_answers, type(exc).__name__)
                await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(headers=bearer(key), timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(one(session) for _ in range(n)))


async def long_embeddings(base: str, n: int, until: float, t: Tally) -> None:
    """Issue 28: 60 inputs of 16,384 characters every 5 s (within every limit), and a neighbour's one short
    sentence every 0.1 s, which must keep getting 200."""
    body = {"model": "minilm", "input": [("long " * (EMBED_CHARS // 5))[:EMBED_CHARS]] * EMBED_INPUTS}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def sender() -> None:
            while time.monotonic() < until:
                sent = time.monotonic()
                try:
                    async with session.post(base + "/v1/embeddings", json=body) as r:
                        await r.read()
                        t.count(t.embed_long_answers, r.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    t.count(t.embed_long_answers, type(exc).__name__)
                await asyncio.sleep(max(0.0, sent + EMBED_EVERY_S - time.monotonic()))

        async def neighbour() -> None:
            tasks = []

            async def one(i: int) -> None:
                start = time.monotonic()
                try:
                    async with session.post(base + "/v1/embeddings",
                                            json={"model": "minilm", "input": f"a short sentence {i}"}) as r:
                        await r.read()
                        t.count(t.neighbour_answers, r.status)
                        if r.status == 200:
                            t.neighbour_ms.append((time.monotonic() - start) * 1000)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    t.count(t.neighbour_answers, type(exc).__name__)

            i = 0
            while time.monotonic() < until:
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(NEIGHBOUR_EVERY_S)
            await asyncio.gather(*tasks)

        await asyncio.gather(neighbour(), *(sender() for _ in range(n)))


async def finish_jobs(base: str, jobs: dict[str, tuple[str, str]], wait_s: float, t: Tally) -> None:
    """Wait (bounded) for every job to finish; note each one's counts and seconds from creation to finish."""
    give_up = time.monotonic() + wait_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for tenant, (job_id, key) in jobs.items():
            job: dict = {}
            while True:
                try:
                    async with session.get(f"{base}/v1/batches/{job_id}", headers=bearer(key)) as r:
                        job = orjson.loads(await r.read())
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                if job.get("status") in ("completed", "failed", "cancelled") or time.monotonic() > give_up:
                    break
                await asyncio.sleep(0.5)
            finished_at, created_at = job.get("finished_at"), job.get("created_at")
            job["seconds"] = round(finished_at - created_at, 1) if finished_at and created_at else None
            t.jobs[tenant] = job


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


def failing_inputs(n: int, share: float) -> list[str]:
    """`share` of the inputs fail (spread evenly), each input distinct (a repeat would be quarantined)."""
    every = max(1, round(1 / share)) if share > 0 else 0
    return [f"FAIL-{i}" if every and i % every == 0 else f"ok-{i}" for i in range(n)]


async def run(a: argparse.Namespace, server: servers.Server, keys: dict[str, str],
              embed: servers.Server | None) -> tuple[Tally, str]:
    t = Tally()
    host, port = "127.0.0.1", server.port
    capacity = a.devices * a.max_batch_size / (a.sim_batch_ms / 1000)
    jobs: dict[str, tuple[str, str]] = {}
    async with aiohttp.ClientSession() as session:
        for tenant, inputs in (("acme", failing_inputs(a.job_items, a.job_fail_share)),
                               ("globex", [f"clean-{i}" for i in range(a.clean_job_items)])):
            if not inputs:
                continue
            async with session.post(server.base + "/v1/batches", json={"inputs": inputs},
                                    headers=bearer(keys[tenant])) as r:
                assert r.status == 202, await r.text()
                jobs[tenant] = ((await r.json())["id"], keys[tenant])
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
                interactive(server.base, a.load * capacity, until, t, keys["live"]),
                watch(server.base, server.pid, until, t),
                big_prompts(server.base, a.prompt_clients, until, t, keys["acme"]),
                *([long_embeddings(embed.base, a.embed_clients, until, t)] if embed is not None else []),
            )
            hostile: dict = await asyncio.to_thread(results.get, True, 60)
        finally:
            attackers.join(timeout=5)
            if attackers.is_alive():
                attackers.kill()
        t.idle_opened, t.idle_closed_by_server = hostile["idle_opened"], hostile["idle_closed_by_server"]
        t.slowloris_answers, t.oversized_answers = hostile["slowloris_answers"], hostile["oversized_answers"]
        await finish_jobs(server.base, jobs, a.job_wait_s, t)
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
        "every job completed": all(j.get("status") == "completed" for j in t.jobs.values()),
        "1 MB prompts refused with a 4xx": all(k.startswith("4") for k in t.prompt_answers),
        "embedding neighbour all 200": set(t.neighbour_answers) <= {"200"},
    }
    server_p95 = float(np.percentile(t.server_ms, 95)) if t.server_ms else float("nan")
    neighbour_p95 = float(np.percentile(t.neighbour_ms, 95)) if t.neighbour_ms else float("nan")
    return {"config": vars(a), "p95_ms": p95, "p50_ms": float(np.percentile(lat, 50)), "ok_share": ok_share,
            "neighbour_p95_ms": neighbour_p95,
            "server_p95_ms": server_p95,
            "hang_retries": hang_retries, "job_items_failed": job_failed, "rss_start_mb": t.rss_mb[0],
            "rss_max_mb": max(t.rss_mb), "healthz_max_ms": max(t.healthz_ms or [float("nan")]),
            "tally": {k: v for k, v in asdict(t).items()
                      if k not in ("latencies_ms", "server_ms", "rss_mb", "healthz_ms", "neighbour_ms")},
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
        *((f"job of {tenant}", f"{j.get('status')}: {j.get('completed')} completed, {j.get('failed')} failed, "
                               f"{j.get('pending')} pending; {j.get('seconds')} s") for tenant, j in t["jobs"].items()),
        ("1 MB prompt answers", str(t["prompt_answers"])),
        ("long-embedding answers / neighbour answers", f"{t['embed_long_answers']} / {t['neighbour_answers']}"),
        ("embedding neighbour p95", f"{s['neighbour_p95_ms']:.0f} ms"),
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
    p.add_argument("--job-items", type=int, default=5000, help="the failing job's inputs")
    p.add_argument("--job-fail-share", type=float, default=0.1, help="share of them that fail (1 = every one)")
    p.add_argument("--clean-job-items", type=int, default=1000, help="another tenant's clean job (0: none)")
    p.add_argument("--job-wait-s", type=float, default=120.0, help="longest wait for the jobs after the window")
    p.add_argument("--prompt-clients", type=int, default=2,
                   help="clients looping 1 MB chat prompts (the server then loads SmolLM2's generation engine)")
    p.add_argument("--embed-clients", type=int, default=1,
                   help="long-embedding clients on a second, minilm server (0: no such server)")
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
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))  # the job store and the keys: never kept
    keys = {tenant: new_key() for tenant in TENANTS}
    (workdir / "keys.toml").write_text("".join(
        f'[[keys]]\ntenant = "{t}"\ntier = "paid"\nsha256 = "{digest(k)}"\nrate = 100000\n' for t, k in keys.items()))
    cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, a.max_batch_size, [
        "--slo-ms", f"{a.slo_ms:g}", "--sim-fail-marker", "FAIL", "--jobs-db", str(workdir / "jobs.db"),
        "--header-timeout-s", "5", "--body-timeout-s", "5", "--keep-alive-timeout-s", "5",
        "--max-connections", str(a.max_connections), "--config", str(workdir / "keys.toml"),
        "--generation", "on" if a.prompt_clients else "off"])
    with common.guarded():
        server = servers.start("soak", cmd, logs, timeout_s=180)
        embed = None
        if a.embed_clients:
            embed = servers.start("soak-minilm", [sys.executable, "-m", "batchserve", "serve", "--port", "0",
                                                  "--backend", "minilm", "--drain-grace-s", "0", "--jobs-db", ""],
                                  logs, timeout_s=180)
        tally, metrics = uvloop.run(run(a, server, keys, embed))
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
