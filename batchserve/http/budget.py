"""The process's descriptor budget, split between its listeners, so HTTP and gRPC together stay under the
descriptor limit whatever the clients of either port do (a flood of idle gRPC connections cannot take the
descriptors HTTP's /healthz needs, nor the reverse).

The budget is the descriptor limit (soft raised to hard) less a reserve for the process's own files: an eighth, at
least 32. With `--grpc-port`, gRPC's cap is a quarter of it and HTTP's the rest, unless configured.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

from batchserve.config import Settings

UNLIMITED_BUDGET = 65536  # the budget when the descriptor limit is unlimited
GRPC_SHARE = 4  # gRPC's derived cap: a quarter of the budget
MIN_CAP = 16


@dataclass(frozen=True)
class ConnectionBudget:
    total: int  # what the listeners may hold together: the limit less the reserve (UNLIMITED_BUDGET with no limit)
    http: int  # HTTP's connection cap
    grpc: int  # gRPC's connection cap (0 when --grpc-port is off)


def descriptor_limit() -> int | None:
    """The soft descriptor limit, raised to the hard one first; None when unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return None if soft == resource.RLIM_INFINITY else soft


def split(limit: int | None, http_configured: int, grpc_configured: int, grpc_on: bool) -> ConnectionBudget:
    """The caps for a descriptor limit (None: unlimited); a configured cap (> 0) is taken as it is."""
    total = UNLIMITED_BUDGET if limit is None else max(MIN_CAP, limit - max(32, limit // 8))
    grpc = (grpc_configured or max(MIN_CAP, total // GRPC_SHARE)) if grpc_on else 0
    http = http_configured or max(MIN_CAP, total - grpc)
    return ConnectionBudget(total, http, grpc)


def connection_budget(settings: Settings) -> ConnectionBudget:
    return split(descriptor_limit(), settings.max_connections, settings.grpc_max_connections, settings.grpc_port >= 0)
