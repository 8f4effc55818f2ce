"""Batch jobs from spare capacity (issue 5), in one command:

    python -m bench.jobs_bench                                  # 5 s warm-up + 20 s window, twice: ~1 minute
    python -m bench.jobs_bench --duration 5 --warmup 2 --job-items 5000 --tag smoke   # a quick check

One sim device, 100 ms batches of up to 100 (1,000 items/s of capacity). Interactive open-loop Poisson load at
500 RPS (`bench.loadgen`: latency from the scheduled send time) runs twice on a fresh server each time: once
alone, once with a 20,000-item batch job submitted as the measured window opens. The interactive p95 of the two
runs must be within 10 ms of each other; the job should take close to the ~500 items/s the interactive load
leaves idle. The job's throughput is its completed count (GET /v1/batches/{id}) over the window, and every
completed output is checked (each the input reversed). Markdown and JSON, with machine, commit and settings,
go to `bench/results/jobs-<time>[-tag].{md,json}`. Servers are stopped by PID on success, error or Ctrl-C.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/jobs_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime as dt
import json
import math
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from bench import common, report, servers
from bench.loadgen import START_DELAY_S, LoadResult, measure
from bench.report import git_info, machine_info
from bench.schedule import row_seed

P95_SLACK_MS = 10.0
POLL_S = 0.5


@dataclass
class JobRun:
    items: int
    http_status: int = 0
    submit_ms: float = math.nan  # POST /v1/batches round trip: every item committed before the answer
    job_id: str = ""
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s since submit, completed)
    completed: int = 0  # by the end of the window
    failed: int = 0
    elapsed_s: float = math.nan  # submit to the end of the window
    items_per_s: float = math.nan
    steady_items_per_s: float = math.nan  # from 1 s after the submit to the window's end (no ramp-up)
    outputs_checked: int = 0
    mismatches: int = 0
    error: str = ""


@dataclass
class Scenario:
    name: str
    load: LoadResult
    job: JobRun | None
    loadavg_before: float


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def job_inputs(n: int) -> list[str]:
    return [f"job-{i:06d}-batchserve" for i in range(n)]


def drive_job(base: str, run: JobRun, start_at: float, end_at: float) -> None:
    """Submit the job when the window opens, then follow its progress to the window's end."""
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        body = json.dumps({"inputs": job_inputs(run.items), "metadata": {"bench": "jobs"}}).encode()
        sent = time.monotonic()
        run.http_status, raw = http("POST", base + "/v1/batches", body)
        submitted = time.monotonic()
        run.submit_ms = (submitted - sent) * 1000
        if run.http_status != 202:
            run.error = raw.decode(errors="replace")[:300]
            return
        run.job_id = json.loads(raw)["id"]
        while True:
            now = time.monotonic()
            _, raw = http("GET", f"{base}/v1/batches/{run.job_id}")
            job = json.loads(raw)
            run.samples.append((round(now - sent, 3), job["completed"]))
            run.completed, run.failed, run.elapsed_s = job["completed"], job["failed"], now - sent
            if now >= end_at or job["status"] not in ("queued", "running"):
                break
            time.sleep(min(POLL_S, max(0.0, end_at - now)))
        run.items_per_s = run.completed / run.elapsed_s if run.elapsed_s > 0 else math.nan
        steady = [(t, n) for t, n in run.samples if t >= 1.0]
        if len(steady) >= 2 and steady[-1][0] > steady[0][0]:
            run.steady_items_per_s = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
    except Exception as exc:  # noqa: BLE001 - reported in the results, the load run goes on
        run.error = f"{type(exc).__name__}: {exc}"


def check_outputs(base: str, run: JobRun) -> None:
    inputs = job_inputs(run.items)
    _, raw = http("GET", f"{base}/v1/batches/{run.job_id}/results")
    for line in raw.splitlines():
        item = json.loads(line)
        if item["status"] == "completed":
            run.outputs_checked += 1
            run.mismatches += item["output"] != inputs[item["index"]][::-1]


