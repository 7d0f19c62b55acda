"""Fault 4, two tries of the same task instance at once, on the same saved run.

A first try starts the run and defers; then two processes execute the task concurrently with the
same ``task_state_store`` (a zombie try that still runs while the scheduler's next try starts, or
a task run twice by a confused executor). Both find the saved run and re-attach. The job must be
launched once (``reconcile`` is idempotent per job id), and the outcome must be one run: one
decision and one bill per slot, the same in the stored state and in whatever each try returns.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_provider_spotsched.operators.fine_tune import STATE_KEY, DeadlineSpotFineTuneOperator
from tests.billing import billed
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
from tests.task_context import TaskContext

DECIDED = ("slot", "allocation", "applied", "work_done", "cost_so_far")


def decided(log: list[dict]) -> list[tuple]:
    return [tuple(str(r[k]) for k in DECIDED) for r in log]


def two_tries_at_once(ledger, tmp_path: Path, policy: str, storm: tuple[int, int] | None, samples: int,
                      seconds_per_slot: float, run: str, seed: int = 0) -> None:
    trace = write_trace(tmp_path / "market.csv", storm=storm, seed=seed)
    store = FileStateStore(tmp_path / "task-state")
    kwargs = operator_kwargs(tmp_path, samples, seconds_per_slot, trace, policy=policy)
    with released_at_exit(tmp_path / "local"), ProgressWatch.progress_file(tmp_path / "checkpoint") as watch:
        with pytest.raises(TaskDeferred):  # the first try starts the run, then its worker is lost
            DeadlineSpotFineTuneOperator(**kwargs).execute(TaskContext(store))
        job_id = store.get(STATE_KEY)["job"]["job_id"]
        audit = Audit(tmp_path / "local", job_id, 2)
        launched = audit.instance_ids()

        tries = dict(kwargs, deferrable=False)
        regained = datetime.now(timezone.utc)
        processes = [
            (spawn("task", str(task_spec(tmp_path, name, tries, store.directory, try_number=n)), log=tmp_path / f"{name}.log"),
             tmp_path / f"{name}.log")
            for n, name in ((2, "try-2"), (3, "try-3"))
        ]
        codes = [finish(process, log, 180) for process, log in processes]
    outcomes = {name: outcome(tmp_path, name) for name in ("try-2", "try-3")}
    saved = store.get(STATE_KEY)["run"]
    results = {name: o["result"] for name, o in outcomes.items() if o and "result" in o}
    final = next(iter(results.values()), None)
    feasible = feasible_at_measured_speed(saved, regained)
    figures = ledger.add(audit.figures("4 two tries at once", run, watch, final, feasible, exit_codes=codes,
                                       errors=[o.get("error") for o in outcomes.values() if o and "error" in o]))
    check_figures(figures)
    assert results, f"neither try returned a result: {outcomes}"
    if storm is None and policy == "greedy":
        assert audit.instance_ids() == launched, "greedy on a calm market: the instances of slot 0 ran the whole job"
    records = saved["records"]
    assert [r["slot"] for r in records] == list(range(len(records))), "one decision per slot in the stored run"
    assert saved["completion_hours"] is not None
    stored_result = {"cost": saved["cost"], "completion_hours": saved["completion_hours"]}
    assert saved["cost"] == pytest.approx(billed(records, stored_result)), "every slot billed once"
    for name, result in results.items():
        log = outcomes[name]["xcoms"]["decision_log"]
        assert decided(log) == decided(records), f"{name} returned the stored run's decisions, one per slot"
        assert (result["cost"], result["completion_hours"]) == pytest.approx(
            (saved["cost"], saved["completion_hours"])), f"{name} returned the stored run's result"


def test_two_tries_at_once_run_the_job_once(ledger, tmp_path):
    two_tries_at_once(ledger, tmp_path, "uniform-progress", storm=(2, 30), samples=200, seconds_per_slot=1.5,
                      run="uniform-progress, storm")


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
@pytest.mark.parametrize("policy", ["uniform-progress", "greedy", "chc"])
def test_chaos_two_tries(ledger, tmp_path, policy, seed):
    storm = (1 + seed % 3, 30) if seed % 2 == 0 else None
    two_tries_at_once(ledger, tmp_path, policy, storm=storm, samples=360, seconds_per_slot=1.5,
                      run=f"{policy} seed {seed}{', storm' if storm else ''}", seed=seed)
