"""The door's own error, learned: observed queue wait over predicted, per model.

Admission predicts when an admitted request's first batch starts (`wait_prediction.predict`); the answer says when it
really did. Whatever the model of the queue leaves out (the event loop and the GIL on a small CPU, hand-offs between
batches, turns it does not foresee) shows as a ratio between the two, learned from the requests admitted under
pressure (the only ones whose prediction decided anything); admission multiplies its queue part by it.

Both waits are EWMAs, divided (not a mean of per-request ratios): a request predicted to wait 1 ms that waited 5
must not weigh like one predicted 200 ms that waited 1,000. The factor is clamped, so one odd stretch cannot shut the
door or open it wide, and is 1 until `MIN_OBSERVED` requests were seen. Totals feed /metrics
(`batchserve_admission_*_wait_seconds_total`).

A right mean still leaves half the requests later than predicted: under pressure the queue fills until a new
request's prediction reaches the bound, and ~half of those admitted near it would miss it. So the 95th percentile
of the error left after the factor (observed minus factor x predicted, s) is tracked too, as a streaming quantile
(up 0.95 of a step above it, down 0.05 below, the step a twentieth of the mean predicted wait), and the door keeps
that `margin` below the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.02  # weight of the newest admitted request (~50 requests, well under a second under pressure)
LOW, HIGH = 0.5, 3.0  # the factor's clamp
MIN_OBSERVED = 20  # requests seen before the factor departs from 1
TAIL_Q = 0.95  # the quantile of the error the margin tracks
TAIL_STEP = 0.05  # the margin's step, as a share of the mean predicted wait


@dataclass
class _Model:
    predicted: float = 0.0  # EWMA of predicted waits, s
    actual: float = 0.0  # EWMA of observed waits, s
    seen: int = 0
    tail: float = 0.0  # the TAIL_Q quantile of observed - factor x predicted wait, s
    predicted_total: float = 0.0
    actual_total: float = 0.0


@dataclass
class WaitCalibration:
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
            if m.seen >= MIN_OBSERVED:  # the error left once the factor applies
                error = actual_s - self.factor(model) * predicted_s
                step = max(0.0005, TAIL_STEP * m.predicted)
                m.tail = max(0.0, m.tail + (step * TAIL_Q if error > m.tail else -step * (1 - TAIL_Q)))
            m.predicted += ALPHA * (predicted_s - m.predicted)
            m.actual += ALPHA * (actual_s - m.actual)
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

    def margin(self, model: str) -> float:
        """Seconds the door keeps below its latency bound: the 95th percentile of its corrected error (0 until
        enough was seen)."""
        m = self.models.get(model)
        return m.tail if m is not None and m.seen >= MIN_OBSERVED else 0.0

    def totals(self) -> dict[str, tuple[float, float, int]]:
        """Per model: predicted and observed waits summed (s), and how many requests."""
        return {model: (m.predicted_total, m.actual_total, m.seen) for model, m in self.models.items()}
