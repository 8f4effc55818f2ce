"""Recent requests by id, for `GET /v1/requests/{id}`: a bounded, insertion-ordered map.

In memory and per process: behind a load balancer a status lookup must reach the node that served the
request (the answer's `X-Request-ID` and the node's logs are the durable record).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Record:
    request_id: str
    model: str
    status: str = "queued"  # queued | processing | completed | failed
    created_at: float = 0.0  # wall clock, seconds since the epoch
    latency_ms: float | None = None
    queue_ms: float | None = None
    compute_ms: float | None = None
    batch_size: int | None = None
    error: str | None = None

    def completed(self, latency_ms: float, queue_ms: float, compute_ms: float, batch_size: int) -> None:
        self.status = "completed"
        self.latency_ms, self.queue_ms, self.compute_ms = round(latency_ms, 1), round(queue_ms, 1), round(compute_ms, 1)
        self.batch_size = batch_size

    def public(self) -> dict:
        return asdict(self)


class RequestLog:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._records: OrderedDict[str, Record] = OrderedDict()

    def add(self, request_id: str, model: str) -> Record:
        rec = Record(request_id, model, created_at=time.time())
        self._records[request_id] = rec
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return rec

    def get(self, request_id: str) -> Record | None:
        return self._records.get(request_id)
