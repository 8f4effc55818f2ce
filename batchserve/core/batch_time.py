"""The learned batch time S, per model and by batch cost (issues 13 and 22).

Cost, not count (issue 22): a batch's cost is what the backend says it costs to run — for the built-ins its
padded tokens (rows x the longest row's tokens); for a plugin that says nothing, 1 per input, so its cost is
its size and everything below reads as "by size". One axis serves both: the sim and plain plugins learn S by
size exactly as before, a tokenizing model learns S by tokens, and a batch of 60 long inputs is expected to take
what such batches took, not what a batch of 60 short ones did.

Why by size: the sim takes the same time for 1 input as for 100, but a real model on a GPU does not (a batch of 1
decodes in a fraction of a batch of 100's time), and one S per model, learned from whatever sizes happened to
run, is wrong for every other size: a deadline computed with a full batch's S dispatches a lone item far too
early, one computed with a lone item's S too late.

How: sizes fall in power-of-two buckets (1, 2, 3-4, 5-8, ..., 65-128); each bucket keeps an exponentially
weighted mean of the sizes it saw and of their batch times, one point (n, S) per bucket. S at any size is read
off the line through the measured points:
- between two points: linear interpolation;
- below the smallest: that point's S (a smaller batch is not slower; no guess at how much faster);
- above the largest: the line through the smallest and largest points (the widest baseline, so two noisy
  neighbours cannot fake a steep slope), never falling and never steeper than proportional growth from the
  largest point (S(n) <= S(largest) x n / largest: a batch costs at most its inputs one by one);
- no point yet: the model's seed (the backend's first guess, or a warm-up measurement).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from collections.abc import Iterator

EWMA_ALPHA = 0.2  # weight of the newest batch in a bucket's mean
DEFAULT_SEED_S = 1.0  # a model with neither a seed nor a measurement
MEMO_KEPT = 1024  # costs whose S a line remembers (then it starts over)


def size_bucket(n: float) -> int:
    """0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ...: the power of two at or above n."""
    return max(0, (max(1, math.ceil(n)) - 1).bit_length())


@dataclass
class Point:
    size: float  # mean batch size seen in the bucket
    seconds: float  # mean batch time seen in the bucket


@dataclass(frozen=True)
class _Line:
    """A model's measured points by size, and the slope to read past the largest."""

    sizes: list[float]
    seconds: list[float]
    slope: float
    # S read off this line by cost: a count model's batches (1..100 inputs) are read again and again, ~8 times
    # per admitted request, between two batches; a new line (an observation) starts empty. Bounded, since a
    # costed model's costs are floats that rarely repeat.
    memo: dict[float, float] = field(default_factory=dict, compare=False)
    # `BatchTimes.most` by the cap it was read at: the door asks it on every request, the line changes per batch.
    tops: dict[float, float] = field(default_factory=dict, compare=False)

    @classmethod
    def through(cls, points: list[Point]) -> _Line:
        if not points:
            return cls([], [], 0.0)
        first, last = points[0], points[-1]
        slope = (last.seconds - first.seconds) / (last.size - first.size) if last.size > first.size else 0.0
        slope = min(max(0.0, slope), last.seconds / last.size)
        return cls([p.size for p in points], [p.seconds for p in points], slope)

    def read(self, n: float) -> float:
        """S at cost n (>= 1) off the points (module docstring); at least one point."""
        sizes, secs = self.sizes, self.seconds
        i = bisect.bisect_right(sizes, n)  # the points at or below n: sizes[:i]
        if i == 0:
            return secs[0]
        lo = i - 1
        if sizes[lo] == n:
            return secs[lo]
        if i < len(sizes):
            return secs[lo] + (secs[i] - secs[lo]) * (n - sizes[lo]) / (sizes[i] - sizes[lo])
        return secs[lo] + self.slope * (n - sizes[lo])


