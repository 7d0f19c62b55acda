"""The run report as a tab of the task instance, in the real Airflow UI, live while the task runs.

A real ``airflow api-server`` (UI, core API and the plugin, with Airflow's SimpleAuthManager)
serves a copy of the metadata database that :mod:`tests.report_airflow` filled by a real
``airflow dags test``. Headless Chromium signs in with the UI's ``_token`` cookie and opens
the task instance's **Spot run report** tab, which the UI draws as an iframe of the report page.
The copy lets this module play the operator: it marks one task instance running, then writes a
new decision log and finally the result and the end state, as the operator does slot by slot,
and checks that the page redraws itself between two polls and stops polling once the task ended.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from tests.headless_chromium import BrowserPage, chromium  # noqa: F401 (a fixture)
from tests.report_airflow import (
    DAG_ID,
    FINISHED_TASK,
    IN_PROGRESS_SLOTS,
    IN_PROGRESS_TASK,
    ReportDb,
    ServedApi,
    serve_api,
    shared_report_db,
)
from tests.run_log_samples import CHARTS, POOLS, sample_in_progress_log, sample_result

pytestmark = pytest.mark.deployment

TAB_ROUTE = "spot-run-report"
# the report inside the tab's iframe, as the UI embeds it (null until the frame has loaded it whole:
# the innerText of a document still being parsed holds only its top)
IN_FRAME = "(() => { const f = document.querySelector('iframe'); const d = f && f.contentDocument; " \
           "return d && d.readyState === 'complete' && d.getElementById('report') ? d : null; })()"


@pytest.fixture(scope="module")
def db_copy(tmp_path_factory) -> ReportDb:
    """A private copy of the shared deployment, with the in-progress task instance running."""
    shared = shared_report_db(tmp_path_factory)
    home = tmp_path_factory.mktemp("report_tab") / "home"
    shutil.copytree(shared.home, home)
    env = {name: value.replace(str(shared.home), str(home)) for name, value in shared.env.items()}
    copy = ReportDb(home, env, shared.run_id)
    _sql(copy, "UPDATE task_instance SET state = 'running', end_date = NULL WHERE task_id = ?", IN_PROGRESS_TASK)
    return copy


@pytest.fixture(scope="module")
def api(db_copy) -> Iterator[ServedApi]:
    with serve_api(db_copy.home, db_copy.env) as served:
        yield served


def _sql(db: ReportDb, statement: str, *parameters: object) -> None:
    with sqlite3.connect(db.home / "airflow.db") as connection:
        assert connection.execute(statement, parameters).rowcount == 1, statement


def _tab_url(api: ServedApi, db: ReportDb, task_id: str) -> str:
    return f"{api.url}/dags/{DAG_ID}/runs/{quote(db.run_id, safe='')}/tasks/{task_id}/plugin/{TAB_ROUTE}"


def _frame(expression: str) -> str:
    """``expression`` over the framed report's document ``d`` (``null`` while the frame loads)."""
    return f"(() => {{ const d = {IN_FRAME}; return d ? ({expression}) : null; }})()"


def test_the_ui_lists_the_tab_for_task_instances(api):
    plugins = api.get("/api/v2/plugins").json()["plugins"]
    views = {view["url_route"]: view for plugin in plugins for view in plugin["external_views"]}
    assert views[TAB_ROUTE]["destination"] == "task_instance" and views[TAB_ROUTE]["name"] == "Spot run report"
    assert views["spot-fleet"]["destination"] == "nav"


def test_the_tab_of_a_finished_task_shows_its_report(api, db_copy, chromium, tmp_path):
    result = sample_result()
    with BrowserPage(chromium, tmp_path / "profile", width=1400) as page:
        page.open(_tab_url(api, db_copy, FINISHED_TASK), cookies={"_token": api.token})
        page.wait_until(_frame("d.body.innerText.includes('finished, deadline met')"), what="the finished report")
        # the frame can load before the UI has drawn the task's tabs around it
        page.wait_until("document.body.innerText.includes('Spot run report')", what="the tab named in the task's tabs")
        text = page.evaluate(_frame("d.body.innerText"))
        assert f"{result['cost']:,.2f} USD" in text and "Slot by slot" in text
        assert page.evaluate(_frame("d.querySelectorAll('svg').length")) == CHARTS + len(POOLS)
        assert page.evaluate(_frame("d.getElementById('report').dataset.live || ''")) == "", "a finished run is not polled"


def test_the_tab_of_a_running_task_redraws_between_polls_and_stops_when_it_ends(api, db_copy, chromium, tmp_path):
    with BrowserPage(chromium, tmp_path / "profile", width=1400) as page:
        page.open(_tab_url(api, db_copy, IN_PROGRESS_TASK), cookies={"_token": api.token})
        page.wait_until(_frame("d.body.innerText.includes('in progress')"), what="the running report")
        assert page.evaluate(_frame("d.getElementById('report').dataset.live")).endswith("/live.json")
        first = page.evaluate(_frame("d.getElementById('report').dataset.version"))
        assert f"Slots decided\t{IN_PROGRESS_SLOTS}" in page.evaluate(_frame("d.body.innerText"))
        page.wait_until(_frame("Number(d.getElementById('report').dataset.polls) >= 1"), what="a first poll")
        assert page.evaluate(_frame("d.getElementById('report').dataset.version")) == first, "nothing changed yet"

        # the operator decides one more slot and pushes its log
        polls = page.evaluate(_frame("Number(d.getElementById('report').dataset.polls)"))
        _sql(db_copy, "UPDATE xcom SET value = ? WHERE task_id = ? AND key = 'decision_log'",
             json.dumps(sample_in_progress_log(IN_PROGRESS_SLOTS + 1)), IN_PROGRESS_TASK)
        page.wait_until(_frame(f"d.body.innerText.includes('Slots decided\\t{IN_PROGRESS_SLOTS + 1}')"),
                        what="the next slot, redrawn by the next poll")
        report = page.evaluate(_frame("Object.assign({}, d.getElementById('report').dataset)"))
        assert int(report["polls"]) > polls and report["version"] != first, "redrawn by a poll, not by a reload"

        # the task ends: its result and its state
        _sql(db_copy, "INSERT INTO xcom (dag_run_id, task_id, map_index, key, dag_id, run_id, value, timestamp) "
             "SELECT dag_run_id, task_id, map_index, 'return_value', dag_id, run_id, ?, timestamp FROM xcom "
             "WHERE task_id = ? AND key = 'decision_log'", json.dumps(sample_result()), IN_PROGRESS_TASK)
        _sql(db_copy, "UPDATE task_instance SET state = 'success' WHERE task_id = ?", IN_PROGRESS_TASK)
        page.wait_until(_frame("d.getElementById('report').dataset.stopped === 'true'"), what="the last poll")
        assert "finished, deadline met" in page.evaluate(_frame("d.body.innerText"))
