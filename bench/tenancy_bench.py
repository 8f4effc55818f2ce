"""The tenancy scenarios of issue 4 ("Done when"), in one command:

    python -m bench.tenancy_bench                          # 3 scenarios, 5 s warm-up + 20 s each, ~2 minutes
    python -m bench.tenancy_bench --duration 4 --warmup 2  # a smoke run
    python -m bench.tenancy_bench --scenarios 2            # one scenario

Each scenario gets a fresh `batchserve serve --backend sim` (100 ms batches, max batch 100) with its own
temporary TOML config (`[[models]]`, `[tiers.*]`) and API keys made with `batchserve keys add`, then several
open-loop Poisson streams at once, one per tenant (or model), each with its own key:

1. 1 device: a free-tier tenant offering 3,000 RPS and a paid tenant offering 50 RPS. The free tier's rate
   (2,000 RPS by default, above what one device serves) lets part of the flood through the token bucket, so
   both refusals are exercised: 429 RATE_LIMITED at the bucket, 503 SERVICE_OVERLOADED at admission. Goals:
   paid p95 <= 210 ms with 0 errors; the free tenant refused (429/503), never timing out (no client timeout,
   no request left unanswered, no 504).
2. 1 device: two paid tenants (per-key rates far above their offer, so only fairness and admission act), one
   at 2,000 RPS and one at 100 RPS. Goal: the light tenant's p95 <= 210 ms (and, as fair share implies, 0
   errors); the heavy tenant's outcomes are reported.
3. 2 devices, two models (`busy@v1`, `quiet@v1`, both sim 100 ms), 800 RPS and 5 RPS, each request naming its
   model. Goal: the quiet model's p95 <= 210 ms (and 0 errors).

The client is `bench.loadgen` (its `drive` and client processes; latency from the *scheduled* send time,
every answer checked to be its input reversed). Each stream runs in its own client process(es), so a light
stream's answers are not stamped late behind a heavy stream's bursts; streams of 1,000 RPS or more are split
over `--heavy-procs` processes. The client shares the machine's cores with the server: the rate it actually
sent inside the window and its send lag are reported beside each stream, so a client that could not keep up
is visible. Results (markdown + JSON: machine, git commit, settings, configs without keys) go to
bench/results/tenancy-*.{md,json}; server logs to bench/results/logs/<run>/. Every server is stopped by PID.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/tenancy_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import math
import multiprocessing as mp
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import aiohttp
import numpy as np
import uvloop

from bench import common, report, servers
from bench.fair_metrics import DeviceSampler, idle_while_waiting
from bench.loadgen import (
    INFERENCE_PATH,
    SPAWN_TIMEOUT_S,
    START_DELAY_S,
    LoadResult,
    Part,
    Snapshot,
    _client_process,
    combine,
    parse_metrics,
    sleep_until,
)
from bench.procstat import process_cpu_s, raise_fd_limit
from bench.schedule import poisson_schedule, row_seed

P95_GOAL_MS = 210.0
HEAVY_RPS = 1000.0  # streams at or above this rate are split over --heavy-procs client processes


@dataclass
class Stream:
    name: str  # short label: free, paid, heavy, light, busy, quiet
    tenant: str
    tier: str
    rate: float  # offered requests per second
    key_rate: float | None  # per-key override given to `keys add --rate` (None: the tier's rate)
    model: str | None = None  # "name@version" put in every request body, or None for the default model


@dataclass
class Scenario:
    number: int
    title: str
    devices: int
    models: list[str]  # "name@version", all sim
    tiers: dict[str, tuple[float, float]]  # [tiers.X] rate, burst written to the config
    streams: list[Stream]


@dataclass
class StreamResult:
    stream: Stream
    load: LoadResult
    procs: int
    sent_in_window_rps: float  # requests that actually left the client inside the window / window
    outcomes: dict[str, int]  # ok, 429, 503, 504, client_timeout, no_answer, mismatch, other


# -- scenarios -----------------------------------------------------------------------------------------------
def scenarios(a: argparse.Namespace) -> list[Scenario]:
    k = a.scale  # every rate (offered, tier, key) and the max batch size: the same queueing at k x the CPU
    high = a.high_key_rate * k
    return [
        Scenario(
            1,
            "free flood beside a paid tenant, 1 device",
            1,
            ["echo@v1"],
            {"free": (a.free_tier_rate * k, a.free_tier_rate * k)},
            [
                Stream("free", "free-co", "free", a.s1_free_rps * k, None),
                Stream("paid", "paid-co", "paid", a.s1_paid_rps * k, a.paid_key_rate * k),
            ],
        ),
        Scenario(
            2,
            "two tenants of one tier (paid), 1 device",
            1,
            ["echo@v1"],
            {},
            [
                Stream("heavy", "heavy-co", "paid", a.s2_heavy_rps * k, high),
                Stream("light", "light-co", "paid", a.s2_light_rps * k, high),
            ],
        ),
        Scenario(
            3,
            "a busy and a quiet model, 2 devices",
            2,
            ["busy@v1", "quiet@v1"],
            {},
            [
                Stream("busy", "busy-co", "paid", a.s3_busy_rps * k, high, "busy@v1"),
                Stream("quiet", "quiet-co", "paid", a.s3_quiet_rps * k, high, "quiet@v1"),
            ],
        ),
    ]


def batch_size(a: argparse.Namespace) -> int:
    return max(1, round(a.max_batch_size * a.scale))


def config_text(sc: Scenario, batch_ms: float) -> str:
    lines = [f"# batchserve tenancy bench, scenario {sc.number}: {sc.title}"]
    for mid in sc.models:
        name, version = mid.split("@")
        lines += [
            "",
            "[[models]]",
            f'name = "{name}"',
            f'version = "{version}"',
            'backend = "sim"',
            f"sim_batch_ms = {batch_ms:g}",
        ]
    for tier, (rate, burst) in sc.tiers.items():
        lines += ["", f"[tiers.{tier}]", f"rate = {rate:g}", f"burst = {burst:g}"]
    return "\n".join(lines) + "\n"


# -- load ----------------------------------------------------------------------------------------------------
def labelled(text: str) -> dict[str, float]:
    """Prometheus text → {full sample key with labels: value} (buckets skipped), for per-model figures."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key, _, value = line.rpartition(" ")
        if "_bucket{" in key:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


