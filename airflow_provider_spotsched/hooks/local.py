"""The ``spotsched_local`` connection: local worker processes on a shipped trace replayed fast.

The embedded default needs no connection at all: workers run under ``$AIRFLOW_HOME/spotsched``,
the market is the shipped GCP H100 trace, one market slot lasts a few wall-clock seconds. A
``spotsched_local`` connection (the one named, else ``spotsched_local_default`` where it exists,
as every provider's hook falls back to its default connection) or keyword overrides (e.g. from a
DAG) change any of it; its extras are

- ``workdir``: where job directories (and default checkpoints) live (default: ``[spotsched]
  local_workdir``, else ``$AIRFLOW_HOME/spotsched``);
- ``trace``: ``"gcp"`` or ``"aws"`` (the shipped traces) or the path of a trace file;
- ``seconds_per_slot``: wall-clock seconds per market slot;
- ``market_start``: UTC timestamp in the trace where the job is submitted (default: after the
  first ``history_slots`` slots);
- ``history_slots``: slots of market history before submission (forecasts and the selector's
  warm-up read them).

The operator and the local backend must see the same market:
:class:`~airflow_provider_spotsched.market.feed.ReplayedMarket` is the trace in slots, history
first; the backend replays its rows from submission on, and slot ``k`` of the run is row
``history_slots + k``, however late the operator reads it.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook, Connection, conf
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.config import SECTION
from airflow_provider_spotsched.execution.environment import SpotEnvironment, local_environment
from airflow_provider_spotsched.hooks import local_connection


class LocalSpotHook(BaseHook):
    """Builds the local backend and its replayed market from a ``spotsched_local`` connection.

    :param local_conn_id: the connection; ``None`` uses ``spotsched_local_default`` where it
        exists, else the embedded default (no connection).
    :param overrides: extras that win over the connection's (same names as the extras).
    """

    conn_name_attr = "local_conn_id"
    default_conn_name = "spotsched_local_default"
    conn_type = local_connection.CONN_TYPE
    hook_name = local_connection.HOOK_NAME

    def __init__(self, local_conn_id: str | None = None, **overrides: Any) -> None:
        super().__init__()
        self.local_conn_id = local_conn_id
        self.overrides = overrides

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The provider info's ``ui-field-behaviour``, for readers of the hook (Airflow 3.3 reads the info)."""
        return local_connection.field_behaviour()

    def settings(self) -> LocalReplaySettings:
        """Overrides win over the connection's extras; then ``[spotsched] local_workdir``; then the defaults."""
        extra: dict[str, Any] = {}
        connection = self._connection()
        if connection is not None:
            extra.update(connection.extra_dejson)
        extra.update({k: v for k, v in self.overrides.items() if v is not None})
        if not extra.get("workdir"):
            extra["workdir"] = conf.get(SECTION, "local_workdir", fallback=None)
        where = f"connection {connection.conn_id!r}" if connection is not None else "backend_options"
        return LocalReplaySettings.from_extra(extra, where)

    def _connection(self) -> Connection | None:
        """The named connection; unnamed, the default one if it exists: the local backend needs
        none (the embedded default), so a missing default is no error. Read through the SDK, as a
        worker cannot open the metadata database."""
        if self.local_conn_id:
            return self.get_connection(self.local_conn_id)
        try:
            return self.get_connection(self.default_conn_name)
        except AirflowNotFoundException:
            return None

    def environment(self, slot_hours: float = 1.0) -> SpotEnvironment:
        """The backend, its replayed market and its clock, for a run."""
        return local_environment(self.settings(), slot_hours)

    def backend(self) -> LocalBackend:
        """The backend alone: it can report and release a job, not launch a new one."""
        settings = self.settings()
        return LocalBackend(settings.workdir / "jobs", seconds_per_slot=settings.seconds_per_slot)
