"""The shipped locustfile (bench/locustfile.py) against a server this command starts, over a ramp past capacity.

    python -m bench.locust --backend sim --users 300 --run-time 60s    # the table per stage
    python -m bench.locust --record                                    # and bench/results/locust-<time>.*
    python -m bench.locust --backend minilm --classes EmbeddingsUser --capacity 120

It starts `batchserve serve` (the sim by default; --server-arg passes any flag), with three keyed tenants on the
enterprise, paid and free tiers, waits for /readyz, and runs locust headless (a subprocess, `--processes` when
asked) over --stages equal stages of users up to --users, paced so the last stage offers --peak x capacity
(capacity: the sim's devices x max batch / batch time, else --capacity, else `batchserve plan --measure`). It
then reads the server's ledger (GET /v1/usage, `batchserve_slo_requests_total` from /metrics) and stops the
server by its PID. Each stage's row comes from locust's history CSV (one row a second): rates are the change of
its counts over the seconds the stage held its users, percentiles locust's own over the last 10 s of the stage
(so keep stages longer than ~12 s). With --record (or --out DIR) locust's CSV and HTML report are kept beside
the markdown and JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from batchserve.config_file import append_key
from batchserve.http.guards import digest, new_key
from bench import common, report, servers
from bench.ledger_drill import OUTCOMES, Tenant, by_outcome, ledger_of, write_keys

LOCUSTFILE = servers.REPO / "bench" / "locustfile.py"
EXTRA_TYPES = ("server", "job", "chat")  # the locustfile's extra events: not HTTP requests
ROUTES = {
    "InferenceUser": "/v1/inference",
    "EmbeddingsUser": "/v1/embeddings",
    "ChatUser": "/v1/chat/completions",
    "RerankUser": "/v1/rerank",
    "KServeUser": "/v2/models/{name}/infer",
    "BatchJobUser": "/v1/batches",
}


def stage_plan(users: int, stages: int, seconds: float) -> list[tuple[int, float]]:
    return [(max(1, round(users * (i + 1) / stages)), seconds / stages) for i in range(stages)]


def seconds_of(text: str) -> float:
    """locust's run time: 60, 60s, 2m, 1h30m."""
    total, number = 0.0, ""
    for ch in text.strip():
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total += float(number) * {"s": 1, "m": 60, "h": 3600}[ch]
            number = ""
    return total + float(number or 0)


def planned_capacity(base: str, max_batch: int) -> float:
    """`batchserve plan --measure`: the node's capacity at the SLO from the live server's figures."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchserve",
            "plan",
            "--rate",
            "1",
            "--measure",
            base,
            "--max-batch",
            str(max_batch),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=servers.REPO,
        check=True,
    ).stdout
    return float(json.loads(out)["capacity"])


def stage_rows(history: Path, plan: list[tuple[int, float]], pace: float, route: str) -> list[dict]:
    """Per stage: the seconds locust held its users, what was sent, answered, refused and failed a second, the
    client's p50/p95 of `route` and the server's `latency_ms` over the stage's last 10 s."""
    rows = list(csv.DictReader(history.open()))
    out = []
    for users, _ in plan:
        held = [r for r in rows if r["User Count"] == str(users)]
        stamps = sorted({r["Timestamp"] for r in held})
        row: dict = {"users": users, "offered": users * pace}
        if len(stamps) >= 2:
            first = [r for r in held if r["Timestamp"] == stamps[0]]
            last = [r for r in held if r["Timestamp"] == stamps[-1]]
            row.update(stage_figures(first, last, float(stamps[-1]) - float(stamps[0]), route))
        out.append(row)
    return out


def stage_figures(first: list[dict], last: list[dict], seconds: float, route: str) -> dict:
    def http(r: dict) -> bool:
        return r["Type"] not in EXTRA_TYPES and r["Name"] != "Aggregated"

    def refused(r: dict) -> bool:
        return http(r) and " refused " in r["Name"]

    def change(keep: Callable[[dict], bool], column: str) -> float:
        return (sum(int(r[column]) for r in last if keep(r)) - sum(int(r[column]) for r in first if keep(r))) / seconds

    def at_end(name: str) -> dict:
        return next((r for r in last if r["Name"] == name), {})

    sent, failed = change(http, "Total Request Count"), change(http, "Total Failure Count")
    refusals = change(refused, "Total Request Count")
    client, server = at_end(route), at_end(f"latency_ms {route}")
    return {
        "seconds": seconds,
        "sent": sent,
        "answered": sent - failed - refusals,
        "refused": refusals,
        "failed": failed,
        "p50": _num(client.get("50%")),
        "p95": _num(client.get("95%")),
        "server_p50": _num(server.get("50%")),
        "server_p95": _num(server.get("95%")),
    }


