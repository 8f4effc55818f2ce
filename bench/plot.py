"""The picture people look at first: p95 latency and goodput versus offered load, one line per server
(batchserve beside its peers, or beside the ideal batcher), as a PNG next to the table a bench records.

Why a module: every load bench reports the same two curves, and each would otherwise style them its own way.
matplotlib (the `bench` extra) with the Agg backend: no display, the same bytes on a server as on a laptop.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Point:
    offered: float  # requests (or inputs) per second sent
    p95_ms: float  # NaN when nothing was answered
    goodput: float  # answered in time (200s) per second


Curves = dict[str, list[Point]]  # server label -> its points, any order


def load_png(curves: Curves, title: str, unit: str = "req/s", p95_target_ms: float | None = None) -> bytes:
    """Two panels side by side: p95 (ms) and goodput against offered load, a line per server; the dashed
    diagonal on the goodput panel is "everything offered was served"; `p95_target_ms` a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # not pyplot: no global figure state, nothing left open

    fig = Figure(figsize=(11, 4.2), dpi=100)
    latency, goodput = fig.subplots(1, 2)
    top = 0.0
    for label, points in curves.items():
        points = sorted(points, key=lambda p: p.offered)
        xs = [p.offered for p in points]
        latency.plot(xs, [p.p95_ms for p in points], marker="o", label=label)
        goodput.plot(xs, [p.goodput for p in points], marker="o", label=label)
        top = max([top, *xs, *(p.goodput for p in points if not math.isnan(p.goodput))])
    if p95_target_ms is not None:
        latency.axhline(p95_target_ms, linestyle=":", color="grey", label=f"target {p95_target_ms:g} ms")
    goodput.plot([0, top], [0, top], linestyle="--", color="grey", linewidth=1, label="all served")
    latency.set(xlabel=f"offered ({unit})", ylabel="p95 latency (ms)", title="p95 latency")
    goodput.set(xlabel=f"offered ({unit})", ylabel=f"goodput ({unit})", title="goodput")
    for axes in (latency, goodput):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
        axes.set_xlim(left=0)
        axes.set_ylim(0, axes.get_ylim()[1] * 1.1)  # headroom: the top points are not cut by the frame
    fig.suptitle(title)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def series_png(
    series: dict[str, tuple[list[float], list[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    bounds: tuple[float, ...] = (),
) -> bytes:
    """One panel of lines over time (a bench's running figure: a service difference, a queue): `series` maps a
    label to its (xs, ys); each of `bounds` a dotted horizontal line (a goal)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    axes = fig.subplots(1, 1)
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, label=label, linewidth=1.2, drawstyle="steps-post")  # service moves by whole answers
    for bound in bounds:
        axes.axhline(bound, linestyle=":", color="grey", label=f"goal {bound:g}" if bound >= 0 else None)
    axes.axhline(0, color="black", linewidth=0.6)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()
