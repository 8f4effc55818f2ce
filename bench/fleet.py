"""Issue 14's fleet bench: N batchserve processes behind a real nginx, each row beside one server alone.

    python -m bench.fleet                      # ~3 minutes: prints the table
    python -m bench.fleet --record             # the same, and writes bench/results/fleet-<stamp>.{md,json}
    python -m bench.fleet --duration 4 --warmup 2 --restart-window 20 --grace 1 --restart-rate 600   # smoke

Rows (sim backend, 1 device per server, open-loop Poisson load from `bench.loadgen`):
1. one server alone at `--rate` (direct, no proxy): the reference;
2. `--servers` servers behind nginx (`deploy/nginx`, Debian's nginx, one worker) at `factor x --rate` for each
   of `--factors`: the goal is p95 <= ideal + 10 ms with no errors at 2.5 x one server's rate, where the ideal
   is `bench.ideal`'s batcher model run on each server's share of the very same arrivals (nginx's round robin
   deals request k to server k mod N);
3. a rolling restart under steady load through nginx (`--restart-rate`): every server in turn gets SIGTERM
   (it drains, keeping its listener open `--grace` s), exits, and is replaced on the same port; the next
   one goes once the replacement answers /readyz. Lost = any answer other than a 200 or a batchserve 503 that
   says why (a reset, refused or timed-out connection, an nginx 502/504, a wrong output): the goal is 0.

Every process's CPU over each row is printed beside it (servers, nginx, the load generator, and what the rest
of the machine used), because on 2 cores they all compete: a miss must say who had the CPU. Servers and nginx
are started here on loopback ports and stopped by PID, on success, error or Ctrl-C.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/fleet.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime as dt
import math
import os
import re
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np

from bench import common, servers
from bench.ideal import IdealResult, ideal, simulate
from bench.loadgen import CLIENTS, LoadResult, measure, parse_metrics
from bench.procstat import CpuSampler, machine_busy_s
from bench.report import git_info, machine_info, write, written
from bench.run_standard import fmt
from bench.schedule import poisson_schedule, row_seed
from deploy.nginx.local import LocalNginx, free_port, start_nginx

FLEET_SLACK_MS = 10.0  # fleet rows: p95 <= ideal + 10 ms
GOAL_FACTOR = 2.5  # ... at 2.5 x one server's rate
REFUSALS = ("503 DRAINING", "503 SERVICE_OVERLOADED", "503 NO_HEALTHY_WORKER")  # answers that say why
SAMPLE_EVERY_S = 0.5


@dataclass
class FleetRow:
    name: str
    servers: int
    rate: float
    seed: int
    load: LoadResult
    ideal: IdealResult | None
    goal: str
    passed: bool
    cpu_cores: dict[str, float] = field(default_factory=dict)  # label -> cores over the row
    mean_batch: float | None = None  # over every server, from their /metrics
    lost: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    retried_by_nginx: int | None = None  # requests nginx passed to a second server
    restarts: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- the ideal of a fleet ------------------------------------------------------------------------------------
def fleet_ideal(
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
    n: int,
    batch_s: float,
    max_batch: int,
    slo_s: float,
    margin_s: float,
    timeout_s: float,
) -> IdealResult:
    """The ideal batcher on each server's round-robin share of the same schedule the load generator sends."""
    arrivals = poisson_schedule(rate, warmup_s + duration_s, seed)
    done = np.full(len(arrivals), np.nan)
    sizes: list[np.ndarray] = []
    for k in range(n):
        share_done, share_sizes = simulate(arrivals[k::n], 1, batch_s, max_batch, slo_s, margin_s, "paced", timeout_s)
        done[k::n] = share_done
        sizes.append(share_sizes)
    window = arrivals >= warmup_s
    lat = (done - arrivals)[window]
    ok = lat[~np.isnan(lat)] * 1000
    pct = np.percentile(ok, [50, 95, 99]) if len(ok) else [math.nan] * 3
    all_sizes = np.concatenate(sizes) if sizes else np.empty(0)
    return IdealResult(
        "paced",
        float(pct[0]),
        float(pct[1]),
        float(pct[2]),
        float(all_sizes.mean()) if len(all_sizes) else math.nan,
        int(np.isnan(lat).sum()),
        int(window.sum()),
    )


