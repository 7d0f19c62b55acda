"""Preemption: notices from AWS/GCP metadata servers (served on loopback) and files, and SIGTERM -> exit 75."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from airflow_provider_spotsched.runtime.preemption import NoticeSource, NoticeWatcher, StopFlag
from tests.runtime_support import TINY_JOB, environment, parse_events, run_inline, write_config

REPOSITORY = Path(__file__).resolve().parent.parent


class FakeMetadata(BaseHTTPRequestHandler):
    """The two metadata endpoints, answering like the clouds do before and after a notice."""

    preempted = False
    requests: list[tuple[str, str, dict]] = []

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def _answer(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self) -> None:
        self.requests.append(("PUT", self.path, dict(self.headers)))
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self._answer(200, "token-123")
        else:
            self._answer(400, "bad token request")

    def do_GET(self) -> None:
        self.requests.append(("GET", self.path, dict(self.headers)))
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                self._answer(401, "")
            elif type(self).preempted:
                self._answer(200, json.dumps({"action": "terminate", "time": "2026-11-29T12:00:00Z"}))
            else:
                self._answer(404, "Not Found")
        elif self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                self._answer(403, "Missing Metadata-Flavor:Google header.")
            else:
                self._answer(200, "TRUE" if type(self).preempted else "FALSE")
        else:
            self._answer(404, "")


@pytest.fixture
def metadata_server():
    FakeMetadata.preempted, FakeMetadata.requests = False, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_notice_settings_are_read_from_the_environment():
    assert NoticeSource.from_env({}) is None
    assert NoticeSource.from_env({"SPOTSCHED_NOTICE": "none"}) is None
    aws = NoticeSource.from_env({"SPOTSCHED_NOTICE": "aws"})
    assert aws.location == "http://169.254.169.254" and aws.window_s == 120
    gcp = NoticeSource.from_env({"SPOTSCHED_NOTICE": "gcp", "SPOTSCHED_METADATA_URL": "http://127.0.0.1:9"})
    assert gcp.location == "http://127.0.0.1:9" and gcp.window_s == 30
    assert NoticeSource.from_env({"SPOTSCHED_NOTICE": "file:///tmp/notice"}) == NoticeSource("file", "/tmp/notice")
    odd = Path("/data/exp#1?v=2 %41/notice")  # what Path.as_uri() encodes comes back whole
    assert NoticeSource.from_env({"SPOTSCHED_NOTICE": odd.as_uri()}) == NoticeSource("file", str(odd))
    with pytest.raises(ValueError, match="SPOTSCHED_NOTICE='azure' is not one of aws, gcp"):
        NoticeSource.from_env({"SPOTSCHED_NOTICE": "azure"})


@pytest.mark.parametrize("kind", ["aws", "gcp"])
def test_the_watcher_polls_the_metadata_server_and_sets_the_flag_on_a_notice(metadata_server, kind):
    source = NoticeSource.from_env({"SPOTSCHED_NOTICE": kind, "SPOTSCHED_METADATA_URL": metadata_server})
    assert source.poll() is None  # no notice yet: 404 (aws) or FALSE (gcp)
    flag = StopFlag()
    watcher = NoticeWatcher(source, flag, interval_s=0.02).start()
    FakeMetadata.preempted = True
    watcher._thread.join(timeout=10)
    assert flag.is_set() and flag.reason.startswith(f"notice: {kind}")
    if kind == "aws":
        assert '"action": "terminate"' in flag.reason
        assert ("PUT", "/latest/api/token") in [(method, path) for method, path, _ in FakeMetadata.requests]


def test_the_file_notice_and_an_unreachable_server(tmp_path):
    notice = tmp_path / "notice"
    source = NoticeSource("file", str(notice))
    assert source.poll() is None
    notice.touch()
    assert source.poll() == f"notice file {notice}"

    errors: list[str] = []
    flag = StopFlag()
    unreachable = NoticeSource("gcp", "http://127.0.0.1:1")  # nothing listens on port 1
    watcher = NoticeWatcher(unreachable, flag, interval_s=0.01, on_error=errors.append).start()
    threading.Event().wait(0.3)
    watcher.stop()
    assert not flag.is_set()
    assert len(errors) == 1 and "preemption notice poll failed (gcp)" in errors[0]  # said once, kept polling


def test_a_gcp_notice_during_training_saves_an_emergency_checkpoint_and_exits_75(metadata_server, tmp_path):
    uri = tmp_path / "ckpt"
    from tests.runtime_support import when_progress

    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path / "cache")):
        when_progress(uri, lambda p: p["step"] >= 3, lambda: setattr(FakeMetadata, "preempted", True))
        # paced: the notice is polled about once a second, and a fast machine must not finish first
        config = write_config(tmp_path, samples_per_second_per_worker=16.0)
        code, events = run_inline(config, uri, SPOTSCHED_NOTICE="gcp",
                                  SPOTSCHED_METADATA_URL=metadata_server)
    assert code == 75
    preempted = events[-1]
    assert preempted["event"] == "preempted" and preempted["reason"] == "notice: gcp preempted"
    assert preempted["discarded_samples"] == 0  # a short step fits the 30 s window: it was finished
    progress = json.loads((uri / "progress.json").read_text())
    assert progress["status"] == "preempted" and progress["checkpoint"] == preempted["checkpoint"]
    assert progress["samples_done"] == preempted["samples_done"] < TINY_JOB["samples"]


def test_the_entry_point_process_exits_75_on_sigterm_and_prints_its_events(tmp_path):
    config = write_config(tmp_path, samples=100_000)
    env = {**os.environ, "SPOTSCHED_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPOSITORY)}
    env.pop("WORLD_SIZE", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_spotsched.runtime", "--config", str(config),
         "--checkpoint-uri", str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPOSITORY)
    lines = []
    for line in process.stdout:  # wait for training to be under way
        lines.append(line)
        if '"event": "step"' in line:
            break
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 75, err
    events = parse_events("".join(lines) + out)
    assert events[0]["event"] == "started" and events[-1]["event"] == "preempted"
    assert events[-1]["reason"] == "sigterm" and events[-1]["checkpoint"].startswith("ckpt-")


def test_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    code, events = run_inline(write_config(tmp_path, batch_size=0), tmp_path / "ckpt")
    assert code == 2 and events == []
    assert "batch_size must be >= 1, got 0" in capsys.readouterr().err
