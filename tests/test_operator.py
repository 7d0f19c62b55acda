"""The operator's loop driven by hand: re-attach on retry, kill, failure, refusals, the trigger.

These tests call ``execute``/``execute_slot`` directly with a minimal task context (a
``task_state_store`` and a task instance that records XComs, tests/task_context.py) and run the
trigger's first event with asyncio, as the triggerer would, after a serialise/rebuild round trip.
The backend is the real local one on the replayed GCP trace; the workers are tests/fake_worker.py
(the runtime's contract in milliseconds). tests/test_operator_e2e.py runs the same operator in a
real Airflow deployment with the real runtime.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferralError, TaskDeferred

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.backends.base import InstanceState, TrainingJob
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_processes import marked
from airflow_provider_spotsched.backends.local_settings import DEFAULT_SECONDS_PER_SLOT
from airflow_provider_spotsched.execution.driver import TrainingFailedError
from airflow_provider_spotsched.hooks.backend_factory import BackendSpec, ConnectionMissingError, build_environment
from airflow_provider_spotsched.hooks.local import LocalSpotHook
from airflow_provider_spotsched.operators import fine_tune
from airflow_provider_spotsched.operators.fine_tune import (
    STATE_KEY,
    DeadlineSpotFineTuneOperator,
    job_id_for,
)
from airflow_provider_spotsched.operators.lineage import AdapterLineage
from airflow_provider_spotsched.scheduling.model import JobError
from airflow_provider_spotsched.scheduling.online import BudgetError
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy
from airflow_provider_spotsched.scheduling.selector_store import SelectorStoreError
from airflow_provider_spotsched.triggers.spot_job import STATUS_FAILURES_TO_WAKE, SpotJobTrigger
from tests.billing import billed
from tests.task_context import TaskContext, TaskStateStore, first_payload, rebuilt

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
POOLS = ["us-east4-a", "europe-west1-c"]
MARKET_START = "2025-10-11T03:10:00Z"  # us-east4-a loses its capacity in slot 2
CHEAP_SELECTOR = {"pool": [{"policy": "greedy"}, {"policy": "uniform-progress"}], "warm_up_rounds": 0}
_UNSET = object()


def operator(tmp_path: Path, samples: int = 160, worker: dict | None = None, **overrides: Any) -> DeadlineSpotFineTuneOperator:
    config = tmp_path / "worker.json"
    config.write_text(json.dumps({"samples": samples, "step_s": 0.05, **(worker or {})}))
    checkpoint = tmp_path / "checkpoint"
    fields: dict[str, Any] = dict(
        task_id="fine_tune",
        pools=POOLS,
        work=samples,
        deadline=6.0,
        hard_deadline_factor=1.5,
        throughput={"alpha": 60.0},
        value=100.0,
        max_instances=2,
        reconfig_overhead_hours=0.2,
        command=[sys.executable, str(FAKE_WORKER), "--config", str(config), "--checkpoint-uri", str(checkpoint)],
        checkpoint_uri=str(checkpoint),
        backend_options={"workdir": str(tmp_path / "local"), "seconds_per_slot": 3.0, "market_start": MARKET_START},
        policy="uniform-progress",
        forecaster="seasonal-naive",
        poll_interval=0.2,
        deferrable=True,
    )
    fields.update(overrides)
    return DeadlineSpotFineTuneOperator(**fields)


def backend(tmp_path: Path):
    return LocalSpotHook(workdir=str(tmp_path / "local")).backend()


def first_event(deferred: TaskDeferred) -> dict[str, Any]:
    """The trigger's first event, after a serialise/rebuild round trip (a triggerer restart)."""
    return first_payload(rebuilt(deferred.trigger))


def start(op: DeadlineSpotFineTuneOperator, context: TaskContext) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    return deferred.value


def drive(op: DeadlineSpotFineTuneOperator, context: TaskContext, deferred: TaskDeferred) -> dict[str, Any]:
    """Resume on every event until the operator returns its result."""
    while True:
        assert deferred.method_name == "execute_slot"
        try:
            return op.execute_slot(context, first_event(deferred))
        except TaskDeferred as again:
            deferred = again


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting after {timeout_s} s"
        time.sleep(0.1)


