"""Cloud compute backends from Airflow connections: the only place they meet Airflow.

The backends themselves take API clients; these hooks build those clients from an ``aws`` or
``google_cloud_platform`` connection through the Amazon and Google providers' own hooks, so
credentials come from Airflow connections only (and never reach an instance: see
:mod:`airflow_provider_spotsched.backends.bootstrap`). ``get_backend`` takes the backend's options
as plain JSON values (what the operator's ``backend_options`` carries), for example::

    Ec2ComputeHook("aws_default").get_backend(
        instance_type="g5.xlarge", image_id="ami-...", pools={"us-east-1a": "subnet-..."},
        iam_instance_profile="spotsched-trainer",
    )
"""

from __future__ import annotations

from typing import Any

from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook
from airflow.providers.google.cloud.hooks.compute import ComputeEngineHook
from airflow.providers.google.common.consts import CLIENT_INFO
from google.cloud import compute_v1

from airflow_provider_spotsched.backends.ec2 import Ec2Backend
from airflow_provider_spotsched.backends.gce import GceBackend


class Ec2ComputeHook(EC2Hook):
    """An :class:`Ec2Backend` on the boto3 EC2 client of an ``aws`` connection (its region too),
    with a Service Quotas client of the same connection to read the account's on-demand quota."""

    def __init__(self, aws_conn_id: str | None = "aws_default", **kwargs: Any) -> None:
        super().__init__(api_type="client_type", aws_conn_id=aws_conn_id, **kwargs)

    def get_backend(self, **options: Any) -> Ec2Backend:
        quotas = AwsBaseHook(aws_conn_id=self.aws_conn_id, client_type="service-quotas", region_name=self.region_name)
        return Ec2Backend(self.conn, quotas_client=quotas.conn, **options)


class GceComputeHook(ComputeEngineHook):
    """A :class:`GceBackend` on the Compute Engine clients of a ``google_cloud_platform`` connection.

    ``project`` defaults to the connection's project. The zone-operations client has the
    credentials and client options of the instances client: every insert, delete and metadata
    update is awaited through it, and ``status`` lists through it the preemptions of spot VMs that
    already deleted themselves.
    """

    def __init__(self, gcp_conn_id: str = "google_cloud_default", **kwargs: Any) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, **kwargs)

    def get_backend(self, **options: Any) -> GceBackend:
        project = options.pop("project", None) or self.project_id
        if not project:
            raise ValueError(
                f"connection {self.gcp_conn_id!r} names no project: set its extra 'project' "
                "or pass project= in the backend options"
            )
        operations = compute_v1.ZoneOperationsClient(
            credentials=self.get_credentials(), client_info=CLIENT_INFO, client_options=self.get_client_options()
        )
        return GceBackend(
            self.get_compute_instance_client(), project=project, zone_operations_client=operations, **options
        )
