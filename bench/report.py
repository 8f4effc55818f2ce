"""Shared pieces of the drill and overload reports: percentiles, markdown tables, where results go.

Why a module: both reports must carry the same provenance (machine, git commit, settings, time) and write
markdown + JSON side by side under bench/results/, so a number can always be traced to its run.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import numpy as np

from bench.run_standard import git_info, machine_info

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: np.ndarray, q: float) -> float:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else math.nan


def fmt(v: object, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec) if isinstance(v, float) else str(v)


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def provenance() -> dict:
    return {"machine": machine_info(), "git": git_info(),
            "when_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


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


def write(name: str, report: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, md = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    js.write_text(json.dumps(clean(report), indent=2, ensure_ascii=False) + "\n")
    md.write_text(markdown + "\n")
    return js, md


def log_lines(path: Path, levels: tuple[str, ...] = ("WARNING", "ERROR", "CRITICAL", "Traceback"),
              limit: int = 60) -> list[str]:
    """The server log's notable lines (first `limit`), kept in the JSON as evidence."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if any(lv in line for lv in levels)][:limit]
