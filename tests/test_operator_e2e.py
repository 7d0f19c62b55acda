"""End to end in a real (throwaway) Airflow: the demo DAG and a retried run, with ``dag.test()``.

The deployment and the runs are built in subprocesses (tests.airflow_env, tests.operator_scenarios);
these tests check what the runs left behind: the operator's XCom result and decision log, the
selector's Variable, the local backend's job directory and processes, and the checkpoint.
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_spotsched.backends.base import InstanceState
from airflow_provider_spotsched.backends.local_jobdir import JobDir
from airflow_provider_spotsched.backends.local_processes import marked
from tests.airflow_env import AirflowHome, airflow_home  # noqa: F401  (the session fixture)
from tests.operator_scenarios import RETRY_SAMPLES

RESULT_KEYS = {
    "job_id", "policy", "cost", "on_demand_cost", "savings", "savings_fraction", "completion_hours",
    "deadline_hours", "deadline_met", "preemptions", "value", "utility", "slots",
}
SCENARIOS_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def scenarios(airflow_home: AirflowHome, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    return airflow_home.run_scenarios(tmp_path_factory.mktemp("scenarios") / "results.json", SCENARIOS_TIMEOUT_S)


def billed(log: list[dict], completion_hours: float, slot_hours: float = 1.0) -> float:
    """The cost rebuilt from the decision log alone: each slot's applied allocation at its prices."""
    total = 0.0
    for index, record in enumerate(log):
        applied = record["applied"] or {"spot": {}, "on_demand": 0}
        hourly = sum(n * record["market"][p]["spot_price"] for p, n in applied["spot"].items())
        hourly += applied["on_demand"] * record["on_demand_price"]
        last = index == len(log) - 1
        total += hourly * ((completion_hours - record["slot"] * slot_hours) if last else slot_hours)
    return total


def test_demo_dag_succeeds_with_the_result_in_xcom(scenarios):
    demo = scenarios["demo"]
    assert demo["state"] == "success"
    assert {t: s["state"] for t, s in demo["tasks"].items()} == {"fine_tune": "success", "summary": "success"}
    result = demo["xcom"]["fine_tune.return_value"]
    assert RESULT_KEYS <= set(result)
    assert result["savings"] == pytest.approx(result["on_demand_cost"] - result["cost"])
    assert result["completion_hours"] is not None  # the fine-tune finished (how fast depends on the machine)
    assert result["deadline_met"] == (result["completion_hours"] <= result["deadline_hours"])
    assert result["preemptions"] >= 1
    assert result["utility"] == pytest.approx(result["value"] - result["cost"])
    summary = demo["xcom"]["summary.return_value"]
    assert f"{result['cost']:.2f} USD" in summary and f"preemptions         {result['preemptions']}" in summary


def test_demo_decision_log_is_in_xcom_and_accounts_for_the_cost(scenarios):
    demo = scenarios["demo"]
    result, log = demo["xcom"]["fine_tune.return_value"], demo["xcom"]["fine_tune.decision_log"]
    assert [r["slot"] for r in log] == list(range(result["slots"]))
    for record in log:
        assert {"forecast", "plan", "allocation", "applied", "market", "cost_so_far"} <= set(record)
        assert set(record["market"]) == {"us-east4-a", "europe-west1-c", "us-central1-a"}
    assert log[1]["market"]["us-east4-a"]["available"] == 0  # the replayed drop that preempts the run
    assert log[-1]["preemptions"] == result["preemptions"]
    assert result["cost"] == pytest.approx(billed(log, result["completion_hours"]), rel=1e-9)


def test_demo_stores_the_selector_round_in_its_variable(scenarios):
    demo = scenarios["demo"]
    result, document = demo["xcom"]["fine_tune.return_value"], demo["variable"]
    assert document is not None and result["job_id"] in document["runs"]
    assert document["last_round"]["member"] == result["policy"]
    assert document["last_round"]["utility"] == pytest.approx(result["utility"])
    (learnt,) = document["selector"]["contexts"].values()  # the demo's one kind of job
    assert result["policy"] in learnt["cumulative_loss"] and learnt["rounds"] >= 1
    assert document["selector"]["draws"] >= 1


def test_demo_releases_the_backend_and_keeps_the_trained_adapter(scenarios, airflow_home):  # noqa: F811
    job_id = scenarios["demo"]["xcom"]["fine_tune.return_value"]["job_id"]
    jobdir = JobDir(airflow_home.workdir / "jobs" / job_id)
    assert not marked(str(jobdir.path))
    state = jobdir.load()
    assert state.supervisor.get("exited") is True
    assert all(record.state not in (InstanceState.RUNNING.value, InstanceState.PENDING.value) for record in state.instances)
    assert any(record.state == InstanceState.PREEMPTED.value for record in state.instances)
    final = airflow_home.workdir / "checkpoints" / job_id / "final"
    assert (final / "adapter_model.safetensors").stat().st_size > 0
    assert json.loads((final / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_a_failed_try_is_retried_and_resumes_the_run(scenarios, airflow_home):  # noqa: F811
    retry = scenarios["retry"]
    assert retry["state"] == "success"
    assert retry["tasks"]["fine_tune"] == {"state": "success", "try_number": 2}
    result, log = retry["xcom"]["fine_tune.return_value"], retry["xcom"]["fine_tune.decision_log"]
    assert [r["slot"] for r in log] == list(range(result["slots"]))  # no slot decided or billed twice
    assert result["slots"] >= 3  # the failure came after slot 1: the retry went on from there
    assert result["cost"] == pytest.approx(billed(log, result["completion_hours"]), rel=1e-9)
    assert not marked(str(airflow_home.workdir / "jobs" / result["job_id"]))
    assert json.loads((airflow_home.home / "retry-checkpoint" / "progress.json").read_text())["samples_done"] == RETRY_SAMPLES
