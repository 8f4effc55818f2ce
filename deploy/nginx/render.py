"""Render `batchserve.conf.template` for N backends: the http-level nginx config of a batchserve fleet.

    python -m deploy.nginx.render --backend 10.0.0.11:8000 --backend 10.0.0.12:8000 --listen 80 \\
        > /etc/nginx/conf.d/batchserve.conf

Why a renderer and not a hand-kept file: the list of upstream servers is the only thing that changes between
fleets, and every server line must carry the same parameters (see the template's header for `max_fails=0`).
Only the standard library is used, so it runs on any host with Python 3.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "batchserve.conf.template"
BACKEND = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def server_line(backend: str) -> str:
    if not BACKEND.match(backend) or not 0 < int(backend.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"a backend is HOST:PORT, got {backend!r}")
    return f"    server {backend} max_fails=0;"


def render(backends: list[str], listen: str = "80", keepalive: int = 256) -> str:
    """The config text for these backends (HOST:PORT each), nginx listening on `listen` (a port or ADDR:PORT)."""
    if not backends:
        raise ValueError("at least one backend is needed")
    if keepalive < 1:
        raise ValueError("keepalive must be at least 1")
    text = TEMPLATE.read_text()
    return (
        text.replace("@SERVERS@", "\n".join(server_line(b) for b in backends))
        .replace("@KEEPALIVE@", str(keepalive))
        .replace("@LISTEN@", listen)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render the nginx config of a batchserve fleet")
    p.add_argument("--backend", action="append", default=[], metavar="HOST:PORT", help="a batchserve process")
    p.add_argument(
        "--local",
        type=int,
        default=0,
        metavar="N",
        help="N processes on this host, on ports --first-port, --first-port+1, ...",
    )
    p.add_argument("--first-port", type=int, default=8001)
    p.add_argument("--listen", default="80", help="what nginx listens on: PORT or ADDR:PORT")
    p.add_argument("--keepalive", type=int, default=256, help="idle upstream connections kept per nginx worker")
    p.add_argument("--out", type=Path, help="write here instead of stdout")
    a = p.parse_args(argv)
    backends = a.backend + [f"127.0.0.1:{a.first_port + k}" for k in range(a.local)]
    try:
        text = render(backends, a.listen, a.keepalive)
    except ValueError as exc:
        p.error(str(exc))
    if a.out:
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
