"""Fairness between two backlogged tenants in the literature's terms (issue 49, item 5): the service difference
over time, Jain's index per window, and work conservation, on one sim device, measured from the server's side.

    python -m bench.fair_service               # 32 s of load (3 windows of 10 s after the first second), ~45 s
    python -m bench.fair_service --quick       # 12 s: one window, a check of the path, not a measurement
    python -m bench.fair_service --record      # and bench/results/fair-service-<time>.{md,json,png}

One `batchserve serve --backend sim` (1 device, 100 ms batches of at most 100; a sim input costs 1) with a TOML
config of three keys: tenants `small` and `large`, both of tier `paid` with per-key rates far above what they
send (only the fair queue and admission act), and an `observer` key with `admin = true` that sends no load.
`small` runs `--small-loops` (300) closed loops of 1-input requests (`POST /v1/inference`), `large`
`--large-loops` (38) closed loops of `--large-inputs` (8)-input requests (KServe v2 infer, one BYTES tensor of
shape [8]: each element one input through the same door and queue). Each tenant so keeps about 300 inputs
outstanding, 6 of its 50-input shares of a batch: it still has inputs waiting at every batch's formation while
its answers travel back and it sends again, and through a client stall of up to ~0.4 s: both are backlogged (an
input waits ~0.6 s, inside `--slo-ms 1000`). A refused request (429/503) waits its `retry_after_ms` (at least
50 ms) and is sent again, as `batchserve.client` does.

Every `--sample-ms` (200) the observer reads, one after the other: `GET /internal/health` (the worker busy or not,
how long and with how many inputs its batch has run, its batch count, the queue depth; read again once the running
batch is 30 ms in), `GET /v1/usage` (every tenant's cost served since start, in one answer: one instant for both,
between two batches' answers) and `GET /metrics` (`batchserve_batch_compute_seconds` sum and count: the device's
time in finished batches; `batchserve_batch_size` sum and count: the batches formed and their inputs). A usage
reading is whole when no batch ended between the health and metrics calls around it and the finished batches'
inputs less the cost served is under one request's cost (what remains: a request whose other inputs are in the
running batch); one taken while a batch's answers were being recorded (one tenant's counted, the other's not yet)
is left out of D and the windows. From these:

- **service difference** D(t) = (W_small(t0, t) - W_large(t0, t)) / U: cost served to each tenant since t0 (the
  first whole reading after the first second of load), apart, over U, the largest single request's cost (8 here:
  the server counts a request when it answers it whole, so the service curves move by whole requests). Goal: |D|
  never above 2: the form of bound start-time fair queuing and the Virtual Token Counter (Sheng et al., OSDI '24)
  give for two backlogged clients, a small multiple of the largest request's cost whatever the interval's length
  (docs/architecture.md, "Priority and fairness", says why batchserve keeps it).
- **Jain's fairness index** over each 10 s window (`--window-s`) of the cost each tenant was served:
  (x1 + x2)^2 / (2 (x1^2 + x2^2)), 1 for equal shares, 0.5 for one tenant served alone. Goal: >= 0.95 each.
- **work conservation**: the device's idle time over the sample intervals with inputs waiting at both ends (the
  interval's length less the growth of busy time: completed batches' compute time plus the running batch's time
  so far), per window, and the samples that saw the worker free while inputs waited. Goal: never idle; the
  hand-off between two batches is counted as idle, so the table gives the idle time itself (ms per window, and
  its share of the waiting time) and judges it against 1 % of the window.

The clients' own counts (sent, 200, refused, 504, errors) are beside the server's. Client, server and sampler
share the machine (and the sampler the clients' event loop): a stall of the client shows as a sample gap far over
the period (`longest sample gap`); one long enough to drain a tenant's ~6 batch shares would end its backlog, and
the fair queue then rightly serves the other alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/fair_service.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson
import uvloop

from bench import common, plot, report, servers
from bench.fair_metrics import DeviceReading, idle_while_waiting, jain
from bench.loadgen import parse_metrics
from bench.procstat import raise_fd_limit
from bench.report import fmt, table

D_GOAL = 2.0  # |service difference| / the largest request's cost
JAIN_GOAL = 0.95
IDLE_GOAL = 0.01  # idle time while inputs wait, as a share of the window: the hand-off between batches
SETTLE_S = 1.0  # the first second of load is not judged


@dataclass
class Tenant:
    name: str
    inputs: int  # per request
    loops: int
    key: str = ""


@dataclass
class Tally:
    """One tenant's clients' own count."""

    sent: int = 0
    ok: int = 0
    inputs_ok: int = 0
    refused: int = 0
    expired: int = 0
    other: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0


@dataclass
class Sample:
    t: float  # seconds from the load's start, between the health call's end and the usage call's
    cost: dict[str, float]  # tenant -> cost served since the server started (/v1/usage)
    t_health: float = math.nan  # the middle of the /internal/health call
    busy: bool | None = None  # the worker ran a batch
    running_s: float = 0.0  # for this long
    running_size: int = 0  # of this many inputs
    batches: int = -1  # batches the worker finished
    queue_depth: int = -1
    compute_sum: float = math.nan  # /metrics, read last: completed batches' compute seconds
    compute_count: float = math.nan  # ... and their number
    formed: float = math.nan  # batches formed (running and staged ones too)
    formed_inputs: float = math.nan  # their inputs
    staged: float = math.nan  # batches begun by the device's thread the moment the one before ended (staging)
    in_flight: dict[str, int] = field(default_factory=dict)


def write_keys(config: Path, tenants: list[Tenant]) -> str:
    """The tenants' keys (paid, rates far above the offer) and the observer's (admin); returns the observer's."""
    from batchserve.config_file import append_key
    from batchserve.http.guards import digest, new_key

    for t in tenants:
        t.key = new_key()
        append_key(str(config), t.name, "paid", digest(t.key), 1_000_000)
    observer = new_key()
    append_key(str(config), "observer", "paid", digest(observer), None, admin=True)
    return observer


