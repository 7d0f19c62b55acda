"""The one interface every compute backend answers: bring the running instances to a target mix.

The scheduler decides *how many* spot instances per pool and on-demand instances the job should
run on (an :class:`~airflow_provider_spotsched.scheduling.model.Allocation`); a backend makes that
true on some infrastructure (local processes, EC2, Compute Engine). Every instance carries the
job's id (a tag or label), so that a retried or restarted caller re-attaches to what is running
instead of launching twice, and ``release`` can find everything the job ever started.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from airflow_provider_spotsched.market.launch import LaunchOutcome, LaunchRecorder
from airflow_provider_spotsched.scheduling.model import Allocation

log = logging.getLogger(__name__)

ON_DEMAND = "on-demand"
"""The pool name of on-demand instances in :class:`InstanceStatus` (spot pools keep their name)."""


class InstanceState(str, enum.Enum):
    """Where one instance of the job stands."""

    PENDING = "pending"  # asked for, not yet training
    RUNNING = "running"
    PREEMPTED = "preempted"  # taken back by the provider (spot interruption)
    FINISHED = "finished"  # the training command exited 0: the job's work is done
    FAILED = "failed"  # the training command or the instance failed
    RELEASED = "released"  # ended by us (scale-down or release)


class BackendError(RuntimeError):
    """A backend could not do what was asked; the message says what and how to fix it."""


class InsufficientCapacityError(BackendError):
    """The provider had fewer instances than asked for in ``pool``; the outcome is recorded."""

    def __init__(self, pool: str, requested: int, launched: int, detail: str = "") -> None:
        super().__init__(
            f"pool {pool!r}: asked for {requested} instance(s), got {launched}"
            + (f" ({detail})" if detail else "")
        )
        self.pool, self.requested, self.launched = pool, requested, launched

    @classmethod
    def from_shortfalls(cls, shortfalls: list[tuple[str, int, str]]) -> InsufficientCapacityError:
        """Nothing started: one error for every ``(pool, requested, reason)`` that came up short."""
        return cls(
            ", ".join(pool for pool, _, _ in shortfalls),
            sum(requested for _, requested, _ in shortfalls),
            0,
            "; ".join(f"{pool}: {reason}" for pool, _, reason in shortfalls),
        )


def record_launch(recorder: LaunchRecorder | None, pool: str, requested: int, launched: int, reason: str) -> None:
    """Log a launch that came up short and hand every outcome to ``recorder``."""
    if launched < requested:
        log.warning("pool %s: asked for %d instance(s), got %d (%s)", pool, requested, launched, reason)
    if recorder is not None:
        recorder(LaunchOutcome(datetime.now(timezone.utc), pool, requested, launched, reason))


def check_target(job: TrainingJob, target: Allocation) -> None:
    """Refuse a target that does not fit the job's pools or holds a negative count."""
    if len(target.spot) != len(job.pools) or target.on_demand < 0 or any(n < 0 for n in target.spot):
        raise ValueError(
            f"target {target} must hold one count >= 0 per pool of job.pools {list(job.pools)} and on_demand >= 0"
        )