def nothing_left(tmp_path: Path, job_id: str) -> bool:
    return not marked(str(tmp_path / "local" / "jobs" / job_id))


def test_a_retry_re_attaches_to_the_running_job_without_launching_again(tmp_path):
    store = TaskStateStore()
    first_try = TaskContext(store)
    start(operator(tmp_path), first_try)  # then the worker running this try dies: nothing is released
    job = TrainingJob.from_dict(store.get(STATE_KEY)["job"])
    running = backend(tmp_path).status(job)
    assert running.active(tuple(POOLS)).total >= 1

    progress = tmp_path / "checkpoint" / "progress.json"
    wait_for(lambda: progress.exists() and json.loads(progress.read_text())["samples_done"] > 0)
    left = store.get(STATE_KEY)["run"]
    assert left["records"][0]["work_done"] == 0  # slot 0 was decided before any training

    retry = TaskContext(store, try_number=2)
    op = operator(tmp_path)
    deferred = start(op, retry)
    assert store.get(STATE_KEY)["job"] == job.to_dict()  # the stored job id, not a new one
    after = backend(tmp_path).status(job)
    assert [i.instance_id for i in after.instances] == [i.instance_id for i in running.instances]
    # a fresh restart would decide slot 0 again, on the samples trained since (work_done > 0)
    resumed = store.get(STATE_KEY)["run"]
    kept = ("slot", "time", "allocation", "work_done")
    decided = [[r[k] for k in kept] for r in left["records"]]
    assert [[r[k] for k in kept] for r in resumed["records"]][: len(decided)] == decided

    result = drive(op, retry, deferred)
    log = retry["ti"].xcoms["decision_log"]
    assert [r["slot"] for r in log] == list(range(len(log))) and result["slots"] == len(log)
    assert result["cost"] == pytest.approx(billed(log, result))
    assert result["savings"] == pytest.approx(result["on_demand_cost"] - result["cost"])
    assert nothing_left(tmp_path, job.job_id)
    assert all(i.state is not InstanceState.RUNNING for i in backend(tmp_path).status(job).instances)


def test_kill_releases_every_instance_and_keeps_the_checkpoint(tmp_path):
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, worker={"samples": 10_000})
    start(op, context)
    job = TrainingJob.from_dict(context["task_state_store"].get(STATE_KEY)["job"])
    progress = tmp_path / "checkpoint" / "progress.json"
    wait_for(progress.exists)
    assert not nothing_left(tmp_path, job.job_id)
    op.on_kill()
    assert nothing_left(tmp_path, job.job_id)
    assert {i.state for i in backend(tmp_path).status(job).instances} <= {InstanceState.RELEASED, InstanceState.PREEMPTED}
    assert json.loads(progress.read_text())["samples_done"] > 0


def test_killing_the_deferred_task_releases_through_the_trigger(tmp_path):
    context = TaskContext(TaskStateStore())
    deferred = start(operator(tmp_path, worker={"samples": 10_000}), context)
    job = TrainingJob.from_dict(deferred.trigger.job)
    live = (InstanceState.RUNNING, InstanceState.PENDING)
    before = backend(tmp_path).status(job).instances
    assert any(i.state in live for i in before) and not nothing_left(tmp_path, job.job_id)
    asyncio.run(deferred.trigger.on_kill())
    assert nothing_left(tmp_path, job.job_id)
    after = backend(tmp_path).status(job).instances
    assert {i.instance_id for i in after} == {i.instance_id for i in before}  # the same instances, ended
    assert all(i.state not in live for i in after)


def test_a_failing_training_command_fails_the_task_with_its_detail_and_releases(tmp_path):
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, worker={"samples": 10_000, "fail_rank": 0, "fail_after_steps": 3})
    deferred = start(op, context)
    job = TrainingJob.from_dict(deferred.trigger.job)
    with pytest.raises(TrainingFailedError, match="simulated crash at step 3"):
        drive(op, context, deferred)
    assert nothing_left(tmp_path, job.job_id)


