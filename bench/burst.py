"""A burst rides one batch: locust's closed-loop users beside open-loop Poisson, this checkout beside a base.

    python -m bench.burst --base /work/wt/base            # about 6 minutes on this machine
    python -m bench.burst --base DIR --record             # into bench/results/burst-<time>.{md,json}

One sim device (100 ms batches of up to 100, the default SLO) unless a row says otherwise, a fresh server per
row, each commit's rows run in turns:

- closed loop: the shipped locustfile's InferenceUser, every user spawned at once (`-r 1000`) and paced at `pace`
  requests/s each (users x pace = the offered rate), as locust users run; locust's own p50 / p95 beside the
  server's `latency_ms` (the locustfile's `server` rows), and the refusals (503s, its `refused` rows) and failures;
- open loop: `bench.loadgen`'s Poisson arrivals at each rate, and at 4 devices, p50 / p95 and errors.

`--closed 300x3` / `--open 1x900` run only the rows named (`--open none`: no open-loop row); `--burst-off` runs
this checkout a second time with the burst rule off (commit "off": `core/batch_hold.py`'s BURSTY_SHARE set past 1 as
the server starts), so both are measured in the same run on the same busy machine. Each closed-loop row reports
too what the server's door learned (its /metrics at the row's end): the queue wait it predicted and observed for
requests admitted under pressure, the factor and margin it applies, and its batches by cause.

Goals (issue 47): closed loop at 10 and 180 req/s the server's p50 <= 115 ms and p95 <= 130 ms; at 0.9x capacity
0 refusals and p95 <= 230 ms; open loop within 3 ms of the base at p95, no new errors. `--record` refuses a busy
machine (1-minute load average >= --max-load).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import common, report, servers
from bench.loadgen import measure

LOCUSTFILE = servers.REPO / "bench" / "locustfile.py"
CLOSED = ((10, 1.0), (60, 3.0), (300, 3.0))  # (users, requests/s each): 10, 180 and 900 req/s (0.9x of 1,000/s)
OPEN = ((1, 10.0), (1, 180.0), (1, 450.0), (1, 900.0), (1, 950.0), (4, 1800.0))  # (devices, req/s): one client


BURST_OFF = "off"  # the commit name of this checkout run with the burst rule off (`--burst-off`)


def server_cmd(devices: int, base: str) -> list[str]:
    """The server of a row: this checkout (base ""), this checkout with the burst rule off (BURST_OFF), or
    another checkout's batchserve (base: its directory)."""
    cmd = servers.batchserve_cmd(devices, 100.0, 100, [])
    if not base:
        return cmd
    if base == BURST_OFF:  # never bursty: `Bursts.until` holds nothing
        pre = "import batchserve.core.batch_hold as b; b.BURSTY_SHARE = 2.0; "
    else:
        pre = f"sys.path.insert(0, {str(Path(base).resolve())!r}); "
    boot = f"import runpy, sys; {pre}runpy.run_module('batchserve', run_name='__main__', alter_sys=True)"
    return [cmd[0], "-c", boot, *cmd[3:]]


