"""The "Spot run report" button on a task instance: a link to the plugin's per-run report page.

Airflow 3 computes an operator's extra links on the worker when the task instance finishes and
stores each URL in XCom, so the link must be absolute within the deployment: it is built on
``[api] base_url`` (which includes any path prefix the API server is served under) and falls
back to a root-relative path when no base URL is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink, conf

from airflow_provider_spotsched.simulation.run_report import run_path

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

REPORT_PREFIX = "/spotsched"


def run_report_path(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The report page's path below the API server's root (each id percent-encoded)."""
    return f"{REPORT_PREFIX}/{run_path(dag_id, run_id, task_id, map_index)}"


def run_report_url(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The report page's URL under ``[api] base_url``; root-relative when that is not set."""
    base_url = (conf.get("api", "base_url", fallback="") or "").strip().rstrip("/")
    return base_url + run_report_path(dag_id, run_id, task_id, map_index)


class SpotRunReportLink(BaseOperatorLink):
    """Opens the task instance's report: plan versus actual, instances, cost, forecasts."""

    name = "Spot run report"

    def get_link(self, operator: Any, *, ti_key: TaskInstanceKey) -> str:
        return run_report_url(ti_key.dag_id, ti_key.run_id, ti_key.task_id, ti_key.map_index)
