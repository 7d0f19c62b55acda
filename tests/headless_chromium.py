"""Headless Chromium driven over the DevTools protocol: open a page with a cookie, screenshot it.

Chromium's ``--screenshot`` flag cannot send a cookie or a header, and the report pages need
Airflow's JWT, so the browser is started with ``--remote-debugging-port`` and driven directly:
set the ``_token`` cookie the Airflow UI would have set, load the page, read what the DOM holds
and capture the whole page as a PNG. Only ``websockets`` (installed with Airflow's API server)
is needed; no browser-automation package.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")
STARTUP_SECONDS = 60
REPLY_SECONDS = 120


def find_chromium() -> Path | None:
    """The Chromium binary (Debian's ``chromium`` package), or ``None`` when it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return Path(found) if found else None


@dataclass(frozen=True)
class PageCapture:
    """What the browser showed: the full-page PNG, its CSS size and the DOM's text and SVG count."""

    png: bytes
    width: int
    height: int
    text: str
    svg_count: int


class _DevTools:
    """Commands and events over one browser-level DevTools websocket."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket = socket
        self.last_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self.last_id += 1
        message: dict[str, Any] = {"id": self.last_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        while True:
            reply = json.loads(self.socket.recv(timeout=REPLY_SECONDS))
            if reply.get("id") != self.last_id:
                self.events.append(reply)
            elif "error" in reply:
                raise RuntimeError(f"DevTools {method} failed: {reply['error']}")
            else:
                return reply.get("result", {})

    def wait_for(self, event: str, session: str) -> None:
        while not any(e.get("method") == event and e.get("sessionId") == session for e in self.events):
            self.events.append(json.loads(self.socket.recv(timeout=REPLY_SECONDS)))


def capture_page(chromium: Path, url: str, profile: Path, *, cookies: dict[str, str] | None = None,
                 width: int = 1280) -> PageCapture:
    """Load ``url`` in a fresh headless Chromium with ``cookies`` set for its origin; capture it whole."""
    profile.mkdir(parents=True, exist_ok=True)
    log = (profile / "chromium.log").open("w")
    process = subprocess.Popen([str(chromium), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        with connect(_browser_endpoint(profile, process), max_size=None, open_timeout=STARTUP_SECONDS) as socket:
            devtools = _DevTools(socket)
            target = devtools.call("Target.createTarget", url="about:blank")["targetId"]
            session = devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            devtools.call("Network.enable", session)
            for name, value in (cookies or {}).items():
                devtools.call("Network.setCookie", session, name=name, value=value, url=url)
            devtools.call("Page.enable", session)
            devtools.call("Emulation.setDeviceMetricsOverride", session, width=width, height=900,
                          deviceScaleFactor=1, mobile=False)
            devtools.call("Page.navigate", session, url=url)
            devtools.wait_for("Page.loadEventFired", session)
            dom = devtools.call("Runtime.evaluate", session, returnByValue=True, expression=(
                "JSON.stringify({text: document.body.innerText, svgs: document.querySelectorAll('svg').length})"))
            seen = json.loads(dom["result"]["value"])
            height = math.ceil(devtools.call("Page.getLayoutMetrics", session)["cssContentSize"]["height"])
            devtools.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                          deviceScaleFactor=1, mobile=False)
            png = base64.b64decode(devtools.call("Page.captureScreenshot", session, format="png")["data"])
            devtools.call("Browser.close")
        process.wait(timeout=STARTUP_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    return PageCapture(png=png, width=width, height=height, text=seen["text"], svg_count=seen["svgs"])


def _browser_endpoint(profile: Path, process: subprocess.Popen) -> str:
    """The browser's DevTools websocket, which Chromium announces in the profile once it listens."""
    announced = profile / "DevToolsActivePort"
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Chromium exited with {process.returncode}; see {profile / 'chromium.log'}")
        lines = announced.read_text().split() if announced.exists() else []
        if len(lines) == 2:
            return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        time.sleep(0.1)
    raise RuntimeError(f"Chromium did not open its DevTools port within {STARTUP_SECONDS} s")
