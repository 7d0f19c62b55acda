"""The fleet dashboard in an Airflow deployment: runs from real dag.test() runs, Airflow's auth.

The deployment (:mod:`tests.fleet_airflow`) holds two DAGs' spot runs; the expected figures are
summed here from the runs' ``return_value`` XComs read back through Airflow's own XCom model,
not from the dashboard's code.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urljoin

import pytest
from fastapi.testclient import TestClient

from tests.fleet_airflow import (
    DAG_A,
    DAG_B,
    DATES,
    FAILED_DATE,
    IN_FLIGHT_DATE,
    OPERATOR,
    SELECTOR_VARIABLE,
    SWEEP,
    FleetDb,
    job_ids,
    shared_fleet_db,
)
from tests.fleet_samples import CONTEXTS, selector_document
from tests.report_airflow import serve_reports, token
from tests.run_log_samples import sample_in_progress_log, sample_result

FLEET = "/spotsched/fleet"
DATA = FLEET + "/data.json"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> FleetDb:
    return shared_fleet_db(tmp_path_factory)


@pytest.fixture(scope="module")
def client(db):
    from airflow.models.crypto import get_fernet

    with serve_reports(db) as host:
        get_fernet.cache_clear()  # the deployment's Fernet key decrypts its Variable
        try:
            with TestClient(host) as test_client:
                yield test_client
        finally:
            get_fernet.cache_clear()


def _as(username: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token('viewer', username)}"}


VIEWER = "viewer"  # may read every DAG


def stored_runs(dag_ids: tuple[str, ...] = (DAG_A, DAG_B), since: str = "", until: str = "9999") -> list[dict[str, Any]]:
    """Every spot task instance of ``dag_ids`` with its state and its ``return_value``, read back
    through Airflow's XCom model; ``since``/``until`` compare with the run date's ``YYYY-MM-DD``."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    runs = []
    with create_session() as session:
        rows = session.execute(select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.task_id,
                                      TaskInstance.map_index, TaskInstance.state, DagRun.run_after)
                               .join(DagRun, (DagRun.dag_id == TaskInstance.dag_id) & (DagRun.run_id == TaskInstance.run_id))
                               .where(TaskInstance.operator == OPERATOR, TaskInstance.dag_id.in_(dag_ids))).all()
        for row in rows:
            day = row.run_after.strftime("%Y-%m-%d")
            if not since <= day < until:
                continue
            query = XComModel.get_many(run_id=row.run_id, key="return_value", dag_ids=row.dag_id, task_ids=row.task_id,
                                       map_indexes=row.map_index, limit=1)
            stored = session.scalars(query).first()
            runs.append({"dag_id": row.dag_id, "run_id": row.run_id, "task_id": row.task_id, "map_index": row.map_index,
                         "state": str(row.state), "day": day,
                         "result": None if stored is None else XComModel.deserialize_value(stored)})
    return runs


def expected_totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    results = [run["result"] for run in runs if run["result"] is not None and run["state"] != "running"]
    pools: Counter[str] = Counter()
    for result in results:
        pools.update(result.get("preemptions_by_pool") or {})
    return {
        "runs": len(runs), "finished": len(results),
        "in_flight": sum(run["state"] == "running" for run in runs),
        "cost": sum(r["cost"] for r in results), "on_demand_cost": sum(r["on_demand_cost"] for r in results),
        "savings": sum(r["savings"] for r in results), "preemptions": sum(r["preemptions"] for r in results),
        "by_pool": dict(pools),
        "unattributed": sum(r["preemptions"] for r in results if "preemptions_by_pool" not in r),
        "met": sum(r["deadline_met"] for r in results),
        "soft": sum(not r["deadline_met"] and r.get("hard_deadline_met") is True for r in results),
        "hard": sum(not r["deadline_met"] and r.get("hard_deadline_met") is False for r in results),
        "budget": sum(r["budget"] for r in results if r.get("budget")),
        "spend_with_budget": sum(r["cost"] for r in results if r.get("budget")),
    }


