"""What the fault suite measures, and the pieces it builds runs from.

Every scenario ends with the same four checks, counted by :class:`Audit` from what the local
backend leaves in its job directory (``<workdir>/jobs/<job id>/``) and from a watcher of the
checkpoint, never from the code under test's own account:

- **leaked instances**: worker processes of the job still alive (``local_processes.marked``),
  plus instances the backend still reports pending or running;
- **double launches**: two workers alive at once for one instance, more workers alive at once
  than the job may run (``max_instances``), or a second job directory in the workdir (a retry
  that did not re-attach to the job id); the worker lifetimes come from the supervisor's
  ``events.jsonl`` (``launched`` ... ``exited``);
- **lost checkpoints**: the checkpointed ``samples_done`` going backwards, as sampled by
  :class:`ProgressWatch` for the whole run (``progress.json`` for the fake worker, whose
  progress file is its checkpoint; the newest valid checkpoint for the real runtime);
- **deadlines**: the job, feasible on N_max on-demand instances, completing by its deadline; the
  completion the run reports must not come before the job's observed end (rank 0's exit 0 in
  ``events.jsonl``, on the replay's clock), or a late look could pass a miss for a hit.

The figures of a run are handed to the session's :class:`Ledger` (tests/faults/conftest.py),
which prints them at the end and writes them as JSON for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.backends.base import InstanceState, TrainingJob
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_processes import marked
from airflow_provider_spotsched.market.trace import parse_instant
from airflow_provider_spotsched.scheduling.online import OnlineRun

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FAKE_WORKER = TESTS / "fake_worker.py"
CHAOS = os.environ.get("SPOTSCHED_CHAOS", "") not in ("", "0")
CHAOS_RUNS = int(os.environ.get("SPOTSCHED_CHAOS_RUNS", "3"))


def wait_for(check: Callable[[], Any], timeout_s: float = 60.0, what: str = "a condition", poll_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting for {what} after {timeout_s} s"
        time.sleep(poll_s)


# -- the task's state store, on disk ---------------------------------------------------------------


class FileStateStore:
    """``task_state_store`` with :class:`tests.task_context.TaskStateStore`'s semantics, in files.

    One JSON file per key, replaced atomically: several processes (tries of one task) share it,
    a reader sees the old value or the new one, and a process killed mid-write leaves the old.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return json.loads(self._path(key).read_text())
        except FileNotFoundError:
            return default

    def set(self, key: str, value: Any, retention: Any = None) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
        with os.fdopen(fd, "w") as handle:
            json.dump(value, handle)
        os.replace(tmp, self._path(key))


# -- the checks ------------------------------------------------------------------------------------


class ProgressWatch:
    """Samples the checkpointed work in a thread for the whole run; counts every step backwards.

    ``read`` returns the checkpointed ``samples_done`` now (``None``: nothing yet).
    """

    def __init__(self, read: Callable[[], float | None], poll_s: float = 0.02) -> None:
        self.read, self.poll_s = read, poll_s
        self.samples: list[float] = []
        self.regressions: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @classmethod
    def progress_file(cls, checkpoint: Path) -> ProgressWatch:
        def read() -> float | None:
            try:
                return float(json.loads((checkpoint / "progress.json").read_text())["samples_done"])
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                return None

        return cls(read)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.poll_s)

    def sample(self) -> None:
        value = self.read()
        if value is None:
            return
        if self.samples and value < self.samples[-1]:
            self.regressions.append((self.samples[-1], value))
        if not self.samples or value != self.samples[-1]:
            self.samples.append(value)

    def __enter__(self) -> ProgressWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def lost(self) -> int:
        return len(self.regressions)


