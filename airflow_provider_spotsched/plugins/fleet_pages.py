"""The fleet dashboard: every spot run of every DAG the caller may read, on one page.

Routes (all ``GET``, under ``/spotsched``):

- ``/fleet``: the HTML page (:func:`airflow_provider_spotsched.simulation.fleet_page.render_fleet_page`),
- ``/fleet/data.json``: the same summary as JSON.

Query parameters: ``dag_id`` (repeatable; none or empty: every DAG the caller may read),
``since`` and ``until`` (ISO-8601 dates or date-times, naive = UTC, on the DAG run's
``run_after``; a date alone as ``until`` includes that day). A bound that is no ISO date answers
422 naming the parameter.

Access follows the run report's rule (:mod:`.run_pages`): the caller needs a JWT the auth manager
accepts (no token 401, a bad one 403), and a DAG's runs are shown only when the auth manager lets
the caller read that DAG's XComs (``is_authorized_dag(GET, XCOM)``). The candidates are the DAGs
``get_authorized_dag_ids(GET)`` returns that have task instances of the fine-tuning operator; a
``dag_id`` filter naming a DAG whose XComs the caller may not read answers 403 and shows nothing.
The selector's Variable is deployment-wide: its weights (not its job ids, which name DAGs) are
shown to every caller who may read at least one DAG with spot runs.

The runs come from one query: the operator's task instances (``TaskInstance.operator``) in the
readable DAGs and time range, joined to their DAG run and outer-joined to their ``return_value``
XCom only; decision logs are never read for finished runs, only for the
:data:`MAX_IN_FLIGHT_LOGS` most recent runs in flight (their figures so far).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Annotated, Any
from urllib.parse import urlencode

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep
from airflow.models.dag import DagModel
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.variable import Variable
from airflow.models.xcom import XComModel
from airflow.sdk import conf
from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy import and_, select, tuple_
from sqlalchemy.orm import Session

from airflow_provider_spotsched.config import CONFIG, SECTION
from airflow_provider_spotsched.links.report import run_report_path
from airflow_provider_spotsched.plugins.run_pages import DECISION_LOG_KEY, OPERATOR_NAME, RESULT_KEY
from airflow_provider_spotsched.simulation.fleet import ENDED_STATES, FleetRun, parse_bound, selector_view, summarise
from airflow_provider_spotsched.simulation.fleet_page import FleetFilters, render_fleet_page

FLEET_ROUTE = "/fleet"
MAX_IN_FLIGHT_LOGS = 20  # in-flight runs whose decision log is read for their figures so far
SELECTOR_OPTION = "selector_state_variable"

DagIdQuery = Annotated[list[str] | None, Query(description="the DAG(s) to show; none: every DAG you may read")]
BoundQuery = Annotated[str | None, Query(description="an ISO-8601 date or date-time (UTC) of the runs' run_after")]

router = APIRouter()


class FleetView:
    """What one caller may see of the fleet under the request's filters."""

    def __init__(self, user: Any, session: Session, dag_id: Sequence[str] | None, since: str | None,
                 until: str | None) -> None:
        self.since_text, self.until_text = (text.strip() if text and text.strip() else None for text in (since, until))
        self.since, self.until = (_bound(name, text, upper) for name, text, upper in
                                  (("since", self.since_text, False), ("until", self.until_text, True)))
        if self.since and self.until and self.until <= self.since:
            raise _unprocessable("until", self.until_text, "until must be after since")
        self.requested = list(dict.fromkeys(d for d in (dag_id or []) if d))
        auth = get_auth_manager()
        if self.requested:
            teams = DagModel.get_dag_id_to_team_name_mapping(self.requested, session=session)
            refused = [d for d in self.requested if not _may_read_xcoms(auth, user, d, teams.get(d))]
            if refused:
                raise HTTPException(status.HTTP_403_FORBIDDEN,
                                    f"you may not read the XComs (spot runs) of DAG {refused[0]!r}")
        self.readable = readable_spot_dags(auth, user, session)
        shown = self.requested or self.readable
        self.runs = load_runs(session, shown, self.since, self.until)
        self.summary = summarise(self.runs)
        self.selector = (read_selector(session) if self.readable else
                         {"variable": _selector_variable(), "status": "hidden", "contexts": [], "skipped_entries": 0,
                          "message": "You may read no DAG with spot runs, so the selector's weights are not shown."})

    @property
    def filters(self) -> FleetFilters:
        return FleetFilters(readable_dags=self.readable, dag_ids=self.requested, since=self.since_text, until=self.until_text)

    def as_json(self) -> dict[str, Any]:
        summary = dict(self.summary)
        base_url = (conf.get("api", "base_url", fallback="") or "").strip().rstrip("/")  # as run_report_url, read once
        summary["recent_runs"] = [
            {**row, "report": base_url + run_report_path(row["dag_id"], row["run_id"], row["task_id"], row["map_index"])}
            for row in summary["recent_runs"]]
        return {
            "filters": {"dag_ids": self.requested, "since": _iso(self.since), "until": _iso(self.until)},
            "readable_dags": self.readable,
            **summary,
            "selector": self.selector,
        }


