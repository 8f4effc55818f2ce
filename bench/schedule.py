"""The arrival schedule shared by the load generator and the ideal model.

Both must see the *same* Poisson arrivals (same seed, rate and length), so a measured row and its ideal
number differ only by the server, never by the luck of the draw.
"""

from __future__ import annotations

import numpy as np


def poisson_schedule(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Send offsets in seconds from the start, exponential gaps of mean 1/rate, all below `duration_s`."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    rng = np.random.default_rng(seed)
    # Draw a little more than the expected count, then top up in the rare case it was not enough.
    n = int(rate * duration_s + 10 * (rate * duration_s) ** 0.5 + 100)
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    while times[-1] < duration_s:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, n))
        times = np.concatenate([times, more])
    return times[times < duration_s]


def row_seed(base: int, devices: int, rate: float) -> int:
    """A stable seed per table row, so every run of the standard table replays the same arrivals."""
    return (base * 1_000_003 + devices * 10_007 + int(round(rate))) % (2**32)