@dataclass
class BatchTimes:
    """S(n) per model. Indexing (`times[model]`) gives a full batch's S, the one number for callers that do not
    know a size (capacity, timeouts, retry hints)."""

    max_batch_size: int
    seeds: dict[str, float] = field(default_factory=dict)
    # Per model: the cost of a full batch (what `times[model]` reads S at) and the highest cost `at` reads
    # (a costed model's batches are not bounded by the batch size). Both default to max_batch_size: one per input.
    full: dict[str, float] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)
    points: dict[str, dict[int, Point]] = field(default_factory=dict)
    alpha: float = EWMA_ALPHA
    # Each model's line, read on every request (at its own size, which changes with every arrival: a memo by
    # size missed nearly always) and rebuilt only after an observation.
    _lines: dict[str, _Line] = field(default_factory=dict, repr=False)
    # Bumped by whatever may change what `at` or `most` read for any model (a point, a seed, a cap or a full
    # batch's cost, and `BatchBudget`'s budgets and mean costs, which it bumps): what the door keeps per model
    # between two batches is stale once it moved (`admission.DoorFigures`).
    version: int = 0

    def seed(self, model: str, seconds: float) -> None:
        """The batch time to assume before any batch of `model` is measured."""
        self.seeds[model] = seconds
        self.version += 1

    def observe(self, model: str, size: float, seconds: float) -> None:
        """One batch of cost `size` (its inputs, for a plugin that declares no cost) took `seconds`."""
        self._lines.pop(model, None)
        self.version += 1
        buckets = self.points.setdefault(model, {})
        p = buckets.get(size_bucket(size))
        if p is None:
            buckets[size_bucket(size)] = Point(float(size), seconds)
            return
        p.size += self.alpha * (size - p.size)
        p.seconds += self.alpha * (seconds - p.seconds)

    def forget_above(self, model: str, cost: float) -> None:
        """Drop the points of batches costlier than `cost` (the model's budget was lowered below them): a
        slow point nothing will run at again must not keep the budget low for good; the line above the
        points left is extrapolated, and a budget raised on it is measured again."""
        buckets = self.points.get(model, {})
        for key in [k for k, p in buckets.items() if p.size > cost]:
            del buckets[key]
        self._lines.pop(model, None)
        self.version += 1

    def at(self, model: str, size: float) -> float:
        """The expected time of a batch of cost `size` (clamped to 1..the model's cap)."""
        cap = self.caps.get(model, self.max_batch_size)  # clamped to 1..cap: comparisons, not min() and max()
        n = size if size < cap else cap
        n = float(n) if n > 1.0 else 1.0
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = _Line.through(sorted(self.points.get(model, {}).values(), key=lambda p: p.size))
        memo = line.memo
        got = memo.get(n)
        if got is not None:
            return got
        if not line.sizes:
            return self.seeds.get(model, DEFAULT_SEED_S)  # not kept: a seed may be set again
        if len(memo) >= MEMO_KEPT:
            memo.clear()
        got = memo[n] = line.read(n)
        return got

    def most(self, model: str) -> float:
        """The longest any batch of this model is expected to take (`at` of any cost is at most this): the
        slowest point, or the line read at the model's cap where it rises past them (inf: a costed model's
        batches are capped by no count, so a rising line has no top). Lets the door skip a prediction that could
        not matter."""
        cap = self.caps.get(model, self.max_batch_size)
        line = self._lines.get(model)
        if line is not None:
            got = line.tops.get(cap)
            if got is not None:
                return got
        else:
            self.at(model, 1.0)  # builds the line
            line = self._lines[model]
        if not line.sizes:
            return self.seeds.get(model, DEFAULT_SEED_S)  # not kept: a seed may be set again
        if cap == math.inf:
            top = math.inf if line.slope > 0 else max(line.seconds)
        else:
            top = max(max(line.seconds), self.at(model, cap))
        line.tops[cap] = top
        return top

    def lower_bound(self, model: str, size: float) -> float:
        """The least a batch of `size` may be expected to take, for refusing or dropping work that could not
        finish in time: the learned S(size), or the seed (the backend's own guess, or its warm-up time) where
        that is lower. Not the learned S alone: one slow first batch (a cold start, a hang that ended) set it,
        every request was then refused at the door or dropped before its batch, and with nothing running
        nothing could teach it otherwise: the model refused all traffic for good."""
        learned = self.at(model, size)
        seed = self.seeds.get(model)
        return learned if seed is None else min(learned, seed)

    def by_size(self, model: str) -> dict[int, float]:
        """The measured points, mean size (rounded) to seconds: what /internal/health shows."""
        return {round(p.size): p.seconds for p in sorted(self.points.get(model, {}).values(), key=lambda p: p.size)}

    def largest(self, model: str) -> float:
        """The cost of the costliest batch measured (0: none yet)."""
        return max((p.size for p in self.points.get(model, {}).values()), default=0.0)

    def fit(self, model: str, seconds: float, floor: float, top: float) -> float:
        """The largest cost in [floor, top] whose batch is expected within `seconds` (halving from `top`): what a
        model's cost budget is lowered to when a full batch would outlast the longest allowed timeout."""
        cost = top
        while cost > floor and self.at(model, cost) > seconds:
            cost = max(floor, cost / 2)
        return cost

    # -- one number per model: a full batch's S --------------------------------------------------------------
    def __getitem__(self, model: str) -> float:
        return self.at(model, self.full.get(model, self.max_batch_size))

    def models(self) -> list[str]:
        return sorted(set(self.seeds) | set(self.points))

    def __iter__(self) -> Iterator[str]:
        return iter(self.models())

    def values(self) -> list[float]:
        return [self[m] for m in self.models()]

    def items(self) -> list[tuple[str, float]]:
        return [(m, self[m]) for m in self.models()]
