"""Who is calling and whether they may, in one place for every route (issue 23): the caller from its key and
its client address, its rate-limit tokens, the metrics key of the operational routes, and the count of what was
answered: the status counts and the SLO ledger (`core/ledger.py`: per model and tier in /metrics, per tenant at
GET /v1/usage), so every model route books its answers alike. The policy (keys, tiers, token buckets) is
`tenancy.py`'s; the guard is where the routes meet it, so
they identify, limit and count alike (the OpenAI routes once passed no client address, and each route counted
its own answers)."""

from __future__ import annotations

import ipaddress

import hmac
from dataclasses import dataclass, field

from starlette.types import Scope

from batchserve import errors
from batchserve.core import ledger
from batchserve.core.ledger import UsageBook
from batchserve.core.tiers import NAMES as TIER_NAMES
from batchserve.errors import ApiError
from batchserve.metrics import Metrics
from batchserve.slo import Deadlines
from batchserve.tenancy import Caller, Tenancy


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
