"""A burst rides one batch: how long a free worker waits for the rest of a burst whose first inputs it sees.

Why: closed-loop clients (locust's users, a UI's fan-out, a job runner's workers) send in bursts: spawned
together, each paced from its previous send, so their next sends come together again. A free device takes what
waits at once (`Batcher.most_urgent`), so a burst's first input went alone and the rest waited a whole batch
behind it: every caller's latency doubled at any load, though the device was idle.

The rule, per model, from the gaps between the arrivals the door sees (`arrived`, the requests' first byte):

- a gap of at most `GAP_MAX_S` is a gap inside a burst; the share of arrivals that come so (`share`) and the
  typical such gap (`gap_s`) are decayed means over the last ten or so arrivals (one burst teaches them);
- while at least `BURSTY_SHARE` of arrivals come inside bursts, a free worker waits until no input has arrived
  for `QUIET_GAPS` typical gaps (at least `QUIET_MIN_S`, at most `GAP_MAX_S`): the burst is over;
- never longer than a share of one batch's time after the oldest waiting input arrived (`WINDOW_BATCH_SHARE`, at
  most `WINDOW_MAX_S`), and never past its dispatch deadline (the batcher's rule, unchanged), so an input that
  waited through a running batch goes at once;
- arrivals that are spread (open-loop, Poisson at a rate where gaps of a few ms are rare) hold nothing, and
  neither do arrivals so dense that they never fall quiet (a run of close arrivals longer than the window is a
  stream, not a burst: several devices at high rates would otherwise each wait out the window).

A full queue goes at once. Pure arithmetic over arrival times, so the unit tests drive it with an injected
clock (tests/unit/core/test_burst.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GAP_MAX_S = 0.008  # a gap this short or shorter is inside a burst; also the longest quiet a worker waits for
QUIET_GAPS = 8.0  # the burst is over once no input came for this many typical in-burst gaps
# ... but at least this long: the door's own hiccups inside a burst (its first request's cold path, a batch's
# answers written meanwhile) and the client's (one locust process sends 60 users' requests over ~30 ms) part two
# requests sent together by 1-8 ms on this machine, where most are 0.1 ms apart
QUIET_MIN_S = 0.006
# The most a burst holds its first input, from its arrival: a share of one batch's time, and never more than
# WINDOW_MAX_S. A burst of 60 users from one locust process takes ~20 ms to arrive; an input that waited through a
# running batch (its wait already a batch time long) is past its window, so a busy device never idles for one.
WINDOW_BATCH_SHARE = 0.4
WINDOW_MAX_S = 0.040
BURSTY_SHARE = 0.5  # arrivals come in bursts when at least this share of them follow another within GAP_MAX_S
INITIAL_SHARE = 0.7  # bursty until arrivals say otherwise: one lone input (x 0.8) leaves it above BURSTY_SHARE
ALPHA = 0.2  # weight of the newest arrival in the decayed means (the last ten or so: one burst teaches it)


@dataclass
class Bursts:
    """One model's arrivals: whether they come in bursts, and how far apart inside one."""

    last: float = -math.inf  # when the latest input arrived
    started: float = -math.inf  # when the run of close arrivals the latest belongs to began
    # Decayed share of arrivals that followed another within GAP_MAX_S; it starts as if bursty, so a server's very
    # first burst rides one batch too (a lone first input then waits one quiet, a few ms).
    share: float = INITIAL_SHARE
    gap_s: float = GAP_MAX_S  # decayed mean of those gaps

    def arrived(self, at: float) -> None:
        """An input that arrived at `at` (out of order by a few µs is fine: a negative gap counts as 0)."""
        gap = at - self.last
        if gap <= GAP_MAX_S:
            self.share += ALPHA * (1.0 - self.share)
            self.gap_s += ALPHA * (max(0.0, gap) - self.gap_s)
        else:
            self.share -= ALPHA * self.share
            self.started = at
        if at > self.last:
            self.last = at

    def until(self, oldest: float, batch_s: float) -> float:
        """Until when a free worker waits for the rest of the burst whose oldest waiting input arrived at
        `oldest`, for a model whose batch takes `batch_s` (-inf: it does not wait)."""
        if self.share < BURSTY_SHARE:
            return -math.inf
        window = min(WINDOW_MAX_S, WINDOW_BATCH_SHARE * batch_s)
        if self.last - self.started > window:  # close arrivals for longer than a burst lasts: a stream, no burst
            return -math.inf
        quiet = min(GAP_MAX_S, max(QUIET_MIN_S, QUIET_GAPS * self.gap_s))
        return min(self.last + quiet, oldest + window)
