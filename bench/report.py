"""Shared pieces of the bench reports: percentiles, markdown tables, provenance, writing the files.

Why a module: every report must carry the same provenance (machine, git commit, settings, time) and write
markdown + JSON side by side, so a number can always be traced to its run. Where it writes (`--record`,
`--out DIR`, else nowhere) is decided by the flags in bench/common.py.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench import plot, servers
from bench.plot import Curves


def pct(values: np.ndarray, q: float) -> float:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else math.nan


def fmt(v: object, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec) if isinstance(v, float) else str(v)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- machine and code: where a number came from -------------------------------------------------------------
def machine_info() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = math.nan
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def git_info() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], check=False, cwd=servers.REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    dirty = git("status", "--porcelain", "--", "batchserve", "bench", "pyproject.toml")
    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(dirty),
        "dirty_files": dirty.splitlines()[:50],
    }


def provenance() -> dict:
    return {
        "machine": machine_info(),
        "git": git_info(),
        "when_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def clean(value: object) -> object:
    """JSON-safe: NaN becomes null, numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write(
    name: str,
    report: dict,
    markdown: str,
    directory: Path | None,
    curves: Curves | None = None,
    plot_title: str = "",
    plot_unit: str = "req/s",
) -> tuple[Path, Path] | None:
    """Markdown and JSON side by side in `directory`; nothing (None) when it is None. With `curves` (a load
    bench's p95 and goodput per offered rate, per server), also `<name>.png`, shown in the markdown."""
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    js, md = directory / f"{name}.json", directory / f"{name}.md"
    if curves:
        png = directory / f"{name}.png"
        png.write_bytes(plot.load_png(curves, plot_title or name, unit=plot_unit))
        markdown += f"\n\n![p95 latency and goodput versus offered load]({png.name})"
    js.write_text(json.dumps(clean(report), indent=2, ensure_ascii=False, default=str) + "\n")
    md.write_text(markdown + "\n")
    return js, md


def judged(name: str, rep: dict, md: str, directory: Path | None, logs: Path | None) -> int:
    """The end of a bench that judges its goals (`rep["result"]["goals"]`): print the markdown, write it when
    asked, say where; the exit status 0 only when every goal held."""
    print(md)
    print("\n" + written(write(name, rep, md, directory), logs))
    return 0 if all(rep["result"]["goals"].values()) else 1


def written(paths: tuple[Path, Path] | None, logs: Path | None = None) -> str:
    """The closing line of a run: what was written, or how to write it."""
    where = f"; server logs in {logs}" if logs is not None else ""
    if paths is None:
        return f"not recorded (--record writes bench/results/, --out DIR elsewhere){where}"
    png = paths[1].with_suffix(".png")
    return f"written: {paths[1]}{f', {png}' if png.exists() else ''} and {paths[0]}{where}"


def log_lines(
    path: Path, levels: tuple[str, ...] = ("WARNING", "ERROR", "CRITICAL", "Traceback"), limit: int = 60
) -> list[str]:
    """The server log's notable lines (first `limit`), kept in the JSON as evidence."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if any(lv in line for lv in levels)][:limit]
