"""`batchserve serve --processes N` (batchserve/http/processes.py): real processes on one port shared with
SO_REUSEPORT, each a whole server on its share of the devices; one drained alone under load with nothing
lost and replaced; one killed outright replaced by a child that joins the port only once ready; the group drained
by SIGTERM to the parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest

from batchserve.plan_measure import measure
from tests import hf_folders
from tests.conftest import LiveServer
from tests.integration.jobs.test_routes import wait_for


def children(server: LiveServer, want: int = 2, timeout: float = 60.0) -> dict[int, dict]:
    """pid -> /internal/health of each child, found through the shared port (a new connection each time, so
    the kernel deals them over the children) and checked ready on each child's own port."""
    seen: dict[int, dict] = {}
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            with httpx.Client(base_url=server.url, timeout=5) as c:
                d = c.get("/internal/health").json()
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        if d["status"] == "ok":
            seen[d["pid"]] = d
        if len(seen) >= want:
            ready = {}
            for pid, d in seen.items():
                own = f"http://127.0.0.1:{d['process']['own_port']}"
                try:
                    if httpx.get(own + "/readyz", timeout=5).status_code == 200:
                        ready[pid] = d
                except httpx.HTTPError:
                    pass
            if len(ready) >= want:
                return ready
            seen = ready
        time.sleep(0.02)
    raise AssertionError(f"found {len(seen)} ready children of {want}:\n" + server.log())


def test_two_processes_share_the_port_each_on_its_own_device(server_factory):
    server = server_factory("--processes", "2", "--devices", "2", "--sim-batch-ms", "20")
    kids = children(server)
    assert len(kids) == 2 and server.proc.pid not in kids
    assert sorted(d["process"]["index"] for d in kids.values()) == [0, 1]
    for pid, d in kids.items():
        assert d["process"]["of"] == 2 and len(d["workers"]) == 1  # 2 devices split: one each
        own = f"http://127.0.0.1:{d['process']['own_port']}"
        assert httpx.get(own + "/internal/health", timeout=5).json()["pid"] == pid  # its own port: it alone
        assert "process_cpu_seconds_total" in httpx.get(own + "/metrics", timeout=5).text
    assert "batch jobs are off" in server.log()  # the default SQLite store is one process's
    m = measure(server.url, None, [])  # `batchserve plan --measure` sees the node: 2 processes of 1 device
    assert m.processes == 2 and m.devices == 2
    with server.client() as c:
        r = c.post("/v1/inference", json={"input": "abc"})
        assert r.status_code == 200 and r.json()["output"] == "cba"


