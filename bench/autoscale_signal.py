"""Does the autoscaling signal lead the SLO? (issue 14, item 5) One command:

    python -m bench.autoscale_signal                 # ~75 s: ramp 30 % -> 130 % of one node's capacity over 60 s
    python -m bench.autoscale_signal --ramp-s 20 --warmup-s 3       # a quick look
    python -m bench.autoscale_signal --record        # also writes bench/results/autoscale-<time>.{md,json}

One sim server (4 devices, 100 ms batches of up to 25: a ceiling of 1,000 requests/s, SLO 200 ms) takes
open-loop Poisson load whose rate holds at 30 % of the ceiling for a warm-up, then rises linearly to 130 % over
the ramp. Every ~0.25 s the script reads /metrics, as an autoscaler would: `batchserve_load_ratio`,
`batchserve_predicted_wait_ratio`, the GPU busy ratio and the queue depth. Every request is recorded (bench/
faultload.py); at each sample the p95 of the requests sent in the last `--window-s` seconds is computed with
every refusal or failure counted as a miss (a 503 misses the objective as surely as a late answer). The SLO
breaks when that p95 passes the SLO; a signal crosses when it reaches its threshold. Both must hold for
`--sustain-s` to count. The table gives, per signal and threshold, how many seconds it crossed before the SLO
broke (its lead) and the offered load at that moment.

Why 4 devices of 25 rather than the seed's 1 device of 100 (the same ceiling): on one device the batcher spends
the whole latency budget by design (it holds a batch until slo - S - margin, so p95 sits at ~196 ms at any load)
and p95 "breaks" a 200 ms SLO at the first millisecond of overhead, at any load: there is no moment to lead.
With 4 devices p95 sits near S + S/G (~125 ms) until the node saturates, as a fleet node's would.

Note what each signal is made of: the busy ratio and the queue depth gauges are refreshed by the server's 1 s
tick; the two ratios are computed when /metrics is read.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/autoscale_signal.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import math
import secrets
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from bench import common, report, servers
from bench.faultload import Run, run
from bench.loadgen import parse_metrics

# (label, metric, threshold): the signals compared, each at the thresholds an autoscaler would plausibly use.
SIGNALS = (
    ("load ratio", "batchserve_load_ratio", 0.8),
    ("load ratio", "batchserve_load_ratio", 1.0),
    ("predicted wait ratio", "batchserve_predicted_wait_ratio", 0.8),
    ("predicted wait ratio", "batchserve_predicted_wait_ratio", 1.0),
    ("GPU busy ratio", "batchserve_worker_busy_ratio", 0.8),
    ("GPU busy ratio", "batchserve_worker_busy_ratio", 0.95),
    ("queue depth", "batchserve_queue_depth", 50),
    ("queue depth", "batchserve_queue_depth", 100),
)


def ramp_schedule(r0: float, r1: float, warmup_s: float, ramp_s: float, seed: int) -> np.ndarray:
    """Poisson arrivals at r0 for `warmup_s`, then at a rate rising linearly from r0 to r1 over `ramp_s`:
    unit-rate Poisson points mapped through the inverse of the cumulative rate (time rescaling)."""
    rng = np.random.default_rng(seed)
    total = r0 * warmup_s + (r0 + r1) / 2 * ramp_s
    units = np.cumsum(rng.exponential(1.0, int(total + 10 * math.sqrt(total) + 100)))
    units = units[units < total]
    t = units / r0
    later = units > r0 * warmup_s
    a = (r1 - r0) / ramp_s
    x = units[later] - r0 * warmup_s
    t[later] = warmup_s + (x / r0 if a == 0 else (-r0 + np.sqrt(r0 * r0 + 2 * a * x)) / a)
    return t


def offered(t: float, r0: float, r1: float, warmup_s: float, ramp_s: float) -> float:
    return r0 if t < warmup_s else r0 + (r1 - r0) * min(1.0, (t - warmup_s) / ramp_s)


@dataclass
class Scrape:
    wall: float  # time.time() when read
    values: dict[str, float]


def scrape_loop(base: str, every_s: float, stop: threading.Event, out: list[Scrape]) -> None:
    """GET /metrics every `every_s` (a thread: the load's event loop must not wait on it)."""
    while not stop.is_set():
        started = time.time()
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=1.0) as r:
                out.append(Scrape(started, parse_metrics(r.read().decode())))
        except OSError:
            pass
        stop.wait(max(0.0, every_s - (time.time() - started)))


