"""The reconcile every cloud backend runs, written once over the few calls each cloud makes its own way.

EC2 and Compute Engine bring a job to its target alike: list the instances carrying the job's
id; if the work is done, stop; end the newest instances of every pool above its count (a pool
the job no longer names goes to 0); launch every pool's deficit as a new generation running the
start-up script (:mod:`.bootstrap`), recording each launch request's outcome; then publish the
rendezvous for the instances that live on. A pool short of capacity launches what it can; only
when nothing at all runs or started is that an :class:`~.base.InsufficientCapacityError`.

An instance still pending ``pending_timeout_s`` after its launch (a zone that accepted the request
but has no capacity to start it) is ended first and its pool reported short, as a launch refused
for lack of capacity is: left alone it would count as capacity the job has, in the rendezvous, the
applied allocation and the bill, and hold its pool's place for good.

A subclass says how its cloud lists, ends and launches instances, which are live, which pool an
instance is in (its tag or label: the *pool key*) and how the rendezvous is published.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    ComputeBackend,
    InsufficientCapacityError,
    JobStatus,
    TrainingJob,
    check_target,
    record_launch,
)
from airflow_provider_spotsched.backends.bootstrap import Provider, startup_script
from airflow_provider_spotsched.market.launch import LaunchRecorder
from airflow_provider_spotsched.scheduling.model import Allocation, JobError

log = logging.getLogger(__name__)

Instance = TypeVar("Instance")
"""What the cloud's list call gives for one instance of the job."""

Launched = TypeVar("Launched")
"""What a launch gives for one started instance (the instance itself, or only its name)."""

Shortfall = tuple[str, int, str]
"""``(pool, instances missing, reason)`` of a launch that came up short."""

DEFAULT_PENDING_TIMEOUT_S = 900.0
"""How long a launched instance may stay pending before it is released: GPU instances start within
a few minutes; one still waiting after 15 was accepted by a zone that has nothing to start it on."""
MIN_PENDING_TIMEOUT_S = 60.0
"""Below this, instances that are merely booting would be released at the next reconcile."""
PENDING_TIMEOUT = "PendingTimeout"
"""The launch outcome's reason for instances released because they stayed pending too long."""


def utc_now() -> datetime:
    """The clock a pending instance's wait is measured against (the cloud's timestamps are UTC-aware)."""
    return datetime.now(timezone.utc)


def check_checkpoint_reachable(checkpoint_uri: str, backend: str) -> None:
    """Refuse a checkpoint URI on this machine's own disk (a plain path, ``file://``, ``local://``:
    fsspec's local filesystem, the last of a chain such as ``simplecache::file://``): a cloud
    backend's instances run on other machines, so each would train from scratch, the run would
    never read their progress, and a preemption would lose the work. A scheme in capitals
    (``S3://``) is refused too: Airflow's storage reads it, but fsspec and the start-up script on
    the instances do not."""
    protocol = fsspec.core.split_protocol(checkpoint_uri)[0] or "file"
    if protocol != protocol.lower():
        raise JobError(
            f"checkpoint_uri={checkpoint_uri!r}: the scheme {protocol!r} in capitals, which the {backend} instances' "
            f"tools do not read; write it in lower case ({protocol.lower()}://...)"
        )
    if protocol.split("::")[-1] in LocalFileSystem.protocol:
        raise JobError(
            f"checkpoint_uri={checkpoint_uri!r}: a path on this machine, which the {backend} instances cannot reach "
            "(each would start from scratch and a preemption would lose the work); give an object store they can "
            "reach (s3://BUCKET/PREFIX or gs://BUCKET/PREFIX), or use backend='local'"
        )


