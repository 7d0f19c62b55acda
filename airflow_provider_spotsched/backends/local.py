"""The embedded default backend: workers are local processes, spot capacity follows a replayed market.

Each instance is one worker process running :attr:`TrainingJob.command`. Spot pools obey a
:class:`~.market_clock.MarketClock` (a shipped trace replayed at ``seconds_per_slot`` of wall time
per slot): a launch gets at most the pool's availability now, and when availability drops below
the running count the excess workers get a notice, then SIGTERM, and end PREEMPTED.

The caller may be gone between calls (an Airflow operator defers between slots), so the workers
belong to a detached supervisor process per job (:mod:`.local_supervisor`) and every call works
through the job directory ``<workdir>/<job_id>/`` (:mod:`.local_jobdir`): a new ``LocalBackend``
on the same workdir re-attaches to what runs, a dead supervisor is replaced by the next
``reconcile``, and ``release`` ends every process on record or carrying the job's marker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    ComputeBackend,
    InstanceState,
    InstanceStatus,
    InsufficientCapacityError,
    JobStatus,
    TrainingJob,
    check_target,
)
from airflow_provider_spotsched.backends.local_jobdir import JobDir, JobState, read_json, write_json
from airflow_provider_spotsched.backends.local_processes import (
    JOB_ID_MARKER,
    JOBDIR_MARKER,
    create_time,
    end_all,
    is_alive,
    marked,
    signal_group,
    wait_gone,
)
from airflow_provider_spotsched.backends.local_supervisor import preempt_beyond_capacity
from airflow_provider_spotsched.backends.market_clock import AWS_NOTICE_SECONDS, MarketClock
from airflow_provider_spotsched.market.launch import LaunchOutcome, LaunchRecorder
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation

INSUFFICIENT_CAPACITY = "InsufficientCapacity"


class LocalBackend(ComputeBackend):
    """Local worker processes on a replayed spot market (see the module docstring).

    ``market`` defaults to the shipped GCP trace in 1-hour slots; ``notice_seconds`` defaults to
    ``provider_notice_seconds`` (AWS's 120 s) divided by the clock's speed-up. A job keeps the
    clock of its first ``reconcile``: a re-attaching backend replays the same market from the
    same start whatever it was given. ``stop_timeout_s`` bounds a worker's emergency checkpoint
    before SIGKILL.
    """

    name = "local"

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        market: SlotMarket | None = None,
        seconds_per_slot: float = 2.0,
        notice_seconds: float | None = None,
        provider_notice_seconds: float = AWS_NOTICE_SECONDS,
        launch_recorder: LaunchRecorder | None = None,
        stop_timeout_s: float = 120.0,
        poll_interval_s: float = 0.2,
    ) -> None:
        if not seconds_per_slot > 0:
            raise ValueError(f"seconds_per_slot must be > 0 (wall seconds per market slot), got {seconds_per_slot!r}")
        if notice_seconds is not None and not notice_seconds >= 0:
            raise ValueError(f"notice_seconds must be >= 0 or None (the provider's, sped up), got {notice_seconds!r}")
        if not stop_timeout_s > 0 or not poll_interval_s > 0:
            raise ValueError(
                f"stop_timeout_s and poll_interval_s must be > 0, got {stop_timeout_s!r} and {poll_interval_s!r}"
            )
        self.workdir = Path(workdir).absolute()
        self.market = market
        self.seconds_per_slot = float(seconds_per_slot)
        self.notice_seconds = notice_seconds
        self.provider_notice_seconds = provider_notice_seconds
        self.launch_recorder = launch_recorder
        self.stop_timeout_s = float(stop_timeout_s)
        self.poll_interval_s = float(poll_interval_s)

    # -- the interface -----------------------------------------------------------------------

    def reconcile(self, job: TrainingJob, target: Allocation) -> JobStatus:
        check_target(job, target)
        jobdir = self.jobdir(job)
        with jobdir.lock():
            state = self._open(jobdir, job)
            if state.outcome == "finished":
                return self._status(jobdir, job)
            state.outcome = None  # a reconcile after a failure is a retry
            clock = MarketClock.from_dict(read_json(jobdir.clock_file))
            now = time.time()
            preempt_beyond_capacity(jobdir, state, clock, now)  # before the supervisor, if it has not looked yet
            wanted = {pool: min(count, clock.capacity(pool, now)) for pool, count in zip(job.pools, target.spot)}
            wanted[ON_DEMAND] = target.on_demand
            outcomes = []
            for pool, count in zip(job.pools, target.spot):
                asked, got = count - len(state.live(pool)), wanted[pool] - len(state.live(pool))
                if asked > 0:
                    reason = INSUFFICIENT_CAPACITY if got < asked else ""
                    when = datetime.fromtimestamp(now, timezone.utc)
                    outcomes.append(LaunchOutcome(when, pool, asked, max(got, 0), reason))
            if self._resize(state, wanted):
                state.generation += 1
            if state.live() or state.with_process():
                self._ensure_supervisor(jobdir, state)
            jobdir.save(state)
        for outcome in outcomes:
            if self.launch_recorder is not None:
                self.launch_recorder(outcome)
        if target.total > 0 and not any(wanted.values()):
            short = [(pool, count) for pool, count in zip(job.pools, target.spot) if count > 0]
            raise InsufficientCapacityError(
                short[0][0],
                short[0][1],
                0,
                f"slot {clock.slot(now)} of the replayed market has no spot capacity in "
                + ", ".join(f"{pool} (asked {count})" for pool, count in short),
            )
        return self._status(jobdir, job)

    def status(self, job: TrainingJob) -> JobStatus:
        jobdir = self.jobdir(job)
        if not jobdir.exists:
            return JobStatus(job.job_id, ())
        return self._status(jobdir, job)

    def release(self, job: TrainingJob) -> None:
        jobdir = self.jobdir(job)
        if not jobdir.exists:
            return
        with jobdir.lock():
            state = jobdir.load() or JobState()
            for record in state.live():
                record.stop_reason, record.detail = "released", "released"
            state.generation += 1
            supervisor = dict(state.supervisor)
            jobdir.save(state)
        if supervisor_running(supervisor):
            wait_gone(supervisor["pid"], supervisor["started"], self.stop_timeout_s + 10 * self.poll_interval_s + 5)
        with jobdir.lock():
            state = jobdir.load() or JobState()
            if supervisor_running(state.supervisor):  # hung: it cannot be trusted with its workers
                signal_group(state.supervisor["pid"], state.supervisor["started"], signal.SIGKILL)
            self._end_orphans(state)
            end_all(marked(str(jobdir.path)), self.stop_timeout_s)
            if state.supervisor:
                state.supervisor["exited"] = True
            jobdir.save(state)

    @contextlib.contextmanager
    def turn(self, job: TrainingJob) -> Iterator[None]:
        """An ``flock`` on ``<job dir>/turn.lock``: callers on this machine take turns (the supervisor never takes it)."""
        with self.jobdir(job).lock(self.jobdir(job).turn_file):
            yield

    # -- helpers -----------------------------------------------------------------------------

    def jobdir(self, job: TrainingJob) -> JobDir:
        return JobDir(self.workdir / job.job_id)

    def supervisor_running(self, job: TrainingJob) -> bool:
        """Whether the job's supervisor process is alive (False for a job never launched)."""
        state = self.jobdir(job).load()
        return state is not None and supervisor_running(state.supervisor)

    def clock_start(self, job: TrainingJob) -> float | None:
        """When slot 0 of ``job``'s replay began (epoch seconds), or ``None`` before its first launch."""
        clock_file = self.jobdir(job).clock_file
        return MarketClock.from_dict(read_json(clock_file)).start if clock_file.exists() else None

    def _open(self, jobdir: JobDir, job: TrainingJob) -> JobState:
        """The job's state; on the first call, its directory, spec and market clock."""
        spec = job.to_dict()
        if jobdir.exists:
            stored = read_json(jobdir.job_file)
            if stored != spec:
                changed = sorted(k for k in spec if stored.get(k) != spec[k])
                raise BackendError(
                    f"job {job.job_id!r} already exists in {jobdir.path} with different {changed}: "
                    "a retry must describe the same job; release it or use a new job_id"
                )
            return jobdir.load() or JobState()
        clock = self._clock()
        missing = [p for p in job.pools if p not in clock.pools]
        if missing:
            raise ValueError(f"job.pools {missing} are not in the replayed market; its pools are {list(clock.pools)}")
        jobdir.create()
        write_json(jobdir.clock_file, clock.to_dict())
        state = JobState()
        jobdir.save(state)
        write_json(jobdir.job_file, spec)  # last: its presence means the directory is complete
        return state

    def _clock(self) -> MarketClock:
        market = self.market
        if market is None:
            from airflow_provider_spotsched import GCP_TRACE
            from airflow_provider_spotsched.market.slots import resample
            from airflow_provider_spotsched.market.trace import load_trace

            market = self.market = resample(load_trace(GCP_TRACE), slot_hours=1.0)
        return MarketClock.replay(
            market,
            self.seconds_per_slot,
            notice_seconds=self.notice_seconds,
            provider_notice_seconds=self.provider_notice_seconds,
        )

    @staticmethod
    def _resize(state: JobState, wanted: dict[str, int]) -> bool:
        """Add or mark for release instances until each pool has its wanted count; True if any changed."""
        changed = False
        for pool, count in wanted.items():
            live = state.live(pool)
            for record in sorted(live, key=lambda r: (r.pid is not None, -(r.rank or 0)))[: max(len(live) - count, 0)]:
                record.stop_reason, record.detail = "released", "scaled down"
                changed = True
            for _ in range(count - len(live)):
                state.new_instance(pool)
                changed = True
        return changed

    def _ensure_supervisor(self, jobdir: JobDir, state: JobState) -> None:
        """Start the job's supervisor unless it runs (called under the job's lock)."""
        if supervisor_running(state.supervisor):
            return
        env = dict(os.environ)
        env.update({JOB_ID_MARKER: jobdir.path.name, JOBDIR_MARKER: str(jobdir.path)})
        with open(jobdir.supervisor_log, "ab") as log:
            starter = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "airflow_provider_spotsched.backends.local_supervisor",
                    str(jobdir.path),
                    "--poll-s",
                    str(self.poll_interval_s),
                    "--stop-timeout-s",
                    str(self.stop_timeout_s),
                    "--detach",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                timeout=60,
            )
        if starter.returncode != 0 or not starter.stdout.strip().isdigit():
            raise BackendError(f"could not start the supervisor of {jobdir.path.name}; see {jobdir.supervisor_log}")
        pid = int(starter.stdout.strip())
        state.supervisor = {"pid": pid, "started": create_time(pid), "exited": False}

    def _end_orphans(self, state: JobState) -> None:
        """End every worker on record (supervisor dead): SIGTERM, then SIGKILL after the stop timeout."""
        for record in state.with_process():
            signal_group(record.worker_pid, record.started, signal.SIGTERM)
        for record in state.with_process():
            if not wait_gone(record.worker_pid, record.started, self.stop_timeout_s):
                signal_group(record.worker_pid, record.started, signal.SIGKILL)
                wait_gone(record.worker_pid, record.started, 5.0)
            record.pid = record.started = None
        for record in state.instances:
            if record.state in (InstanceState.PENDING.value, InstanceState.RUNNING.value):
                preempted = record.stop_reason == "preempted"
                record.state = (InstanceState.PREEMPTED if preempted else InstanceState.RELEASED).value

    def _status(self, jobdir: JobDir, job: TrainingJob) -> JobStatus:
        state = jobdir.load() or JobState()
        supervisor = state.supervisor
        down = ""
        if state.live() and not supervisor_running(supervisor):
            why = supervisor.get("error") or f"supervisor (pid {supervisor.get('pid')}) is not running"
            down = f"; {why}: reconcile() restarts it, release() ends the workers"
        return JobStatus(
            job.job_id,
            tuple(
                InstanceStatus(r.instance_id, r.pool, InstanceState(r.state), r.detail + (down if r.live else ""))
                for r in state.instances
            ),
        )


def supervisor_running(supervisor: dict) -> bool:
    """Whether the supervisor on record is alive and has not declared itself done."""
    if not supervisor or supervisor.get("exited"):
        return False
    return is_alive(supervisor.get("pid"), supervisor.get("started"))
