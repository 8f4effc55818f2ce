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
from dataclasses import dataclass, field, replace

from batchserve import errors
from batchserve.config import Settings
from batchserve.core import tiers

ANONYMOUS = "anonymous"
ANONYMOUS_OWNER = ANONYMOUS + "@"  # + the client's address: who owns an anonymous caller's jobs and records
ANONYMOUS_CACHE = 4096  # anonymous Callers kept, one per client address

# Requests per second and burst of each tier unless the config file says otherwise.
DEFAULT_TIER_RATES: dict[str, tuple[float, float]] = {t.name: (t.rate, t.burst) for t in tiers.TIERS}


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str  # the lane it is scheduled and rate-limited in (all anonymous callers share one)
    tier: int  # a tiers.Tier rank
    key_id: str = ""  # first 12 hex digits of the key's digest (safe to log); "" for anonymous callers
    owner: str = ""  # who its jobs and request records belong to: the tenant, or anonymous@<client address>
    admin: bool = False  # its key has `admin = true`: GET /v1/usage shows it every tenant
    best: int = -1  # the highest tier (lowest rank) a request may ask for: its key's `best_tier`, else `tier`

    @property
    def ceiling(self) -> int:
        return self.tier if self.best < 0 else self.best

    def at(self, tier: int) -> Caller:
        """This caller running one request at `tier` (its own priority, `Work.ask`): what the books read."""
        return self if tier == self.tier else replace(self, tier=tier)


def lane_of(owner: str) -> str:
    """The scheduling lane of an owner: anonymous owners (one per client address) share the anonymous lane,
    so the fair queue holds one lane per configured tenant, not one per address ever seen."""
    return ANONYMOUS if owner.startswith(ANONYMOUS_OWNER) else owner


@dataclass
class KeyEntry:
    tenant: str
    tier: str
    sha256: str
    rate: float | None = None
    burst: float | None = None
    admin: bool = False  # GET /v1/usage shows this key every tenant's figures
    best_tier: str | None = None  # the highest tier a request may ask for (`priority`, `service_tier`)


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float
    updated: float

    def has(self, now: float, count: int = 1) -> bool:
        """Whether `count` tokens are there now (refilled to `now`), none taken."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        return self.tokens >= count

    def take(self, now: float, count: int = 1) -> bool:
        if self.has(now, count):
            self.tokens -= count
            return True
        return False

    def headers(self) -> dict[str, str]:
        """Limit is the bucket's size (the most requests the key may send at once), so Remaining (whole
        requests left in it now) never passes it; Reset is the seconds until the bucket is full again. The rate
        it refills at is the tier's (or the key's) requests per second; Retry-After on a 429 says when the next
        request is allowed."""
        refill = (self.burst - self.tokens) / self.rate
        # Lower-case, as every other header batchserve writes (Starlette lower-cases what it sends; the hot
        # route writes these names as given): one spelling on a 200 and a 429.
        return {
            "x-ratelimit-limit": f"{self.burst:g}",
            "x-ratelimit-remaining": str(int(self.tokens)),
            "x-ratelimit-reset": str(math.ceil(refill)),
        }


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "bs_" + secrets.token_urlsafe(32)


@dataclass
class Tenancy:
    keys: list[KeyEntry] = field(default_factory=list)
    tier_rates: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TIER_RATES))
    anonymous_allowed: bool = True
    anonymous_tier: str = "paid"
    buckets: dict[str, TokenBucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._anonymous_rank = tiers.by_name(self.anonymous_tier).rank
        # The anonymous Caller of each client address, built once (a frozen dataclass costs ~0.5 us a request);
        # emptied past ANONYMOUS_CACHE addresses, so a sweep of addresses cannot grow it without bound.
        self._anonymous: dict[str, Caller] = {}

    @classmethod
    def from_settings(cls, s: Settings) -> Tenancy:
        return cls(
            keys=[KeyEntry(**k) for k in s.keys],
            tier_rates={**DEFAULT_TIER_RATES, **s.tier_rates},
            anonymous_allowed=not s.keys or s.allow_anonymous,
            anonymous_tier=s.anonymous_tier,
        )

    def identify(self, authorization: str | None, client: str = "") -> Caller:
        """The caller of a request, from its Authorization header; `client` (the peer's address) tells
        anonymous callers apart as owners of jobs and request records."""
        token = ""
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise errors.unauthorized("use 'Authorization: Bearer <key>'")
            token = token.strip()
        if not token:
            if self.anonymous_allowed:
                caller = self._anonymous.get(client)
                if caller is None:
                    if len(self._anonymous) >= ANONYMOUS_CACHE:
                        self._anonymous.clear()
                    caller = self._anonymous[client] = Caller(
                        ANONYMOUS, self._anonymous_rank, "", ANONYMOUS_OWNER + client
                    )
                return caller
            raise errors.unauthorized("an API key is required: 'Authorization: Bearer <key>'")
        wanted = digest(token)
        found: KeyEntry | None = None
        for entry in self.keys:  # every digest compared, in constant time: no early exit to time
            if hmac.compare_digest(entry.sha256, wanted):
                found = entry
        if found is None:
            raise errors.unauthorized("unknown API key")
        rank = tiers.by_name(found.tier).rank
        best = min(rank, tiers.by_name(found.best_tier).rank) if found.best_tier else rank
        return Caller(found.tenant, rank, wanted[:12], found.tenant, found.admin, best)

    def take_token(self, caller: Caller, count: int = 1) -> dict[str, str]:
        """Spend `count` requests (the inputs of a list, on /v1/embeddings) from the caller's bucket; returns the
        X-RateLimit-* headers, or raises 429."""
        if not caller.key_id:
            return {}
        bucket = self._bucket(caller.key_id)
        if bucket.take(time.monotonic(), count):
            return bucket.headers()
        raise self._over(bucket, count)

    def check_token(self, caller: Caller, count: int = 1) -> None:
        """429 unless `count` tokens could be taken now; none are taken. For a route whose cost is known only
        from its body (a list of inputs): a caller with an empty bucket is refused before its body is read."""
        if not caller.key_id:
            return
        bucket = self._bucket(caller.key_id)
        if not bucket.has(time.monotonic(), count):
            raise self._over(bucket, count)

    def _bucket(self, key_id: str) -> TokenBucket:
        bucket = self.buckets.get(key_id)
        if bucket is None:
            rate, burst = self._limits(key_id)
            bucket = self.buckets[key_id] = TokenBucket(rate, burst, burst, time.monotonic())
        return bucket

    @staticmethod
    def _over(bucket: TokenBucket, count: int) -> errors.ApiError:
        """The 429 for `count` tokens the bucket cannot give."""
        headers = bucket.headers()
        if count > bucket.burst:
            return errors.rate_limited(
                f"{count} inputs in one request are more than this key's burst of "
                f"{bucket.burst:g}: send at most {int(bucket.burst)} per request",
                count / bucket.rate * 1000,
                headers,
            )
        retry_ms = (count - bucket.tokens) / bucket.rate * 1000
        return errors.rate_limited(f"over the rate of {bucket.rate:g} requests/s for this key", retry_ms, headers)

    def _limits(self, key_id: str) -> tuple[float, float]:
        entry = next(e for e in self.keys if e.sha256.startswith(key_id))
        rate, burst = self.tier_rates.get(entry.tier, DEFAULT_TIER_RATES[entry.tier])
        rate = entry.rate if entry.rate is not None else rate
        burst = entry.burst if entry.burst is not None else max(burst, rate)
        return rate, burst