# -- measuring -----------------------------------------------------------------------------------------------
class Sampling:
    """CPU of every process of a row, sampled in a thread (so replaced servers still count), plus the machine."""

    def __init__(self, sampler: CpuSampler) -> None:
        self.sampler = sampler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sampler.sample()

    def __enter__(self) -> Sampling:
        self.started, self.busy0 = time.monotonic(), machine_busy_s()
        self.sampler.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sampler.sample()
        self.wall = time.monotonic() - self.started
        self.busy = machine_busy_s() - self.busy0

    def cores(self, client_cores: float) -> dict[str, float]:
        """Cores per label over the row; the load generator from its own window measure; `other` is what the
        machine used beyond every process named here."""
        out = {label: cpu / self.wall for label, cpu in sorted(self.sampler.by_label().items())}
        out["load generator"] = client_cores
        out["machine busy"] = self.busy / self.wall
        out["other"] = max(0.0, out["machine busy"] - sum(v for k, v in out.items() if k != "machine busy"))
        return out


def batch_counts(bases: list[str]) -> tuple[float, float]:
    """(sum of batch sizes, number of batches) over these servers' /metrics."""
    total, count = 0.0, 0.0
    for base in bases:
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
                m = parse_metrics(resp.read().decode())
        except OSError:
            continue
        total += m.get("batchserve_batch_size_sum", 0.0)
        count += m.get("batchserve_batch_size_count", 0.0)
    return total, count


def track_fleet(sampler: CpuSampler, members: list[servers.Server], nginx: LocalNginx | None) -> None:
    for k, s in enumerate(members):
        sampler.track(s.pid, f"server {k + 1}")
    if nginx is not None:
        sampler.track(nginx.pid, "nginx")
        for pid in nginx.worker_pids():
            sampler.track(pid, "nginx")


def judge_lost(load: LoadResult) -> tuple[int, dict[str, int]]:
    refused = {k: v for k, v in load.errors.items() if k in REFUSALS}
    return load.error_count - sum(refused.values()), refused


# -- rows ----------------------------------------------------------------------------------------------------
def server_cmd(a: argparse.Namespace, port: int) -> list[str]:
    return servers.batchserve_cmd(
        1,
        a.sim_batch_ms,
        a.max_batch_size,
        ["--port", str(port), *common.sim_server_flags(a), f"--drain-grace-s={a.grace:g}"],
    )


def ideal_kw(a: argparse.Namespace) -> dict:
    return dict(
        batch_s=a.sim_batch_ms / 1000,
        max_batch=a.max_batch_size,
        slo_s=a.slo_ms / 1000,
        margin_s=a.margin_ms / 1000,
        timeout_s=a.request_timeout_ms / 1000,
    )


def run_alone(a: argparse.Namespace, log_dir: Path) -> FleetRow:
    seed = row_seed(a.seed, 1, a.rate)
    server = servers.start("alone", server_cmd(a, 0), log_dir)
    sampler = CpuSampler()
    track_fleet(sampler, [server], None)
    try:
        with Sampling(sampler) as sampling:
            load = measure(
                server.base,
                a.rate,
                a.duration,
                a.warmup,
                seed,
                server_pid=server.pid,
                timeout_s=a.timeout,
                procs=a.procs,
                client=a.client,
            )
    finally:
        servers.stop(server)
    best = ideal(a.rate, a.duration, a.warmup, seed, 1, policy="paced", **ideal_kw(a))
    bound = best.p95_ms + FLEET_SLACK_MS
    row = FleetRow(
        "one server alone",
        1,
        a.rate,
        seed,
        load,
        best,
        f"reference (p95 ≤ ideal + 10 = {bound:.1f})",
        load.error_count == 0 and load.p95_ms <= bound,
        sampling.cores(load.client_cores),
        load.mean_batch,
    )
    row.lost, row.refused = judge_lost(load)
    return row


def run_fleet_rate(a: argparse.Namespace, factor: float, members: list[servers.Server], nginx: LocalNginx) -> FleetRow:
    rate = factor * a.rate
    seed = row_seed(a.seed, len(members), rate)
    bases = [s.base for s in members]
    sampler = CpuSampler()
    track_fleet(sampler, members, nginx)
    batches0 = batch_counts(bases)
    with Sampling(sampler) as sampling:
        load = measure(
            nginx.url,
            rate,
            a.duration,
            a.warmup,
            seed,
            timeout_s=a.timeout,
            metrics=False,
            procs=a.procs,
            client=a.client,
        )
    batches1 = batch_counts(bases)
    best = fleet_ideal(rate, a.duration, a.warmup, seed, len(members), **ideal_kw(a))
    bound = best.p95_ms + FLEET_SLACK_MS
    passed = load.ok > 0 and load.error_count == 0 and load.p95_ms <= bound
    row = FleetRow(
        f"{len(members)} servers via nginx, {factor:g}× one",
        len(members),
        rate,
        seed,
        load,
        best,
        f"p95 ≤ ideal + 10 = {bound:.1f} ms, 0 errors",
        passed,
        sampling.cores(load.client_cores),
    )
    n = batches1[1] - batches0[1]
    row.mean_batch = (batches1[0] - batches0[0]) / n if n > 0 else None  # warm-up included
    row.lost, row.refused = judge_lost(load)
    return row


