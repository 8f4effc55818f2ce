"""`batchserve plan`, the command: its flags, the contract they describe (given, or measured by `plan_measure.py`),
and the plan rendered as a table or JSON (the arithmetic is `plan.py`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from batchserve.plan import HOURS_PER_MONTH, SIM_S, BatchTime, Contract, LatencyAtRate, Plan, Prices, make_plan
from batchserve.plan_measure import Measured, measure


DESCRIPTION = (
    "Nodes needed for a target rate at the SLO. Required: --rate, and exactly one of --batch-ms, "
    "--batch-ms-by-size or --measure URL (a running server). Defaults are shown beside each flag."
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default beside it, `(required)` on a required one; none shown for None, False or ""."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return f"{action.help} (required)"
        if action.default in (None, False, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`batchserve plan`'s flags, in three sections of its -h."""
    p = parser.add_argument_group("the workload")
    p.add_argument("--rate", type=float, required=True, help="target requests/s across the service")
    p.add_argument(
        "--slo-ms", type=float, default=None, help="p95 latency objective [200, or with --measure the server's]"
    )
    p.add_argument("--devices", type=int, default=None, help="devices (GPUs) per node [1, or measured]")
    p.add_argument("--max-batch", type=int, default=100, help="most inputs in one batch (--max-batch-size)")
    p.add_argument(
        "--batch-ms",
        type=float,
        default=None,
        help="batch time, the same at every size (this, --batch-ms-by-size or --measure is required)",
    )
    p.add_argument(
        "--batch-ms-by-size",
        default=None,
        metavar="SIZE:MS,...",
        help="batch time by batch size, e.g. 1:40,32:60,100:100 (linear between; this, --batch-ms or "
        "--measure is required)",
    )
    p.add_argument(
        "--timeout-ms",
        type=float,
        default=None,
        help="request deadline (--timeout-ms) [2000, or with --measure the server's]",
    )
    p.add_argument("--margin-ms", type=float, default=5.0, help="the server's --dispatch-margin-ms")
    p = parser.add_argument_group("a running server")
    p.add_argument(
        "--measure",
        default=None,
        metavar="URL",
        help="read devices and the batch time from a running server (/internal/health, /metrics; this, "
        "--batch-ms or --batch-ms-by-size is required)",
    )
    p.add_argument(
        "--probe",
        default="",
        metavar="SIZES",
        help="with --measure: send bursts of these sizes (e.g. 1,50,100) to learn batch time by size",
    )
    p.add_argument("--api-key", default="", help="with --probe: the key to send")
    p.add_argument("--model", default=None, help="with --measure: which model's batch time (default: the first)")
    p.add_argument(
        "--cpu-window-s",
        type=float,
        default=5.0,
        help="with --measure: seconds between the two /metrics reads that give CPU per request",
    )
    p = parser.add_argument_group("the node")
    for flag, kind, default, help in NODE_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=help)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


# A node's bounds and prices, and the simulation's own knobs: (flag, type, default, help).
NODE_FLAGS = (
    (
        "--overhead-ms",
        float,
        0.0,
        "per-request time outside the batcher (HTTP, event loop, network), added to every latency",
    ),
    ("--max-busy", float, 0.95, "the most device time a node is planned at, whatever the SLO allows"),
    (
        "--cpu-us-per-request",
        float,
        None,
        "one server process's CPU per request, microseconds (with --measure: read from the "
        "server's own counters over --cpu-window-s unless given)",
    ),
    (
        "--processes",
        int,
        None,
        "server processes per node (batchserve serve --processes), the devices split evenly [1, or measured]",
    ),
    ("--cores", float, 0.0, "cores the node's server processes may use (0 = one per process)"),
    ("--max-cpu-busy", float, 0.9, "the most of a core one process is planned at"),
    ("--gpu-cost-per-hour", float, 0.0, "price of one device (GPU) an hour"),
    ("--node-cost-per-hour", float, 0.0, "price of a node an hour beside its GPUs (CPUs, memory, network)"),
    ("--sim-s", float, SIM_S, "simulated seconds per point"),
)


DEFAULT_SLO_MS = 200.0
DEFAULT_TIMEOUT_MS = 2000.0