def test_a_retry_after_a_failure_relaunches_from_the_checkpoint_and_finishes_the_run(tmp_path):
    store = TaskStateStore()
    first_try = TaskContext(store)
    op = operator(tmp_path, samples=300, worker={"fail_rank": 0, "fail_after_steps": 40})
    with pytest.raises(TrainingFailedError):
        drive(op, first_try, start(op, first_try))
    failed_at = json.loads((tmp_path / "checkpoint" / "progress.json").read_text())["samples_done"]
    decided = store.get(STATE_KEY)["run"]["records"]
    assert failed_at > 0 and decided

    (tmp_path / "worker.json").write_text(json.dumps({"samples": 300, "step_s": 0.05}))  # the fault is fixed
    retry = TaskContext(store, try_number=2)
    op = operator(tmp_path, samples=300)
    result = drive(op, retry, start(op, retry))
    log = retry["ti"].xcoms["decision_log"]
    assert log[: len(decided)] == [{**r, "preemptions": log[i]["preemptions"]} for i, r in enumerate(decided)]
    assert [r["slot"] for r in log] == list(range(result["slots"]))
    assert json.loads((tmp_path / "checkpoint" / "progress.json").read_text())["samples_done"] == 300
    assert result["cost"] == pytest.approx(billed(log, result))


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"work": 100_000, "samples": 100_000}, JobError, r"job is infeasible: .* set deadline_hours >="),
        ({"pools": ["us-east4-a", "mars-1a"]}, JobError, r"unknown pool\(s\) \['mars-1a'\]"),
        ({"budget": 0.5}, BudgetError, r"budget=0.5 USD cannot cover the job.* raise the budget to >="),
        ({"compute_conn_id": "no_such_conn"}, ConnectionMissingError,
         r"compute_conn_id='no_such_conn': no such connection\. Create it with `airflow connections add no_such_conn "
         r"--conn-type spotsched_local"),
        ({"backend": "ec2", "compute_conn_id": "no_aws", "checkpoint_uri": "s3://bucket/ckpt"}, ConnectionMissingError,
         r"compute_conn_id='no_aws': no such connection\. Create it with .* --conn-type aws"),
        ({"deadline": "2020-01-01T00:00:00Z"}, JobError, "has passed"),
        ({"work": 10, "steps": 3, "batch_size": 8}, JobError, r"size disagrees: work = 10, steps \* batch_size = 24"),
    ],
    ids=["infeasible", "unknown-pool", "budget", "missing-connection", "missing-ec2-connection", "past-deadline",
         "size-conflict"],
)
def test_bad_parameters_fail_before_anything_launches(tmp_path, overrides, error, message):
    samples = overrides.pop("samples", 160)
    with pytest.raises(error, match=message):
        operator(tmp_path, samples=samples, **overrides).execute(TaskContext(TaskStateStore()))
    jobs = tmp_path / "local" / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir())


@pytest.fixture
def variables(monkeypatch) -> dict[str, str]:
    """The operator's Airflow Variables as the text the metadata database would hold, by key."""
    texts: dict[str, str] = {}

    class Variable:  # airflow.sdk.Variable's get and set, as the operator calls them
        @staticmethod
        def get(key: str, default: Any = _UNSET, deserialize_json: bool = False) -> Any:
            if key not in texts:
                if default is _UNSET:
                    raise KeyError(key)
                return default
            return json.loads(texts[key]) if deserialize_json else texts[key]

        @staticmethod
        def set(key: str, value: Any, serialize_json: bool = False) -> None:
            texts[key] = json.dumps(value) if serialize_json else str(value)

    monkeypatch.setattr(fine_tune, "Variable", Variable)
    return texts


def nothing_launched(tmp_path: Path, context: TaskContext) -> bool:
    jobs = tmp_path / "local" / "jobs"
    return context["task_state_store"].get(STATE_KEY) is None and (not jobs.exists() or not any(jobs.iterdir()))