def run_rolling_restart(
    a: argparse.Namespace, members: list[servers.Server], nginx: LocalNginx, log_dir: Path
) -> FleetRow:
    """Steady load through nginx while each server in turn is stopped and replaced on its port."""
    rate = a.restart_rate
    seed = row_seed(a.seed, 100 + len(members), rate)
    sampler = CpuSampler()
    track_fleet(sampler, members, nginx)
    restarts: list[dict] = []
    failure: list[str] = []
    began = time.monotonic()

    def restart_each() -> None:
        time.sleep(a.warmup + 1.0)  # into the measured window (the load starts ~0.2 s after the call)
        for k, old in enumerate(list(members)):
            port = old.port
            t0 = time.monotonic()
            sampler.sample_one(old.pid)
            servers.stop(old)
            exited = time.monotonic()
            try:
                new = servers.start(f"fleet-{k + 1}-restarted", server_cmd(a, port), log_dir)
            except servers.ServerFailed as exc:
                failure.append(str(exc))
                return
            members[k] = new
            sampler.track(new.pid, f"server {k + 1}")
            restarts.append(
                {
                    "server": k + 1,
                    "port": port,
                    "sigterm_at_s": round(t0 - began, 2),
                    "exit_code": old.proc.returncode if old.proc else None,
                    "drain_and_exit_s": round(exited - t0, 2),
                    "replacement_ready_s": round(time.monotonic() - exited, 2),
                }
            )

    before = len(nginx.access_log())
    restarter = threading.Thread(target=restart_each, daemon=True)
    with Sampling(sampler) as sampling:
        restarter.start()
        load = measure(
            nginx.url,
            rate,
            a.restart_window,
            a.warmup,
            seed,
            timeout_s=a.timeout,
            metrics=False,
            procs=a.procs,
            client=a.client,
        )
        restarter.join()
    done_by = max(
        (r["sigterm_at_s"] + r["drain_and_exit_s"] + r["replacement_ready_s"] for r in restarts), default=math.nan
    )
    row = FleetRow(
        f"rolling restart of {len(members)} via nginx",
        len(members),
        rate,
        seed,
        load,
        None,
        "0 lost; every server restarted within the window",
        False,
        sampling.cores(load.client_cores),
    )
    row.lost, row.refused = judge_lost(load)
    row.restarts = restarts
    row.retried_by_nginx = sum(1 for line in nginx.access_log()[before:] if re.search(r"upstream_status=\S+, ", line))
    window_end = a.warmup + a.restart_window
    row.passed = row.lost == 0 and len(restarts) == len(members) and not failure and done_by < window_end
    if failure:
        row.notes.append(f"a replacement failed to start: {failure[0][:300]}")
    if len(restarts) == len(members) and not done_by < window_end:
        row.notes.append(
            f"the restarts ended at {done_by:.1f} s, after the window ({window_end:g} s): raise --restart-window"
        )
    if row.lost:
        row.notes.append(f"lost: { {k: v for k, v in load.errors.items() if k not in REFUSALS} }")
    return row


# -- diagnosis and output ------------------------------------------------------------------------------------
def diagnose(row: FleetRow) -> None:
    x = row.load
    if x.send_lag_p99_ms > 5:
        row.notes.append(
            f"client lag: requests left up to {x.send_lag_p99_ms:.1f} ms late (p99), the load "
            f"generator using {x.client_cores:.2f} cores; that delay is in the measured latency"
        )
    busy = row.cpu_cores.get("machine busy", 0.0)
    cores = os.cpu_count() or 1
    if busy > 0.85 * cores:
        top = sorted(((v, k) for k, v in row.cpu_cores.items() if k not in ("machine busy",)), reverse=True)[:3]
        row.notes.append(
            f"the machine was saturated: {busy:.2f} of {cores} cores busy (most: "
            + ", ".join(f"{k} {v:.2f}" for v, k in top)
            + ")"
        )
    if row.cpu_cores.get("other", 0.0) > 0.2:
        row.notes.append(f"something outside the bench used {row.cpu_cores['other']:.2f} cores")
    if x.error_count and row.lost == 0 and row.ideal is not None:
        row.notes.append(f"refusals: {row.refused}")