async def snap(base: str, pid: int) -> tuple[Snapshot, dict[str, float]]:
    at = time.monotonic()
    try:
        cpu = process_cpu_s(pid)
    except OSError:
        cpu = None
    text = ""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(base + "/metrics") as resp:
                if resp.status == 200:
                    text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        pass
    return Snapshot(at, cpu, parse_metrics(text) if text else None), labelled(text)


async def snaps_around(
    base: str, pid: int, window: tuple[float, float], sampler: DeviceSampler
) -> tuple[tuple[Snapshot, dict[str, float]], tuple[Snapshot, dict[str, float]]]:
    """/metrics and the server's CPU at the window's edges; the devices (`sampler`) all through it."""
    await sleep_until(window[0])
    first = await snap(base, pid)
    sampler.start = window[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        await sampler.run(session, window[1])
    await sleep_until(window[1])
    return first, await snap(base, pid)


def classify(errors: dict[str, int], ok: int) -> dict[str, int]:
    out = {"ok": ok, "429": 0, "503": 0, "504": 0, "client_timeout": 0, "no_answer": 0, "mismatch": 0, "other": 0}
    for what, n in errors.items():
        if what.startswith("429 "):
            out["429"] += n
        elif what.startswith("503 "):
            out["503"] += n
        elif what.startswith("504 "):
            out["504"] += n
        elif what == "client_timeout":
            out["client_timeout"] += n
        elif what == "mismatch":
            out["mismatch"] += n
        elif what.startswith(("conn:", "client:", "non-JSON")):
            out["no_answer"] += n
        else:
            out["other"] += n
    return out


def run_load(
    server: servers.Server, sc: Scenario, keys: dict[str, str], a: argparse.Namespace, sampler: DeviceSampler
) -> tuple[list[StreamResult], tuple, tuple]:
    """Every stream at once, each in its own client process(es) (`loadgen._client_process`), one shared t0;
    this process only reads /metrics and the server's CPU at the window's edges, and its devices through it."""
    raise_fd_limit()
    ctx = mp.get_context("spawn")
    url = server.base + INFERENCE_PATH
    offsets = (a.warmup, a.warmup + a.duration)
    plans = []  # (stream, seed, schedule, procs)
    jobs: list[tuple[int, Connection[float, str | Part], BaseProcess]] = []  # (stream index, pipe, process)
    finished = False
    try:
        for si, s in enumerate(sc.streams):
            seed = row_seed(a.seed, 100 * sc.number + si, s.rate)
            sched = poisson_schedule(s.rate, a.warmup + a.duration, seed)
            procs = a.heavy_procs if s.rate >= HEAVY_RPS else 1
            plans.append((s, seed, sched, procs))
            tag = f"s{sc.number}{s.name}-{secrets.token_hex(3)}"
            headers = {"Authorization": f"Bearer {keys[s.name]}"}
            extra = {"model": s.model} if s.model else None
            for k in range(procs):
                share = np.arange(k, len(sched), procs)
                parent_end, child_end = ctx.Pipe()
                child = ctx.Process(
                    target=_client_process,
                    daemon=True,
                    args=(child_end, url, sched, share, tag, a.timeout, a.connections, offsets, headers, extra),
                )
                child.start()
                jobs.append((si, parent_end, child))
        for _, pipe, _ in jobs:
            if not pipe.poll(SPAWN_TIMEOUT_S) or pipe.recv() != "ready":
                raise RuntimeError("a client process did not start")
        t0 = time.monotonic() + START_DELAY_S
        for _, pipe, _ in jobs:
            pipe.send(t0)
        window = (t0 + offsets[0], t0 + offsets[1])
        first, last = uvloop.run(snaps_around(server.base, server.pid, window, sampler))
        parts: list[list[Part]] = [[] for _ in sc.streams]
        for si, pipe, _ in jobs:
            if not pipe.poll(a.timeout + 30):
                raise RuntimeError("a client process did not report")
            part = pipe.recv()
            assert isinstance(part, Part), "a client process sends its Part once the schedule is done"
            parts[si].append(part)
        finished = True
    finally:
        for _, _, proc in jobs:  # after an error or Ctrl-C, at once: their schedules would run on
            proc.join(timeout=5 if finished else 0)
            if proc.is_alive():
                proc.kill()  # by its own PID; it is ours
                proc.join(timeout=5)

    results = []
    for si, (s, seed, sched, procs) in enumerate(plans):
        load = combine(
            parts[si],
            sched,
            s.rate,
            a.duration,
            a.warmup,
            seed,
            first[0],
            last[0],
            procs,
            {
                "url": url,
                "timeout_s": a.timeout,
                "connections": a.connections,
                "rate": s.rate,
                "duration_s": a.duration,
                "warmup_s": a.warmup,
                "seed": seed,
                "procs": procs,
                "tenant": s.tenant,
                "tier": s.tier,
                "model": s.model,
            },
        )
        sent = np.concatenate([sched[p.idx] + p.lag_s for p in parts[si]]) if parts[si] else np.empty(0)
        in_window = int(((sent >= a.warmup) & (sent < a.warmup + a.duration)).sum())
        results.append(StreamResult(s, load, procs, in_window / a.duration, classify(load.errors, load.ok)))
    return results, first, last


# -- judging -------------------------------------------------------------------------------------------------
def per_model(first: dict[str, float], last: dict[str, float], models: list[str], window_s: float) -> dict:
    def delta(key: str) -> float:
        return last.get(key, 0.0) - first.get(key, 0.0)

    out = {}
    for mid in models:
        lab = f'{{model="{mid}"}}'
        n = delta(f"batchserve_batch_size_count{lab}")
        qn = delta(f"batchserve_queue_wait_seconds_count{lab}")
        out[mid] = {
            "batches": n,
            "batches_per_s": n / window_s if window_s > 0 else None,
            "mean_batch": delta(f"batchserve_batch_size_sum{lab}") / n if n else None,
            "mean_queue_ms": delta(f"batchserve_queue_wait_seconds_sum{lab}") / qn * 1000 if qn else None,
            "mean_batch_ms": (
                delta(f"batchserve_batch_compute_seconds_sum{lab}")
                / delta(f"batchserve_batch_compute_seconds_count{lab}")
                * 1000
            )
            if delta(f"batchserve_batch_compute_seconds_count{lab}")
            else None,
        }
    rejected = {}
    for key in last:
        if key.startswith("batchserve_rejected_total{"):
            d = delta(key)
            if d:
                rejected[key.split('reason="', 1)[-1].rstrip('"}')] = d
    return {"models": out, "rejected_by_reason": rejected}


def p95_check(label: str, r: StreamResult) -> dict:
    x = r.load
    return {
        "check": f"{label} p95",
        "goal": f"≤ {P95_GOAL_MS:g} ms",
        "measured": f"{report.fmt(x.p95_ms)} ms "
        f"(server's own {report.fmt(x.server_p95_ms, '.0f')}; {x.ok} answered 200)",
        "met": bool(x.ok > 0 and x.p95_ms <= P95_GOAL_MS),
    }


def errors_check(label: str, r: StreamResult, note: str = "") -> dict:
    x = r.load
    detail = ", ".join(f"{k}: {v}" for k, v in x.errors.items())
    return {
        "check": f"{label} errors{note}",
        "goal": "0",
        "measured": f"{x.error_count}" + (f" ({detail})" if detail else ""),
        "met": x.error_count == 0,
    }


def outcome_text(r: StreamResult) -> str:
    o = r.outcomes
    return (
        f"200: {o['ok']}, 429: {o['429']}, 503: {o['503']}, 504: {o['504']}, client timeouts: "
        f"{o['client_timeout']}, no answer: {o['no_answer']}, wrong output: {o['mismatch']}, other: {o['other']}"
    )


def judge(sc: Scenario, res: list[StreamResult]) -> list[dict]:
    by = {r.stream.name: r for r in res}
    if sc.number == 1:
        free, paid = by["free"], by["paid"]
        o = free.outcomes
        never = o["client_timeout"] + o["no_answer"] + o["504"]
        return [
            p95_check("paid tenant", paid),
            errors_check("paid tenant", paid),
            {
                "check": "free tenant refused with 429/503",
                "goal": "refusals > 0",
                "measured": f"429: {o['429']}, 503: {o['503']} of {free.load.count} (200: {o['ok']})",
                "met": o["429"] + o["503"] > 0,
            },
            {
                "check": "free tenant never timing out",
                "goal": "0 client timeouts, 0 unanswered, 0 × 504",
                "measured": f"client timeouts {o['client_timeout']}, unanswered {o['no_answer']}, 504 {o['504']}",
                "met": never == 0,
            },
            {
                "check": "free tenant wrong outputs / other errors",
                "goal": "0",
                "measured": f"{o['mismatch']} / {o['other']}",
                "met": o["mismatch"] + o["other"] == 0,
            },
        ]
    if sc.number == 2:
        heavy, light = by["heavy"], by["light"]
        return [
            p95_check("light tenant", light),
            errors_check("light tenant", light, " (fair share implies none)"),
            {
                "check": "heavy tenant outcomes",
                "goal": "(reported)",
                "measured": outcome_text(heavy) + f"; p95 of its 200s {report.fmt(heavy.load.p95_ms)} ms",
                "met": None,
            },
        ]
    busy, quiet = by["busy"], by["quiet"]
    return [
        p95_check("quiet model", quiet),
        errors_check("quiet model", quiet),
        {
            "check": "busy model outcomes",
            "goal": "(reported)",
            "measured": outcome_text(busy) + f"; p95 {report.fmt(busy.load.p95_ms)} ms",
            "met": None,
        },
    ]


def notes_for(res: list[StreamResult], loadavg: float, server_stats: dict, devices: int, max_batch: int) -> list[str]:
    notes = []
    bps, batch_ms, mean_batch = (server_stats.get(k) for k in ("batches_per_s", "mean_batch_ms", "mean_batch"))
    if devices == 1 and bps and batch_ms and mean_batch and mean_batch >= 0.9 * max_batch:
        cycle = 1000 / bps
        notes.append(
            f"the device was saturated: one batch every {cycle:.1f} ms for a {batch_ms:.1f} ms batch (worker "
            f"gap {cycle - batch_ms:.1f} ms). An item taken into the very next batch still waits for the "
            f"running one, so even a perfect priority gives p95 ≈ 0.95 × cycle + batch = "
            f"{0.95 * cycle + batch_ms:.1f} ms before any HTTP or event-loop delay"
        )
    for r in res:
        x = r.load
        if x.scheduled_rps > 0 and r.sent_in_window_rps < 0.95 * x.scheduled_rps:
            notes.append(
                f"{r.stream.name}: the client sent only {r.sent_in_window_rps:.0f} RPS inside the window "
                f"of the {x.scheduled_rps:.0f} scheduled ({r.procs} client process(es), "
                f"{x.client_cores:.2f} cores): the offered load was lower than nominal"
            )
        if x.send_lag_p99_ms > 5:
            notes.append(
                f"{r.stream.name}: requests left the client up to {x.send_lag_p99_ms:.1f} ms late (p99; "
                f"max {x.send_lag_max_ms:.0f}); that lag is inside its latency"
            )
        if x.ok and not math.isnan(x.server_p95_ms) and x.server_p95_ms > P95_GOAL_MS:
            notes.append(
                f"{r.stream.name}: the server's own latency_ms p95 is {x.server_p95_ms:.0f} ms: the delay "
                f"is inside the server, not the client"
            )
        elif x.ok and x.p95_ms > P95_GOAL_MS and x.server_p95_ms <= P95_GOAL_MS:
            notes.append(
                f"{r.stream.name}: client p95 {x.p95_ms:.1f} ms but the server's own p95 "
                f"{x.server_p95_ms:.0f} ms: the gap is the client/HTTP path (shared cores)"
            )
    if loadavg > 1.0:
        notes.append(f"the machine was busy before the scenario (load average {loadavg:.2f} on {os.cpu_count()} cores)")
    cores = server_stats.get("server_cores")
    if cores is not None and cores > 0.9:
        notes.append(f"the server used {cores:.2f} cores: its event loop is near one core's worth")
    return notes


# -- one scenario --------------------------------------------------------------------------------------------
def run_scenario(sc: Scenario, a: argparse.Namespace, log_dir: Path) -> dict:
    loadavg = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"batchserve-tenancy-s{sc.number}-") as tmp:
        cfg = Path(tmp) / "batchserve.toml"
        cfg.write_text(config_text(sc, a.sim_batch_ms))
        keys = {s.name: servers.add_key(cfg, s.tenant, s.tier, s.key_rate) for s in sc.streams}
        config_used = cfg.read_text()  # digests only: the keys themselves are never written down
        extra = ["--config", str(cfg), *common.sim_server_flags(a), *a.server_arg]
        server = servers.start(
            f"tenancy-s{sc.number}", servers.batchserve_cmd(sc.devices, a.sim_batch_ms, batch_size(a), extra), log_dir
        )
        sampler = DeviceSampler(server.base, 0.0, a.sample_ms / 1000)
        try:
            res, first, last = run_load(server, sc, keys, a, sampler)
        finally:
            servers.stop(server)
    window = last[0].at - first[0].at
    x = res[0].load  # server-wide figures are the same in every stream's LoadResult
    stats = {
        "server_cores": x.server_cores,
        "server_cpu_s": x.server_cpu_s,
        "mean_batch": x.mean_batch,
        "batches_per_s": x.batches_per_s,
        "mean_batch_ms": x.server_mean_compute_ms,
        "mean_queue_ms": x.server_mean_queue_ms,
        "client_cores": sum(r.load.client_cores for r in res),
        **per_model(first[1], last[1], sc.models, window),
        "idle_while_waiting": idle_while_waiting(sampler.readings),
    }
    checks = judge(sc, res)
    return {
        "scenario": sc.number,
        "title": sc.title,
        "devices": sc.devices,
        "models": sc.models,
        "config": config_used,
        "server_cmd": server.cmd,
        "server_log": str(server.log_path),
        "server_log_notable": report.log_lines(server.log_path),
        "loadavg_before": loadavg,
        "sample_ms": a.sample_ms,
        "streams": [
            {
                "stream": asdict(r.stream),
                "procs": r.procs,
                "sent_in_window_rps": r.sent_in_window_rps,
                "outcomes": r.outcomes,
                "load": asdict(r.load),
            }
            for r in res
        ],
        "server": stats,
        "checks": checks,
        "passed": all(c["met"] is not False for c in checks),
        "notes": notes_for(res, loadavg, stats, sc.devices, batch_size(a)),
    }


