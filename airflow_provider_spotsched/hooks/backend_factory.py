"""From the operator's ``backend=`` and connection ids to a compute backend and its market.

The operator and its trigger run in different processes (a worker, the triggerer), so what
builds a backend travels as plain data: a :class:`BackendSpec` (backend name, connection id,
options). The operator builds a
:class:`~airflow_provider_spotsched.execution.environment.SpotEnvironment` from it (backend,
market feed, clock); the trigger rebuilds only the backend, to read the job's status or release
it.

- ``local``: :class:`~airflow_provider_spotsched.hooks.local.LocalSpotHook` (a ``spotsched_local``
  connection; without one named, ``spotsched_local_default`` where it exists, else the embedded
  default); the market is the trace it replays.
- ``ec2`` / ``gce``: the compute hooks of :mod:`airflow_provider_spotsched.hooks.compute` (an
  ``aws`` or ``google_cloud_platform`` connection); the market is the live
  :class:`~airflow_provider_spotsched.market.source.MarketSource` given to the operator, usually a
  :class:`~airflow_provider_spotsched.hooks.market_spec.MarketSpec` naming its connection. The
  files under the checkpoint URI are reached with the compute connection's credentials
  (:mod:`airflow_provider_spotsched.hooks.object_storage`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk import BaseHook

from airflow_provider_spotsched.backends.base import ComputeBackend
from airflow_provider_spotsched.execution.environment import SpotEnvironment
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.hooks.object_storage import connection_locate
from airflow_provider_spotsched.market.feed import LiveMarketFeed
from airflow_provider_spotsched.market.source import MarketSource

BACKEND_CONN_TYPES = {"local": "spotsched_local", "ec2": "aws", "gce": "google_cloud_platform"}
MARKET_CONN_TYPES = {"aws": "aws", "gcp": "google_cloud_platform", "trace": "", "history": ""}
CLOUD_HOOKS = {
    "ec2": "airflow_provider_spotsched.hooks.compute:Ec2ComputeHook",
    "gce": "airflow_provider_spotsched.hooks.compute:GceComputeHook",
}


class ConnectionMissingError(ValueError):
    """A connection the task needs does not exist; the message says how to create it."""


@dataclass(frozen=True)
class BackendSpec:
    """Everything needed to rebuild a backend in another process (JSON-ready)."""

    name: str
    conn_id: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in BACKEND_CONN_TYPES:
            raise ValueError(f"backend={self.name!r} is unknown; choose one of {sorted(BACKEND_CONN_TYPES)}")
        if self.name != "local" and not self.conn_id:
            raise ValueError(
                f"backend={self.name!r} needs compute_conn_id: the id of an {BACKEND_CONN_TYPES[self.name]!r} connection"
            )
        try:
            json.dumps(dict(self.options))
        except TypeError as error:
            raise ValueError(f"backend_options must be JSON-serialisable (the trigger rebuilds the backend): {error}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "conn_id": self.conn_id, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendSpec:
        return cls(data["name"], data.get("conn_id"), dict(data.get("options") or {}))


def check_connection(conn_id: str, conn_type: str, parameter: str) -> None:
    """Fail before launching anything when ``conn_id`` does not exist, saying how to create it."""
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    try:
        BaseHook.get_connection(conn_id)
    except (AirflowNotFoundException, AirflowRuntimeError):
        raise ConnectionMissingError(
            f"{parameter}={conn_id!r}: no such connection. Create it with "
            f"`airflow connections add {conn_id} --conn-type {conn_type} --conn-extra '{{...}}'`, the UI "
            f"(Admin > Connections) or the environment variable AIRFLOW_CONN_{conn_id.upper()}"
        ) from None


def build_backend(spec: BackendSpec) -> ComputeBackend:
    """The backend alone: enough to read a job's status or release it (the trigger's needs)."""
    if spec.name == "local":
        from airflow_provider_spotsched.hooks.local import LocalSpotHook

        return LocalSpotHook(spec.conn_id, **spec.options).backend()
    return _cloud_hook(spec).get_backend(**spec.options)


def build_environment(
    spec: BackendSpec, slot_hours: float, market_source: MarketSource | None = None
) -> SpotEnvironment:
    """Backend, market and clock for a run (connections checked first, see :func:`check_connection`)."""
    if spec.conn_id:
        check_connection(spec.conn_id, BACKEND_CONN_TYPES[spec.name], "compute_conn_id")
    if spec.name == "local":
        from airflow_provider_spotsched.hooks.local import LocalSpotHook

        return LocalSpotHook(spec.conn_id, **spec.options).environment(slot_hours)
    if market_source is None:
        raise ValueError(
            f"backend={spec.name!r} needs market_source: the pools' live market, e.g. "
            '{"kind": "aws", "conn_id": "aws_default", "options": {...}} (see hooks/market_spec.py)'
        )
    if isinstance(market_source, MarketSpec) and market_source.conn_id:
        check_connection(market_source.conn_id, MARKET_CONN_TYPES[market_source.kind], "market_source.conn_id")
    return SpotEnvironment(
        backend=build_backend(spec), market=LiveMarketFeed(market_source, slot_hours), locate=connection_locate(spec.conn_id)
    )


def _cloud_hook(spec: BackendSpec) -> Any:
    module, name = CLOUD_HOOKS[spec.name].split(":")
    try:
        hook_class = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ValueError(
            f"backend={spec.name!r} needs {CLOUD_HOOKS[spec.name]}, which this installation lacks; "
            "install the provider with its amazon/google extras"
        ) from None
    return hook_class(spec.conn_id)
