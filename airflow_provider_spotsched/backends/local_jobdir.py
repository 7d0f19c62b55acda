"""The local backend's record of one job: a directory that outlives every process touching it.

The caller of :class:`~airflow_provider_spotsched.backends.local.LocalBackend` defers between
slots, so no Python object survives from one call to the next. Everything the backend and its
supervisor process know about a job lives in ``<workdir>/<job_id>/``: ``job.json`` and
``clock.json`` (written once), ``state.json`` (the instances, rewritten atomically), ``lock``
(``fcntl.flock`` around every read-modify-write), ``turn.lock`` (held by a caller for one step
of its run, see :meth:`~airflow_provider_spotsched.backends.base.ComputeBackend.turn`), ``events.jsonl`` (what the supervisor did to
each worker, when), the workers' logs and their notice files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.backends.base import InstanceState

LIVE_STATES = (InstanceState.PENDING.value, InstanceState.RUNNING.value)


@dataclass
class WorkerRecord:
    """One instance: its pool, state and, while one runs, its worker process.

    ``generation`` is the worker set the process was started for; ``stop_reason`` ("preempted",
    "released" or "finished") marks an instance on its way out, and ``signalled_at`` the moment
    the backend sent its process SIGTERM (so that exit 75 reads as a stop, not a failure).
    ``pid`` stays set after the worker process exited (``exited_at``) while any process marked as
    its instance still runs: the children of a wrapper or launcher that exited before them.
    """

    instance_id: str
    pool: str
    state: str = InstanceState.PENDING.value
    detail: str = ""
    rank: int | None = None
    pid: int | None = None
    started: float | None = None  # the process's start (local_processes.create_time): a recycled pid is not ours
    generation: int = -1
    stop_reason: str | None = None
    notice_at: float | None = None
    term_at: float | None = None
    signalled_at: float | None = None
    killed: bool = False
    exit_code: int | None = None
    launched_at: float | None = None  # wall times of the current (or last) worker's start and exit
    exited_at: float | None = None
    log: str = ""

    @property
    def live(self) -> bool:
        """Wanted in the worker set: pending or running and not on its way out."""
        return self.state in LIVE_STATES and self.stop_reason is None

    @property
    def worker_pid(self) -> int:
        """The pid of the worker process, for a record that :meth:`JobState.with_process` returned."""
        if self.pid is None:
            raise RuntimeError(f"instance {self.instance_id} has no worker process to signal")
        return self.pid


@dataclass
class JobState:
    """What changes while a job runs: the instances and which worker set is wanted and running.

    ``generation`` counts changes of the wanted worker set; the supervisor restarts every worker
    whenever it differs from ``running_generation``. ``outcome`` is "finished" or "failed" once
    the job ended that way; ``supervisor`` holds the supervisor's pid and create time.
    """

    generation: int = 0
    running_generation: int = 0
    next_seq: int = 0
    outcome: str | None = None
    instances: list[WorkerRecord] = field(default_factory=list)
    supervisor: dict[str, Any] = field(default_factory=dict)

    def live(self, pool: str | None = None) -> list[WorkerRecord]:
        return [r for r in self.instances if r.live and (pool is None or r.pool == pool)]

    def with_process(self) -> list[WorkerRecord]:
        return [r for r in self.instances if r.pid is not None]

    def new_instance(self, pool: str) -> WorkerRecord:
        record = WorkerRecord(instance_id=f"local-{self.next_seq:04d}", pool=pool)
        self.next_seq += 1
        self.instances.append(record)
        return record

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobState:
        fields = dict(data)
        fields["instances"] = [WorkerRecord(**r) for r in data.get("instances", [])]
        return cls(**fields)


class JobDir:
    """The files of one job under ``<workdir>/<job_id>/``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).absolute()
        self.job_file = self.path / "job.json"
        self.clock_file = self.path / "clock.json"
        self.state_file = self.path / "state.json"
        self.lock_file = self.path / "lock"
        self.turn_file = self.path / "turn.lock"
        self.logs = self.path / "logs"
        self.notices = self.path / "notices"
        self.supervisor_log = self.path / "supervisor.log"
        self.events = self.path / "events.jsonl"

    @property
    def exists(self) -> bool:
        return self.job_file.exists()

    def create(self) -> None:
        for folder in (self.path, self.logs, self.notices):
            folder.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lock(self, path: Path | None = None) -> Iterator[None]:
        """Exclusive access for one read-modify-write, across processes (``path``: another lock file of the job)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(path or self.lock_file, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def load(self) -> JobState | None:
        if not self.state_file.exists():
            return None
        return JobState.from_dict(read_json(self.state_file))

    def save(self, state: JobState) -> None:
        write_json(self.state_file, state.to_dict())

    def log_stem(self, record: WorkerRecord, generation: int) -> Path:
        return self.logs / f"{record.instance_id}.g{generation}"

    def notice_file(self, record: WorkerRecord, generation: int) -> Path:
        return self.notices / f"{record.instance_id}.g{generation}"

    def log_event(self, kind: str, record: WorkerRecord, **fields: Any) -> None:
        """Append what was done to a worker to ``events.jsonl``: the job's timeline, for people and the benchmark."""
        line = {"time": time.time(), "event": kind, "instance_id": record.instance_id, "pool": record.pool,
                "generation": record.generation, "rank": record.rank, **fields}
        with open(self.events, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def read_json(path: Path) -> Any:
    with open(path) as handle:
        return json.load(handle)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` so that a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def tail(path: Path, limit: int = 2000) -> str:
    """The last ``limit`` characters of a log file (empty when there is none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - limit))
            return handle.read().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return ""
