"""The reliability drill (issue 3), in one command:

    python -m bench.drill                         # the full drill: 1500 RPS for 30 s on 4 sim devices
    python -m bench.drill --rate 300 --duration 12 --hang-at 4 --signal-at 10    # a short smoke run

It starts `batchserve serve --devices 4 --sim-batch-ms 100 --sim-fail-marker POISON --sim-hang-marker HANG
--sim-hang-ms 60000`, sends open-loop Poisson load (`bench.faultload`; latency from the scheduled send time)
with one POISON input in every 500 requests and one HANG input at `--hang-at`, sends SIGTERM at
`--signal-at` while the load goes on (to see 503 DRAINING), and reports against the goals:

- requests left without an answer (timeouts, dropped connections of requests sent before the process
  exited): goal 0. Requests that could not connect because the process had already exited are counted apart;
- p95 before and after the hang;
- every non-200 by status + error code and by phase (before the hang, after it, after the signal), with
  which of them the goals expect (the poisons' 500s, the HANG input's own answer, DRAINING after the signal);
- when the hung batch's items were answered, relative to the HANG request (goal: within gpu_timeout + one
  batch of its batch's start, i.e. gpu_timeout + slo of its arrival, since a batch leaves within the slo);
- 503 DRAINING only after the signal.

Results (markdown + JSON with machine, git commit and settings, and the server log) are printed, and written to
bench/results/ with `--record` (or to DIR with `--out DIR`).
The server is stopped by PID whatever happens.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/drill.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime as dt
import json
import re
import secrets
import signal
import urllib.request
from collections import Counter

import numpy as np

from bench import common, report, servers
from bench.faultload import Records, Run, run, signal_event
from bench.report import fmt, pct, table
from bench.schedule import poisson_schedule

POISON, HANG = "POISON", "HANG"
PHASES = ("before hang", "after hang", "after signal")


def plan(
    rate: float, duration: float, seed: int, poison_every: int, hang_at: float
) -> tuple[np.ndarray, list[str], list[str]]:
    """The schedule and every request's input: distinct, non-palindromic, with the planted faults."""
    sched = poisson_schedule(rate, duration, seed)
    tag = secrets.token_hex(3)
    inputs, kinds = [], []
    hang_index = int(np.searchsorted(sched, hang_at)) if hang_at < duration else -1
    for i in range(len(sched)):
        text, kind = f"{tag}-{i:06d}-drill→", "normal"
        if i == hang_index:
            text, kind = f"{text}-{HANG}", "hang"
        elif poison_every and i % poison_every == poison_every // 2:
            text, kind = f"{text}-{POISON}", "poison"
        inputs.append(text)
        kinds.append(kind)
    return sched, inputs, kinds


def server_facts(base: str) -> dict:
    """gpu_timeout and the learned batch time, as the server states them before the load."""
    with urllib.request.urlopen(base + "/internal/health", timeout=5) as resp:
        h = json.loads(resp.read())
    return {
        "gpu_timeout_ms": h.get("gpu_timeout_ms"),
        "batch_ms": h.get("batch_ms"),
        "workers": len(h.get("workers", [])),
    }


# -- analysis -------------------------------------------------------------------------------------------------
def phase_of(t: float, hang_at: float, signal_at: float) -> str:
    return PHASES[0] if t < hang_at else PHASES[1] if t < signal_at else PHASES[2]


def outcome(r: Records, i: int) -> str:
    """'200', '500 INFERENCE_FAILED', '200 WRONG OUTPUT' or 'no answer: client_timeout' ..."""
    if not r.status[i]:
        return f"no answer: {r.failure[i] or 'unknown'}"
    if r.status[i] == 200:
        return "200 WRONG OUTPUT" if r.wrong[i] else "200"
    return f"{r.status[i]} {r.code[i]}"


def expected(kind: str, out: str, sent: float, signal_fired: float) -> bool:
    """What the goals allow: 200; the poisons' 500; any answer to the HANG input itself; 503 DRAINING after
    the signal; a refused connection after the signal (the listener closed: the request was never accepted)."""
    if kind == "poison" and sent < signal_fired:
        return out == "500 INFERENCE_FAILED"
    if kind == "hang":
        return not out.startswith("no answer")
    if out == "200":
        return True
    if out == "no answer: connect":  # never accepted: fine once the server stops listening after the signal
        return sent >= signal_fired
    return out == "503 DRAINING" and sent >= signal_fired


