"""Whether a `--processes` child still answers: the parent's probe of each child's own port.

"Hung": the child's event loop has answered no `GET /healthz` on its own port for `--process-hang-s`. The probe is
answered by the same loop that answers every request, so it says what a caller would see (a SIGSTOPped process, a
deadlocked loop); a heartbeat thread would keep beating while the loop is stuck. A busy child is not hung: a loop
that turns at all answers /healthz within milliseconds even under full load, and the threshold is many times the
default SLO, so only a loop that every caller already finds dead is killed.

Only silence counts: a refused connection means the child is leaving (a stopped process's port still accepts
connections in the kernel, never refuses them). A child's exit is watched through its process sentinel.
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

PROBE_EVERY_S = 0.5  # how often each child is asked


@dataclass
class ChildLiveness:
    """One child's verdict from its probes' answers; pure (the clock is the caller's), so it is tested alone."""

    hang_s: float  # silence that makes a child hung; 0 = never
    last_answer: float  # when it last answered, or when watching began

    def answered(self, now: float) -> None:
        self.last_answer = max(self.last_answer, now)

    def silent_for(self, now: float) -> float:
        return max(0.0, now - self.last_answer)

    def hung(self, now: float) -> bool:
        return self.hang_s > 0 and self.silent_for(now) >= self.hang_s


def probe(host: str, port: int, timeout_s: float) -> bool:
    """One `GET /healthz` on a new connection: True when the child answered (any status) or refused the
    connection (leaving, not hung); False when nothing came back within `timeout_s`."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        return True
    except (ConnectionRefusedError, ConnectionResetError, http.client.HTTPException):
        return True  # leaving; or a garbled answer, still an answer from a turning loop
    except OSError:  # socket.timeout (TimeoutError) above all: silence
        return False
    finally:
        conn.close()


class Prober:
    """A daemon thread that probes one child's own port; the parent's supervision loop reads `hung()` and does the
    killing (one place decides a child's fate)."""

    def __init__(self, host: str, port: int, hang_s: float, ask: Callable[[str, int, float], bool] = probe) -> None:
        self.host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        self.port, self.ask = port, ask
        self.liveness = ChildLiveness(hang_s, time.monotonic())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{port}", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def hung(self) -> bool:
        with self._lock:
            return self.liveness.hung(time.monotonic())

    def silent_for(self) -> float:
        with self._lock:
            return self.liveness.silent_for(time.monotonic())

    def _run(self) -> None:
        # Each probe may wait as long as the whole threshold: a loop late by less than that is alive.
        timeout_s = max(self.liveness.hang_s, PROBE_EVERY_S)
        while not self._stop.is_set():
            sent = time.monotonic()
            if self.ask(self.host, self.port, timeout_s):
                with self._lock:
                    self.liveness.answered(time.monotonic())
            self._stop.wait(max(0.0, sent + PROBE_EVERY_S - time.monotonic()))