def run_scenario(name: str, with_job: bool, a: argparse.Namespace, log_dir: Path) -> Scenario:
    db_dir = tempfile.mkdtemp(prefix="batchserve-jobs-bench-")
    loadavg = os.getloadavg()[0]
    extra = ["--jobs-db", os.path.join(db_dir, "jobs.db"), *a.server_arg]
    server = servers.start(name, servers.batchserve_cmd(1, a.sim_batch_ms, a.max_batch_size, extra), log_dir)
    job = JobRun(a.job_items) if with_job else None
    try:
        driver = None
        if job is not None:
            window_open = time.monotonic() + START_DELAY_S + a.warmup
            driver = threading.Thread(
                target=drive_job, args=(server.base, job, window_open, window_open + a.duration), daemon=True
            )
            driver.start()
        load = measure(
            server.base,
            a.rate,
            a.duration,
            a.warmup,
            row_seed(a.seed, 1, a.rate),
            server_pid=server.pid,
            timeout_s=a.timeout,
            procs=a.procs,
        )
        if driver is not None and job is not None:
            driver.join(timeout=a.duration + 60)
            if job.job_id:
                check_outputs(server.base, job)
                http("POST", f"{server.base}/v1/batches/{job.job_id}/cancel")
    finally:
        servers.stop(server)
        shutil.rmtree(db_dir, ignore_errors=True)
    return Scenario(name, load, job, loadavg)


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(report: dict, scenarios: list[Scenario]) -> str:
    s, m, g = report["settings"], report["machine"], report["git"]
    lines = [
        f"# Batch jobs from spare capacity — {report['timestamp']}",
        "",
        f"1 sim device, {s['sim_batch_ms']:g} ms batches of up to {s['max_batch_size']}; interactive open-loop "
        f"Poisson {s['rate']:g} RPS, {s['warmup']:g} s warm-up + {s['duration']:g} s window; job of "
        f"{s['job_items']} items submitted as the window opens. Client procs {s['procs']}.",
        f"Machine: {m['cpu_model']}, {m['cores_usable']} usable cores, Python {m['python']}; load average at start "
        f"{m['loadavg_at_start']}. Commit {g['commit'][:12]}{' (dirty)' if g['dirty'] else ''}.",
        "",
        "| run | achieved RPS | p50 ms | p95 ms | p99 ms | errors | mean batch | batches/s | job items/s (steady) "
        "| job submit ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sc in scenarios:
        r, j = sc.load, sc.job
        job = (
            f"{fmt(j.items_per_s, '.0f')} ({fmt(j.steady_items_per_s, '.0f')}) | {fmt(j.submit_ms, '.0f')}"
            if j
            else "n/a | n/a"
        )
        lines.append(
            f"| {sc.name} | {r.achieved_rps:.0f} | {fmt(r.p50_ms)} | {fmt(r.p95_ms)} | {fmt(r.p99_ms)} | "
            f"{r.error_count} | {fmt(r.mean_batch)} | {fmt(r.batches_per_s)} | {job} |"
        )
    v = report["verdict"]
    lines += [
        "",
        f"- interactive p95 with the job − without: **{fmt(v['p95_delta_ms'])} ms** (goal ≤ "
        f"{P95_SLACK_MS:g} ms): {'met' if v['p95_met'] else 'MISSED'}",
        f"- job throughput: **{fmt(v['job_items_per_s'], '.0f')} items/s** of the ~{v['idle_capacity']:.0f} "
        f"items/s the interactive load leaves idle ({fmt(v['share_of_idle'] * 100, '.0f')}%); "
        f"{fmt(v['job_steady_items_per_s'], '.0f')} items/s once running (from 1 s after the submit)",
        f"- job outputs checked: {v['outputs_checked']}, wrong: {v['mismatches']}; interactive errors: "
        f"{v['interactive_errors']}",
    ]
    if report.get("notes"):
        lines += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500.0, help="interactive requests per second")
    p.add_argument("--job-items", type=int, default=20000)
    common.add_load_flags(p, procs=True)
    common.add_sim_flags(p, slo_ms=None)
    common.add_output_flags(p, tag=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "jobs")
    log_dir = common.log_dir(a, name)
    rep: dict = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_info(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "server_log_dir": str(log_dir),
    }
    scenarios: list[Scenario] = []
    with common.guarded(rep):
        for label, with_job in (("interactive only", False), ("interactive + job", True)):
            print(f"-- {label}: {a.rate:g} RPS, {a.warmup:g} s warm-up + {a.duration:g} s ...", flush=True)
            scenarios.append(run_scenario(label.replace(" ", "-").replace("+", "plus"), with_job, a, log_dir))
            sc = scenarios[-1]
            print(
                f"   p95 {fmt(sc.load.p95_ms)} ms, errors {sc.load.error_count}, mean batch "
                f"{fmt(sc.load.mean_batch)}"
                + (
                    f", job {fmt(sc.job.items_per_s, '.0f')} items/s{' ' + sc.job.error if sc.job.error else ''}"
                    if sc.job
                    else ""
                ),
                flush=True,
            )
            time.sleep(0.5)
    if len(scenarios) < 2:
        return 1
    base, loaded = scenarios
    job = loaded.job
    assert job is not None
    idle = a.max_batch_size * 1000 / a.sim_batch_ms - a.rate
    delta = loaded.load.p95_ms - base.load.p95_ms
    rep["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    rep["verdict"] = {
        "p95_without_ms": base.load.p95_ms,
        "p95_with_ms": loaded.load.p95_ms,
        "p95_delta_ms": delta,
        "p95_met": delta <= P95_SLACK_MS,
        "job_items_per_s": job.items_per_s,
        "job_steady_items_per_s": job.steady_items_per_s,
        "idle_capacity": idle,
        "share_of_idle": job.items_per_s / idle if idle > 0 else math.nan,
        "outputs_checked": job.outputs_checked,
        "mismatches": job.mismatches,
        "interactive_errors": base.load.error_count + loaded.load.error_count,
    }
    rep["notes"] = [
        n
        for n in (
            job.error and f"job: {job.error}",
            max(s.loadavg_before for s in scenarios) > 0.5
            and "the machine was not idle before a run (load average > 0.5): shared cores "
            "add latency to both runs alike, but noisily",
        )
        if n
    ]
    rep["scenarios"] = [asdict(s) for s in scenarios]
    md = markdown(rep, scenarios)
    print()
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a)), log_dir))
    return 0 if rep["verdict"]["p95_met"] and not job.mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
