"""A real PostgreSQL server for the tests: `initdb` in a temporary directory, `pg_ctl start`, stopped at the end.

It listens only on a unix socket in its own directory (no TCP port to collide with anything else on the
machine), with trust authentication. PostgreSQL refuses to run as root, so as root (CI) the server runs as the
`postgres` user through `runuser`, and its directory is handed to that user. Each test that needs a database
gets a fresh schema (`fresh_url`), so tests never see each other's jobs.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

INSTALL_HINT = (
    "PostgreSQL's server binaries (initdb, pg_ctl) were not found in /usr/lib/postgresql/*/bin or on "
    "PATH; install them (Debian: apt-get install -y postgresql-15) or point BATCHSERVE_PG_BIN at "
    "their directory"
)


def find_bin_dir() -> Path:
    """The directory holding initdb and pg_ctl: BATCHSERVE_PG_BIN, else the newest Debian install, else PATH."""
    given = os.environ.get("BATCHSERVE_PG_BIN")
    candidates = [given] if given else []
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda d: int(Path(d).parent.name) if Path(d).parent.name.isdigit() else 0,
        reverse=True,
    )
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for d in candidates:
        if (Path(d) / "initdb").is_file() and (Path(d) / "pg_ctl").is_file():
            return Path(d)
    raise FileNotFoundError(INSTALL_HINT)


@dataclass
class PgServer:
    bin_dir: Path
    root: Path  # holds data/ and the socket
    port: int = 5432  # only names the socket file: nothing listens on TCP
    as_user: list[str] = field(default_factory=list)  # runuser prefix when running as root
    running: bool = False
    _schemas: int = 0

    @classmethod
    def start(cls) -> PgServer:
        bin_dir = find_bin_dir()
        root = Path(tempfile.mkdtemp(prefix="batchserve-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            pg = pwd.getpwnam("postgres")
            os.chown(root, pg.pw_uid, pg.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        server = cls(bin_dir, root, as_user=as_user)
        data = root / "data"
        server._run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync")
        # Durability settings off: a test database need not survive a power cut, and fsync is slow on CI disks.
        server.resume()
        return server

    def resume(self) -> None:
        """Start the server (again, after `halt`), on the same data and socket."""
        options = (
            f"-k {self.root} -c listen_addresses='' -p {self.port} -c fsync=off -c synchronous_commit=off "
            f"-c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.root / "data"),
            "-o",
            options,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        self.running = True

    def halt(self) -> None:
        """Stop the server as an outage would (connections cut, new ones refused), keeping its data (a fast
        stop: with fsync and synchronous_commit off, an immediate one loses the last commits)."""
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")
        self.running = False

    def server_pids(self) -> list[int]:
        """The postmaster (first line of its data directory's postmaster.pid) and every process it started."""
        postmaster = int((self.root / "data" / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True, timeout=10)
        return [postmaster] + [int(pid) for pid in children.stdout.split()]

    def freeze(self) -> list[int]:
        """Black-hole the server: SIGSTOP the postmaster, then every backend and helper. Its socket still takes
        connections (the kernel does) and nothing answers or refuses; its connections stay open. Returns the
        pids stopped, for `thaw`."""
        postmaster, *rest = self.server_pids()
        os.kill(postmaster, signal.SIGSTOP)  # first: it starts no backend after this
        for pid in rest + self.server_pids()[1:]:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        return [postmaster] + sorted(set(rest + self.server_pids()[1:]))

    def thaw(self, pids: list[int]) -> None:
        """SIGCONT what `freeze` stopped, the backends first."""
        for pid in reversed(pids):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _run(self, program: str, *args: str) -> None:
        cmd = [*self.as_user, str(self.bin_dir / program), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n{tail}")

    def url(self, schema: str = "") -> str:
        url = f"postgresql://postgres@/postgres?host={quote(str(self.root), safe='')}&port={self.port}"
        return url + (f"&options={quote(f'-csearch_path={schema}', safe='')}" if schema else "")

    def fresh_url(self) -> str:
        """The URL of a fresh, empty namespace: a schema of its own, set as the connection's search_path
        (a schema takes a millisecond to create, a database a second)."""
        self._schemas += 1
        name = f"t{os.getpid()}_{self._schemas}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            if self.running:
                self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL server for the session; fails (not skips) when PostgreSQL is not installed."""
    try:
        server = PgServer.start()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.stop()
