"""The solver operator: one decision of an OnlineRun, with the state and the plan on XCom."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.forecast.snapshot import market_at
from airflow_provider_spotsched.market.trace import load_trace, parse_timestamp
from airflow_provider_spotsched.operators.forecast import SpotMarketForecastOperator
from airflow_provider_spotsched.operators.solver import RUN_STATE_KEY, SpotAllocationSolverOperator
from airflow_provider_spotsched.scheduling.model import Job, JobError
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig

POOLS = ["us-east4-a", "europe-west1-c", "us-central1-a"]
AT, NEXT = "2025-10-11T04:10:00Z", "2025-10-11T05:10:00Z"  # us-east4-a loses its capacity at NEXT
HISTORY_HOURS = 72.0
JOB = {"work": 2000.0, "deadline_hours": 10.0, "max_instances": 2, "throughput": {"alpha": 200.0}, "value": 100.0,
       "hard_deadline_factor": 1.5}


class TaskInstance:
    dag_id, task_id, run_id, map_index = "tests", "solve", "manual__1", -1

    def __init__(self) -> None:
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = json.loads(json.dumps(value))  # what XCom stores


def solve(**fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The operator's return value and its run_state XCom, both as XCom stores them."""
    ti = TaskInstance()
    fields.setdefault("market", "gcp")
    fields.setdefault("history_hours", HISTORY_HOURS)
    result = SpotAllocationSolverOperator(task_id="solve", **fields).execute({"ti": ti})
    return json.loads(json.dumps(result)), ti.xcoms[RUN_STATE_KEY]


def forecast(at: str) -> dict[str, Any]:
    operator = SpotMarketForecastOperator(task_id="forecast", market="gcp", pools=POOLS, at=at, model="seasonal-naive",
                                          history_hours=HISTORY_HOURS)
    return json.loads(json.dumps(operator.execute({})))


def test_a_new_run_decides_slot_zero_as_the_online_run_does():
    result, state = solve(job=JOB, pools=POOLS, at=AT)
    at = parse_timestamp(AT)
    config = RunConfig("tests-solve", Job.from_dict(JOB), tuple(POOLS), policy="chc")
    history = market_at(load_trace(GCP_TRACE), at, 1.0, POOLS)
    direct = OnlineRun.start(config, history.window(history.num_slots - int(HISTORY_HOURS) - 1), at).decide(0.0, at)
    policy = "chc(window=24,commit=4,forecaster=seasonal-naive,terminal_price=marginal)"
    assert result == {"slot": 0, "allocation": direct.allocation, "plan": direct.plan, "policy": policy}
    assert result["plan"][0] == result["allocation"] and len(result["plan"]) == 4  # CHC commits 4 slots
    assert state["run"]["records"][0]["allocation"] == result["allocation"] and state["forecasts"] == {}


def test_the_forecast_given_is_the_one_the_policy_plans_on():
    document = forecast(AT)
    own, _ = solve(job=JOB, pools=POOLS, at=AT)
    same, state = solve(job=JOB, pools=POOLS, at=AT, forecast=document)
    assert same == own  # the document is the seasonal-naive forecast CHC would have made itself
    assert state["forecasts"] == {AT: document}
    cheap = copy.deepcopy(document)  # us-central1-a forecast nearly free and plentiful: worth waiting for
    cheap["pools"]["us-central1-a"].update(spot_price=[0.05] * 24, available=[8.0] * 24)
    waits, _ = solve(job=JOB, pools=POOLS, at=AT, forecast=json.dumps(cheap))  # JSON text, as a rendered template
    assert waits["allocation"] == {"spot": {}, "on_demand": 0}
    assert waits["plan"][1:] == [{"spot": {"us-central1-a": 2}, "on_demand": 0}] * 3


