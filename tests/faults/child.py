"""The fault suite's helper processes: a triggerer, a try of the task, to be killed or run twice.

``python -m tests.faults.child trigger KWARGS.json OUT.json POLLED``
    Rebuilds a :class:`SpotJobTrigger` from its serialised arguments, as a restarted triggerer
    does, and runs it to its first event (written to OUT.json). POLLED is touched after every
    status poll, so that a test knows the trigger is waiting.

``python -m tests.faults.child task SPEC.json``
    One try of the operator: ``execute`` with a file-backed ``task_state_store``
    (:class:`~tests.faults.support.FileStateStore`); the result, a deferral or the error goes to
    the spec's ``out``. With ``SPOTSCHED_FAULT_KILL=WHERE:N`` (read here only, never by the
    package) the process kills itself with SIGKILL at the N-th ``reconcile`` of its backend:
    ``before`` it (the decision is persisted, the backend has not acted), ``inside`` it (right
    after the backend saved the job's new instances, holding the job's lock) or ``after`` it
    (the backend acted, the driver has not recorded what it applied).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

KILL = "SPOTSCHED_FAULT_KILL"


def write_out(path: str, payload: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, path)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def trigger(kwargs_file: str, out: str, polled: str) -> None:
    from airflow_provider_spotsched.backends.local import LocalBackend
    from airflow_provider_spotsched.triggers.spot_job import SpotJobTrigger
    from tests.task_context import first_payload

    status = LocalBackend.status

    def polled_status(self: LocalBackend, job: Any) -> Any:
        result = status(self, job)
        Path(polled).touch()
        return result

    LocalBackend.status = polled_status  # type: ignore[method-assign]
    payload = first_payload(SpotJobTrigger(**json.loads(Path(kwargs_file).read_text())))
    write_out(out, payload)


class KillingBackend:
    """Wraps the run's backend; SIGKILLs this process at the configured reconcile (module doc)."""

    def __init__(self, inner: Any, where: str, at: int) -> None:
        self.inner, self.where, self.at, self.calls = inner, where, at, 0
        self.name = inner.name

    def reconcile(self, job: Any, target: Any) -> Any:
        self.calls += 1
        if self.calls != self.at:
            return self.inner.reconcile(job, target)
        if self.where == "before":
            die()
        if self.where == "inside":
            from airflow_provider_spotsched.backends import local_jobdir

            save = local_jobdir.JobDir.save

            def save_then_die(jobdir: Any, state: Any) -> None:
                save(jobdir, state)
                die()

            local_jobdir.JobDir.save = save_then_die  # type: ignore[method-assign]
        status = self.inner.reconcile(job, target)
        die()
        return status

    def __getattr__(self, name: str) -> Any:
        """Everything but ``reconcile`` is the wrapped backend's (status, release, turn, limits)."""
        return getattr(self.inner, name)


def task(spec_file: str) -> int:
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_provider_spotsched.operators import fine_tune
    from tests.faults.support import FileStateStore
    from tests.task_context import TaskContext

    spec = json.loads(Path(spec_file).read_text())
    kill = os.environ.get(KILL)
    if kill:
        where, at = kill.split(":")
        build = fine_tune.build_environment

        def build_killing(*args: Any, **kwargs: Any) -> Any:
            env = build(*args, **kwargs)
            return dataclasses.replace(env, backend=KillingBackend(env.backend, where, int(at)))

        fine_tune.build_environment = build_killing  # type: ignore[assignment]
    operator = fine_tune.DeadlineSpotFineTuneOperator(**spec["operator"])
    context = TaskContext(FileStateStore(spec["store"]), try_number=spec.get("try_number", 1))
    try:
        result = operator.execute(context)
    except TaskDeferred as deferred:
        write_out(spec["out"], {"deferred": deferred.trigger.serialize()[1], "xcoms": context["ti"].xcoms})
        return 0
    except Exception as error:
        write_out(spec["out"], {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(),
                                "xcoms": context["ti"].xcoms})
        return 1
    write_out(spec["out"], {"result": result, "xcoms": context["ti"].xcoms})
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "trigger":
        trigger(*argv[1:])
        return 0
    if argv[0] == "task":
        return task(*argv[1:])
    raise SystemExit(f"unknown helper {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
