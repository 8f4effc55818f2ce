"""The planner's predictions against measured bench rows (issue 14, item 6), in one command:

    python -m bench.plan_check                      # the committed standard run, rows 1:500,1:900,4:400,4:2000
    python -m bench.plan_check --file bench/results/standard-<time>.json --rows 1:100,1:950
    python -m bench.plan_check --record             # also writes bench/results/plan-check-<time>.{md,json}

It measures nothing: for each row of a recorded standard bench (`bench/run_standard.py`) it asks
`batchserve.plan.latency_at` — the planner's own model, with its own Poisson draws — for p50/p95 at the row's
rate, devices, batch time, SLO and margin, and prints them beside what was measured, with the error of each.
A second prediction uses the device time per batch the server actually delivered in that row (devices /
batches per second: the batch's compute plus the worker's idle gap before the next one) instead of the
contract's 100 ms, which tells an error of the model from a batch cycle that drifted. The bench's `ideal p95`
column is the same policy on the row's very arrivals, so predicted-vs-ideal is only the luck of the draw.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/plan_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime as dt
import json
from dataclasses import asdict, dataclass

from batchserve.plan import PoissonArrivals, BatchTime, Contract, LatencyAtRate, latency_at
from bench import common
from bench.report import git_info, write, written
from bench.run_standard import parse_rows


def newest_standard() -> Path | None:
    """The newest recorded standard table (the file names sort by time), untagged: a `--tag`ged run
    (`standard-<time>-plot.json`) may hold only some of the rows."""
    found = sorted(common.RESULTS.glob("standard-*Z.json"))
    return found[-1] if found else None


DEFAULT_ROWS = "1:500,1:900,4:400,4:2000"
GOAL_PCT = 10.0  # the bar: predicted p95 within 10 % of the measured row


@dataclass
class Check:
    devices: int
    rate: float
    measured_p50_ms: float
    measured_p95_ms: float
    server_p95_ms: float | None  # the server's own latency_ms (without the client and the network)
    ideal_p95_ms: float  # bench/ideal.py on the row's very arrivals
    batch_ms: float | None  # device time per batch as run: devices / batches per second (compute + gaps)
    planned: LatencyAtRate  # the contract's batch time
    planned_as_run: LatencyAtRate | None  # the row's measured batch time

    @property
    def p95_error_pct(self) -> float:
        return 100 * (self.planned.p95_ms - self.measured_p95_ms) / self.measured_p95_ms

    @property
    def p50_error_pct(self) -> float:
        return 100 * (self.planned.p50_ms - self.measured_p50_ms) / self.measured_p50_ms

    @property
    def as_run_error_pct(self) -> float | None:
        if self.planned_as_run is None:
            return None
        return 100 * (self.planned_as_run.p95_ms - self.measured_p95_ms) / self.measured_p95_ms


def check(report: dict, rows: list[tuple[int, float]], sim_s: float, seed: int) -> list[Check]:
    s = report["settings"]
    out = []
    for devices, rate in rows:
        row = next((r for r in report["rows"] if r["devices"] == devices and r["rate"] == rate), None)
        if row is None:
            have = ", ".join(f"{r['devices']}:{r['rate']:g}" for r in report["rows"])
            raise SystemExit(f"no row {devices}:{rate:g} in the file (it has {have})")

        def contract(batch_ms: float, devices: int = devices) -> Contract:
            return Contract(
                BatchTime.constant(batch_ms),
                devices,
                s["max_batch_size"],
                s["slo_ms"] / 1000,
                s["margin_ms"] / 1000,
                s.get("request_timeout_ms", 2000.0) / 1000,
            )

        load = row["load"]
        per_s = load.get("batches_per_s")
        batch_ms = devices * 1000 / per_s if per_s else load.get("server_mean_compute_ms")
        planned = latency_at(rate, contract(s["sim_batch_ms"]), PoissonArrivals(seed), sim_s)
        as_run = latency_at(rate, contract(batch_ms), PoissonArrivals(seed), sim_s) if batch_ms else None
        out.append(
            Check(
                devices,
                rate,
                load["p50_ms"],
                load["p95_ms"],
                load.get("server_p95_ms"),
                row["ideal"]["p95_ms"],
                batch_ms,
                planned,
                as_run,
            )
        )
    return out


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def table(checks: list[Check]) -> str:
    lines = [
        "| devices | RPS | measured p50 | planned p50 | measured p95 | planned p95 | p95 error | within "
        f"{GOAL_PCT:g} % | server's own p95 | ideal p95 (same arrivals) | device ms per batch as run | "
        "planned p95 at that | its error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.devices} | {c.rate:g} | {c.measured_p50_ms:.1f} | {c.planned.p50_ms:.1f} | {c.measured_p95_ms:.1f} "
            f"| {c.planned.p95_ms:.1f} | {c.p95_error_pct:+.1f} % | "
            f"{'yes' if abs(c.p95_error_pct) <= GOAL_PCT else 'NO'} "
            f"| {fmt(c.server_p95_ms, '.0f')} | {c.ideal_p95_ms:.1f} | {fmt(c.batch_ms)} "
            f"| {fmt(c.planned_as_run.p95_ms if c.planned_as_run else None)} | "
            f"{fmt(c.as_run_error_pct, '+.1f')} % |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="batchserve plan's predictions against a recorded standard bench")
    p.add_argument(
        "--file", type=Path, default=newest_standard(), help="a standard-*.json (default: the newest in bench/results/)"
    )
    p.add_argument(
        "--rows", type=parse_rows, default=parse_rows(DEFAULT_ROWS), help=f"DEVICES:RPS,... ({DEFAULT_ROWS})"
    )
    p.add_argument("--sim-s", type=float, default=60.0, help="simulated seconds per prediction")
    p.add_argument("--seed", type=int, default=1, help="the planner's seed (its own draws, not the bench's)")
    common.add_output_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    report = json.loads(a.file.read_text())
    checks = check(report, a.rows, a.sim_s, a.seed)
    worst = max(abs(c.p95_error_pct) for c in checks)
    text = "\n".join(
        [
            f"# batchserve plan vs measured — {a.file.name} ({report['timestamp']})",
            "",
            f"Planner: `batchserve.plan.latency_at`, {a.sim_s:g} s simulated per row after 5 s warm-up, seed {a.seed}; "
            f"bench settings {report['settings']['sim_batch_ms']:g} ms batches, max batch "
            f"{report['settings']['max_batch_size']}, SLO {report['settings']['slo_ms']:g} ms. Error = (planned − "
            "measured) / measured.",
            "",
            table(checks),
            "",
            f"Largest p95 error: {worst:.1f} % (goal within {GOAL_PCT:g} %: "
            f"{'met' if worst <= GOAL_PCT else 'NOT met'}).",
        ]
    )
    print(text)
    rep = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git": git_info(),
        "source": str(a.file.name),
        "settings": {"sim_s": a.sim_s, "seed": a.seed},
        "rows": [
            {
                **asdict(c),
                "p95_error_pct": c.p95_error_pct,
                "p50_error_pct": c.p50_error_pct,
                "as_run_error_pct": c.as_run_error_pct,
            }
            for c in checks
        ],
    }
    print("\n" + written(write(common.run_name(a, "plan-check"), rep, text, common.out_dir(a))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
