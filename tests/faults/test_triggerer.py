"""Fault 2, the triggerer killed and restarted while the task is deferred.

The operator defers to its :class:`SpotJobTrigger`; the trigger runs in a triggerer process of
its own (tests/faults/child.py, asyncio as the triggerer runs it), which is killed with SIGKILL
while it waits. A new process rebuilds the trigger from its serialised form, as a restarted
triggerer does: its event must still come (at the slot boundary, or on the job's end if the job
ended meanwhile), and the operator must resume on it without launching anything again.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_provider_spotsched.operators.fine_tune import STATE_KEY, DeadlineSpotFineTuneOperator
from tests.billing import billed
from tests.faults.markets import write_trace
from tests.faults.support import (
    CHAOS_RUNS,
    Audit,
    ProgressWatch,
    check_figures,
    finish,
    operator_kwargs,
    released_at_exit,
    spawn,
    wait_for,
)
from tests.task_context import TaskContext, TaskStateStore, first_payload, rebuilt


def deferred(call: Any, *args: Any) -> TaskDeferred | dict[str, Any]:
    try:
        return call(*args)
    except TaskDeferred as again:
        return again


def triggerer(tmp_path: Path, kwargs: dict[str, Any], name: str):
    arguments, out, polled, log = (tmp_path / f"{name}{suffix}" for suffix in (".kwargs.json", ".out.json", ".polled",
                                                                               ".log"))
    arguments.write_text(json.dumps(kwargs))
    return spawn("trigger", str(arguments), str(out), str(polled), log=log), out, polled, log


def kill_and_restart_the_triggerer(ledger, tmp_path: Path, seconds_per_slot: float, samples: int,
                                   wait_for_the_end: bool, run: str) -> None:
    trace = write_trace(tmp_path / "calm.csv")
    op = DeadlineSpotFineTuneOperator(**operator_kwargs(tmp_path, samples, seconds_per_slot, trace))
    store = TaskStateStore()
    context = TaskContext(store)
    with released_at_exit(tmp_path / "local"), ProgressWatch.progress_file(tmp_path / "checkpoint") as watch:
        first = deferred(op.execute, context)
        assert isinstance(first, TaskDeferred)
        job_id = store.get(STATE_KEY)["job"]["job_id"]
        audit = Audit(tmp_path / "local", job_id, 2)
        launched = audit.instance_ids()
        assert launched, "slot 0 launched its allocation"
        _, kwargs = first.trigger.serialize()

        process, out, polled, log = triggerer(tmp_path, json.loads(json.dumps(kwargs)), "triggerer-1")
        wait_for(polled.exists, 60, "the first triggerer's first poll")
        process.send_signal(signal.SIGKILL)
        assert finish(process, log) == -signal.SIGKILL
        assert not out.exists(), "the first triggerer was killed while it waited, before its event"

        if wait_for_the_end:  # the job ends while no triggerer runs
            wait_for(lambda: audit.backend().status(audit.job()).finished, 120, "the job's end")
        process, out, _, log = triggerer(tmp_path, json.loads(json.dumps(kwargs)), "triggerer-2")
        assert finish(process, log) == 0, log.read_text()[-3000:]
        event = json.loads(out.read_text())
        assert event["reason"] in (("finished",) if wait_for_the_end else ("boundary", "finished", "preempted"))

        step = deferred(op.execute_slot, context, event)
        assert audit.instance_ids() == launched, "resuming on the restarted trigger's event launched nothing"
        while isinstance(step, TaskDeferred):
            step = deferred(op.execute_slot, context, first_payload(rebuilt(step.trigger)))
    result = step
    decisions = context["ti"].xcoms["decision_log"]
    figures = ledger.add(audit.figures("2 triggerer killed", run, watch, result, reason=event["reason"]))
    check_figures(figures)
    assert audit.instance_ids() == launched, "a calm market: the instances of slot 0 ran the whole job"
    assert [r["slot"] for r in decisions] == list(range(len(decisions)))
    assert result["cost"] == pytest.approx(billed(decisions, result))


def test_a_killed_triggerer_rebuilt_from_its_serialised_form_still_wakes_the_task(ledger, tmp_path):
    kill_and_restart_the_triggerer(ledger, tmp_path, seconds_per_slot=6.0, samples=400, wait_for_the_end=False,
                                   run="boundary")


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
@pytest.mark.parametrize("wait_for_the_end", [False, True], ids=["restart-before-the-boundary", "restart-after-the-end"])
def test_chaos_triggerer_killed(ledger, tmp_path, wait_for_the_end, seed):
    kill_and_restart_the_triggerer(ledger, tmp_path, seconds_per_slot=6.0, samples=400 + 100 * seed,
                                   wait_for_the_end=wait_for_the_end,
                                   run=f"{'after the end' if wait_for_the_end else 'boundary'} seed {seed}")