class CloudBackend(ComputeBackend, Generic[Instance, Launched]):
    """A backend on a cloud: the reconcile of the module docstring over the primitives below.

    ``poll_seconds`` is how often the start-up script polls for a rendezvous; ``recorder``
    receives every launch request's outcome; ``pending_timeout_s`` is how long an instance may
    stay pending after its launch before a reconcile releases it (the module docstring);
    ``clock`` gives the time it is measured against (tests pass a fake one).
    """

    provider: Provider

    def __init__(
        self,
        *,
        poll_seconds: int,
        recorder: LaunchRecorder | None,
        pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        if (
            isinstance(pending_timeout_s, bool)
            or not isinstance(pending_timeout_s, (int, float))
            or not MIN_PENDING_TIMEOUT_S <= pending_timeout_s < float("inf")
        ):
            raise ValueError(
                f"pending_timeout_s must be a number of seconds >= {MIN_PENDING_TIMEOUT_S:g} (how long a launched "
                f"instance may stay pending before it is released and its pool counted short), got "
                f"{pending_timeout_s!r}; leave it out for the default {DEFAULT_PENDING_TIMEOUT_S:g}"
            )
        self.poll_seconds = poll_seconds
        self.recorder = recorder
        self.pending_timeout_s = float(pending_timeout_s)
        self.clock = clock

    # -- ComputeBackend -------------------------------------------------------------------------

    def status(self, job: TrainingJob) -> JobStatus:
        return self._status(job, self._list(job))

    def check_job(self, job: TrainingJob) -> None:
        """A checkpoint URI the instances can reach, every pool placeable and the start-up script one
        the backend would send (no credential, a secret as a reference, within the size limit), as the
        first launch would check them."""
        check_checkpoint_reachable(job.checkpoint_uri, self.name)
        self._check(job, Allocation((1,) * len(job.pools), 1))
        startup_script(job, self.provider, poll_seconds=self.poll_seconds)

    def reconcile(self, job: TrainingJob, target: Allocation) -> JobStatus:
        check_target(job, target)
        self._check(job, target)
        instances = self._list(job)
        before = self._status(job, instances)
        if before.finished:
            return before  # the work is done: nothing to launch
        self._finish_releases(instances)
        stuck = self._release_stuck(job, [i for i in instances if self._live(i)])
        live = [i for i in instances if self._live(i)]
        wanted = dict(zip(self._pool_keys(job), (*target.spot, target.on_demand)))
        for key in set(wanted) | {self._pool_key(i) for i in live}:  # a pool the job no longer names goes to 0
            count = wanted.get(key, 0)
            mine = sorted((i for i in live if self._pool_key(i) == key), key=self._oldest_first)
            if len(mine) > count:
                self._terminate(mine[count:])  # the newest go first
        survivors = [i for i in live if self._live(i)]
        launched, shortfalls = self._launch_deficits(job, wanted, survivors, instances, stuck)
        if shortfalls and not survivors and not launched:
            raise InsufficientCapacityError.from_shortfalls(shortfalls)
        known = self._with_launched(job, instances, launched)
        self._rendezvous([i for i in known if self._live(i)], known)
        return self._status(job, known)

    def _release_stuck(self, job: TrainingJob, live: list[Instance]) -> set[str]:
        """End the live instances pending for longer than ``pending_timeout_s``; return their pool keys.

        Each such pool's outcome is recorded as a launch that came up short (asked for the pool's
        live instances, got those that started), the evidence a capacity error leaves: the
        scheduler's next decisions read the pool as short and can run that capacity elsewhere.
        The instances end as released, not preempted: no work ran on them to lose.
        """
        now = self.clock()
        stuck = [
            i for i in live
            if (since := self._pending_since(i)) is not None and (now - since).total_seconds() > self.pending_timeout_s
        ]
        if not stuck:
            return set()
        pools = self._pool_names(job)
        keys = {self._pool_key(i) for i in stuck}
        log.warning(
            "releasing %d instance(s) of %s still pending more than pending_timeout_s=%g s after their launch",
            len(stuck), sorted(pools.get(k, k) for k in keys), self.pending_timeout_s,
        )
        self._terminate(stuck)
        for key in sorted(keys):
            held = sum(1 for i in live if self._pool_key(i) == key)
            started = held - sum(1 for i in stuck if self._pool_key(i) == key)
            record_launch(self.recorder, pools.get(key, key), held, started, PENDING_TIMEOUT)
        return keys

    def _launch_deficits(
        self,
        job: TrainingJob,
        wanted: Mapping[str, int],
        survivors: list[Instance],
        known: list[Instance],
        stuck: set[str],
    ) -> tuple[list[Launched], list[Shortfall]]:
        """Launch every pool's deficit, recording each request; return what started and the shortfalls.

        A pool in ``stuck`` (pool keys whose instances stayed pending too long) launches nothing in
        this call, as after a capacity error: asking it again now would most likely wait as long.
        """
        deficits = {k: n - sum(1 for i in survivors if self._pool_key(i) == k) for k, n in wanted.items()}
        deficits = {k: d for k, d in deficits.items() if d > 0}
        if not deficits:
            return [], []
        pools = self._pool_names(job)
        generation = self._next_generation(job, known)
        script = startup_script(job, self.provider, poll_seconds=self.poll_seconds)
        launched: list[Launched] = []
        shortfalls: list[Shortfall] = [(pools[k], n, PENDING_TIMEOUT) for k, n in deficits.items() if k in stuck]
        for key, count in deficits.items():
            if key in stuck:
                continue  # its outcome was recorded when its instances were released
            new, reason = self._launch(job, key, count, generation, script)
            launched += new
            record_launch(self.recorder, pools[key], count, len(new), reason)
            if len(new) < count:
                shortfalls.append((pools[key], count - len(new), reason))
        return launched, shortfalls

    def _pool_names(self, job: TrainingJob) -> dict[str, str]:
        """Pool key -> the pool's name in the job (:data:`~.base.ON_DEMAND` for on-demand)."""
        return dict(zip(self._pool_keys(job), (*job.pools, ON_DEMAND)))

    # -- primitives -----------------------------------------------------------------------------

    @abstractmethod
    def _check(self, job: TrainingJob, target: Allocation) -> None:
        """Refuse a target this backend's configuration cannot place (after :func:`~.base.check_target`)."""

    @abstractmethod
    def _list(self, job: TrainingJob) -> list[Instance]:
        """Every instance carrying the job's id, whatever its state."""

    @abstractmethod
    def _status(self, job: TrainingJob, instances: list[Instance]) -> JobStatus:
        """The job's status from ``instances`` as last listed or launched."""

    @abstractmethod
    def _live(self, instance: Instance) -> bool:
        """Pending or running, and not being ended by this backend."""

    @abstractmethod
    def _pool_keys(self, job: TrainingJob) -> tuple[str, ...]:
        """The pool key of each pool of ``job.pools``, in order, then that of on-demand."""

    @abstractmethod
    def _pool_key(self, instance: Instance) -> str:
        """The pool key ``instance`` carries (one of :meth:`_pool_keys`, or a pool the job no longer names)."""

    @abstractmethod
    def _oldest_first(self, instance: Instance) -> tuple[Any, str]:
        """Sort key: launch order, ties broken by a stable id."""

    @abstractmethod
    def _pending_since(self, instance: Instance) -> datetime | None:
        """When ``instance`` was launched if it is still waiting to start, else ``None``."""

    def _finish_releases(self, instances: list[Instance]) -> None:
        """End what an earlier call marked for ending but did not end (it crashed); nothing by default."""

    @abstractmethod
    def _terminate(self, instances: list[Instance]) -> None:
        """End ``instances``, so that the job's status tells them from preempted ones."""

    @abstractmethod
    def _next_generation(self, job: TrainingJob, known: list[Instance]) -> int:
        """A launch generation above every one the job has used (names and tags stay apart)."""

    @abstractmethod
    def _launch(
        self, job: TrainingJob, key: str, count: int, generation: int, script: str
    ) -> tuple[list[Launched], str]:
        """Start up to ``count`` instances in pool ``key``; what started, and why not all did ("" if all)."""

    @abstractmethod
    def _with_launched(self, job: TrainingJob, instances: list[Instance], launched: list[Launched]) -> list[Instance]:
        """Every instance of the job once ``launched`` started (``instances`` when nothing did)."""

    @abstractmethod
    def _rendezvous(self, live: list[Instance], known: list[Instance]) -> None:
        """Publish a new generation when the live set differs from the one last published."""
