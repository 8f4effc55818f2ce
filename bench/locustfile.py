"""batchserve under locust: one user class per surface, the server's own timings beside the client's.

    locust --headless -u 200 -r 100 -t 40s -H http://127.0.0.1:8000     # pyproject's [tool.locust] names this file
    locust ... KServeUser BatchJobUser                                  # some classes, by name
    locust ... --tags inference,kserve                                  # or by tag (a surface's name)
    python -m bench.locust --backend sim --users 300 --run-time 60s     # a server, a ramp past capacity, a table

Classes (tag = surface): InferenceUser (`inference`: POST /v1/inference), EmbeddingsUser (`embeddings`: POST
/v1/embeddings), ChatUser (`chat`: POST /v1/chat/completions), RerankUser (`rerank`: POST /v1/rerank),
KServeUser (`kserve`: POST /v2/models/{name}/infer) and BatchJobUser (`jobs`: POST /v1/batches, polled to its
end, its results read, then deleted). At start only the classes whose surface the server serves run, read from
GET /v1/models (after /readyz): every listed model serves inference, kserve and jobs (jobs also need GET
/v1/batches to answer 200: a server without a job store has none), an `embedding` model serves embeddings, an
`hf` model whose outputs are `json` (a cross-encoder folder) serves rerank, and the generation engine's entry
(the one with `max_tokens`) serves chat. `--bs-surfaces all` (or a list) runs the classes asked for whatever
the server says.

Options (locust arguments; each also from its environment variable):
  --bs-words 8-40        BATCHSERVE_LOCUST_WORDS   words in each input, uniform in the range
  --bs-items 1-4         BATCHSERVE_LOCUST_ITEMS   inputs per embeddings request, documents per rerank query,
                                                   elements per KServe request
  --bs-pace 1            BATCHSERVE_LOCUST_PACE    requests/s each user aims at (constant_throughput): users x
                                                   pace = the offered rate, while answers come faster than 1/pace
  --bs-rate 0            BATCHSERVE_LOCUST_RATE    open loop: this many requests/s in all, shared by the users of
                                                   every process (divided by --processes); 0 = closed loop
  --bs-keys k1,k2        BATCHSERVE_LOCUST_KEYS    API keys, dealt to users in turn (so several tenants and tiers
                                                   run at once); none: anonymous
  --bs-surfaces auto     BATCHSERVE_LOCUST_SURFACES  auto (what the server serves), all, or a list of tags
  --bs-capacity 0        BATCHSERVE_LOCUST_CAPACITY  the server's capacity, requests/s (refusal rule below)
  --bs-metrics-key ''    BATCHSERVE_LOCUST_METRICS_KEY  to read /internal/health where --metrics-key is set
  --bs-max-error-rate 0  BATCHSERVE_LOCUST_MAX_ERROR_RATE  verdict: exit 1 past this share of failures
  --bs-min-rate 0        BATCHSERVE_LOCUST_MIN_RATE  verdict: exit 1 below this many answers/s
  --bs-spread            BATCHSERVE_LOCUST_SPREAD  closed loop: each user starts at a random phase (default: as
                                                   spawned, as plain locust: users spawned together send together)
  --bs-job-items 50, --bs-job-pace 0.1 (jobs/s per user), --bs-job-poll 1 (s), --bs-max-tokens 32, --bs-stream

Closed or open loop: plain locust is closed loop, each user waits for its answer before its next request, so a
slow server is offered less. `--bs-rate R` is open loop: one pacer per process hands the users send times R/s
apart (no catch-up burst: give enough users, R x the slowest answer in s, or the sent rate falls short of R).

Refusals: a 429, or a 503 `SERVICE_OVERLOADED`, carrying a retry hint (`retry_after_ms` in the body, or a
`Retry-After` header) is the server saying it is full. It is counted under its own name (`<route> refused 503`)
as a success when the load is past capacity, and as a failure otherwise. Past capacity: the server's own
`load_ratio` (GET /internal/health, polled each second; the largest of the last 5 s) is at least 0.8, or, with
--bs-capacity, this run's sent rate over the last 2 s is at least 0.8 of it. A 429 (a key's own rate limit) is
always a refusal. A closed-loop user then waits the `retry_after_ms` asked before it paces on, as
batchserve.client does; an open-loop user does not.

The server's timings: every answer's `Server-Timing` (`queue;dur=…, compute;dur=…`) and the `latency_ms`,
`queue_ms`, `compute_ms` in a JSON answer's top level are fired as extra request events of type `server`, named
`latency_ms /v1/inference` and so on, so locust's table (and CSV) shows them beside the client's rows; a job's
submit-to-done time is type `job`, a streamed chat's first token type `chat`. These rows are counted in locust's
"Aggregated" row too; the verdict counts HTTP rows only.

Verdict (exit status, for CI): locust's own rule (`--exit-code-on-error`, 1: any failure) unless
--bs-max-error-rate is set, then only a failure share above it fails; an answered rate below --bs-min-rate fails.

Stages: BATCHSERVE_LOCUST_STAGES="USERS:SECONDS,..." turns the run into that plan (a LoadTestShape; -u and -t
are then ignored); `python -m bench.locust` sets it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
from locust import FastHttpUser, LoadTestShape, events, tag, task
from locust.contrib.fasthttp import ResponseContextManager
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

log = logging.getLogger("batchserve.locust")

SURFACES = ("inference", "embeddings", "chat", "rerank", "kserve", "jobs")
EXTRA_TYPES = ("server", "job", "chat")  # request types of the extra events: not HTTP requests
PAST_CAPACITY = 0.8  # load ratio from which a SERVICE_OVERLOADED refusal is expected
JOB_DONE = ("completed", "failed", "cancelled", "expired")
WORDS = (
    "the a of to and in is that for it as with was on be by at this from or an which one all were we when "
    "there can more if out so what up about into than them only time some could these two may then first "
    "any like now my such make over did even most after also made many before must through back years "
    "where much your way well down should because each just those people how too little state good very "
    "world still own see men work long here get both between life being under never day same another know "
    "while last might great old year off come since against go came right used take three model batch "
    "server request answer queue device latency vector token search query document river city music"
).split()


# -- options ------------------------------------------------------------------------------------------------
@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    def add(name: str, default: str, help: str, **kw: Any) -> None:
        env = "BATCHSERVE_LOCUST_" + name.removeprefix("--bs-").replace("-", "_").upper()
        parser.add_argument(name, default=default, env_var=env, help=help, **kw)

    add("--bs-words", "8-40", "words per input, MIN-MAX")
    add("--bs-items", "1-4", "inputs per embeddings/KServe request, documents per rerank query, MIN-MAX")
    add("--bs-pace", "1", "requests/s each user aims at (closed loop)")
    add("--bs-rate", "0", "open loop: requests/s in all (0: closed loop)")
    add("--bs-keys", "", "API keys, comma-separated, dealt to users in turn")
    add("--bs-surfaces", "auto", "auto (the server's), all, or a comma-separated list of " + ", ".join(SURFACES))
    add("--bs-capacity", "0", "the server's capacity, requests/s (0: read its load ratio)")
    add("--bs-metrics-key", "", "key for GET /internal/health when the server sets --metrics-key")
    add("--bs-max-error-rate", "0", "fail the run past this share of failed requests (0: locust's rule)")
    add("--bs-min-rate", "0", "fail the run below this many answers/s")
    add("--bs-job-items", "50", "inputs per batch job")
    add("--bs-job-pace", "0.1", "batch jobs/s each job user aims at")
    add("--bs-job-poll", "1", "seconds between polls of a job")
    add("--bs-max-tokens", "32", "max_tokens of each chat completion")
    add("--bs-stream", "", "stream chat completions", action="store_true")
    add("--bs-spread", "", "closed loop: each user starts at a random phase (default: as spawned)", action="store_true")


def span(text: str) -> tuple[int, int]:
    low, _, high = str(text).partition("-")
    return int(low), int(high or low)


@dataclass
class Settings:
    words: tuple[int, int] = (8, 40)
    items: tuple[int, int] = (1, 4)
    pace: float = 1.0
    rate: float = 0.0
    keys: list[str] = field(default_factory=list)
    capacity: float = 0.0
    metrics_key: str = ""
    job_items: int = 50
    job_pace: float = 0.1
    job_poll: float = 1.0
    max_tokens: int = 32
    stream: bool = False
    processes: int = 1
    spread: bool = False  # closed loop: a random phase per user, not as spawned

    @classmethod
    def of(cls, o: Any) -> Settings:
        if float(o.bs_pace) <= 0 or float(o.bs_job_pace) <= 0:
            raise SystemExit("--bs-pace and --bs-job-pace must be positive")
        return cls(
            span(o.bs_words),
            span(o.bs_items),
            float(o.bs_pace),
            float(o.bs_rate),
            [k.strip() for k in o.bs_keys.split(",") if k.strip()],
            float(o.bs_capacity),
            o.bs_metrics_key,
            int(o.bs_job_items),
            float(o.bs_job_pace),
            float(o.bs_job_poll),
            int(o.bs_max_tokens),
            bool(o.bs_stream),
            max(1, int(getattr(o, "processes", 0) or 0)),
            bool(o.bs_spread),
        )


S = Settings()


def text(words: tuple[int, int] | None = None) -> str:
    low, high = words or S.words
    return " ".join(random.choices(WORDS, k=random.randint(low, high)))


def texts() -> list[str]:
    return [text() for _ in range(random.randint(*S.items))]


# -- what the server serves ---------------------------------------------------------------------------------
def surfaces_of(models: list[dict[str, Any]], jobs: bool) -> dict[str, str]:
    """The surfaces GET /v1/models' entries show, each with the model id to ask for ("" = the default)."""
    found: dict[str, str] = {}
    batcher = [m for m in models if "name" in m]  # the batcher's models; the engine's card has no name
    if batcher:
        found["inference"] = ""
        found["kserve"] = str(batcher[0]["name"])
        if jobs:
            found["jobs"] = ""
    for m in models:
        if m.get("output_kind") == "embedding":
            found.setdefault("embeddings", str(m["id"]))
        elif m.get("backend") == "hf" and m.get("output_kind") == "json":
            found.setdefault("rerank", str(m["id"]))
        if "max_tokens" in m:
            found.setdefault("chat", str(m["id"]))
    return found


