"""The fine-tune operator refuses bad arguments before anything launches: at DAG parse time where
the argument is no template, else when the task starts (a template renders only then).

The operator is tests/test_operator.py's, on the local backend over the replayed GCP trace.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.execution.environment import SpotEnvironment
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.market.feed import ReplayedMarket
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.operators import fine_tune
from airflow_provider_spotsched.operators.fine_tune import STATE_KEY
from airflow_provider_spotsched.operators.solver import SpotAllocationSolverOperator
from airflow_provider_spotsched.scheduling.model import JobError
from tests.task_context import TaskContext, TaskStateStore
from tests.test_backend_gce import gce, make_backend  # noqa: F401 (a fixture)
from tests.test_operator import MARKET_START, operator, start


def nothing_launched(tmp_path: Path) -> bool:
    jobs = tmp_path / "local" / "jobs"
    return not jobs.exists() or not any(jobs.iterdir())


def test_a_pool_named_twice_is_refused_before_anything_launches(tmp_path):
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"^pools=\['us-east4-a', 'us-east4-a'\]: names \['us-east4-a'\] more than once"):
        operator(tmp_path, pools=["us-east4-a", "us-east4-a"]).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_pools_rendered_to_one_string_are_read_comma_separated(tmp_path):
    """A template renders to text: "us-east4-a,europe-west1-c" is two pools, not 25 characters."""
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, pools="us-east4-a,europe-west1-c")
    start(op, context)
    try:
        assert context["task_state_store"].get(STATE_KEY)["run"]["config"]["pools"] == ["us-east4-a", "europe-west1-c"]
    finally:
        op.on_kill()


def test_max_instances_over_the_deployments_limit_is_refused_before_anything_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__MAX_INSTANCES_LIMIT", "1")
    with pytest.raises(JobError, match=r"^max_instances=2: more than the limit of 1 instances"):
        operator(tmp_path, max_instances=2).execute(TaskContext(TaskStateStore()))
    for bad in ("many", "0", "-4"):  # 0 or less would refuse every job with a limit nobody means
        monkeypatch.setenv("AIRFLOW__SPOTSCHED__MAX_INSTANCES_LIMIT", bad)
        with pytest.raises(JobError, match=rf"^\[spotsched\] max_instances_limit='{bad}': not a whole number of instances >= 1"):
            operator(tmp_path).execute(TaskContext(TaskStateStore()))
    assert nothing_launched(tmp_path)


def test_a_bad_min_deferral_seconds_is_refused_before_anything_launches(tmp_path, monkeypatch):
    for bad in ("soon", "-1", "nan", "inf"):  # inf would never defer: every wait would hold a worker slot
        monkeypatch.setenv("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", bad)
        with pytest.raises(JobError, match=rf"^\[spotsched\] min_deferral_seconds='{bad}': not a finite number of seconds >= 0"):
            operator(tmp_path).execute(TaskContext(TaskStateStore()))
    assert nothing_launched(tmp_path)


def test_max_instances_over_the_accounts_quota_is_refused_before_anything_launches(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalBackend, "instance_limit", lambda self: 1)
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"^max_instances=2: more than the 1 instance\(s\) the local account may run"):
        operator(tmp_path, max_instances=2).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_poll_interval_below_zero_fails_when_the_dag_is_parsed_and_nothing_launches(tmp_path):
    for bad, shown in ((-1, "-1"), (True, "True"), (float("nan"), "nan")):
        with pytest.raises(ValueError, match=rf"^poll_interval={shown}: "):
            operator(tmp_path, poll_interval=bad)
    assert not (tmp_path / "local").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "azure"}, r"^backend='azure' is unknown; choose one of \['ec2', 'gce', 'local'\]"),
        ({"backend": "ec2", "compute_conn_id": None}, r"^backend='ec2' needs compute_conn_id"),
        ({"policy": "magic"}, r"^policy='magic': not a registered policy; choose one of \['chc', "),
        ({"forecaster": "oracle"}, r"^forecaster='oracle': not a forecaster of a live market; choose one of \['arima', "),
        ({"slot_hours": 0}, r"^slot_hours=0: must be >= 0.0166667; a slot lasts a minute or more"),
        ({"slot_hours": "1"}, r"^slot_hours='1': text, not a number"),
        ({"hard_deadline_factor": 0.5}, r"^hard_deadline_factor=0.5: must be >= 1; "),
        ({"reconfig_overhead_hours": -0.1}, r"^reconfig_overhead_hours=-0.1: must be >= 0; "),
        ({"reconfig_overhead_hours": 1.0}, r"^reconfig_overhead_hours=1: must be < slot_hours=1; "),
        ({"work": True}, r"^work=True: a boolean, not a number"),
        ({"work": 0}, r"^work=0: must be > 0; "),
        ({"value": -1}, r"^value=-1: must be >= 0; "),
        ({"max_instances": 0}, r"^max_instances=0: must be >= 1; "),
        ({"min_instances": 1.5}, r"^min_instances=1.5: not an integer"),
        ({"throughput": {"alpha": float("inf")}}, r"^throughput.alpha=inf: not a finite number"),
        ({"throughput": {"alpha": 9000, "bta": 4000}}, r"^unknown throughput field\(s\) \['bta'\]; use alpha and beta"),
        ({"throughput": {"beta": 4000}}, r"^throughput=\{'beta': 4000\}: not an object with alpha"),
        ({"work": None, "steps": 0, "batch_size": 8}, r"^steps=0: must be >= 1"),
        ({"budget": 0}, r"^budget=0: not a number of USD > 0"),
        ({"deadline": -1}, r"^deadline=-1: must be a duration > 0 from the task's start"),
        ({"deadline": timedelta(0)}, r"^deadline=datetime.timedelta\(0\): must be a duration > 0"),
        ({"deadline": datetime(2030, 1, 1)}, r"^deadline 2030-01-01T00:00:00 has no time zone"),
        ({"deadline": datetime(2020, 1, 1, tzinfo=timezone.utc)}, r"has passed; give a later deadline"),
        ({"regions": ["us-east4", "us-east4"]}, r"^regions=\['us-east4', 'us-east4'\]: names \['us-east4'\] more than once"),
        ({"deferrable": "yes"}, r"^deferrable='yes': not a bool"),
        ({"backend": "gce", "compute_conn_id": "gcp", "checkpoint_uri": "/data/ckpt"},
         r"^checkpoint_uri='/data/ckpt': a path on this machine, which the gce instances cannot reach .* use backend='local'$"),
        ({"backend": "ec2", "compute_conn_id": "aws", "checkpoint_uri": "file:///data/ckpt"},
         r"^checkpoint_uri='file:///data/ckpt': a path on this machine, which the ec2 instances cannot reach .*"
         r"\(s3://BUCKET/PREFIX or gs://BUCKET/PREFIX\)"),
    ],
    ids=lambda value: None if isinstance(value, str) else "-".join(f"{k}={v}" for k, v in value.items()),
)
def test_an_argument_no_template_changes_is_refused_when_the_dag_is_parsed(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        operator(tmp_path, **overrides)
    assert not (tmp_path / "local").exists()


def test_templated_arguments_holding_jinja_are_left_for_the_task_to_check(tmp_path):
    op = operator(tmp_path, work="{{ params.samples }}", value="{{ params.value }}", max_instances="{{ params.n }}",
                  deadline="{{ params.deadline }}", budget="{{ params.budget }}", pools="{{ params.pools }}",
                  throughput={"alpha": "{{ params.alpha }}"}, regions="us-east4")
    assert op.regions == ("us-east4",)  # one string is one region, not eight characters


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"policy": "magic"}, r"^policy='magic': not a registered policy"), ({"slot_hours": 0}, r"^slot_hours=0: must be >= 0.0166667"),
     ({"history_hours": "48"}, r"^history_hours='48': text, not a number")],
)
def test_the_solver_operator_refuses_its_untemplated_arguments_when_the_dag_is_parsed(overrides, message):
    with pytest.raises(JobError, match=message):
        SpotAllocationSolverOperator(task_id="solve", market="gcp", **overrides)


@pytest.mark.parametrize(("slot_hours", "history_hours", "least"), [(1.0, -1, 24), (1.0, 12, 24), (48.0, 24.0, 48)])
def test_the_solver_operator_refuses_less_history_than_its_market_read_needs_when_the_dag_is_parsed(
    slot_hours, history_hours, least
):
    """As the forecast operator does: every run would fail reading its market (slot_market_at)."""
    message = rf"^history_hours={history_hours!r}: a forecast needs .* give history_hours >= {least}$"
    with pytest.raises(ValueError, match=message):
        SpotAllocationSolverOperator(task_id="solve", market="gcp", slot_hours=slot_hours, history_hours=history_hours)


def test_the_solver_operator_checks_the_history_against_the_jobs_slot_length_not_its_own():
    """The run decides in the job's slots (its slot_hours overrides the operator's): 30 h of history
    cannot hold the slot before at's for 48-h slots, and is plenty for 2-h ones."""
    job = {"work": 100.0, "deadline_hours": 96.0, "max_instances": 1, "value": 100.0}
    with pytest.raises(ValueError, match=r"^history_hours=30: a forecast needs 2 slots of 48 h .* give history_hours >= 48$"):
        SpotAllocationSolverOperator(task_id="solve", market="gcp", job={**job, "slot_hours": 48}, history_hours=30)
    SpotAllocationSolverOperator(task_id="solve", market="gcp", job={**job, "slot_hours": 2}, slot_hours=48, history_hours=30)
    with pytest.raises(JobError, match=r"^slot_hours=0: must be >= 0.0166667"):
        SpotAllocationSolverOperator(task_id="solve", market="gcp", job={**job, "slot_hours": 0}, history_hours=30)