def first_sustained(times: np.ndarray, ok: np.ndarray, sustain_s: float) -> float | None:
    """The first time from which `ok` holds at every sample for at least `sustain_s`."""
    start = None
    for t, good in zip(times, ok):
        if good:
            start = t if start is None else start
            if t - start >= sustain_s:
                return float(start)
        else:
            start = None
    return None


def window_p95(
    sched: np.ndarray, latency_ms: np.ndarray, ok: np.ndarray, at: np.ndarray, window_s: float, least: int = 20
) -> np.ndarray:
    """p95 of the requests sent in (t - window, t] for each t, a refused or failed request counted as infinite."""
    lat = np.where(ok, latency_ms, np.inf)
    out = np.full(len(at), np.nan)
    for k, t in enumerate(at):
        lo, hi = np.searchsorted(sched, t - window_s, "right"), np.searchsorted(sched, t, "right")
        if hi - lo >= least:
            out[k] = np.percentile(lat[lo:hi], 95, method="higher")
    return out


def analyse(a: argparse.Namespace, result: Run, scrapes: list[Scrape]) -> dict:
    rec = result.records
    cap = a.devices * a.max_batch_size * 1000 / a.sim_batch_ms
    r0, r1 = a.start_load * cap, a.end_load * cap
    times = np.array([s.wall - result.wall_t0 for s in scrapes])
    keep = times >= 0
    times, scrapes = times[keep], [s for s, k in zip(scrapes, keep) if k]
    ok = (rec.status == 200) & ~rec.wrong
    p95 = window_p95(rec.sched, rec.latency_ms, ok, times, a.window_s)
    breach = first_sustained(times, np.nan_to_num(p95, nan=0.0) > a.slo_ms, a.sustain_s)
    rows = []
    for label, metric, threshold in SIGNALS:
        values = np.array([s.values.get(metric, np.nan) for s in scrapes])
        if metric == "batchserve_worker_busy_ratio":
            values = values / a.devices  # summed over the workers by parse_metrics: their mean
        crossed = first_sustained(times, np.nan_to_num(values, nan=-1.0) >= threshold, a.sustain_s)
        rows.append(
            {
                "signal": label,
                "metric": metric,
                "threshold": threshold,
                "crossed_s": crossed,
                "load_at_crossing": offered(crossed, r0, r1, a.warmup_s, a.ramp_s) / cap
                if crossed is not None
                else None,
                "lead_s": breach - crossed if breach is not None and crossed is not None else None,
            }
        )
    timeline = []
    step = max(1, int(round(5.0 / a.every_s)))
    for k in range(0, len(times), step):
        s = scrapes[k].values
        timeline.append(
            {
                "t": float(times[k]),
                "offered_load": offered(times[k], r0, r1, a.warmup_s, a.ramp_s) / cap,
                "p95_ms": float(p95[k]),
                "load_ratio": s.get("batchserve_load_ratio"),
                "predicted_wait_ratio": s.get("batchserve_predicted_wait_ratio"),
                "gpu_busy": s.get("batchserve_worker_busy_ratio", math.nan) / a.devices,
                "queue_depth": s.get("batchserve_queue_depth"),
            }
        )
    codes: dict[str, int] = {}
    for i in np.flatnonzero(~ok):
        key = rec.code[i] or rec.failure[i] or ("wrong output" if rec.wrong[i] else str(rec.status[i]))
        codes[key] = codes.get(key, 0) + 1
    series = {
        "t": times.round(3).tolist(),
        "p95_ms": p95.tolist(),
        **{metric: [sc.values.get(metric) for sc in scrapes] for _, metric, _ in SIGNALS},
    }
    return {
        "capacity_rps": cap,
        "breach_s": breach,
        "series": series,
        "load_at_breach": offered(breach, r0, r1, a.warmup_s, a.ramp_s) / cap if breach is not None else None,
        "requests": len(rec.sched),
        "answered_200": int(ok.sum()),
        "not_200": codes,
        "samples": len(times),
        "signals": rows,
        "timeline": timeline,
    }


