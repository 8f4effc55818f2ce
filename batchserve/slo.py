"""Each served model's own latency objective and timeouts: `Deadlines`, one per model id, in one shared table
(`ModelRegistry.deadlines`).

A leaf: it imports nothing of batchserve, so `core/`, `backends/warmup.py` and the HTTP layer all read it without
a cycle (the settings are seen through the `Knobs` protocol, since `config.py` imports `core`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Knobs(Protocol):
    """What `Deadlines.of_settings` reads of `config.Settings`."""

    slo_ms: float
    timeout_ms: float
    max_timeout_ms: float
    given: dict[str, str]


SET, DEFAULT, DERIVED = "set", "default", "derived"  # where a figure of `Deadlines` came from


@dataclass(slots=True)
class Deadlines:
    """One model's latency objective and timeouts, so an embedder beside a chat model is not held to the chat
    model's seconds. A figure the user set applies to every model; one left unset follows the model's own measured
    batch or answer time (`backends/warmup.py`), else the default."""

    slo_s: float  # the latency objective (p95) its answers are held to
    timeout_s: float  # the deadline of a request that names none
    max_timeout_s: float  # the longest timeout a caller may ask for
    measured_s: float = 0.0  # the batch or answer time the unset figures follow (0: none measured)
    measured: str = ""  # what was measured ("the warm-up batch time", "the stepper's answer time")
    slo_from: str = DEFAULT  # SET, DEFAULT or DERIVED
    timeout_from: str = DEFAULT
    max_timeout_from: str = DEFAULT

    @classmethod
    def of_settings(cls, settings: Knobs) -> Deadlines:
        """The figures of a model with nothing measured: the settings' values, set or default."""
        given = settings.given
        return cls(
            settings.slo_ms / 1000,
            settings.timeout_ms / 1000,
            settings.max_timeout_ms / 1000,
            slo_from=SET if "slo_ms" in given else DEFAULT,
            timeout_from=SET if "timeout_ms" in given else DEFAULT,
            max_timeout_from=SET if "max_timeout_ms" in given else DEFAULT,
        )

    def public(self) -> dict[str, float]:
        """The figures in milliseconds, as /internal/health and /v1/models show them."""
        return {
            "slo_ms": round(self.slo_s * 1000, 3),
            "timeout_ms": round(self.timeout_s * 1000, 3),
            "max_timeout_ms": round(self.max_timeout_s * 1000, 3),
        }