def body_of(tenant: Tenant, tag: str, i: int) -> tuple[str, bytes]:
    """The route and body of request i: /v1/inference for one input, KServe v2 infer for several."""
    if tenant.inputs == 1:
        return "/v1/inference", orjson.dumps({"input": f"{tag}-{i}"})
    data = [f"{tag}-{i}-{j}" for j in range(tenant.inputs)]
    tensor = {"name": "input", "datatype": "BYTES", "shape": [tenant.inputs], "data": data}
    return "/v2/models/sim/infer", orjson.dumps({"inputs": [tensor]})


def retry_after_s(raw: bytes) -> float:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return 0.05
    hint = body.get("retry_after_ms") if isinstance(body, dict) else None
    if hint is None and isinstance(body, dict) and isinstance(body.get("error"), dict):
        hint = body["error"].get("retry_after_ms")
    return max(0.05, float(hint or 0) / 1000)


async def closed_loop(
    session: aiohttp.ClientSession, base: str, tenant: Tenant, loop_no: int, stop_at: float, tally: Tally
) -> None:
    headers = {"Authorization": f"Bearer {tenant.key}", "Content-Type": "application/json"}
    tag, i = f"{tenant.name[0]}{loop_no}", 0
    while time.monotonic() < stop_at:
        path, body = body_of(tenant, tag, i)
        i += 1
        tally.sent += 1
        tally.in_flight += 1
        wait = 0.0
        try:
            async with session.post(base + path, data=body, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            status, raw = 0, type(exc).__name__.encode()
        finally:
            tally.in_flight -= 1
        if status == 200:
            tally.ok += 1
            tally.inputs_ok += tenant.inputs
        elif status in (429, 503):
            tally.refused += 1
            wait = retry_after_s(raw)
        elif status == 504:
            tally.expired += 1
        else:
            what = str(status) if status else f"no answer: {raw.decode()}"
            tally.other[what] = tally.other.get(what, 0) + 1
            wait = 0.05
        if wait:
            await asyncio.sleep(wait)


ALIGN_S = 0.03  # a usage reading waits until the running batch is this far in: the last batch's answers are out


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> dict:
    async with session.get(url, headers=headers) as resp:
        body: dict = orjson.loads(await resp.read())
        return body


async def observe(
    session: aiohttp.ClientSession,
    base: str,
    observer: str,
    start: float,
    stop_at: float,
    every_s: float,
    tallies: dict[str, Tally],
    out: list[Sample],
) -> None:
    """The server's figures every `every_s`: health, then usage (both tenants at one instant), then metrics. The
    usage call waits until the running batch is ALIGN_S in, so it falls between two batches' answers."""
    auth = {"Authorization": f"Bearer {observer}"}
    while time.monotonic() < stop_at:
        began = time.monotonic()
        try:
            health = await get_json(session, base + "/internal/health")
            worker = health["workers"][0] if health.get("workers") else {}
            early = ALIGN_S - worker.get("running_ms", 0) / 1000
            if worker.get("busy") and early > 0:
                await asyncio.sleep(early)
                began = time.monotonic()
                health = await get_json(session, base + "/internal/health")
                worker = health["workers"][0] if health.get("workers") else {}
            after_health = time.monotonic()
            usage = await get_json(session, base + "/v1/usage?window_s=5", auth)
            after_usage = time.monotonic()
            async with session.get(base + "/metrics") as resp:
                metrics = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            await asyncio.sleep(every_s)
            continue
        out.append(
            Sample(
                t=(after_health + after_usage) / 2 - start,
                cost={row["tenant"]: float(row["since_start"]["cost_served"]) for row in usage["data"]},
                t_health=(began + after_health) / 2 - start,
                busy=worker.get("busy"),
                running_s=worker.get("running_ms", 0) / 1000,
                running_size=int(worker.get("batch_size", 0)),
                batches=int(worker.get("batches", -1)),
                queue_depth=int(health.get("queue_depth", -1)),
                compute_sum=metrics.get("batchserve_batch_compute_seconds_sum", math.nan),
                compute_count=metrics.get("batchserve_batch_compute_seconds_count", math.nan),
                formed=metrics.get("batchserve_batch_size_count", math.nan),
                formed_inputs=metrics.get("batchserve_batch_size_sum", math.nan),
                staged=metrics.get("batchserve_batches_staged_total", 0.0),  # absent before one
                in_flight={name: t.in_flight for name, t in tallies.items()},
            )
        )
        await asyncio.sleep(max(0.0, began + every_s - time.monotonic()))


async def drive(
    base: str, tenants: list[Tenant], observer: str, seconds: float, every_s: float, timeout_s: float
) -> tuple[dict[str, Tally], list[Sample]]:
    tallies = {t.name: Tally() for t in tenants}
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connections = sum(t.loops for t in tenants) + 8
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=60),
        timeout=timeout,
        skip_auto_headers=("User-Agent",),
    ) as session:
        start = time.monotonic()
        stop_at = start + seconds
        tasks = [
            asyncio.create_task(closed_loop(session, base, t, n, stop_at, tallies[t.name]))
            for t in tenants
            for n in range(t.loops)
        ]
        watcher = asyncio.create_task(observe(session, base, observer, start, stop_at, every_s, tallies, samples))
        await asyncio.gather(watcher, *tasks)
    return tallies, samples


