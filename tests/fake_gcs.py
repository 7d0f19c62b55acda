"""A Cloud Storage JSON API on loopback: the few calls gcsfs makes to write, stat and read objects.

Enough for the operator's files under a ``gs://`` checkpoint URI (simple multipart uploads, object
metadata, media downloads with ranges); each request's ``Authorization`` header is kept so a test
can tell whose credentials reached the store.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeGcs:
    url: str
    objects: dict[str, bytes] = field(default_factory=dict)
    authorizations: list[str | None] = field(default_factory=list)


@contextmanager
def fake_gcs() -> Iterator[FakeGcs]:
    """Serve objects (``bucket/name`` -> bytes) until the block ends."""
    store = FakeGcs("")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _not_found(self) -> None:
            self._send(404, b'{"error": {"code": 404, "message": "No such object"}}')

        def do_GET(self) -> None:
            store.authorizations.append(self.headers.get("Authorization"))
            url = urllib.parse.urlparse(self.path)
            if "/o/" not in url.path:  # a listing: gcsfs asks whether a path is a directory
                return self._send(200, b'{"items": [], "prefixes": []}')
            bucket = url.path.split("/b/", 1)[1].split("/", 1)[0]
            key = f"{bucket}/{urllib.parse.unquote(url.path.split('/o/', 1)[1])}"
            if key not in store.objects:
                return self._not_found()
            data = store.objects[key]
            if urllib.parse.parse_qs(url.query).get("alt") != ["media"]:
                name = key.split("/", 1)[1]
                return self._send(200, json.dumps({"bucket": bucket, "name": name, "size": str(len(data))}).encode())
            if ranged := self.headers.get("Range"):
                start, _, end = ranged.removeprefix("bytes=").partition("-")
                return self._send(206, data[int(start) : int(end) + 1 if end else None], "application/octet-stream")
            self._send(200, data, "application/octet-stream")

        def do_POST(self) -> None:
            store.authorizations.append(self.headers.get("Authorization"))
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            url = urllib.parse.urlparse(self.path)
            if urllib.parse.parse_qs(url.query).get("uploadType") != ["multipart"]:
                return self._send(400, b'{"error": {"code": 400, "message": "only multipart uploads"}}')
            boundary = self.headers["Content-Type"].split("boundary=", 1)[1].strip('"').encode()
            _, meta, data, _ = body.split(b"--" + boundary)
            name = json.loads(meta.split(b"\n\n", 1)[1])["name"]
            bucket = url.path.split("/b/", 1)[1].split("/", 1)[0]
            store.objects[f"{bucket}/{name}"] = data.split(b"\n\n", 1)[1][:-1]
            self._send(200, json.dumps({"bucket": bucket, "name": name}).encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    store.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield store
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