def door_figures(url: str) -> dict[str, float]:
    """What the server's door learned by now (/metrics): the queue waits predicted and observed for requests
    admitted under pressure (s, summed), their count, the factor and margin (ms) it applies, its refusals and
    its batches by cause (`batches_<cause>`)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    names = {
        "batchserve_admission_predicted_wait_seconds_total": "predicted_wait_s",
        "batchserve_admission_actual_wait_seconds_total": "actual_wait_s",
        "batchserve_admission_calibrated_requests_total": "calibrated",
        "batchserve_admission_wait_factor": "factor",
        "batchserve_admission_wait_margin_seconds": "margin_ms",
    }
    got: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        bare = name.split("{", 1)[0]
        if bare in names:
            key = names[bare]
            got[key] = got.get(key, 0.0) + float(value) * (1000.0 if key == "margin_ms" else 1.0)
        elif bare == "batchserve_batches_total" and 'cause="' in name:
            key = "batches_" + name.split('cause="', 1)[1].split('"', 1)[0]
            got[key] = got.get(key, 0.0) + float(value)
    return got


def pick(rows: tuple[tuple[int, float], ...], asked: list[str] | None) -> list[tuple[int, float]]:
    """The rows named by `--closed` / `--open` (`AxB`: users x pace, or devices x rate; `none`), else all."""
    if asked is None:
        return list(rows)
    want = {a for arg in asked for a in arg.split(",") if a and a != "none"}
    known = {f"{a}x{b:g}": (a, b) for a, b in rows}
    unknown = want - set(known)
    if unknown:
        sys.exit(f"no such row: {', '.join(sorted(unknown))} (rows: {', '.join(known)})")
    return [row for name, row in known.items() if name in want]


def closed_loop(url: str, users: int, pace: float, seconds: float, work: Path, processes: int = 0) -> dict[str, float]:
    """One locust run (`processes`: locust's --processes, its users split over that many worker processes); its
    client and server rows from the stats CSV."""
    prefix = work / f"locust-{users}x{pace:g}"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", "1000",
        "-t", f"{seconds:g}s", "-H", url, "--csv", str(prefix), "--only-summary", "--bs-pace", f"{pace:g}",
        "--bs-surfaces", "inference", *(["--processes", str(processes)] if processes else []), "InferenceUser",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=servers.REPO, capture_output=True, text=True, timeout=seconds + 60, check=False)
    rows = {row["Name"]: row for row in csv.DictReader(open(f"{prefix}_stats.csv"))}
    client, server = rows.get("/v1/inference", {}), rows.get("latency_ms /v1/inference", {})
    refused = sum(int(r["Request Count"]) for name, r in rows.items() if "refused" in name)

    def num(row: dict, key: str) -> float:
        return float(row.get(key) or "nan")

    return {
        "offered": users * pace,
        "answered": num(client, "Request Count"),
        "locust_p50": num(client, "50%"),
        "locust_p95": num(client, "95%"),
        "server_p50": num(server, "50%"),
        "server_p95": num(server, "95%"),
        "failures": num(client, "Failure Count"),
        "refused": float(refused),
    }


def run(a: argparse.Namespace) -> dict:
    commits = {"this": ""} | ({BURST_OFF: BURST_OFF} if a.burst_off else {}) | ({"base": a.base} if a.base else {})
    rep: dict = {"provenance": report.provenance(), "settings": vars(a) | {"out_dir": str(a.out_dir)}, "closed": [],
                 "open": []}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="burst-"))
    logs = common.log_dir(a, "burst")
    with common.guarded(rep):
        for users, pace in pick(CLOSED, a.closed):
            for name, base in commits.items():
                server = servers.start(f"{name}-closed-{users}", server_cmd(1, base), logs)
                try:
                    row = closed_loop(server.base, users, pace, a.duration, work, a.locust_processes)
                    door = door_figures(server.base)
                finally:
                    servers.stop(server)
                rep["closed"].append({"commit": name, "users": users, "pace": pace, **row, "door": door})
                print(f"closed {name} {users}x{pace:g}: {row}", file=sys.stderr)
        for devices, rate in pick(OPEN, a.open):
            for name, base in commits.items():
                server = servers.start(f"{name}-open-{devices}-{rate:g}", server_cmd(devices, base), logs)
                try:
                    r = measure(server.base, rate, a.duration, a.warmup, a.seed, server_pid=server.pid)
                finally:
                    servers.stop(server)
                row = {"commit": name, "devices": devices, "rate": rate, "p50": r.p50_ms, "p95": r.p95_ms,
                       "errors": sum(r.errors.values()), "answered": r.ok}  # fmt: skip
                rep["open"].append(row)
                print(f"open {name} {devices} dev {rate:g}/s: {row}", file=sys.stderr)
    rep["machine_load_end"] = list(os.getloadavg())
    return rep


def markdown(rep: dict) -> str:
    closed = report.table(
        ["commit", "users x pace", "offered/s", "answered", "locust p50", "locust p95", "server p50", "server p95",
         "refused", "failures"],
        [[r["commit"], f"{r['users']} x {r['pace']:g}", r["offered"], r["answered"], r["locust_p50"],
          r["locust_p95"], r["server_p50"], r["server_p95"], r["refused"], r["failures"]] for r in rep["closed"]],
    )  # fmt: skip
    causes = sorted({k for r in rep["closed"] for k in r.get("door", {}) if k.startswith("batches_")})
    door = report.table(
        ["commit", "users x pace", "calibrated", "predicted wait s", "observed wait s", "factor", "margin ms",
         *(c.removeprefix("batches_") for c in causes)],
        [[r["commit"], f"{r['users']} x {r['pace']:g}", *(r.get("door", {}).get(k, 0.0) for k in
          ("calibrated", "predicted_wait_s", "actual_wait_s", "factor", "margin_ms", *causes))] for r in rep["closed"]],
    )  # fmt: skip
    opened = report.table(
        ["commit", "devices", "rate/s", "answered", "p50 ms", "p95 ms", "errors"],
        [[r["commit"], r["devices"], r["rate"], r["answered"], r["p50"], r["p95"], r["errors"]] for r in rep["open"]],
    )
    load = rep["provenance"]["machine"]["loadavg_at_start"]
    n = rep["settings"].get("locust_processes") or 0
    procs = f"locust --processes {n}" if n else "one locust process"
    return (
        f"# A burst rides one batch ({rep['provenance']['git']['commit'][:8]}, load at start {load})\n\n"
        f"Closed loop (locust, users spawned at once, {procs}), one sim device:\n\n{closed}\n\n"
        f"What the door learned under pressure by each closed-loop row's end, and its batches by cause:\n\n{door}\n\n"
        f"Open loop (bench.loadgen, Poisson):\n\n{opened}\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="", help="another checkout: its batchserve runs every row too")
    p.add_argument("--duration", type=float, default=20.0, help="seconds a row (default %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0, help="open loop: seconds before the measured window")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--closed", action="append", help="closed-loop rows to run, e.g. 300x3 (repeat or comma-separate)")
    p.add_argument("--open", action="append", help="open-loop rows to run, e.g. 1x900 or 4x1800; none: no row")
    p.add_argument(
        "--locust-processes",
        type=int,
        default=0,
        help="closed loop: locust --processes (one process sends a 60-user burst over ~40 ms of its own CPU here)",
    )
    p.add_argument("--burst-off", action="store_true", help="also run this checkout with the burst rule off")
    p.add_argument("--max-load", type=float, default=1.5, help="--record refuses to start at this load or more")
    common.add_output_flags(p)
    a = p.parse_args()
    if a.record and os.getloadavg()[0] >= a.max_load:
        sys.exit(f"the machine is busy (load {os.getloadavg()[0]:.2f} >= {a.max_load}): not a result to record")
    rep = run(a)
    md = markdown(rep)
    print(md)
    print(report.written(report.write(common.run_name(a, "burst"), rep, md, common.out_dir(a))))


if __name__ == "__main__":
    main()
