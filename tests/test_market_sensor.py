"""The market sensor's trigger on a synthetic trace replayed fast: each start condition, the
timeout's on-demand fallback, a serialise/rebuild round trip (a triggerer restart), and the
sensor run in a small DAG with ``dag.test()`` (in the throwaway deployment of tests.airflow_env).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_spotsched.sensors.market import SpotMarketSensor
from airflow_provider_spotsched.triggers.market import OBSERVE_FAILURES_TO_FAIL, SpotMarketTrigger, StartConditions
from tests.airflow_env import AirflowHome, airflow_home  # noqa: F401  (the session fixture)
from tests.markets import make_market
from tests.task_context import first_payload, rebuilt

REPO = Path(__file__).resolve().parent.parent
T0 = datetime(2025, 3, 1, tzinfo=timezone.utc)
SWITCH = T0 + timedelta(hours=72)  # the synthetic market changes here
JOB = {"work": 400.0, "deadline_hours": 8.0, "max_instances": 2, "throughput": {"alpha": 100.0}, "value": 50.0}


def write_trace(path: Path, before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> Path:
    """Ten-minute ticks over four days: each pool's (price, available) before and after SWITCH."""
    rows = ["timestamp,market,spot_price,available,on_demand_price"]
    for k in range(4 * 24 * 6):
        when = T0 + timedelta(minutes=10 * k)
        for pool, (price, available) in (before if when < SWITCH else after).items():
            rows.append(f"{when:%Y-%m-%dT%H:%M:%SZ},{pool},{price},{available},10.0")
    path.write_text("\n".join(rows) + "\n")
    return path


def trigger(trace: Path, conditions: dict[str, Any], timeout_s: float = 30.0, start: datetime = SWITCH,
            pools: tuple[str, ...] = ("pool-a", "pool-b")) -> SpotMarketTrigger:
    """A trigger replaying ``trace`` from ``start`` at one slot per second, polling every 0.1 s."""
    now = datetime.now(timezone.utc)
    return SpotMarketTrigger(
        market={"kind": "trace", "options": {"path": str(trace)}},
        pools=list(pools),
        conditions=conditions,
        timeout_at=(now + timedelta(seconds=timeout_s)).isoformat(),
        poll_interval=0.1,
        replay={"origin": now.isoformat(), "market_start": start.isoformat(), "seconds_per_slot": 1.0},
    )


def test_serialize_round_trip_keeps_every_argument_and_the_absolute_timeout(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 0), "pool-b": (3.0, 0)}, {"pool-a": (3.0, 0), "pool-b": (3.0, 0)})
    original = trigger(trace, {"price_below": 2.0, "min_available": 2, "job": JOB, "forecaster": "persistence"})
    copy = rebuilt(original)
    assert copy.serialize() == original.serialize()
    kwargs = original.serialize()[1]
    assert set(kwargs) == {"market", "pools", "conditions", "timeout_at", "slot_hours", "poll_interval", "history_hours", "replay"}
    assert datetime.fromisoformat(kwargs["timeout_at"].replace("Z", "+00:00")) > datetime.now(timezone.utc)
    assert kwargs["conditions"]["job"] == JOB and kwargs["conditions"]["policy"] == "chc"


def test_fires_when_a_spot_price_drops_under_the_threshold(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 4), "pool-b": (2.5, 4)}, {"pool-a": (1.5, 4), "pool-b": (2.5, 4)})
    event = first_payload(rebuilt(trigger(trace, {"price_below": 2.0}, start=SWITCH - timedelta(hours=1))))
    assert event["start"] is True and event["reason"] == "price" and event["fallback"] is None
    assert event["details"] == {"pool": "pool-a", "spot_price": 1.5, "available": 4}
    assert datetime.fromisoformat(event["market_time"].replace("Z", "+00:00")) >= SWITCH  # not before the drop


def test_a_cheap_pool_with_no_capacity_is_not_worth_starting_on(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.0, 0), "pool-b": (3.0, 4)}, {"pool-a": (1.0, 0), "pool-b": (3.0, 4)})
    event = first_payload(trigger(trace, {"price_below": 2.0}, timeout_s=1.0))
    assert event["reason"] == "timeout"