@dataclass(frozen=True)
class TrainingJob:
    """What every instance of one job runs, and the id that ties the instances to the job.

    ``job_id`` must be stable across retries of the same job and unique to it within the cloud
    account (the operator draws it when the run starts and stores it with the run); ``command``
    is the training entry point with its arguments; ``checkpoint_uri`` is where the runtime saves
    and resumes (local path, s3:// or gs://).
    ``pools`` names the spot pools in the order of :attr:`Allocation.spot`.
    """

    job_id: str
    command: tuple[str, ...]
    checkpoint_uri: str
    pools: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.job_id or not all(c.isalnum() or c in "-_." for c in self.job_id) or set(self.job_id) == {"."}:
            raise ValueError(
                f"job_id {self.job_id!r} must be non-empty and use only letters, digits, '-', '_' and '.', not dots"
                " alone (it becomes a cloud tag or label, and a directory name)"
            )
        if not self.command:
            raise ValueError("command is empty: give the training entry point and its arguments")

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON: what a trigger, a task's saved state and a local job directory keep."""
        return {
            "job_id": self.job_id,
            "command": list(self.command),
            "checkpoint_uri": self.checkpoint_uri,
            "pools": list(self.pools),
            "env": dict(self.env),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingJob:
        return cls(
            job_id=data["job_id"],
            command=tuple(data["command"]),
            checkpoint_uri=data["checkpoint_uri"],
            pools=tuple(data["pools"]),
            env=dict(data.get("env") or {}),
        )


@dataclass(frozen=True)
class InstanceStatus:
    """One instance of the job: its provider id, its pool (or :data:`ON_DEMAND`) and its state.

    ``inferred`` marks a ``PREEMPTED`` the backend reads from an instance that ended without a
    result (a Compute Engine spot VM stopping, or gone, before its preemption operation shows), which a
    command that failed on an instance unable to tag itself looks like too; any other
    ``PREEMPTED`` is the cloud's own report, which a ``failed-<code>`` the command left as the
    shutdown ended it does not override.

    ``tagged_result`` is the result the instance tagged or labelled itself with (``done`` or
    ``failed-<code>``; "" for none, and on a backend with no tags): the run driver reads the result
    stored beside the log only where it is "", and must not guess it from ``detail``, free text
    that may hold anything (a state reason, a log tail).
    """

    instance_id: str
    pool: str
    state: InstanceState
    detail: str = ""
    inferred: bool = False
    tagged_result: str = ""

    @property
    def spot(self) -> bool:
        return self.pool != ON_DEMAND


@dataclass(frozen=True)
class JobStatus:
    """Every instance the backend knows for the job, with the counts the scheduler reasons in."""

    job_id: str
    instances: tuple[InstanceStatus, ...]

    def count(self, state: InstanceState, pool: str | None = None) -> int:
        return sum(1 for i in self.instances if i.state is state and (pool is None or i.pool == pool))

    def active(self, pools: tuple[str, ...]) -> Allocation:
        """The allocation now pending or running, in the order of ``pools``."""
        live = (InstanceState.PENDING, InstanceState.RUNNING)
        spot = tuple(sum(1 for i in self.instances if i.pool == p and i.state in live) for p in pools)
        od = sum(1 for i in self.instances if i.pool == ON_DEMAND and i.state in live)
        return Allocation(spot, od)

    @property
    def finished(self) -> bool:
        return any(i.state is InstanceState.FINISHED for i in self.instances)

    @property
    def failed(self) -> bool:
        return any(i.state is InstanceState.FAILED for i in self.instances)

    @property
    def preemptions(self) -> int:
        return self.count(InstanceState.PREEMPTED)

    @property
    def preemptions_by_pool(self) -> dict[str, int]:
        """Preempted instances per pool (pools with none left out)."""
        counts: dict[str, int] = {}
        for i in self.instances:
            if i.state is InstanceState.PREEMPTED:
                counts[i.pool] = counts.get(i.pool, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "instances": [
                {"instance_id": i.instance_id, "pool": i.pool, "state": i.state.value, "detail": i.detail}
                for i in self.instances
            ],
        }


class ComputeBackend(ABC):
    """Runs a :class:`TrainingJob` on a target mix of spot and on-demand instances.

    All three calls are idempotent: ``reconcile`` with the allocation already in place launches
    and ends nothing; ``release`` of a released job does nothing. None of them ever leaves an
    instance running that no later call can find (the job id is on every instance).

    :meth:`turn` lets the callers of one job take turns (two tries of one task running at once).
    """

    name: str = "backend"

    @abstractmethod
    def reconcile(self, job: TrainingJob, target: Allocation) -> JobStatus:
        """Launch or end instances until the job runs ``target``; return the status after.

        Spot pools short of capacity launch what they can and record the shortfall (an
        :class:`InsufficientCapacityError` is raised only when nothing at all could start).
        A change of the instance count restarts training from the latest checkpoint.
        """

    @abstractmethod
    def status(self, job: TrainingJob) -> JobStatus:
        """Every instance carrying the job's id, with its state now."""

    @abstractmethod
    def release(self, job: TrainingJob) -> None:
        """End every instance of the job; safe to call again, after a crash, or on a job never launched."""

    def check_job(self, job: TrainingJob) -> None:
        """Refuse a job this backend could never run (a pool it cannot place, a start-up script it
        would refuse), before anything is stored or launched; the default has nothing to check."""
        return None

    def instance_limit(self) -> int | None:
        """The most instances the account may run on demand at once, where the provider says
        (``None``: unknown). The spec's feasibility counts on ``max_instances`` on-demand
        instances, so a job above it is refused before anything launches."""
        return None

    @contextlib.contextmanager
    def turn(self, job: TrainingJob) -> Iterator[None]:
        """Hold the job's turn: while one caller (a process driving the job) holds it, others wait.

        The run driver holds it for each step (read the stored run, decide, persist, reconcile),
        so that two callers of one job never decide the same slot twice. A backend that can
        lock across the callers' machines overrides it; the default excludes nobody (the cloud
        backends: their callers may run anywhere).
        """
        yield
