"""Waits for the next moment a run must decide: a slot boundary, a preemption or the job's end.

While the job trains, its operator is deferred: it holds no worker slot, and this trigger polls
the backend from the triggerer. A poll is one ``status`` call in a thread (the local backend
reads a few small files; a cloud backend makes one describe call), then an ``asyncio.sleep``
until the next poll or the boundary, whichever comes first. Everything the trigger needs is in
its arguments (backend spec, job, boundary as an ISO string, poll interval, preemptions and
failures already known), so a triggerer that restarts rebuilds it from :meth:`SpotJobTrigger.serialize` and goes
on waiting for the same boundary. The event carries what the operator needs to resume: the
reason, the instant and the job's status. A status call that fails is retried at the next poll;
after :data:`STATUS_FAILURES_TO_WAKE` in a row the task is woken with reason ``error`` (and the
error), never left to fail with its instances running. Once the boundary has passed, a failed
call wakes the task with reason ``boundary`` (and the error) at once: the boundary does not
depend on the status, and the woken step reads the status itself.

No event comes before ``not_before``: Airflow 3.3 fails a task resumed before the scheduler has
read the executor's report of the worker that deferred it (a stale success for a task that is
running again; apache/airflow#71580, #72716). The operator sets it ``[spotsched]
min_deferral_seconds`` after the deferral and defers only for waits at least that long.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_spotsched.backends.base import TrainingJob
from airflow_provider_spotsched.execution.wake import BOUNDARY, wake_reason

STATUS_FAILURES_TO_WAKE = 5
"""Failed status calls in a row after which the trigger wakes the task (reason ``error``) instead
of failing: a failed trigger fails its task with no release, while the woken task's own step
either gets through or fails and releases the job's instances."""


class SpotJobTrigger(BaseTrigger):
    """Fires once: at ``boundary``, on a preemption beyond ``known_preemptions``, or at the job's end.

    :param backend: a :class:`~airflow_provider_spotsched.hooks.backend_factory.BackendSpec` as a dict.
    :param job: the :class:`TrainingJob` as a dict (see :meth:`TrainingJob.to_dict`).
    :param boundary: ISO-8601 UTC instant of the next slot boundary.
    :param poll_interval: seconds between status polls.
    :param known_preemptions: preempted instances the operator has already seen.
    :param known_failures: failed instances the operator has already seen (a retry restarts a
        failed job; the failures of earlier tries stay in its status).
    :param not_before: ISO-8601 UTC instant before which a wake is held (``None``: none held).
    """

    def __init__(
        self,
        backend: Mapping[str, Any],
        job: Mapping[str, Any],
        boundary: str,
        poll_interval: float = 5.0,
        known_preemptions: int = 0,
        known_failures: int = 0,
        not_before: str | None = None,
    ) -> None:
        super().__init__()
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.backend = dict(backend)
        self.job = dict(job)
        self.boundary = boundary
        self.poll_interval = float(poll_interval)
        self.known_preemptions = int(known_preemptions)
        self.known_failures = int(known_failures)
        self.not_before = not_before

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "backend": self.backend,
                "job": self.job,
                "boundary": self.boundary,
                "poll_interval": self.poll_interval,
                "known_preemptions": self.known_preemptions,
                "known_failures": self.known_failures,
                "not_before": self.not_before,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_provider_spotsched.hooks.backend_factory import BackendSpec, build_backend

        backend = await asyncio.to_thread(build_backend, BackendSpec.from_dict(self.backend))
        job = TrainingJob.from_dict(self.job)
        boundary = datetime.fromisoformat(self.boundary)
        not_before = datetime.fromisoformat(self.not_before) if self.not_before else None
        failures = 0  # status calls failed in a row
        while True:
            payload: dict[str, Any]
            try:
                status = await asyncio.to_thread(backend.status, job)
            except Exception as error:  # a throttled or dropped call: the instances run on, so ask again
                failures += 1
                now = datetime.now(timezone.utc)
                self.log.warning("status of job %s failed (%d in a row): %s", job.job_id, failures, error)
                # the boundary needs no status (the woken step reads it): past it, retrying at once would
                # only burn the failures allowed and wake the task with "error" instead
                reason = "error" if failures >= STATUS_FAILURES_TO_WAKE else BOUNDARY if now >= boundary else None
                payload = {"error": f"{type(error).__name__}: {error}"}
            else:
                failures = 0
                now = datetime.now(timezone.utc)
                reason = wake_reason(status, now, boundary, self.known_preemptions, self.known_failures)
                payload = {"status": status.to_dict()}
            until = boundary
            if reason is not None:
                if not_before is None or now >= not_before:
                    yield TriggerEvent({"reason": reason, "time": now.isoformat(), **payload})
                    return
                until = not_before  # held: poll again when it may fire
            await asyncio.sleep(max(min(self.poll_interval, (until - now).total_seconds()), 0.0))

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark failed, clear): end every instance of the job."""
        from airflow_provider_spotsched.hooks.backend_factory import BackendSpec, build_backend

        backend = await asyncio.to_thread(build_backend, BackendSpec.from_dict(self.backend))
        await asyncio.to_thread(backend.release, TrainingJob.from_dict(self.job))
