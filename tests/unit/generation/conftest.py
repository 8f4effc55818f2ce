"""The injected clock the generation engine's in-process tests share (test_inference, test_inference_records)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchserve.decoding import engine as engine_module
from tests.unit.fakes import Clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(1000.0)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=c))
    return c
