"""The EC2 backend reads the account's on-demand quota (moto server on loopback, as
tests/test_backend_ec2.py): Service Quotas' vCPU limit over the instance type's vCPUs.

Moto's Service Quotas answers for VPC quotas only, so the quota itself comes from a stand-in
client; the instance type's vCPUs come from moto's EC2 (whose catalogue lacks p3.2xlarge).
"""

from __future__ import annotations

from typing import Any

import boto3

from airflow_provider_spotsched.hooks.compute import Ec2ComputeHook
from tests.moto_server import moto_endpoint  # noqa: F401 (a fixture)
from tests.test_backend_ec2 import IMAGE_ID, client, ec2, make_backend  # noqa: F401 (fixtures)
from tests.test_compute_hooks import aws_connection  # noqa: F401 (a fixture)


class Quotas:
    """A Service Quotas client that knows one quota."""

    def __init__(self, code: str, vcpus: float) -> None:
        self.code, self.vcpus = code, vcpus
        self.asked: list[dict[str, Any]] = []

    def get_service_quota(self, **params: Any) -> dict[str, Any]:
        self.asked.append(params)
        return {"Quota": {"QuotaCode": self.code, "Value": self.vcpus}}


def test_the_limit_is_the_on_demand_vcpu_quota_over_the_types_vcpus(client):
    quotas = Quotas("L-417A185B", 400.0)  # "Running On-Demand P instances", in vCPUs
    assert make_backend(client, instance_type="p4d.24xlarge", quotas_client=quotas).instance_limit() == 4  # 400 // 96
    assert quotas.asked == [{"ServiceCode": "ec2", "QuotaCode": "L-417A185B"}]
    gpus = Quotas("L-DB2E81BA", 64.0)  # "Running On-Demand G and VT instances"
    assert make_backend(client, instance_type="g5.xlarge", quotas_client=gpus).instance_limit() == 16  # 4 vCPUs each
    standard = Quotas("L-1216C47A", 6.0)
    assert make_backend(client, instance_type="m5.xlarge", quotas_client=standard).instance_limit() == 1


def test_the_limit_is_unknown_without_a_quota_to_read(client, moto_endpoint):
    assert make_backend(client).instance_limit() is None  # no quotas client
    assert make_backend(client, instance_type="trn1.2xlarge", quotas_client=Quotas("", 1.0)).instance_limit() is None
    moto_quotas = boto3.client("service-quotas", endpoint_url=moto_endpoint, region_name="us-east-1")
    assert make_backend(client, instance_type="g5.xlarge", quotas_client=moto_quotas).instance_limit() is None  # NoSuchResource
    assert make_backend(client, quotas_client=Quotas("L-417A185B", 400.0)).instance_limit() is None  # a type moto lacks


def test_the_hook_gives_the_backend_a_quotas_client_of_the_same_connection(aws_connection, moto_endpoint):
    backend = Ec2ComputeHook(aws_connection).get_backend(
        instance_type="g5.xlarge", image_id=IMAGE_ID, pools={"us-east-1a": "us-east-1a"}
    )
    quotas = backend.quotas_client
    assert quotas.meta.service_model.service_name == "service-quotas" and quotas.meta.endpoint_url == moto_endpoint
    assert quotas.meta.region_name == "us-east-1" and backend.instance_limit() is None  # moto: no EC2 quotas
