"""Who is calling and whether they may, in one place for every route: the caller from its key and client address,
its rate-limit tokens, the metrics key of the operational routes, and the count of what was answered (status
counts and the SLO ledger, `core/ledger.py`), so every model route books its answers alike. Below it, the policy
it applies (keys, tiers, token buckets: `Tenancy`)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from dataclasses import dataclass, field, replace

from starlette.types import Scope

from batchserve import errors
from batchserve.core import ledger, tiers
from batchserve.core.ledger import UsageBook
from batchserve.core.tiers import NAMES as TIER_NAMES
from batchserve.errors import ApiError
from batchserve.metrics import Metrics
from batchserve.config import Settings
from batchserve.slo import Deadlines


@dataclass
class Guard:
    tenancy: Tenancy
    metrics: Metrics
    metrics_key: str = ""  # --metrics-key: what the operational routes ask for ("" = open)
    answered: int = 0  # requests answered since start, any status
    slo_s: float = 0.2  # the SLO for a model without its own in `deadlines`
    deadlines: dict[str, Deadlines] = field(default_factory=dict)  # shared with `ModelRegistry.deadlines`
    usage: UsageBook = field(default_factory=UsageBook)  # per tenant, for GET /v1/usage
    gateways: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def via_gateway(self, scope: Scope) -> bool:
        """Whether the request's peer is a configured gateway (`--gateway-ips`): only then are its fairness-id and
        objective headers believed (anyone else could send them to jump a queue or another tenant's lane)."""
        client = scope.get("client")
        if not client or not self.gateways:
            return False
        try:
            peer = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        return any(peer in network for network in self.gateways)

    def identify(self, authorization: str | None, scope: Scope, openai: bool = False) -> Caller:
        """The caller (401 when keys are configured and its key is missing or wrong). The peer's address is read
        here so no route can forget it: it tells anonymous callers apart as owners of jobs and records. On the
        OpenAI routes clients always send a key: with no keys configured, any key is anonymous (as vLLM does)."""
        if openai and not self.tenancy.keys:
            authorization = None
        client = scope.get("client")  # http/plumbing.client_host, inlined: every request
        return self.tenancy.identify(authorization, client[0] if client else "")

    def enter(self, authorization: str | None, scope: Scope, openai: bool = False) -> Caller:
        """Identify, and refuse (429) a caller whose bucket is empty, taking no token: for a route whose cost is
        known only from its body, so the refusal comes before the body is read (`take` once it is)."""
        caller = self.identify(authorization, scope, openai)
        self.tenancy.check_token(caller)
        return caller

    def check(self, caller: Caller) -> None:
        """`enter`'s second half, for a route that keeps the caller to book a 429 to."""
        self.tenancy.check_token(caller)

    def take(self, caller: Caller, count: int = 1) -> dict[str, str]:
        """Spend `count` tokens: the X-RateLimit-* headers, or 429."""
        return self.tenancy.take_token(caller, count)

    def admit(
        self, authorization: str | None, scope: Scope, count: int = 1, openai: bool = False
    ) -> tuple[Caller, dict[str, str]]:
        caller = self.identify(authorization, scope, openai)
        return caller, self.tenancy.take_token(caller, count)

    def ok(self, model: str, latency_s: float, caller: Caller, inputs: int = 1, cost: float = 1.0) -> None:
        """A model's answer went out: `inputs` served, costing `cost` units (tokens, or 1 an input)."""
        self.answered += 1
        d = self.deadlines.get(model)
        outcome = ledger.MET if latency_s <= (self.slo_s if d is None else d.slo_s) else ledger.SLOW
        tier = TIER_NAMES[caller.tier]  # `settle`'s booking, inlined: every answer of every model route
        self.metrics.count_ok(model, latency_s, tier, ledger.OUTCOMES[outcome], inputs, cost)
        self.usage.record(caller.tenant, tier, outcome, inputs, cost, latency_s, model)

    def refused(self, model: str, err: ApiError, caller: Caller | None, inputs: int = 1) -> None:
        """An error went out, counted by its code, and in the SLO ledger when it is an outcome (429, 5xx) of a
        known caller."""
        self.answered += 1
        self.metrics.count_error(model, err)
        self.settle(model, caller, err.status, 0.0, inputs)

    def settle(
        self, model: str, caller: Caller | None, status: int, latency_s: float, inputs: int = 1, cost: float = 1.0
    ) -> None:
        """The SLO ledger's entry of an answer with `status` (nothing for a 4xx other than 429, or a 499); for
        routes that count their statuses themselves."""
        if caller is None:
            return
        if 200 <= status < 300:
            d = self.deadlines.get(model)
            outcome: int | None = ledger.MET if latency_s <= (self.slo_s if d is None else d.slo_s) else ledger.SLOW
        else:
            outcome = ledger.error_outcome(status)  # None for a 499 too
        if outcome is None:
            return
        tier = TIER_NAMES[caller.tier]
        served = outcome <= ledger.SLOW
        self.metrics.count_outcome(
            model, tier, ledger.OUTCOMES[outcome], inputs if served else 0, cost if served else 0.0
        )
        self.usage.record(caller.tenant, tier, outcome, inputs, cost, latency_s, model)

    def shed(self, err: ApiError) -> None:
        """A refusal of work outside the batcher, counted as the door's refusals are; the answer itself is counted
        when it goes out."""
        self.metrics.rejected.labels(err.code).inc()

    def gone(self, model: str) -> None:
        """The caller hung up: a 499 in the model's status counts; no SLO outcome (nobody read an answer)."""
        self.metrics.requests.labels(model, "499").inc()

    def counted(self) -> None:
        """An answer went out that the model metrics do not count."""
        self.answered += 1

    def check_ops_key(self, authorization: str | None) -> None:
        """401 unless the caller shows `--metrics-key` (when one is set)."""
        key = self.metrics_key
        if not key:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise errors.unauthorized("this route needs the metrics key: 'Authorization: Bearer <metrics key>'")


# -- the caller policy: keys, tiers of callers, token buckets ------------------------------------------------------
# API keys are stored as SHA-256 digests and compared in constant time; keys and tier rates come from the TOML
# config file (`config_file.py`), which `batchserve keys add` writes.
ANONYMOUS = "anonymous"
ANONYMOUS_OWNER = ANONYMOUS + "@"  # + the client's address: who owns an anonymous caller's jobs and records
ANONYMOUS_CACHE = 4096  # anonymous Callers kept, one per client address

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
        """This caller running one request at `tier` (its own priority, `Work.ask`)."""
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
        """Whether `count` tokens are there now, none taken."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        return self.tokens >= count

    def take(self, now: float, count: int = 1) -> bool:
        if self.has(now, count):
            self.tokens -= count
            return True
        return False

    def headers(self) -> dict[str, str]:
        """Limit is the bucket's size (the most requests the key may send at once), so Remaining never passes
        it; Reset is the seconds until the bucket is full again."""
        refill = (self.burst - self.tokens) / self.rate
        # Lower-case, as Starlette sends them (the hot route writes names as given): one spelling on a 200 and a 429.
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
        # The anonymous Caller per client address, built once rather than per request; emptied past
        # ANONYMOUS_CACHE addresses, so a sweep of addresses cannot grow it without bound.
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
        """The caller, from its Authorization header; `client` (the peer's address) tells anonymous callers
        apart as owners."""
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
        """Spend `count` tokens; returns the X-RateLimit-* headers, or raises 429."""
        if not caller.key_id:
            return {}
        bucket = self._bucket(caller.key_id)
        if bucket.take(time.monotonic(), count):
            return bucket.headers()
        raise self._over(bucket, count)

    def check_token(self, caller: Caller, count: int = 1) -> None:
        """429 unless `count` tokens could be taken now; none are taken."""
        if not caller.key_id:
            return
        bucket = self._bucket(caller.key_id)
        if not bucket.has(time.monotonic(), count):
            raise self._over(bucket, count)

    def _bucket(self, key_id: str) -> TokenBucket:
        bucket = self.buckets.get(key_id)
        if bucket is None:
            entry = next(e for e in self.keys if e.sha256.startswith(key_id))
            rate, burst = self.tier_rates.get(entry.tier, DEFAULT_TIER_RATES[entry.tier])
            rate = entry.rate if entry.rate is not None else rate
            burst = entry.burst if entry.burst is not None else max(burst, rate)
            bucket = self.buckets[key_id] = TokenBucket(rate, burst, burst, time.monotonic())
        return bucket

    @staticmethod
    def _over(bucket: TokenBucket, count: int) -> errors.ApiError:
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
