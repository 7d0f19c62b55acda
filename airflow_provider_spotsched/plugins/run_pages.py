"""One run's report: the page (a tab of the task instance), its data and its live view.

Every route needs read access to the DAG's XComs (Airflow's ``requires_access_dag(GET, XCOM)``,
see :mod:`.report`). The XComs are read straight from the metadata database, the way the core API's
XCom routes do, with the task instance's state (whether the run is still live).

Routes (``map_index`` is an optional query parameter for mapped tasks):

- ``GET /spotsched/runs/{dag_id}/{run_id}/{task_id}``: the HTML report; while the task runs it
  polls its live view every ``poll`` seconds (default 10) and redraws itself, then stops,
- ``.../{task_id}/data.json``: the decision log and result,
- ``.../{task_id}/live.json``: the task's state, whether it is live, and the report's body.

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
from fastapi import APIRouter, Depends, HTTPException, Query, status
from fastapi.responses import HTMLResponse
from pydantic import BeforeValidator
from sqlalchemy import select
from sqlalchemy.orm import Session

from airflow_provider_spotsched.simulation.fleet import ENDED_STATES
from airflow_provider_spotsched.simulation.run_report import (
    LiveView,
    check_decision_log,
    check_result,
    render_run_body,
    render_run_report,
    report_version,
)

DECISION_LOG_KEY = "decision_log"
RESULT_KEY = "return_value"
OPERATOR_NAME = "DeadlineSpotFineTuneOperator"  # TaskInstance.operator: the operator's class name

# map_index is a 32-bit INTEGER column: a larger number cannot name a task and overflows the query
MAX_MAP_INDEX = 2**31 - 1
# The UI's task-instance tab fills {MAP_INDEX} in the view's link only for a mapped task: the
# placeholder left as it is names the unmapped task instance.
UNFILLED_MAP_INDEX = "{MAP_INDEX}"
MapIndex = Annotated[
    int,
    BeforeValidator(lambda value: -1 if value == UNFILLED_MAP_INDEX else value),
    Query(ge=-1, le=MAX_MAP_INDEX, description="the mapped task's index; -1 for an unmapped task"),
]
PollSeconds = Annotated[float, Query(ge=1, le=3600, description="seconds between the live page's polls")]
REPORT_ROUTE = "/runs/{dag_id}/{run_id}/{task_id}"

router = APIRouter(dependencies=[Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM))])


class RunXComs:
    """What the pages show of one task instance: its two XComs, its state and its operator."""

    def __init__(self, session: Session, dag_id: str, run_id: str, task_id: str, map_index: int) -> None:
        if session.scalar(select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"DAG {dag_id!r} has no run {run_id!r}")
        found = session.execute(select(TaskInstance.state, TaskInstance.operator).where(
            TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
            TaskInstance.task_id == task_id, TaskInstance.map_index == map_index,
        )).first()
        if found is None:
            where = f" with map_index {map_index}" if map_index >= 0 else ""
            raise HTTPException(status.HTTP_404_NOT_FOUND,
                                f"run {run_id!r} of DAG {dag_id!r} has no task {task_id!r}{where}")
        self.state = None if found.state is None else str(getattr(found.state, "value", found.state))
        self.operator = found.operator
        self.decision_log = _xcom(session, dag_id, run_id, task_id, map_index, DECISION_LOG_KEY)
        # another operator's return value is its own business, not a spot run's result to check
        self.result = None if self.not_a_run else _xcom(session, dag_id, run_id, task_id, map_index, RESULT_KEY)
        self.title = f"{dag_id} / {run_id} / {task_id}" + (f" [{map_index}]" if map_index >= 0 else "")

    @property
    def live(self) -> bool:
        """Whether the log or the result may still change (the task has not ended)."""
        return self.state not in ENDED_STATES

    @property
    def not_a_run(self) -> str | None:
        """Why there is nothing to show, for a task of another operator that logged no decision."""
        if self.decision_log is None and self.operator != OPERATOR_NAME:
            return (f"This task runs {self.operator or 'an unknown operator'}, not {OPERATOR_NAME}: "
                    "it has no spot run to report.")
        return None

    def body(self, data_url: str) -> str:
        try:
            return render_run_body(self.decision_log, self.result, self.title, data_url=data_url,
                                   not_a_run=self.not_a_run)
        except ValueError as error:
            raise _malformed(error) from None


@router.get(REPORT_ROUTE, response_class=HTMLResponse)
def run_report(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: MapIndex = -1,
               poll: PollSeconds = 10.0) -> HTMLResponse:
    """The report page; a live run shows the slots decided so far and redraws as it goes."""
    xcoms = RunXComs(session, dag_id, run_id, task_id, map_index)
    data_url, live_url = (f"{quote(task_id, safe='')}/{name}" + (f"?map_index={map_index}" if map_index >= 0 else "")
                          for name in ("data.json", "live.json"))
    live = LiveView(live_url, poll) if xcoms.live else None
    try:
        page = render_run_report(xcoms.decision_log, xcoms.result, xcoms.title, data_url=data_url, live=live,
                                 not_a_run=xcoms.not_a_run)
    except ValueError as error:
        raise _malformed(error) from None
    return HTMLResponse(page)


@router.get(REPORT_ROUTE + "/live.json")
def run_live(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: MapIndex = -1) -> dict[str, Any]:
    """The report's body redrawn now, its version, and whether the run is still live."""
    xcoms = RunXComs(session, dag_id, run_id, task_id, map_index)
    data_url = "data.json" + (f"?map_index={map_index}" if map_index >= 0 else "")
    html = xcoms.body(f"{quote(task_id, safe='')}/{data_url}")
    return {"state": xcoms.state, "live": xcoms.live, "version": report_version(xcoms.decision_log, xcoms.result),
            "slots": len(xcoms.decision_log or []), "html": html}


@router.get(REPORT_ROUTE + "/data.json")
def run_data(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: MapIndex = -1) -> dict[str, Any]:
    """The raw decision log and result (``null`` while the run is in progress, and for a task of another
    operator that logged no decision: its return value is not a spot run's)."""
    xcoms = RunXComs(session, dag_id, run_id, task_id, map_index)
    try:
        checked_log, checked_result = check_decision_log(xcoms.decision_log), check_result(xcoms.result)
    except ValueError as error:
        raise _malformed(error) from None
    return {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index, "state": xcoms.state,
            "decision_log": checked_log, "result": checked_result}


def _xcom(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int, key: str) -> Any:
    query = XComModel.get_many(run_id=run_id, key=key, dag_ids=dag_id, task_ids=task_id, map_indexes=map_index, limit=1)
    row = session.scalars(query).first()
    return None if row is None else XComModel.deserialize_value(row)


def _malformed(error: ValueError) -> HTTPException:
    return HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR,
                         f"the task's XComs are not a spot-scheduler decision log and result: {error}")
