"""A request's own priority under overload (issue 49): one key, two classes of request, one sim device past
its capacity.

    python -m bench.priority                 # 1.5x capacity for 20 s after 3 s of warm-up, ~35 s
    python -m bench.priority --quick         # 6 s: a check of the path, not a measurement
    python -m bench.priority --record        # and bench/results/priority-<time>.{md,json}

One `batchserve serve --backend sim` (1 device, 100 ms batches of at most 100: ~1,000 inputs/s) with
`--slo-ms 1000` and one API key of the `paid` tier whose `best_tier` is `enterprise`. Open-loop Poisson load at
`--load` (1.5) x that capacity from that one key (`bench/faultload.py`: a record per request); each request is
drawn into one of two classes, `--priority-share` (0.3) of them asking `"priority": "priority"` (the key's best
tier: enterprise, docs/configuration.md) and the rest sending no priority (the key's tier: paid).

Per class, over the requests scheduled after the warm-up: sent, answered 200, refused at the door (429/503),
504 after admission, anything else, and the server's own queue wait of each 200 (`queue_ms` in the answer:
arrival to the batch's formation, the figure its `Server-Timing: queue` header carries) at p50/p95, with the
server's `latency_ms` and the client's latency (from the scheduled send) beside it. The server's SLO ledger by
tier (`batchserve_slo_requests_total`) is read back, so the priority class is seen booked under `enterprise`.

Goals (issue 49): the priority class's p50 queue wait at most 1/3 of the default class's, and 0 answers 504
after admission in either class. Exit status 0 when both hold, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/priority.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import os
import secrets
import tempfile
import urllib.request
from collections import Counter

import numpy as np

from bench import common, report, servers
from bench.faultload import Run, run
from bench.ledger_drill import by_outcome, ledger_of
from bench.report import fmt, pct, table
from bench.schedule import poisson_schedule

CLASSES = ("priority", "default")
QUEUE_RATIO_GOAL = 1 / 3  # priority p50 queue wait <= this x the default class's


def write_key(config: Path) -> str:
    """One key: tenant `one`, tier paid, allowed to ask up to enterprise; its rate far above the offer (only
    admission refuses)."""
    from batchserve.config_file import append_key
    from batchserve.http.guards import digest, new_key

    key = new_key()
    append_key(str(config), "one", "paid", digest(key), 1_000_000, best_tier="enterprise")
    return key


def classes_of(n: int, share: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 1)
    return ["priority" if x else "default" for x in rng.random(n) < share]


def analyse(result: Run, warmup_s: float) -> dict:
    r = result.records
    measured = r.sched >= warmup_s
    kinds = np.array(r.kinds)
    out: dict = {}
    for cls in CLASSES:
        mine = measured & (kinds == cls)
        ok = mine & (r.status == 200) & ~r.wrong
        status = r.status[mine]
        queue, server, client = r.queue_ms[ok], r.server_ms[ok], r.latency_ms[ok]
        codes = Counter(
            f"{r.status[i]} {r.code[i]}" if r.status[i] else f"no answer: {r.failure[i]}"
            for i in np.flatnonzero(mine & (r.status != 200))
        )
        out[cls] = {
            "sent": int(mine.sum()),
            "ok": int(ok.sum()),
            "refused": int(((status == 429) | (status == 503)).sum()),
            "expired_504": int((status == 504).sum()),
            "wrong_output": int((mine & (r.status == 200) & r.wrong).sum()),
            "other": int(((status != 200) & (status != 429) & (status != 503) & (status != 504)).sum()),
            "no_answer": int((status == 0).sum()),
            "queue_p50_ms": pct(queue, 50),
            "queue_p95_ms": pct(queue, 95),
            "server_p50_ms": pct(server, 50),
            "server_p95_ms": pct(server, 95),
            "client_p95_ms": pct(client, 95),
            "mean_batch": float(np.mean(r.batch_size[ok])) if ok.any() else float("nan"),
            "codes": dict(codes.most_common()),
        }
    p, d = out["priority"], out["default"]
    ratio = p["queue_p50_ms"] / d["queue_p50_ms"] if d["queue_p50_ms"] else float("nan")
    out["queue_p50_ratio"] = ratio
    out["send_lag_p99_ms"] = pct((r.sent - r.sched)[measured] * 1000, 99)
    out["goals"] = {
        "priority p50 queue wait <= 1/3 of default's": bool(ratio <= QUEUE_RATIO_GOAL),
        "0 x 504 after admission (priority)": p["expired_504"] == 0,
        "0 x 504 after admission (default)": d["expired_504"] == 0,
        "every request answered": p["no_answer"] + d["no_answer"] == 0,
    }
    return out


def markdown(rep: dict) -> str:
    s, res, m = rep["settings"], rep["result"], rep["machine"]
    rows = []
    for cls in CLASSES:
        c = res[cls]
        rows.append(
            [
                f"{cls} ({'enterprise' if cls == 'priority' else 'paid'})",
                c["sent"],
                c["ok"],
                c["refused"],
                c["expired_504"],
                c["other"] + c["wrong_output"],
                fmt(c["queue_p50_ms"]),
                fmt(c["queue_p95_ms"]),
                fmt(c["server_p50_ms"]),
                fmt(c["server_p95_ms"]),
                fmt(c["client_p95_ms"]),
            ]
        )
    header = [
        "class (tier run at)",
        "sent",
        "200",
        "refused 429/503",
        "504 after admission",
        "other",
        "queue p50 ms",
        "queue p95 ms",
        "server p50 ms",
        "server p95 ms",
        "client p95 ms",
    ]
    ledger = "; ".join(
        f"{tier}: " + ", ".join(f"{o} {n}" for o, n in counts.items() if n)
        for tier, counts in rep["ledger_by_tier"].items()
        if any(counts.values())
    )
    goals = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {g}" for g, ok in res["goals"].items())
    return "\n".join(
        [
            "# A request's own priority under overload (bench/priority.py)",
            "",
            f"One sim device ({s['sim_batch_ms']:g} ms batches of at most {s['max_batch_size']}: ~{s['capacity']:.0f}"
            f" inputs/s), `--slo-ms {s['slo_ms']:g}`, one key (paid, `best_tier` enterprise). Open-loop Poisson at "
            f"{s['load']:g}x capacity ({s['rate']:.0f} req/s) for {s['warmup']:g} s of warm-up + {s['duration']:g} s "
            f'measured; {s["priority_share"]:.0%} of requests ask `"priority": "priority"`, the rest nothing. '
            f"Machine: {m.get('cores_usable', '?')} usable cores, load average {rep['loadavg_before']} before, "
            f"{rep['loadavg_after']} after; commit {rep['git'].get('commit', '?')[:12]}"
            f"{' (dirty)' if rep['git'].get('dirty') else ''}.",
            "",
            "Queue wait is the server's own (`queue_ms` in each 200: arrival to the batch's formation, as its "
            "`Server-Timing: queue` says); server latency its `latency_ms`; client latency from the scheduled send.",
            "",
            table(header, rows),
            "",
            f"Priority p50 queue wait / default's: **{fmt(res['queue_p50_ratio'], '.2f')}** (goal <= "
            f"{QUEUE_RATIO_GOAL:.2f}). The server's SLO ledger by tier: {ledger or 'empty'}. Client send lag "
            f"p99 {fmt(res['send_lag_p99_ms'])} ms (more than a few ms: the client, not the server, lagged).",
            "",
            "Answers other than 200: "
            + "; ".join(f"{cls}: " + ", ".join(f"{c} x{n}" for c, n in res[cls]["codes"].items()) for cls in CLASSES),
            "",
            goals,
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_sim_flags(p, devices=None, slo_ms=1000.0)
    p.add_argument("--load", type=float, default=1.5, help="offered load over capacity (default %(default)g)")
    p.add_argument(
        "--priority-share", type=float, default=0.3, help="share of requests asking priority (default %(default)g)"
    )
    common.add_load_flags(p, duration=20.0, warmup=3.0, seed=49, timeout=10.0)
    p.add_argument("--quick", action="store_true", help="2 s of warm-up and 4 measured: a check, not a measurement")
    common.add_output_flags(p, name="priority", tag=True)
    a = p.parse_args(argv)
    if a.quick:
        a.warmup, a.duration = 2.0, 4.0
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "priority")
    capacity = a.max_batch_size / a.sim_batch_ms * 1000
    rate = a.load * capacity
    sched = poisson_schedule(rate, a.warmup + a.duration, a.seed)
    kinds = classes_of(len(sched), a.priority_share, a.seed)
    extras: list[dict | None] = [{"priority": "priority"} if k == "priority" else None for k in kinds]
    tag = secrets.token_hex(3)
    inputs = [f"{tag}-{i:06d}-priority→" for i in range(len(sched))]
    prov = report.provenance()
    logs = common.log_dir(a, name)
    loadavg_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="priority-") as tmp, common.guarded():
        config = Path(tmp) / "keys.toml"
        key = write_key(config)
        cmd = servers.batchserve_cmd(
            1,
            a.sim_batch_ms,
            a.max_batch_size,
            ["--config", str(config), *common.sim_server_flags(a), *a.server_arg],
        )
        server = servers.start(name + ".server", cmd, logs)
        assert server.proc is not None
        result = run(
            server.base,
            sched,
            inputs,
            kinds,
            [],
            server.pid,
            server.proc,
            timeout_s=a.timeout,
            headers={"Authorization": f"Bearer {key}"},
            extras=extras,
        )
        with urllib.request.urlopen(server.base + "/metrics", timeout=10) as resp:
            ledger = ledger_of(resp.read().decode())
    rep = {
        **prov,
        "settings": {
            **{k: v for k, v in vars(a).items() if k != "out_dir"},
            "capacity": capacity,
            "rate": rate,
            "requests": len(sched),
            "command": " ".join(["python -m bench.priority", *(argv if argv is not None else sys.argv[1:])]),
            "server_cmd": cmd[1:],
        },
        "loadavg_before": loadavg_before,
        "loadavg_after": round(os.getloadavg()[0], 2),
        "result": analyse(result, a.warmup),
        "ledger_by_tier": {t: by_outcome(ledger, t) for t in ("enterprise", "paid")},
        "client_cpu_s": result.client_cpu_s,
        "server_log": report.log_lines(server.log_path),
    }
    return report.judged(name, rep, markdown(rep), common.out_dir(a), logs)


if __name__ == "__main__":
    sys.exit(main())
