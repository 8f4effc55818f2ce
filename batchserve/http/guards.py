"""Who is calling and whether they may, in one place for every route (issue 23): the caller from its key and
its client address, its rate-limit tokens, the metrics key of the operational routes, and the count of what was
answered: the status counts and the SLO ledger (`core/ledger.py`: per model and tier in /metrics, per tenant at
GET /v1/usage), so every model route books its answers alike; and below it the policy it applies (keys, tiers of
callers, token buckets: `Tenancy`), which the gRPC listener and the batch jobs read too."""

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
    answered: int = 0  # requests answered since start, any status (the 1 s tick's requests per second)
    slo_s: float = 0.2  # the latency objective the ledger holds 2xx answers of a model without its own figures to
    # Each model's own SLO (and timeouts): the ledger holds a model's answers to its own (issue 46 item 7). The
    # runtime shares `ModelRegistry.deadlines`, which the door and the batcher read too.
    deadlines: dict[str, Deadlines] = field(default_factory=dict)
    usage: UsageBook = field(default_factory=UsageBook)  # per tenant, for GET /v1/usage
    # --gateway-ips: the inference gateway whose fairness and objective headers are believed (`via_gateway`)
    gateways: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def via_gateway(self, scope: Scope) -> bool:
        """Whether the request's peer is a configured gateway: only then do its fairness-id and objective headers
        say anything (anyone else could send them to jump a queue or another tenant's lane)."""
        client = scope.get("client")
        if not client or not self.gateways:
            return False
        try:
            peer = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        return any(peer in network for network in self.gateways)

    def identify(self, authorization: str | None, scope: Scope, openai: bool = False) -> Caller:
        """The caller (401 when keys are configured and its key is missing or wrong). The peer's address, read
        from the request's `scope` here so no route can forget it, tells anonymous callers apart as owners of
        jobs and request records. On the OpenAI routes (`openai`) a key is always sent by the clients: with no
        keys configured, any key is anonymous (as vLLM does)."""
        if openai and not self.tenancy.keys:
            authorization = None
        client = scope.get("client")  # http/plumbing.client_host, inline: once per request of every route
        return self.tenancy.identify(authorization, client[0] if client else "")

    def enter(self, authorization: str | None, scope: Scope, openai: bool = False) -> Caller:
        """Identify, and refuse (429) a caller whose bucket holds not even one token, taking none: for a route
        whose cost is known only from its body (a list of N inputs costs N), so a caller who may not send is
        refused before its body is read, and its tokens are taken (`take`) once the body says how many."""
        caller = self.identify(authorization, scope, openai)
        self.tenancy.check_token(caller)
        return caller

    def check(self, caller: Caller) -> None:
        """`enter`'s second half, for a route that keeps the caller to book a 429 to: 429 unless the caller's
        bucket holds a token now (none is taken)."""
        self.tenancy.check_token(caller)

    def take(self, caller: Caller, count: int = 1) -> dict[str, str]:
        """Spend `count` tokens (the inputs of a list) from the caller's bucket: the X-RateLimit-* headers, or 429."""
        return self.tenancy.take_token(caller, count)

    def admit(
        self, authorization: str | None, scope: Scope, count: int = 1, openai: bool = False
    ) -> tuple[Caller, dict[str, str]]:
        """Identify, then take `count` tokens: the caller and its rate-limit headers."""
        caller = self.identify(authorization, scope, openai)
        return caller, self.tenancy.take_token(caller, count)

    def ok(self, model: str, latency_s: float, caller: Caller, inputs: int = 1, cost: float = 1.0) -> None:
        """A model's answer went out: `inputs` served, costing `cost` units (tokens, or 1 an input)."""
        self.answered += 1
        d = self.deadlines.get(model)
        outcome = ledger.MET if latency_s <= (self.slo_s if d is None else d.slo_s) else ledger.SLOW
        tier = TIER_NAMES[caller.tier]  # `_book` for a served answer, inline: once per answer of every model route
        self.metrics.count_ok(model, latency_s, tier, ledger.OUTCOMES[outcome], inputs, cost)
        self.usage.record(caller.tenant, tier, outcome, inputs, cost, latency_s, model)

    def refused(self, model: str, err: ApiError, caller: Caller | None, inputs: int = 1) -> None:
        """An error went out, counted by its code (`model` is "unknown" before one was picked), and in the
        SLO ledger when it is an outcome (429, 5xx) of a known caller (a 401 has none: it is no outcome)."""
        self.answered += 1
        self.metrics.count_error(model, err)
        self.settle(model, caller, err.status, 0.0, inputs)

    def settle(
        self, model: str, caller: Caller | None, status: int, latency_s: float, inputs: int = 1, cost: float = 1.0
    ) -> None:
        """The SLO ledger's entry of an answer with `status` (nothing for a 4xx other than 429, or a 499); for
        the routes that count their answers' statuses themselves (the generation engine's)."""
        if caller is None:
            return
        if 200 <= status < 300:
            d = self.deadlines.get(model)
            outcome: int | None = ledger.MET if latency_s <= (self.slo_s if d is None else d.slo_s) else ledger.SLOW
        else:
            outcome = ledger.error_outcome(status) if status != 499 else None
        if outcome is not None:
            self._book(model, caller, outcome, inputs, cost, latency_s)

    def _book(self, model: str, caller: Caller, outcome: int, inputs: int, cost: float, latency_s: float) -> None:
        tier = TIER_NAMES[caller.tier]
        served = outcome <= ledger.SLOW
        self.metrics.count_outcome(
            model, tier, ledger.OUTCOMES[outcome], inputs if served else 0, cost if served else 0.0
        )
        self.usage.record(caller.tenant, tier, outcome, inputs, cost, latency_s, model)

    def shed(self, err: ApiError) -> None:
        """A refusal of work outside the batcher (the generation engine's 503s): `batchserve_rejected_total`
        by its code, as the door's refusals are; the answer itself is counted when it goes out."""
        self.metrics.rejected.labels(err.code).inc()

    def gone(self, model: str) -> None:
        """The caller hung up before its answer: a 499 in the model's status counts, as the generation routes
        count theirs; no SLO outcome (nobody read an answer)."""
        self.metrics.requests.labels(model, "499").inc()

    def counted(self) -> None:
        """An answer went out that the model metrics do not count (a route's own refusal shape, a job route)."""
        self.answered += 1

    def check_ops_key(self, authorization: str | None) -> None:
        """401 unless the caller shows `--metrics-key` (when one is set): the operational routes name workers,
        queue depths and rates that callers need not see."""
        key = self.metrics_key
        if not key:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise errors.unauthorized("this route needs the metrics key: 'Authorization: Bearer <metrics key>'")


# -- the caller policy: keys, tiers of callers, token buckets ------------------------------------------------------
# Who is calling: API keys (stored as SHA-256 digests, compared in constant time), tiers and rate limits.
#
# `Tenancy.identify(authorization_header)` returns the `Caller` or raises 401; `Tenancy.take_token(caller)`
# raises 429 with `Retry-After` and `X-RateLimit-*` headers when the caller's token bucket is empty.
# Keys and tier rates come from the TOML config file (`config_file.py`); `batchserve keys add` writes them.
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
