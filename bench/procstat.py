"""CPU time and resident memory of a process from /proc, and this client's CPU, so a bench measures the server
from outside."""

from __future__ import annotations

import math
import os
import resource
import threading
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all its threads), in seconds; 10 ms resolution on Linux."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode()
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = raw.rpartition(")")[2].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / CLK_TCK


def tree_pids(pid: int) -> list[int]:
    """`pid` and its descendants (a `serve --processes` parent and its children), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().decode().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (children that exited are not counted)."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            total += process_cpu_s(p)
        except (OSError, ValueError, IndexError):
            pass
    return total


def self_cpu_s() -> float:
    """CPU seconds of this process (the load generator), to tell when the client itself is the bottleneck."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one: an open-loop client under overload holds many sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle since boot (from /proc/stat): with the processes a bench knows,
    it tells how much of the machine something else used."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


class CpuSampler:
    """CPU seconds of a changing set of processes over a run (a rolling restart replaces them): reads every
    tracked PID now and then, and keeps the last value seen, so a process that has exited still counts."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def track(self, pid: int, label: str) -> None:
        """From now on (a process tracked after the start counts from its first sample)."""
        if pid not in self.labels:
            self.labels[pid] = label
            self.sample_one(pid)

    def sample_one(self, pid: int) -> None:
        try:
            value = process_cpu_s(pid)
        except (OSError, IndexError, ValueError):
            return  # gone: its last value stays
        self.first.setdefault(pid, value)
        self.last[pid] = value

    def sample(self) -> None:
        for pid in list(self.labels):
            self.sample_one(pid)

    def by_label(self) -> dict[str, float]:
        """CPU seconds per label (processes sharing a label are summed)."""
        out: dict[str, float] = {}
        for pid, label in self.labels.items():
            if pid in self.first:
                out[label] = out.get(label, 0.0) + self.last[pid] - self.first[pid]
        return out


def rss_mb(pid: int) -> float:
    """Resident memory of the process (VmRSS of /proc/<pid>/status), MiB; NaN once it has exited."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith(b"VmRSS:")), math.nan)
    except (OSError, ValueError):
        return math.nan


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its live descendants (a server's device processes), MiB."""
    return sum(r for r in map(rss_mb, tree_pids(pid)) if not math.isnan(r))


@dataclass
class RssWatch:
    """Samples a process's RSS every 50 ms in a thread: its value at the start and its peak."""

    pid: int
    start_mb: float = 0.0
    peak_mb: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssWatch:
        self.start_mb = self.peak_mb = rss_mb(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.start_mb