@pytest.mark.parametrize(
    "text", ["selector: {oops", "", "null", '""', "[]", "0", "false", "{}", '{"selector": {"version": 2}}']
)
def test_a_selector_variable_that_holds_no_selector_state_is_refused_before_launching(tmp_path, variables, text):
    op = operator(tmp_path, policy="selector", policy_params=CHEAP_SELECTOR)
    key = op.selector_state_variable
    variables[key] = text
    context = TaskContext(TaskStateStore())
    with pytest.raises(SelectorStoreError, match=rf"^Variable '{key}' holds no valid selector state: ") as refused:
        op.execute(context)
    assert f"restore it from a backup, or delete Variable '{key}' to start learning afresh" in str(refused.value)
    assert variables[key] == text, "the learnt state is never replaced by a fresh one"
    assert nothing_launched(tmp_path, context)


def test_a_selector_variable_damaged_during_the_run_is_kept_and_a_retry_closes_the_round(tmp_path, variables, caplog):
    store = TaskStateStore()
    first_try = TaskContext(store)
    op = operator(tmp_path, policy="selector", policy_params=CHEAP_SELECTOR)
    key = op.selector_state_variable
    with caplog.at_level("INFO", logger="airflow_provider_spotsched.scheduling.selector_store"):
        deferred = start(op, first_try)
    variables[key] = "null"  # cleared by hand while the job trained
    with pytest.raises(SelectorStoreError, match=rf"^Variable '{key}' holds no valid selector state: it holds null") as failed:
        drive(op, first_try, deferred)
    job_id = store.get(STATE_KEY)["job"]["job_id"]
    assert f"The round of run {job_id} was not stored" in str(failed.value)
    assert variables[key] == "null"
    log = first_try["ti"].xcoms["decision_log"]

    del variables[key]  # the fix chosen: learn afresh
    retry = TaskContext(store, try_number=2)
    result = operator(tmp_path, policy="selector", policy_params=CHEAP_SELECTOR).execute(retry)
    assert result["deadline_met"] and retry["ti"].xcoms["decision_log"] == log, "the finished run, not a new one"
    document = json.loads(variables[key])
    assert document["runs"] == [job_id] and document["last_round"]["utility"] == pytest.approx(result["utility"])
    assert f"Variable '{key}' does not exist yet; the selector starts fresh" in caplog.text


def test_a_selector_variable_recreated_for_another_pool_during_the_run_drops_the_round_and_succeeds(
    tmp_path, variables, caplog
):
    """Deleted and recreated by a run with other policy_params while the job trained: the round
    cannot be learnt by that selector, so it is dropped with a warning, not raised (a failing closing
    step would fail every retry the same way), and the task returns its result."""
    store = TaskStateStore()
    context = TaskContext(store)
    op = operator(tmp_path, policy="selector", policy_params=CHEAP_SELECTOR)
    key = op.selector_state_variable
    deferred = start(op, context)
    other = SelectorPolicy(pool=[{"policy": "greedy"}, {"policy": "prediction-free"}], warm_up_rounds=0).to_state()
    variables[key] = json.dumps({"selector": other, "runs": ["other"]})
    with caplog.at_level("WARNING", logger="airflow_provider_spotsched.scheduling.selector_store"):
        result = drive(op, context, deferred)
    assert result["deadline_met"]
    job_id = store.get(STATE_KEY)["job"]["job_id"]
    assert json.loads(variables[key]) == {"selector": other, "runs": ["other", job_id]}, "kept, the round marked as closed"
    assert f"Variable '{key}' holds another selector than run {job_id} started from" in caplog.text
    assert f"the round of its member {result['policy']!r} is dropped" in caplog.text


def test_policy_params_other_than_the_stored_selectors_are_refused_before_launching(tmp_path, variables):
    op = operator(tmp_path, policy="selector", policy_params={**CHEAP_SELECTOR, "algorithm": "exp3", "seed": 7})
    stored = json.dumps({"selector": SelectorPolicy(**CHEAP_SELECTOR).to_state(), "runs": []})  # hedge, seed 0
    variables[op.selector_state_variable] = stored
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match="algorithm: stored 'hedge', asked 'exp3'; seed: stored 0, asked 7"):
        op.execute(context)
    assert variables[op.selector_state_variable] == stored and nothing_launched(tmp_path, context)


