"""The report plugin in an Airflow deployment: XComs from a real run, Airflow's auth, the link."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.report_airflow import (
    DAG_ID,
    FINISHED_TASK,
    IN_PROGRESS_SLOTS,
    IN_PROGRESS_TASK,
    OTHER_TASK,
    SILENT_TASK,
    ReportDb,
    serve_reports,
    shared_report_db,
    token,
)
from tests.run_log_samples import CHARTS, POOLS, sample_decision_log, sample_result


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> ReportDb:
    return shared_report_db(tmp_path_factory)


@pytest.fixture(scope="module")
def client(db):
    with serve_reports(db) as host:
        with TestClient(host) as test_client:
            yield test_client


@pytest.fixture
def run_id(db) -> str:
    return db.run_id


def _report(run_id: str, task_id: str = FINISHED_TASK, dag_id: str = DAG_ID) -> str:
    return f"/spotsched/runs/{dag_id}/{run_id}/{task_id}"


def _bearer(role: str | None = "viewer") -> dict[str, str]:
    return {"Authorization": f"Bearer {token(role)}"}


def test_the_report_of_a_finished_run_is_served_to_a_dag_reader(client, run_id):
    response = client.get(_report(run_id), headers=_bearer())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    result = sample_result()
    assert f"{DAG_ID} / {run_id} / {FINISHED_TASK}" in html
    assert "finished, deadline met" in html and f"{result['cost']:,.2f} USD" in html
    assert len(re.findall(r"<svg\b", html)) == CHARTS + len(POOLS)
    assert f'href="{FINISHED_TASK}/data.json"' in html


def test_the_raw_log_and_result_are_served_as_json(client, run_id):
    response = client.get(f"{_report(run_id)}/data.json", headers=_bearer())
    assert response.status_code == 200, response.text
    data = response.json()
    assert (data["dag_id"], data["run_id"], data["task_id"], data["map_index"]) == (DAG_ID, run_id, FINISHED_TASK, -1)
    assert data["decision_log"] == sample_decision_log()
    assert data["result"] == sample_result()


def test_the_ui_session_cookie_is_accepted(client, run_id):
    client.cookies.set("_token", token("viewer"))
    try:
        response = client.get(_report(run_id))
    finally:
        client.cookies.clear()
    assert response.status_code == 200, response.text


def test_a_run_in_progress_shows_the_slots_so_far(client, run_id):
    response = client.get(_report(run_id, IN_PROGRESS_TASK), headers=_bearer())
    assert response.status_code == 200, response.text
    assert "in progress" in response.text and f"<th>Slots decided</th><td>{IN_PROGRESS_SLOTS}</td>" in response.text
    data = client.get(f"{_report(run_id, IN_PROGRESS_TASK)}/data.json", headers=_bearer()).json()
    assert data["result"] is None and len(data["decision_log"]) == IN_PROGRESS_SLOTS


@pytest.mark.parametrize("task_id", [SILENT_TASK, OTHER_TASK])
def test_a_task_of_another_operator_says_it_has_no_spot_run(client, run_id, task_id):
    """Every task instance has the report tab; one that is no spot run says so, whatever it returned."""
    response = client.get(_report(run_id, task_id), headers=_bearer())
    assert response.status_code == 200, response.text
    assert "This task runs _PythonDecoratedOperator, not DeadlineSpotFineTuneOperator: it has no spot run to report" \
        in response.text
    live = client.get(f"{_report(run_id, task_id)}/live.json", headers=_bearer())
    assert live.status_code == 200, live.text
    assert "it has no spot run to report" in live.json()["html"]
    data = client.get(f"{_report(run_id, task_id)}/data.json", headers=_bearer())
    assert data.status_code == 200, data.text
    assert (data.json()["decision_log"], data.json()["result"]) == ([], None)


@pytest.mark.parametrize("where, suffix, message", [
    ({"run_id": "no_such_run"}, "", f"DAG '{DAG_ID}' has no run 'no_such_run'"),
    ({"task_id": "no_such_task"}, "", "has no task 'no_such_task'"),
    ({}, "?map_index=3", "has no task 'finetune' with map_index 3"),
    ({}, "/data.json?map_index=0", "has no task 'finetune' with map_index 0"),  # the task is not mapped
    ({"dag_id": "no_such_dag"}, "/data.json", "DAG 'no_such_dag' has no run"),
    ({"dag_id": "x" * 300}, "", "DAG 'xxxx"),  # longer than any id the database holds
    ({"task_id": "%20"}, "", "has no task ' '"),
])
def test_an_unknown_run_or_task_is_a_404_naming_it(client, run_id, where, suffix, message):
    response = client.get(_report(**{"run_id": run_id, **where}) + suffix, headers=_bearer())
    assert response.status_code == 404
    assert message in response.json()["detail"]


REPORT = "/spotsched/runs/{dag_id}/{run_id}/{task_id}"


@pytest.mark.parametrize("suffix", ["", "/data.json", "/live.json"])
@pytest.mark.parametrize(
    ("map_index", "error"),
    [
        ("", "int_parsing"),
        ("abc", "int_parsing"),
        ("1.5", "int_parsing"),
        ("-2", "greater_than_equal"),
        ("2147483648", "less_than_equal"),  # past the database's 32-bit column
        ("99999999999999999999", "less_than_equal"),  # past SQLite's 64-bit integers: this was a 500
    ],
)
def test_a_map_index_that_cannot_name_a_task_is_a_422_naming_it(client, run_id, suffix, map_index, error):
    response = client.get(f"{_report(run_id)}{suffix}?map_index={map_index}", headers=_bearer())
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["query", "map_index"] and detail["type"] == error


def test_the_largest_map_index_is_looked_up_and_not_found(client, run_id):
    response = client.get(f"{_report(run_id)}?map_index=2147483647", headers=_bearer())
    assert response.status_code == 404
    assert "has no task 'finetune' with map_index 2147483647" in response.json()["detail"]


@pytest.mark.parametrize(
    "path",
    ["/spotsched/runs", f"/spotsched/runs/{DAG_ID}", "/spotsched/runs/{dag_id}/{run_id}", "/spotsched/runs//{run_id}/finetune",
     "/spotsched/runs/{dag_id}//finetune", "/spotsched/runs/{dag_id}/{run_id}/", "/spotsched/runs/{dag_id}/{run_id}/finetune/x"],
    ids=["no-ids", "dag-id-only", "no-task-id", "empty-dag-id", "empty-run-id", "empty-task-id", "extra-segment"],
)
def test_a_path_with_an_id_missing_is_a_404_naming_the_routes(client, run_id, path):
    path = path.format(dag_id=DAG_ID, run_id=run_id)
    response = client.get(path, headers=_bearer())
    assert response.status_code == 404
    assert response.json()["detail"] == (
        f"no page at {path}: a report is at {REPORT} (its data at {REPORT}/data.json, its live view at "
        f"{REPORT}/live.json, each id non-empty) and the fleet at /spotsched/fleet")


REPORT = "/spotsched/runs/{dag_id}/{run_id}/{task_id}"


@pytest.mark.parametrize("suffix", ["", "/data.json", "/live.json"])
def test_requests_without_a_valid_token_are_refused(client, run_id, suffix):
    path = _report(run_id) + suffix
    assert client.get(path).status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403
    # signed by this deployment, but for a user with no role: authenticated, not allowed to read the DAG
    refused = client.get(path, headers=_bearer(role=None))
    assert refused.status_code == 403 and "finetune" not in refused.text


def test_the_api_docs_are_not_exposed(client):
    assert client.get("/spotsched/openapi.json", headers=_bearer()).status_code == 404
    assert client.get("/spotsched/docs", headers=_bearer()).status_code == 404


def test_the_extra_link_points_at_the_report(monkeypatch):
    from airflow.sdk.types import TaskInstanceKey

    from airflow_provider_spotsched.links.report import SpotRunReportLink

    link = SpotRunReportLink()
    assert link.name == "Spot run report"
    key = TaskInstanceKey(dag_id=DAG_ID, task_id=FINISHED_TASK, run_id="manual__2025-10-06T00:00:00+00:00",
                          try_number=1, map_index=-1)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/team-a/")
    assert link.get_link(None, ti_key=key) == (
        f"https://airflow.example.com/team-a/spotsched/runs/{DAG_ID}/"
        "manual__2025-10-06T00%3A00%3A00%2B00%3A00/finetune")
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "")
    mapped = TaskInstanceKey(dag_id="d", task_id="group.t", run_id="r 1", try_number=1, map_index=2)
    assert link.get_link(None, ti_key=mapped) == "/spotsched/runs/d/r%201/group.t?map_index=2"


def test_the_link_the_worker_stored_leads_to_the_report(client, run_id):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from airflow_provider_spotsched.links.report import SpotRunReportLink, run_report_path

    # Airflow 3 computes extra links on the worker when the task instance ends and keeps them in XCom
    with create_session() as session:
        query = XComModel.get_many(run_id=run_id, key=SpotRunReportLink().xcom_key, dag_ids=DAG_ID,
                                   task_ids=FINISHED_TASK, limit=1)
        link = XComModel.deserialize_value(session.scalars(query).one())
    assert link == run_report_path(DAG_ID, run_id, FINISHED_TASK)  # no [api] base_url: root-relative
    response = client.get(link, headers=_bearer())
    assert response.status_code == 200 and "finished, deadline met" in response.text


def test_the_tabs_unfilled_map_index_placeholder_names_the_unmapped_task(client, run_id):
    """The UI fills {MAP_INDEX} in the tab's link only for a mapped task instance."""
    response = client.get(_report(run_id) + "?map_index={MAP_INDEX}", headers=_bearer())
    assert response.status_code == 200, response.text
    assert response.text == client.get(_report(run_id), headers=_bearer()).text


def test_the_live_view_is_the_report_body_with_its_version(client, run_id):
    view = client.get(f"{_report(run_id)}/live.json", headers=_bearer()).json()
    assert view["state"] == "success" and view["live"] is False and view["slots"] == len(sample_decision_log())
    page = client.get(_report(run_id), headers=_bearer()).text
    assert view["html"] in page and f'data-version="{view["version"]}"' in page
    assert "data-live=" not in page, "a task that ended is not polled"