ABANDON = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR \S+ worker (\S+) ran a batch of (\d+) "
    r"for ([\d.]+)s \(gpu_timeout ([\d.]+)s\)"
)


def abandons(log_path: Path, wall_t0: float) -> list[dict]:
    """The watchdog's "marked unhealthy" lines, on the run's clock: when, which worker, how big a batch, and
    when that batch had started (marked − ran for)."""
    out: list[dict[str, object]] = []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        m = ABANDON.match(line)
        if m:
            at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_t0
            out.append(
                {
                    "marked_s": at,
                    "worker": m.group(2),
                    "batch": int(m.group(3)),
                    "ran_s": float(m.group(4)),
                    "gpu_timeout_s": float(m.group(5)),
                    "batch_started_s": at - float(m.group(4)),
                }
            )
    return out


def analyse(result: Run, a: argparse.Namespace, facts: dict, log_path: Path) -> dict:
    r = result.records
    signal_fired = next(ev.fired for ev in result.events if ev.name == "SIGTERM")
    lat = r.latency_ms
    n = len(r.sched)
    outs = [outcome(r, i) for i in range(n)]
    phases = [phase_of(float(r.sent[i]), a.hang_at, signal_fired) for i in range(n)]  # by when it left

    # Left without an answer: the request reached the server (a connection was made, or one was reused) but
    # no HTTP answer came: a timeout, a reset, a dropped connection. A refused connection was never accepted.
    lost = [i for i in range(n) if outs[i].startswith("no answer") and r.failure[i] != "connect"]
    refused = [i for i in range(n) if r.failure[i] == "connect"]
    refused_after_signal = [i for i in refused if r.sent[i] >= signal_fired]

    by_phase = []
    for ph in PHASES:
        idx = [i for i in range(n) if phases[i] == ph]
        ok = np.array([lat[i] for i in idx if outs[i] == "200"])
        by_phase.append(
            {
                "phase": ph,
                "requests": len(idx),
                "ok": len(ok),
                "p50_ms": pct(ok, 50),
                "p95_ms": pct(ok, 95),
                "p99_ms": pct(ok, 99),
                "max_ms": float(ok.max()) if len(ok) else float("nan"),
                "non_200": dict(Counter(outs[i] for i in idx if outs[i] != "200").most_common()),
            }
        )

    non200 = Counter(
        (outs[i], phases[i], r.kinds[i], expected(r.kinds[i], outs[i], r.sent[i], signal_fired))
        for i in range(n)
        if outs[i] != "200"
    )
    non200_rows = [
        {"outcome": o, "phase": ph, "input": k, "expected": e, "count": c}
        for (o, ph, k, e), c in sorted(non200.items(), key=lambda kv: (PHASES.index(kv[0][1]), kv[0][0]))
    ]
    unexpected = sum(c for (_, _, _, e), c in non200.items() if not e)

    unexpected_detail = [
        {
            "index": i,
            "input": r.kinds[i],
            "sent_s": r.sent[i],
            "outcome": outs[i],
            "answered_after_ms": (r.done[i] - r.sent[i]) * 1000,
            "detail": r.detail[i],
            "nearest_poison_before": max(
                (j for j in range(max(0, i - 2000), i) if r.kinds[j] == "poison"), default=None
            ),
        }
        for i in range(n)
        if outs[i] != "200" and not expected(r.kinds[i], outs[i], r.sent[i], signal_fired)
    ][:200]
    draining_early = [i for i in range(n) if outs[i] == "503 DRAINING" and r.sent[i] < signal_fired]
    poison = [i for i in range(n) if r.kinds[i] == "poison" and r.sent[i] < signal_fired]

    # The hung batch: the HANG request's batch started when the watchdog's first "marked unhealthy" line says
    # (marked − ran for); its items are the requests sent in the slo before that start which were held past
    # most of gpu_timeout (or never got a 200).
    gpu_timeout_ms = float(facts.get("gpu_timeout_ms") or 0)
    hang = [i for i in range(n) if r.kinds[i] == "hang"]
    marks = abandons(log_path, result.wall_t0)
    hang_section: dict = {"gpu_timeout_ms": gpu_timeout_ms, "abandoned_workers": marks}
    if hang:
        h = hang[0]
        start = marks[0]["batch_started_s"] if marks else float(r.sent[h])
        bound_ms = gpu_timeout_ms + a.sim_batch_ms
        held = [
            i
            for i in range(n)
            if i != h
            and start - a.slo_ms / 1000 - 0.05 <= r.sent[i] <= start + 0.005
            and not r.done[i] - r.sent[i] < 0.8 * gpu_timeout_ms / 1000
        ]  # held long (or never answered)
        after_ms = np.array([(r.done[i] - start) * 1000 for i in held])
        unhealthy = [s for s in result.samples if s.healthy is not None and s.workers and s.healthy < s.workers]
        hang_section.update(
            {
                "hang_request": {
                    "index": h,
                    "sent_s": r.sent[h],
                    "outcome": outs[h],
                    "answered_after_ms": (r.done[h] - r.sent[h]) * 1000,
                },
                "batch_started_s": start,
                "batch_start_from": "server log" if marks else "HANG request sent",
                "held_items": len(held),
                "held_outcomes": dict(Counter(outs[i] for i in held).most_common()),
                "held_answered_after_start_ms": {
                    "min": float(np.nanmin(after_ms)) if len(after_ms) else None,
                    "median": pct(after_ms, 50),
                    "max": float(np.nanmax(after_ms)) if len(after_ms) else None,
                },
                "held_detail": [
                    {
                        "index": i,
                        "sent_s": r.sent[i],
                        "outcome": outs[i],
                        "answered_after_start_ms": (r.done[i] - start) * 1000,
                    }
                    for i in held[:100]
                ],
                "bound_ms": bound_ms,
                "first_unhealthy_sample_s": unhealthy[0].t if unhealthy else None,
                "min_healthy_workers": min((s.healthy for s in result.samples if s.healthy is not None), default=None),
            }
        )
        answered_in_time = bool(held) and not np.isnan(after_ms).any() and float(after_ms.max()) <= bound_ms
        hang_section["answered_in_time"] = answered_in_time
        hang_section["all_200"] = bool(held) and all(outs[i] == "200" for i in held)

    timeline = []
    for sec in range(int(np.ceil(a.duration))):
        idx = [i for i in range(n) if sec <= r.sched[i] < sec + 1]
        ok = np.array([lat[i] for i in idx if outs[i] == "200"])
        hs = [s.healthy for s in result.samples if sec <= s.t < sec + 1 and s.healthy is not None]
        qs = [s.queue_depth for s in result.samples if sec <= s.t < sec + 1 and s.queue_depth is not None]
        cpu = [(s.t, s.cpu_s) for s in result.samples if sec <= s.t < sec + 1 and s.cpu_s is not None]
        lag = np.array([(r.sent[i] - r.sched[i]) * 1000 for i in idx])
        timeline.append(
            {
                "second": sec,
                "requests": len(idx),
                "ok": len(ok),
                "p95_ms": pct(ok, 95),
                "send_lag_p99_ms": pct(lag, 99),
                "non_200": len(idx) - len(ok),
                "healthy_min": min(hs) if hs else None,
                "queue_max": max(qs) if qs else None,
                "server_cores": (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0])
                if len(cpu) > 1 and cpu[-1][0] > cpu[0][0]
                else None,
            }
        )

    goals = {
        "no request left without an answer": len(lost) == 0,
        "poisons alone fail, with 500 INFERENCE_FAILED": all(outs[i] == "500 INFERENCE_FAILED" for i in poison),
        "no connection refused before the signal": len(refused) == len(refused_after_signal),
        "no other non-200 (besides the HANG input and DRAINING after the signal)": unexpected == 0,
        "hung batch's items answered within gpu_timeout + one batch": bool(hang_section.get("answered_in_time")),
        "hung batch's items all 200 (the HANG input aside)": bool(hang_section.get("all_200")),
        "503 DRAINING only after the signal": not draining_early,
        "no wrong output": not r.wrong.any(),
    }
    return {
        "totals": {
            "scheduled": n,
            "answered_http": int((r.status > 0).sum()),
            "ok": outs.count("200"),
            "left_without_answer": len(lost),
            "lost_detail": dict(Counter(outs[i] for i in lost)),
            "lost_examples": [
                {
                    "index": i,
                    "sent_s": r.sent[i],
                    "outcome": outs[i],
                    "detail": r.detail[i],
                    "connection": {1: "new", 0: "reused"}.get(int(r.new_conn[i]), "?"),
                }
                for i in lost[:20]
            ],
            "lost_by_connection": dict(Counter({1: "new", 0: "reused"}.get(int(r.new_conn[i]), "?") for i in lost)),
            "refused_connections": len(refused),
            "refused_before_signal": len(refused) - len(refused_after_signal),
            "wrong_outputs": int(r.wrong.sum()),
        },
        "events": {
            "signal_s": signal_fired,
            "server_exited_s": result.exited_at,
            "first_refused_connection_s": min((float(r.sent[i]) for i in refused_after_signal), default=None),
            "last_send_s": float(np.nanmax(r.sent)) if n else None,
        },
        "phases": by_phase,
        "non_200": non200_rows,
        "unexpected_non_200": unexpected,
        "unexpected_detail": unexpected_detail,
        "draining_before_signal": len(draining_early),
        "poisons": {"count": len(poison), "outcomes": dict(Counter(outs[i] for i in poison))},
        "hang": hang_section,
        "timeline": timeline,
        "client": {"send_lag_p99_ms": pct((r.sent - r.sched) * 1000, 99), "cpu_s": result.client_cpu_s},
        "goals": goals,
    }


