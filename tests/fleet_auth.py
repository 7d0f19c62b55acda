"""An auth manager for the fleet tests: Airflow's SimpleAuthManager, with users limited to some DAGs.

Selected with ``AIRFLOW__CORE__AUTH_MANAGER=tests.fleet_auth.PerDagAuthManager``. The
environment variable :data:`ACCESS_ENV` holds JSON ``{username: {"dags": [...], "xcom": [...]}}``:
a user named there may read only the DAGs in ``dags``, and the XComs of only those in ``xcom``
(default: all of ``dags``); a check for no DAG in particular is refused. Other users, and every
role check, are SimpleAuthManager's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

ACCESS_ENV = "SPOTSCHED_TEST_DAG_ACCESS"


class PerDagAuthManager(SimpleAuthManager):
    """SimpleAuthManager whose users of :data:`ACCESS_ENV` see only their DAGs."""

    def is_authorized_dag(
        self,
        *,
        method: Any,
        user: SimpleAuthManagerUser,
        access_entity: DagAccessEntity | None = None,
        details: DagDetails | None = None,
    ) -> bool:
        rules = json.loads(os.environ.get(ACCESS_ENV) or "{}").get(user.get_name())
        if rules is not None:
            dag_id = details.id if details else None
            allowed = rules.get("xcom", rules["dags"]) if access_entity == DagAccessEntity.XCOM else rules["dags"]
            if dag_id is None or dag_id not in allowed:
                return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
