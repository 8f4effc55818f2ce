"""One request's value from the door to the device: who asked, for which model, by when, and what it costs.

Made once per request where the caller is identified (the HTTP skeleton, the gRPC servicer, a batch job's
feeder); the wing's parse names the model and the deadline; the door (`InferenceService.infer` / `infer_many`)
fills in the inputs and their cost as it prices them; every path below it (the batcher's items, the generation
engine's sequences, the request log) reads this value rather than a row of positional arguments; accounting (the
ledger, the metrics, the answer's headers) reads it back. Nothing else sets its fields.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from batchserve import errors
from batchserve.core import tiers


class Work(msgspec.Struct, eq=False):
    """One request on its way. A Struct: built in C once per request (the hot path), mutable where the door
    fills it in."""

    request_id: str
    arrived: float  # time.monotonic() at the request's first byte
    tier: int = 1  # a tiers.Tier rank: the caller's
    tenant: str = ""  # the fair queue's lane
    owner: str = ""  # whose request records these are (the tenant, or anonymous@<address>)
    model: str = "unknown"  # the model version that answers, once the wing has picked it
    deadline: float = 0.0  # time.monotonic() by which the answer is due (arrived + the request's timeout)
    gone: Callable[[], bool] | None = None  # True once the caller has hung up
    inputs: int = 1  # inputs the request holds, as the door counted them
    cost: float = 1.0  # their cost units (tokens, or 1 an input), as the door priced them
    asked: str = ""  # the priority the request asked for ("": none), so its answer names the tier it ran at

    @property
    def timeout_s(self) -> float:
        """The request's whole timeout, from its first byte."""
        return self.deadline - self.arrived

    def due_in(self, timeout_s: float) -> Work:
        """This request due `timeout_s` after its first byte (the wing's parse reads the timeout)."""
        self.deadline = self.arrived + timeout_s
        return self

    def ask(self, value: str | int | None, tier: int, best: int, field: str) -> int:
        """Run at the priority the request asks for in `field` (a tier name or OpenAI's `service_tier`), within
        what the caller's key allows (its `tier`, up to `best`; above that, capped): the tier it is queued, shed
        and booked under. Returns that tier's rank."""
        if value is None:
            return tier
        rank = tiers.asked(value, tier, best)
        if rank is None:
            raise errors.invalid(
                f"'{field}' must be one of {', '.join(tiers.ASKABLE)}, or a level 0-{tiers.BATCH.rank + 1}"
            )
        self.tier, self.asked = rank, str(value)
        return rank

    @property
    def record_owner(self) -> str:
        """Under whom the request log keeps this request."""
        return self.owner or self.tenant