def _num(value: str | None) -> float | None:
    return float(value) if value not in (None, "", "N/A") else None


def get(url: str, key: str) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read()


def markdown(rep: dict) -> str:
    a, m = rep["settings"], rep["machine"]
    header = [
        "users",
        "offered /s",
        "sent /s",
        "answered /s",
        "locust p50 ms",
        "locust p95 ms",
        "server latency_ms p50",
        "server latency_ms p95",
        "failures /s",
        "refusals /s",
    ]
    rows = [
        [
            s["users"],
            s["offered"],
            s.get("sent"),
            s.get("answered"),
            s.get("p50"),
            s.get("p95"),
            s.get("server_p50"),
            s.get("server_p95"),
            s.get("failed"),
            s.get("refused"),
        ]
        for s in rep["stages"]
    ]
    tiers = "; ".join(
        f"{tier}: " + ", ".join(f"{o} {n}" for o, n in counts.items() if n)
        for tier, counts in rep["ledger_by_tier"].items()
    )
    lines = [
        f"# locust against batchserve ({a['backend']}): {a['users']} users, {a['run_time_s']:g} s",
        "",
        f"{a['classes'] or 'the served classes'} at {a['pace']:.3g} requests/s a user (users x pace = offered), "
        f"{a['stages']} stages to {a['peak']:g} x a capacity of {a['capacity']:.0f}/s ({a['capacity_from']}); "
        f"tenants {', '.join(f'{t} ({tier})' for t, tier in a['tenants'])}, keys dealt to users in turn. "
        f"Locust exit status {rep['locust_exit']}. Client and server share the machine "
        f"({m['cores_usable']} usable cores, load average {rep['loadavg_before']} before, {rep['loadavg_after']} "
        f"after); commit {rep['git']['commit'][:12]}.",
        "",
        report.table(header, rows),
        "",
        "Rates: the change of locust's counts over the seconds each stage held its users; percentiles: locust's "
        f"over the stage's last 10 s, of {a['route']} (client) and of the server's own latency_ms. A refusal is "
        "a 503/429 with retry_after_ms while the load is past capacity (bench/locustfile.py's rule); a refusal "
        "below it counts as a failure.",
        "",
        f"The server's SLO ledger (batchserve_slo_requests_total) by tier: {tiers or 'empty'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="sim", help="the server's --backend (default %(default)s)")
    p.add_argument("--users", type=int, default=300, help="users in the last stage (default %(default)s)")
    p.add_argument("--run-time", default="60s", help="the whole plan, locust's notation (default %(default)s)")
    p.add_argument("--stages", type=int, default=4, help="equal stages of users up to --users")
    p.add_argument("--peak", type=float, default=1.5, help="the last stage's offered rate over capacity")
    p.add_argument("--capacity", type=float, default=0.0, help="requests/s the server serves (0: sim's or planned)")
    p.add_argument("--pace", type=float, default=0.0, help="requests/s a user (0: peak x capacity / users)")
    p.add_argument(
        "--classes",
        default="InferenceUser",
        help="locust user classes, comma-separated, or 'auto': those the server serves",
    )
    p.add_argument("--processes", type=int, default=0, help="locust --processes (past ~4k requests/s a core)")
    p.add_argument("--devices", type=int, default=1)
    common.add_sim_flags(p, max_batch_size=20, slo_ms=None)
    common.add_output_flags(p, name="locust")
    a = p.parse_args(argv)
    run_s = seconds_of(a.run_time)
    name = common.run_name(a, "locust")
    where = common.out_dir(a)
    tenants = [
        Tenant("acme", "enterprise", 0, key_rate=1e6),
        Tenant("globex", "paid", 0, key_rate=1e6),
        Tenant("initech", "free", 0, key_rate=1e6),
    ]
    admin = Tenant("bench-admin", "paid", 0)
    classes = [] if a.classes == "auto" else [c.strip() for c in a.classes.split(",") if c.strip()]
    rep: dict = {**report.provenance(), "loadavg_before": round(os.getloadavg()[0], 2)}
    work = Path(tempfile.mkdtemp(prefix="bench-locust-"))
    locust_exit = None
    try:
        with common.guarded(rep):
            config = work / "keys.toml"
            write_keys(config, tenants)
            admin.key = new_key()
            append_key(str(config), admin.name, admin.tier, digest(admin.key), None, admin=True)  # reads every tenant
            own = ["--config", str(config), "--jobs-db", str(work / "jobs.db"), *a.server_arg]
            if a.backend == "sim":
                cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, a.max_batch_size, own)
            else:
                cmd = servers.serve_cmd(
                    a.backend,
                    *own,
                )
            server = servers.start("batchserve", cmd, common.log_dir(a, name), timeout_s=600)
            if a.capacity:
                capacity, source = a.capacity, "given"
            elif a.backend == "sim":
                capacity, source = a.devices * a.max_batch_size / (a.sim_batch_ms / 1000), "the sim's settings"
            else:
                capacity, source = planned_capacity(server.base, a.max_batch_size), "batchserve plan --measure"
            pace = a.pace or a.peak * capacity / a.users
            plan = stage_plan(a.users, a.stages, run_s)
            prefix = work / name
            env = {
                **os.environ,
                "BATCHSERVE_LOCUST_STAGES": ",".join(f"{u}:{s:g}" for u, s in plan),
                "BATCHSERVE_LOCUST_KEYS": ",".join(t.key for t in tenants),
                "BATCHSERVE_LOCUST_PACE": f"{pace:g}",
                "BATCHSERVE_LOCUST_CAPACITY": f"{capacity:g}",
            }
            locust = [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(LOCUSTFILE),
                "--headless",
                "-H",
                server.base,
                "--csv",
                str(prefix),
                "--csv-full-history",
                "--html",
                f"{prefix}.html",
                "--only-summary",
                *(["--processes", str(a.processes)] if a.processes else []),
                *classes,
            ]
            print(
                f"locust: {len(plan)} stages of {plan[0][1]:g} s up to {a.users} users at {pace:.3g}/s each "
                f"(capacity {capacity:.0f}/s, {source})",
                flush=True,
            )
            with open(work / "locust.log", "wb") as log:
                locust_exit = subprocess.run(
                    locust,
                    cwd=servers.REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=run_s + 120,
                    check=False,
                ).returncode
            usage = json.loads(get(server.base + "/v1/usage?window_s=3600", admin.key))["data"]
            ledger = ledger_of(get(server.base + "/metrics", admin.key).decode())
        rep["loadavg_after"] = round(os.getloadavg()[0], 2)
        if locust_exit is None:
            return 1
        route = ROUTES.get(classes[0], "/v1/inference") if classes else "/v1/inference"
        rep.update(
            {
                "locust_exit": locust_exit,
                "stages": stage_rows(Path(f"{prefix}_stats_history.csv"), plan, pace, route),
                "usage": usage,
                "ledger_by_tier": {t: by_outcome(ledger, t) for t in sorted({k[1] for k in ledger})},
                "ledger": by_outcome(ledger),
                "outcomes": list(OUTCOMES),
                "settings": {
                    "backend": a.backend,
                    "users": a.users,
                    "run_time_s": run_s,
                    "stages": a.stages,
                    "peak": a.peak,
                    "capacity": capacity,
                    "capacity_from": source,
                    "pace": pace,
                    "classes": ",".join(classes),
                    "route": route,
                    "processes": a.processes,
                    "devices": a.devices,
                    "sim_batch_ms": a.sim_batch_ms,
                    "max_batch_size": a.max_batch_size,
                    "server_args": a.server_arg,
                    "tenants": [(t.name, t.tier) for t in tenants],
                },
            }
        )
        md = markdown(rep)
        print(md)
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
            for f in work.glob(f"{name}*"):
                shutil.copy(f, where / f.name)
            shutil.copy(work / "locust.log", where / f"{name}-locust.log")
        print(report.written(report.write(name, rep, md, where)))
        return 0 if locust_exit in (0, 1) else locust_exit
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
