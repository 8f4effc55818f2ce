"""The overload run (issue 3), in one command:

    python -m bench.overload                      # 1 sim device offered 3,000 RPS for 20 s
    python -m bench.overload --duration 6         # a short smoke run

One device of 100 ms batches serves at most ~1,000 RPS, so two thirds of the offer must be refused at the door
(503 with retry_after_ms), fast, while what is admitted still meets the SLO. It reports, against the goals:
admitted p95 (≤ 250 ms), refusal latency median (< 10 ms), client timeouts and requests left without an answer
(0), and the server's resident memory sampled from /proc every 100 ms (flat: the growth over the second half of
the run, when the queue is full, is judged). Latency is from the scheduled send time (open loop); refusal
latency is also given from the actual send, to tell the client's lag apart. Results are printed, and written to
bench/results/ with `--record` (or to DIR with `--out DIR`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/overload.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import secrets
from collections import Counter

import numpy as np

from bench import common, report, servers
from bench.faultload import Run, run
from bench.report import fmt, pct, table
from bench.schedule import poisson_schedule

ADMITTED_P95_GOAL_MS = 250.0
REFUSAL_MEDIAN_GOAL_MS = 10.0
RSS_GROWTH_GOAL_MB = 20.0  # "flat": less than this over the second half of the run


def analyse(result: Run, a: argparse.Namespace) -> dict:
    r = result.records
    n = len(r.sched)
    lat = r.latency_ms
    from_send = (r.done - r.sent) * 1000
    ok = r.status == 200
    refused = (r.status == 503) | (r.status == 429)
    no_answer = r.status == 0
    codes = Counter(
        f"{r.status[i]} {r.code[i]}" if r.status[i] else f"no answer: {r.failure[i]}"
        for i in range(n)
        if r.status[i] != 200
    )

    rss = [(s.t, s.rss_mb) for s in result.samples if s.rss_mb is not None]
    t_rss = np.array([t for t, _ in rss])
    mb = np.array([m for _, m in rss])
    half = t_rss >= a.duration / 2
    slope = float(np.polyfit(t_rss[half], mb[half], 1)[0]) if half.sum() > 2 else float("nan")
    growth_second_half = float(mb[half].max() - mb[half].min()) if half.any() else float("nan")
    cpu = [(s.t, s.cpu_s) for s in result.samples if s.cpu_s is not None]
    server_cores = (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]) if len(cpu) > 1 else float("nan")

    admitted_p95 = pct(lat[ok], 95)
    refusal_median = pct(lat[refused], 50)
    goals = {
        f"admitted p95 ≤ {ADMITTED_P95_GOAL_MS:g} ms": bool(admitted_p95 <= ADMITTED_P95_GOAL_MS),
        f"refusal latency median < {REFUSAL_MEDIAN_GOAL_MS:g} ms": bool(refusal_median < REFUSAL_MEDIAN_GOAL_MS),
        "no client timeouts": not any(f == "client_timeout" for f in r.failure),
        "no request left without an answer": not no_answer.any(),
        f"server memory flat (second half grows < {RSS_GROWTH_GOAL_MB:g} MB)": bool(
            growth_second_half < RSS_GROWTH_GOAL_MB
        ),
        "no wrong output": not r.wrong.any(),
    }
    seconds = []
    for sec in range(int(np.ceil(a.duration))):
        m = (r.sched >= sec) & (r.sched < sec + 1)
        rs = [x for t, x in rss if sec <= t < sec + 1]
        seconds.append(
            {
                "second": sec,
                "offered": int(m.sum()),
                "admitted": int((m & ok).sum()),
                "refused": int((m & refused).sum()),
                "admitted_p95_ms": pct(lat[m & ok], 95),
                "refusal_p50_ms": pct(lat[m & refused], 50),
                "rss_mb": max(rs) if rs else None,
            }
        )
    return {
        "totals": {
            "offered": n,
            "admitted": int(ok.sum()),
            "refused": int(refused.sum()),
            "other_non_200": int((~ok & ~refused & ~no_answer).sum()),
            "no_answer": int(no_answer.sum()),
            "client_timeouts": sum(1 for f in r.failure if f == "client_timeout"),
            "wrong_outputs": int(r.wrong.sum()),
            "admitted_rps": float(ok.sum()) / a.duration,
        },
        "admitted_ms": {
            "p50": pct(lat[ok], 50),
            "p95": admitted_p95,
            "p99": pct(lat[ok], 99),
            "max": float(np.nanmax(lat[ok])) if ok.any() else None,
            "p50_from_send": pct(from_send[ok], 50),
            "p95_from_send": pct(from_send[ok], 95),
            "p50_server": pct(r.server_ms[ok], 50),
            "p95_server": pct(r.server_ms[ok], 95),
            "mean_batch": float(r.batch_size[ok].mean()) if ok.any() else None,
        },
        "refusal_ms": {
            "p50": refusal_median,
            "p95": pct(lat[refused], 95),
            "p99": pct(lat[refused], 99),
            "p50_from_send": pct(from_send[refused], 50),
            "p95_from_send": pct(from_send[refused], 95),
        },
        "non_200": dict(codes.most_common()),
        "rss_mb": {
            "first": float(mb[0]) if len(mb) else None,
            "max": float(mb.max()) if len(mb) else None,
            "last": float(mb[-1]) if len(mb) else None,
            "second_half_growth": growth_second_half,
            "second_half_slope_mb_per_s": slope,
            "samples": len(mb),
        },
        "server_cores": server_cores,
        "client": {
            "send_lag_p50_ms": pct((r.sent - r.sched) * 1000, 50),
            "send_lag_p99_ms": pct((r.sent - r.sched) * 1000, 99),
            "cpu_s": result.client_cpu_s,
        },
        "per_second": seconds,
        "goals": goals,
    }


def markdown(rep: dict) -> str:
    res, s = rep["result"], rep["settings"]
    t, ad, rf, mem = res["totals"], res["admitted_ms"], res["refusal_ms"], res["rss_mb"]
    return "\n".join(
        [
            f"# Overload run — {rep['when_utc']}",
            f"`{s['command']}`  ",
            f"commit `{rep['git']['commit'][:12]}`{' (dirty)' if rep['git']['dirty'] else ''}, "
            f"{rep['machine']['cpu_model']} × {rep['machine']['cores_usable']} usable cores, load average at start "
            f"{rep['machine']['loadavg_at_start']}; {s['devices']} sim device(s), {s['sim_batch_ms']:g} ms batches, "
            f"{s['rate']:g} RPS offered for {s['duration']:g} s",
            "",
            "## Goals",
            table(["goal", "met"], [[g, "yes" if ok else "**NO**"] for g, ok in res["goals"].items()]),
            "",
            "## Result",
            table(
                [
                    "offered",
                    "admitted (200)",
                    "admitted RPS",
                    "refused (503/429)",
                    "other non-200",
                    "no answer",
                    "client timeouts",
                ],
                [
                    [
                        t["offered"],
                        t["admitted"],
                        t["admitted_rps"],
                        t["refused"],
                        t["other_non_200"],
                        t["no_answer"],
                        t["client_timeouts"],
                    ]
                ],
            ),
            "",
            table(
                ["latency ms", "p50", "p95", "p99", "max"],
                [
                    ["admitted (from scheduled send)", ad["p50"], ad["p95"], ad["p99"], ad["max"]],
                    ["admitted (from actual send)", ad["p50_from_send"], ad["p95_from_send"], None, None],
                    ["admitted (server's own latency_ms)", ad["p50_server"], ad["p95_server"], None, None],
                    ["refused (from scheduled send)", rf["p50"], rf["p95"], rf["p99"], None],
                    ["refused (from actual send)", rf["p50_from_send"], rf["p95_from_send"], None, None],
                ],
            ),
            "",
            table(
                [
                    "server RSS MB: first",
                    "max",
                    "last",
                    "growth over the second half",
                    "slope MB/s (second half)",
                    "samples",
                    "server CPU cores",
                ],
                [
                    [
                        mem["first"],
                        mem["max"],
                        mem["last"],
                        mem["second_half_growth"],
                        fmt(mem["second_half_slope_mb_per_s"], ".3f"),
                        mem["samples"],
                        fmt(res["server_cores"], ".2f"),
                    ]
                ],
            ),
            f"\nClient send lag p50 {fmt(res['client']['send_lag_p50_ms'])} ms, p99 "
            f"{fmt(res['client']['send_lag_p99_ms'])} ms (client CPU {fmt(res['client']['cpu_s'])} s). Mean batch of "
            f"the admitted {fmt(ad['mean_batch'])}. Non-200: {res['non_200']}",
            "",
            "## Per second",
            table(
                ["s", "offered", "admitted", "refused", "admitted p95 ms", "refusal p50 ms", "RSS MB (max)"],
                [
                    [
                        x["second"],
                        x["offered"],
                        x["admitted"],
                        x["refused"],
                        x["admitted_p95_ms"],
                        x["refusal_p50_ms"],
                        x["rss_mb"],
                    ]
                    for x in res["per_second"]
                ],
            ),
            "",
            "## Server log (warnings and errors, first lines)",
            "```",
            *rep["server_log"],
            "```",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Overload run: far more load than one device can serve")
    common.add_sim_flags(p, devices=1, max_batch_size=None, slo_ms=None)
    p.add_argument("--rate", type=float, default=3000.0, help="offered requests per second")
    common.add_load_flags(p, warmup=None, seed=5)
    common.add_output_flags(p, name="overload")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "overload")
    cmd = servers.batchserve_cmd(a.devices, a.sim_batch_ms, 100, a.server_arg)
    sched = poisson_schedule(a.rate, a.duration, a.seed)
    tag = secrets.token_hex(3)
    inputs = [f"{tag}-{i:06d}-overload→" for i in range(len(sched))]
    prov = report.provenance()
    logs = common.log_dir(a, name)
    with common.guarded():
        server = servers.start(name + ".server", cmd, logs)
        assert server.proc is not None
        result = run(
            server.base, sched, inputs, ["normal"] * len(sched), [], server.pid, server.proc, timeout_s=a.timeout
        )
        alive_after = server.proc.poll() is None and servers.ready(server.base)
    rep = {
        **prov,
        "settings": {
            **vars(a),
            "command": " ".join(["python -m bench.overload", *(argv or sys.argv[1:])]),
            "server_cmd": cmd[1:],
            "requests": len(sched),
        },
        "result": analyse(result, a),
        "server_ready_after_run": alive_after,
        "server_log": report.log_lines(server.log_path),
    }
    rep["result"]["goals"]["server still ready after the run"] = alive_after
    return report.judged(name, rep, markdown(rep), common.out_dir(a), logs)


if __name__ == "__main__":
    sys.exit(main())