def test_the_solver_operator_checks_a_templated_slot_length_when_the_task_starts(monkeypatch):
    """Text may be a template: it renders only when the task runs, and is checked then, before the market is read."""
    job = {"work": 100.0, "deadline_hours": 96.0, "max_instances": 1, "throughput": {"alpha": 10.0}, "value": 100.0,
           "slot_hours": "{{ params.slot }}"}
    op = SpotAllocationSolverOperator(task_id="solve", market="gcp", job=job, pools="us-east4-a", history_hours=30, job_id="t",
                                      at=MARKET_START)
    op.job = {**job, "slot_hours": "48"}  # as rendered
    monkeypatch.setattr("airflow_provider_spotsched.operators.solver.slot_market_at", pytest.fail)
    with pytest.raises(ValueError, match=r"^history_hours=30.0: a forecast needs 2 slots of 48 h .* give history_hours >= 48$"):
        op.execute({"ti": None})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"max_instances": 3}, r"^training_config's batch_size=4 is split evenly .* a world size of 3 \(max_instances=3\)"),
])
def test_a_job_the_default_runtime_cannot_run_is_refused_before_anything_launches(tmp_path, overrides, message):
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, command=None, training_config={"samples": 160, "batch_size": 4}, **overrides)
    with pytest.raises(JobError, match=message):
        op.execute(context)