def measured_contract(a: argparse.Namespace) -> tuple[Contract, str, Measured | None]:
    """The contract the flags describe, what it was read from, and what `--measure` read (None without it); an
    unset SLO and deadline are the measured server's, else the defaults."""
    given = [x for x in (a.batch_ms, a.batch_ms_by_size, a.measure) if x is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --batch-ms, --batch-ms-by-size, --measure URL")
    if a.cpu_us_per_request is not None and a.cpu_us_per_request <= 0:
        raise ValueError("--cpu-us-per-request must be positive")
    cpu_s = a.cpu_us_per_request / 1e6 if a.cpu_us_per_request is not None else 0.0
    m, source, server = None, "given", {}  # server: the figures --measure read, for those the flags leave unset
    if a.measure is not None:
        sizes = [int(x) for x in a.probe.split(",") if x.strip()] if a.probe else []
        window = a.cpu_window_s if a.cpu_us_per_request is None else 0.0
        m = measure(a.measure, a.model, sizes, a.api_key, window)
        batch_time, source = m.batch_time, m.source
        cpu_s = cpu_s or (m.cpu_s_per_request or 0.0)
        server = {"devices": m.devices, "processes": m.processes, "slo_ms": m.slo_ms, "timeout_ms": m.timeout_ms}
        read = [
            f"{what} {server[name]:g} ms"
            for name, what in (("slo_ms", "SLO"), ("timeout_ms", "timeout"))
            if getattr(a, name) is None and server[name] is not None
        ]
        if read:
            source += f"; the server's {' and '.join(read)}"
    elif a.batch_ms_by_size is not None:
        batch_time = BatchTime.parse(a.batch_ms_by_size)
    else:
        if a.batch_ms <= 0:
            raise ValueError("--batch-ms must be positive")
        batch_time = BatchTime.constant(a.batch_ms)

    def figure(name: str, default: float) -> float:
        """The flag's value, else the measured server's, else the default."""
        value = getattr(a, name)
        value = server.get(name) if value is None else value
        return default if value is None else value

    devices, processes = int(figure("devices", 1)), int(figure("processes", 1))
    slo_ms, timeout_ms = figure("slo_ms", DEFAULT_SLO_MS), figure("timeout_ms", DEFAULT_TIMEOUT_MS)
    check_bounds(a, devices, processes, slo_ms)
    return (
        Contract(
            batch_time,
            devices,
            a.max_batch,
            slo_ms / 1000,
            a.margin_ms / 1000,
            timeout_ms / 1000,
            a.overhead_ms / 1000,
            a.max_busy,
            cpu_s,
            processes,
            a.cores,
            a.max_cpu_busy,
        ),
        source,
        m,
    )


def check_bounds(a: argparse.Namespace, devices: int, processes: int, slo_ms: float) -> None:
    if devices < 1 or a.max_batch < 1 or slo_ms <= 0 or not 0 < a.max_busy <= 1:
        raise ValueError("--devices and --max-batch must be >= 1, --slo-ms positive, --max-busy in (0, 1]")
    if processes < 1 or a.cores < 0 or not 0 < a.max_cpu_busy <= 1:
        raise ValueError("--processes must be >= 1, --cores 0 or more, --max-cpu-busy in (0, 1]")
    if a.gpu_cost_per_hour < 0 or a.node_cost_per_hour < 0:
        raise ValueError("--gpu-cost-per-hour and --node-cost-per-hour must be 0 or more")


def limits_line(plan: Plan) -> str:
    """Which limit binds, beside the other."""
    c = plan.contract
    procs = f"{c.processes} process(es)" + (
        f" on {c.cores:g} core(s)" if c.cores and c.cores < c.processes else ", a core each"
    )
    cpu = (
        "CPU not modelled (give --cpu-us-per-request, or --measure a loaded server)"
        if math.isinf(plan.cpu_capacity)
        else f"CPU {plan.cpu_capacity:.0f} ({procs} at {c.max_cpu_busy:.0%}, "
        f"{c.cpu_s_per_request * 1e6:.0f} us per request)"
    )
    name = {"cpu": "the CPU", "devices": "the devices (full-batch cap)", "slo": "the SLO on the devices"}
    return f"limits            devices {plan.device_capacity:.0f}; {cpu}: {name[plan.binding]} binds"


def one_down_line(plan: Plan, d: LatencyAtRate) -> str:
    """What the other nodes serve while one is down, and whether that holds the SLO."""
    c = plan.contract
    each = plan.target_rate / (plan.nodes - 1)
    over_cpu = each > plan.cpu_capacity
    verdict = (
        "within the SLO"
        if d.meets(c.slo_s) and not over_cpu
        else (
            f"{'past the CPU ceiling' if over_cpu else 'over the SLO'}"
            f"{f', {d.expired:.0%} time out' if d.expired else ''}: plan "
            f"{plan.nodes_for_one_down} nodes to lose one (or restart one at a time) safely"
        )
    )
    return f"one node down     {plan.nodes - 1} nodes at {each:.0f} requests/s each: p95 {d.p95_ms:.0f} ms, {verdict}"


def render(plan: Plan, source: str) -> str:
    c, t = plan.contract, plan.at_target
    slo = c.slo_s * 1000
    capped = plan.device_capacity >= c.max_busy * c.ceiling() * (1 - 1e-9)
    bound = f"capped at {c.max_busy:.0%} of" if capped else "ceiling"
    split = f" in {c.processes} processes of {c.devices // c.processes}" if c.processes > 1 else ""
    cpu = f", bound by its CPU (devices alone: {plan.device_capacity:.0f}, " if plan.binding == "cpu" else " ("
    lines = [
        f"target {plan.target_rate:g} requests/s at p95 <= {slo:g} ms",
        f"node: {c.devices} device(s){split}, batches of 1..{c.max_batch}, batch time {c.batch_time.describe()} "
        f"({source}), dispatch margin {c.margin_s * 1000:g} ms, overhead {c.overhead_s * 1000:g} ms",
        f"one node serves {plan.capacity:.0f} requests/s within the SLO{cpu}{bound} {c.ceiling():.0f} at full batches)",
        limits_line(plan),
        "",
        f"nodes needed      {plan.nodes}  ({plan.target_rate / plan.nodes:.0f} requests/s each)",
        f"predicted         p50 {t.p50_ms:.0f} ms, p95 {t.p95_ms:.0f} ms, p99 {t.p99_ms:.0f} ms; "
        f"mean batch {t.mean_batch:.1f}, {t.load:.0%} of the full-batch ceiling",
        f"headroom          {plan.headroom:.1%} more load (to {plan.target_rate * (1 + plan.headroom):.0f} "
        f"requests/s) before a node passes its {plan.capacity:.0f} requests/s",
    ]
    if plan.note:
        lines.append(f"note              {plan.note}")
    if plan.one_down is not None:
        lines.append(one_down_line(plan, plan.one_down))
    if plan.processes_for_cpu:
        p = plan.processes_for_cpu
        lines.append(
            f"processes         the CPU binds: --processes {p} ({c.devices // p} device(s) each) lifts "
            f"it to {replace(c, processes=p).cpu_ceiling():.0f} requests/s a node"
        )
    elif plan.binding == "cpu":
        lines.append(
            "processes         the CPU binds and no split of the devices lifts it: more nodes, or less CPU per request"
        )
    if plan.cost is not None:
        k = plan.cost
        lines.append(
            f"cost              {k.per_hour:,.2f} an hour for {plan.nodes} node(s) ({k.per_node_hour:,.2f} "
            f"each); {k.per_1000_requests:.4f} per 1,000 requests at {plan.target_rate:g} requests/s; "
            f"{k.per_month:,.0f} a month ({HOURS_PER_MONTH:g} h)"
        )
    lines.append(
        "(model: the batcher's policy on Poisson arrivals, no server overhead beyond --overhead-ms, and "
        "a process's CPU as a ceiling, not a latency; see docs/capacity.md)"
    )
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    try:
        contract, source, m = measured_contract(a)
    except (ValueError, OSError) as exc:
        print(f"batchserve plan: {exc}", file=sys.stderr)
        return 2
    prices = Prices(a.gpu_cost_per_hour, a.node_cost_per_hour)
    try:
        plan = make_plan(a.rate, contract, a.sim_s, a.seed, prices if prices != Prices() else None)  # unpriced: no cost
    except ValueError as exc:
        hint = ""
        if m is not None and not m.probed:  # the learned batch time at every size: small batches may be faster
            hint = (
                f"; the batch time was the server's learned {contract.batch_time(1) * 1000:g} ms taken at every "
                f"size: --probe 1,8,32 measures it by size (a real model's small batches are often faster)"
            )
        print(f"batchserve plan: {exc}{hint}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=1) if a.json else render(plan, source))
    return 0
