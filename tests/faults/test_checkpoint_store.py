"""Fault 6, the checkpoint store returning errors for a while.

The real training runtime (runtime/train.py, the tiny GPT-2 of tests/test_runtime_train.py) runs
in this process on a checkpoint URI whose filesystem (``flaky://``, an fsspec in-memory store)
refuses writes while an :class:`Outage` lasts, as an object store or a disk that is down. The
runtime must never lose the previous valid checkpoint, and either go on training and save again
later, or stop resumable (exit 75) and resume from that checkpoint:

- a periodic save refused (store down for a while): training goes on, the next save is tried
  when the next is due, the run finishes (exit 0);
- SIGTERM while the store refuses checkpoints, right after a checkpoint was saved: the emergency
  save is skipped (nothing new to save; re-saving the step would first invalidate it) and the
  runtime exits 75; the restart resumes from that checkpoint;
- the final save refused: tried again a few times, then exit 75 (the next start resumes and
  saves again).

The checkpointed work is sampled after every write and removal the store sees: the newest
checkpoint whose payload matches its manifest's checksum, read straight from the store (not
through the code under test). It must never go backwards.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

pytest.importorskip("torch")

import fsspec  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

from tests.faults.support import CHAOS_RUNS, Figures, ProgressWatch, check_figures  # noqa: E402
from tests.runtime_support import TINY_JOB, environment, late_sigterm_ignored, run_inline, write_config  # noqa: E402


class Outage:
    """Writes under the job's URI (``only``: those whose path holds it) fail once ``start`` said so.

    ``start(path, data)`` sees every successful write; once it returns True the next ``calls``
    writes (``None``: all of them) raise ``OSError(EIO)``; ``on_start`` runs at that moment.
    """

    def __init__(self, start: Callable[[str, bytes], bool], calls: int | None, only: str = "",
                 on_start: Callable[[], None] | None = None) -> None:
        self.start, self.left, self.only, self.on_start = start, calls, only, on_start
        self.failing = False
        self.raised = 0

    def before(self, path: str) -> None:
        if self.failing and self.only in path and (self.left is None or self.left > 0):
            self.raised += 1
            if self.left is not None:
                self.left -= 1
            raise OSError(errno.EIO, "checkpoint store unavailable (injected)", path)

    def after(self, path: str, data: bytes) -> None:
        if not self.failing and self.raised == 0 and self.start(path, data):
            self.failing = True
            if self.on_start is not None:
                self.on_start()


class FlakyFileSystem(MemoryFileSystem):
    """``flaky://``: fsspec's memory filesystem, whose writes an :class:`Outage` can refuse."""

    protocol = "flaky"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    outage: ClassVar[Outage | None] = None
    watch: ClassVar[ProgressWatch | None] = None

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str):
            path = path.removeprefix("flaky://")
        return super()._strip_protocol(path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if self.outage is not None:
            self.outage.before(path)
        super().pipe_file(path, value, mode, **kwargs)
        if self.outage is not None:
            self.outage.after(path, bytes(value))
        if self.watch is not None:
            self.watch.sample()

    def _open(self, path, mode="rb", **kwargs):
        if self.outage is not None and any(c in mode for c in "wax"):
            self.outage.before(path)
        return super()._open(path, mode, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        super().rm(path, recursive, maxdepth)
        if self.watch is not None:
            self.watch.sample()


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


def checkpointed(root: str) -> Callable[[], float | None]:
    """The samples of the newest valid checkpoint under ``root``, read from the store itself."""

    def read() -> float | None:
        store = FlakyFileSystem.store
        prefix = f"{root}/checkpoints/"
        best: tuple[int, float] | None = None
        for path in list(store):
            if not (path.startswith(prefix) and path.endswith("/manifest.json")):
                continue
            manifest = json.loads(store[path].getvalue())
            payload = store.get(path.rsplit("/", 1)[0] + "/" + manifest["payload"])
            if payload is None or hashlib.sha256(payload.getvalue()).hexdigest() != manifest["sha256"]:
                continue
            if best is None or manifest["step"] > best[0]:
                best = (manifest["step"], float(manifest["samples_done"]))
        return None if best is None else best[1]

    return read


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path_factory.mktemp("model-cache"))):
        yield


@pytest.fixture
def flaky():
    """A fresh ``flaky://`` job URI; the outage and the watch are the test's to set."""
    root = f"/job-{uuid.uuid4().hex[:8]}"
    watch = ProgressWatch(checkpointed(root))
    FlakyFileSystem.watch, FlakyFileSystem.outage = watch, None
    yield f"flaky://{root}", watch
    FlakyFileSystem.watch = FlakyFileSystem.outage = None
    for path in [p for p in FlakyFileSystem.store if p.startswith(root)]:
        del FlakyFileSystem.store[path]


def job_config(tmp_path):
    """tests/runtime_support.py's tiny job, slowed to about a second of training: several periodic checkpoints."""
    return write_config(tmp_path, fault_injection={"step_sleep_s": 0.06})