def test_a_spotsched_local_connection_configures_the_backend(tmp_path, monkeypatch):
    extra = {"workdir": str(tmp_path / "from-conn"), "seconds_per_slot": 3.0, "market_start": MARKET_START}
    monkeypatch.setenv("AIRFLOW_CONN_MY_LOCAL", json.dumps({"conn_type": "spotsched_local", "extra": extra}))
    settings = LocalSpotHook("my_local").settings()
    assert settings.workdir == tmp_path / "from-conn" and settings.seconds_per_slot == 3.0
    assert LocalSpotHook("my_local", seconds_per_slot=1.5).settings().seconds_per_slot == 1.5
    with pytest.raises(ValueError, match=r"connection 'my_local': seconds_per_slot must be a number of seconds > 0"):
        LocalSpotHook("my_local", seconds_per_slot=-1).settings()


def test_without_compute_conn_id_the_spotsched_local_default_connection_configures_the_backend(tmp_path, monkeypatch):
    """docs/airflow.md tells users to create spotsched_local_default: with no compute_conn_id the
    operator's environment reads it, as other providers' hooks read their default connection."""
    extra = {"workdir": str(tmp_path / "from-default"), "trace": "aws", "seconds_per_slot": 3.0}
    monkeypatch.setenv("AIRFLOW_CONN_SPOTSCHED_LOCAL_DEFAULT", json.dumps({"conn_type": "spotsched_local", "extra": extra}))
    env = build_environment(BackendSpec("local", None), 1.0)
    assert env.seconds_per_slot == 3.0 and env.backend.workdir == tmp_path / "from-default" / "jobs"
    assert LocalSpotHook().settings().trace == AWS_TRACE
    assert LocalSpotHook(seconds_per_slot=1.5).settings().seconds_per_slot == 1.5  # backend_options still win


def test_without_compute_conn_id_or_a_default_connection_the_local_backend_uses_the_embedded_default(tmp_path, monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_SPOTSCHED_LOCAL_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__LOCAL_WORKDIR", str(tmp_path / "embedded"))
    env = build_environment(BackendSpec("local", None), 1.0)
    assert env.seconds_per_slot == DEFAULT_SECONDS_PER_SLOT and env.backend.workdir == tmp_path / "embedded" / "jobs"
    assert LocalSpotHook().settings().trace == GCP_TRACE


def test_a_spotsched_local_connection_in_uri_form_reads_its_numbers_from_text(tmp_path, monkeypatch):
    """Airflow gives a URI's query extras as text: seconds_per_slot=10 is 10 seconds, not a refusal."""
    monkeypatch.setenv("AIRFLOW_CONN_MY_LOCAL", f"spotsched-local://?workdir={tmp_path}&seconds_per_slot=10&history_slots=24")
    settings = LocalSpotHook("my_local").settings()
    assert (settings.workdir, settings.seconds_per_slot, settings.history_slots) == (tmp_path, 10.0, 24)
    for query, message in (("seconds_per_slot=inf", "seconds_per_slot must be a number of seconds > 0, got inf"),
                           ("seconds_per_slot=soon", "seconds_per_slot must be a number of seconds > 0, got 'soon'"),
                           ("history_slots=1.5", "history_slots must be an integer >= 1, got '1.5'"),
                           ("history_slots=0", "history_slots must be an integer >= 1, got 0")):
        monkeypatch.setenv("AIRFLOW_CONN_MY_LOCAL", f"spotsched-local://?{query}")
        with pytest.raises(ValueError, match=rf"^connection 'my_local': {re.escape(message)}$"):
            LocalSpotHook("my_local").settings()


def test_trigger_serialises_every_argument():
    trigger = SpotJobTrigger(
        backend={"name": "local", "conn_id": None, "options": {"workdir": "/tmp/x"}},
        job={"job_id": "j-1", "command": ["python", "train.py"], "checkpoint_uri": "/tmp/c", "pools": ["a"], "env": {}},
        boundary="2026-01-01T00:00:00+00:00",
        poll_interval=2.5,
        known_preemptions=3,
        known_failures=1,
        not_before="2025-12-31T23:59:45+00:00",
    )
    path, kwargs = trigger.serialize()
    assert path == "airflow_provider_spotsched.triggers.spot_job.SpotJobTrigger"
    rebuilt = SpotJobTrigger(**json.loads(json.dumps(kwargs)))
    assert rebuilt.serialize() == (path, kwargs)
    assert kwargs["known_preemptions"] == 3 and kwargs["known_failures"] == 1 and kwargs["poll_interval"] == 2.5
    assert kwargs["not_before"] == "2025-12-31T23:59:45+00:00"


def test_a_trigger_whose_status_calls_keep_failing_wakes_the_task_instead_of_failing(tmp_path, monkeypatch):
    """A failed trigger fails its task with nothing released; after a few failed polls in a row it
    wakes the task, whose own step either gets through or fails and releases."""
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, worker={"samples": 10_000})
    deferred = start(op, context)
    job = TrainingJob.from_dict(deferred.trigger.job)
    calls = []

    def throttled(self, job):
        calls.append(job.job_id)
        raise OSError("Request limit exceeded")

    with monkeypatch.context() as patch:
        patch.setattr(LocalBackend, "status", throttled)
        event = first_event(deferred)
    assert event["reason"] == "error" and "Request limit exceeded" in event["error"]
    assert len(calls) == STATUS_FAILURES_TO_WAKE
    assert not nothing_left(tmp_path, job.job_id)  # the instances ran on meanwhile
    op.on_kill()