def test_fires_when_enough_instances_are_likely_available_ahead(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 1), "pool-b": (3.0, 0)}, {"pool-a": (3.0, 1), "pool-b": (3.0, 3)})
    conditions = {"min_available": 2, "min_probability": 0.9, "hours_ahead": 3.0, "forecaster": "persistence"}
    event = first_payload(rebuilt(trigger(trace, conditions, start=SWITCH - timedelta(hours=1))))
    assert event["reason"] == "availability"
    assert event["details"] == {"pool": "pool-b", "probability": 1.0, "slots": 3}
    assert datetime.fromisoformat(event["market_time"].replace("Z", "+00:00")) >= SWITCH


def test_the_availability_forecast_repeats_a_day_of_the_markets_slots():
    """On 8-hour slots a day is 3 slots: pool-0, full in the first slot of each day, will be full
    in the next one; 24 slots back lies before the history, where seasonal naive repeats the last."""
    market = make_market([[3.0]] * 9, [[4], [0], [0]] * 3, slot_hours=8.0)
    conditions = StartConditions(min_available=2, min_probability=0.9, hours_ahead=8.0, forecaster="seasonal-naive")
    assert conditions.availability(market) == {"pool": "pool-0", "probability": 1.0, "slots": 1}


def test_fires_when_the_schedulers_plan_starts_on_spot(tmp_path):
    # spot at 3 USD/h against 10 on demand, two instances in pool-a: CHC starts the job on spot now
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 2), "pool-b": (9.0, 2)}, {"pool-a": (3.0, 2), "pool-b": (9.0, 2)})
    event = first_payload(rebuilt(trigger(trace, {"job": JOB})))
    assert event["reason"] == "plan"
    assert event["details"]["allocation"]["spot"].get("pool-a", 0) >= 1
    assert event["details"]["plan"][0] == event["details"]["allocation"]


def test_the_plan_condition_waits_while_the_scheduler_would_not_start_on_spot(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 0), "pool-b": (9.0, 0)}, {"pool-a": (3.0, 0), "pool-b": (9.0, 0)})
    event = first_payload(trigger(trace, {"job": JOB}, timeout_s=1.0))
    assert event["reason"] == "timeout"


def test_timeout_falls_back_to_on_demand_instead_of_failing(tmp_path):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 0), "pool-b": (3.0, 0)}, {"pool-a": (3.0, 0), "pool-b": (3.0, 0)})
    original = trigger(trace, {"price_below": 2.0, "min_available": 1, "forecaster": "persistence"}, timeout_s=0.5)
    event = first_payload(original)
    assert event["start"] is True and event["reason"] == "timeout" and event["fallback"] == "on-demand"
    assert event["details"]["timeout_at"] == original.timeout_at
    assert first_payload(rebuilt(original))["reason"] == "timeout"  # restarted after the timeout: fires at once


def flaky_feed(monkeypatch, errors: list[Exception | None]) -> list[str]:
    """The trigger's market feed raises ``errors[k]`` at its k-th observation (``None``: observes);
    past the list it observes. The calls are listed in the returned list."""
    from airflow_provider_spotsched.triggers import market

    calls: list[str] = []

    class FlakyFeed(market.LiveMarketFeed):
        def history(self, now, pools=None):
            error = errors[len(calls)] if len(calls) < len(errors) else None
            calls.append("observed" if error is None else "failed")
            if error is not None:
                raise error
            return super().history(now, pools)

    monkeypatch.setattr(market, "LiveMarketFeed", FlakyFeed)
    return calls


def test_a_failed_market_observation_is_retried_at_the_next_poll(tmp_path, monkeypatch):
    calls = flaky_feed(monkeypatch, [ConnectionError("connection reset by peer")] * (OBSERVE_FAILURES_TO_FAIL - 1))
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4), "pool-b": (2.5, 4)}, {"pool-a": (1.5, 4), "pool-b": (2.5, 4)})
    event = first_payload(trigger(trace, {"price_below": 2.0}))
    assert event["reason"] == "price" and event["details"]["pool"] == "pool-a"
    assert calls == ["failed"] * (OBSERVE_FAILURES_TO_FAIL - 1) + ["observed"]


