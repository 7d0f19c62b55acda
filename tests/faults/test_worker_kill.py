"""Fault 3, the task's worker killed with SIGKILL in the middle of a decision.

The first try runs the operator (``deferrable=False``, the slot loop in the worker) in a process
of its own whose backend kills the process at its N-th ``reconcile`` (tests/faults/child.py):
``before`` it (the decision is persisted, the backend has not acted), ``inside`` it (the
backend recorded the new instances, holding the job's lock) or ``after`` it (the backend acted,
the driver had not recorded what it applied). Nothing runs ``on_kill``; the state store is a
file that outlives the process. The retry, in a new process, must re-attach to the same job id,
launch nothing twice, and bill every slot once.
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from pathlib import Path

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_provider_spotsched.operators.fine_tune import STATE_KEY, DeadlineSpotFineTuneOperator
from airflow_provider_spotsched.triggers.spot_job import SpotJobTrigger
from tests.billing import billed
from tests.faults.child import KILL
from tests.faults.markets import write_trace
from tests.faults.support import (
    CHAOS_RUNS,
    Audit,
    FileStateStore,
    ProgressWatch,
    check_figures,
    feasible_at_measured_speed,
    finish,
    operator_kwargs,
    outcome,
    released_at_exit,
    spawn,
    task_spec,
)
from tests.task_context import TaskContext, first_payload, rebuilt


def kill_mid_decision(ledger, tmp_path: Path, where: str, at: int, policy: str = "greedy", storm: bool = False,
                      seconds_per_slot: float = 1.5, samples: int = 240, run: str = "") -> None:
    trace = write_trace(tmp_path / "market.csv", storm=(2, 30) if storm else None)
    store = FileStateStore(tmp_path / "task-state")
    with released_at_exit(tmp_path / "local"), ProgressWatch.progress_file(tmp_path / "checkpoint") as watch:
        first = operator_kwargs(tmp_path, samples, seconds_per_slot, trace, policy=policy, deferrable=False)
        log = tmp_path / "try-1.log"
        process = spawn("task", str(task_spec(tmp_path, "try-1", first, store.directory)), log=log,
                        **{KILL: f"{where}:{at}"})
        assert finish(process, log) == -signal.SIGKILL, log.read_text()[-3000:]
        saved = store.get(STATE_KEY)
        assert saved is not None, "the first decision was persisted before the backend acted"
        job_id = saved["job"]["job_id"]
        audit = Audit(tmp_path / "local", job_id, 2)
        before = audit.instance_ids() if audit.jobdir.joinpath("state.json").exists() else []
        if where == "before":
            assert saved["run"]["records"][-1]["applied"] is None, "killed between the decision and the backend"

        # the retry: a new process re-attaches and defers (or settles a job that ended meanwhile); the rest runs
        # here, as the triggerer's resumes would
        retry = dict(first, deferrable=True)
        log = tmp_path / "try-2.log"
        regained = datetime.now(timezone.utc)
        process = spawn("task", str(task_spec(tmp_path, "try-2", retry, store.directory, try_number=2)), log=log)
        assert finish(process, log) == 0, log.read_text()[-3000:]
        retried = outcome(tmp_path, "try-2")
        assert retried is not None and ("deferred" in retried or "result" in retried), retried
        assert store.get(STATE_KEY)["job"]["job_id"] == job_id, "the retry re-attached to the same job"
        if before and not storm:
            assert audit.instance_ids() == before, "the retry launched nothing the first try had launched"

        if "result" in retried:
            # The job's workers train on while no task watches them; on a loaded machine the retry's
            # process may start after they finished, and the retry then settles the job at once.
            result, decisions = retried["result"], retried["xcoms"]["decision_log"]
        else:
            op = DeadlineSpotFineTuneOperator(**retry)
            context = TaskContext(store, try_number=2)
            trigger = SpotJobTrigger(**retried["deferred"])  # as the triggerer rebuilds it from the stored kwargs
            while True:
                try:
                    result = op.execute_slot(context, first_payload(trigger))
                    break
                except TaskDeferred as again:
                    trigger = rebuilt(again.trigger)
            decisions = context["ti"].xcoms["decision_log"]
    # The deadline is the scheduler's to keep from when the retry could act: the slots the dead
    # worker left unwatched, and the retry's own start on a loaded machine, are not.
    feasible = feasible_at_measured_speed(store.get(STATE_KEY)["run"], regained)
    figures = ledger.add(audit.figures("3 worker killed mid-decision", run or f"{where} reconcile {at}", watch, result, feasible))
    check_figures(figures)
    assert [r["slot"] for r in decisions] == list(range(len(decisions))), "every slot decided once"
    assert result["cost"] == pytest.approx(billed(decisions, result)), "every slot billed once"
    if not storm:
        assert len(audit.instance_ids()) == 2, "one launch of N_max spot instances for the whole job"


def test_a_worker_killed_mid_decision_is_re_attached_by_the_retry(ledger, tmp_path):
    """Killed at slot 1's reconcile, the decision persisted, slot 0's instances running."""
    kill_mid_decision(ledger, tmp_path, "before", 2)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
@pytest.mark.parametrize("where", ["before", "inside", "after"])
def test_chaos_worker_killed(ledger, tmp_path, where, seed):
    """Every kill point, at the first launch and later (by seed), on a calm market and in a storm."""
    at = 1 + seed
    kill_mid_decision(ledger, tmp_path, where, at, samples=400, run=f"{where} reconcile {at}")


@pytest.mark.chaos
@pytest.mark.parametrize("where", ["before", "inside", "after"])
def test_chaos_worker_killed_in_a_storm(ledger, tmp_path, where):
    kill_mid_decision(ledger, tmp_path, where, 3, policy="uniform-progress", storm=True, samples=300,
                      run=f"storm, {where} reconcile 3")