def table(rows: list[FleetRow]) -> str:
    head = (
        "| row | offered RPS | achieved RPS | p50 ms | p95 ms | p99 ms | ideal p95 | mean batch (ideal) "
        "| 503s | lost | goal | result |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        x = r.load
        refused = sum(r.refused.values())
        lines.append(
            f"| {r.name} | {r.rate:g} | {x.achieved_rps:.0f} | {fmt(x.p50_ms)} | {fmt(x.p95_ms)} | {fmt(x.p99_ms)} "
            f"| {fmt(r.ideal.p95_ms) if r.ideal else '–'} | {fmt(r.mean_batch)}"
            f"{f' ({r.ideal.mean_batch:.1f})' if r.ideal else ''} | {refused} | {r.lost} | {r.goal} "
            f"| {'PASS' if r.passed else 'FAIL'} |"
        )
    return "\n".join(lines)


def cpu_table(rows: list[FleetRow]) -> str:
    labels: list[str] = []
    for r in rows:
        labels += [k for k in r.cpu_cores if k not in labels]
    head = "| row | " + " | ".join(labels) + " |"
    lines = [head + "  (cores over the row)", "|" + "---|" * (len(labels) + 1)]
    for r in rows:
        lines.append(f"| {r.name} | " + " | ".join(fmt(r.cpu_cores.get(k), ".2f") for k in labels) + " |")
    return "\n".join(lines)


def restart_table(row: FleetRow) -> str:
    lines = [
        "| server | port | SIGTERM at s | drain + exit s | exit code | replacement ready after s |",
        "|---|---|---|---|---|---|",
    ]
    for r in row.restarts:
        lines.append(
            f"| {r['server']} | {r['port']} | {r['sigterm_at_s']} | {r['drain_and_exit_s']} "
            f"| {r['exit_code']} | {r['replacement_ready_s']} |"
        )
    return "\n".join(lines)


def headline(rows: list[FleetRow], a: argparse.Namespace) -> str:
    alone = next((r for r in rows if r.servers == 1), None)
    fleet = [r for r in rows if r.servers > 1 and r.ideal is not None]
    restart = next((r for r in rows if r.restarts or r.name.startswith("rolling")), None)
    parts = []
    best = max((r for r in fleet if r.passed), key=lambda r: r.rate, default=None)
    if alone is not None:
        parts.append(f"one server alone: {alone.load.achieved_rps:.0f} RPS at p95 {fmt(alone.load.p95_ms)} ms")
    if best is not None:
        measured = (
            f", {best.load.achieved_rps / alone.load.achieved_rps:.2f}× the alone row's achieved rate"
            if alone is not None and alone.load.achieved_rps > 0
            else ""
        )
        parts.append(
            f"{best.servers} servers via nginx sustained {best.rate:g} RPS "
            f"({best.rate / a.rate:.2f}× --rate{measured}) within ideal + 10 ms"
        )
    elif fleet:
        parts.append(f"no fleet row met p95 ≤ ideal + 10 ms with 0 errors (goal: {GOAL_FACTOR:g}× one)")
    if restart is not None:
        parts.append(
            f"rolling restart: {restart.lost} lost of {restart.load.count}, "
            f"{sum(restart.refused.values())} answered 503, {restart.retried_by_nginx} retried by nginx"
        )
    return "; ".join(parts)


def markdown(report: dict, rows: list[FleetRow], a: argparse.Namespace) -> str:
    m, g = report["machine"], report["git"]
    out = [
        f"# batchserve fleet bench — {report['timestamp']}",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), {m['memory_gib']} GiB; "
        f"load average at start {m['loadavg_at_start']}. Code: {g['commit'][:12]} on {g['branch']}"
        f"{' (uncommitted changes)' if g['dirty'] else ''}.",
        f"Settings: {a.servers} servers, sim backend, 1 device each, {a.sim_batch_ms:g} ms per batch, max batch "
        f"{a.max_batch_size}, SLO {a.slo_ms:g} ms; nginx {report.get('nginx_version', '?')} with "
        f"{a.nginx_workers} worker(s) and deploy/nginx's config; {a.duration:g} s windows after {a.warmup:g} s "
        f"warm-up ({a.restart_window:g} s for the restart row); drain grace {a.grace:g} s; "
        f"{a.procs} load-generator process(es) with the {a.client} sender; seed {a.seed}.",
        "",
        f"**{headline(rows, a)}**",
        "",
        *(
            [f"**Incomplete run**: {report.get('error') or 'interrupted'}", ""]
            if report.get("interrupted") or report.get("error")
            else []
        ),
        "## Rows",
        "",
        table(rows),
        "",
        "## CPU per process",
        "",
        cpu_table(rows),
        "",
    ]
    restart = next((r for r in rows if r.restarts), None)
    if restart is not None:
        out += ["## Rolling restart", "", restart_table(restart), ""]
    notes = [(r, n) for r in rows for n in r.notes]
    if notes:
        out += ["## Notes and evidence", ""] + [f"- {r.name}: {n}" for r, n in notes] + [""]
    return "\n".join(out)