def test_a_value_error_from_a_source_that_has_answered_is_retried_not_taken_for_misconfiguration(tmp_path, monkeypatch):
    # the price drops a slot (a second) in: the first observation answers with no start, then one call's reply
    # cannot be read (a page cut short; requests' JSONDecodeError is a ValueError) and another's parts vanished
    from requests.exceptions import JSONDecodeError

    calls = flaky_feed(monkeypatch, [None, JSONDecodeError("Unterminated string", "{", 1), ValueError("parts kept vanishing")])
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 4), "pool-b": (2.5, 4)}, {"pool-a": (1.5, 4), "pool-b": (2.5, 4)})
    event = first_payload(trigger(trace, {"price_below": 2.0}, start=SWITCH - timedelta(hours=1)))
    assert event["reason"] == "price" and calls[:3] == ["observed", "failed", "failed"]


def test_a_value_error_before_the_source_ever_answered_fails_the_wait_at_once(tmp_path, monkeypatch):
    calls = flaky_feed(monkeypatch, [ValueError("options: region 'mars-1' is not a region")])
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4)}, {"pool-a": (1.5, 4)})
    with pytest.raises(ValueError, match="mars-1"):
        first_payload(trigger(trace, {"price_below": 2.0}))
    assert calls == ["failed"]


def test_a_market_source_that_keeps_failing_fails_the_wait_with_its_error(tmp_path, monkeypatch):
    calls = flaky_feed(monkeypatch, [ConnectionError("connection reset by peer")] * 100)
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4)}, {"pool-a": (1.5, 4)})
    with pytest.raises(RuntimeError, match=f"failed {OBSERVE_FAILURES_TO_FAIL} times in a row.*ConnectionError: connection reset"):
        first_payload(trigger(trace, {"price_below": 2.0}))
    assert len(calls) == OBSERVE_FAILURES_TO_FAIL


def test_bad_conditions_are_refused_with_the_field_to_fix(tmp_path):
    with pytest.raises(ValueError, match="no start condition"):
        StartConditions()
    with pytest.raises(ValueError, match="min_probability"):
        StartConditions(min_available=2, min_probability=1.5)
    with pytest.raises(ValueError, match="deadline_hours"):
        StartConditions(job={**JOB, "deadline_hours": 1.0})
    for name in ("oracle", "prophet"):  # the oracle reads the future: refused before the wait, not in the triggerer
        message = rf"^forecaster='{name}': not a forecaster of a live market; choose one of \[.*'sojourn-chain'\]$"
        with pytest.raises(ValueError, match=message):
            StartConditions(min_available=2, forecaster=name)
        with pytest.raises(ValueError, match=message):  # when the DAG is parsed, not when the task starts
            SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], min_available=2, forecaster=name)
    with pytest.raises(ValueError, match="market_start and seconds_per_slot"):
        SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], price_below=2.0, market_start="2025-10-11T04:00:00Z")


def test_pools_rendered_from_a_template_are_split_at_commas_not_into_letters():
    sensor = SpotMarketSensor(task_id="wait", market="gcp", pools="us-east4-a, europe-west1-c", price_below=2.0)
    assert sensor.trigger(datetime.now(timezone.utc)).pools == ["us-east4-a", "europe-west1-c"]


def test_the_sensor_defers_at_once_and_returns_the_event():
    from airflow.sdk.exceptions import TaskDeferred

    sensor = SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], price_below=2.0, timeout=timedelta(hours=2))
    before = datetime.now(timezone.utc)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.method_name == "execute_complete" and isinstance(deferred.value.trigger, SpotMarketTrigger)
    timeout_at = datetime.fromisoformat(deferred.value.trigger.timeout_at.replace("Z", "+00:00"))
    assert timedelta(hours=2) - timedelta(seconds=1) <= timeout_at - before <= timedelta(hours=2, seconds=60)
    event = {"start": True, "reason": "timeout", "fallback": "on-demand", "details": {"timeout_at": "x"}}
    assert sensor.execute_complete({}, event) == event


