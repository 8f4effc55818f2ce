"""A real nginx for tests and benches: Debian's package, run unprivileged-style from a temporary directory.

Why here: tests and `bench/fleet.py` must run the very config that deploys (`batchserve.conf.template`), in
front of real batchserve processes, on a clean CI machine. `ensure_nginx` installs Debian's nginx with
apt-get when it is missing (as root, as CI runs) and fails loudly, with the command to run, when it cannot.
`start_nginx` wraps the rendered http-level config in a main config whose pid file, logs and temp paths all
live in the run's directory, listens on a free loopback port and runs in the foreground (`daemon off`), so
nothing outside that directory is touched and stopping it by its PID leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.nginx.render import render
from scripts.debian import ensure_installed

INSTALL_CMD = "apt-get update && apt-get install -y --no-install-recommends nginx"
START_TIMEOUT_S = 10.0
BIND_RETRIES = 5

MAIN_CONF = """\
# A local nginx run from {dir} (deploy/nginx/local.py): everything it writes stays in this directory.
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    {access_log}
    include {dir}/batchserve.conf;
}}
"""
ACCESS_LOG = (
    "log_format upstreams '$request_uri $status upstream=$upstream_addr "
    "upstream_status=$upstream_status rt=$request_time';\n"
    "    access_log {dir}/access.log upstreams;"
)


class NginxUnavailable(RuntimeError):
    """nginx is not installed and could not be installed here."""


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def ensure_nginx() -> str:
    """The nginx binary; installs Debian's package first when it is missing (root only)."""
    return ensure_installed(find_nginx, INSTALL_CMD, "nginx", NginxUnavailable, timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalNginx:
    proc: subprocess.Popen
    dir: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        """The worker processes (children of the master), for CPU accounting."""
        try:
            return [int(p) for p in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except OSError:
            return []

    def access_log(self) -> list[str]:
        path = self.dir / "access.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def error_log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, cleanup: bool = True, keep_logs_in: Path | None = None) -> None:
        """SIGQUIT (finish open requests), then SIGKILL after a bounded wait; then copy its logs to
        `keep_logs_in` (when given) and remove its directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if keep_logs_in is not None:
            keep_logs_in.mkdir(parents=True, exist_ok=True)
            for name in ("error.log", "access.log", "batchserve.conf"):
                if (self.dir / name).exists():
                    shutil.copy(self.dir / name, keep_logs_in / f"nginx-{name}")
        if cleanup:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_nginx(
    backends: list[str], workers: int = 1, access_log: bool = True, keepalive: int = 256, port: int = 0
) -> LocalNginx:
    """Run nginx in front of `backends` (HOST:PORT each) on 127.0.0.1 and return once it accepts connections."""
    binary = ensure_nginx()
    run_dir = Path(tempfile.mkdtemp(prefix="batchserve-nginx-"))
    run_dir.chmod(0o755)  # run as root, nginx's workers are `nobody`: they must reach the temp paths
    (run_dir / "tmp").mkdir()
    main = MAIN_CONF.format(
        dir=run_dir, workers=workers, access_log=ACCESS_LOG.format(dir=run_dir) if access_log else "access_log off;"
    )
    (run_dir / "nginx.conf").write_text(main)
    last_error = ""
    for _ in range(BIND_RETRIES):
        chosen = port or free_port()
        (run_dir / "batchserve.conf").write_text(render(backends, f"127.0.0.1:{chosen}", keepalive))
        proc = subprocess.Popen(
            [
                binary,
                "-p",
                str(run_dir),
                "-c",
                str(run_dir / "nginx.conf"),
                "-e",
                str(run_dir / "error.log"),
                "-g",
                "daemon off;",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        give_up = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < give_up and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", chosen), timeout=0.5).close()
                return LocalNginx(proc, run_dir, chosen)
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log = run_dir / "error.log"
        last_error = (proc.stderr.read() if proc.stderr else "") + (
            log.read_text(errors="replace") if log.exists() else ""
        )
        if "Address already in use" not in last_error or port:
            break
    shutil.rmtree(run_dir, ignore_errors=True)
    raise RuntimeError(f"nginx did not start:\n{last_error}")