# -- output ---------------------------------------------------------------------------------------------------
def markdown(rep: dict) -> str:
    res, s = rep["result"], rep["settings"]
    t, hg = res["totals"], res["hang"]
    out = [
        f"# Reliability drill — {rep['when_utc']}",
        f"`{s['command']}`  ",
        f"commit `{rep['git']['commit'][:12]}`{' (dirty)' if rep['git']['dirty'] else ''}, "
        f"{rep['machine']['cpu_model']} × {rep['machine']['cores_usable']} usable cores, "
        f"load average at start {rep['machine']['loadavg_at_start']}",
        "",
        "## Goals",
        table(["goal", "met"], [[g, "yes" if ok else "**NO**"] for g, ok in res["goals"].items()]),
        "",
        "## Totals",
        table(
            [
                "scheduled",
                "answered (HTTP)",
                "200",
                "left without an answer",
                "connection refused (never accepted)",
                "of which before the signal",
                "wrong outputs",
            ],
            [
                [
                    t["scheduled"],
                    t["answered_http"],
                    t["ok"],
                    t["left_without_answer"],
                    t["refused_connections"],
                    t["refused_before_signal"],
                    t["wrong_outputs"],
                ]
            ],
        ),
        f"\nSIGTERM at {fmt(res['events']['signal_s'], '.3f')} s; first refused connection (listener "
        f"closed) at {fmt(res['events']['first_refused_connection_s'], '.3f')} s; server exited at "
        f"{fmt(res['events']['server_exited_s'], '.3f')} s; last request sent at "
        f"{fmt(res['events']['last_send_s'], '.3f')} s. Client send lag p99 "
        f"{fmt(res['client']['send_lag_p99_ms'])} ms.",
        "",
        "## Latency of the 200s by phase (ms, from the scheduled send time)",
        table(
            ["phase", "requests", "200", "p50", "p95", "p99", "max"],
            [
                [p["phase"], p["requests"], p["ok"], p["p50_ms"], p["p95_ms"], p["p99_ms"], p["max_ms"]]
                for p in res["phases"]
            ],
        ),
        "",
        "## Every non-200",
        table(
            ["outcome", "phase", "input", "expected by the goals", "count"],
            [
                [x["outcome"], x["phase"], x["input"], "yes" if x["expected"] else "**no**", x["count"]]
                for x in res["non_200"]
            ],
        )
        if res["non_200"]
        else "none",
        "",
        "## The hang",
    ]
    if "hang_request" in hg:
        hr, ha = hg["hang_request"], hg["held_answered_after_start_ms"]
        out += [
            f"HANG input sent at {fmt(hr['sent_s'], '.3f')} s, answered `{hr['outcome']}` after "
            f"{fmt(hr['answered_after_ms'], '.0f')} ms. Its batch started at {fmt(hg['batch_started_s'], '.3f')} s "
            f"(from the {hg['batch_start_from']}); gpu_timeout {fmt(hg['gpu_timeout_ms'], '.0f')} ms; "
            f"first sample with a worker unhealthy at {fmt(hg['first_unhealthy_sample_s'], '.2f')} s; fewest "
            f"healthy workers {fmt(hg['min_healthy_workers'])}.",
            "",
            table(
                [
                    "items held by the hang",
                    "their outcomes",
                    "answered after the batch started (min / median / max ms)",
                    "bound: gpu_timeout + one batch (ms)",
                ],
                [
                    [
                        hg["held_items"],
                        ", ".join(f"{k}: {v}" for k, v in hg["held_outcomes"].items()),
                        f"{fmt(ha['min'], '.0f')} / {fmt(ha['median'], '.0f')} / {fmt(ha['max'], '.0f')}",
                        fmt(hg["bound_ms"], ".0f"),
                    ]
                ],
            ),
            "",
            "Workers the watchdog abandoned:",
            table(
                [
                    "marked unhealthy at s",
                    "worker",
                    "batch size",
                    "ran for s",
                    "detected after gpu_timeout + ms",
                    "its batch started at s",
                ],
                [
                    [
                        fmt(m["marked_s"], ".3f"),
                        m["worker"],
                        m["batch"],
                        fmt(m["ran_s"], ".2f"),
                        fmt((m["ran_s"] - m["gpu_timeout_s"]) * 1000, ".0f"),
                        fmt(m["batch_started_s"], ".3f"),
                    ]
                    for m in hg["abandoned_workers"]
                ],
            ),
        ]
    else:
        out.append("no HANG input was sent")
    out += [
        "",
        "## Per second",
        table(
            [
                "s",
                "requests",
                "200",
                "p95 ms",
                "non-200",
                "healthy workers (min)",
                "queue (max)",
                "server CPU cores",
                "client send lag p99 ms",
            ],
            [
                [
                    x["second"],
                    x["requests"],
                    x["ok"],
                    x["p95_ms"],
                    x["non_200"],
                    x["healthy_min"],
                    x["queue_max"],
                    x["server_cores"],
                    x["send_lag_p99_ms"],
                ]
                for x in res["timeline"]
            ],
        ),
    ]
    if t["lost_examples"]:
        out += [
            "",
            "## Requests left without an answer (first 20)",
            f"by connection: {t['lost_by_connection']}",
            "",
            table(
                ["index", "sent s", "outcome", "client error", "connection"],
                [
                    [x["index"], fmt(x["sent_s"], ".3f"), x["outcome"], x["detail"], x["connection"]]
                    for x in t["lost_examples"]
                ],
            ),
        ]
    if res["unexpected_detail"]:
        out += [
            "",
            "## Unexpected non-200s (first 40; all in the JSON up to 200)",
            table(
                ["index", "input", "sent s", "outcome", "answered after ms", "nearest poison before (index)"],
                [
                    [
                        x["index"],
                        x["input"],
                        fmt(x["sent_s"], ".3f"),
                        x["outcome"],
                        fmt(x["answered_after_ms"], ".0f"),
                        x["nearest_poison_before"],
                    ]
                    for x in res["unexpected_detail"][:40]
                ],
            ),
        ]
    out += ["", "## Server log (warnings and errors, first lines)", "```", *rep["server_log"], "```"]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Reliability drill: poison, hang and SIGTERM under open-loop load")
    common.add_sim_flags(p, devices=4, max_batch_size=None)
    p.add_argument("--rate", type=float, default=1500.0, help="offered requests per second")
    common.add_load_flags(p, duration=30.0, warmup=None, seed=3)
    p.add_argument("--poison-every", type=int, default=500, help="one POISON input in every N requests")
    p.add_argument("--hang-at", type=float, default=10.0, help="send the HANG input at this second")
    p.add_argument("--signal-at", type=float, default=25.0, help="send SIGTERM to the server at this second")
    common.add_output_flags(p, name="drill")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "drill")
    extra = [
        "--slo-ms",
        f"{a.slo_ms:g}",
        "--sim-fail-marker",
        POISON,
        "--sim-hang-marker",
        HANG,
        "--sim-hang-ms",
        "60000",
        *a.server_arg,
    ]
    cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, 100, extra)
    sched, inputs, kinds = plan(a.rate, a.duration, a.seed, a.poison_every, a.hang_at)
    prov = report.provenance()
    logs = common.log_dir(a, name)
    with common.guarded():
        server = servers.start(name + ".server", cmd, logs)
        facts = server_facts(server.base)
        assert server.proc is not None
        result = run(
            server.base,
            sched,
            inputs,
            kinds,
            [signal_event(a.signal_at, server.pid, signal.SIGTERM, "SIGTERM")],
            server.pid,
            server.proc,
            timeout_s=a.timeout,
        )
    rep = {
        **prov,
        "settings": {
            **vars(a),
            "command": " ".join(["python -m bench.drill", *(argv or sys.argv[1:])]),
            "server_cmd": cmd[1:],
            "server": facts,
            "requests": len(sched),
        },
        "result": analyse(result, a, facts, server.log_path),
        "server_exit_code": server.proc.returncode if server.proc else None,
        "server_log": report.log_lines(server.log_path),
    }
    return report.judged(name, rep, markdown(rep), common.out_dir(a), logs)


if __name__ == "__main__":
    sys.exit(main())
