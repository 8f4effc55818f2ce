"""What answers a model's `/v1/inference` inputs: the one interface the route, the job scheduler and the other
callers of the door read, whichever path runs the model.

Two implementations: `core.service.InferenceService`, the door to the batcher (an input rides a batch on a worker
thread), and `generation.inference.StepperInference` (a generative model's input joins the generation engine's
continuous batch as one sequence, `--inference-path stepper`). The door stays the one entrance: it hands a model's
work to the handler registered for it (`InferenceService.serve_with`), so every caller reaches the stepper alike.
"""

from __future__ import annotations

from typing import Protocol

from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.work import Work


class InferenceHandler(Protocol):
    async def infer(self, work: Work, text: str) -> ItemResult:
        """One input's answer, or the ApiError that fits (503 at the door, 504 past the deadline, 500), or
        ClientGone when `work.gone` says the caller left. Fills in `work.inputs` and `work.cost`."""
        ...

    async def infer_many(self, work: Work, texts: list[str]) -> list[ItemResult]:
        """`infer` for a request of several inputs: admitted together, answered together."""
        ...

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item:
        """A batch-job input at the lowest tier; its future carries an `ItemResult` or the error, its
        `dispatched` says whether it has started running (the scheduler only takes back what has not)."""
        ...

    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]:
        """Batch-job inputs of one job, kept apart from other work where the path can."""
        ...
