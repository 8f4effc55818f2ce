"""Issue 27's scale bench: one server process's ceiling on the sim with fast batches, then N processes
(`batchserve serve --processes N`) to the host's ceiling, each beside `batchserve plan`'s prediction.

    python -m bench.scale                       # ~2 minutes on 2 cores: prints the tables
    python -m bench.scale --record              # also writes bench/results/scale-<time>.{md,json}
    python -m bench.scale --duration 2 --warmup 1 --factors 0.8,1.0 --max-ramp-rows 3   # a smoke run

With batches of 10 ms on 4 sim devices per process, the devices could serve 38,000 requests/s a process: the
CPU is the only limit left, which is the point. Steps:

1. One process's ceiling: a ramp from `--start-rate` by `--ramp-step` (open loop, `bench.loadgen`, raw
   client) until a row fails; at the highest passing row, the server's CPU per request (utime + stime of its
   process tree from /proc, the counter its /metrics exports as process_cpu_seconds_total, over the requests
   sent) and the load generator's. CPU per request falls as the rate rises (per-batch and per-tick work is
   shared by more requests), so it is read where the process is busiest, as `plan --measure` should be.
2. Predictions: `batchserve.plan.make_plan` for each process count, with that CPU per request, the planner's
   default 90 % of a core per process, and the cores the servers can have: one per process, and on this host
   no more than its cores less what the rest of the machine used (the ramp's median) and the load generator's share
   at the predicted rate (it runs on the same cores here; on a real host it does not). That share depends on
   the rate, so the cores and the prediction are iterated.
3. The ceiling search, interleaved so both configurations see the same machine: for each factor of
   `--factors`, every configuration still passing runs at factor x its prediction; a row passes with
   p95 <= the SLO, 0 errors and at least 97 % answered; past the listed factors the grid goes on in
   `--extend-step` steps to `--max-factor` until every configuration has failed once. A configuration's
   ceiling is its highest passing row before its first failure.
4. The plan for `--plan-rate` (10,000) on nodes of `--plan-devices` GPUs of `--plan-batch-ms`, with the
   measured CPU per request and the example prices `--gpu-cost-per-hour` / `--node-cost-per-hour`.

The load generator is `bench.loadgen`'s, split over `--procs` client processes (the same Poisson schedule dealt
round-robin; one raw-client process took ~0.25 cores at 10,000 requests/s here, so one was enough on 2 cores;
a 16-core host aiming at 10,000+ needs several). Every server is started here on 127.0.0.1 and stopped by PID. The
machine is shared: each row records what
the rest of the machine used (`others cores`), and a miss must be read beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import math
import os
import statistics
import time
import urllib.request
import json
from dataclasses import asdict, dataclass

from batchserve.plan import BatchTime, Contract, Prices, make_plan
from batchserve.plan_command import render
from bench import common, report, servers
from bench.loadgen import measure
from bench.procstat import machine_busy_s, tree_cpu_s

PASS_ANSWERED = 0.97  # share of the scheduled requests answered 200 for a row to pass
HOST_ITERATIONS = 6


@dataclass
class Row:
    processes: int
    factor: float
    rate: float
    predicted: float
    achieved: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int
    error_kinds: dict
    server_cores: float
    server_us_per_req: float
    client_cores: float
    others_cores: float  # the machine's busy CPU less the servers' and the load generator's
    send_lag_p99_ms: float
    passed: bool


def children_ready(base: str, want: int, timeout_s: float = 60.0) -> list[int]:
    """The pids behind the shared port, once `want` distinct ones answer /internal/health "ok"."""
    seen: set[int] = set()
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            req = urllib.request.Request(base + "/internal/health", headers={"Connection": "close"})
            with urllib.request.urlopen(req, timeout=5) as r:
                d = json.loads(r.read())
            if d["status"] == "ok":
                seen.add(d["pid"])
        except OSError:
            pass
        if len(seen) >= want:
            return sorted(seen)
        time.sleep(0.02)
    raise servers.ServerFailed(f"only {len(seen)} of {want} processes answered behind {base}")


def run_row(
    base: str, pid: int, processes: int, factor: float, rate: float, predicted: float, a: argparse.Namespace
) -> Row:
    cpu0, busy0, t0 = tree_cpu_s(pid), machine_busy_s(), time.monotonic()
    r = measure(base, rate, a.duration, a.warmup, a.seed, timeout_s=a.timeout, procs=a.procs, client="raw")
    cpu1, busy1, wall = tree_cpu_s(pid), machine_busy_s(), time.monotonic() - t0
    sent = r.count / a.duration * (a.duration + a.warmup)  # warm-up requests cost CPU too
    server_cpu = cpu1 - cpu0
    server_cores = server_cpu / wall
    others = (busy1 - busy0) / wall - server_cores - r.client_cores
    passed = r.error_count == 0 and r.p95_ms <= a.slo_ms and r.ok >= PASS_ANSWERED * r.count
    return Row(
        processes,
        factor,
        rate,
        predicted,
        r.achieved_rps,
        r.p50_ms,
        r.p95_ms,
        r.p99_ms,
        r.error_count,
        r.errors,
        server_cores,
        server_cpu / max(1.0, sent) * 1e6,
        r.client_cores,
        max(0.0, others),
        r.send_lag_p99_ms,
        passed,
    )


def contract(a: argparse.Namespace, processes: int, cpu_s: float, cores: float) -> Contract:
    return Contract(
        BatchTime.constant(a.sim_batch_ms),
        devices=processes * a.devices_per_process,
        max_batch=a.max_batch_size,
        slo_s=a.slo_ms / 1000,
        cpu_s_per_request=cpu_s,
        processes=processes,
        cores=cores,
    )


def predict_host(
    a: argparse.Namespace, processes: int, cpu_s: float, client_s: float, others: float
) -> tuple[float, float]:
    """The planner's capacity for `processes` on this host, and the cores it was given: one per process, at
    most the host's cores less what the rest of the machine used at one process's ceiling and what the load
    generator burns at the predicted rate (solved by iteration)."""
    host = float(os.cpu_count() or 1) - others
    cores = float(processes)
    cap = 0.0
    for _ in range(HOST_ITERATIONS):
        cap = make_plan(1.0, contract(a, processes, cpu_s, cores), sim_s=a.plan_sim_s).capacity
        cores = max(0.1, min(float(processes), host - client_s * cap))
    return cap, cores


def markdown(rep: dict) -> str:
    s, probe = rep["settings"], rep["probe"]
    lines = [
        f"# Scale bench: one process's ceiling, then N processes on one port ({rep['when_utc']})",
        "",
        f"Machine: {rep['machine']}. Commit {rep['git']['commit'][:10]}{' (dirty)' if rep['git']['dirty'] else ''}.",
        f"Sim: {s['devices_per_process']} devices per process, {s['sim_batch_ms']:g} ms batches of up to "
        f"{s['max_batch_size']}, SLO p95 <= {s['slo_ms']:g} ms; open-loop Poisson load (`bench.loadgen`, raw "
        f"client, {s['procs']} client process(es)), {s['warmup']:g} s warm-up + {s['duration']:g} s per row.",
        "",
        "**This machine is shared** (2 cores, several engineers' tests and benches at once) and the load "
        "generator runs on the same cores: the numbers are noisy, and the `others cores` column says how much "
        "of the machine something else used during each row. Rows of the two configurations are interleaved "
        "(factor by factor), so both saw the same machine.",
        "",
        "## One process's ceiling (a ramp)",
        "",
        f"Highest passing rate **{probe['rate']:.0f} requests/s** (p95 {probe['p95_ms']:.1f} ms, "
        f"{probe['errors']} errors), where the server used **{probe['server_us_per_req']:.0f} µs of CPU per "
        f"request** ({probe['server_cores']:.2f} cores); the load generator {probe['client_us_per_req']:.0f} µs per "
        f"request; the rest of the machine {probe['others_cores']:.2f} cores. "
        + (
            f"The next row, {probe['first_failing']['rate']:.0f} requests/s, failed (p95 "
            f"{probe['first_failing']['p95_ms']:.1f} ms, {probe['first_failing']['errors']} errors)."
            if probe["first_failing"]
            else "No row failed: the ramp ran out of rows before the ceiling."
        ),
        "",
        "| offered | achieved | p50 | p95 | p99 | errors | server cores | server µs/req | client cores | "
        "others cores | pass |",
        "|" + "---|" * 11,
        *[
            f"| {r['rate']:.0f} | {r['achieved']:.0f} | {report.fmt(r['p50_ms'])} | {report.fmt(r['p95_ms'])} | "
            f"{report.fmt(r['p99_ms'])} | {r['errors']} | {r['server_cores']:.2f} | {r['server_us_per_req']:.0f} | "
            f"{r['client_cores']:.2f} | {r['others_cores']:.2f} | {'yes' if r['passed'] else 'no'} |"
            for r in rep["ramp"]
        ],
        "",
        "The planner's predictions below take that CPU per request, 90 % of a core per process (its default), "
        "and as cores the host's less what the rest of the machine used (the median over the ramp: "
        f"{rep.get('others_for_plan', math.nan):.2f} cores) and what the load generator uses at the predicted "
        "rate (it shares these cores; on a real host it would not).",
        "",
        "## Ceilings against the planner",
        "",
        "| processes | predicted ceiling (req/s) | cores given to the planner | measured ceiling | error |",
        "|---|---|---|---|---|",
    ]
    for c in rep["ceilings"]:
        err = f"{(c['measured'] / c['predicted'] - 1) * 100:+.1f} %" if c["measured"] else "–"
        if c["measured"] and not c.get("failed", True):
            err += " (a lower bound: no row failed)"
        lines.append(
            f"| {c['processes']} | {c['predicted']:.0f} | {c['cores']:.2f} | {c['measured']:.0f} | {err} |"
            if c["measured"]
            else f"| {c['processes']} | {c['predicted']:.0f} | {c['cores']:.2f} | none passed | – |"
        )
    lines += [
        "",
        "Measured ceiling = the highest passing row (its offered rate); the grid's steps bound the error's resolution.",
        "",
        "## Rows (in the order run)",
        "",
        "| processes | factor | offered | planner | achieved | p50 | p95 | p99 | errors | server cores | "
        "server µs/req | client cores | others cores | send lag p99 | pass |",
        "|" + "---|" * 15,
    ]
    for r in rep["rows"]:
        errs = str(r["errors"]) + (
            f" ({', '.join(f'{k}: {v}' for k, v in r['error_kinds'].items())})" if r["error_kinds"] else ""
        )
        lines.append(
            f"| {r['processes']} | {r['factor']:g} | {r['rate']:.0f} | {r['predicted']:.0f} | "
            f"{r['achieved']:.0f} | {report.fmt(r['p50_ms'])} | {report.fmt(r['p95_ms'])} | "
            f"{report.fmt(r['p99_ms'])} | {errs} | {r['server_cores']:.2f} | {r['server_us_per_req']:.0f} | "
            f"{r['client_cores']:.2f} | {r['others_cores']:.2f} | {report.fmt(r['send_lag_p99_ms'])} | "
            f"{'yes' if r['passed'] else 'no'} |"
        )
    lines += [
        "",
        f"## The plan for {s['plan_rate']:g} requests/s",
        "",
        f"With the probe's CPU per request, on nodes of {s['plan_devices']} GPUs at {s['plan_batch_ms']:g} ms "
        f"a batch of {s['max_batch_size']}, at example prices (not quotes) of {s['gpu_cost_per_hour']:g} "
        f"per GPU-hour and {s['node_cost_per_hour']:g} per node-hour:",
        "",
    ]
    for text in rep["plans"]:
        lines += ["```", text, "```", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one process's ceiling, then N processes, beside the planner")
    p.add_argument("--processes", default="1,2", help="process counts to compare (default %(default)s)")
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--sim-batch-ms", type=float, default=10.0)
    p.add_argument("--max-batch-size", type=int, default=100)
    p.add_argument("--slo-ms", type=float, default=200.0)
    p.add_argument("--start-rate", type=float, default=3000.0, help="the one-process ramp's first rate")
    p.add_argument("--ramp-step", type=float, default=1.25, help="the ramp's factor from row to row")
    p.add_argument("--max-ramp-rows", type=int, default=10)
    p.add_argument(
        "--factors",
        default="0.8,0.9,0.95,1.0,1.05,1.1,1.2",
        help="rows at these multiples of each configuration's predicted ceiling",
    )
    p.add_argument("--extend-step", type=float, default=0.1, help="past --factors, step by this until a fail")
    p.add_argument("--max-factor", type=float, default=2.0)
    p.add_argument("--plan-rate", type=float, default=10000.0)
    p.add_argument("--plan-devices", type=int, default=8)
    p.add_argument("--plan-batch-ms", type=float, default=100.0)
    p.add_argument("--gpu-cost-per-hour", type=float, default=2.5, help="example price (default %(default)g)")
    p.add_argument("--node-cost-per-hour", type=float, default=2.0, help="example price (default %(default)g)")
    p.add_argument("--plan-sim-s", type=float, default=5.0)
    common.add_load_flags(p, duration=4.0, warmup=1.5, seed=27, timeout=10.0, procs=True)
    common.add_output_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    counts = sorted({1, *(int(x) for x in a.processes.split(","))})  # one process's ramp comes first
    factors = [float(x) for x in a.factors.split(",")]
    name = common.run_name(a, "scale")
    log_dir = common.log_dir(a, name)
    rep: dict = {**report.provenance(), "settings": vars(a).copy(), "rows": [], "ceilings": [], "plans": []}
    rep["settings"]["out_dir"] = str(a.out_dir) if a.out_dir else None
    with common.guarded(rep) as stopping:
        started = {}
        for n in counts:
            cmd = servers.batchserve_cmd(
                n * a.devices_per_process,
                a.sim_batch_ms,
                a.max_batch_size,
                ["--processes", str(n), "--slo-ms", f"{a.slo_ms:g}"],
            )
            server = servers.start(f"{name}.p{n}", cmd, log_dir)
            if n > 1:
                children_ready(server.base, n)
            started[n] = server
        one = started[1]
        ramp: list[Row] = []
        rate = a.start_rate
        while len(ramp) < a.max_ramp_rows and not stopping:
            row = run_row(one.base, one.pid, 1, 0.0, rate, math.nan, a)
            ramp.append(row)
            print(
                f"ramp, 1 process: {rate:.0f} offered, p95 {row.p95_ms:.1f} ms, errors {row.errors}, server "
                f"{row.server_cores:.2f} cores at {row.server_us_per_req:.0f} us/req, client "
                f"{row.client_cores:.2f}, others {row.others_cores:.2f}: {'pass' if row.passed else 'FAIL'}",
                flush=True,
            )
            if not row.passed:
                break
            rate *= a.ramp_step
        passing = [r for r in ramp if r.passed]
        if not passing:
            raise servers.ServerFailed(f"one process failed even at {a.start_rate:g} requests/s: lower --start-rate")
        top = passing[-1]
        cpu_s = top.server_us_per_req / 1e6
        client_s = top.client_cores / max(1.0, top.achieved)
        rep["ramp"] = [asdict(r) for r in ramp]
        rep["probe"] = {
            "rate": top.rate,
            "server_us_per_req": top.server_us_per_req,
            "server_cores": top.server_cores,
            "client_us_per_req": client_s * 1e6,
            "p95_ms": top.p95_ms,
            "errors": top.errors,
            "others_cores": top.others_cores,
            "first_failing": asdict(ramp[-1]) if not ramp[-1].passed else None,
        }
        # What the rest of the machine used: the median over the ramp, not the one row's (it swings 0.3-1.6 cores).
        others = statistics.median(r.others_cores for r in ramp)
        rep["others_for_plan"] = others
        predicted = {n: predict_host(a, n, cpu_s, client_s, others) for n in counts}
        best: dict[int, float] = {}
        failed: set[int] = set()
        # The listed factors, then on in --extend-step steps to --max-factor while any configuration passes:
        # a ceiling is where a configuration first fails, not where the grid ran out.
        grid = list(factors)
        while grid[-1] + a.extend_step <= a.max_factor + 1e-9:
            grid.append(round(grid[-1] + a.extend_step, 6))
        for f in grid:
            if len(failed) == len(counts):
                break
            for n in counts:
                if n in failed or stopping:
                    continue
                rate = f * predicted[n][0]
                row = run_row(started[n].base, started[n].pid, n, f, rate, predicted[n][0], a)
                rep["rows"].append(asdict(row))
                print(
                    f"{n} proc x{f:g}: {rate:.0f} offered, p95 {row.p95_ms:.1f} ms, errors {row.errors}, "
                    f"server {row.server_cores:.2f} cores, client {row.client_cores:.2f}, others "
                    f"{row.others_cores:.2f}: {'pass' if row.passed else 'FAIL'}",
                    flush=True,
                )
                if row.passed:
                    best[n] = rate
                else:
                    failed.add(n)
        rep["ceilings"] = [
            {
                "processes": n,
                "predicted": predicted[n][0],
                "cores": predicted[n][1],
                "measured": best.get(n, 0.0),
                "failed": n in failed,
            }
            for n in counts
        ]
    prices = Prices(a.gpu_cost_per_hour, a.node_cost_per_hour)
    cpu = rep.get("probe", {}).get("server_us_per_req")
    if cpu:
        for procs in (1, 2):
            c = Contract(
                BatchTime.constant(a.plan_batch_ms),
                devices=a.plan_devices,
                max_batch=a.max_batch_size,
                slo_s=a.slo_ms / 1000,
                cpu_s_per_request=cpu / 1e6,
                processes=procs,
            )
            plan = make_plan(a.plan_rate, c, prices=prices)
            rep["plans"].append(
                f"$ batchserve plan --rate {a.plan_rate:g} --batch-ms {a.plan_batch_ms:g} "
                f"--devices {a.plan_devices} --processes {procs} --cpu-us-per-request {cpu:.0f} "
                f"--gpu-cost-per-hour {a.gpu_cost_per_hour:g} --node-cost-per-hour "
                f"{a.node_cost_per_hour:g}\n" + render(plan, "given")
            )
    md = markdown(rep) if "probe" in rep else json.dumps(rep, indent=1, default=str)
    print(md)
    print("\n" + report.written(report.write(name, rep, md, common.out_dir(a)), log_dir))
    return 0 if "error" not in rep and "interrupted" not in rep else 1


if __name__ == "__main__":
    sys.exit(main())