@router.get(FLEET_ROUTE, response_class=HTMLResponse)
def fleet_page(user: GetUserDep, session: SessionDep, dag_id: DagIdQuery = None, since: BoundQuery = None,
               until: BoundQuery = None) -> HTMLResponse:
    """The dashboard over every spot run the caller may read."""
    view = FleetView(user, session, dag_id, since, until)
    query = _query(view)
    page = render_fleet_page(view.summary, view.selector, view.filters,
                             data_url="fleet/data.json" + (f"?{query}" if query else ""),
                             generated=datetime.now(timezone.utc))
    return HTMLResponse(page)


@router.get(FLEET_ROUTE + "/data.json", response_class=JSONResponse)
def fleet_data(user: GetUserDep, session: SessionDep, dag_id: DagIdQuery = None, since: BoundQuery = None,
               until: BoundQuery = None) -> JSONResponse:
    """The dashboard's summary as JSON (each recent run with its report's URL).

    Already JSON-ready, so it is encoded directly rather than walked by FastAPI's encoder (a
    tenth of a second for a selector history of a thousand rounds).
    """
    content = FleetView(user, session, dag_id, since, until).as_json()
    try:
        return JSONResponse(content)
    except ValueError:  # a sum of absurd results overflowed to infinity: JSON has no such number
        return JSONResponse(_finite(content))


def readable_spot_dags(auth: Any, user: Any, session: Session) -> list[str]:
    """The DAGs with spot task instances whose XComs ``user`` may read, sorted."""
    candidates = auth.get_authorized_dag_ids(user=user, method="GET", session=session)
    if not candidates:
        return []
    with_runs = list(session.scalars(select(TaskInstance.dag_id).distinct().where(
        TaskInstance.operator == OPERATOR_NAME, TaskInstance.dag_id.in_(sorted(candidates)))))
    teams = DagModel.get_dag_id_to_team_name_mapping(with_runs, session=session)
    return sorted(d for d in with_runs if _may_read_xcoms(auth, user, d, teams.get(d)))


def _may_read_xcoms(auth: Any, user: Any, dag_id: str, team_name: str | None) -> bool:
    return bool(auth.is_authorized_dag(method="GET", access_entity=DagAccessEntity.XCOM,
                                       details=DagDetails(id=dag_id, team_name=team_name), user=user))


