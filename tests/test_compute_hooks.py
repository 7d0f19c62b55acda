"""The compute hooks build the cloud backends from Airflow connections (``AIRFLOW_CONN_*`` JSON).

The EC2 hook's backend launches on the moto server with the connection's credentials (none in
the environment); the Compute Engine hook's backend carries the connection's project and service
account. Neither connection's secrets reach an instance's start-up script.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import boto3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.cloud import compute_v1

from airflow_provider_spotsched.backends.base import TrainingJob
from airflow_provider_spotsched.backends.bootstrap import startup_script
from airflow_provider_spotsched.backends.ec2 import Ec2Backend
from airflow_provider_spotsched.backends.gce import GceBackend
from airflow_provider_spotsched.hooks.compute import Ec2ComputeHook, GceComputeHook
from airflow_provider_spotsched.scheduling.model import Allocation
from tests.moto_server import FAKE_CREDENTIALS, moto_endpoint  # noqa: F401 (a fixture)

JOB = TrainingJob("hooks.job__1", ("spotsched-train", "--config", "cfg.json"), "s3://bucket/ckpt", ("us-east-1a",))
AWS_LOGIN, AWS_PASSWORD = "AKIAIOSFODNN7EXAMPLE", "conn-secret-wJalrXUtnFEMI"


@pytest.fixture
def aws_connection(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in (*FAKE_CREDENTIALS, "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)  # the connection is the only source of credentials
    connection = {
        "conn_type": "aws",
        "login": AWS_LOGIN,
        "password": AWS_PASSWORD,
        "extra": {"region_name": "us-east-1", "endpoint_url": moto_endpoint},
    }
    monkeypatch.setenv("AIRFLOW_CONN_SPOTSCHED_AWS", json.dumps(connection))
    return "spotsched_aws"


@pytest.fixture
def gcp_connection(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    keyfile = {
        "type": "service_account",
        "project_id": "spotsched-test",
        "private_key_id": "0123456789abcdef",
        "private_key": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
        "client_email": "airflow@spotsched-test.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    connection = {"conn_type": "google_cloud_platform", "extra": {"project": "spotsched-test", "keyfile_dict": keyfile}}
    monkeypatch.setenv("AIRFLOW_CONN_SPOTSCHED_GCP", json.dumps(connection))
    return keyfile


def test_the_ec2_hook_launches_with_the_connections_credentials_and_keeps_them_off_the_instance(aws_connection):
    backend = Ec2ComputeHook(aws_connection).get_backend(
        instance_type="g5.xlarge", image_id="ami-03cf127a", pools={"us-east-1a": "us-east-1a"}
    )
    assert isinstance(backend, Ec2Backend)
    credentials = backend.client._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == (AWS_LOGIN, AWS_PASSWORD)

    status = backend.reconcile(JOB, Allocation((1,), 0))
    (instance,) = status.instances
    ec2 = boto3.client(
        "ec2", endpoint_url=backend.client.meta.endpoint_url, region_name="us-east-1",
        aws_access_key_id="x", aws_secret_access_key="y",
    )
    value = ec2.describe_instance_attribute(InstanceId=instance.instance_id, Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(value).decode()
    assert "spotsched-train" in script
    for secret in (AWS_LOGIN, AWS_PASSWORD, aws_connection, "endpoint_url", backend.client.meta.endpoint_url):
        assert secret not in script
    backend.release(JOB)


def test_the_gce_hook_builds_clients_from_the_connections_service_account(gcp_connection):
    backend = GceComputeHook("spotsched_gcp").get_backend(
        zones={"us-central1-a": "us-central1-a"},
        on_demand_zone="us-central1-b",
        machine_type="g2-standard-8",
        image="projects/deeplearning-platform-release/global/images/family/common-cu124",
    )
    assert isinstance(backend, GceBackend) and backend.project == "spotsched-test"
    assert isinstance(backend.instances, compute_v1.InstancesClient)
    assert isinstance(backend.operations, compute_v1.ZoneOperationsClient)
    email = backend.instances._transport._credentials.service_account_email
    assert email == gcp_connection["client_email"]

    job = TrainingJob("hooks.job__1", ("spotsched-train",), "gs://bucket/ckpt", ("us-central1-a",))
    script = startup_script(job, "gcp")
    assert gcp_connection["private_key_id"] not in script and "PRIVATE KEY" not in script
    assert gcp_connection["client_email"] not in script
