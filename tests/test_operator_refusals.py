"""The fine-tune operator refuses bad arguments before anything launches: at DAG parse time where
the argument is no template, else when the task starts (a template renders only then).

The operator is tests/test_operator.py's, on the local backend over the replayed GCP trace.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.operators.fine_tune import STATE_KEY
from airflow_provider_spotsched.scheduling.model import JobError
from tests.task_context import TaskContext, TaskStateStore
from tests.test_operator import operator, start


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
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__MAX_INSTANCES_LIMIT", "many")
    with pytest.raises(JobError, match=r"^\[spotsched\] max_instances_limit='many': not an integer"):
        operator(tmp_path).execute(TaskContext(TaskStateStore()))
    assert nothing_launched(tmp_path)


def test_max_instances_over_the_accounts_quota_is_refused_before_anything_launches(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalBackend, "instance_limit", lambda self: 1)
    context = TaskContext(TaskStateStore())
    with pytest.raises(JobError, match=r"^max_instances=2: more than the 1 instance\(s\) the local account may run"):
        operator(tmp_path, max_instances=2).execute(context)
    assert context["task_state_store"].get(STATE_KEY) is None and nothing_launched(tmp_path)
