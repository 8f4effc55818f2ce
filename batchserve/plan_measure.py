"""`batchserve plan --measure`: the devices, batch time, SLO and CPU per request of a running server, read from
its /internal/health and /metrics (and, with `--probe`, from bursts it is sent), for the planner (`plan.py`)."""

from __future__ import annotations

import http.client
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from batchserve.plan import BatchTime

MIN_CPU_SAMPLE = 50  # requests a --measure window must see before its CPU per request is believed
KEEP_ALIVE_PING_S = 1.0  # a GET /healthz this often holds the CPU window's connection open (see cpu_per_request)
CPU_WINDOW_TRIES = 3  # windows started over on a fresh connection when the server closes it all the same


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
    """CPU seconds per answered request of one server process: `process_cpu_seconds_total` over
    `batchserve_requests_total` (every status: a refusal costs CPU too), read twice `window_s` apart on ONE
    connection, so both readings come from the same process behind a shared (`--processes`) port. A window, not
    totals since start, so start-up is not counted: measure a node under its real traffic.

    Why the pings: the server closes a connection idle for `--keep-alive-timeout-s`, so a `GET /healthz` (counted
    in neither counter) keeps it busy; should it close all the same, the window starts over with more pings."""
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
    """Both /metrics readings (CPU, requests) `window_s` apart on one connection."""
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


def _get(url: str | urllib.request.Request, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # an operator-given http(s) URL
        return r.read()


def histogram_mean(metrics_text: str, name: str, model: str) -> float | None:
    """sum / count of a Prometheus histogram's series for `model`, from /metrics text."""
    total = metric_sum(metrics_text, f'{name}_sum{{model="{model}"}}')
    count = metric_sum(metrics_text, f'{name}_count{{model="{model}"}}')
    return total / count if total is not None and count else None


def probe(base: str, sizes: list[int], api_key: str = "", rounds: int = 3) -> BatchTime:
    """Batch time by size from bursts of concurrent requests: the median `compute_ms` per observed `batch_size`."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    body = json.dumps({"input": "batchserve plan probe"}).encode()

    def one(_: int) -> tuple[int, float] | None:
        req = urllib.request.Request(base + "/v1/inference", data=body, headers=headers, method="POST")
        try:
            answer = json.loads(_get(req, timeout=30))
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


def measure(
    base: str, model: str | None, probe_sizes: list[int], api_key: str = "", cpu_window_s: float = 0.0
) -> Measured:
    """Devices from /internal/health's workers; the batch time as the server learned it (the same at every size: a
    first guess for a real model), or by size from a probe; the CPU per request with a `cpu_window_s`."""
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
    cpu_s, cpu_note = cpu_per_request(base, cpu_window_s, api_key) if cpu_window_s > 0 else (None, "")
    if probe_sizes:
        batch_time = probe(base, probe_sizes, api_key)
        said = [f"probe of {base} ({name})", cpu_note]
    else:
        batch_time = BatchTime.constant(learned[name])
        mean_compute = histogram_mean(_get(base + "/metrics").decode(), "batchserve_batch_compute_seconds", name)
        said = [
            f"{base} ({name}): learned batch time {learned[name]:g} ms, taken as the same at every size "
            f"(--probe 1,50,100 measures it by size, which a model whose big batches are slower needs)"
            + (f", mean batch compute {mean_compute * 1000:.1f} ms since start" if mean_compute is not None else ""),
            cpu_note,
            f"{processes} processes of {devices // processes} device(s)" if processes > 1 else "",
        ]
    source = "; ".join(x for x in said if x)
    slo_ms, timeout_ms = (_model_figure(health, member, name) for member in ("slo_ms", "timeout_ms"))
    return Measured(devices, batch_time, source, cpu_s, processes, slo_ms, timeout_ms, probed=bool(probe_sizes))


def _model_figure(health: dict, member: str, model: str) -> float | None:
    """A positive figure of /internal/health for `model`: each model's own (a map by model id), or an older
    server's one (None when absent)."""
    value = health.get(member)
    value = value.get(model) if isinstance(value, dict) else value
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