def test_a_hugging_face_token_secret_on_the_local_backend_is_refused_before_anything_launches(tmp_path):
    """The secret is read on cloud instances with their identity; locally there is no such identity."""
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"^hf_token_secret is read on cloud instances \(ec2, gce\), not with backend='local'"):
        operator(tmp_path, hf_token_secret="projects/p/secrets/hf/versions/latest").execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_a_checkpoint_uri_rendered_to_a_path_on_the_worker_is_refused_on_a_cloud_backend_before_anything_launches(
    tmp_path, monkeypatch, gce
):
    """The VMs run on other machines, out of reach of the worker's disk: each would train from scratch and a
    preemption would lose the work. A template renders only when the task starts; the backend refuses it then."""
    op = operator(tmp_path, backend="gce", compute_conn_id="gcp", checkpoint_uri="{{ params.checkpoints }}")
    op.checkpoint_uri = str(tmp_path / "checkpoint")  # as rendered
    env = SpotEnvironment(backend=make_backend(gce), market=ReplayedMarket(cached_trace(GCP_TRACE), 1.0, 48))
    monkeypatch.setattr(fine_tune, "build_environment", lambda spec, slot_hours, market_source: env)
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=rf"^checkpoint_uri='{re.escape(op.checkpoint_uri)}': a path on this machine, "
                                       r"which the gce instances cannot reach"):
        op.execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and gce.requests == []


@pytest.mark.parametrize("pool", ["europe-west10-a", "europe-west12-b", "us-east4-a"])
def test_a_pool_whose_region_only_starts_like_one_of_regions_is_refused_before_anything_launches(tmp_path, pool):
    """europe-west10 is no part of europe-west1: a region is matched whole, not as a prefix of the zone."""
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=rf"^pools \['{pool}'\] lie outside regions=\['europe-west1'\]"):
        operator(tmp_path, pools=[pool], regions=["europe-west1"]).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_zones_of_the_regions_given_pass_the_region_check(tmp_path):
    """A GCE zone is its region, a dash and a letter; an EC2 availability zone its region and a letter."""
    operator(tmp_path, pools=["europe-west1-c", "us-east-1a"], regions=["europe-west1", "us-east-1"])._check_regions()


