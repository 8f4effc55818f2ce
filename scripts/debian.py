"""Install a Debian package the tests need when its binary is missing (CI runs as root on a clean machine)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from collections.abc import Callable

# apt-get fails at once when another apt-get holds dpkg's lock: the test workers (pytest-xdist) that need
# chromium and nginx on a clean machine install one at a time, each waiting on this file's lock.
INSTALL_LOCK = Path(tempfile.gettempdir()) / "batchserve-apt-install.lock"


def ensure_installed(
    find: Callable[[], str | None], install_cmd: str, what: str, error: type[Exception], timeout: float = 900
) -> str:
    """The binary `find` locates; runs `install_cmd` (apt-get) first when it is missing and this is root.
    Raises `error` with the command to run when it cannot be installed here, or with apt's output when it failed."""
    found = find()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        raise error(f"{what} is not installed and cannot be installed by this user; run as root: {install_cmd}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find()  # another worker may have installed it while this one waited
        if found:
            return found
        done = subprocess.run(["bash", "-c", install_cmd], env=env, capture_output=True, text=True, timeout=timeout)
    found = find()
    if done.returncode != 0 or not found:
        raise error(f"`{install_cmd}` failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return found
