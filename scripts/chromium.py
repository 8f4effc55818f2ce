"""A real headless Chromium for checking pages batchserve serves (`/docs`), and the screenshot in docs/.

`ensure_chromium` installs Debian's `chromium` with apt-get when it is missing (as root, as CI runs), as
`deploy/nginx/local.py` does for nginx, and fails loudly with the command to run when it cannot. Each run
gets a profile directory of its own (removed after), so nothing outside it is touched. `load_page` drives the
browser over its DevTools protocol and reports every request the page itself sent (the browser's own
background traffic to its vendor's services is not the page's), and what the page's CSP blocked.

    python -m scripts.chromium http://127.0.0.1:8000/docs docs/swagger-ui.png   # the committed screenshot
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.debian import ensure_installed

INSTALL_CMD = "apt-get update && apt-get install -y --no-install-recommends chromium"
NAMES = ("chromium", "chromium-browser")
RENDER_BUDGET_MS = 15000  # virtual time the page gets to run its scripts before the DOM is read


# The browser's own traffic (time sync, sign-in, safe browsing, updates, hints) switched off, so what it sends
# is what the page asks for.
QUIET = (
    "--no-pings",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-default-apps",
    "--no-service-autorun",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    "--disable-breakpad",
    "--safebrowsing-disable-auto-update",
    "--allow-browser-signin=false",
    "--dns-prefetch-disable",
    "--enable-automation",
    "--disable-component-extensions-with-background-pages",
    "--disable-search-engine-choice-screen",
    "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,MediaRouter,Translate,"
    "AutofillServerCommunication,CertificateTransparencyComponentUpdater,DialMediaRouteProvider,"
    "InterestFeedContentSuggestions,SafeBrowsingEnhancedProtection,SigninInterceptBubble,PreconnectToSearch,"
    "SearchPrefetchServicePrefetching,NetworkPrediction,ChromeSignin,DiceWebSigninInterception,"
    "PrivacySandboxSettings4,OptimizationGuideModelDownloading",
)


class ChromiumUnavailable(RuntimeError):
    pass


def find_chromium() -> str | None:
    return next((found for name in NAMES if (found := shutil.which(name))), None)


def ensure_chromium() -> str:
    """The chromium binary; installs Debian's package first when it is missing (root only)."""
    return ensure_installed(find_chromium, INSTALL_CMD, "chromium", ChromiumUnavailable, timeout=900)


def run_headless(
    url: str, *actions: str, width: int = 1280, height: int = 1400, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Load `url` in headless Chromium and do `actions` (`--dump-dom`, `--screenshot=PATH`)."""
    binary = ensure_chromium()
    with tempfile.TemporaryDirectory(prefix="bs-chromium-") as profile:
        cmd = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            *QUIET,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={RENDER_BUDGET_MS}",
            *actions,
        ]
        return subprocess.run(
            [*cmd, url], capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": profile}
        )


@dataclass
class PageLoad:
    """What a page did in the browser: its DOM once rendered, every URL it requested, and the URLs its
    Content-Security-Policy blocked."""

    dom: str
    requested: list[str]
    blocked: list[str]


RECORD_CSP = (
    "window.__blocked = []; document.addEventListener('securitypolicyviolation', "
    "e => window.__blocked.push(e.blockedURI));"
)


async def _load_page(ws_url: str, url: str, ready_js: str, timeout: float) -> PageLoad:
    """Open `url` in a fresh tab over the DevTools protocol, recording each request the page sends
    (Network.requestWillBeSent) until `ready_js` is true, then read the DOM."""
    import websockets

    async with websockets.connect(ws_url, max_size=64 * 2**20) as ws:
        ids = iter(range(1, 1_000_000))
        requested: list[str] = []

        async def call(method: str, session: str | None = None, **params: object) -> dict:
            msg_id = next(ids)
            await ws.send(
                json.dumps(
                    {"id": msg_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
                )
            )
            while True:
                msg = json.loads(await ws.recv())
                if msg.get("method") == "Network.requestWillBeSent":
                    requested.append(msg["params"]["request"]["url"])
                if msg.get("id") == msg_id:
                    if "error" in msg:
                        raise ChromiumUnavailable(f"{method}: {msg['error']}")
                    return msg.get("result", {})

        target = (await call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
        await call("Network.enable", session)
        await call("Page.enable", session)
        await call("Page.addScriptToEvaluateOnNewDocument", session, source=RECORD_CSP)
        await call("Page.navigate", session, url=url)
        give_up = time.monotonic() + timeout
        while not (await call("Runtime.evaluate", session, expression=f"Boolean({ready_js})", returnByValue=True))[
            "result"
        ].get("value"):
            if time.monotonic() > give_up:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # anything the rendered page still sends
        value = await call(
            "Runtime.evaluate",
            session,
            returnByValue=True,
            expression="JSON.stringify([document.documentElement.outerHTML, window.__blocked])",
        )
        dom, blocked = json.loads(value["result"]["value"])
        await call("Browser.close")
        return PageLoad(dom, requested, blocked)


def load_page(url: str, ready_js: str = "true", timeout: float = 60) -> PageLoad:
    """Load `url` in headless Chromium and wait until `ready_js` is true (or `timeout`): the page's DOM, the
    requests it sent (the browser's own background traffic is not the page's, and is not in the list)."""
    binary = ensure_chromium()
    with tempfile.TemporaryDirectory(prefix="bs-chromium-") as profile:
        cmd = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            *QUIET,
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            "about:blank",
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HOME": profile}
        )
        try:
            assert proc.stderr is not None
            ws_url = ""
            for line in proc.stderr:
                if line.startswith("DevTools listening on "):
                    ws_url = line.split(" on ", 1)[1].strip()
                    break
            if not ws_url:
                raise ChromiumUnavailable(f"chromium exited ({proc.wait()}) before its DevTools port opened")
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain: it must never block on a pipe
            return asyncio.run(_load_page(ws_url, url, ready_js, timeout))
        finally:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def screenshot(url: str, out: Path) -> None:
    done = run_headless(url, f"--screenshot={out.resolve()}")
    if done.returncode != 0 or not out.exists():
        raise ChromiumUnavailable(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m scripts.chromium URL OUT.png")
    screenshot(sys.argv[1], Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