def load_runs(session: Session, dag_ids: Sequence[str], since: datetime | None, until: datetime | None) -> list[FleetRun]:
    """The spot task instances of ``dag_ids`` whose DAG run's ``run_after`` is in [since, until)."""
    if not dag_ids:
        return []
    ti, run, xcom = TaskInstance, DagRun, XComModel
    query = (
        select(ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.state, ti.start_date, ti.end_date, run.run_after,
               xcom.value)
        .join(run, and_(run.dag_id == ti.dag_id, run.run_id == ti.run_id))
        .outerjoin(xcom, and_(xcom.dag_run_id == run.id, xcom.task_id == ti.task_id, xcom.map_index == ti.map_index,
                              xcom.key == RESULT_KEY))
        .where(ti.operator == OPERATOR_NAME, ti.dag_id.in_(list(dag_ids)))
        .order_by(run.run_after, ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    )
    if since is not None:
        query = query.where(run.run_after >= since)
    if until is not None:
        query = query.where(run.run_after < until)
    # executed as Core: plain rows, without the ORM's per-row loading (a third of the time for 10,000 runs)
    rows = session.connection().execute(query).all()
    states = [None if row.state is None else str(getattr(row.state, "value", row.state)) for row in rows]
    flying = [i for i, state in enumerate(states) if state not in ENDED_STATES][-MAX_IN_FLIGHT_LOGS:]
    last_entries = _last_decisions(session, [rows[i] for i in flying])
    return [
        FleetRun(dag_id=row.dag_id, run_id=row.run_id, task_id=row.task_id, map_index=row.map_index, state=state,
                 start_date=row.start_date, end_date=row.end_date, run_after=row.run_after,
                 result=XComModel.deserialize_value(row) if state in ENDED_STATES else None,
                 last_entry=last_entries.get((row.dag_id, row.run_id, row.task_id, row.map_index)))
        for row, state in zip(rows, states)
    ]


def _last_decisions(session: Session, rows: Sequence[Any]) -> dict[tuple[str, str, str, int], Any]:
    """The last decision-log entry of each of these (in-flight) task instances that logged one."""
    if not rows:
        return {}
    xcom = XComModel
    keys = [(row.dag_id, row.run_id, row.task_id, row.map_index) for row in rows]
    found = session.execute(select(xcom.dag_id, xcom.run_id, xcom.task_id, xcom.map_index, xcom.value).where(
        xcom.key == DECISION_LOG_KEY, tuple_(xcom.dag_id, xcom.run_id, xcom.task_id, xcom.map_index).in_(keys)))
    last = {}
    for row in found:
        log = XComModel.deserialize_value(row)
        if isinstance(log, list) and log and isinstance(log[-1], dict):
            last[(row.dag_id, row.run_id, row.task_id, row.map_index)] = log[-1]
    return last


def read_selector(session: Session) -> dict[str, Any]:
    """The selector's weights from its Variable in the metadata database (see :func:`selector_view`)."""
    name = _selector_variable()
    variable = session.scalar(select(Variable).where(Variable.key == name))
    if variable is None:
        return selector_view(name, None)
    text = variable.val  # None when it cannot be decrypted (Airflow logs why)
    if not isinstance(text, str):
        return {**selector_view(name, ""), "status": "unreadable",
                "message": f"The selector's Variable {name!r} exists but cannot be read here (its value could not be "
                           "decrypted: is this API server's Fernet key the workers' one?)."}
    return selector_view(name, text)


def _selector_variable() -> str:
    default = CONFIG[SECTION]["options"][SELECTOR_OPTION]["default"]
    return (conf.get(SECTION, SELECTOR_OPTION, fallback=default) or default).strip()


def _bound(name: str, text: str | None, upper: bool) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_bound(text, upper=upper)
    except ValueError as error:
        raise _unprocessable(name, text, str(error)) from None


def _unprocessable(name: str, text: str | None, message: str) -> HTTPException:
    """A 422 in FastAPI's own shape, naming the query parameter."""
    return HTTPException(422,
                         [{"type": "value_error", "loc": ["query", name], "msg": message, "input": text}])


def _query(view: FleetView) -> str:
    """The request's filters as a query string (``""`` for none)."""
    pairs = [("dag_id", d) for d in view.requested]
    pairs += [(name, text) for name, text in (("since", view.since_text), ("until", view.until_text)) if text]
    return urlencode(pairs)


def _finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float replaced by ``None`` (unknown), as JSON allows."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")