SENSOR_DAG = '''
import json
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, task

from airflow_provider_spotsched.sensors.market import SpotMarketSensor

with DAG("spotsched_market_sensor_test", schedule=None, start_date=datetime(2025, 1, 1), catchup=False) as dag:
    wait = SpotMarketSensor(
        task_id="wait_for_market", market={trace!r}, pools=["pool-a", "pool-b"], price_below=2.0,
        market_start={start!r}, seconds_per_slot=1.0, poke_interval=0.2, timeout=120,
    )

    @task
    def start_training(event: dict) -> None:
        Path({out!r}).write_text(json.dumps(event))

    start_training(wait.output)

if __name__ == "__main__":
    dag.test()
'''


def test_the_sensor_runs_in_a_dag_and_hands_its_event_downstream(tmp_path, airflow_home: AirflowHome):
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (3.0, 4), "pool-b": (2.5, 4)}, {"pool-a": (1.5, 4), "pool-b": (2.5, 4)})
    out = tmp_path / "event.json"
    dags = tmp_path / "dags"  # dag.test() runs a DAG of the DAGs folder (it serialises it from there)
    dags.mkdir()
    dag_file = dags / "sensor_dag.py"
    start = (SWITCH - timedelta(hours=1)).isoformat()
    dag_file.write_text(SENSOR_DAG.format(trace=str(trace), start=start, out=str(out)))
    env = {**airflow_home.env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    done = subprocess.run([sys.executable, str(dag_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    event = json.loads(out.read_text())
    assert event["reason"] == "price" and event["details"]["pool"] == "pool-a" and event["start"] is True


def test_a_watched_pool_without_ticks_counts_as_unavailable_and_no_data_waits_for_the_timeout(tmp_path):
    # pool-b never ticks: unknown capacity is 0, so the cheap pool-a still starts the job, and nothing fails
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4)}, {"pool-a": (1.5, 4)})
    event = first_payload(trigger(trace, {"price_below": 2.0}))
    assert event["reason"] == "price" and event["details"] == {"pool": "pool-a", "spot_price": 1.5, "available": 4}
    # a market with no evidence at all (the replay runs past the trace's end): wait, then on demand
    late = first_payload(trigger(trace, {"price_below": 2.0}, timeout_s=0.5, start=T0 + timedelta(days=10)))
    assert late["reason"] == "timeout" and late["fallback"] == "on-demand"


def test_a_pool_the_trace_lacks_is_refused_by_the_sensor_before_it_defers():
    """A typo'd pool would count as unavailable: the wait would time out and "succeed" on on-demand."""
    sensor = SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a", "us-east4-z"], price_below=100.0)
    with pytest.raises(ValueError, match=r"^pools=\['us-east4-a', 'us-east4-z'\]: unknown pool\(s\) \['us-east4-z'\]; "
                                         r"the market's pools are \[.*'us-east4-a', 'us-east4-b'.*\]$"):
        sensor.execute({})  # raised, not TaskDeferred
    missing = {"kind": "trace", "options": {"path": "/nonexistent/missing.csv"}}  # read then too: refused, not skipped
    with pytest.raises(ValueError, match="missing.csv"):
        SpotMarketSensor(task_id="wait", market=missing, pools=["pool-a"], price_below=2.0, soft_fail=True).execute({})


def test_a_pool_outside_a_live_markets_zones_is_refused_and_a_silent_zone_of_it_is_only_unavailable(tmp_path):
    """A live market offers the zones its options name: a typo is refused before the wait, while a
    configured zone without evidence yet (no placement score, no launch) counts as unavailable and
    the wait goes on, even when none of the watched pools ticks and others do."""
    aws = {"kind": "aws", "options": {"instance_type": "p3.2xlarge", "availability_zones": ["us-east-1a", "us-east-1b"],
                                      "on_demand_price": 3.06}}
    sensor = SpotMarketSensor(task_id="wait", market=aws, pools=["us-east-1a", "us-east-1z"], price_below=1.0)
    with pytest.raises(ValueError, match=r"^pools=\['us-east-1a', 'us-east-1z'\]: unknown pool\(s\) \['us-east-1z'\]; "
                                         r"the market's pools are \['us-east-1a', 'us-east-1b'\]$"):
        sensor.execute({})  # raised, not TaskDeferred
    trace = write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4)}, {"pool-a": (1.5, 4)})
    silent = first_payload(trigger(trace, {"price_below": 2.0}, timeout_s=0.5, pools=("pool-z",)))
    assert silent["reason"] == "timeout" and silent["fallback"] == "on-demand"


