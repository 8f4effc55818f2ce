"""`batchserve plan`: how many nodes a target rate needs at the SLO, and the latency they will give.

Why a simulation and not a formula: no queueing formula describes the batcher's policy — a batch leaves when it
is full, when its oldest item's dispatch deadline arrives (`arrived + slo − S − margin`), or by pacing (`S/G`
after the previous dispatch; S = learned batch time, G = devices), and only when a device is free. So the planner
runs that policy event by event on Poisson arrivals: the same model as `bench/ideal.py` (the tests check them
against each other), in pure Python so the package needs nothing more.

A node's capacity is the highest arrival rate whose simulated p95 stays within the SLO with nothing timing out;
nodes = ceil(target / capacity) (a Poisson stream split at random stays Poisson). Every rate is simulated on the
same unit-exponential gaps scaled by 1/rate (common random numbers), so p95 rises smoothly with the rate and the
bisection is stable. What the model leaves out (HTTP, the event loop, admission's refusals) makes measured
latency higher; `--overhead-ms` adds a fixed per-request amount, and docs/capacity.md gives the error.

The host's CPU is the other ceiling: a process runs one event loop on one core at a fixed CPU cost per request,
so it serves at most `max_cpu_busy / cpu per request`. With `--processes P` a node is P processes of devices/P
devices each; its capacity is the lower of the devices' and the CPU's, and the plan says which binds.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace

EWMA_ALPHA = 0.2  # as batcher.EWMA_ALPHA: weight of the newest batch in the learned batch time
SIM_S = 30.0  # simulated seconds per point, after the warm-up
WARMUP_S = 5.0
BISECT_STEPS = 12  # capacity to ceiling / 4096
CHECK_POINTS = 8  # rates under a bisected capacity checked to meet the SLO too (see `capacity`)
RECHECKS = 6  # searches started over beneath a rate that missed, before no capacity is trusted
PLAN_RETRIES = 8  # plans redone with a capacity below the per-node rate whose prediction missed
TRICKLE = 0.05  # a capacity under this share of the ceiling is no plan: the SLO is missed at any real load
HOURS_PER_MONTH = 730.0  # 365 x 24 / 12


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
        sizes, seconds = zip(*sorted(points.items()))
        return cls(sizes, seconds)

    def __call__(self, size: int) -> float:
        i = bisect.bisect_left(self.sizes, size)
        if i == len(self.sizes):
            return self.seconds[-1]
        if i == 0 or self.sizes[i] == size:
            return self.seconds[i]
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
    """One node's simulated latency percentiles at a request rate (not admission's `core.admission.Prediction`)."""

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
    """The batcher's policy on these sorted arrival times (s): each arrival's answer time (NaN when it expired
    in the queue) and the size of each batch. Items are answered when their batch ends."""
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
    """Unit-exponential gaps drawn once per seed and scaled per rate (common random numbers, module docstring)."""

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
    counted = [d - t for t, d in zip(times, done) if t >= warmup_s]  # NaN: expired
    latencies = sorted((x + c.overhead_s) * 1000 for x in counted if not math.isnan(x))
    return LatencyAtRate(
        rate,
        percentile(latencies, 50),
        percentile(latencies, 95),
        percentile(latencies, 99),
        statistics.fmean(sizes) if sizes else 0.0,
        (len(counted) - len(latencies)) / max(1, len(counted)),
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

    Why the cap: near the ceiling a queue's steady state takes far longer to reach than any window one can
    simulate, so a finite window would call a node that slowly drowns healthy.

    Why the check below: when a big batch takes much longer than a small one, the queue is bistable (a slow
    batch lets enough arrive to form the next slow one), so p95 is not monotone in the rate and a bisection can
    land on a lucky rate just above unlucky ones. A miss on the grid below restarts the search beneath it."""
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
    """Whether one node meets the SLO at `rate`; a window where nothing arrived counts as a request alone."""
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
    needed = c.max_busy * c.ceiling()
    if c.cpu_ceiling() >= needed:
        return None
    splits = (p for p in range(c.processes + 1, c.devices + 1) if c.devices % p == 0 and (not c.cores or p <= c.cores))
    return next((p for p in splits if replace(c, processes=p).cpu_ceiling() >= needed), None)


def plan_cost(target_rate: float, nodes: int, c: Contract, prices: Prices) -> Cost:
    node_hour = c.devices * prices.gpu_per_hour + prices.node_per_hour
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
        # p95 is not monotone in the rate here (`capacity`): the capacity is what meets beneath the rate that missed.
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
