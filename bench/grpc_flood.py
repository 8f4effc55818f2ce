"""A flood of idle gRPC connections against `--grpc-port` while HTTP /healthz, a keyed HTTP request and a gRPC call
keep being asked: whether each keeps answering, and what became of the flood's connections.

    python -m bench.grpc_flood                            # 20,000 connections, server limit 20,000 descriptors
    python -m bench.grpc_flood --connections 2000 --server-fd-limit 2000 --hold-s 4 --idle-s 1

Each flood connection sends HTTP/2's preface and an empty SETTINGS, then nothing. The server caps gRPC at its share
of the descriptor budget (`batchserve/http/budget.py`: a quarter) and closes connections without a call after
`--keep-alive-timeout-s`; HTTP keeps its own share. One sim server (1 device) on 127.0.0.1, the flood and the
probes from this process; it stops itself after the flood, the hold and the idle limit have passed. Busy machine:
latencies are not results there.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench import common, report, servers
from bench.procstat import raise_fd_limit

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS
KEY = "sk-grpc-flood"
GRPC_LINE = re.compile(rb"gRPC \(KServe v2\) listening on [\d.]+:(\d+)")


@dataclass
class Probe:
    """One kind of request asked over and over in a phase: its answers and latencies."""

    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)

    def p99_ms(self) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


def probe_loop(
    url: str, grpc_target: str, stop: threading.Event, phase: list[str], probes: dict[tuple[str, str], Probe]
) -> None:
    """Every 0.1 s: GET /healthz, a keyed POST /v1/inference, a gRPC ServerReady on a channel opened before the
    flood and one on a new connection, each booked to the phase."""
    import grpc

    method = "/inference.GRPCInferenceService/ServerReady"

    def fresh() -> None:
        with grpc.insecure_channel(grpc_target) as new:
            new.unary_unary(method)(b"", timeout=2)

    with httpx.Client(base_url=url, timeout=5) as http, grpc.insecure_channel(grpc_target) as channel:
        ready = channel.unary_unary(method)
        asks = {
            "healthz": lambda: http.get("/healthz").raise_for_status(),
            "keyed": lambda: http.post(
                "/v1/inference", json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"}
            ).raise_for_status(),
            "grpc, open channel": lambda: ready(b"", timeout=5),
            "grpc, new connection": fresh,
        }
        while not stop.is_set():
            for name, ask in asks.items():
                book = probes.setdefault((phase[0], name), Probe())
                started = time.monotonic()
                try:
                    ask()
                    book.ok += 1
                    book.latencies.append(time.monotonic() - started)
                except Exception:  # noqa: BLE001 - any failure is what is counted
                    book.failed += 1
            stop.wait(0.1)


def open_flood(port: int, n: int, sel: selectors.DefaultSelector) -> tuple[int, int, int]:
    """Open `n` connections, each sending the preface, reaping what the server closes as it goes (so the client's
    own descriptors, as many as the server's, last for an attempt of the server's whole limit): (opened, refused
    at connect or past this client's descriptors, closed by the server meanwhile)."""
    opened = refused = closed = 0
    for i in range(n):
        if i % 256 == 0:
            closed += reap(sel, 0.0)
        try:
            sock = socket.socket()
        except OSError:  # this client's own descriptors are spent: the server kept every one open
            refused += 1
            continue
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(PREFACE)
        except OSError:
            sock.close()
            refused += 1
            continue
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        opened += 1
    return opened, refused, closed


def reap(sel: selectors.DefaultSelector, wait_s: float) -> int:
    """Read what the server sent for `wait_s` (at least one pass); close and count the connections it closed."""
    closed = 0
    give_up = time.monotonic() + wait_s
    while sel.get_map():
        left = give_up - time.monotonic()
        for key, _ in sel.select(max(0.0, min(left, 0.2))):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                sock.close()
                closed += 1
        if left <= 0:
            break
    return closed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=20000, help="idle gRPC connections attempted")
    p.add_argument("--hold-s", type=float, default=12.0, help="seconds the flood is watched once opened")
    p.add_argument("--idle-s", type=float, default=5.0, help="the server's --keep-alive-timeout-s")
    p.add_argument("--server-fd-limit", type=int, default=20000, help="the server's descriptor limit (ulimit -n)")
    common.add_output_flags(p, name="grpc-flood")
    a = p.parse_args(argv)
    limit = raise_fd_limit()  # the flood reaps what the server closes as it opens: a server of as many is fine
    name = common.run_name(a, "grpc-flood")
    logs = common.log_dir(a, name)
    logs.mkdir(parents=True, exist_ok=True)
    keys = logs / "keys.toml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    keys.write_text(f'[[keys]]\ntenant = "probe"\ntier = "paid"\nsha256 = "{digest}"\nrate = 100000\n')
    rep: dict = {"kind": "grpc-flood", "settings": vars(a) | {"descriptor_limit": limit}, **report.provenance()}
    rows: list[list] = []
    with common.guarded(rep):
        extra = ["--grpc-port", "0", "--config", str(keys), f"--keep-alive-timeout-s={a.idle_s:g}"]
        cmd = servers.batchserve_cmd(1, 5, 100, extra)
        limited = ["bash", "-c", f'ulimit -n {a.server_fd_limit} && exec "$@"', "bash", *cmd]
        server = servers.start("batchserve", limited, logs)
        found = GRPC_LINE.search(server.log_path.read_bytes())
        assert found, "no gRPC port in the server's log"
        grpc_port = int(found.group(1))
        phase, stop = ["before"], threading.Event()
        probes: dict[tuple[str, str], Probe] = {}
        prober = threading.Thread(
            target=probe_loop, args=(f"http://127.0.0.1:{server.port}", f"127.0.0.1:{grpc_port}", stop, phase, probes)
        )
        prober.start()
        sel = selectors.DefaultSelector()
        try:
            time.sleep(2.0)
            phase[0] = "flood"
            started = time.monotonic()
            opened, refused, closed_while_opening = open_flood(grpc_port, a.connections, sel)
            open_s = time.monotonic() - started
            closed_at_once = closed_while_opening + reap(sel, 1.0)  # past the cap: closed as they come
            phase[0] = "held"
            closed_later = reap(sel, a.hold_s)  # the idle limit
            still_open = len(sel.get_map())
            phase[0] = "after"
            time.sleep(1.0)
        finally:
            stop.set()
            prober.join()
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
        for (ph, probe_name), probe in probes.items():
            rows.append([ph, probe_name, probe.ok, probe.failed, f"{probe.p99_ms():.1f}"])
        rep["flood"] = {
            "attempted": a.connections,
            "opened": opened,
            "refused_at_connect": refused,
            "open_s": open_s,
            "closed_within_1s": closed_at_once,
            "closed_later": closed_later,
            "still_open": still_open,
        }
    servers.stop_all()
    rep["rows"] = rows
    table = report.table(["phase", "probe", "answered", "failed", "p99 ms"], rows)
    counts = [f"{v:.1f}" if isinstance(v, float) else v for v in rep["flood"].values()]
    flood = report.table(list(rep["flood"]), [counts])
    markdown = f"# batchserve idle gRPC flood — {rep['when_utc']}\n\n{flood}\n\n{table}\n"
    print(flood)
    print(table)
    print(report.written(report.write(name, rep, markdown, common.out_dir(a)), logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