# -- analysis ------------------------------------------------------------------------------------------------
def busy_total(s: Sample, offset: float) -> float:
    """The device's busy seconds at the health call: completed batches' compute time, plus the running batch's
    time so far when no batch ended between the health and metrics calls (their batch counts agree)."""
    running = s.running_s if s.busy and s.compute_count - s.batches == offset else 0.0
    return s.compute_sum + running


def unanswered(s: Sample) -> float:
    """Inputs of the finished batches not in any tenant's cost served: the answers not yet recorded, and the
    inputs of a request whose other inputs are still in the running batch."""
    return s.formed_inputs - (s.running_size if s.busy else 0) - sum(s.cost.values())


def readable(samples: list[Sample], offset: float, unit: float) -> list[Sample]:
    """The samples whose usage reading is whole: no batch ended or was staged between the health and metrics
    calls around it, and every answer of the finished batches recorded (less than one request's cost missing,
    against the least missing in the run): a reading taken while a batch's answers were being recorded counts
    one tenant's and not yet the other's."""
    steady = [
        s
        for s in samples
        if s.compute_count - s.batches == offset and s.formed == s.compute_count + (1 if s.busy else 0)
    ]
    if not steady:
        return []
    base = min(unanswered(s) for s in steady)
    return [s for s in steady if unanswered(s) - base < unit]