@pytest.mark.parametrize("job", ["{{ params.job | tojson }}", {**JOB, "work": "{{ params.work }}", "max_instances": "{{ params.n }}"}])
def test_a_job_that_a_template_renders_to_text_is_read_back_as_the_job(job):
    """Airflow renders templates to text by default: the whole job as JSON, or numbers inside it."""
    from airflow.sdk import DAG

    with DAG("templated_job", schedule=None, start_date=datetime(2025, 1, 1)):
        sensor = SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], job=job)
    sensor.render_template_fields({"params": {"job": JOB, "work": 400, "n": 2}})
    conditions = sensor.trigger(datetime.now(timezone.utc)).conditions
    assert conditions["job"] == JOB and isinstance(conditions["job"]["max_instances"], int)


@pytest.mark.parametrize(("job", "message"), [
    ("{'work': 400.0}", r"job=.*neither a dict nor JSON text of an object.*\| tojson"),
    ({**JOB, "work": "lots"}, r"job.work='lots' is not a number"),
    ({**JOB, "max_instances": "2.5"}, r"job.max_instances='2.5' is not an integer"),
])
def test_a_job_rendered_to_other_text_is_refused_naming_the_field(job, message):
    sensor = SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], job=job)
    with pytest.raises(ValueError, match=message):
        sensor.trigger(datetime.now(timezone.utc))


@pytest.mark.parametrize("flag", ["soft_fail", "never_fail", None])
def test_a_failed_wait_in_the_worker_is_skipped_under_soft_fail_as_a_failed_trigger_is(tmp_path, monkeypatch, flag):
    from airflow.sdk.exceptions import AirflowSkipException

    flaky_feed(monkeypatch, [ValueError("options: region 'mars-1' is not a region")])
    trace = {"kind": "trace", "options": {"path": str(write_trace(tmp_path / "t.csv", {"pool-a": (1.5, 4)}, {"pool-a": (1.5, 4)}))}}
    flags = {flag: True} if flag else {}
    sensor = SpotMarketSensor(task_id="wait", market=trace, pools=["pool-a"], price_below=2.0, deferrable=False, **flags)
    with pytest.raises(AirflowSkipException if flag else ValueError, match="mars-1"):
        sensor.execute({})


def test_reschedule_mode_without_deferral_is_refused_naming_both_parameters():
    """The wait in the worker is one loop that cannot give the worker back between observations."""
    with pytest.raises(ValueError, match=r"mode='reschedule' with deferrable=False.*deferrable=True.*mode='poke'"):
        SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], price_below=2.0, deferrable=False, mode="reschedule")
    SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], price_below=2.0, mode="reschedule")  # defers: no slot held


def test_less_history_than_a_slot_is_refused_before_the_wait_naming_both_fields(tmp_path):
    """Not in run(), in the triggerer, after the task deferred."""
    message = r"history_hours >= slot_hours, got 2.0 and 1.0"
    with pytest.raises(ValueError, match=message):
        SpotMarketSensor(task_id="wait", market="gcp", pools=["us-east4-a"], price_below=2.0, slot_hours=2.0, history_hours=1.0)
    with pytest.raises(ValueError, match=message):
        SpotMarketTrigger(market={"kind": "trace", "options": {"path": "gcp"}}, pools=["us-east4-a"], conditions={"price_below": 2.0},
                          timeout_at=datetime.now(timezone.utc).isoformat(), slot_hours=2.0, history_hours=1.0)
