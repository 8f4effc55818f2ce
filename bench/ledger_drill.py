"""The overload drill's ledger (issue 33): two keyed tenants drive a sim server past its capacity for a few
seconds, each client counting its own answers, and the server's SLO ledger is read back: the sum over outcomes
of `batchserve_slo_requests_total` against the requests sent, its `met` against the clients' own count of
answers within the SLO, and each key's `GET /v1/usage` against that client's counts.

Two client-side counts of "within the SLO": by the `latency_ms` the server put in each answer (rounded to the
ms, stamped as the answer is made), and by the client's own clock (the request's write to its answer's bytes
arriving). The ledger's clock runs from the request's first byte read to its answer written, so it sits
between the two; issue 46 asks it to agree with the client's clock within 1 % of the requests at <= 0.8x
capacity. What still parts them is each side's wake-up (the server reading the request, the client reading the
answer: about 0.6 ms together on a shared 2-core machine), so how far they part depends on how many answers
land within that much of the SLO: at the contract's 100 ms batches and a 200 ms SLO,

    python -m bench.ledger_drill --seconds 30 --sim-batch-ms 100 --max-batch-size 10 --max-queue 20 \
        --slo-ms 200 --rates 50,30       # 0.8x capacity: the agreement issue 46 asks for

    python -m bench.ledger_drill                     # ~15 s: the overload drill's table
    python -m bench.ledger_drill --record            # and bench/results/ledger-drill-<time>.{md,json}

The integration test tests/integration/core/test_ledger.py runs `drill` against its own server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import orjson
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench import common, report, servers
from bench.rawclient import drive_raw

OUTCOMES = ("met", "slow", "refused", "expired", "failed")


@dataclass
class Tenant:
    name: str
    tier: str
    rate: float  # requests per second the client sends, open loop
    key: str = ""
    key_rate: float | None = None  # the key's own rate limit (None: the tier's)


@dataclass
class Tally:
    """One client's own count of what it sent and what came back."""

    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    met_by_server_latency: int = 0  # 2xx whose answer's latency_ms is within the SLO
    met_by_client_clock: int = 0  # 2xx the client itself saw within the SLO
    transport_errors: int = 0  # no HTTP answer at all (must stay 0: the ledger counts answers)
    client_ms: list[float] = field(default_factory=list)

    def outcomes(self) -> dict[str, int]:
        """The client's count in the ledger's terms (met by the server-reported latency)."""
        s = self.statuses
        ok = sum(n for st, n in s.items() if 200 <= st < 300)
        return {
            "met": self.met_by_server_latency,
            "slow": ok - self.met_by_server_latency,
            "refused": s.get(429, 0) + s.get(503, 0),
            "expired": s.get(504, 0),
            "failed": sum(n for st, n in s.items() if st >= 500 and st not in (503, 504)),
        }


async def drive(url: str, tenant: Tenant, seconds: float, slo_ms: float, timeout_ms: float, tally: Tally) -> None:
    """Open-loop load: one request every 1/rate s for `seconds`, whatever the answers; then waits for all. Sent by
    the raw client (`bench/rawclient.py`) on uvloop: its clock runs from the request's write to its answer's
    bytes arriving (a connection opened for it included), with a fraction of aiohttp's CPU, whose own event
    loop lag would otherwise be most of what the client's clock adds to the server's."""
    n = int(seconds * tenant.rate)
    out = await drive_raw(
        url + "/v1/inference",
        np.arange(n) / tenant.rate,
        np.arange(n),
        time.monotonic(),
        lambda i: f"{tenant.name}-{i}",
        timeout_ms / 1000 + 30,
        connections=1024,
        headers={"Authorization": f"Bearer {tenant.key}"},
        extra={"timeout_ms": timeout_ms},
    )
    tally.sent = n
    ok = ~np.isnan(out.latency_s)
    took_ms = (out.latency_s[ok] - out.lag_s[ok]) * 1000
    tally.statuses[200] = int(ok.sum())
    tally.client_ms = [float(x) for x in took_ms]
    tally.met_by_server_latency = int((out.server_ms[ok] <= slo_ms).sum())
    tally.met_by_client_clock = int((took_ms <= slo_ms).sum())
    for _, outcome in out.errors:
        status = outcome.split(" ", 1)[0]
        if status.isdigit():
            tally.statuses[int(status)] = tally.statuses.get(int(status), 0) + 1
        else:  # no HTTP answer (a connection error, the client's timeout) or a wrong one
            tally.transport_errors += 1