def nth_manifest(n: int) -> Callable[[str, bytes], bool]:
    seen = []

    def start(path: str, data: bytes) -> bool:
        if path.endswith("/manifest.json"):
            seen.append(path)
        return len(seen) >= n

    return start


def last_step_reported(path: str, data: bytes) -> bool:
    """The last step's report, written before the final save (its samples_done is the checkpointed work)."""
    if not path.endswith("/progress.json"):
        return False
    progress = json.loads(data)
    last_step = progress["samples_total"] // TINY_JOB["global_batch_size"]
    return progress["step"] >= last_step and progress["status"] == "running"


def record(ledger, run: str, watch: ProgressWatch, outage: Outage, codes: list[int], done: bool) -> None:
    figures = ledger.add(Figures("6 checkpoint store errors", run, lost_checkpoints=watch.lost, deadline_feasible=False,
                                 notes={"exit_codes": codes, "refused_writes": outage.raised, "finished": done}))
    check_figures(figures)
    assert outage.failing, "the outage began"


def test_refused_periodic_saves_do_not_stop_training(ledger, tmp_path, flaky):
    uri, watch = flaky
    outage = FlakyFileSystem.outage = Outage(nth_manifest(2), calls=12)  # the whole store, for a dozen writes
    code, events = run_inline(job_config(tmp_path), uri)
    record(ledger, "periodic saves refused", watch, outage, [code], code == 0)
    assert code == 0, events[-3:]
    assert any(e["event"] == "checkpoint_failed" for e in events), "the refused save was reported"
    assert events[-1]["event"] == "done" and events[-1]["samples_done"] == TINY_JOB["samples"]
    assert watch.samples[-1] == TINY_JOB["samples"], "the final checkpoint holds the whole job"


def test_sigterm_while_the_store_refuses_keeps_the_checkpoint_just_saved(ledger, tmp_path, flaky):
    uri, watch = flaky
    config = job_config(tmp_path)
    # the third checkpoint is saved; at that moment the store goes down for checkpoints and SIGTERM comes
    outage = FlakyFileSystem.outage = Outage(nth_manifest(3), calls=None, only="/checkpoints/",
                                             on_start=lambda: os.kill(os.getpid(), signal.SIGTERM))
    with late_sigterm_ignored():
        code, first = run_inline(config, uri)
    saved = watch.samples[-1]
    FlakyFileSystem.outage = None  # the store is back
    resumed_code, second = run_inline(config, uri)
    record(ledger, "SIGTERM while checkpoints are refused", watch, outage, [code, resumed_code], resumed_code == 0)
    assert code == 75, first[-3:]
    assert first[-1]["event"] == "preempted"
    assert second[0]["event"] == "resumed" and second[0]["samples_done"] == saved, "resumed from the checkpoint kept"
    assert resumed_code == 0 and second[-1]["samples_done"] == TINY_JOB["samples"]


@pytest.mark.parametrize("calls", [pytest.param(2, marks=pytest.mark.chaos), None], ids=["brief", "until-the-end"])
def test_a_refused_final_save_is_tried_again_or_left_resumable(ledger, tmp_path, flaky, calls, monkeypatch):
    monkeypatch.setattr("airflow_provider_spotsched.runtime.train.FINAL_SAVE_PAUSE_S", 0.05)
    uri, watch = flaky
    config = job_config(tmp_path)
    outage = FlakyFileSystem.outage = Outage(last_step_reported, calls=calls)
    code, events = run_inline(config, uri)
    codes = [code]
    if calls is None:
        assert code == 75, events[-3:]
        FlakyFileSystem.outage = None
        code, events = run_inline(config, uri)
        codes.append(code)
    record(ledger, f"final save refused ({'brief' if calls else 'until the end'})", watch, outage, codes, code == 0)
    assert code == 0 and events[-1]["event"] == "done", events[-3:]
    assert watch.samples[-1] == TINY_JOB["samples"]
    assert FlakyFileSystem.store.get(uri[len("flaky://"):] + "/final/adapter_config.json") is not None


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
@pytest.mark.parametrize("first", [1, 2, 4])
def test_chaos_refused_saves_at_every_point(ledger, tmp_path, flaky, first, seed):
    """The store down after the first, second or fourth checkpoint, for 2 to 2 + 4 * seed writes."""
    uri, watch = flaky
    outage = FlakyFileSystem.outage = Outage(nth_manifest(first), calls=2 + 4 * seed)
    code, events = run_inline(job_config(tmp_path), uri)
    codes = [code]
    while code == 75 and len(codes) < 4:  # stopped resumable: the backend restarts it
        code, events = run_inline(job_config(tmp_path), uri)
        codes.append(code)
    record(ledger, f"store down after checkpoint {first} for {2 + 4 * seed} writes", watch, outage, codes, code == 0)
    assert code == 0 and events[-1]["samples_done"] == TINY_JOB["samples"]
