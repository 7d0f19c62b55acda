"""Fault 5, the metadata database briefly unreachable while the task runs.

The task's ``task_state_store`` (its ``set``, or its ``get`` when the task resumes) and its XCom
push raise ``sqlalchemy.exc.OperationalError`` for a few calls, as they do while the database or
the API server in front of it is down. The operator retries them with a short backoff inside the
try: a brief outage costs no instance and no restart. A longer one fails the try (releasing every
instance, as any failure does); the retry re-attaches to the same job once the database is back.
Either way: no leak, no double launch, no lost checkpoint, and the run completes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from sqlalchemy.exc import OperationalError

from airflow_provider_spotsched.operators.fine_tune import STATE_KEY, DeadlineSpotFineTuneOperator
from tests.billing import billed
from tests.faults.markets import write_trace
from tests.faults.support import Audit, ProgressWatch, check_figures, operator_kwargs, released_at_exit
from tests.task_context import TaskContext, TaskInstance, TaskStateStore, first_payload, rebuilt


class Outage:
    """Calls ``first`` .. ``first + calls - 1`` (counted from 1) of one kind raise, as a database that is down."""

    def __init__(self, first: int, calls: int) -> None:
        self.first, self.calls, self.seen, self.raised = first, calls, 0, 0

    def call(self, what: str) -> None:
        self.seen += 1
        if self.first <= self.seen < self.first + self.calls:
            self.raised += 1
            raise OperationalError(what, {}, ConnectionRefusedError("connection to server at 10.0.0.5:5432 refused"))


class FlakyStore(TaskStateStore):
    def __init__(self, sets: Outage | None = None, gets: Outage | None = None) -> None:
        super().__init__()
        self.sets, self.gets = sets, gets

    def set(self, key: str, value: Any, retention: Any = None) -> None:
        if self.sets is not None:
            self.sets.call(f"UPDATE task_state_store SET value=... WHERE key={key!r}")
        super().set(key, value, retention)

    def get(self, key: str, default: Any = None) -> Any:
        if self.gets is not None:
            self.gets.call(f"SELECT value FROM task_state_store WHERE key={key!r}")
        return super().get(key, default)


class FlakyTaskInstance(TaskInstance):
    def __init__(self, try_number: int, pushes: Outage | None) -> None:
        super().__init__(try_number)
        self.pushes = pushes

    def xcom_push(self, key: str, value: Any) -> None:
        if self.pushes is not None:
            self.pushes.call(f"INSERT INTO xcom ... key={key!r}")
        super().xcom_push(key, value)


def run_with_retries(make_operator, store: TaskStateStore, pushes: Outage | None, retries: int = 2):
    """The task as Airflow runs it: each try from ``execute``, resumed on its trigger's events."""
    failures = []
    for try_number in range(1, retries + 2):
        context = TaskContext(store, try_number)
        context["ti"] = FlakyTaskInstance(try_number, pushes)
        op = make_operator()
        try:
            step: Any = op.execute(context)
        except TaskDeferred as deferred:
            step = deferred
        except Exception as error:
            failures.append(error)
            continue
        try:
            while isinstance(step, TaskDeferred):
                try:
                    step = op.execute_slot(context, first_payload(rebuilt(step.trigger)))
                except TaskDeferred as again:
                    step = again
        except Exception as error:
            failures.append(error)
            continue
        return step, context, failures
    raise AssertionError(f"every try failed: {failures}")


def decided_launches(log: list[dict[str, Any]]) -> int:
    """The instances the decision log starts: each slot's applied allocation less the one before, per pool.

    The policy may move the job for reasons of its own (greedy goes on-demand when the throughput
    measured on a loaded host leaves too little slack); an outage must add no launch to those.
    """
    launches, previous = 0, {"spot": {}, "on_demand": 0}
    for record in log:
        applied = record["applied"]
        launches += sum(max(n - previous["spot"].get(pool, 0), 0) for pool, n in applied["spot"].items())
        launches += max(applied["on_demand"] - previous["on_demand"], 0)
        previous = applied
    return launches


def outage(ledger, tmp_path: Path, run: str, sets: Outage | None = None, gets: Outage | None = None,
           pushes: Outage | None = None, samples: int = 240,
           seconds_per_slot: float = 1.5) -> tuple[list, Audit, list[dict[str, Any]]]:
    trace = write_trace(tmp_path / "calm.csv")
    kwargs = operator_kwargs(tmp_path, samples, seconds_per_slot, trace)
    store = FlakyStore(sets, gets)
    with released_at_exit(tmp_path / "local"), ProgressWatch.progress_file(tmp_path / "checkpoint") as watch:
        result, context, failures = run_with_retries(lambda: DeadlineSpotFineTuneOperator(**kwargs), store, pushes)
    audit = Audit(tmp_path / "local", store.get(STATE_KEY)["job"]["job_id"], 2)
    figures = ledger.add(audit.figures("5 metadata database unreachable", run, watch, result,
                                       failed_tries=len(failures),
                                       raised=sum(o.raised for o in (sets, gets, pushes) if o is not None)))
    check_figures(figures)
    assert sum(o.raised for o in (sets, gets, pushes) if o is not None) > 0, "the outage happened"
    log = context["ti"].xcoms["decision_log"]
    assert [r["slot"] for r in log] == list(range(len(log)))
    assert result["cost"] == pytest.approx(billed(log, result))
    return failures, audit, log


def test_a_brief_outage_is_ridden_out_inside_the_try(ledger, tmp_path):
    """The state store's set (at slot 1's decision), its get (on the first resume) and the XCom push each fail twice."""
    failures, audit, log = outage(ledger, tmp_path, "brief: set, get and push", sets=Outage(4, 2), gets=Outage(2, 2),
                                  pushes=Outage(2, 2))
    assert not failures, f"a brief outage fails no try: {failures}"
    assert log[0]["applied"] == {"spot": {"zone-a": 2}, "on_demand": 0}
    assert audit.launches() == decided_launches(log), "nothing was released and relaunched: what was decided, once"


@pytest.mark.chaos
def test_chaos_a_long_outage_fails_the_try_and_the_retry_re_attaches(ledger, tmp_path):
    failures, audit, log = outage(ledger, tmp_path, "long: state store set", sets=Outage(4, 6))
    assert len(failures) == 1 and isinstance(failures[0], OperationalError)
    relaunched = sum(log[0]["applied"]["spot"].values())
    assert audit.launches() == decided_launches(log) + relaunched, \
        "the failed try released its instances; the retry launched them again, once"


@pytest.mark.chaos
@pytest.mark.parametrize("first", [1, 3, 7, 12])
def test_chaos_brief_outages_at_every_point_of_the_run(ledger, tmp_path, first):
    failures, _, _ = outage(ledger, tmp_path, f"brief: set, gets and pushes from call {first}", sets=Outage(first, 2),
                            gets=Outage(max(first // 3, 1), 1), pushes=Outage(max(first // 2, 1), 2), samples=360)
    assert not failures, failures


@pytest.mark.chaos
@pytest.mark.parametrize(
    ("kind", "outages"),
    [
        ("state store set", {"sets": Outage(4, 3)}),
        ("state store get on resume", {"gets": Outage(2, 3)}),
        ("xcom push", {"pushes": Outage(2, 3)}),
    ],
    ids=["set", "get", "xcom"],
)
def test_chaos_one_kind_of_call_down(ledger, tmp_path, kind, outages):
    failures, audit, log = outage(ledger, tmp_path, f"brief: {kind}", **outages)
    assert not failures, failures
    assert audit.launches() == decided_launches(log)
