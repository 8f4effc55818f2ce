"""Who is calling: API keys (stored as SHA-256 digests, compared in constant time), tiers and rate limits.

`identify(request)` returns the `Caller`, or raises 401; `check_rate(caller)` raises 429 with the
`Retry-After` and `X-RateLimit-*` headers when the caller's token bucket is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    tier: int  # index into config.TIERS
    key_id: str = ""  # a short public prefix of the key's digest; "" for anonymous callers