def fmt(v: float | None, spec: str) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rep: dict) -> str:
    s, r = rep["settings"], rep["result"]
    breach = (
        f"at {r['breach_s']:.1f} s, offered load {r['load_at_breach']:.0%} of capacity"
        if r["breach_s"] is not None
        else "never during the run"
    )
    lines = [
        f"# Autoscaling signal vs SLO — {rep['when_utc']}",
        "",
        f"Machine: {rep['machine']['cpu_model']}, {rep['machine']['cores']} cores; code {rep['git']['commit'][:12]}"
        f"{' (uncommitted changes)' if rep['git']['dirty'] else ''}.",
        f"One sim server: {s['devices']} device(s), {s['sim_batch_ms']:g} ms batches of up to {s['max_batch_size']} "
        f"(capacity {r['capacity_rps']:.0f} requests/s), SLO {s['slo_ms']:g} ms. Load: open-loop Poisson, "
        f"{s['start_load']:.0%} of capacity for {s['warmup_s']:g} s, then rising linearly to {s['end_load']:.0%} "
        f"over {s['ramp_s']:g} s. /metrics read every {s['every_s']:g} s ({r['samples']} reads); p95 over the "
        f"requests sent in the last {s['window_s']:g} s, refusals counted as misses; a crossing must hold "
        f"{s['sustain_s']:g} s.",
        "",
        f"**p95 broke the {s['slo_ms']:g} ms SLO {breach}.** {r['requests']} requests, {r['answered_200']} answered "
        f"200; the rest: {r['not_200'] or 'none'}.",
        "",
        "| signal | threshold | crossed at | offered load then | lead before the SLO broke |",
        "|---|---|---|---|---|",
    ]
    for row in r["signals"]:
        lead = row["lead_s"]
        lines.append(
            f"| {row['signal']} (`{row['metric']}`) | {row['threshold']:g} | {fmt(row['crossed_s'], '.1f')} s "
            f"| {fmt(row['load_at_crossing'], '.0%')} | "
            f"{'never crossed' if row['crossed_s'] is None else fmt(lead, '+.1f') + ' s'} |"
        )
    lines += [
        "",
        "Timeline (every ~5 s):",
        "",
        "| t s | offered load | p95 ms (window) | load ratio | predicted wait ratio | GPU busy | queue depth |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r["timeline"]:
        lines.append(
            f"| {p['t']:.1f} | {p['offered_load']:.0%} | {fmt(p['p95_ms'], '.0f')} | "
            f"{fmt(p['load_ratio'], '.2f')} | {fmt(p['predicted_wait_ratio'], '.2f')} | "
            f"{fmt(p['gpu_busy'], '.2f')} | {fmt(p['queue_depth'], '.0f')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="How far batchserve_load_ratio leads p95 breaking the SLO")
    common.add_sim_flags(p, devices=4, max_batch_size=25, server_arg=False)
    p.add_argument("--start-load", type=float, default=0.3, help="share of capacity at the start")
    p.add_argument("--end-load", type=float, default=1.3, help="share of capacity at the end of the ramp")
    p.add_argument("--warmup-s", type=float, default=5.0, help="seconds at the start load before the ramp")
    p.add_argument("--ramp-s", type=float, default=60.0)
    p.add_argument("--every-s", type=float, default=0.25, help="how often /metrics is read")
    p.add_argument("--window-s", type=float, default=2.0, help="p95 over the requests sent in this window")
    p.add_argument("--sustain-s", type=float, default=1.0, help="a crossing or a breach must hold this long")
    common.add_load_flags(p, duration=None, warmup=None, seed=14)
    common.add_output_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cap = a.devices * a.max_batch_size * 1000 / a.sim_batch_ms
    sched = ramp_schedule(a.start_load * cap, a.end_load * cap, a.warmup_s, a.ramp_s, a.seed)
    tag = secrets.token_hex(3)
    inputs = [f"{tag}-{i:06d}-autoscale→" for i in range(len(sched))]
    name = common.run_name(a, "autoscale")
    prov = report.provenance()
    cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, a.max_batch_size, common.sim_server_flags(a))
    log_dir = common.log_dir(a, name)
    scrapes: list[Scrape] = []
    stop = threading.Event()
    with common.guarded():
        server = servers.start(name + ".server", cmd, log_dir)
        sampler = threading.Thread(target=scrape_loop, args=(server.base, a.every_s, stop, scrapes), daemon=True)
        try:
            assert server.proc is not None
            sampler.start()
            result = run(
                server.base,
                sched,
                inputs,
                ["normal"] * len(sched),
                [],
                server.pid,
                server.proc,
                timeout_s=a.timeout,
                sample_until=float(sched[-1]) + 1.0,
            )
        finally:
            stop.set()
            sampler.join(timeout=5)
    rep = {
        **prov,
        "settings": {**vars(a), "server_cmd": cmd[1:]},
        "result": analyse(a, result, scrapes),
        "server_log": report.log_lines(server.log_path),
    }
    md = markdown(rep)
    print(md)
    print("\n" + report.written(report.write(name, rep, md, common.out_dir(a)), log_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
