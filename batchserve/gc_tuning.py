"""The cyclic garbage collector, tuned for a server that allocates a few dozen short-lived objects per request.

With CPython's default thresholds (700, 10, 10) the sim server at 900 requests/s spent ~0.7 s in the collector
per 20 s (460 young collections of ~0.8 ms, 3 full ones of 55-70 ms): a full collection stalls the loop and
delays the running batch's hand-back, one such batch teaches the learned batch time a 46 ms outlier, and the
capacity estimate falls below the arrival rate (the 503s of the 900 RPS row). Freezing what start-up built
(modules, app, models: never garbage) and collecting the young generation every 50,000 allocations instead of
700 cut the collector's time to ~40 ms per 20 s and the longest pause to ~4 ms (same load, one run each).

Start-up builds in two places: `batchserve serve` imports and builds the app before the port opens
(`tune_gc`), and the lifespan loads the models behind the open port (the batch backends, on a start-up thread,
and the generation engine's own model replica). What the lifespan loads is frozen once it is up
(`freeze_late_startup_objects`): measured with SmolLM2 on this 2-core CPU, its ~370,000 objects left in the
collector's reach made each full collection take 230-285 ms, and in a run of the slot stepper with the GPU
stood in (`bench/stepper_host.py`) such a pause left the device idle for 250-290 ms (device busy 0.81 -> 0.94).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 10, 10)


def freeze_startup_objects() -> None:
    """Collect, then move everything alive out of the collector's scans (it is never garbage)."""
    gc.collect()
    gc.freeze()


def tune_gc() -> None:
    """Freeze what start-up built so far and collect the young generation less often: the serving process's
    settings (`batchserve serve`), not a library's to impose on a process that embeds the app."""
    freeze_startup_objects()
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_late_startup_objects() -> None:
    """Freeze what the lifespan loaded, in a process `tune_gc` tuned (only there: a process that embeds the app,
    such as a test run, keeps its collector as it set it)."""
    if gc.get_threshold() == GC_THRESHOLDS:
        freeze_startup_objects()
