"""`batchserve plan`: how many nodes a target rate needs at the SLO, and the latency they will give.

Why a simulation and not a formula: what a request waits is set by the batcher's policy, which no queueing
formula describes — a batch leaves when it is full (`max_batch_size`), when its oldest item's dispatch deadline
arrives (`arrived + slo − S − margin`), or by pacing (`S/G` after the previous dispatch; S = learned batch time,
G = devices), and only when a device is free. So the planner runs that policy, event by event, with zero
overhead, on Poisson arrivals: the same model as `bench/ideal.py` (which the tests check it against), in pure
Python so the package needs nothing more. The batch time may depend on the batch size (`BatchTime`); S is
learned as the server learns it (an exponentially weighted average of the batch times, weight 0.2).

A node's capacity at the SLO is the highest arrival rate whose simulated p95 stays within the SLO with nothing
timing out; nodes = ceil(target / capacity), with the load balancer splitting arrivals evenly (a Poisson stream
split at random stays Poisson). Every rate is simulated on the same unit-exponential gaps scaled by 1/rate
(common random numbers), so p95 rises smoothly with the rate and the bisection for the capacity is stable.
What the model leaves out — HTTP, the event loop, the client, admission's refusals near overload — makes
measured latency higher; `--overhead-ms` adds a fixed per-request amount, and docs/capacity.md gives the error
against the measured bench rows.

The host's CPU is the other ceiling: one server process runs one event loop, on one core, and every request
costs it a fixed amount of CPU (parsing, admission, answering), so a process serves at most
`max_cpu_busy / cpu per request` whatever its devices. With `--processes P` a node is P such processes, each
with devices/P devices (`batchserve serve --processes`); the node's capacity is the lower of the devices' (the
simulation, per process) and the CPU's, and the plan says which binds. Prices turn the node count into a cost
per 1,000 requests and per month.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import http.client
import json
import math
import random
import statistics
import sys
import time
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

EWMA_ALPHA = 0.2  # as batcher.EWMA_ALPHA: weight of the newest batch in the learned batch time
SIM_S = 30.0  # simulated seconds per point, after the warm-up
WARMUP_S = 5.0
BISECT_STEPS = 12  # capacity to ceiling / 4096
CHECK_POINTS = 8  # rates under a bisected capacity checked to meet the SLO too (see `capacity`)
RECHECKS = 6  # searches started over beneath a rate that missed, before no capacity is trusted
PLAN_RETRIES = 8  # plans redone with a capacity below the per-node rate whose prediction missed
TRICKLE = 0.05  # a capacity under this share of the ceiling is no plan: the SLO is missed at any real load
HOURS_PER_MONTH = 730.0  # 365 x 24 / 12
MIN_CPU_SAMPLE = 50  # requests a --measure window must see before its CPU per request is believed
KEEP_ALIVE_PING_S = 1.0  # a GET /healthz this often holds the CPU window's connection open (see cpu_per_request)
CPU_WINDOW_TRIES = 3  # windows started over on a fresh connection when the server closes it all the same


@dataclass(frozen=True)
class BatchTime:
    """Seconds one batch takes, by its size: linear between the given sizes, flat beyond the ends."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def constant(cls, ms: float) -> BatchTime:
        return cls((1,), (ms / 1000,))

    @classmethod
    def parse(cls, text: str) -> BatchTime:
        """`1:100,100:100` (size:milliseconds pairs)."""
        points: dict[int, float] = {}
        for part in text.split(","):
            size, sep, ms = part.strip().partition(":")
            try:
                if not sep or int(size) < 1 or float(ms) <= 0:
                    raise ValueError
                points[int(size)] = float(ms) / 1000
            except ValueError:
                raise ValueError(
                    f"batch times must read size:ms,size:ms (sizes >= 1, times > 0), not {part!r}"
                ) from None
        ordered = sorted(points.items())
        return cls(tuple(s for s, _ in ordered), tuple(t for _, t in ordered))

    def __call__(self, size: int) -> float:
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):
            return self.seconds[-1]
        s0, s1, t0, t1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
        return t0 + (t1 - t0) * (size - s0) / (s1 - s0)

    def describe(self) -> str:
        if len(set(self.seconds)) == 1:
            return f"{self.seconds[0] * 1000:g} ms at every size"
        return ", ".join(f"{s}: {t * 1000:g} ms" for s, t in zip(self.sizes, self.seconds))


