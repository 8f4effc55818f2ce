"""The collector tuning of a serving process (`gc_tuning.py`): what the lifespan loads after the CLI's freeze
(the generation replica, or backends loaded there) is frozen too, once the runtime is up; a process that only
embeds the app keeps its collector as it was. Each case runs in its own interpreter (a freeze is for life)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, gc, json, sys
from batchserve.config import Settings
from batchserve.gc_tuning import tune_gc
from batchserve.runtime import Runtime

if sys.argv[1] == "tuned":
    tune_gc()  # as `batchserve serve` does before the server runs
frozen_before = gc.get_freeze_count()

async def main():
    runtime = Runtime.create(Settings(backend="sim", jobs_db="", generation="off"))
    await runtime.start()  # loads the sim backend in the lifespan: after the CLI's freeze
    try:
        backend = next(iter(runtime.backends.values()))
        return {"ready": runtime.ready, "frozen_before": frozen_before, "frozen_after": gc.get_freeze_count(),
                "backend_scanned": any(o is backend for o in gc.get_objects()),
                "thresholds": list(gc.get_threshold())}
    finally:
        await runtime.stop()

print(json.dumps(asyncio.run(main())))
"""


def run_case(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["tuned", "embedded"])
def test_what_the_lifespan_loads_is_frozen_in_a_serving_process_only(mode: str) -> None:
    from batchserve.gc_tuning import GC_THRESHOLDS

    r = run_case(mode)
    assert r["ready"]
    if mode == "tuned":
        assert r["thresholds"] == list(GC_THRESHOLDS)
        assert not r["backend_scanned"] and r["frozen_after"] > r["frozen_before"] > 0
    else:
        assert r["thresholds"] != list(GC_THRESHOLDS)
        assert r["backend_scanned"] and r["frozen_after"] == r["frozen_before"] == 0
