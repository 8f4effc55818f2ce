"""The cyclic garbage collector, tuned for a server that allocates a few dozen short-lived objects per request.

With CPython's default thresholds a full collection stalls the loop for tens of milliseconds under load: it
delays the running batch's hand-back, teaches the learned batch time an outlier, and the capacity estimate falls
below the arrival rate (503s). Freezing what start-up built (never garbage) and collecting the young generation far
less often cuts the collector's time and pauses by an order of magnitude.

Start-up builds in two places: before the port opens (`tune_gc`) and behind it, where the lifespan loads the models
(`freeze_late_startup_objects`); a loaded model left in the collector's reach makes each full collection take
hundreds of milliseconds, with the device idle meanwhile.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 10, 10)


def tune_gc() -> None:
    """Freeze what start-up built so far and collect the young generation less often: the serving process's
    settings (`batchserve serve`), not a library's to impose on a process that embeds the app."""
    gc.collect()
    gc.freeze()  # what is alive now is never garbage: out of the collector's scans
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_late_startup_objects() -> None:
    """Freeze what the lifespan loaded, in a process `tune_gc` tuned (only there: a process that embeds the app,
    such as a test run, keeps its collector as it set it)."""
    if gc.get_threshold() == GC_THRESHOLDS:
        gc.collect()
        gc.freeze()
