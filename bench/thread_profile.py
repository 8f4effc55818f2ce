"""Where a server's time goes, per thread, while a load runs: each OS thread's CPU seconds (from
/proc/<pid>/task/<tid>/stat, so native threads — torch's, the tokenizer's Rust pool — count too) and, when py-spy
is installed (`pip install py-spy`), the Python thread each tid is and the functions its busy samples were in.

A thread's CPU over the window's wall time is the cores it used; on a shared machine it is also the share of the
CPU it was given, which a profile of the interpreter alone (cProfile of the main thread) cannot show.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`, by tid."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclass
class ThreadProfile:
    wall_s: float
    cores: dict[str, float]  # thread (Python name, or "native <tid>") -> cores used over the window
    frames: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # thread -> (function, share of samples)
    sampler: str = ""

    def text(self, top: int = 6) -> str:
        total = sum(self.cores.values())
        how = self.sampler or "no py-spy: CPU only"
        lines = [f"server process: {total:.2f} cores over {self.wall_s:.0f} s ({how})"]
        for name, cores in sorted(self.cores.items(), key=lambda kv: -kv[1]):
            if cores < 0.005 and name.startswith("native"):
                continue
            share = 100 * cores / total if total else 0.0
            lines.append(f"  {name:<28} {cores:5.2f} cores ({share:4.1f} % of the process)")
            for fn, share in self.frames.get(name, [])[:top]:
                lines.append(f"      {100 * share:5.1f} %  {fn}")
        return "\n".join(lines)


class Recorder:
    """`start()` before the window, `stop()` after: the threads' CPU between the two, and py-spy's samples."""

    def __init__(self, pid: int, seconds: float, rate_hz: int = 50) -> None:
        self.pid, self.seconds, self.rate_hz = pid, seconds, rate_hz
        self.spy: subprocess.Popen | None = None
        self.raw = Path(tempfile.mkdtemp(prefix="thread-profile-")) / "spy.txt"

    def start(self) -> None:
        self.before, self.at = thread_cpu(self.pid), time.monotonic()
        # on PATH, or beside this interpreter (a venv's bin/, where `pip install py-spy` puts it, when the bench
        # runs as .venv/bin/python without the venv activated)
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy:
            self.spy = subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    str(self.pid),
                    "-d",
                    str(int(self.seconds)),
                    "-r",
                    str(self.rate_hz),
                    "-t",
                    "-f",
                    "raw",
                    "-o",
                    str(self.raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> ThreadProfile:
        after, wall = thread_cpu(self.pid), time.monotonic() - self.at
        names: dict[int, str] = {}
        frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        sampler = ""
        if self.spy is not None:
            try:
                self.spy.wait(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                self.spy.kill()
            if self.raw.exists():
                sampler = f"py-spy, {self.rate_hz} Hz, busy samples only"
                for line in self.raw.read_text().splitlines():
                    stack, _, count = line.rpartition(" ")
                    parts = stack.split(";")
                    head = parts[0]  # "thread (1234): name" (py-spy -t)
                    try:
                        tid = int(head[head.index("(") + 1 : head.index(")")])
                        name = head.split(": ", 1)[1] if ": " in head else str(tid)
                    except ValueError:
                        continue
                    names[tid] = name
                    frames[name][parts[-1] if len(parts) > 1 else "?"] += int(count)
        cores: dict[str, float] = {}
        for tid, cpu in after.items():
            name = names.get(tid, f"native {tid}")
            cores[name] = cores.get(name, 0.0) + max(0.0, cpu - self.before.get(tid, 0.0)) / wall
        shares = {name: [(fn, n / sum(c.values())) for fn, n in c.most_common(8)] for name, c in frames.items()}
        shutil.rmtree(self.raw.parent, ignore_errors=True)
        return ThreadProfile(wall, dict(cores), shares, sampler)