def analyse(samples: list[Sample], names: tuple[str, str], unit: float, window_s: float) -> dict:
    """The running service difference, Jain's index per window, and idle time while inputs waited."""
    judged = [s for s in samples if s.t >= SETTLE_S]
    if len(judged) < 2:
        return {"error": "fewer than two samples after the first second"}
    offset = judged[0].compute_count - judged[0].batches
    valid = readable(judged, offset, unit)
    if len(valid) < 2:
        return {"error": f"fewer than two whole usage readings after the first second (of {len(judged)})"}
    first = valid[0]
    t0 = first.t

    def served(s0: Sample, s1: Sample) -> dict[str, float]:
        return {n: s1.cost.get(n, 0.0) - s0.cost.get(n, 0.0) for n in names}

    a, b = names
    diff = [(s.t - t0, served(first, s)[a] - served(first, s)[b]) for s in valid]
    windows: list[dict[str, Any]] = []
    edge = t0
    while edge + window_s <= valid[-1].t + 1e-9 or not windows:
        inside = [s for s in valid if edge - 1e-9 <= s.t <= edge + window_s + 1e-9]
        if len(inside) < 2:
            break
        lo, hi = inside[0], inside[-1]
        span = [s for s in judged if lo.t <= s.t <= hi.t]
        idle = idle_while_waiting([DeviceReading(s.t_health, s.queue_depth, 1, busy_total(s, offset)) for s in span])
        got = served(lo, hi)
        d_in = [abs(d) / unit for t, d in diff if lo.t - t0 - 1e-9 <= t <= hi.t - t0 + 1e-9]
        windows.append(
            {
                "from_s": round(lo.t, 2),
                "to_s": round(hi.t, 2),
                "served": got,
                "jain": jain(list(got.values())),
                "max_abs_d": max(d_in) if d_in else math.nan,
                "waiting_s": idle["waiting_s"],
                "idle_ms": idle["idle_ms"],
                "idle_share": idle["idle_share"],
                "free_with_waiting": sum(1 for s in span if s.busy is False and s.queue_depth > 0),
                "samples": len(span),
                "readings": len(inside),
                "in_flight_end": hi.in_flight,
                "queue_depth_min": min(s.queue_depth for s in span),
                "batches": hi.compute_count - lo.compute_count,
                "staged": hi.staged - lo.staged,
                # a gap between samples far over the period: the client (and sampler) stalled on a busy machine,
                # and a tenant whose answers were not read meanwhile may have stopped being backlogged
                "longest_sample_gap_s": max(s1.t - s0.t for s0, s1 in zip(span, span[1:], strict=False)),
            }
        )
        edge = hi.t
    max_d = max(abs(d) for _, d in diff) / unit
    total = served(first, valid[-1])
    full = [w for w in windows if w["to_s"] - w["from_s"] >= window_s * 0.9]
    judged_windows = full or windows
    return {
        "t0_s": t0,
        "unit": unit,
        "samples": len(judged),
        "readings": len(valid),
        "diff": [(round(t, 3), d) for t, d in diff],
        "max_abs_d": max_d,
        "windows": windows,
        "served": total,
        "share_ratio": max(total.values()) / min(total.values()) if min(total.values()) else math.inf,
        "goals": {
            f"|D| never above {D_GOAL:g} after the first second": bool(max_d <= D_GOAL),
            f"Jain's index >= {JAIN_GOAL} in every {window_s:g} s window": all(
                w["jain"] >= JAIN_GOAL for w in judged_windows
            ),
            f"device idle while inputs wait <= {IDLE_GOAL:.0%} of each window": all(
                not w["idle_share"] > IDLE_GOAL for w in judged_windows
            ),
            "no sample saw the device free while inputs waited": all(
                w["free_with_waiting"] == 0 for w in judged_windows
            ),
        },
    }


