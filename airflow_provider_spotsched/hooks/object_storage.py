"""Files under a job's checkpoint URI, reached on the Airflow side with a connection's credentials.

The operator writes ``config.json`` and reads ``progress.json`` and the instances' logs under
``checkpoint_uri``. Plain fsspec would reach ``s3://`` or ``gs://`` with whatever credentials the
worker's environment holds; Airflow's ``ObjectStoragePath`` with ``conn_id`` builds the filesystem
from the connection (the Amazon provider's through ``s3fs``, the Google provider's through
``gcsfs``), so a DAG's storage access is the connection it names. A local path needs no
credentials and keeps fsspec's local filesystem.
"""

from __future__ import annotations

import fsspec
from fsspec import AbstractFileSystem

from airflow_provider_spotsched.runtime.contract import Locate


def connection_locate(conn_id: str | None) -> Locate:
    """A :data:`~airflow_provider_spotsched.runtime.contract.Locate` that opens remote URIs with ``conn_id``."""

    def locate(uri: str) -> tuple[AbstractFileSystem, str]:
        if "://" not in uri or uri.startswith("file://"):
            return fsspec.core.url_to_fs(uri)
        from airflow.sdk import ObjectStoragePath

        path = ObjectStoragePath(uri, conn_id=conn_id)
        return path.fs, path.path

    return locate