def test_a_deadline_rendered_to_text_is_read_as_hours(tmp_path):
    """A template renders hours to text ("{{ params.hours }}" -> "6"): that is 6 hours, not a bad timestamp."""
    context = TaskContext(TaskStateStore())
    op = operator(tmp_path, deadline="6")
    start(op, context)
    try:
        assert context["task_state_store"].get(STATE_KEY)["run"]["config"]["job"]["deadline_hours"] == 6.0
    finally:
        op.on_kill()


@pytest.mark.parametrize(
    ("deadline", "message"),
    [("-1", r"^deadline='-1': must be a duration > 0"), ("nan", r"^deadline=nan: not a finite number"),
     ("soon", r"^deadline='soon': neither hours nor an ISO-8601 timestamp; give hours")],
)
def test_a_deadline_rendered_to_bad_text_is_refused_before_anything_launches(tmp_path, deadline, message):
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=message):
        operator(tmp_path, deadline=deadline).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_dict_parameters_rendered_to_json_text_are_read_as_dicts(tmp_path):
    """A template renders a dict to JSON text ("{{ params.opts | tojson }}"); the run reads the object."""
    context = TaskContext(TaskStateStore())
    options = {"workdir": str(tmp_path / "local"), "seconds_per_slot": 3.0, "market_start": MARKET_START}
    op = operator(tmp_path, backend_options=json.dumps(options), policy="chc", policy_params='{"window": 4}',
                  throughput='{"alpha": 60}')
    start(op, context)
    try:
        config = context["task_state_store"].get(STATE_KEY)["run"]["config"]
        assert config["policy_params"] == {"window": 4} and config["job"]["throughput"]["alpha"] == 60.0
        assert not nothing_launched(tmp_path)  # in the workdir the rendered backend_options named
    finally:
        op.on_kill()


def test_a_throughput_rendered_with_an_unknown_key_is_refused_before_anything_launches(tmp_path):
    """A typo such as "bta" would otherwise plan with beta = 0, as if the key were absent."""
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"^unknown throughput field\(s\) \['bta'\]; use alpha and beta"):
        operator(tmp_path, throughput='{"alpha": 60, "bta": 4}').execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_a_training_config_rendered_to_json_text_is_read_as_the_config(tmp_path):
    """Its batch_size is read from the text: the same refusal as for the dict, not 'got str'."""
    op = operator(tmp_path, command=None, training_config='{"samples": 160, "batch_size": 4}', max_instances=3)
    with pytest.raises(JobError, match=r"^training_config's batch_size=4 is split evenly"):
        op.execute(TaskContext(TaskStateStore()))
    assert nothing_launched(tmp_path)


@pytest.mark.parametrize("name", ["backend_options", "policy_params", "training_config", "throughput"])
@pytest.mark.parametrize("text", ["{{ not rendered }}", "[1, 2]"])
def test_a_dict_parameter_rendered_to_no_json_object_is_refused_naming_it(tmp_path, name, text):
    context = TaskContext(TaskStateStore())
    overrides = {"command": None} if name == "training_config" else {}
    with pytest.raises(JobError, match=rf"^{name}='{re.escape(text)}': neither a dict nor JSON text of an object; give a dict"):
        operator(tmp_path, **{name: text, **overrides}).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


@pytest.mark.parametrize(
    ("steps", "batch_size", "message"),
    [("-10", "-16", r"^steps=-10: must be >= 1"), ("10", "0", r"^batch_size=0: must be >= 1"),
     ("2.5", "64", r"^steps='2.5' is not an integer")],
)
def test_steps_and_batch_size_rendered_to_no_count_are_refused_before_anything_launches(tmp_path, steps, batch_size, message):
    """The parse-time checks hold for the rendered text too: -10 * -16 is no job of 160 samples."""
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=message):
        operator(tmp_path, work=None, steps=steps, batch_size=batch_size).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)


def test_a_market_source_rendered_to_json_text_is_read_as_the_specs_dict(tmp_path):
    """Not as a trace path named '{"kind": ...}': a template renders the spec's dict to JSON text."""
    spec = operator(tmp_path, market_source='{"kind": "trace", "options": {"path": "gcp"}}')._market_source()
    assert isinstance(spec, MarketSpec) and (spec.kind, spec.options) == ("trace", {"path": "gcp"})
    for text, message in (('{"path": "gcp"}', r"^market_source='\{\"path\": \"gcp\"\}': a JSON object without 'kind'"),
                          ("{oops", r"^market_source='\{oops': neither a dict nor JSON text of an object")):
        with pytest.raises(JobError, match=message):
            operator(tmp_path, market_source=text)._market_source()
