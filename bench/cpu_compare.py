"""End-to-end server CPU per request at 900 RPS: bare Starlette, the minimal batcher and batchserve, in one
command (issue 23, item 5).

Why its own command: `run_standard` measures batchserve once and the two references once each, one after the
other, and on a shared 2-core machine one busy minute moves a single window by 20 % or more. Here the three
servers take turns, window by window, for `--repeats` rounds (the order rotates each round, so none always runs
first), all on the same seeded arrivals, and the table quotes medians of the rounds:

- CPU per request = the server process's CPU seconds over the measured window (utime + stime from /proc) / the
  requests answered in it;
- the ratios of batchserve and of the minimal batcher to bare Starlette (goal: batchserve <= 1.5 x), and the
  p95 of batchserve beside the minimal batcher's (goal: within 5 ms), each ratio taken within a round first.

Each window starts a fresh server (batchserve as in `run_standard`'s 1-device row: sim backend, 100 ms batches
of at most 100, --slo-ms 200, --dispatch-margin-ms 5, --timeout-ms 2000), warms it up, measures, and stops it by
PID.

    python -m bench.cpu_compare                       # 3 rounds of 3 x (3 s warm-up + 10 s): about 2.5 minutes
    python -m bench.cpu_compare --repeats 5 --record  # into bench/results/cpu-compare-<time>.{md,json}
    python -m bench.cpu_compare --base /work/wt/base  # a fourth server: batchserve of another checkout

`--base DIR` (before/after in one run): batchserve from DIR's package takes its turn beside the three (same flags,
same arrivals), and the table adds its CPU ratio and p95 gap, and this checkout's CPU per request over the base's,
round by round.

`--record` refuses to run on a busy machine (1-minute load average >= `--max-load`, default 1.5), as the numbers
would say more about the neighbours than about the servers. Exit status 0 when both goals are met.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench import common, report, servers
from bench.loadgen import LoadResult, measure
from bench.schedule import row_seed

RATE = 900.0
CPU_RATIO_GOAL = 1.5
P95_SLACK_MS = 5.0
SERVERS = ("bare Starlette", "minimal batcher", "batchserve")
BASE = "batchserve (base)"  # with --base DIR


def command(name: str, a: argparse.Namespace) -> list[str]:
    if name == "bare Starlette":
        return servers.bare_cmd()
    if name == "minimal batcher":
        return servers.minimal_cmd()
    cmd = servers.batchserve_cmd(1, a.sim_batch_ms, a.max_batch_size, a.server_arg)
    if name == BASE:  # the same command, the package imported from the base tree (put first on the path)
        boot = (
            f"import runpy, sys; sys.path.insert(0, {str(Path(a.base).resolve())!r}); "
            "runpy.run_module('batchserve', run_name='__main__', alter_sys=True)"
        )
        return [cmd[0], "-c", boot, *cmd[3:]]
    return cmd


def one_window(name: str, a: argparse.Namespace, log_dir: Path, round_no: int) -> LoadResult:
    tag = name.replace(" ", "-").replace("(", "").replace(")", "")
    server = servers.start(f"{tag}-r{round_no}", command(name, a), log_dir)
    try:
        return measure(
            server.base,
            a.rate,
            a.duration,
            a.warmup,
            row_seed(a.seed, 1, a.rate),
            server_pid=server.pid,
            timeout_s=a.timeout,
            metrics=name.startswith("batchserve"),
            client=a.client,
        )
    finally:
        servers.stop(server)


def median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def ratios(num: list[float | None], den: list[float | None], rounds: int) -> list[float]:
    """num[i] / den[i] for each of the first `rounds` rounds where both were measured (and non-zero)."""
    out = []
    for i in range(rounds):
        n, d = num[i], den[i]
        if n and d:
            out.append(n / d)
    return out


def summarise(runs: dict[str, list[LoadResult]]) -> dict[str, object]:
    """Medians per server, and the ratios / p95 gaps taken within each round before their median (a round's
    three windows ran minutes apart at most, on the same machine state)."""
    cpu = {n: [r.server_cpu_ms_per_req for r in rs] for n, rs in runs.items()}
    p95 = {n: [r.p95_ms for r in rs] for n, rs in runs.items()}
    rounds = min(len(rs) for rs in runs.values())
    ratio = ratios(cpu["batchserve"], cpu["bare Starlette"], rounds)
    minimal_ratio = ratios(cpu["minimal batcher"], cpu["bare Starlette"], rounds)
    gap = [p95["batchserve"][i] - p95["minimal batcher"][i] for i in range(rounds)]
    errors = {n: sum(r.error_count for r in rs) for n, rs in runs.items()}
    ratio_median, gap_median = median(ratio), median(gap)
    out: dict[str, object] = {
        "cpu_ms": cpu,
        "p95_ms": p95,
        "ratio_runs": ratio,
        "minimal_ratio_runs": minimal_ratio,
        "p95_gap_runs": gap,
        "errors": errors,
        "cpu_ms_median": {n: median(v) for n, v in cpu.items()},
        "p95_ms_median": {n: median(v) for n, v in p95.items()},
        "achieved_rps_median": {n: median([r.achieved_rps for r in rs]) for n, rs in runs.items()},
        "ratio": ratio_median,
        "minimal_ratio": median(minimal_ratio),
        "p95_gap_ms": gap_median,
    }
    out["cpu_passed"] = ratio_median <= CPU_RATIO_GOAL and errors["batchserve"] == 0
    out["p95_passed"] = gap_median <= P95_SLACK_MS and errors["batchserve"] == 0
    if BASE in runs:  # --base: the base's figures, and this checkout's CPU over the base's, round by round
        base_ratio = ratios(cpu[BASE], cpu["bare Starlette"], rounds)
        base_gap = [p95[BASE][i] - p95["minimal batcher"][i] for i in range(rounds)]
        head_over_base = ratios(cpu["batchserve"], cpu[BASE], rounds)
        out["base_ratio_runs"] = base_ratio
        out["base_p95_gap_runs"] = base_gap
        out["head_over_base_runs"] = head_over_base
        out["base_ratio"] = median(base_ratio)
        out["base_p95_gap_ms"] = median(base_gap)
        out["head_over_base"] = median(head_over_base)
    return out


def markdown(rep: dict) -> str:
    s, a = rep["summary"], rep["settings"]
    f = report.fmt
    rows = []
    for n in s["cpu_ms"]:
        ratio = {"batchserve": s["ratio"], "minimal batcher": s["minimal_ratio"], "bare Starlette": 1.0}.get(
            n, s.get("base_ratio", math.nan)
        )
        rows.append(
            f"| {n} | {f(s['cpu_ms_median'][n], '.3f')} | {f(ratio, '.2f')} | {f(s['p95_ms_median'][n])} "
            f"| {f(s['achieved_rps_median'][n], '.0f')} | {s['errors'][n]} "
            f"| {', '.join(f(v, '.3f') for v in s['cpu_ms'][n])} |"
        )
    m, g = rep["provenance"]["machine"], rep["provenance"]["git"]
    return "\n".join(
        [
            f"# Server CPU per request at {a['rate']:g} RPS: bare Starlette, the minimal batcher, batchserve "
            "(bench/cpu_compare.py)",
            "",
            f"{a['repeats']} rounds, servers interleaved (order rotating), each window a fresh server: "
            f"{a['warmup']:g} s warm-up + {a['duration']:g} s measured on the same seeded arrivals (seed {a['seed']}), "
            f"client `{a['client']}`. Machine: {m.get('cpu_model')}, {m.get('cores_usable')} usable cores; "
            f"load average {rep['loadavg_start']} at the start, {rep['loadavg_end']} at the end. "
            f"Commit {g.get('commit', '?')}{' (dirty)' if g.get('dirty') else ''}.",
            "",
            "| server | CPU ms/req (median) | × bare (median of the rounds' ratios) | p95 ms (median) | achieved RPS "
            "| errors (all rounds) | CPU ms/req per round |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"- CPU per request, batchserve / bare Starlette: {f(s['ratio'], '.2f')} (rounds: "
            f"{', '.join(f(v, '.2f') for v in s['ratio_runs'])}; goal ≤ {CPU_RATIO_GOAL:g}): "
            f"**{'PASS' if s['cpu_passed'] else 'FAIL'}**",
            f"- p95, batchserve − minimal batcher: {f(s['p95_gap_ms'], '+.1f')} ms (rounds: "
            f"{', '.join(f(v, '+.1f') for v in s['p95_gap_runs'])}; goal ≤ {P95_SLACK_MS:g} ms): "
            f"**{'PASS' if s['p95_passed'] else 'FAIL'}**",
            *(
                [
                    f"- base (`{a['base']}`): CPU ratio {f(s['base_ratio'], '.2f')}, p95 gap "
                    f"{f(s['base_p95_gap_ms'], '+.1f')} ms "
                    f"(rounds: {', '.join(f(v, '+.1f') for v in s['base_p95_gap_runs'])}); "
                    f"this checkout's CPU per request ÷ the base's: **{f(s['head_over_base'], '.2f')}** (rounds: "
                    f"{', '.join(f(v, '.2f') for v in s['head_over_base_runs'])})"
                ]
                if "head_over_base" in s
                else []
            ),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_load_flags(p, duration=10.0, warmup=3.0)
    p.add_argument("--rate", type=float, default=RATE, help="offered requests/s (default %(default)g)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three servers (default %(default)s)")
    p.add_argument(
        "--client",
        default="aiohttp",
        help="the load sender (bench/loadgen.py CLIENTS; default aiohttp, as run_standard)",
    )
    p.add_argument("--base", default="", help="another checkout: its batchserve takes a turn too (module docstring)")
    p.add_argument(
        "--max-load",
        type=float,
        default=1.5,
        help="--record refuses to start at a 1-minute load average at or above this (default %(default)g)",
    )
    common.add_sim_flags(p, deadlines=True)
    common.add_output_flags(p, tag=True)
    a = p.parse_args(argv)
    a.server_arg = [*common.sim_server_flags(a), *a.server_arg]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load = round(os.getloadavg()[0], 2)
    if a.record and load >= a.max_load:
        print(
            f"not recording: the 1-minute load average is {load} (>= --max-load {a.max_load:g}); the machine is "
            "busy. Run it later, or without --record.",
            file=sys.stderr,
        )
        return 2
    name = common.run_name(a, "cpu-compare")
    log_dir = common.log_dir(a, name)
    rep: dict = {
        "provenance": report.provenance(),
        "loadavg_start": load,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
    }
    names = (*SERVERS, BASE) if a.base else SERVERS
    runs: dict[str, list[LoadResult]] = {n: [] for n in names}
    with common.guarded(rep) as stopping:
        for r in range(a.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order:
                if stopping:
                    raise KeyboardInterrupt
                res = one_window(n, a, log_dir, r)
                runs[n].append(res)
                print(
                    f"round {r + 1}/{a.repeats} {n:16s} CPU {report.fmt(res.server_cpu_ms_per_req, '.3f')} ms/req, "
                    f"p95 {res.p95_ms:.1f} ms, {res.achieved_rps:.0f} RPS, errors {res.error_count}",
                    flush=True,
                )
                time.sleep(0.5)
    rep["loadavg_end"] = round(os.getloadavg()[0], 2)
    if rep.get("interrupted") or rep.get("error") or not all(runs.values()):
        print("incomplete run: nothing summarised", file=sys.stderr)
        return 1
    rep["summary"] = summarise(runs)
    rep["runs"] = {n: [asdict(r) for r in rs] for n, rs in runs.items()}
    md = markdown(rep)
    print()
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a)), log_dir))
    return 0 if rep["summary"]["cpu_passed"] and rep["summary"]["p95_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