# -- output --------------------------------------------------------------------------------------------------
def met_text(met: bool | None) -> str:
    return "–" if met is None else ("yes" if met else "**no**")


def scenario_markdown(s: dict) -> str:
    lines = [
        f"## Scenario {s['scenario']}: {s['title']} — {'PASS' if s['passed'] else 'FAIL'}",
        "",
        report.table(
            ["check", "goal", "measured", "met"],
            [[c["check"], c["goal"], c["measured"], met_text(c["met"])] for c in s["checks"]],
        ),
        "",
    ]
    rows = []
    for st in s["streams"]:
        x, o, t = st["load"], st["outcomes"], st["stream"]
        rows.append(
            [
                t["name"],
                f"{t['tenant']} ({t['tier']})",
                t["model"] or "default",
                f"{t['rate']:g}",
                f"{x['scheduled_rps']:.0f}",
                f"{st['sent_in_window_rps']:.0f}",
                o["ok"],
                o["429"],
                o["503"],
                o["504"],
                o["client_timeout"],
                o["no_answer"],
                o["mismatch"] + o["other"],
                x["p50_ms"],
                x["p95_ms"],
                x["p99_ms"],
                report.fmt(x["server_p95_ms"], ".0f"),
                x["send_lag_p99_ms"],
                f"{st['procs']}",
            ]
        )
    lines += [
        report.table(
            [
                "stream",
                "tenant (tier)",
                "model",
                "offered RPS",
                "scheduled RPS",
                "sent in window RPS",
                "200",
                "429",
                "503",
                "504",
                "client timeouts",
                "no answer",
                "wrong/other",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "server's p95",
                "send lag p99 ms",
                "client procs",
            ],
            rows,
        ),
        "",
    ]
    sv = s["server"]
    per = "; ".join(
        f"{m}: mean batch {report.fmt(v['mean_batch'])}, {report.fmt(v['batches_per_s'])} batches/s, "
        f"mean queue wait {report.fmt(v['mean_queue_ms'])} ms"
        for m, v in sv["models"].items()
    )
    lines.append(
        f"Server over the window: {report.fmt(sv['server_cores'], '.2f')} cores, mean batch "
        f"{report.fmt(sv['mean_batch'])}, {report.fmt(sv['batches_per_s'])} batches/s, batch "
        f"{report.fmt(sv['mean_batch_ms'])} ms; {per}. Refusals by reason: "
        f"{sv['rejected_by_reason'] or 'none'}. Client processes used "
        f"{report.fmt(sv['client_cores'], '.2f')} cores. Load average before: {s['loadavg_before']:.2f}."
    )
    idle = sv["idle_while_waiting"]
    share = report.fmt(idle["idle_share"] * 100, ".2f")
    lines += [
        "",
        f"Work conservation (`bench/fair_metrics.py`, the devices read every {s['sample_ms']:g} ms): inputs "
        f"waited {report.fmt(idle['waiting_s'], '.1f')} s of the window, the devices idle "
        f"{report.fmt(idle['idle_ms'], '.0f')} device-ms meanwhile ({share} %; the hand-off between batches "
        "counts as idle, and so does a hold for a fuller batch while a device is below saturation). D and "
        "Jain's index are not judged here: the light streams are open loop, not backlogged "
        "(`bench/fairness.py` and `bench/fair_service.py` measure two backlogged tenants).",
    ]
    if s["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in s["notes"]]]
    return "\n".join(lines) + "\n"


def markdown(rep: dict) -> str:
    m, g, st = rep["machine"], rep["git"], rep["settings"]
    out = [
        f"# batchserve tenancy bench (issue 4) — {rep['when_utc']}",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), {m['memory_gib']} GiB; "
        f"Python {m['python']} on {m['platform']}; load average at start {m['loadavg_at_start']}, at end "
        f"{m.get('loadavg_at_end')}.",
        f"Code: {g['commit'][:12]} on {g['branch']}{' (uncommitted changes)' if g['dirty'] else ''}.",
        *(
            [
                f"**Scaled run (--scale {st['scale']:g})**: every rate and the max batch size × {st['scale']:g} (same "
                "batch time, same load ratios); the issue's goals are for the unscaled run."
            ]
            if st["scale"] != 1
            else []
        ),
        f"Settings: sim backend, {st['sim_batch_ms']:g} ms per batch, max batch {rep['max_batch_size']}, SLO "
        f"{st['slo_ms']:g} ms, margin {st['margin_ms']:g} ms, request timeout {st['request_timeout_ms']:g} ms; "
        f"{st['duration']:g} s measured after {st['warmup']:g} s warm-up per scenario; seed {st['seed']}; client "
        f"timeout {st['timeout']:g} s; streams ≥ {HEAVY_RPS:g} RPS on {st['heavy_procs']} client process(es); "
        f"extra server args {st['server_arg'] or 'none'}.",
        "Latency is from each request's scheduled send time (open loop), over the answers 200 whose output was "
        "the input reversed; counts are of requests scheduled in the window.",
        "",
    ]
    if rep.get("interrupted") or rep.get("error"):
        out += [f"**Incomplete run**: {'interrupted' if rep.get('interrupted') else rep.get('error')}", ""]
    out += [scenario_markdown(s) for s in rep["scenarios"]]
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Issue 4's tenancy scenarios against local sim servers (127.0.0.1)")
    common.add_load_flags(p, connections=True)
    p.add_argument("--scenarios", default="1,2,3", help="which scenarios, e.g. 1,3 (default 1,2,3)")
    p.add_argument("--sample-ms", type=float, default=200.0, help="how often the devices are read (default 200)")
    p.add_argument("--s1-free-rps", type=float, default=3000.0)
    p.add_argument("--s1-paid-rps", type=float, default=50.0)
    p.add_argument(
        "--free-tier-rate",
        type=float,
        default=2000.0,
        help="scenario 1: [tiers.free] rate and burst; above one device's ~1,000 RPS so both 429s and "
        "503s happen (default 2000)",
    )
    p.add_argument(
        "--paid-key-rate",
        type=float,
        default=1000.0,
        help="scenario 1: the paid key's rate (keys add --rate), far above its offer (default 1000)",
    )
    p.add_argument(
        "--high-key-rate",
        type=float,
        default=100000.0,
        help="scenarios 2 and 3: every key's rate, so no token bucket limits them (default 100000)",
    )
    p.add_argument("--s2-heavy-rps", type=float, default=2000.0)
    p.add_argument("--s2-light-rps", type=float, default=100.0)
    p.add_argument("--s3-busy-rps", type=float, default=800.0)
    p.add_argument("--s3-quiet-rps", type=float, default=5.0)
    p.add_argument(
        "--heavy-procs",
        type=int,
        default=2,
        help=f"client processes for a stream of ≥ {HEAVY_RPS:g} RPS (default 2; others get 1)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every rate (offered, tier, key) and the max batch size by this: e.g. 0.1 gives "
        "the same queueing (same batch time, same load ratios) at a tenth of the CPU, for smoke "
        "runs on a busy machine; the issue's goals are for 1 (default 1)",
    )
    common.add_sim_flags(p, deadlines=True)
    common.add_output_flags(p, tag=True)
    a = p.parse_args(argv)
    try:
        a.scenarios = sorted({int(x) for x in a.scenarios.split(",") if x.strip()})
    except ValueError:
        p.error("--scenarios takes numbers 1-3, comma-separated")
    if not a.scenarios or not set(a.scenarios) <= {1, 2, 3}:
        p.error("--scenarios takes numbers 1-3, comma-separated")
    if a.duration <= 0 or a.warmup < 0 or a.heavy_procs < 1 or not 0 < a.scale <= 1:
        p.error("--duration must be > 0, --warmup >= 0, --heavy-procs >= 1, 0 < --scale <= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "tenancy")
    log_dir = common.log_dir(a, name)
    rep: dict = {
        **report.provenance(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "goal_p95_ms": P95_GOAL_MS,
        "max_batch_size": batch_size(a),
        "server_log_dir": str(log_dir),
        "scenarios": [],
    }
    chosen = [sc for sc in scenarios(a) if sc.number in a.scenarios]
    with common.guarded(rep, catch=(servers.ServerFailed, RuntimeError)) as stopping:
        for sc in chosen:
            if stopping:
                raise KeyboardInterrupt
            rates = ", ".join(f"{s.name} {s.rate:g} RPS" for s in sc.streams)
            print(
                f"-- scenario {sc.number}: {sc.title} ({rates}); {a.warmup:g} s warm-up + {a.duration:g} s ...",
                flush=True,
            )
            result = run_scenario(sc, a, log_dir)
            rep["scenarios"].append(result)
            print(scenario_markdown(result), flush=True)
            time.sleep(0.5)
    rep["machine"]["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    rep["all_passed"] = (
        len(rep["scenarios"]) == len(chosen)
        and not rep.get("error")
        and not rep.get("interrupted")
        and all(s["passed"] for s in rep["scenarios"])
    )
    md = markdown(rep)
    print(
        f"{'ALL GOALS MET' if rep['all_passed'] else 'SOME GOALS MISSED'}; "
        + report.written(report.write(name, rep, md, common.out_dir(a)), log_dir)
    )
    return 0 if rep["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
