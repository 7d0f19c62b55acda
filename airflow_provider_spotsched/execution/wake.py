"""When a waiting run must act again: a slot boundary, a preemption, a failure or the job's end.

One rule for both ways of waiting: the Airflow trigger polls it from the triggerer while the
task is deferred, and :func:`wait_for_wake` polls it in-process (the operator without a
triggerer, the command line).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from airflow_provider_spotsched.backends.base import ComputeBackend, InstanceState, JobStatus, TrainingJob

BOUNDARY, PREEMPTED, FINISHED, FAILED = "boundary", "preempted", "finished", "failed"


@dataclass(frozen=True)
class Wait:
    """Come back at ``boundary``, or earlier when the job's status moves past what is known.

    :param boundary: the next slot boundary (UTC).
    :param known_preemptions: preempted instances the run has already seen.
    :param known_failures: failed instances the run has already seen (a retry restarts a failed
        job; the failures of earlier tries stay in its status).
    :param poll_interval: seconds between status polls that suit the run's clock.
    """

    boundary: datetime
    known_preemptions: int
    known_failures: int
    poll_interval: float


def wake_reason(
    status: JobStatus, now: datetime, boundary: datetime, known_preemptions: int, known_failures: int
) -> str | None:
    """Why the run must act now, or ``None`` to keep waiting (the job's end comes first)."""
    if status.finished:
        return FINISHED
    if status.count(InstanceState.FAILED) > known_failures:
        return FAILED
    if status.preemptions > known_preemptions:
        return PREEMPTED
    if now >= boundary:
        return BOUNDARY
    return None


def wait_for_wake(backend: ComputeBackend, job: TrainingJob, wait: Wait, poll_interval: float | None = None) -> str:
    """Block, polling ``backend``, until :func:`wake_reason` gives a reason; return it."""
    interval = poll_interval or wait.poll_interval
    while True:
        now = datetime.now(timezone.utc)
        reason = wake_reason(backend.status(job), now, wait.boundary, wait.known_preemptions, wait.known_failures)
        if reason is not None:
            return reason
        time.sleep(max(min(interval, (wait.boundary - now).total_seconds()), 0.0))
