"""Server memory across floods of idle connections: RSS before, while N connections are held, and after they close.

    python -m bench.idle_flood                       # 5,000 then 15,000 connections; prints the table
    python -m bench.idle_flood --sizes 18000 --record

Why: the soak left RSS +96 MB after 20 k idle connections had come and gone (issue 28): what the connections
took stayed in glibc's free lists. The server now returns it (`batchserve/heap.py`, called by the connection
sweep once the open connections fall to a quarter of a peak of 1,024 or more); this shows how much comes back.
One sim server (1 device), connections from this process on 127.0.0.1; nothing else runs.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

from bench import common, report, servers
from bench.procstat import raise_fd_limit, rss_mb


def flood(port: int, pid: int, n: int, settle_s: float) -> dict:
    before = rss_mb(pid)
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.connect(("127.0.0.1", port))
        socks.append(sock)
    time.sleep(settle_s)  # every connection accepted, its protocol built
    held = rss_mb(pid)
    for sock in socks:
        sock.close()
    time.sleep(settle_s)  # the sweep sees them gone (under a second) and trims
    after = rss_mb(pid)
    return {
        "connections": n,
        "rss_before_mb": before,
        "rss_held_mb": held,
        "rss_after_mb": after,
        "kept_of_growth": (after - before) / (held - before) if held > before else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="5000,15000", help="connections per flood, comma-separated (in this order)")
    p.add_argument("--settle", type=float, default=4.0, help="seconds waited after opening, and after closing")
    common.add_output_flags(p, name="idle-flood")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    limit = raise_fd_limit()
    if max(sizes) + 100 > limit:
        p.error(f"the descriptor limit is {limit}: at most {limit - 100} connections")
    name = common.run_name(a, "idle-flood")
    logs = common.log_dir(a, name)
    rows: list[dict] = []
    rep: dict = {"kind": "idle-flood", "settings": {"sizes": sizes, "settle_s": a.settle}, **report.provenance()}
    with common.guarded(rep):
        server = servers.start(
            "batchserve", servers.batchserve_cmd(1, 5, 100, [f"--max-connections={max(sizes) + 1000}"]), logs
        )
        for n in sizes:
            rows.append(flood(server.port, server.pid, n, a.settle))
            print(f"{n} connections: {rows[-1]}", file=sys.stderr)
    servers.stop_all()
    rep["rows"] = rows
    table = report.table(
        ["connections", "RSS before MB", "held MB", "after close MB", "kept of the growth"],
        [
            [r["connections"], r["rss_before_mb"], r["rss_held_mb"], r["rss_after_mb"], f"{r['kept_of_growth']:.0%}"]
            for r in rows
        ],
    )
    markdown = f"# batchserve idle-connection flood — {rep['when_utc']}\n\n{table}\n"
    print(table)
    print(report.written(report.write(name, rep, markdown, common.out_dir(a)), logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