def print_row(row: FleetRow) -> None:
    x = row.load
    print(
        f"   p50 {fmt(x.p50_ms)} p95 {fmt(x.p95_ms)} p99 {fmt(x.p99_ms)} ms"
        f"{f' (ideal p95 {row.ideal.p95_ms:.1f})' if row.ideal else ''}; achieved {x.achieved_rps:.0f} RPS; "
        f"503s {sum(row.refused.values())}, lost {row.lost}; CPU "
        + ", ".join(f"{k} {v:.2f}" for k, v in row.cpu_cores.items())
        + f": {'PASS' if row.passed else 'FAIL'}",
        flush=True,
    )


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="N batchserve servers behind nginx vs one alone, and a rolling restart under load (127.0.0.1 only)"
    )
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--rate", type=float, default=900.0, help="one server's rate, the reference row (default 900)")
    p.add_argument(
        "--factors",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[GOAL_FACTOR],
        help="fleet rows at these multiples of --rate (default 2.5)",
    )
    p.add_argument(
        "--restart-rate",
        type=float,
        default=0.0,
        help="load during the rolling restart (default: half the fleet's capacity, servers x rate / 2)",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=45.0,
        help="measured window of the restart row, s; must cover every restart (default 45)",
    )
    p.add_argument("--skip-restart", action="store_true")
    p.add_argument(
        "--grace", type=float, default=5.0, help="--drain-grace-s of the servers (default 5, the server's default)"
    )
    common.add_load_flags(p, procs=True)
    common.add_sim_flags(p, deadlines=True, server_arg=False)
    p.add_argument(
        "--client",
        choices=CLIENTS,
        default="raw",
        help="load generator's sender (default raw: bench/rawclient.py, the cheapest on CPU)",
    )
    p.add_argument("--nginx-workers", type=int, default=1)
    common.add_output_flags(p)
    a = p.parse_args(argv)
    if a.servers < 1 or a.rate <= 0:
        p.error("--servers must be >= 1 and --rate > 0")
    a.restart_rate = a.restart_rate or a.servers * a.rate / 2
    return a


def nginx_version() -> str:
    import subprocess

    from deploy.nginx.local import ensure_nginx

    done = subprocess.run([ensure_nginx(), "-v"], capture_output=True, text=True)
    return (done.stderr or done.stdout).strip().rpartition("/")[2]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "fleet")
    log_dir = common.log_dir(a, name)
    report: dict = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_info(),
        "nginx_version": nginx_version(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "server_log_dir": str(log_dir),
    }
    rows: list[FleetRow] = []
    nginx: LocalNginx | None = None
    with common.guarded(report, catch=(servers.ServerFailed, RuntimeError)) as stopping:
        try:
            print(f"-- one server alone, {a.rate:g} RPS: {a.warmup:g} s warm-up + {a.duration:g} s ...", flush=True)
            rows.append(run_alone(a, log_dir))
            print_row(rows[-1])
            ports = [free_port() for _ in range(a.servers)]
            members = [servers.start(f"fleet-{k + 1}", server_cmd(a, port), log_dir) for k, port in enumerate(ports)]
            nginx = start_nginx([f"127.0.0.1:{p}" for p in ports], workers=a.nginx_workers)
            for factor in a.factors:
                if stopping:
                    raise KeyboardInterrupt
                print(f"-- {a.servers} servers via nginx, {factor * a.rate:g} RPS ...", flush=True)
                rows.append(run_fleet_rate(a, factor, members, nginx))
                print_row(rows[-1])
            if not a.skip_restart and not stopping:
                print(
                    f"-- rolling restart of {a.servers} via nginx under {a.restart_rate:g} RPS: "
                    f"{a.warmup:g} s warm-up + {a.restart_window:g} s ...",
                    flush=True,
                )
                rows.append(run_rolling_restart(a, members, nginx, log_dir))
                print_row(rows[-1])
        finally:
            if nginx is not None:
                nginx.stop(keep_logs_in=log_dir)
    for row in rows:
        diagnose(row)
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["rows"] = [asdict(r) for r in rows]
    report["all_passed"] = bool(rows) and all(r.passed for r in rows) and not report.get("error")
    md = markdown(report, rows, a)
    print()
    print(md)
    print(written(write(name, report, md, common.out_dir(a)), log_dir))
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