def test_a_failed_status_call_past_the_boundary_wakes_the_task_at_the_boundary_at_once(tmp_path, monkeypatch):
    """The boundary needs no status call: past it (a triggerer restarted late), a throttled call
    is not retried at once until the failures run out, and the task wakes at its boundary."""
    calls = []

    def throttled(self, job):
        calls.append(job.job_id)
        raise OSError("Request limit exceeded")

    monkeypatch.setattr(LocalBackend, "status", throttled)
    trigger = SpotJobTrigger(
        backend={"name": "local", "conn_id": None, "options": {"workdir": str(tmp_path)}},
        job={"job_id": "j-1", "command": ["python", "train.py"], "checkpoint_uri": str(tmp_path / "c"), "pools": ["a"], "env": {}},
        boundary=(datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat(),
        poll_interval=60.0,
    )
    event = first_payload(trigger)
    assert event["reason"] == "boundary" and "Request limit exceeded" in event["error"]
    assert calls == ["j-1"]


def test_a_failed_trigger_releases_the_jobs_instances_before_the_task_fails(tmp_path):
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, worker={"samples": 10_000})
    job = TrainingJob.from_dict(start(op, context).trigger.job)
    assert not nothing_left(tmp_path, job.job_id)
    with pytest.raises(TaskDeferralError, match="Trigger failure"):
        operator(tmp_path).resume_execution(fine_tune.TRIGGER_FAILED, {"error": "Trigger failure"}, context)
    assert nothing_left(tmp_path, job.job_id)


def test_a_resume_that_fails_before_its_driver_is_rebuilt_releases_the_job(tmp_path, monkeypatch):
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, worker={"samples": 10_000})
    job = TrainingJob.from_dict(start(op, context).trigger.job)

    def no_connection(*args, **kwargs):
        raise ConnectionMissingError("the API server did not answer")

    monkeypatch.setattr(fine_tune, "build_environment", no_connection)
    with pytest.raises(ConnectionMissingError):
        operator(tmp_path).execute_slot(context, {"reason": "boundary", "time": datetime.now(timezone.utc).isoformat()})
    assert nothing_left(tmp_path, job.job_id)