@dataclass
class Figures:
    """One run's figures: what docs/reliability.md reports per scenario."""

    scenario: str
    run: str
    leaked_instances: int = 0
    double_launches: int = 0
    lost_checkpoints: int = 0
    deadline_feasible: bool = True
    deadline_met: bool | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Audit:
    """Reads a local job's directory: leaked instances and double launches (module docstring)."""

    def __init__(self, workdir: Path, job_id: str, max_instances: int) -> None:
        self.workdir, self.job_id, self.max_instances = Path(workdir), job_id, max_instances
        self.jobdir = self.workdir / "jobs" / job_id

    def backend(self) -> LocalBackend:
        return LocalBackend(self.workdir / "jobs")

    def job(self) -> TrainingJob:
        return TrainingJob.from_dict(json.loads((self.jobdir / "job.json").read_text()))

    def instance_ids(self) -> list[str]:
        state = json.loads((self.jobdir / "state.json").read_text())
        return [r["instance_id"] for r in state["instances"]]

    def leaked(self) -> int:
        processes = len(marked(str(self.jobdir)))
        live = (InstanceState.PENDING, InstanceState.RUNNING)
        reported = sum(1 for i in self.backend().status(self.job()).instances if i.state in live)
        return processes + reported

    def events(self) -> list[dict[str, Any]]:
        path = self.jobdir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def lifetimes(self) -> list[tuple[str, float, float]]:
        """(instance, launched, exited) of every worker; one still unreaped ends now."""
        open_: dict[str, float] = {}
        spans = []
        for event in self.events():
            if event["event"] == "launched":
                if event["instance_id"] in open_:  # launched again before its exit was seen
                    spans.append((event["instance_id"], open_[event["instance_id"]], float("inf")))
                open_[event["instance_id"]] = event["time"]
            elif event["event"] == "exited" and event["instance_id"] in open_:
                spans.append((event["instance_id"], open_.pop(event["instance_id"]), event["time"]))
        spans += [(instance, start, time.time()) for instance, start in open_.items()]
        return spans

    def double_launches(self) -> int:
        spans = self.lifetimes()
        overlaps = sum(
            1
            for i, (a, start_a, end_a) in enumerate(spans)
            for (b, start_b, end_b) in spans[i + 1 :]
            if a == b and start_a < end_b and start_b < end_a
        )
        moments = sorted([(start, 1) for _, start, _ in spans] + [(end, -1) for _, _, end in spans])
        alive = peak = 0
        for _, change in moments:
            alive += change
            peak = max(peak, alive)
        jobs = [d for d in (self.workdir / "jobs").iterdir() if (d / "job.json").exists()]
        return overlaps + max(peak - self.max_instances, 0) + (len(jobs) - 1)

    def launches(self) -> int:
        return sum(1 for e in self.events() if e["event"] == "launched")

    def observed_completion_hours(self) -> float | None:
        """When rank 0 exited 0 (as its supervisor saw it), in hours of the run's clock."""
        exits = [e["time"] for e in self.events() if e["event"] == "exited" and e.get("exit_code") == 0
                 and e.get("rank") == 0]
        if not exits:
            return None
        clock = json.loads((self.jobdir / "clock.json").read_text())
        return (min(exits) - clock["start"]) / clock["seconds_per_slot"] * clock["slot_hours"]

    def figures(self, scenario: str, run: str, watch: ProgressWatch | None, result: Mapping[str, Any] | None,
                deadline_feasible: bool = True, **notes: Any) -> Figures:
        return Figures(
            scenario=scenario,
            run=run,
            leaked_instances=self.leaked(),
            double_launches=self.double_launches(),
            lost_checkpoints=watch.lost if watch is not None else 0,
            deadline_feasible=deadline_feasible,
            deadline_met=None if result is None else bool(result["deadline_met"]),
            notes={"launches": self.launches(), "instances": len(self.instance_ids()),
                   "completion_hours": None if result is None else result["completion_hours"],
                   "observed_completion_hours": self.observed_completion_hours(), **notes},
        )


def feasible_at_measured_speed(run_state: Mapping[str, Any], regained: datetime | None = None) -> bool:
    """Whether N_max on-demand instances, one restart paid, could have met the soft deadline at
    the speed the workers really ran (the run's measured throughput), from slot 0 or, for a run
    whose scheduler was away, from the first record written at or after ``regained``.

    The fake workers run on wall-clock time: on a loaded machine they can fall below the planning
    model the deadline was set on, and the tries a scenario spawns after losing its first one can
    take many slots to start; a deadline no allocation could have met from when a scheduler could
    act again is not the scheduler's miss.
    """
    run = OnlineRun.from_state(run_state)
    job = run.config.job
    rate = job.rate(job.max_instances) * run.realised_throughput().factor
    hours, work_done = 0.0, 0.0
    if regained is not None:
        back = next((r for r in run.records if parse_instant(r.time, "time") >= regained), None)
        if back is None:
            return False
        hours, work_done = run.hours_at(parse_instant(back.time, "time")), back.work_done
    return (job.deadline_hours - hours - job.reconfig_overhead_hours) * rate >= job.work - work_done