def markdown(rep: dict) -> str:
    s, res, m = rep["settings"], rep["result"], rep["machine"]
    if "error" in res:
        return f"# Fair service (bench/fair_service.py)\n\nNo result: {res['error']}"
    names = [t["name"] for t in s["tenants"]]
    tenant_rows = []
    for t in s["tenants"]:
        c = rep["clients"][t["name"]]
        tenant_rows.append(
            [
                t["name"],
                t["loops"],
                t["inputs"],
                c["sent"],
                c["ok"],
                c["refused"],
                c["expired"],
                sum(c["other"].values()),
                fmt(res["served"][t["name"]], ".0f"),
            ]
        )
    window_rows = []
    for w in res["windows"]:
        window_rows.append(
            [
                f"{w['from_s']:.1f}-{w['to_s']:.1f}",
                *(fmt(w["served"][n], ".0f") for n in names),
                fmt(w["jain"], ".4f"),
                fmt(w["max_abs_d"], ".2f"),
                fmt(w["idle_ms"], ".1f"),
                fmt(w["idle_share"] * 100, ".2f"),
                w["free_with_waiting"],
                f"{w['batches']:.0f} ({w['staged']:.0f})",
                w["queue_depth_min"],
                fmt(w["longest_sample_gap_s"] * 1000, ".0f"),
                " / ".join(str(w["in_flight_end"].get(n, "?")) for n in names),
            ]
        )
    goals = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {g}" for g, ok in res["goals"].items())
    who = "; ".join(
        f"`{t['name']}` {t['loops']} closed loops of {t['inputs']}-input requests"
        + (" (`/v1/inference`)" if t["inputs"] == 1 else " (KServe v2 infer)")
        for t in s["tenants"]
    )
    return "\n".join(
        [
            "# Fair service between two backlogged tenants (bench/fair_service.py)",
            "",
            f"One sim device ({s['sim_batch_ms']:g} ms batches of at most {s['max_batch_size']}; an input costs 1), "
            f"`--slo-ms {s['slo_ms']:g}`, two `paid` tenants: {who}. {s['seconds']:g} s of load; the server "
            f"sampled every {s['sample_ms']:g} ms (`/v1/usage` by an admin key, `/internal/health`, `/metrics`); "
            f"judged from t0 = {res['t0_s']:.2f} s (the first sample after the first second). Machine: "
            f"{m.get('cores_usable', '?')} usable cores, load average {rep['loadavg_before']} before, "
            f"{rep['loadavg_after']} after; commit {rep['git'].get('commit', '?')[:12]}"
            f"{' (dirty)' if rep['git'].get('dirty') else ''}.",
            "",
            table(
                [
                    "tenant",
                    "loops",
                    "inputs a request",
                    "sent",
                    "200",
                    "refused",
                    "504",
                    "other",
                    "cost served from t0",
                ],
                tenant_rows,
            ),
            "",
            f"Service difference D = (W_{names[0]} - W_{names[1]}) / U from t0, U = {res['unit']:g} (the largest "
            f"request's cost): **max |D| = {res['max_abs_d']:.2f}** (goal <= {D_GOAL:g}); over the run the larger "
            f"share is {res['share_ratio']:.3f}x the smaller. D is read from the {res['readings']} whole usage "
            f"readings of {res['samples']} samples (the others were taken while a batch ended or its answers were "
            "being recorded, when one tenant's answers are counted and not yet the other's).",
            "",
            table(
                [
                    "window s",
                    *(f"cost {n}" for n in names),
                    "Jain",
                    "max abs D",
                    "device idle ms while waiting",
                    "idle % of waiting",
                    "samples free with waiting",
                    "batches (staged)",
                    "min queue depth",
                    "longest sample gap ms",
                    "in flight at end " + " / ".join(names),
                ],
                window_rows,
            ),
            "",
            "Idle: over the sample intervals with inputs waiting at both ends, the interval less the growth of the "
            "device's busy time (completed batches' `batch_compute_seconds` plus the running batch's `running_ms`); "
            "the hand-off between two batches counts as idle. Staged: batches the device's thread began the moment "
            "the one before ended (`batchserve_batches_staged_total`); the others waited for the event loop to hear "
            "of the end. A sample gap far over the period means the client and sampler stalled (a busy machine): a "
            "tenant whose answers were not read meanwhile may have stopped being backlogged.",
            "",
            goals,
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_sim_flags(p, slo_ms=1000.0)
    p.add_argument("--seconds", type=float, default=32.0, help="seconds of load (default %(default)g)")
    p.add_argument("--window-s", type=float, default=10.0, help="Jain's index window (default %(default)g)")
    p.add_argument("--sample-ms", type=float, default=200.0, help="how often the server is read (default %(default)g)")
    p.add_argument("--small-loops", type=int, default=300, help="closed loops of 1-input requests")
    p.add_argument("--large-loops", type=int, default=38, help="closed loops of --large-inputs-input requests")
    p.add_argument("--large-inputs", type=int, default=8, help="inputs per request of the large tenant")
    p.add_argument("--timeout-ms", type=float, default=10000.0, help="the server's --timeout-ms (default %(default)g)")
    p.add_argument("--quick", action="store_true", help="12 s of load, one window: a check, not a measurement")
    common.add_output_flags(p, name="fair-service", tag=True)
    a = p.parse_args(argv)
    if a.quick:
        a.seconds = 12.0
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "fair-service")
    tenants = [Tenant("small", 1, a.small_loops), Tenant("large", a.large_inputs, a.large_loops)]
    prov = report.provenance()
    logs = common.log_dir(a, name)
    loadavg_before = round(os.getloadavg()[0], 2)
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="fair-service-") as tmp, common.guarded():
        config = Path(tmp) / "keys.toml"
        observer = write_keys(config, tenants)
        flags = ["--config", str(config), "--slo-ms", f"{a.slo_ms:g}", "--timeout-ms", f"{a.timeout_ms:g}"]
        cmd = servers.batchserve_cmd(1, a.sim_batch_ms, a.max_batch_size, [*flags, *a.server_arg])
        server = servers.start(name + ".server", cmd, logs)
        tallies, samples = uvloop.run(
            drive(server.base, tenants, observer, a.seconds, a.sample_ms / 1000, a.timeout_ms / 1000 + 30)
        )
    unit = float(max(t.inputs for t in tenants))  # a sim input costs 1: the largest request costs its inputs
    result = analyse(samples, ("small", "large"), unit, a.window_s)
    rep = {
        **prov,
        "settings": {
            **{k: v for k, v in vars(a).items() if k != "out_dir"},
            "tenants": [{"name": t.name, "inputs": t.inputs, "loops": t.loops} for t in tenants],
            "command": " ".join(["python -m bench.fair_service", *(argv if argv is not None else sys.argv[1:])]),
            "server_cmd": cmd[1:],
        },
        "loadavg_before": loadavg_before,
        "loadavg_after": round(os.getloadavg()[0], 2),
        "clients": {n: asdict(t) for n, t in tallies.items()},
        "result": result,
        "samples": [asdict(s) for s in samples],
        "server_log": report.log_lines(server.log_path),
    }
    md = markdown(rep)
    directory = common.out_dir(a)
    if directory is not None and "diff" in result:
        md += f"\n\n![the service difference over time]({name}.png)"
    print(md)
    paths = report.write(name, rep, md, directory)
    if paths is not None and "diff" in result:
        xs = [result["t0_s"] + t for t, _ in result["diff"]]
        ys = [d / unit for _, d in result["diff"]]
        png = plot.series_png(
            {f"(W_small - W_large) / {unit:g}": (xs, ys)},
            "Accumulated service difference between two backlogged paid tenants (1 sim device)",
            "seconds of load",
            "difference / largest request's cost",
            bounds=(D_GOAL, -D_GOAL),
        )
        paths[1].with_suffix(".png").write_bytes(png)
    print("\n" + report.written(paths, logs))
    goals = result.get("goals", {})
    return 0 if goals and all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