def test_one_process_drained_alone_under_load_loses_nothing_and_is_replaced(server_factory):
    """SIGTERM to one child while 6 clients send back to back: it closes its share of the port, answers what
    it holds, and exits; a request reaching it on an open keep-alive connection gets 503 DRAINING (it never
    ran) and its retry on a new connection reaches the sibling. Every request ends in its right answer, no
    connection fails, and the parent starts a replacement that joins the port."""
    server = server_factory(
        "--processes",
        "2",
        "--devices",
        "2",
        "--sim-batch-ms",
        "20",
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "10000",
        "--drain-grace-s",
        "5",
    )
    kids = children(server)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        i = 0
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                text = f"drain-{k}-{i}"
                i += 1
                for _ in range(3):
                    try:
                        r = c.post("/v1/inference", json={"input": text})
                    except httpx.HTTPError as exc:
                        with lock:
                            failures.append(f"{text}: {type(exc).__name__}: {exc}")
                        break
                    if r.status_code == 503 and r.json()["error"] == "DRAINING":
                        with lock:
                            outcomes["503 DRAINING, retried"] += 1
                        continue
                    with lock:
                        if r.status_code == 200 and r.json()["output"] == text[::-1]:
                            outcomes["200"] += 1
                        else:
                            failures.append(f"{text}: {r.status_code} {r.text[:200]}")
                    break
                else:
                    with lock:
                        failures.append(f"{text}: DRAINING three times")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    try:
        # Load before the drain: until 60 answers are in (what a fixed 1.5 s waited for; ~1 s on a quiet machine).
        wait_for(lambda: outcomes["200"] > 60, timeout=30, every=0.02)
        before = outcomes["200"]
        victim = min(kids)
        os.kill(victim, signal.SIGTERM)
        # Its share of the port closed at once (no grace for a lone drain, though --drain-grace-s is 5): every
        # new connection goes to the sibling (or, once up, the replacement), none to it, none answered DRAINING.
        time.sleep(0.2)
        fresh = Counter()
        for _ in range(40):
            with httpx.Client(base_url=server.url, timeout=10) as c:
                r = c.get("/internal/health")
                fresh[(r.json()["pid"], r.json()["status"])] += 1
        assert fresh and all(pid != victim and status == "ok" for pid, status in fresh), fresh
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            try:
                os.kill(victim, 0)  # still there (or not yet reaped by the parent)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the drained process did not exit:\n" + server.log())
        after_exit = outcomes["200"]
        replaced = children(server)  # the survivor and a replacement, both ready
        # Answered after the exit too: 40 more answers (what a fixed 1 s waited for), not a fixed time.
        wait_for(lambda: outcomes["200"] > after_exit + 40 or failures, timeout=30, every=0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [], failures[:5]
    assert victim not in replaced and len(replaced) == 2
    assert before > 50 and outcomes["200"] > after_exit  # load before, and answered through and after the drain
    assert "draining this process alone" in server.log()
    assert "starting a replacement" in server.log()
    # SIGTERM to the parent drains the whole group and exits 0; no child outlives it.
    pids = list(replaced)
    assert server.stop(signal.SIGTERM) == 0
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_child_killed_outright_is_replaced(server_factory):
    """SIGKILL: no drain, its requests lost with it (as with any process killed so); the parent starts another
    on the same devices, and the port has two ready processes again."""
    server = server_factory("--processes", "2", "--devices", "2", "--sim-batch-ms", "20")
    kids = children(server)
    victim = min(kids)
    os.kill(victim, signal.SIGKILL)
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        now = children(server)
        if victim not in now:
            break
        time.sleep(0.1)
    assert victim not in now and len(now) == 2
    assert sorted(d["process"]["index"] for d in now.values()) == [0, 1]  # the same slot, filled again
    assert "starting a replacement" in server.log()


PAUSE_S = 0.05  # between one client's requests: enough of them, and CPU left for the replacement to warm


class FreshConnections:
    """Clients each sending one request per new connection (so the kernel deals them over every listener on the
    shared port, as from many callers): /readyz, and a one-token completion. What each ended in, and when."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.stop = url, threading.Event()
        self.lock = threading.Lock()
        self.sent: list[tuple[float, str, int | None]] = []  # (sent at, outcome, the answering child's pid)
        self.threads = [threading.Thread(target=self.client, args=(k,)) for k in range(clients)]

    def ask(self, i: int) -> tuple[str, int | None]:
        with httpx.Client(base_url=self.url, timeout=30) as c:  # closed after one request: a new connection each
            if i % 2:
                r = c.get("/readyz")
            else:
                body = {"model": "lm", "prompt": "hello", "max_tokens": 1, "temperature": 0}
                r = c.post("/v1/completions", json=body)
            pid = c.get("/internal/health").json()["pid"] if r.status_code == 200 else None
        return f"{r.status_code} {r.text[:120]}" if r.status_code != 200 else "200", pid

    def client(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                outcome, pid = self.ask(i)
            except httpx.HTTPError as exc:
                outcome, pid = f"{type(exc).__name__}: {exc}", None
            i += 1
            with self.lock:
                self.sent.append((started, outcome, pid))
            time.sleep(PAUSE_S)

    def since(self, t: float) -> list[tuple[float, str, int | None]]:
        with self.lock:
            return [s for s in self.sent if s[0] >= t]

    def __enter__(self) -> FreshConnections:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_a_replacement_takes_no_connection_of_the_shared_port_until_it_is_ready(server_factory, tmp_path):
    """Issue 46, item 11: a child killed outright (SIGKILL) is replaced; the replacement warms (here a generation
    folder's engine loads its own replica, seconds after the batch models) while its sibling serves, and joins the
    shared port only once ready. Every request sent after the killed child is gone, on a new connection each, is
    answered 200 by a ready child: no 503 "warming up" from the replacement, no connection error. (The requests
    the killed child held when it died are lost with it, as with any SIGKILL: the count starts once it is gone.)
    Then the replacement answers its share of the port."""
    lm = hf_folders.causal_lm(tmp_path / "lm")
    server = server_factory("--processes", "2", "--model", f"lm={lm}", timeout=240)
    kids = children(server, timeout=120)
    victim = min(kids)
    with FreshConnections(server.url) as drill:
        wait_for(lambda: len(drill.since(0)) > 20, timeout=60, every=0.05)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: gone(victim), timeout=30, every=0.02)
        since = time.monotonic()
        replaced = children(server, timeout=180)
        (replacement,) = set(replaced) - set(kids)
        joined = time.monotonic()
        wait_for(lambda: any(pid == replacement for _, _, pid in drill.since(joined)), timeout=30, every=0.05)
    outcomes = Counter(outcome for _, outcome, _ in drill.since(since))
    print(f"replacement joined {joined - since:.1f} s after the kill; outcomes since: {dict(outcomes)}")
    assert set(outcomes) == {"200"}, outcomes
    assert outcomes["200"] > 20 and "starting a replacement" in server.log()


def test_uneven_device_split_is_refused_before_anything_starts():
    r = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--processes", "2", "--devices", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "does not split evenly over --processes 2" in r.stderr


def test_a_sqlite_job_store_is_refused_with_several_processes():
    """A SQLite file belongs to one process, and the shared port would send a job's GET to another."""
    r = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--processes", "2", "--jobs-db", "jobs.db"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--jobs-db is a SQLite file, which belongs to one process" in r.stderr


def test_a_child_that_cannot_listen_stops_the_group_with_its_status():
    """Its own port is taken: it exits before it ever listened, so a replacement would fail the same way; the
    parent stops the other child and exits non-zero instead of respawning for ever."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "batchserve",
                "serve",
                "--port",
                "0",
                "--processes",
                "2",
                "--devices",
                "2",
                "--process-port-base",
                str(taken.getsockname()[1]),
                "--drain-grace-s",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    assert "cannot bind" in r.stderr and "before it listened: stopping the others" in r.stderr


class HungDrill:
    """Six keep-alive clients sending back to back, each request retried once after a connection error (reset,
    or closed with no answer), as a balancer retries an idempotent request on another connection. What each
    request ended in, when it was sent, and how long it took, retry included."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.url, self.stop = url, threading.Event()
        self.lock = threading.Lock()
        self.sent: list[tuple[float, float, str]] = []  # (sent at, took, outcome)
        self.failures: list[str] = []
        self.retried = 0
        self.threads = [threading.Thread(target=self.client, args=(k,)) for k in range(clients)]

    def client(self, k: int) -> None:
        i = 0
        c = httpx.Client(base_url=self.url, timeout=30)
        try:
            while not self.stop.is_set():
                text = f"hung-{k}-{i}"
                i += 1
                started = time.monotonic()
                outcome = ""
                for attempt in range(2):
                    try:
                        r = c.post("/v1/inference", json={"input": text})
                    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError) as exc:
                        # The connection broke with no answer: the stopped child was killed under it.
                        c.close()
                        c = httpx.Client(base_url=self.url, timeout=30)
                        if attempt == 0:
                            with self.lock:
                                self.retried += 1
                            continue
                        outcome = f"connection error twice: {type(exc).__name__}"
                        break
                    except httpx.HTTPError as exc:  # a timeout above all: 30 s with no answer
                        outcome = f"{type(exc).__name__}: {exc}"
                        break
                    if r.status_code == 200 and r.json()["output"] == text[::-1]:
                        outcome = "200"
                    elif r.status_code in (429, 503, 504) and r.json().get("error"):
                        # A clear status: refused, or (504 DEADLINE_EXCEEDED) its batch outlived the worker's
                        # deadline while the process stood still.
                        outcome = f"{r.status_code} {r.json()['error']}"
                    else:
                        outcome = f"{r.status_code} {r.text[:200]}"
                    break
                with self.lock:
                    self.sent.append((started, time.monotonic() - started, outcome))
                    if outcome != "200" and not outcome.startswith(("429 ", "503 ", "504 ")):
                        self.failures.append(f"{text}: {outcome}")
        finally:
            c.close()

    def outcomes(self, since: float = 0.0) -> Counter[str]:
        with self.lock:
            return Counter(outcome for started, _, outcome in self.sent if started >= since)

    def answered_since(self, t: float) -> int:
        with self.lock:
            return sum(1 for started, _, outcome in self.sent if started >= t and outcome == "200")

    def __enter__(self) -> HungDrill:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stopped_child_is_killed_and_replaced_and_every_request_is_answered(server_factory):
    """Issue 34, item 3: SIGSTOP one of two children under six clients. A pause shorter than --process-hang-s
    (1 s against the default 3 s) is a busy child: nothing is killed. A lasting stop: the parent, which probes
    each child's own port, finds its loop silent for 3 s, kills it and starts a replacement. Meanwhile the
    requests the kernel dealt to it wait; at the kill their connections break, and each client's one retry
    reaches a live child. Every request ends in its right answer (or a clear 429/503), none waits anywhere near
    its 30 s timeout (a batch running when the process stopped may end 504 DEADLINE_EXCEEDED: it outlived its
    worker's deadline), and afterwards the shared port's /readyz is answered by live children only.
    (Checked: with --process-hang-s 0, the old behaviour, the stopped child's requests time out.)"""
    server = server_factory(
        "--processes", "2", "--devices", "2", "--sim-batch-ms", "20", "--slo-ms", "2000", "--timeout-ms", "10000"
    )
    kids = children(server)
    victim = min(kids)
    try:
        with HungDrill(server.url) as drill:
            wait_for(lambda: drill.answered_since(0) > 60, timeout=30, every=0.02)
            # A short pause is not a hang.
            os.kill(victim, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(victim, signal.SIGCONT)
            paused_back = time.monotonic()
            wait_for(lambda: drill.answered_since(paused_back) > 40, timeout=30, every=0.02)
            assert not gone(victim) and "answered no health probe" not in server.log()
            # A lasting stop is.
            stopped_at = time.monotonic()
            os.kill(victim, signal.SIGSTOP)
            wait_for(lambda: gone(victim), timeout=30, every=0.05)
            killed_after = time.monotonic() - stopped_at
            replaced = children(server)
            after = time.monotonic()
            wait_for(lambda: drill.answered_since(after) > 40 or drill.failures, timeout=30, every=0.02)
    finally:
        if not gone(victim):
            os.kill(victim, signal.SIGKILL)
    assert drill.failures == [], drill.failures[:5]
    slowest = max(took for started, took, _ in drill.sent if started >= stopped_at - 0.5)
    print(
        f"killed {killed_after:.1f} s after the stop; slowest request {slowest:.1f} s; "
        f"{drill.retried} connection(s) broken and retried; {drill.outcomes()}"
    )
    assert killed_after < 10, f"the stopped child was killed {killed_after:.1f} s after the stop"
    assert slowest < 10, f"a request took {slowest:.1f} s across the stop"
    assert "answered no health probe on its own port" in server.log()
    assert victim not in replaced and len(replaced) == 2
    assert sorted(d["process"]["index"] for d in replaced.values()) == [0, 1]
    for _ in range(20):  # the shared port: every probe answered, ready, by a live child
        with httpx.Client(base_url=server.url, timeout=5) as c:
            r = c.get("/readyz")
            assert r.status_code == 200, r.text
            assert c.get("/internal/health").json()["pid"] in replaced