def test_the_run_state_carries_the_run_to_the_next_slot():
    first, state = solve(job=JOB, pools=POOLS, at=AT, forecast=forecast(AT))
    second, state2 = solve(run_state=state, at=NEXT, work_done=350.0, forecast=forecast(NEXT))
    assert second["slot"] == 1
    records = state2["run"]["records"]
    assert records[0]["allocation"] == first["allocation"] and records[0]["applied"] == first["allocation"]
    assert records[1]["work_done"] == 350.0 and records[1]["market"]["us-east4-a"]["available"] == 0
    assert "us-east4-a" not in second["allocation"]["spot"]  # no capacity left there
    assert state2["run"]["cost"] > 0 and set(state2["forecasts"]) == {AT, NEXT}


def test_a_state_from_online_run_to_state_is_continued_too():
    _, state = solve(job=JOB, pools=POOLS, at=AT)
    result, _ = solve(run_state=state["run"], at=NEXT)
    assert result["slot"] == 1 and result["policy"].startswith("chc(")


def test_the_job_and_policy_params_rendered_to_json_text_are_read_as_dicts():
    """Templated fields render to text (``| tojson``) unless the DAG renders native objects."""
    given, _ = solve(job=JOB, pools=POOLS, at=AT, policy_params={"window": 4})
    assert solve(job=json.dumps(JOB), pools=POOLS, at=AT, policy_params='{"window": 4}')[0] == given
    assert given["policy"].startswith("chc(window=4,")
    as_text = {key: str(value) if isinstance(value, (int, float)) else value for key, value in JOB.items()}
    assert solve(job=as_text, pools=POOLS, at=AT, policy_params={"window": 4})[0] == given  # {"work": "{{ params.work }}"}


@pytest.mark.parametrize("name", ["job", "policy_params"])
def test_a_job_or_policy_params_rendered_to_no_json_object_is_refused_naming_it(name):
    fields: dict[str, Any] = {"job": JOB, "pools": POOLS, "at": AT, name: "{{ not rendered }}"}
    with pytest.raises(JobError, match=rf"^{name}='{{{{ not rendered }}}}': neither a dict nor JSON text of an object"):
        solve(**fields)


@pytest.mark.parametrize(
    ("damage", "message"),
    [(lambda doc: doc["pools"].update({"us-east4-a": {}}),
      r"^the forecast's pool\(s\) \['us-east4-a'\] lack \['available', 'model', 'spot_price'\]"),
     (lambda doc: doc.update(pools=POOLS), r"^forecast must be a forecast document .*; got pools=\['us-east4-a', "),
     (lambda doc: doc.update(slot_hours="x"), r"^forecast must be a forecast document .*; got pools=.*, slot_hours='x'")],
    ids=["pool-without-fields", "pools-a-list", "slot-hours-text"],
)
def test_a_malformed_forecast_document_is_refused_saying_what_it_lacks(damage, message):
    document = forecast(AT)
    damage(document)
    with pytest.raises(ValueError, match=message):
        solve(job=JOB, pools=POOLS, at=AT, forecast=document)


def test_bad_input_is_refused_with_the_field_to_fix():
    with pytest.raises(JobError, match="give job"):
        solve(at=AT)
    with pytest.raises(JobError, match="deadline_hours"):
        solve(job={**JOB, "deadline_hours": 2.0}, pools=POOLS, at=AT)
    _, state = solve(job=JOB, pools=POOLS, at=AT)
    with pytest.raises(ValueError, match="next slot starts at 2025-10-11T05:10:00Z"):
        solve(run_state=state, at="2025-10-11T07:10:00Z")
    with pytest.raises(ValueError, match="forecast was made at 2025-10-11T05:10:00Z"):
        solve(job=JOB, pools=POOLS, at=AT, forecast=forecast(NEXT))
    with pytest.raises(ValueError, match="neither a dict nor JSON"):
        solve(job=JOB, pools=POOLS, at=AT, forecast="{{ not rendered }}")
    with pytest.raises(ValueError, match="work_done must be a number"):
        solve(job=JOB, pools=POOLS, at=AT, work_done="lots")
    for endless in ("inf", "nan", "-1"):  # no measured progress is infinite
        with pytest.raises(ValueError, match=r"^work_done must be a finite number >= 0 of work units, got"):
            solve(job=JOB, pools=POOLS, at=AT, work_done=endless)