def get(base: str, path: str, key: str = "", timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(base.rstrip("/") + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def discover(base: str, key: str, ready_s: float = 60.0) -> dict[str, str]:
    """Wait for /readyz (models warming list no output kinds yet), then read what the server serves."""
    give_up = time.monotonic() + ready_s
    while get(base, "/readyz", key)[0] != 200:
        if time.monotonic() > give_up:
            raise RuntimeError(f"{base}/readyz did not answer 200 within {ready_s:.0f} s")
        gevent.sleep(0.2)
    status, body = get(base, "/v1/models", key)
    if status != 200:
        raise RuntimeError(f"GET {base}/v1/models answered {status}: {body[:200]!r}")
    jobs = get(base, "/v1/batches?limit=1", key)[0] == 200
    return surfaces_of(json.loads(body)["data"], jobs)


SERVED: dict[str, str] = {}  # surface -> model id, once discovered


# -- refusals: past capacity or not -------------------------------------------------------------------------
class Load:
    """Whether the load is past capacity now: the server's load ratio, and this run's offered rate against the
    capacity (--bs-capacity, or the server's own: its arrivals/s over its load ratio)."""

    def __init__(self) -> None:
        self.ratios: deque[tuple[float, float]] = deque(maxlen=16)  # (when, load_ratio)
        self.capacity = 0.0  # the server's, once its figures show it
        self.sends: deque[float] = deque()  # this process's send times over the last second
        self.fresh = 0.0  # when the last completed look at /internal/health began
        self.reading: gevent.event.Event | None = None  # set while a read of /internal/health is under way
        self.poller: gevent.Greenlet | None = None

    def note_sent(self) -> None:
        now = time.monotonic()
        self.sends.append(now)
        while self.sends[0] < now - 1.0:
            self.sends.popleft()

    def offered(self, runner: Any) -> float:
        """Requests/s this run offers: the larger of what its users aim at (users x pace, or --bs-rate) and
        what they sent over the last second, this process's times --processes."""
        if S.rate > 0:
            return S.rate
        now = time.monotonic()
        while self.sends and self.sends[0] < now - 1.0:
            self.sends.popleft()
        classes = {u.__name__: u for u in USERS.values()}
        aimed = sum(n * classes[name].pace() for name, n in runner.user_classes_count.items() if name in classes)
        return max(aimed, len(self.sends)) * S.processes

    def past_capacity(self, environment: Environment) -> bool:
        """Judged by what is known, or else by a look at the server begun after the refusal came (one under
        way for another user serves this one too)."""
        asked = time.monotonic()
        if self.judge(environment):
            return True
        while self.fresh < asked:
            if self.reading is not None:
                self.reading.wait(3.0)
            else:
                self.read(environment.host or "")
        return self.judge(environment)

    def judge(self, environment: Environment) -> bool:
        now = time.monotonic()
        if any(r >= PAST_CAPACITY for t, r in self.ratios if now - t <= 5):
            return True
        capacity = S.capacity or self.capacity
        return capacity > 0 and self.offered(environment.runner) >= PAST_CAPACITY * capacity

    def describe(self, environment: Environment) -> str:
        ratio = max((r for t, r in self.ratios if time.monotonic() - t <= 5), default=None)
        capacity = S.capacity or self.capacity
        return (
            f"refused below capacity: offered {self.offered(environment.runner):.1f}/s, capacity "
            f"{f'{capacity:.1f}/s' if capacity else 'unknown'}, server load ratio "
            f"{'unknown' if ratio is None else f'{ratio:.2f}'}"
        )

    def read(self, base: str) -> None:
        self.reading = reading = gevent.event.Event()
        began = time.monotonic()
        try:
            status, body = get(base, "/internal/health", S.metrics_key, timeout=2)
            if status == 200:
                health = json.loads(body)
                ratio, arrivals = float(health.get("load_ratio") or 0), float(health.get("arrivals_per_s") or 0)
                self.ratios.append((time.monotonic(), ratio))
                if ratio > 0 and arrivals > 0:  # ratio = arrivals / capacity: so this is the capacity, to rounding
                    self.capacity = arrivals / ratio
        finally:
            self.fresh, self.reading = began, None
            reading.set()

    def poll(self, base: str) -> None:
        while True:
            self.read(base)
            gevent.sleep(1.0)


LOAD = Load()


class Pacer:
    """Open loop: send times `1/rate` apart handed to whichever user asks, shared by a process's users."""

    def __init__(self) -> None:
        self.next_at = 0.0

    def wait(self, rate: float) -> float:
        now = time.monotonic()
        slot = max(now, self.next_at)
        self.next_at = slot + 1.0 / rate
        return slot - now


PACER = Pacer()


# -- the server's timings -----------------------------------------------------------------------------------
def server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: queue;dur=1.2, compute;dur=100.3` as {"queue": 1.2, "compute": 100.3} (entries without a
    duration are left out)."""
    out: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            key, _, value = p.partition("=")
            if name and key.strip().lower() == "dur":
                try:
                    out[name] = float(value.strip().strip('"'))
                except ValueError:
                    pass
    return out


def record_server_timings(env: Environment, route: str, headers: Any, body: Any) -> None:
    timings = {f"{k}_ms": v for k, v in server_timing(headers.get("Server-Timing") or "").items()}
    if isinstance(body, dict):
        for k in ("latency_ms", "queue_ms", "compute_ms"):
            if isinstance(body.get(k), int | float) and k not in timings:
                timings[k] = float(body[k])
    for name, ms in timings.items():
        fire(env, "server", f"{name} {route}", ms)


def fire(env: Environment, kind: str, name: str, ms: float) -> None:
    env.events.request.fire(
        request_type=kind, name=name, response_time=ms, response_length=0, exception=None, context={}
    )


# -- the users ----------------------------------------------------------------------------------------------
class Surface(FastHttpUser):
    """One surface's user: its key, its pace, and the one way every answer is judged."""

    abstract = True
    surface = ""
    pace_option = "pace"
    network_timeout = 60.0
    connection_timeout = 10.0
    dealt = 0  # keys dealt so far in this process

    @classmethod
    def pace(cls) -> float:
        """Requests (jobs, for the job user) a second one user aims at."""
        return S.job_pace if cls.pace_option == "job_pace" else S.pace

    def wait_time(self) -> float:
        if S.rate > 0:
            return PACER.wait(S.rate / S.processes)
        return max(0.0, 1.0 / self.pace() - (time.perf_counter() - self._last_start))

    def on_start(self) -> None:
        Surface.dealt += 1
        key = S.keys[Surface.dealt % len(S.keys)] if S.keys else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = SERVED.get(self.surface, "")
        # Closed loop, as plain locust: users spawned together send together (a burst the server must take as one
        # batch), each then paced from its own last send; `--bs-spread` gives each a random phase instead.
        # Open loop: the pacer's first slot.
        if S.rate > 0:
            gevent.sleep(PACER.wait(S.rate / S.processes))
        elif S.spread:
            gevent.sleep(random.uniform(0, 1.0 / self.pace()))
        self._last_start = time.perf_counter()

    def started(self) -> None:
        self._last_start = time.perf_counter()
        LOAD.note_sent()

    def judge(self, resp: ResponseContextManager, route: str, parse: bool = True) -> Any:
        """Success, refusal or failure for one answer; the JSON body when it succeeded (`parse`)."""
        status = resp.status_code
        if 200 <= status < 300:
            try:
                body = resp.json() if parse and resp.text else None
            except ValueError:
                resp.failure(f"{status} with a body that is not JSON")
                return None
            record_server_timings(self.environment, route, resp.headers, body)
            resp.success()
            return body
        wait_ms = retry_hint(status, resp.headers, resp.text)
        if wait_ms is not None and (status == 429 or LOAD.past_capacity(self.environment)):
            resp.request_meta["name"] = f"{route} refused {status}"
            resp.success()
            if S.rate <= 0:
                gevent.sleep(min(wait_ms, 30_000) / 1000)
            return None
        if wait_ms is not None:
            log.warning("%s %s: %s", status, route, LOAD.describe(self.environment))
        resp.failure(f"{status}: " + ("refused below capacity" if wait_ms is not None else (resp.text or "")[:200]))
        return None

    def post(self, path: str, body: dict[str, Any], route: str = "") -> Any:
        route = route or path
        self.started()
        with self.client.post(path, json=body, headers=self.headers, name=route, catch_response=True) as resp:
            return self.judge(resp, route)


def retry_hint(status: int, headers: Any, body_text: str | None) -> float | None:
    """The wait a 429 or 503 asks for, ms, when it is a refusal for load (None otherwise)."""
    if status not in (429, 503):
        return None
    code, hint = "", None
    try:
        data = json.loads(body_text or "null")
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        code = str(err.get("code") if isinstance(err, dict) else err or "").upper()
        hint = data.get("retry_after_ms")
    if code in ("DRAINING", "NO_HEALTHY_WORKER", "JOBS_UNAVAILABLE"):
        return None
    if isinstance(hint, int | float):
        return float(hint)
    after = headers.get("Retry-After")
    try:
        return float(after) * 1000 if after is not None else None
    except ValueError:
        return None


class InferenceUser(Surface):
    weight = 4
    surface = "inference"

    @tag("inference")
    @task
    def infer(self) -> None:
        body: dict[str, Any] = {"input": text()}
        if self.model:
            body["model"] = self.model
        self.post("/v1/inference", body)


class EmbeddingsUser(Surface):
    weight = 4
    surface = "embeddings"

    @tag("embeddings")
    @task
    def embed(self) -> None:
        self.post("/v1/embeddings", {"input": texts(), "model": self.model})


class RerankUser(Surface):
    weight = 4
    surface = "rerank"

    @tag("rerank")
    @task
    def rerank(self) -> None:
        docs = texts()
        self.post(
            "/v1/rerank", {"model": self.model, "query": text((3, 12)), "documents": docs, "top_n": min(3, len(docs))}
        )


class KServeUser(Surface):
    weight = 4
    surface = "kserve"

    @tag("kserve")
    @task
    def infer(self) -> None:
        data = texts()
        body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [len(data)], "data": data}]}
        self.post(f"/v2/models/{self.model or 'sim'}/infer", body, "/v2/models/{name}/infer")


class ChatUser(Surface):
    weight = 4
    surface = "chat"

    @tag("chat")
    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text()}],
            "max_tokens": S.max_tokens,
            "stream": S.stream,
        }
        if not S.stream:
            self.post("/v1/chat/completions", body)
            return
        route = "/v1/chat/completions"
        self.started()
        began = time.perf_counter()
        with self.client.post(
            route, json=body, headers=self.headers, name=route, catch_response=True, stream=True
        ) as resp:
            if resp.status_code != 200:
                self.judge(resp, route)
                return
            first, rest = None, b""
            for chunk in resp.iter_content(chunk_size=4096, decode_content=False):
                if first is None and b"data:" in chunk:
                    first = time.perf_counter()
                rest = (rest + chunk)[-64:]
            resp.request_meta["response_time"] = (time.perf_counter() - began) * 1000
            record_server_timings(self.environment, route, resp.headers, None)
            if first is None or b"[DONE]" not in rest:
                resp.failure("the stream ended without data: [DONE]")
                return
            resp.success()
            fire(self.environment, "chat", f"first token {route}", (first - began) * 1000)


class BatchJobUser(Surface):
    """A batch job each 1/--bs-job-pace s: submitted, polled to its end, its results read, deleted."""

    weight = 1
    surface = "jobs"
    pace_option = "job_pace"

    @tag("jobs")
    @task
    def job(self) -> None:
        inputs = [text() for _ in range(S.job_items)]
        began = time.perf_counter()
        job = self.post("/v1/batches", {"inputs": inputs})
        if not isinstance(job, dict) or "id" not in job:
            return
        path = f"/v1/batches/{job['id']}"
        while job.get("status") not in JOB_DONE:
            gevent.sleep(S.job_poll)
            with self.client.get(path, headers=self.headers, name="/v1/batches/{id}", catch_response=True) as r:
                job = self.judge(r, "/v1/batches/{id}")
            if not isinstance(job, dict):
                return
        fire(self.environment, "job", "done /v1/batches", (time.perf_counter() - began) * 1000)
        with self.client.get(
            path + "/results", headers=self.headers, name="/v1/batches/{id}/results", catch_response=True
        ) as r:
            lines = [json.loads(x) for x in (r.text or "").splitlines() if x.strip()] if r.status_code == 200 else []
            done = sum(1 for x in lines if x.get("status") == "completed")
            if r.status_code == 200 and (job["status"] != "completed" or done != len(inputs)):
                r.failure(f"job {job['status']}: {done} of {len(inputs)} inputs completed")
            else:
                self.judge(r, "/v1/batches/{id}/results", parse=False)
        with self.client.delete(path, headers=self.headers, name="/v1/batches/{id}", catch_response=True) as r:
            self.judge(r, "/v1/batches/{id}")


USERS: dict[str, type[Surface]] = {
    u.surface: u for u in (InferenceUser, EmbeddingsUser, ChatUser, RerankUser, KServeUser, BatchJobUser)
}


# -- the run: which classes, the load poller, the verdict ---------------------------------------------------
def choose(environment: Environment) -> None:
    """Keep only the classes whose surface is served (or asked for), in this process's discovery."""
    options = environment.parsed_options
    assert options is not None, "locust parses its options before the init event"
    wanted = options.bs_surfaces.strip() or "auto"
    key = S.keys[0] if S.keys else ""
    if wanted == "auto":
        SERVED.update(discover(environment.host or "", key))
        names = set(SERVED)
    else:
        try:
            SERVED.update(discover(environment.host or "", key, ready_s=10))
        except (RuntimeError, ValueError, KeyError) as exc:
            log.warning("could not read what the server serves (%s): models left to the server", exc)
        names = set(SURFACES) if wanted == "all" else {s.strip() for s in wanted.split(",")}
        unknown = names - set(SURFACES)
        if unknown:
            raise ValueError(f"--bs-surfaces: unknown {', '.join(sorted(unknown))}; known: {', '.join(SURFACES)}")
    if options.tags:  # a class whose task locust's own tag filter removes would fail on start
        names &= set(options.tags)
    names -= set(options.exclude_tags or ())
    if isinstance(environment.runner, WorkerRunner):
        return  # the master picks the classes; a worker spawns what it is sent
    kept = [u for u in environment.user_classes if getattr(u, "surface", None) in names]
    dropped = sorted(u.__name__ for u in environment.user_classes if u not in kept)
    log.info(
        "surfaces served: %s; user classes kept: %s; left out: %s",
        ", ".join(sorted(SERVED)) or "none",
        ", ".join(u.__name__ for u in kept) or "none",
        ", ".join(dropped) or "none",
    )
    if not kept:
        raise ValueError(
            f"no user class left: the server serves {', '.join(sorted(SERVED)) or 'nothing'} (GET /v1/models), and "
            "neither the classes named, --tags nor --bs-surfaces ask for any of that"
        )
    environment.user_classes[:] = kept


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    global S
    if environment.parsed_options is None:
        return
    S = Settings.of(environment.parsed_options)
    if environment.host:
        try:
            choose(environment)
        except (RuntimeError, ValueError, KeyError) as exc:
            log.error("%s", exc)
            sys.exit(2)


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    if environment.host and LOAD.poller is None and not isinstance(environment.runner, MasterRunner):
        LOAD.poller = gevent.spawn(LOAD.poll, environment.host)


@events.test_stop.add_listener
def _stop(environment: Environment, **_: Any) -> None:
    if LOAD.poller is not None:
        LOAD.poller.kill(block=False)
        LOAD.poller = None


@events.quitting.add_listener
def _verdict(environment: Environment, **_: Any) -> None:
    if environment.parsed_options is None or isinstance(environment.runner, WorkerRunner):
        return
    stats = environment.stats
    http = [e for e in stats.entries.values() if e.method not in EXTRA_TYPES]
    sent = sum(e.num_requests for e in http)
    failed = sum(e.num_failures for e in http)
    refused = sum(e.num_requests for e in http if " refused " in e.name)
    seconds = max(1e-9, (stats.total.last_request_timestamp or 0) - stats.total.start_time)
    answered = (sent - failed - refused) / seconds
    max_errors = float(environment.parsed_options.bs_max_error_rate)
    min_rate = float(environment.parsed_options.bs_min_rate)
    share = failed / sent if sent else 0.0
    verdict = []
    if (share > max_errors) if max_errors > 0 else failed:
        verdict.append(f"failures {share:.2%} > {max_errors:.2%}" if max_errors > 0 else "failures (any fails)")
    if min_rate > 0 and answered < min_rate:
        verdict.append(f"answered {answered:.1f}/s < {min_rate:g}/s")
    log.info(
        "batchserve verdict: %d requests, %d failed (%.2f%%), %d refused past capacity, %.1f answered/s: %s",
        *(sent, failed, 100 * share, refused, answered),
        "FAIL: " + "; ".join(verdict) if verdict else "pass",
    )
    if verdict and max_errors > 0 or min_rate > 0 and answered < min_rate:
        environment.process_exit_code = 1
    elif max_errors > 0 and failed and environment.runner is not None and not environment.runner.exceptions:
        environment.process_exit_code = 0  # within the allowed share: locust's any-failure rule does not apply


# -- a stage plan -------------------------------------------------------------------------------------------
def stages_of(plan: str) -> list[tuple[int, float]]:
    """BATCHSERVE_LOCUST_STAGES "100:15,200:15" as [(100, 15.0), (200, 15.0)]: users and seconds per stage."""
    out = []
    for part in plan.split(","):
        users, _, seconds = part.strip().partition(":")
        out.append((int(users), float(seconds)))
    return out


if os.environ.get("BATCHSERVE_LOCUST_STAGES"):

    class StagePlan(LoadTestShape):
        """Each stage's users for its seconds, reached at twice the step a second; then the run ends."""

        stages = stages_of(os.environ["BATCHSERVE_LOCUST_STAGES"])

        def tick(self) -> tuple[int, float] | None:
            elapsed, before = self.get_run_time(), 0
            for users, seconds in self.stages:
                if elapsed < seconds:
                    return users, max(1.0, 2.0 * abs(users - before))
                elapsed -= seconds
                before = users
            return None
