"""Headless Chromium driven over the DevTools protocol: open a page with a cookie, screenshot it.

Chromium's ``--screenshot`` flag cannot send a cookie or a header, and the report pages need
Airflow's JWT, so the browser is started with ``--remote-debugging-port`` and driven directly:
set the ``_token`` cookie the Airflow UI would have set, load the page, wait for what it should
show, read what the DOM holds and capture it as a PNG. Only ``websockets`` (installed with Airflow's API server)
is needed; no browser-automation package.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")
STARTUP_SECONDS = 60
REPLY_SECONDS = 120


@pytest.fixture(scope="module")
def chromium() -> Path:
    """The Chromium binary; a test that needs it fails (rather than skips) where it is missing."""
    found = find_chromium()
    if found is None:
        pytest.fail("Chromium is not installed; the browser tests need it: scripts/ensure-chromium")
    return found


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


class BrowserPage:
    """One tab of a fresh headless Chromium, driven step by step: open, evaluate, wait, capture.

    A single-page app (the Airflow UI) draws after its load event, and a live page redraws
    itself, so tests wait for what they expect with :meth:`wait_until` rather than reading once.
    """

    def __init__(self, chromium: Path, profile: Path, *, width: int = 1280) -> None:
        self.chromium, self.profile, self.width = chromium, profile, width

    def __enter__(self) -> BrowserPage:
        self.profile.mkdir(parents=True, exist_ok=True)
        (self.profile / "DevToolsActivePort").unlink(missing_ok=True)  # a reused profile's port is stale
        self._resources = ExitStack()
        self._log = self._resources.enter_context((self.profile / "chromium.log").open("w"))
        self._process = subprocess.Popen(
            [str(self.chromium), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._socket = self._resources.enter_context(
                connect(_browser_endpoint(self.profile, self._process), max_size=None, open_timeout=STARTUP_SECONDS))
            self._devtools = _DevTools(self._socket)
            target = self._devtools.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self._devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Network.enable", "Page.enable"):
                self._devtools.call(domain, self._session)
            self._resize(900)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._devtools.call("Browser.close")
            self._process.wait(timeout=STARTUP_SECONDS)
        finally:
            self._stop()

    def open(self, url: str, *, cookies: dict[str, str] | None = None) -> None:
        """Load ``url`` with ``cookies`` set for its origin; return once its load event fired."""
        for name, value in (cookies or {}).items():
            self._devtools.call("Network.setCookie", self._session, name=name, value=value, url=url)
        self._devtools.events.clear()
        self._devtools.call("Page.navigate", self._session, url=url)
        self._devtools.wait_for("Page.loadEventFired", self._session)

    def evaluate(self, expression: str) -> Any:
        """The JSON-serialisable value of a JavaScript expression in the page."""
        reply = self._devtools.call("Runtime.evaluate", self._session, expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression!r} raised in the page: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    def wait_until(self, expression: str, timeout: float = 60.0, what: str = "") -> Any:
        """Evaluate ``expression`` until it is truthy; its value, or an error naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                seen = self.evaluate("document.body ? document.body.innerText.slice(0, 2000) : ''")
                raise AssertionError(f"the page did not show {what or expression} within {timeout:g} s; it shows:\n{seen}")
            time.sleep(0.25)

    def capture(self) -> PageCapture:
        """The whole page as a PNG, with the DOM's text and SVG count."""
        seen = json.loads(self.evaluate(
            "JSON.stringify({text: document.body.innerText, svgs: document.querySelectorAll('svg').length})"))
        height = math.ceil(self._devtools.call("Page.getLayoutMetrics", self._session)["cssContentSize"]["height"])
        self._resize(height)
        png = base64.b64decode(self._devtools.call("Page.captureScreenshot", self._session, format="png")["data"])
        return PageCapture(png=png, width=self.width, height=height, text=seen["text"], svg_count=seen["svgs"])

    def capture_viewport(self, height: int) -> bytes:
        """The top ``height`` CSS pixels as a PNG (an app page whose frame scrolls inside)."""
        self._resize(height)
        return base64.b64decode(self._devtools.call("Page.captureScreenshot", self._session, format="png")["data"])

    def _resize(self, height: int) -> None:
        self._devtools.call("Emulation.setDeviceMetricsOverride", self._session, width=self.width, height=height,
                            deviceScaleFactor=1, mobile=False)

    def _stop(self) -> None:
        self._resources.close()
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def capture_page(chromium: Path, url: str, profile: Path, *, cookies: dict[str, str] | None = None,
                 width: int = 1280) -> PageCapture:
    """Load ``url`` in a fresh headless Chromium with ``cookies`` set for its origin; capture it whole."""
    with BrowserPage(chromium, profile, width=width) as page:
        page.open(url, cookies=cookies)
        return page.capture()


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
