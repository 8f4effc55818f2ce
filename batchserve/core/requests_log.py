"""Recent requests by owner and id, for `GET /v1/requests/{id}`: a bounded, insertion-ordered map.

A record belongs to the tenant that made the request (for anonymous callers, their address): it is stored
and found under (owner, id), so another tenant neither reads it nor, by sending the same `X-Request-ID`,
overwrites it.

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
    owner: str = ""  # the tenant (or anonymous@address) that made the request; not shown
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
        out = asdict(self)
        del out["owner"]
        return out


class RequestLog:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._records: OrderedDict[tuple[str, str], Record] = OrderedDict()

    def add(self, owner: str, request_id: str, model: str) -> Record:
        rec = Record(request_id, model, owner, created_at=time.time())
        key = (owner, request_id)
        self._records.pop(key, None)  # a reused id is the owner's newest request: keep it the youngest
        self._records[key] = rec
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return rec

    def get(self, owner: str, request_id: str) -> Record | None:
        return self._records.get((owner, request_id))