@pytest.mark.parametrize("entry", ["execute_slot", "retry"])
def test_a_bad_min_deferral_seconds_met_by_a_running_job_releases_it(tmp_path, monkeypatch, entry):
    # an admin's typo while the job trains: the resumed try and every retry fail on it; none may leave it running
    store = TaskStateStore()
    job = TrainingJob.from_dict(start(operator(tmp_path, worker={"samples": 10_000}), TaskContext(store)).trigger.job)
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", "15s")
    resumed = operator(tmp_path, worker={"samples": 10_000})
    with pytest.raises(JobError, match="min_deferral_seconds='15s'"):
        if entry == "retry":
            resumed.execute(TaskContext(store, try_number=2))
        else:
            resumed.execute_slot(TaskContext(store), {"reason": "boundary", "time": datetime.now(timezone.utc).isoformat()})
    assert nothing_left(tmp_path, job.job_id)


def test_backend_options_rendered_to_json_text_are_read_on_the_resumed_try_that_reports_lineage(tmp_path):
    text = json.dumps({"workdir": str(tmp_path / "local"), "seconds_per_slot": 3.0, "market_start": MARKET_START})
    context = TaskContext(TaskStateStore())
    deferred = start(operator(tmp_path, samples=100, backend_options=text), context)
    resumed = operator(tmp_path, samples=100, backend_options=text)  # Airflow renders a new operator per resume
    drive(resumed, context, deferred)
    assert resumed.backend_options == json.loads(text)
    assert AdapterLineage.of(resumed, "file:///x/final").market is not None  # the market it ran on, an input


def test_a_wake_is_held_until_the_deferral_has_lasted_min_deferral_seconds(tmp_path, monkeypatch):
    """Airflow 3.3 fails a task resumed before the scheduler read its deferring worker's exit
    (triggers/spot_job.py): the trigger fires no sooner than ``not_before``, even on the job's end."""
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", "0.5")
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, samples=4)
    before = datetime.now(timezone.utc)
    deferred = start(op, context)
    after = datetime.now(timezone.utc)
    not_before = datetime.fromisoformat(deferred.trigger.not_before)
    assert before + timedelta(seconds=0.5) <= not_before <= after + timedelta(seconds=0.5)

    job = TrainingJob.from_dict(deferred.trigger.job)
    wait_for(lambda: backend(tmp_path).status(job).finished)
    _, kwargs = deferred.trigger.serialize()
    held_until = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    event = first_payload(SpotJobTrigger(**{**kwargs, "not_before": held_until.isoformat()}))
    assert event["reason"] == "finished" and datetime.fromisoformat(event["time"]) >= held_until
    result = op.execute_slot(context, event)
    assert result["deadline_met"] and nothing_left(tmp_path, job.job_id)


def test_a_wait_shorter_than_min_deferral_seconds_is_waited_in_the_worker(tmp_path, monkeypatch, capsys):
    """Every wait of a 3 s slot is under 60 s: the run goes on in the worker, deciding each slot once."""
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", "60")
    context = TaskContext(TaskStateStore())
    result = operator(tmp_path).execute(context)  # no TaskDeferred: it returns
    log = context["ti"].xcoms["decision_log"]
    assert result["deadline_met"] and result["slots"] == len(log) >= 2
    assert [r["slot"] for r in log] == list(range(len(log)))
    assert result["cost"] == pytest.approx(billed(log, result))
    task_log = capsys.readouterr().out  # the operator's task logger writes there outside a task runner
    assert task_log.count("waiting in the worker: the next boundary is") == len(log)  # the job ends in the last
    job = TrainingJob.from_dict(context["task_state_store"].get(STATE_KEY)["job"])
    assert nothing_left(tmp_path, job.job_id)


def test_a_job_id_names_its_dag_and_task_and_is_a_valid_cloud_label():
    job_id = job_id_for("My DAG", "Fine_Tune.step", "manual__2026-01-01T00:00:00+00:00", nonce="1")
    assert job_id.startswith("my-dag-fine-tune-step-")
    assert job_id != job_id_for("My DAG", "Fine_Tune.step", "manual__2026-01-01T00:00:00+00:00", nonce="2")
    longest = job_id_for("d" * 250, "t" * 250, "manual__2026-01-01T00:00:00+00:00", 7, nonce="1")
    for valid in (job_id, longest):  # kept as they are as a GCE label (<= 63 characters, [a-z0-9-])
        assert len(valid) <= 63 and all(c.islower() or c.isdigit() or c == "-" for c in valid)