def check_figures(figures: Figures) -> None:
    """The suite's four invariants on one run's figures."""
    assert figures.leaked_instances == 0, f"{figures.leaked_instances} instance(s) leaked: {figures}"
    assert figures.double_launches == 0, f"{figures.double_launches} double launch(es): {figures}"
    assert figures.lost_checkpoints == 0, f"checkpointed work went backwards: {figures}"
    if figures.deadline_feasible and figures.deadline_met is not None:
        assert figures.deadline_met, f"missed a deadline N_max on-demand could have met: {figures}"
    reported, observed = figures.notes.get("completion_hours"), figures.notes.get("observed_completion_hours")
    if reported is not None and observed is not None:
        assert reported >= observed - 1e-3, f"the run reports its end before the job ended: {figures}"


# -- the fake worker's job -------------------------------------------------------------------------


def worker_command(tmp_path: Path, samples: int, step_s: float = 0.05, **worker: Any) -> list[str]:
    """tests/fake_worker.py on a config of ``samples`` (``step_s`` a step per worker)."""
    config = tmp_path / "worker.json"
    config.write_text(json.dumps({"samples": samples, "step_s": step_s, **worker}))
    checkpoint = tmp_path / "checkpoint"
    return [sys.executable, str(FAKE_WORKER), "--config", str(config), "--checkpoint-uri", str(checkpoint)]


# -- processes -------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a helper process: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def spawn(*args: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """``python -m tests.faults.child ARGS`` in a process of its own, its output in ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.faults.child", *args],
            cwd=REPO, env=child_env(**env), stdout=out, stderr=subprocess.STDOUT,
        )


def finish(process: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> int:
    """Wait for a helper process; its exit code (its log is shown on a timeout)."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"helper process ran past {timeout_s} s; its log:\n{log.read_text()[-4000:]}") from None


@contextlib.contextmanager
def released_at_exit(workdir: Path) -> Iterator[None]:
    """Whatever a failed test leaves running under ``workdir`` is ended (and then counted as leaked)."""
    try:
        yield
    finally:
        jobs = workdir / "jobs"
        if jobs.exists():
            backend = LocalBackend(jobs, stop_timeout_s=5.0)
            for jobdir in jobs.iterdir():
                if (jobdir / "job.json").exists() and marked(str(jobdir)):
                    backend.release(TrainingJob.from_dict(json.loads((jobdir / "job.json").read_text())))


# -- the operator's job ----------------------------------------------------------------------------

STEP_S = 0.05  # a fake worker does 1 / STEP_S samples per second


def operator_kwargs(tmp_path: Path, samples: int, seconds_per_slot: float, trace: Path, policy: str = "greedy",
                    deferrable: bool = True, deadline: float | None = None, **overrides: Any) -> dict[str, Any]:
    """The operator's arguments (JSON, for a helper process too) for the fake worker's job.

    The planning model is 60% of what a fake worker does in a slot, so that the deadline the
    safety net plans for is one the workers can keep on a loaded machine; the default deadline
    leaves N_max on-demand instances 30% of slack.
    """
    from tests.faults.markets import MARKET_START, POOLS

    alpha = 0.6 * seconds_per_slot / STEP_S
    if deadline is None:
        deadline = float(math.ceil(samples / (2 * alpha) * 1.3 + 0.2))
    checkpoint = tmp_path / "checkpoint"
    fields: dict[str, Any] = dict(
        task_id="fine_tune",
        pools=list(POOLS),
        work=samples,
        deadline=deadline,
        hard_deadline_factor=1.5,
        throughput={"alpha": alpha},
        value=100.0,
        max_instances=2,
        reconfig_overhead_hours=0.2,
        command=worker_command(tmp_path, samples, STEP_S),
        checkpoint_uri=str(checkpoint),
        backend_options={"workdir": str(tmp_path / "local"), "trace": str(trace),
                         "seconds_per_slot": seconds_per_slot, "market_start": MARKET_START.isoformat()},
        policy=policy,
        forecaster="persistence",
        poll_interval=0.1,
        deferrable=deferrable,
    )
    fields.update(overrides)
    return fields


def task_spec(tmp_path: Path, name: str, kwargs: Mapping[str, Any], store: Path, try_number: int = 1) -> Path:
    """A helper process's spec: the operator, its state store, where its outcome goes."""
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"operator": kwargs, "store": str(store), "try_number": try_number,
                                "out": str(tmp_path / f"{name}.out.json")}))
    return spec


def outcome(tmp_path: Path, name: str) -> dict[str, Any] | None:
    path = tmp_path / f"{name}.out.json"
    return json.loads(path.read_text()) if path.exists() else None