@dataclass(frozen=True)
class Contract:
    """One node: what it runs and the objective it is held to."""

    batch_time: BatchTime
    devices: int = 1
    max_batch: int = 100
    slo_s: float = 0.2
    margin_s: float = 0.005
    timeout_s: float = 2.0
    overhead_s: float = 0.0  # per request, outside the batcher (HTTP, event loop, network)
    max_busy: float = 0.95  # the most device time a node is planned at (see `capacity`)
    cpu_s_per_request: float = 0.0  # one process's CPU per request (0 = leave the CPU out)
    processes: int = 1  # server processes per node, the devices split evenly between them
    cores: float = 0.0  # cores the node's server processes may use (0 = one per process; a sidecar may leave 1.5)
    max_cpu_busy: float = 0.9  # the most of a core one process is planned at

    def __post_init__(self) -> None:
        if self.processes < 1 or self.devices % self.processes:
            raise ValueError(
                f"{self.devices} device(s) do not split evenly over {self.processes} processes "
                f"(each process runs the same number)"
            )

    def ceiling(self) -> float:
        """Requests/s one node serves at full batches on every device: no rate at or above it is stable."""
        return self.devices * self.max_batch / self.batch_time(self.max_batch)

    def per_process(self) -> Contract:
        """One of the node's processes: its share of the devices, its own batcher (the simulation's unit)."""
        return replace(self, devices=self.devices // self.processes, processes=1, cores=0.0)

    def cpu_ceiling(self) -> float:
        """Requests/s the node's CPU allows: each process's loop at `max_cpu_busy` of one core, on at most
        `cores` cores (processes beyond the cores share them); infinite when the CPU is left out."""
        if self.cpu_s_per_request <= 0:
            return math.inf
        cores = min(self.processes, self.cores) if self.cores else self.processes
        return cores * self.max_cpu_busy / self.cpu_s_per_request


@dataclass
class LatencyAtRate:
    """One node's latency percentiles at a request rate, as the planner's simulation gives them (not admission's
    per-request `core.admission.Prediction`)."""

    rate: float  # per node
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float
    expired: float  # share of requests the model answers 504 (their deadline passed in the queue)
    load: float  # rate over the ceiling (full batches on every device)

    def meets(self, slo_s: float) -> bool:
        return self.expired == 0 and self.p95_ms <= slo_s * 1000


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def simulate(arrivals: list[float], c: Contract) -> tuple[list[float], list[int]]:
    """The batcher's policy on these arrival times (sorted, seconds): each arrival's answer time (NaN when it
    expired in the queue) and the size of each batch.

    One free device at a time waits for its batch and takes it at the first of: full; the oldest item's
    dispatch deadline; `S/G` after the previous dispatch. The batch is formed at that instant, runs
    `batch_time(size)`, and its items are answered at the end."""
    n = len(arrivals)
    done = [math.nan] * n
    sizes: list[int] = []
    free = [0.0] * max(1, c.devices)  # when each device is next free (a heap)
    learned = c.batch_time(c.max_batch)  # S: the server starts from its guess and learns from every batch
    last_dispatch = -math.inf
    q: deque[int] = deque()
    i, now = 0, 0.0
    while True:
        now = max(now, free[0])  # the first device to be free takes the turn
        while True:  # it waits for its batch
            while i < n and arrivals[i] <= now:
                q.append(i)
                i += 1
            while q and arrivals[q[0]] + c.timeout_s <= now:
                q.popleft()  # expired: answered 504, never dispatched
            if not q:
                if i >= n:
                    return done, sizes
                now = arrivals[i]
                continue
            if len(q) >= c.max_batch:
                break
            delay = max(0.0, c.slo_s - learned - c.margin_s)
            # One device takes what waits as soon as it frees (batcher.most_urgent); several are paced S/G apart.
            pace = now if c.devices <= 1 else last_dispatch + learned / c.devices
            due = min(arrivals[q[0]] + delay, pace)
            if due <= now:
                break
            if i < n and arrivals[i] < due:
                now = arrivals[i]  # an arrival may fill the batch before it is due
                continue
            now = due
            break
        batch: list[int] = []
        while q and len(batch) < c.max_batch:
            j = q.popleft()
            if arrivals[j] + c.timeout_s > now:  # an expired item is dropped as the batch forms (the 504)
                batch.append(j)
        if batch:
            run_s = c.batch_time(len(batch))
            end = now + run_s
            for j in batch:
                done[j] = end
            sizes.append(len(batch))
            heapq.heapreplace(free, end)
            last_dispatch = now
            learned += EWMA_ALPHA * (run_s - learned)


@dataclass
class PoissonArrivals:
    """Unit-exponential gaps drawn once per seed; `at(rate, seconds)` scales them, so every rate sees the same
    draws (common random numbers) and a prediction moves smoothly with the rate."""

    seed: int = 1
    gaps: list[float] = field(default_factory=list)
    _rng: random.Random | None = None

    def at(self, rate: float, seconds: float) -> list[float]:
        if self._rng is None:
            self._rng = random.Random(self.seed)
        times: list[float] = []
        t, k = 0.0, 0
        while True:
            if k == len(self.gaps):
                self.gaps.extend(self._rng.expovariate(1.0) for _ in range(4096))
            t += self.gaps[k] / rate
            if t >= seconds:
                return times
            times.append(t)
            k += 1


def latency_at(
    rate: float, c: Contract, arrivals: PoissonArrivals | None = None, sim_s: float = SIM_S, warmup_s: float = WARMUP_S
) -> LatencyAtRate:
    """Latency percentiles of one node at `rate` requests/s, over `sim_s` seconds after a warm-up."""
    if rate <= 0:
        base = (c.batch_time(1) + c.overhead_s) * 1000
        return LatencyAtRate(rate, base, base, base, 0.0, 0.0, 0.0)
    times = (arrivals or PoissonArrivals()).at(rate, warmup_s + sim_s)
    done, sizes = simulate(times, c)
    latencies, expired, counted = [], 0, 0
    for t, d in zip(times, done):
        if t < warmup_s:
            continue
        counted += 1
        if math.isnan(d):
            expired += 1
        else:
            latencies.append((d - t + c.overhead_s) * 1000)
    latencies.sort()
    return LatencyAtRate(
        rate,
        percentile(latencies, 50),
        percentile(latencies, 95),
        percentile(latencies, 99),
        statistics.fmean(sizes) if sizes else 0.0,
        expired / max(1, counted),
        rate / c.ceiling(),
    )


def capacity(
    c: Contract,
    arrivals: PoissonArrivals | None = None,
    sim_s: float = SIM_S,
    steps: int = BISECT_STEPS,
    below: float | None = None,
) -> float:
    """The highest rate (requests/s, one node) whose p95 stays within the SLO with nothing expired — at that
    rate and at every rate checked below it — and at most `max_busy` of the ceiling (and under `below`, a rate
    known to miss); 0 when even a lone request misses the SLO.

    Why the cap: close to the ceiling a queue's steady state takes far longer to reach than any window one
    can simulate (or than the load stays Poisson), so a finite window would call a node that slowly drowns
    healthy. With several devices the SLO alone binds only there: the dispatch deadline leaves room for
    many paced batches, so p95 stays flat until the devices saturate.

    Why the check below: when a big batch takes much longer than a small one (a batch time that jumps with
    the size), the queue is bistable: one burst forms a slow batch, during which enough arrive to form the
    next slow one, and it stays slow. Whether a finite window tips depends on its draws, so p95 is not
    monotone in the rate and a bisection can land on a lucky rate just above unlucky ones. The rates of a
    grid under the bisected one are checked, and a miss among them starts the search over beneath it."""
    arrivals = arrivals or PoissonArrivals()
    top = c.ceiling() * c.max_busy if below is None else min(below, c.ceiling() * c.max_busy)
    for _ in range(RECHECKS):
        cap = _bisect_capacity(c, arrivals, sim_s, steps, top, top_known_to_miss=below is not None)
        if cap <= 0:
            return 0.0
        missed = next(
            (r for r in (cap * k / CHECK_POINTS for k in range(1, CHECK_POINTS)) if not _meets(r, c, arrivals, sim_s)),
            None,
        )
        if missed is None:
            return cap
        top, below = missed, missed
    return 0.0  # it keeps tipping lower: no rate can be trusted


def _meets(rate: float, c: Contract, arrivals: PoissonArrivals, sim_s: float) -> bool:
    """Whether one node meets the SLO at `rate`; a rate so low that nothing arrived in the window is a
    request alone (p95 NaN is no evidence of a miss)."""
    p = latency_at(rate, c, arrivals, sim_s)
    return (latency_at(0.0, c) if math.isnan(p.p95_ms) else p).meets(c.slo_s)


def _bisect_capacity(
    c: Contract, arrivals: PoissonArrivals, sim_s: float, steps: int, top: float, top_known_to_miss: bool
) -> float:
    lo, hi = 0.0, top
    if not top_known_to_miss and _meets(hi, c, arrivals, sim_s):
        return hi
    if not _meets(hi * 2**-steps, c, arrivals, sim_s):
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if _meets(mid, c, arrivals, sim_s):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Prices:
    """What a node costs an hour: its GPUs and the rest of it (CPUs, memory, network)."""

    gpu_per_hour: float = 0.0
    node_per_hour: float = 0.0

    def node_hour(self, devices: int) -> float:
        return devices * self.gpu_per_hour + self.node_per_hour


@dataclass
class Cost:
    per_node_hour: float
    per_hour: float  # all the planned nodes
    per_1000_requests: float  # at the target rate, the nodes fully paid
    per_month: float  # HOURS_PER_MONTH of the planned nodes


@dataclass
class Plan:
    target_rate: float
    contract: Contract
    capacity: float  # per node, at the SLO: the lower of the two below
    device_capacity: float  # what the node's devices serve within the SLO (P processes x the simulation)
    cpu_capacity: float  # what the node's CPU serves (inf when the CPU is left out)
    binding: str  # "slo", "devices" (the full-batch cap) or "cpu"
    nodes: int
    at_target: LatencyAtRate  # each process at target / (nodes x processes)
    headroom: float  # share of extra load the planned nodes take before p95 passes the SLO
    one_down: LatencyAtRate | None  # each node at target / (nodes - 1): a node lost or restarting
    nodes_for_one_down: int
    cost: Cost | None = None
    processes_for_cpu: int | None = None  # when the CPU binds: processes per node that lift it above the devices
    note: str = ""  # why the capacity is lower than a rate that met the SLO, when it is

    def as_dict(self) -> dict:
        d = asdict(self)
        d["contract"]["batch_time"] = {
            "sizes": list(self.contract.batch_time.sizes),
            "ms": [t * 1000 for t in self.contract.batch_time.seconds],
        }
        if math.isinf(self.cpu_capacity):
            d["cpu_capacity"] = None  # JSON has no infinity
        return d


def processes_for_cpu(c: Contract) -> int | None:
    """The fewest processes (dividing the devices, within `cores`) whose CPU ceiling reaches the devices' cap,
    when the CPU binds now; None when it does not bind or no split lifts it."""
    if c.cpu_ceiling() >= c.max_busy * c.ceiling():
        return None
    for p in range(c.processes + 1, c.devices + 1):
        if c.devices % p == 0 and (not c.cores or p <= c.cores):
            if replace(c, processes=p).cpu_ceiling() >= c.max_busy * c.ceiling():
                return p
    return None


def plan_cost(target_rate: float, nodes: int, c: Contract, prices: Prices) -> Cost:
    node_hour = prices.node_hour(c.devices)
    per_hour = nodes * node_hour
    return Cost(node_hour, per_hour, per_hour / (target_rate * 3600) * 1000, per_hour * HOURS_PER_MONTH)


def make_plan(
    target_rate: float, c: Contract, sim_s: float = SIM_S, seed: int = 1, prices: Prices | None = None
) -> Plan:
    if target_rate <= 0:
        raise ValueError("the target rate must be positive")
    arrivals = PoissonArrivals(seed)
    proc = c.per_process()
    device_cap = capacity(proc, arrivals, sim_s) * c.processes
    notes: list[str] = []
    for _ in range(PLAN_RETRIES):
        _check_device_capacity(device_cap, c)
        cap, binding = _binding(device_cap, c)
        nodes = max(1, math.ceil(target_rate / cap - 1e-9))
        per_proc = nodes * c.processes
        at_target = latency_at(target_rate / per_proc, proc, arrivals, sim_s)
        if at_target.meets(c.slo_s):
            break
        # The plan's own rate misses although a higher one met: p95 is not monotone in the rate here (see
        # `capacity`), so the capacity is what meets beneath the rate that missed.
        missed = target_rate / per_proc
        notes.append(
            f"at {missed:.0f} requests/s a process, p95 is {at_target.p95_ms:.0f} ms"
            + (f", {at_target.expired:.0%} time out" if at_target.expired else "")
        )
        device_cap = capacity(proc, arrivals, sim_s, below=missed * (1 - 1e-6)) * c.processes
    note = ""
    if notes:
        note = (
            "p95 is not monotone in the rate with this batch time (a slow big batch lets enough arrive to "
            "form the next, and the queue stays slow): " + "; ".join(notes) + " although a higher rate met the "
            "SLO in its window, so the capacity is what meets beneath them"
        )
        if not at_target.meets(c.slo_s):
            note += f"; after {PLAN_RETRIES} tries the plan still misses the SLO at its own rate: do not trust it"
    one_down = latency_at(target_rate / (per_proc - c.processes), proc, arrivals, sim_s) if nodes > 1 else None
    return Plan(
        target_rate,
        c,
        cap,
        device_cap,
        c.cpu_ceiling(),
        binding,
        nodes,
        at_target,
        nodes * cap / target_rate - 1,
        one_down,
        nodes + 1,
        plan_cost(target_rate, nodes, c, prices) if prices else None,
        processes_for_cpu(c) if binding == "cpu" else None,
        note,
    )


def _check_device_capacity(device_cap: float, c: Contract) -> None:
    """No plan when no rate, or only a trickle, meets the SLO: say why."""
    if device_cap <= 0:
        raise ValueError(
            f"no rate meets a {c.slo_s * 1000:g} ms SLO: one batch alone takes "
            f"{c.batch_time(1) * 1000:g} ms (+{c.overhead_s * 1000:g} ms overhead)"
        )
    if device_cap < TRICKLE * c.ceiling():
        raise ValueError(
            f"p95 meets {c.slo_s * 1000:g} ms only below {device_cap:.1f} requests/s a node "
            f"({device_cap / c.ceiling():.1%} of its {c.ceiling():.0f} at full batches): at any real load a request "
            f"waits up to the pace interval S/G or its dispatch deadline (slo - S - margin) for a batch, then runs "
            f"S, plus {c.overhead_s * 1000:g} ms overhead; it takes more devices per node, a shorter batch or a "
            f"looser SLO"
        )


def _binding(device_cap: float, c: Contract) -> tuple[float, str]:
    """The node's capacity (the lower of the devices' and the CPU's) and which of them binds."""
    cpu_cap = c.cpu_ceiling()
    if cpu_cap < device_cap:
        return cpu_cap, "cpu"
    if device_cap >= c.max_busy * c.ceiling() * (1 - 1e-9):
        return device_cap, "devices"
    return device_cap, "slo"


# -- measuring a running server ------------------------------------------------------------------------------
@dataclass
class Measured:
    devices: int
    batch_time: BatchTime
    source: str
    cpu_s_per_request: float | None = None  # from the process's own counters over a window under load
    processes: int = 1  # a `serve --processes` node: `devices` is then the node's, every process's together
    slo_ms: float | None = None  # the server's SLO and deadline in force (set, or derived from its warm-up)
    timeout_ms: float | None = None
    probed: bool = False  # the batch time by size from a probe; else the learned one taken at every size


def metric_sum(metrics_text: str, name: str) -> float | None:
    """The sum of every series of `name` (all label sets) in /metrics text; None when there is none."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def cpu_per_request(base: str, window_s: float, api_key: str = "") -> tuple[float | None, str]:
    """CPU seconds per answered request of one server process, from its own counters: `process_cpu_seconds_total`
    over `batchserve_requests_total` (every status: a refusal costs CPU too), read twice `window_s` apart on
    ONE connection, so both readings come from the same process behind a shared (`--processes`) port.
    Totals since start would count the start-up (imports, model loading); the window counts only the load
    the server carries now, so measure a node under its real traffic.

    Why the pings: the server closes a connection idle for `--keep-alive-timeout-s` (5 s by default, as long as
    the default window), so the connection is kept busy with a `GET /healthz` (counted in neither counter) every
    `KEEP_ALIVE_PING_S`. Should the server close it all the same (a shorter keep-alive), the window starts over
    on a fresh connection with pings twice as often, a few times, before it gives up with the reason."""
    ping_s = KEEP_ALIVE_PING_S
    for attempt in range(1, CPU_WINDOW_TRIES + 1):
        try:
            cpu0, req0, cpu1, req1 = _cpu_window(base, window_s, api_key, ping_s)
            break
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            if attempt == CPU_WINDOW_TRIES:
                raise OSError(
                    f"{base} closed the connection held for the {window_s:g} s CPU window "
                    f"{CPU_WINDOW_TRIES} times (pinged every {ping_s:g} s): {exc}; give "
                    f"--cpu-us-per-request or a shorter --cpu-window-s"
                ) from exc
            ping_s /= 2
    if cpu0 is None or cpu1 is None:
        return None, "no process_cpu_seconds_total in /metrics"
    answered = (req1 or 0.0) - (req0 or 0.0)
    if answered < MIN_CPU_SAMPLE:
        return None, (
            f"{answered:.0f} requests answered in the {window_s:g} s window (fewer than "
            f"{MIN_CPU_SAMPLE}): CPU per request not measured; measure under load or give "
            f"--cpu-us-per-request"
        )
    per = (cpu1 - cpu0) / answered
    return per, (
        f"CPU {per * 1e6:.0f} us per request ({cpu1 - cpu0:.2f} CPU-s over {answered:.0f} requests in {window_s:g} s)"
    )


def _cpu_window(
    base: str, window_s: float, api_key: str, ping_s: float
) -> tuple[float | None, float | None, float | None, float | None]:
    """Both /metrics readings (CPU, requests) `window_s` apart on one connection, pinged every `ping_s`."""
    u = urlsplit(base)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "127.0.0.1", u.port, timeout=10)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prefix = u.path.rstrip("/")

    def get(path: str) -> str:
        conn.request("GET", prefix + path, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            raise OSError(f"{base}{path} answered {resp.status}")
        return text

    def read() -> tuple[float | None, float | None]:
        text = get("/metrics")
        return metric_sum(text, "process_cpu_seconds_total"), metric_sum(text, "batchserve_requests_total")

    try:
        cpu0, req0 = read()
        end = time.monotonic() + window_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(ping_s, left))
            if end - time.monotonic() > 0:
                get("/healthz")  # keeps the connection from idling out; counted in neither reading
        cpu1, req1 = read()
    finally:
        conn.close()
    return cpu0, req0, cpu1, req1


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # an operator-given http(s) URL
        return r.read()


def histogram_mean(metrics_text: str, name: str, model: str) -> float | None:
    """sum / count of a Prometheus histogram's series for `model`, from /metrics text."""
    total = count = None
    for line in metrics_text.splitlines():
        if line.startswith(f'{name}_sum{{model="{model}"}}'):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f'{name}_count{{model="{model}"}}'):
            count = float(line.rsplit(" ", 1)[1])
    return total / count if total is not None and count else None