def test_two_fresh_starts_of_one_task_instance_are_two_jobs_with_their_own_checkpoints(tmp_path, monkeypatch):
    """Two deployments on one cloud account run the same DAG with the same run ids (as do a re-created
    DAG and a reset metadata database): neither may take the other's instances or checkpoint as its own."""
    monkeypatch.setattr(DeadlineSpotFineTuneOperator, "_drive", lambda self, context, spec, driver, reattach: driver.training)
    staging, production = (operator(tmp_path, checkpoint_uri=None).execute(TaskContext(TaskStateStore())) for _ in range(2))
    assert staging.job_id != production.job_id
    assert staging.job_id.startswith("tests-fine-tune-") and production.job_id.startswith("tests-fine-tune-")
    assert staging.checkpoint_uri == str(tmp_path / "local" / "checkpoints" / staging.job_id)  # the default location
    assert staging.checkpoint_uri != production.checkpoint_uri


def test_without_a_triggerer_the_operator_runs_the_job_in_the_worker(tmp_path):
    """deferrable=False: the same driver, waiting in-process; the result and the log as deferred."""
    context = TaskContext(TaskStateStore())
    result = operator(tmp_path, deferrable=False).execute(context)  # no TaskDeferred: it returns
    log = context["ti"].xcoms["decision_log"]
    assert result["deadline_met"] and result["slots"] == len(log)
    assert [r["slot"] for r in log] == list(range(len(log)))
    assert result["cost"] == pytest.approx(billed(log, result))
    job = TrainingJob.from_dict(context["task_state_store"].get(STATE_KEY)["job"])
    assert nothing_left(tmp_path, job.job_id)


@pytest.mark.parametrize("setting", ["true", "false"])
def test_deferrable_defaults_to_airflows_operators_setting(setting):
    code = (
        "from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator as Op; "
        "print(Op(task_id='t', pools=['a'], deadline=6.0, throughput={'alpha': 60.0}, value=1.0, work=1).deferrable)"
    )
    env = {**os.environ, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": setting}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == str(setting == "true")


def test_the_jobs_size_counts_and_market_render_from_upstream_xcom(tmp_path):
    """Templated as a DAG would pass them: text from XCom, turned into numbers before the job is built."""
    from jinja2 import Environment

    class Upstream:
        def xcom_pull(self, task_ids: str) -> Any:
            return {"sizing": {"n": 2, "samples": 160, "alpha": 60.0}}[task_ids]

    op = operator(
        tmp_path,
        max_instances="{{ ti.xcom_pull(task_ids='sizing')['n'] }}",
        work="{{ ti.xcom_pull(task_ids='sizing')['samples'] }}",
        throughput={"alpha": "{{ ti.xcom_pull(task_ids='sizing')['alpha'] }}"},
        value="{{ 50 * 2 }}",
    )
    for name in ("max_instances", "work", "throughput", "value", "market_source", "instance_type"):
        assert name in op.template_fields
    op.render_template_fields({"ti": Upstream()}, jinja_env=Environment())
    assert op.max_instances == "2" and op.work == "160"
    context = TaskContext(TaskStateStore())
    deferred = start(op, context)
    job = context["task_state_store"].get(STATE_KEY)["run"]["config"]["job"]
    assert (job["max_instances"], job["work"], job["throughput"]["alpha"], job["value"]) == (2, 160.0, 60.0, 100.0)
    drive(op, context, deferred)


def test_a_template_that_renders_to_no_number_is_refused_before_launching(tmp_path):
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"max_instances='two' is not an integer"):
        operator(tmp_path, max_instances="two").execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None
    assert not (tmp_path / "local" / "jobs").exists() or not any((tmp_path / "local" / "jobs").iterdir())
