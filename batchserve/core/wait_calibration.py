"""The door's own error, learned: observed queue wait over predicted, per model (issue 22).

Admission predicts when an admitted request's first batch starts (`admission.predict`: the class turns, the
learned batch times); the answer says when it really did. Whatever the model of the queue leaves out — the event
loop and the GIL on a small CPU, hand-offs between batches, turns it does not foresee — shows as a ratio between
the two. Like `BatchTimes` learns S from the batches that ran, this learns the ratio from the requests that were
admitted under pressure (the ones whose prediction decided anything: without pressure only the deadline, seconds
away, bounds them), and admission multiplies the queue part of its prediction by it.

Both waits are kept as exponentially weighted means and divided (not a mean of per-request ratios): a request
predicted to wait 1 ms that waited 5 must not weigh like one predicted 200 ms that waited 1,000. The factor is
clamped, so one odd stretch cannot shut the door (too high) or open it wide (too low), and it starts at 1 until
`MIN_OBSERVED` requests were seen. Totals are kept for /metrics (`batchserve_admission_*_wait_seconds_total`):
their increase over a window is the ratio a benchmark reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.02  # weight of the newest admitted request (~50 requests, well under a second under pressure)
LOW, HIGH = 0.5, 3.0  # the factor's clamp
MIN_OBSERVED = 20  # requests seen before the factor departs from 1


@dataclass
class _Model:
    predicted: float = 0.0  # EWMA of predicted waits, s
    actual: float = 0.0  # EWMA of observed waits, s
    seen: int = 0
    predicted_total: float = 0.0
    actual_total: float = 0.0


@dataclass
class WaitCalibration:
    alpha: float = ALPHA
    low: float = LOW
    high: float = HIGH
    models: dict[str, _Model] = field(default_factory=dict)

    def observe(self, model: str, predicted_s: float, actual_s: float) -> None:
        """An admitted request predicted to start its batch `predicted_s` after admission started it after
        `actual_s`."""
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = _Model(predicted_s, actual_s)
        else:
            m.predicted += self.alpha * (predicted_s - m.predicted)
            m.actual += self.alpha * (actual_s - m.actual)
        m.seen += 1
        m.predicted_total += predicted_s
        m.actual_total += actual_s

    def factor(self, model: str) -> float:
        """What the queue part of a prediction is multiplied by: observed over predicted, clamped; 1 until
        enough was seen."""
        m = self.models.get(model)
        if m is None or m.seen < MIN_OBSERVED or m.predicted <= 0:
            return 1.0
        return min(self.high, max(self.low, m.actual / m.predicted))

    def totals(self) -> dict[str, tuple[float, float, int]]:
        """Per model: predicted and observed waits summed (s), and how many requests."""
        return {model: (m.predicted_total, m.actual_total, m.seen) for model, m in self.models.items()}
