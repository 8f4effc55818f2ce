"""CPU time of a process from /proc, and of this client, so CPU per request can be measured from outside."""

from __future__ import annotations

import os
import resource

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all its threads), in seconds; 10 ms resolution on Linux."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode()
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = raw.rpartition(")")[2].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / CLK_TCK


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