def get(url: str, key: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read()


def ledger_of(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """`batchserve_slo_requests_total` by (model, tier, outcome), parsed by prometheus-client's own parser."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "batchserve_slo_requests_total":
                out[(s.labels["model"], s.labels["tier"], s.labels["outcome"])] = s.value
    return out


def by_outcome(ledger: dict[tuple[str, str, str], float], tier: str | None = None) -> dict[str, int]:
    return {o: int(sum(v for (_, t, oc), v in ledger.items() if oc == o and tier in (None, t))) for o in OUTCOMES}


def drill(url: str, tenants: list[Tenant], seconds: float, slo_ms: float, timeout_ms: float) -> dict:
    """Drive every tenant at once, then read the server's books: the clients' tallies, the ledger by outcome
    (all, and per tier), and each key's /v1/usage."""
    tallies = {t.name: Tally() for t in tenants}

    async def all_of() -> None:
        await asyncio.gather(*(drive(url, t, seconds, slo_ms, timeout_ms, tallies[t.name]) for t in tenants))

    uvloop.run(all_of())
    ledger = ledger_of(get(url + "/metrics").decode())
    usage = {t.name: orjson.loads(get(url + "/v1/usage", t.key))["data"][0] for t in tenants}
    return {
        "tallies": tallies,
        "ledger": ledger,
        "server": by_outcome(ledger),
        "server_by_tier": {t.tier: by_outcome(ledger, t.tier) for t in tenants},
        "usage": usage,
    }


def write_keys(config: Path, tenants: list[Tenant]) -> None:
    from batchserve.config_file import append_key
    from batchserve.http.guards import digest, new_key

    for t in tenants:
        t.key = new_key()
        append_key(str(config), t.name, t.tier, digest(t.key), t.key_rate)


def admitted(counts: dict[str, int]) -> int:
    return counts["met"] + counts["slow"] + counts["expired"] + counts["failed"]


def attainment(counts: dict[str, int]) -> float:
    """SLO attainment of admitted requests: met / (met + slow + expired + failed), as the alert rule reads it."""
    return counts["met"] / max(1, admitted(counts))


def markdown(rep: dict, result: dict) -> str:
    a = rep["settings"]
    rows = []
    for name, tally in result["tallies"].items():
        mine, usage = tally.outcomes(), result["usage"][name]["requests"]
        rows.append(
            [
                name,
                tally.sent,
                *[f"{mine[o]} / {usage[o]}" for o in OUTCOMES],
                sum(usage.values()),
                tally.met_by_client_clock,
                tally.transport_errors,
            ]
        )
    total = {o: sum(t.outcomes()[o] for t in result["tallies"].values()) for o in OUTCOMES}
    sent = sum(t.sent for t in result["tallies"].values())
    server = result["server"]
    rows.append(
        [
            "all (clients / server ledger)",
            sent,
            *[f"{total[o]} / {server[o]}" for o in OUTCOMES],
            sum(server.values()),
            sum(t.met_by_client_clock for t in result["tallies"].values()),
            sum(t.transport_errors for t in result["tallies"].values()),
        ]
    )
    m = rep["machine"]
    who = ", ".join(f"{t['name']} ({t['tier']}) {t['rate']:g}/s" for t in a["tenants"])
    tiers = "; ".join(
        f"{tier} {attainment(counts):.3f} of {admitted(counts)} admitted, {counts['refused']} refused"
        for tier, counts in result["server_by_tier"].items()
    )
    setting = (
        f"Sim server: 1 device, {a['sim_batch_ms']:g} ms batches of at most {a['max_batch_size']}, "
        f"--max-queue {a['max_queue']}, --slo-ms {a['slo_ms']:g}, requests' timeout_ms {a['timeout_ms']:g}; "
        f"{a['seconds']:g} s of open-loop load from two keyed tenants ({who}) against a capacity of "
        f"~{a['capacity_rps']:.0f} requests/s. Client and server share the machine "
        f"({m.get('cores_usable', '?')} usable cores, {m.get('cpu_model', '?')}, load average "
        f"{rep['loadavg_before']} before, {rep['loadavg_after']} after); commit "
        f"{rep['git'].get('commit', '?')[:12]}."
    )
    legend = (
        "Each cell: the client's own count / the server's (the tenant's GET /v1/usage; the last row: the sum "
        "of `batchserve_slo_requests_total`). Client `met` counts 2xx answers whose `latency_ms` (the "
        "server's time, which the SLO is held to) is within the SLO; `met by client clock` counts those the "
        "client itself saw within it (the raw client's clock, on uvloop, from the request's write to its "
        "answer's last bytes arriving, a connection opened for it included)."
    )
    by_clock = sum(t.met_by_client_clock for t in result["tallies"].values())
    apart = server["met"] - by_clock
    summary = (
        f"The ledger's `met` against the clients' clock: {server['met']} / {by_clock}, {apart:+d} "
        f"({abs(apart) / max(1, sent):.2%} of the requests sent; issue 46 asks within 1 % at <= 0.8x capacity). "
        f"SLO attainment of admitted requests (met / (met + slow + expired + failed)): "
        f"{rep['attainment']:.3f}; of all requests sent (met / sent): {server['met'] / max(1, sent):.3f}. "
        f"Per tier, from /metrics: {tiers}."
    )
    lines = [
        "# The overload drill's ledger (bench/ledger_drill.py)",
        "",
        setting,
        "",
        legend,
        "",
        report.table(["tenant", "sent", *OUTCOMES, "server sum", "met by client clock", "no answer"], rows),
        "",
        summary,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of load (default %(default)g)")
    p.add_argument("--sim-batch-ms", type=float, default=40.0)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--slo-ms", type=float, default=150.0)
    p.add_argument("--timeout-ms", type=float, default=600.0, help="each request's timeout_ms")
    p.add_argument("--rates", default="120,60", help="requests/s of the two tenants (default %(default)s)")
    common.add_output_flags(p, name="ledger-drill")
    a = p.parse_args(argv)
    ra, rb = (float(r) for r in a.rates.split(","))
    tenants = [Tenant("alpha", "paid", ra, key_rate=10000), Tenant("beta", "free", rb, key_rate=40)]
    name = common.run_name(a, "ledger-drill")
    rep: dict = {
        **report.provenance(),
        "settings": {
            "seconds": a.seconds,
            "sim_batch_ms": a.sim_batch_ms,
            "max_batch_size": a.max_batch_size,
            "max_queue": a.max_queue,
            "slo_ms": a.slo_ms,
            "timeout_ms": a.timeout_ms,
            "capacity_rps": a.max_batch_size / a.sim_batch_ms * 1000,
            "tenants": [{"name": t.name, "tier": t.tier, "rate": t.rate, "key_rate": t.key_rate} for t in tenants],
        },
    }
    rep["loadavg_before"] = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="ledger-drill-") as tmp, common.guarded():
        config = Path(tmp) / "keys.toml"
        write_keys(config, tenants)
        cmd = servers.batchserve_cmd(
            1,
            a.sim_batch_ms,
            a.max_batch_size,
            ["--config", str(config), "--max-queue", str(a.max_queue), "--slo-ms", f"{a.slo_ms:g}"],
        )
        server = servers.start("batchserve", cmd, common.log_dir(a, name))
        result = drill(server.base, tenants, a.seconds, a.slo_ms, a.timeout_ms)
    rep["loadavg_after"] = round(os.getloadavg()[0], 2)
    s = result["server"]
    rep["attainment"] = attainment(s)
    rep["clients"] = {
        n: {**asdict(t), "client_ms": None, "outcomes": t.outcomes()} for n, t in result["tallies"].items()
    }
    rep["server"], rep["server_by_tier"], rep["usage"] = s, result["server_by_tier"], result["usage"]
    md = markdown(rep, result)
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
