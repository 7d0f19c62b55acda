"""Preemption: SIGTERM and the clouds' preemption notices, turned into one "stop now" flag.

The training loop checks the flag at every step boundary (and between gradient-accumulation
chunks, where SIGTERM, or a notice whose window a step would overrun, abandons the step in
progress); when it is set, the workers agree to stop, save an emergency checkpoint and exit 75
(EX_TEMPFAIL: resumable). Notices come from ``$SPOTSCHED_NOTICE``:

- ``aws``: IMDSv2 ``/latest/meta-data/spot/instance-action`` (404 until the 2-minute notice,
  then a JSON body with the action and time), with a session token from ``/latest/api/token``;
- ``gcp``: ``/computeMetadata/v1/instance/preempted`` with header ``Metadata-Flavor: Google``
  (``TRUE`` once preempted, 30 seconds before the instance stops);
- ``file:///path``: the appearance of that file is the notice (the local backend uses it); the
  path is percent-decoded, as ``Path.as_uri()`` encodes it (a literal ``#`` or ``?`` would end it);
- ``none`` (default): SIGTERM only.

``$SPOTSCHED_METADATA_URL`` replaces the metadata server's base URL (tests serve it on loopback).
"""

from __future__ import annotations

import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

NOTICE_WINDOW_S = {"aws": 120.0, "gcp": 30.0}
DEFAULT_METADATA_URL = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
HTTP_TIMEOUT_S = 2.0


class StopFlag:
    """Set once by a signal handler or a watcher thread; read by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking at once when the flag is set; returns whether it is."""
        return self._event.wait(seconds)


def install_sigterm_handler(flag: StopFlag) -> Callable[[], None]:
    """Make SIGTERM set ``flag``; returns a function that restores the previous handler."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flag.set("sigterm"))

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


@dataclass(frozen=True)
class NoticeSource:
    """Where preemption notices come from: ``kind`` aws | gcp | file, and the URL or path."""

    kind: str
    location: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NoticeSource | None:
        value = env.get("SPOTSCHED_NOTICE", "none").strip() or "none"
        if value == "none":
            return None
        if value in ("aws", "gcp"):
            return cls(value, env.get("SPOTSCHED_METADATA_URL") or DEFAULT_METADATA_URL[value])
        if value.startswith("file://"):
            path = unquote(urlparse(value).path)
            if not path:
                raise ValueError(f"SPOTSCHED_NOTICE={value!r} names no file: use file:///absolute/path")
            return cls("file", path)
        raise ValueError(f"SPOTSCHED_NOTICE={value!r} is not one of aws, gcp, file:///path, none")

    @property
    def window_s(self) -> float | None:
        """Seconds between the notice and the stop (None: the file notice has no fixed window)."""
        return NOTICE_WINDOW_S.get(self.kind)

    def poll(self) -> str | None:
        """One look: a description of the notice if one is out, else None. Network errors raise OSError."""
        if self.kind == "file":
            return f"notice file {self.location}" if Path(self.location).exists() else None
        base = self.location.rstrip("/")
        if self.kind == "gcp":
            request = urllib.request.Request(base + GCP_PREEMPTED_PATH, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                body = response.read().decode().strip()
            return "gcp preempted" if body.upper() == "TRUE" else None
        headers = {}
        try:  # IMDSv2 session token; IMDSv1 (no token) still answers where v2 is not enforced
            token_request = urllib.request.Request(
                base + AWS_TOKEN_PATH, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
            with urllib.request.urlopen(token_request, timeout=HTTP_TIMEOUT_S) as response:
                headers["X-aws-ec2-metadata-token"] = response.read().decode()
        except urllib.error.HTTPError:
            pass
        try:
            request = urllib.request.Request(base + AWS_ACTION_PATH, headers=headers)
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return f"aws instance-action {response.read().decode().strip()}"
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise


class NoticeWatcher:
    """A daemon thread polling ``source`` every ``interval_s`` and setting ``flag`` on a notice."""

    def __init__(self, source: NoticeSource, flag: StopFlag, interval_s: float = 1.0,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.source, self.flag, self.interval_s = source, flag, interval_s
        self.on_error = on_error or (lambda message: None)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotsched-notice-watcher", daemon=True)
        self.notice: str | None = None

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.interval_s + HTTP_TIMEOUT_S * 2)

    def _run(self) -> None:
        reported_error = False
        while not self._stopped.is_set():
            try:
                notice = self.source.poll()
            except OSError as error:  # metadata server unreachable: keep polling, say so once
                if not reported_error:
                    self.on_error(f"preemption notice poll failed ({self.source.kind}): {error}")
                    reported_error = True
                notice = None
            if notice:
                self.notice = notice
                self.flag.set(f"notice: {notice}")
                return
            self._stopped.wait(self.interval_s)