def assert_totals_match(data: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    expected = expected_totals(runs)
    totals = data["totals"]
    assert expected["finished"] > 0
    assert (totals["runs"], totals["finished"], totals["in_flight"]) == (
        expected["runs"], expected["finished"], expected["in_flight"])
    for key in ("cost", "on_demand_cost", "savings", "preemptions"):
        assert totals[key] == pytest.approx(expected[key], rel=1e-12), key
    assert data["preemptions"]["total"] == expected["preemptions"]
    assert data["preemptions"]["by_pool"] == expected["by_pool"]
    # older results name no pool: their preemptions count in the total only
    assert data["preemptions"]["unattributed"] == expected["unattributed"]
    assert sum(data["preemptions"]["by_pool"].values()) + expected["unattributed"] == expected["preemptions"]
    assert (totals["deadline"]["met"], totals["deadline"]["soft_miss"], totals["deadline"]["hard_miss"]) == (
        expected["met"], expected["soft"], expected["hard"])
    assert data["budget"]["budget"] == pytest.approx(expected["budget"])
    assert data["budget"]["spend"] == pytest.approx(expected["spend_with_budget"])
    assert {(r["dag_id"], r["run_id"], r["task_id"], r["map_index"]) for r in data["recent_runs"]} == {
        (r["dag_id"], r["run_id"], r["task_id"], r["map_index"]) for r in runs}


def test_the_totals_are_the_sums_of_the_runs_results(client):
    runs = stored_runs()
    spot_tasks = len(DATES[DAG_A]) * (1 + SWEEP) + len(DATES[DAG_B])
    assert len(runs) == spot_tasks  # DAG B's "prepare" task (another operator, a result-like dict) is not a spot run
    response = client.get(DATA, headers=_as(VIEWER))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["readable_dags"] == [DAG_A, DAG_B]
    assert_totals_match(data, runs)
    totals = data["totals"]
    assert totals["ended_without_result"] == 1  # the run that failed
    assert totals["deadline"]["soft_miss"] > 0 and totals["deadline"]["hard_miss"] > 0
    # the older results lack the newer keys: unknown, and said so
    old = sum(1 for r in runs if r["result"] is not None and "budget" not in r["result"])
    assert old > 0 and totals["missing"] == {"budget": old, "hard_deadline_met": old, "preemptions_by_pool": old}


def test_the_regions_roll_up_the_zones(client):
    data = client.get(DATA, headers=_as(VIEWER)).json()
    by_region: Counter[str] = Counter()
    for pool, n in data["preemptions"]["by_pool"].items():
        by_region[{"us-central1-a": "us-central1", "us-central1-b": "us-central1", "europe-west4-c": "europe-west4",
                   "us-east-1a": "us-east-1", "us-east-1b": "us-east-1"}[pool]] += n
    assert data["preemptions"]["by_region"] == dict(by_region)


def test_the_run_in_flight_and_the_failed_run(client):
    data = client.get(DATA, headers=_as(VIEWER)).json()
    last = sample_in_progress_log()[-1]
    assert data["in_flight"]["runs"] == 1 and data["in_flight"]["with_progress"] == 1
    assert data["in_flight"]["cost_so_far"] == pytest.approx(last["cost_so_far"])
    rows = {(r["dag_id"], r["run_id"][8:18]): r for r in data["recent_runs"] if r["task_id"] == "fine_tune"}
    flying = rows[(DAG_B, IN_FLIGHT_DATE)]
    assert flying["status"] == "in_flight" and flying["progress"]["slot"] == last["slot"]
    assert rows[(DAG_B, FAILED_DATE)]["status"] == "no_result"


def test_the_page_shows_the_totals_the_charts_and_links_to_each_report(client):
    response = client.get(FLEET, headers=_as(VIEWER))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    data = client.get(DATA, headers=_as(VIEWER)).json()
    totals = data["totals"]
    assert f"{totals['savings']:,.2f} <small>USD</small>" in html and f"{totals['cost']:,.2f} <small>USD</small>" in html
    # savings over time, preemptions per pool and region, and one chart per kind of job the selector learnt
    assert len(re.findall(r"<svg\b", html)) == 2 + len(CONTEXTS)
    links = re.findall(r'href="(runs/[^"]+)"', html)
    assert len(links) == totals["runs"]
    mapped = f"runs/{DAG_A}/manual__2025-10-03T00%3A00%3A00%2B00%3A00/sweep?map_index=1"
    assert mapped in links
    for link in links[:3] + [mapped]:
        target = urljoin(f"http://testserver{FLEET}", link.replace("&amp;", "&"))
        assert target.startswith("http://testserver/spotsched/runs/")
        report = client.get(target, headers=_as(VIEWER))
        assert report.status_code == 200, (link, report.text[:300])
    assert 'href="fleet/data.json"' in html


def test_the_json_links_each_run_to_its_report(client):
    data = client.get(DATA, headers=_as(VIEWER)).json()
    for row in data["recent_runs"]:
        assert row["report"].startswith("/spotsched/runs/")
        assert client.get(row["report"], headers=_as(VIEWER)).status_code == 200


@pytest.mark.parametrize("dag_ids", [(DAG_A,), (DAG_B,), (DAG_A, DAG_B)])
def test_the_dag_filter(client, dag_ids):
    query = "&".join(f"dag_id={d}" for d in dag_ids)
    data = client.get(f"{DATA}?{query}", headers=_as(VIEWER)).json()
    assert {row["dag_id"] for row in data["dags"]} == set(dag_ids)
    assert_totals_match(data, stored_runs(dag_ids))
    assert data["readable_dags"] == [DAG_A, DAG_B]  # the form still offers every readable DAG
    page = client.get(f"{FLEET}?{query}", headers=_as(VIEWER)).text
    for dag_id in dag_ids:
        assert f'<option value="{dag_id}" selected>' in page


def test_an_empty_dag_filter_means_every_dag(client):
    """The form's "all DAGs" option submits dag_id= and empty dates."""
    data = client.get(f"{DATA}?dag_id=&since=&until=", headers=_as(VIEWER)).json()
    assert data["totals"]["runs"] == len(stored_runs())


@pytest.mark.parametrize("since, until, first, end", [
    ("2025-10-02", "2025-10-11", "2025-10-02", "2025-10-12"),  # a date as until includes that day
    ("2025-10-03T00:00:00Z", "2025-10-12T00:00:00+00:00", "2025-10-03", "2025-10-12"),
    ("2025-10-12", None, "2025-10-12", "9999"),
    (None, "2025-10-01T12:00", "", "2025-10-02"),  # naive means UTC
    ("0001-01-01T00:00+01:00", "9999-12-31", "", "9999"),  # past the calendar's ends in UTC: every run
])
def test_the_time_range_filters_on_the_run_date(client, since, until, first, end):
    query = "&".join(f"{k}={v}" for k, v in (("since", since), ("until", until)) if v).replace("+", "%2B")
    data = client.get(f"{DATA}?{query}", headers=_as(VIEWER)).json()
    runs = stored_runs(since=first, until=end)
    assert runs
    assert_totals_match(data, runs)


@pytest.mark.parametrize("query, name", [
    ("since=yesterday", "since"), ("until=2025-13-01", "until"), ("since=2025-10-01T25:00", "since"),
    ("since=2025-10-05&until=2025-10-01", "until"),
])
@pytest.mark.parametrize("route", [FLEET, DATA])
def test_a_bad_bound_is_a_422_naming_it(client, route, query, name):
    response = client.get(f"{route}?{query}", headers=_as(VIEWER))
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["query", name]


@pytest.mark.parametrize("route", [FLEET, DATA])
def test_requests_without_a_valid_token_are_refused(client, route):
    assert client.get(route).status_code == 401
    assert client.get(route, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403
    assert client.get(f"{route}?dag_id={DAG_A}").status_code == 401


def test_the_ui_session_cookie_is_accepted(client):
    client.cookies.set("_token", token("viewer", VIEWER))
    try:
        response = client.get(FLEET)
    finally:
        client.cookies.clear()
    assert response.status_code == 200 and DAG_B in response.text


def _b_traces(text: str) -> list[str]:
    """Anything of DAG B in a response: its id, or the job ids made from it."""
    return [needle for needle in (DAG_B, DAG_B.replace("_", "-"), *[j for j in job_ids() if "fleet-b" in j], "2025-10-1")
            if needle in text]


@pytest.mark.parametrize("user", ["alice", "carol"])  # alice may not read DAG B; carol may, but not its XComs
def test_a_user_sees_only_the_dags_whose_xcoms_they_may_read(client, user):
    response = client.get(DATA, headers=_as(user))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["readable_dags"] == [DAG_A]
    assert {row["dag_id"] for row in data["recent_runs"]} == {DAG_A}
    assert_totals_match(data, stored_runs((DAG_A,)))
    assert _b_traces(response.text) == []
    page = client.get(FLEET, headers=_as(user))
    assert page.status_code == 200
    assert _b_traces(page.text) == []
    assert DAG_A in page.text and len(re.findall(r"<svg\b", page.text)) == 2 + len(CONTEXTS)


@pytest.mark.parametrize("user", ["alice", "carol"])
@pytest.mark.parametrize("query", [f"dag_id={DAG_B}", f"dag_id={DAG_A}&dag_id={DAG_B}", "dag_id=no_such_dag"])
@pytest.mark.parametrize("route", [FLEET, DATA])
def test_filtering_on_a_dag_one_may_not_read_is_a_403(client, user, query, route):
    response = client.get(f"{route}?{query}", headers=_as(user))
    assert response.status_code == 403, response.text
    assert "USD" not in response.text and "runs/" not in response.text and DAG_A not in response.text


def test_a_user_who_may_read_no_dag_sees_an_empty_fleet(client):
    response = client.get(DATA, headers=_as("nobody"))
    assert response.status_code == 200
    data = response.json()
    assert data["readable_dags"] == [] and data["totals"]["runs"] == 0 and data["recent_runs"] == []
    assert data["selector"]["status"] == "hidden" and data["selector"]["contexts"] == []
    page = client.get(FLEET, headers=_as("nobody")).text
    assert DAG_A not in page and DAG_B not in page and "<svg" not in page


def test_the_selector_weights_come_from_its_variable_without_job_ids(client):
    response = client.get(DATA, headers=_as(VIEWER))
    selector = response.json()["selector"]
    assert selector["variable"] == SELECTOR_VARIABLE and selector["status"] == "ok"
    document = selector_document(job_ids())
    for kind in selector["contexts"]:
        entries = [e for e in document["history"] if e["context"] == kind["context"]]
        assert kind["rounds"] == [e["round"] for e in entries]
        assert kind["played"] == [e["member"] for e in entries]
        for member, weights in kind["weights"].items():
            assert weights == pytest.approx([e["weights"][member] for e in entries])
    assert {kind["context"] for kind in selector["contexts"]} == set(CONTEXTS)
    assert not [job for job in job_ids() if job in response.text]


def test_a_missing_or_damaged_selector_variable_is_said(client, monkeypatch):
    from airflow.models.variable import Variable
    from airflow.utils.session import create_session

    monkeypatch.setenv("AIRFLOW__SPOTSCHED__SELECTOR_STATE_VARIABLE", "spotsched_fleet_test_absent")
    page = client.get(FLEET, headers=_as(VIEWER)).text
    assert "The selector&#x27;s Variable &#x27;spotsched_fleet_test_absent&#x27; does not exist" in page
    assert len(re.findall(r"<svg\b", page)) == 2
    with create_session() as session:
        Variable.set("spotsched_fleet_test_damaged", "{not json", session=session)
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__SELECTOR_STATE_VARIABLE", "spotsched_fleet_test_damaged")
    data = client.get(DATA, headers=_as(VIEWER)).json()
    assert data["selector"]["status"] == "not_json" and "does not hold JSON" in data["selector"]["message"]
    assert data["totals"]["runs"] == len(stored_runs())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # matplotlib, placing ticks near 1e308
def test_sums_that_overflow_are_null_in_the_json(client, monkeypatch):
    """Absurd results whose sum passes a float's range: unknown (null) in the JSON, which has no infinity."""
    from airflow_provider_spotsched.plugins import fleet_pages
    from airflow_provider_spotsched.simulation.fleet import FleetRun

    huge = {**sample_result(), "cost": 1e308, "on_demand_cost": 1e308, "savings": 0.0}
    runs = [FleetRun(DAG_A, f"huge_{i}", "fine_tune", state="success", end_date=datetime(2025, 10, 1 + i, tzinfo=timezone.utc),
                     result=huge) for i in range(2)]
    monkeypatch.setattr(fleet_pages, "load_runs", lambda *args: runs)
    response = client.get(DATA, headers=_as(VIEWER))
    assert response.status_code == 200, response.text
    totals = response.json()["totals"]
    assert (totals["finished"], totals["cost"], totals["on_demand_cost"], totals["savings"]) == (2, None, None, 0.0)
    assert response.json()["savings_over_time"]["points"][-1]["cumulative_cost"] is None
    assert client.get(FLEET, headers=_as(VIEWER)).status_code == 200


def test_one_query_for_the_runs_and_no_finished_decision_log(client, db):
    """The runs come from one query; only the run in flight has its decision log read."""
    from airflow import settings
    from sqlalchemy import event

    statements: list[tuple[str, Any]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append((statement, parameters))

    event.listen(settings.engine, "before_cursor_execute", record)
    try:
        assert client.get(DATA, headers=_as(VIEWER)).status_code == 200
    finally:
        event.remove(settings.engine, "before_cursor_execute", record)
    xcom_reads = [(s, p) for s, p in statements if re.search(r"\bFROM xcom\b|JOIN xcom\b", s)]
    assert len(xcom_reads) == 2, [s for s, _ in xcom_reads]  # the results (joined), the in-flight logs
    (log_read,) = [(s, p) for s, p in xcom_reads if "decision_log" in str(p)]
    assert [v for v in log_read[1] if isinstance(v, str) and v.startswith("manual__")] == [
        f"manual__{IN_FLIGHT_DATE}T00:00:00+00:00"]
    assert len(statements) < 15, [s for s, _ in statements]
