"""The provider's pages in Airflow's API server, under ``/spotsched``: run reports and the fleet.

Plugin FastAPI apps get no authentication from Airflow, and runs' costs are private, so every
route depends on Airflow's own auth: the caller presents a JWT that the deployment's auth manager
accepts (the ``Authorization: Bearer`` header, or the ``_token`` cookie the Airflow UI sets on
login) and sees only DAGs whose XComs it may read. The routes live in :mod:`.run_pages` and
:mod:`.fleet_pages`; this module mounts them and tells the UI where they appear:

- a **Spot run report** tab on every task instance (``external_views``, destination
  ``task_instance``; a task of another operator gets a page saying it is not a spot run),
- a **Spot fleet** entry in the UI's navigation.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import conf
from fastapi import FastAPI, HTTPException, Request, Response, status
from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_provider_spotsched.links.report import REPORT_PREFIX
from airflow_provider_spotsched.plugins import fleet_pages, run_pages

app = FastAPI(
    title="Spot scheduler pages",
    description="Run reports and the fleet dashboard of DeadlineSpotFineTuneOperator tasks "
    "(requires read access to the DAGs' XComs).",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)
app.include_router(run_pages.router)
app.include_router(fleet_pages.router)


@app.exception_handler(StarletteHTTPException)
async def _no_such_route(request: Request, error: StarletteHTTPException) -> Response:
    """The router's bare 404 for a path that is no route (an id left out) says where the pages are."""
    if error.status_code == status.HTTP_404_NOT_FOUND and error.detail == "Not Found":
        route = REPORT_PREFIX + run_pages.REPORT_ROUTE
        error = HTTPException(status.HTTP_404_NOT_FOUND, f"no page at {request.url.path}: a report is at "
                              f"{route} (its data at {route}/data.json, its live view at {route}/live.json, "
                              f"each id non-empty) and the fleet at {REPORT_PREFIX}{fleet_pages.FLEET_ROUTE}")
    return await http_exception_handler(request, error)


def _under_base_url(path: str) -> str:
    """``path`` below the path of ``[api] base_url`` (a deployment served under a prefix)."""
    base = (conf.get("api", "base_url", fallback="") or "").strip()
    return urlsplit(base).path.rstrip("/") + path


class SpotschedPlugin(AirflowPlugin):
    """Mounts the pages on Airflow's API server and adds them to the UI."""

    name = "spotsched"
    fastapi_apps = [{"app": app, "url_prefix": REPORT_PREFIX, "name": "Spot scheduler pages"}]
    external_views = [
        {
            "name": "Spot run report",
            "href": _under_base_url(REPORT_PREFIX + "/runs/{DAG_ID}/{RUN_ID}/{TASK_ID}?map_index={MAP_INDEX}"),
            "destination": "task_instance",
            "url_route": "spot-run-report",
        },
        {
            "name": "Spot fleet",
            "href": _under_base_url(REPORT_PREFIX + fleet_pages.FLEET_ROUTE),
            "destination": "nav",
            "category": "browse",
            "url_route": "spot-fleet",
        },
    ]
