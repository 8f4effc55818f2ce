"""Fixtures every in-process test may use."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop of the test's own, for policy that creates futures without running a server."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()