def probe(base: str, sizes: list[int], api_key: str = "", rounds: int = 3) -> BatchTime:
    """Batch time by size from the server's own answers: bursts of `size` concurrent requests, each answer
    carrying the `batch_size` it ran in and its `compute_ms`; the median per observed size."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    body = json.dumps({"input": "batchserve plan probe"}).encode()

    def one(_: int) -> tuple[int, float] | None:
        req = urllib.request.Request(base + "/v1/inference", data=body, headers=headers, method="POST")
        try:
            answer = json.loads(_get_request(req))
        except OSError:
            return None
        return int(answer["batch_size"]), float(answer["compute_ms"])

    seen: dict[int, list[float]] = {}
    with ThreadPoolExecutor(max_workers=max(sizes)) as pool:
        for _ in range(rounds):
            for size in sizes:
                for got in pool.map(one, range(size)):
                    if got is not None:
                        seen.setdefault(got[0], []).append(got[1])
    if not seen:
        raise OSError(f"no probe request to {base} succeeded")
    points = sorted((size, statistics.median(ms)) for size, ms in seen.items())
    return BatchTime(tuple(s for s, _ in points), tuple(ms / 1000 for _, ms in points))


def _get_request(req: urllib.request.Request) -> bytes:
    with urllib.request.urlopen(req, timeout=30) as r:  # an operator-given http(s) URL
        return r.read()


def measure(
    base: str, model: str | None, probe_sizes: list[int], api_key: str = "", cpu_window_s: float = 0.0
) -> Measured:
    """Devices from /internal/health's workers; the batch time as the server learned it (its `batch_ms`, the
    same at every size: true of the sim, a first guess for a real model), or by size from a probe; with a
    `cpu_window_s`, the process's CPU per request over that window (`cpu_per_request`)."""
    base = base.rstrip("/")
    health = json.loads(_get(base + "/internal/health"))
    if health.get("status") == "starting":  # no workers, no batch time yet: nothing to read
        raise OSError(f"{base} is still warming up (its models load); run again once {base}/readyz answers 200")
    devices = sum(1 for w in health.get("workers", []) if w.get("healthy")) or len(health.get("workers", []))
    processes = int((health.get("process") or {}).get("of", 1))  # one process answered: its siblings match it
    devices *= processes
    learned: dict[str, float] = health.get("batch_ms", {})
    stepper: dict[str, float] = health.get("answer_ms", {})  # answered by the generation engine, not batches
    if model in stepper or (model is None and not learned and stepper):
        name = model or next(iter(stepper))
        raise OSError(
            f"{base} answers {name} on the generation engine's stepper ({stepper[name]:g} ms an answer), "
            "not in batches: this planner models the batcher; size it by the engine's slots and "
            "batchserve_load_ratio (docs/capacity.md)"
        )
    if not learned:
        raise OSError(f"{base}/internal/health reports no batch_ms")
    name = model if model is not None else next(iter(learned))
    if name not in learned:
        raise OSError(f"{base} serves {', '.join(learned)}, not {name}")
    slo_ms, timeout_ms = _positive(_of_model(health, "slo_ms", name)), _positive(_of_model(health, "timeout_ms", name))
    cpu_s, cpu_note = cpu_per_request(base, cpu_window_s, api_key) if cpu_window_s > 0 else (None, "")
    if probe_sizes:
        return Measured(
            devices,
            probe(base, probe_sizes, api_key),
            "; ".join(x for x in (f"probe of {base} ({name})", cpu_note) if x),
            cpu_s,
            processes,
            slo_ms,
            timeout_ms,
            probed=True,
        )
    mean_compute = histogram_mean(_get(base + "/metrics").decode(), "batchserve_batch_compute_seconds", name)
    source = (
        f"{base} ({name}): learned batch time {learned[name]:g} ms, taken as the same at every size "
        f"(--probe 1,50,100 measures it by size, which a model whose big batches are slower needs)"
    )
    if mean_compute is not None:
        source += f", mean batch compute {mean_compute * 1000:.1f} ms since start"
    if cpu_note:
        source += f"; {cpu_note}"
    if processes > 1:
        source += f"; {processes} processes of {devices // processes} device(s)"
    return Measured(devices, BatchTime.constant(learned[name]), source, cpu_s, processes, slo_ms, timeout_ms)


