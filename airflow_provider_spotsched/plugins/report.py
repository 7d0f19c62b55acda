"""The per-run report pages, served by Airflow's API server under ``/spotsched``.

Plugin FastAPI apps get no authentication from Airflow, and a run's costs are private, so every
route depends on Airflow's own ``requires_access_dag(GET, XCOM)``: the caller must present a
JWT that the deployment's auth manager accepts (the ``Authorization: Bearer`` header, or the
``_token`` cookie the Airflow UI sets on login) and be allowed to read the DAG's XComs. The
XComs are read straight from the metadata database, the way the core API's XCom routes do.

Routes (``map_index`` is an optional query parameter for mapped tasks):

- ``GET /spotsched/runs/{dag_id}/{run_id}/{task_id}``: the HTML report,
- ``GET /spotsched/runs/{dag_id}/{run_id}/{task_id}/data.json``: the decision log and result.

Bad requests answer 4xx with a JSON ``detail``, never 500: a ``map_index`` that is not an
integer in -1..2**31-1 (the database's column) 422, an unknown run or task instance 404 naming
it, and any other path (an id missing) 404 naming the routes.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_provider_spotsched.links.report import REPORT_PREFIX
from airflow_provider_spotsched.simulation.run_report import check_decision_log, check_result, render_run_report

DECISION_LOG_KEY = "decision_log"
RESULT_KEY = "return_value"

# map_index is a 32-bit INTEGER column: a larger number cannot name a task and overflows the query
MAX_MAP_INDEX = 2**31 - 1
MapIndex = Annotated[int, Query(ge=-1, le=MAX_MAP_INDEX, description="the mapped task's index; -1 for an unmapped task")]
REPORT_ROUTE = REPORT_PREFIX + "/runs/{dag_id}/{run_id}/{task_id}"

app = FastAPI(
    title="Spot scheduler reports",
    description="Per-run reports of DeadlineSpotFineTuneOperator tasks (requires read access to the DAG's XComs).",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    dependencies=[Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM))],
)


@app.get("/runs/{dag_id}/{run_id}/{task_id}", response_class=HTMLResponse)
def run_report(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: MapIndex = -1) -> HTMLResponse:
    """The report page; a run in progress shows the slots decided so far."""
    decision_log, result = _run_xcoms(session, dag_id, run_id, task_id, map_index)
    title = f"{dag_id} / {run_id} / {task_id}" + (f" [{map_index}]" if map_index >= 0 else "")
    data_url = f"{quote(task_id, safe='')}/data.json" + (f"?map_index={map_index}" if map_index >= 0 else "")
    try:
        page = render_run_report(decision_log, result, title, data_url=data_url)
    except ValueError as error:
        raise _malformed(error) from None
    return HTMLResponse(page)


@app.get("/runs/{dag_id}/{run_id}/{task_id}/data.json")
def run_data(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: MapIndex = -1) -> dict[str, Any]:
    """The raw decision log and result (``null`` while the run is in progress)."""
    decision_log, result = _run_xcoms(session, dag_id, run_id, task_id, map_index)
    try:
        checked_log, checked_result = check_decision_log(decision_log), check_result(result)
    except ValueError as error:
        raise _malformed(error) from None
    return {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index,
            "decision_log": checked_log, "result": checked_result}


@app.exception_handler(StarletteHTTPException)
async def _no_such_route(request: Request, error: StarletteHTTPException) -> Response:
    """The router's bare 404 for a path that is no route (an id left out) says where the reports are."""
    if error.status_code == status.HTTP_404_NOT_FOUND and error.detail == "Not Found":
        error = HTTPException(status.HTTP_404_NOT_FOUND, f"no report at {request.url.path}: a report is at "
                              f"{REPORT_ROUTE} and its data at {REPORT_ROUTE}/data.json, each id non-empty")
    return await http_exception_handler(request, error)


def _run_xcoms(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int) -> tuple[Any, Any]:
    """The task instance's decision log and result; 404 when the run or the task instance is unknown."""
    if session.scalar(select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"DAG {dag_id!r} has no run {run_id!r}")
    instance = select(TaskInstance.id).where(
        TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
        TaskInstance.task_id == task_id, TaskInstance.map_index == map_index,
    )
    if session.scalar(instance) is None:
        where = f" with map_index {map_index}" if map_index >= 0 else ""
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"run {run_id!r} of DAG {dag_id!r} has no task {task_id!r}{where}")
    return tuple(_xcom(session, dag_id, run_id, task_id, map_index, key) for key in (DECISION_LOG_KEY, RESULT_KEY))


def _xcom(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int, key: str) -> Any:
    query = XComModel.get_many(run_id=run_id, key=key, dag_ids=dag_id, task_ids=task_id, map_indexes=map_index, limit=1)
    row = session.scalars(query).first()
    return None if row is None else XComModel.deserialize_value(row)


def _malformed(error: ValueError) -> HTTPException:
    return HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR,
                         f"the task's XComs are not a spot-scheduler decision log and result: {error}")


class SpotschedPlugin(AirflowPlugin):
    """Mounts the report app on Airflow's API server."""

    name = "spotsched"
    fastapi_apps = [{"app": app, "url_prefix": REPORT_PREFIX, "name": "Spot scheduler reports"}]
