"""Helpers for the runtime tests: run the entry point in-process or in forked workers, read its events."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from airflow_provider_spotsched.runtime.__main__ import main

# A tiny job of the builtin loop (runtime "loop": multi-worker, divergence guard, object-store
# checkpoints): 32-token samples, 8 per step at any world size in micro-batches of 4 (so one worker
# accumulates two), 20 steps; checkpoints every 0.2-0.5 s of training.
TINY_JOB: dict[str, Any] = {
    "runtime": "loop", "samples": 160, "global_batch_size": 8, "batch_size": 4, "seq_len": 32, "lr": 0.01, "seed": 3, "log_every_steps": 1,
    "checkpoint": {"keep": 3, "min_interval_s": 0.2, "max_interval_s": 0.5},
}


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def late_sigterm_ignored() -> Iterator[None]:
    """A SIGTERM that lands after the runtime restored the handler is dropped, not fatal to pytest."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_config(directory: Path, **overrides: Any) -> Path:
    path = directory / f"config-{len(list(directory.glob('config-*.json')))}.json"
    path.write_text(json.dumps({**TINY_JOB, **overrides}))
    return path


def parse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_inline(config: Path, uri: Path, **env: str | None) -> tuple[int, list[dict[str, Any]]]:
    """The entry point in this process (world size 1 unless env says otherwise): (exit code, events)."""
    out = io.StringIO()
    with environment(**{"WORLD_SIZE": None, "RANK": None, "SPOTSCHED_NOTICE": None, **env}):
        with contextlib.redirect_stdout(out):
            code = main(["--config", str(config), "--checkpoint-uri", str(uri)])
    return code, parse_events(out.getvalue())


def run_forked_workers(config: Path, uri: Path, world_size: int, log_dir: Path,
                       on_start: Callable[[list[int]], None] | None = None, **env: str) -> list[tuple[int, list]]:
    """``world_size`` workers as forked processes on loopback (gloo): per rank (exit code, events).

    ``on_start`` receives the workers' pids as soon as they run (to signal them).
    Forking shares this process's imported torch/transformers, saving each worker the seconds a
    fresh interpreter spends importing them; every worker still joins a real process group.
    """
    port = free_port()
    children = []
    for rank in range(world_size):
        log = log_dir / f"rank{rank}.log"
        pid = os.fork()
        if pid == 0:  # the worker: its stdout to a file, never back into the test
            code = 1
            try:
                with open(log, "w") as handle, contextlib.redirect_stdout(handle):
                    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port), **env})
                    code = main(["--config", str(config), "--checkpoint-uri", str(uri)])
            finally:
                os._exit(code)
        children.append((pid, log))
    if on_start:
        on_start([pid for pid, _ in children])
    results = []
    for pid, log in children:
        _, status = os.waitpid(pid, 0)
        results.append((os.waitstatus_to_exitcode(status), parse_events(log.read_text())))
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def when_progress(uri: Path, condition: Callable[[dict[str, Any]], bool], action: Callable[[], None],
                  timeout_s: float = 600.0) -> threading.Thread:
    """A thread that runs ``action`` once ``URI/progress.json`` satisfies ``condition``."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if condition(json.loads((uri / "progress.json").read_text())):
                    action()
                    return
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def step_losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def kill_tree(pid: int, timeout_s: float) -> None:
    """SIGKILL a process and all its descendants, as a vanished machine would (torchrun starts its
    workers in sessions of their own, so a process-group kill would miss them)."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=timeout_s)
