"""The ``spotsched://`` asset scheme: a trained adapter, named by the task that trains it.

``spotsched://{dag_id}/{task_id}/adapter`` names the adapter a fine-tune task produces when its
files have no fixed location (the local backend's default checkpoints are per run); each asset
event's ``extra`` says where that run's adapter is. The provider info registers the scheme
(``asset-uris``): Airflow checks such URIs with :func:`sanitize_uri`, and OpenLineage names the
dataset with :func:`convert_asset_to_openlineage`. :func:`openlineage_name` names any other
location the same way OpenLineage's own providers do, for the operator's lineage.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit

if TYPE_CHECKING:
    from airflow.sdk import Asset

SCHEME = "spotsched"


def adapter_uri(dag_id: str, task_id: str) -> str:
    """The URI of the adapter that task ``task_id`` of DAG ``dag_id`` trains."""
    return f"{SCHEME}://{dag_id}/{task_id}/adapter"


def create_asset(*, dag_id: str, task_id: str, extra: dict[str, Any] | None = None) -> Asset:
    """The adapter's Asset: what a consumer DAG puts in its ``schedule``."""
    from airflow.sdk import Asset

    return Asset(adapter_uri(dag_id, task_id), extra=extra)


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Refuse a ``spotsched://`` URI without a DAG id or a path: it names no task's adapter."""
    if not uri.netloc:
        raise ValueError("URI format spotsched:// must name a DAG: spotsched://{dag_id}/{task_id}/adapter")
    if uri.path in ("", "/"):
        raise ValueError("URI format spotsched:// must name a task: spotsched://{dag_id}/{task_id}/adapter")
    return uri


def location_uri(location: str) -> str:
    """A location as an asset URI: a local path becomes an absolute ``file://`` URI, a URI stays."""
    return location if "://" in location else Path(location).expanduser().absolute().as_uri()


def openlineage_name(location: str) -> tuple[str, str]:
    """``(namespace, name)`` of a location's OpenLineage dataset, by OpenLineage's naming rules.

    A local file is ``("file", path)``; any other URI ``("scheme://authority", path)``: an
    ``s3://`` bucket, a ``gs://`` bucket, or a ``spotsched://`` DAG and its task's adapter.
    """
    parts = urlsplit(location_uri(location))
    if parts.scheme == "file":
        return "file", parts.path
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/") or "/"


def convert_asset_to_openlineage(asset: Asset, lineage_context: Any) -> Any:
    """The OpenLineage dataset of a ``spotsched://`` asset (called by the OpenLineage provider)."""
    from airflow.providers.common.compat.openlineage.facet import Dataset

    namespace, name = openlineage_name(asset.uri)
    return Dataset(namespace=namespace, name=name)
