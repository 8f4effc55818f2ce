"""The hung-child drill (issue 34, item 3), in one command:

    python -m bench.hung_child                    # 30 RPS for 30 s, one of two children SIGSTOPped at 10 s for 10 s
    python -m bench.hung_child --hang-s 0         # the same with hang detection off (the behaviour before)
    python -m bench.hung_child --record           # write bench/results/hung-child-<time>.{md,json} and the log

It starts `batchserve serve --processes 2 --devices 2 --sim-batch-ms 20` (`--process-hang-s` from `--hang-s`),
sends open-loop Poisson load (latency from the scheduled send time; a new request whatever the earlier ones
are doing) over keep-alive connections (`--fresh-connections`: a new one per request, as from many clients), and at
`--stop-at` sends SIGSTOP to one child, SIGCONT `--stop-s`
later (nothing, once it was killed). Each request whose connection breaks with no answer (the stopped child
killed under it) is sent once more on a new connection, as a balancer retries an idempotent request; the
report counts those apart. A prober asks the shared port's /readyz on a new connection every 0.5 s, with no
retry (aiohttp's own resend of a GET on a broken connection is turned off): one dealt to the stopped child
waits for the kill, then its connection is reset.

Reported: p95 of the requests scheduled before the stop, during it (from the stop until the child was killed,
or until the SIGCONT when it was not), and after; when the stopped child was killed (its pid gone); when the
last request sent before that was answered (answers resumed); every outcome by status and error code, and
connection errors (retried once; a second failure counts as a failure); /readyz by outcome.
The server is stopped by PID whatever happens; a stopped child is sent SIGCONT before that.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/hung_child.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson
import uvloop

from bench import common, report, servers
from bench.report import fmt, pct, table
from bench.schedule import poisson_schedule

JSON_HEADERS = {"Content-Type": "application/json"}
BROKEN = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)


@dataclass
class Drill:
    sched: np.ndarray
    done: np.ndarray = field(init=False)  # offset of the final answer, nan when none
    outcome: list[str] = field(init=False)  # "200", "503 DRAINING", "wrong", "failed: ..."
    retried: np.ndarray = field(init=False)  # its first connection broke with no answer
    readyz: list[tuple[float, str, float]] = field(default_factory=list)  # (sent at, outcome, took s)

    def __post_init__(self) -> None:
        n = len(self.sched)
        self.done, self.retried = np.full(n, np.nan), np.zeros(n, bool)
        self.outcome = [""] * n


def children(base: str, want: int = 2, timeout_s: float = 60) -> dict[int, dict]:
    """pid -> /internal/health of each child, found through the shared port (new connections)."""
    seen: dict[int, dict] = {}
    give_up = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < give_up:
        try:
            with urllib.request.urlopen(base + "/internal/health", timeout=5) as resp:
                d = json.loads(resp.read())
            if d.get("status") == "ok":
                seen[d["pid"]] = d
        except OSError:
            time.sleep(0.05)
    if len(seen) < want:
        raise servers.ServerFailed(f"found {len(seen)} children of {want} behind {base}")
    return seen


def watch_gone(pid: int, t0: float, out: list[float], stop: threading.Event) -> None:
    """When `pid` stops existing (killed and reaped by the parent), in seconds from t0."""
    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            out.append(time.monotonic() - t0)
            return
        time.sleep(0.02)


async def drive(
    base: str,
    d: Drill,
    t0: float,
    stop_at: float,
    stop_s: float,
    victim: int,
    timeout_s: float,
    fresh_connections: bool = False,
) -> None:
    """The load, the SIGSTOP / SIGCONT and the /readyz prober, all timed from t0 (time.monotonic())."""
    url = base + "/v1/inference"
    tag = os.urandom(3).hex()
    # Keep-alive: a request takes an idle connection, so those stuck on the stopped child take no new ones. Fresh:
    # a new connection per request (many independent clients), each dealt by the kernel, half to the stopped child.
    connector = (
        aiohttp.TCPConnector(limit=0, force_close=True)
        if fresh_connections
        else aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    )
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:

        async def send(i: int) -> None:
            text = f"hc-{tag}-{i}"
            for attempt in range(2):
                try:
                    async with s.post(url, data=orjson.dumps({"input": text}), headers=JSON_HEADERS) as resp:
                        raw = await resp.read()
                        status = resp.status
                except BROKEN as exc:
                    if attempt == 0:
                        d.retried[i] = True
                        continue
                    d.outcome[i] = f"failed: {type(exc).__name__} twice"
                    return
                except (TimeoutError, aiohttp.ClientError) as exc:
                    d.outcome[i] = f"failed: {type(exc).__name__}"
                    return
                d.done[i] = time.monotonic() - t0
                try:
                    body = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    d.outcome[i] = f"{status} non-JSON"
                    return
                if status == 200:
                    d.outcome[i] = "200" if body.get("output") == text[::-1] else "wrong"
                else:
                    d.outcome[i] = f"{status} {body.get('error', '?')}"
                return

        async def readyz_prober(until: float) -> None:
            async def one(at: float) -> None:
                began = time.monotonic()
                try:
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as fresh:
                        fresh._retry_connection = False  # aiohttp resends a GET once on a broken connection itself
                        async with fresh.get(base + "/readyz") as resp:
                            await resp.read()
                            what = str(resp.status)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    what = f"no answer ({type(exc).__name__})"
                d.readyz.append((at, what, time.monotonic() - began))

            probes = []
            k = 0
            while time.monotonic() - t0 < until:
                at = k * 0.5
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                probes.append(asyncio.create_task(one(at)))
                k += 1
            await asyncio.gather(*probes)

        async def signals() -> None:
            await asyncio.sleep(max(0.0, t0 + stop_at - time.monotonic()))
            os.kill(victim, signal.SIGSTOP)
            await asyncio.sleep(max(0.0, t0 + stop_at + stop_s - time.monotonic()))
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed and replaced: nothing to resume

        side = [asyncio.create_task(signals()), asyncio.create_task(readyz_prober(float(d.sched[-1])))]
        tasks = []
        for i, due in enumerate(d.sched):
            await asyncio.sleep(max(0.0, t0 + float(due) - time.monotonic()))
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks, *side)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, default=30.0, help="requests per second (default %(default)g)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load (default %(default)g)")
    p.add_argument("--stop-at", type=float, default=10.0, help="SIGSTOP one child at this second (default %(default)g)")
    p.add_argument("--stop-s", type=float, default=10.0, help="SIGCONT this long after (default %(default)g)")
    p.add_argument(
        "--hang-s",
        type=float,
        default=3.0,
        help="the server's --process-hang-s (0: detection off, the behaviour before; default %(default)g)",
    )
    p.add_argument("--sim-batch-ms", type=float, default=20.0, help="default %(default)g")
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request, s (default %(default)g)")
    p.add_argument(
        "--fresh-connections",
        action="store_true",
        help="a new connection per request (default: keep-alive connections, an idle one reused)",
    )
    p.add_argument("--seed", type=int, default=34)
    common.add_output_flags(p, name="hung-child", tag=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "hung-child")
    logs = common.log_dir(a, name)
    load_before = os.getloadavg()
    cmd = servers.batchserve_cmd(
        2,
        a.sim_batch_ms,
        100,
        ["--processes", "2", "--slo-ms", "2000", "--timeout-ms", "10000", "--process-hang-s", f"{a.hang_s:g}"],
    )
    d = Drill(poisson_schedule(a.rate, a.duration, a.seed))
    gone: list[float] = []
    stop_watch = threading.Event()
    victim = 0
    with common.guarded():
        server = servers.start("hung-child", cmd, logs)
        kids = children(server.base)
        victim = min(kids)
        try:
            t0 = time.monotonic() + 0.2
            threading.Thread(target=watch_gone, args=(victim, t0, gone, stop_watch), daemon=True).start()
            uvloop.run(drive(server.base, d, t0, a.stop_at, a.stop_s, victim, a.timeout, a.fresh_connections))
            after_kids = children(server.base)
        finally:
            stop_watch.set()
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server_log = server.log_path
    killed_at = gone[0] if gone else None
    stop_end = killed_at if killed_at is not None else a.stop_at + a.stop_s
    lat = (d.done - d.sched) * 1000
    ok = np.array([o == "200" for o in d.outcome])

    def phase(lo: float, hi: float) -> np.ndarray:
        return (d.sched >= lo) & (d.sched < hi)

    before, during, after = phase(0, a.stop_at), phase(a.stop_at, stop_end), phase(stop_end, a.duration + 1)
    sent_before_kill = d.sched < stop_end
    resumed_at = (
        float(np.nanmax(d.done[sent_before_kill & (d.sched >= a.stop_at)]))
        if np.any(sent_before_kill & (d.sched >= a.stop_at))
        else float("nan")
    )
    outcomes = Counter(d.outcome)
    clear = {o: n for o, n in outcomes.items() if o == "200" or o[:3] in ("429", "503", "504")}
    unclear = {o: n for o, n in outcomes.items() if o not in clear}
    ready = Counter(what for _, what, _ in d.readyz)
    ready_during = Counter(what for at, what, _ in d.readyz if a.stop_at <= at < stop_end)
    ready_slowest = max((took for at, _, took in d.readyz if a.stop_at <= at < stop_end), default=float("nan"))
    rows = [
        [
            label,
            int(mask.sum()),
            int((mask & ok).sum()),
            fmt(pct(lat[mask & ok], 50)),
            fmt(pct(lat[mask & ok], 95)),
            fmt(float(np.nanmax(lat[mask])) if np.any(mask & ~np.isnan(lat)) else float("nan")),
        ]
        for label, mask in (
            ("before the stop", before),
            ("during (stop to kill, or to SIGCONT)", during),
            ("after (the kill, or SIGCONT)", after),
        )
    ]
    md = [
        f"# Hung child drill ({name})",
        "",
        f"`batchserve serve --processes 2 --devices 2 --sim-batch-ms {a.sim_batch_ms:g} --process-hang-s "
        f"{a.hang_s:g}`; {a.rate:g} RPS open-loop Poisson for {a.duration:g} s "
        f"({'a new connection per request' if a.fresh_connections else 'keep-alive connections'}); SIGSTOP of child "
        f"pid {victim} "
        f"at {a.stop_at:g} s, SIGCONT at {a.stop_at + a.stop_s:g} s. Load average before: "
        f"{' '.join(f'{x:.2f}' for x in load_before)} (2 shared cores: noisy).",
        "",
        table(["requests scheduled", "n", "200", "p50 ms", "p95 ms", "max ms"], rows),
        "",
        f"- stopped child killed: {fmt(killed_at - a.stop_at) + ' s after the SIGSTOP' if killed_at else 'never'}",
        f"- answers resumed (the last request sent between the stop and the kill answered): "
        f"{fmt(resumed_at - a.stop_at)} s after the SIGSTOP",
        f"- outcomes: {dict(outcomes)}; connections broken with no answer and retried once: "
        f"{int(d.retried.sum())}; unclear (neither an answer nor a clear status): {unclear or 'none'}",
        f"- /readyz on the shared port, a new connection every 0.5 s: {dict(ready)}; during the stop: "
        f"{dict(ready_during)}, the slowest ended after {fmt(ready_slowest)} s",
        f"- children after: {sorted(after_kids)} (the stopped one "
        f"{'replaced' if victim not in after_kids else 'still there'})",
    ]
    markdown = "\n".join(md)
    print(markdown)
    rep = {
        **report.provenance(),
        "settings": vars(a) | {"out_dir": str(a.out_dir) if a.out_dir else None},
        "load_before": load_before,
        "victim": victim,
        "killed_after_s": killed_at - a.stop_at if killed_at else None,
        "resumed_after_s": resumed_at - a.stop_at,
        "phases": rows,
        "outcomes": dict(outcomes),
        "retried": int(d.retried.sum()),
        "unclear": unclear,
        "readyz": dict(ready),
        "readyz_during": dict(ready_during),
        "readyz_slowest_during_s": ready_slowest,
        "children_after": sorted(after_kids),
        "log": report.log_lines(server_log),
    }
    paths = report.write(name, rep, markdown, common.out_dir(a))
    print(report.written(paths, logs))
    return 0 if not unclear and (a.hang_s == 0 or (killed_at is not None and resumed_at - a.stop_at < 5)) else 1


if __name__ == "__main__":
    sys.exit(main())
