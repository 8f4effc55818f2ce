"""Who is calling: API keys (stored as SHA-256 digests, compared in constant time), tiers and rate limits.

`Tenancy.identify(authorization_header)` returns the `Caller` or raises 401; `Tenancy.take_token(caller)`
raises 429 with `Retry-After` and `X-RateLimit-*` headers when the caller's token bucket is empty.
Keys and tier rates come from the TOML config file (`config_file.py`); `batchserve keys add` writes them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from dataclasses import dataclass, field

from batchserve.config import TIERS, Settings
from batchserve.errors import ApiError

ANONYMOUS = "anonymous"

# Requests per second and burst of each tier unless the config file says otherwise.
DEFAULT_TIER_RATES: dict[str, tuple[float, float]] = {
    "enterprise": (1000.0, 2000.0),
    "paid": (100.0, 200.0),
    "free": (10.0, 20.0),
    "batch": (10.0, 20.0),
}


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    tier: int  # index into config.TIERS
    key_id: str = ""  # first 12 hex digits of the key's digest (safe to log); "" for anonymous callers


@dataclass
class KeyEntry:
    tenant: str
    tier: str
    sha256: str
    rate: float | None = None
    burst: float | None = None


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def headers(self) -> dict[str, str]:
        """Limit is the bucket's size (the most requests the key may send at once), so Remaining (whole
        requests left in it now) never passes it; Reset is the seconds until the bucket is full again. The rate
        it refills at is the tier's (or the key's) requests per second; Retry-After on a 429 says when the next
        request is allowed."""
        refill = (self.burst - self.tokens) / self.rate
        return {"X-RateLimit-Limit": f"{self.burst:g}", "X-RateLimit-Remaining": str(int(self.tokens)),
                "X-RateLimit-Reset": str(math.ceil(refill))}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "bs_" + secrets.token_urlsafe(32)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "UNAUTHORIZED", message, headers={"WWW-Authenticate": "Bearer"})


@dataclass
class Tenancy:
    keys: list[KeyEntry] = field(default_factory=list)
    tier_rates: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TIER_RATES))
    anonymous_allowed: bool = True
    anonymous_tier: str = "paid"
    buckets: dict[str, TokenBucket] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: Settings) -> "Tenancy":
        return cls(keys=[KeyEntry(**k) for k in s.keys], tier_rates={**DEFAULT_TIER_RATES, **s.tier_rates},
                   anonymous_allowed=not s.keys or s.allow_anonymous, anonymous_tier=s.anonymous_tier)

    def identify(self, authorization: str | None) -> Caller:
        token = ""
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise unauthorized("use 'Authorization: Bearer <key>'")
            token = token.strip()
        if not token:
            if self.anonymous_allowed:
                return Caller(ANONYMOUS, TIERS.index(self.anonymous_tier))
            raise unauthorized("an API key is required: 'Authorization: Bearer <key>'")
        wanted = digest(token)
        found: KeyEntry | None = None
        for entry in self.keys:  # every digest compared, in constant time: no early exit to time
            if hmac.compare_digest(entry.sha256, wanted):
                found = entry
        if found is None:
            raise unauthorized("unknown API key")
        return Caller(found.tenant, TIERS.index(found.tier), wanted[:12])

    def take_token(self, caller: Caller) -> dict[str, str]:
        """Spend one request from the caller's bucket; returns the X-RateLimit-* headers, or raises 429."""
        if not caller.key_id:
            return {}
        bucket = self.buckets.get(caller.key_id)
        now = time.monotonic()
        if bucket is None:
            rate, burst = self._limits(caller.key_id)
            bucket = self.buckets[caller.key_id] = TokenBucket(rate, burst, burst, now)
        if bucket.take(now):
            return bucket.headers()
        headers = bucket.headers()
        retry_ms = (1.0 - bucket.tokens) / bucket.rate * 1000
        raise ApiError(429, "RATE_LIMITED", f"over the rate of {bucket.rate:g} requests/s for this key",
                       retry_after_ms=max(1, int(retry_ms)), headers=headers)

    def _limits(self, key_id: str) -> tuple[float, float]:
        entry = next(e for e in self.keys if e.sha256.startswith(key_id))
        rate, burst = self.tier_rates.get(entry.tier, DEFAULT_TIER_RATES[entry.tier])
        rate = entry.rate if entry.rate is not None else rate
        burst = entry.burst if entry.burst is not None else max(burst, rate)
        return rate, burst