def _of_model(health: dict, member: str, model: str) -> object:
    """A figure of /internal/health for `model`: each model's own (a map by model id), or an older server's one."""
    value = health.get(member)
    return value.get(model) if isinstance(value, dict) else value


def _positive(value: object) -> float | None:
    """A number from /internal/health, when it is one above 0 (an older server has no such member)."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


# -- the command ---------------------------------------------------------------------------------------------
DESCRIPTION = (
    "Nodes needed for a target rate at the SLO. Required: --rate, and exactly one of --batch-ms, "
    "--batch-ms-by-size or --measure URL (a running server). Defaults are shown beside each flag."
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default beside it, `(required)` on a required one; no default shown where there is none to
    show (None, False, "": the help text says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return f"{action.help} (required)"
        if action.default in (None, False, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--margin-ms", type=float, default=5.0, help="the server's --dispatch-margin-ms")
    p.add_argument(
        "--timeout-ms",
        type=float,
        default=None,
        help="request deadline (--timeout-ms) [2000, or with --measure the server's]",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=0.0,
        help="per-request time outside the batcher (HTTP, event loop, network), added to every latency",
    )
    p.add_argument(
        "--max-busy",
        type=float,
        default=0.95,
        help="the most device time a node is planned at, whatever the SLO allows",
    )
    p.add_argument(
        "--cpu-us-per-request",
        type=float,
        default=None,
        help="one server process's CPU per request, microseconds (with --measure: read from the "
        "server's own counters over --cpu-window-s unless given)",
    )
    p.add_argument(
        "--cpu-window-s",
        type=float,
        default=5.0,
        help="with --measure: seconds between the two /metrics reads that give CPU per request",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="server processes per node (batchserve serve --processes), the devices split evenly [1, or measured]",
    )
    p.add_argument(
        "--cores", type=float, default=0.0, help="cores the node's server processes may use (0 = one per process)"
    )
    p.add_argument("--max-cpu-busy", type=float, default=0.9, help="the most of a core one process is planned at")
    p.add_argument("--gpu-cost-per-hour", type=float, default=0.0, help="price of one device (GPU) an hour")
    p.add_argument(
        "--node-cost-per-hour",
        type=float,
        default=0.0,
        help="price of a node an hour beside its GPUs (CPUs, memory, network)",
    )
    p.add_argument("--sim-s", type=float, default=SIM_S, help="simulated seconds per point")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


DEFAULT_SLO_MS = 200.0
DEFAULT_TIMEOUT_MS = 2000.0


def measured_contract(a: argparse.Namespace) -> tuple[Contract, str, Measured | None]:
    """The contract the flags describe, what it was read from, and what `--measure` read (None without it):
    the SLO and deadline left unset are the measured server's, else DEFAULT_SLO_MS / DEFAULT_TIMEOUT_MS."""
    given = [x for x in (a.batch_ms, a.batch_ms_by_size, a.measure) if x is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --batch-ms, --batch-ms-by-size, --measure URL")
    devices, processes, source = a.devices, a.processes, "given"
    slo_ms, timeout_ms, m = a.slo_ms, a.timeout_ms, None
    if a.cpu_us_per_request is not None and a.cpu_us_per_request <= 0:
        raise ValueError("--cpu-us-per-request must be positive")
    cpu_s = a.cpu_us_per_request / 1e6 if a.cpu_us_per_request is not None else 0.0
    if a.measure is not None:
        sizes = [int(x) for x in a.probe.split(",") if x.strip()] if a.probe else []
        window = a.cpu_window_s if a.cpu_us_per_request is None else 0.0
        m = measure(a.measure, a.model, sizes, a.api_key, window)
        batch_time, source = m.batch_time, m.source
        devices = devices if devices is not None else m.devices
        processes = processes if processes is not None else m.processes
        cpu_s = cpu_s or (m.cpu_s_per_request or 0.0)
        read = []
        if slo_ms is None and m.slo_ms is not None:
            slo_ms = m.slo_ms
            read.append(f"SLO {slo_ms:g} ms")
        if timeout_ms is None and m.timeout_ms is not None:
            timeout_ms = m.timeout_ms
            read.append(f"timeout {timeout_ms:g} ms")
        if read:
            source += f"; the server's {' and '.join(read)}"
    elif a.batch_ms_by_size is not None:
        batch_time = BatchTime.parse(a.batch_ms_by_size)
    else:
        if a.batch_ms <= 0:
            raise ValueError("--batch-ms must be positive")
        batch_time = BatchTime.constant(a.batch_ms)
    devices = 1 if devices is None else devices
    processes = 1 if processes is None else processes
    slo_ms = DEFAULT_SLO_MS if slo_ms is None else slo_ms
    timeout_ms = DEFAULT_TIMEOUT_MS if timeout_ms is None else timeout_ms
    if devices < 1 or a.max_batch < 1 or slo_ms <= 0 or not 0 < a.max_busy <= 1:
        raise ValueError("--devices and --max-batch must be >= 1, --slo-ms positive, --max-busy in (0, 1]")
    if processes < 1 or a.cores < 0 or not 0 < a.max_cpu_busy <= 1:
        raise ValueError("--processes must be >= 1, --cores 0 or more, --max-cpu-busy in (0, 1]")
    if a.gpu_cost_per_hour < 0 or a.node_cost_per_hour < 0:
        raise ValueError("--gpu-cost-per-hour and --node-cost-per-hour must be 0 or more")
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


def prices_from(a: argparse.Namespace) -> Prices | None:
    if not a.gpu_cost_per_hour and not a.node_cost_per_hour:
        return None
    return Prices(a.gpu_cost_per_hour, a.node_cost_per_hour)


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
    devices = f"devices {plan.device_capacity:.0f}"
    name = {"cpu": "the CPU", "devices": "the devices (full-batch cap)", "slo": "the SLO on the devices"}
    return f"limits            {devices}; {cpu}: {name[plan.binding]} binds"


def render(plan: Plan, source: str) -> str:
    c, t = plan.contract, plan.at_target
    slo = c.slo_s * 1000
    capped = plan.device_capacity >= c.max_busy * c.ceiling() * (1 - 1e-9)
    bound = f"capped at {c.max_busy:.0%} of" if capped else "ceiling"
    split = f" in {c.processes} processes of {c.devices // c.processes}" if c.processes > 1 else ""
    serves = (
        f"one node serves {plan.capacity:.0f} requests/s within the SLO, bound by its CPU (devices alone: "
        f"{plan.device_capacity:.0f}, {bound} {c.ceiling():.0f} at full batches)"
        if plan.binding == "cpu"
        else f"one node serves {plan.capacity:.0f} requests/s within the SLO ({bound} {c.ceiling():.0f} at full "
        f"batches)"
    )
    lines = [
        f"target {plan.target_rate:g} requests/s at p95 <= {slo:g} ms",
        f"node: {c.devices} device(s){split}, batches of 1..{c.max_batch}, batch time {c.batch_time.describe()} "
        f"({source}), dispatch margin {c.margin_s * 1000:g} ms, overhead {c.overhead_s * 1000:g} ms",
        serves,
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
        d = plan.one_down
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
        lines.append(
            f"one node down     {plan.nodes - 1} nodes at {each:.0f} requests/s each: p95 {d.p95_ms:.0f} ms, {verdict}"
        )
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
    try:
        plan = make_plan(a.rate, contract, a.sim_s, a.seed, prices_from(a))
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
