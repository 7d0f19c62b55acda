"""The market-data hooks build sources from Airflow connections given as environment variables
(no metadata database): AWS against the moto server, GCP with a made-up service-account key and
Google's token and catalog endpoints answered by recorded replies (no network)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import responses
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from airflow_provider_spotsched.hooks.market_data import AwsSpotMarketHook, GcpSpotMarketHook, aws_zone_region
from airflow_provider_spotsched.market.aws import AwsSpotMarketSource
from airflow_provider_spotsched.market.gcp import CATALOG_URL, GcpSpotMarketSource
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.market.source import CombinedMarketSource
from tests.moto_server import FAKE_CREDENTIALS, aws_env, moto_endpoint  # noqa: F401  (pytest fixtures)
from tests.test_market_sources import billing_page

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def aws_connection(aws_env, monkeypatch) -> str:
    """An AWS connection pointing at the moto server; the environment holds no other credentials."""
    for name in FAKE_CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    extra = {"endpoint_url": aws_env, "region_name": "us-east-1"}
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPOT_MARKET_AWS",
        json.dumps({"conn_type": "aws", "login": "testing", "password": "testing", "extra": extra}),
    )
    return "spot_market_aws"


def test_the_aws_hook_builds_one_source_per_region_from_the_connection(aws_connection, aws_env):
    hook = AwsSpotMarketHook(aws_conn_id=aws_connection)
    outcomes = [
        LaunchOutcome(T0 + timedelta(minutes=1), "us-east-1a", 1, 1),
        LaunchOutcome(T0 + timedelta(minutes=1), "us-west-2a", 1, 0, "InsufficientInstanceCapacity"),
    ]
    source = hook.get_source(
        "g4dn.xlarge", ["us-east-1a", "us-west-2a"], 0.526, placement_target=None, launch_outcomes=lambda a, b: outcomes
    )
    assert isinstance(source, CombinedMarketSource)
    regions = [s.client.meta.region_name for s in source.sources]
    assert regions == ["us-east-1", "us-west-2"] and all(isinstance(s, AwsSpotMarketSource) for s in source.sources)
    assert {s.client.meta.endpoint_url for s in source.sources} == {aws_env}
    assert source.sources[0].client.meta.config.region_name == "us-east-1"
    credentials = source.sources[1].client._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == ("testing", "testing")  # from the connection
    trace = source.observe(T0, T0 + timedelta(minutes=20))
    assert trace.names == ["us-east-1a", "us-west-2a"]
    assert list(trace.pools["us-east-1a"].available) == [1, 1, 1]
    assert list(trace.pools["us-west-2a"].available) == [0, 0, 0]
    # one zone: the plain source, no combination
    assert isinstance(hook.get_source("g4dn.xlarge", ["us-east-1c"], 0.526), AwsSpotMarketSource)


def test_zone_names_must_name_a_region():
    assert aws_zone_region("us-east-1a") == "us-east-1" and aws_zone_region("ap-southeast-2c") == "ap-southeast-2"
    with pytest.raises(ValueError, match="is not a name like 'us-east-1a'"):
        aws_zone_region("us-east-1")


@pytest.fixture
def gcp_connection(monkeypatch) -> str:
    """A Google Cloud connection with a made-up service-account key (a fresh RSA key, never sent)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    keyfile = {
        "type": "service_account",
        "project_id": "spot-test",
        "private_key_id": "0123456789abcdef",
        "private_key": pem.decode(),
        "client_email": "market@spot-test.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    extra = {"keyfile_dict": json.dumps(keyfile), "project": "spot-test"}
    connection = {"conn_type": "google_cloud_platform", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_SPOT_MARKET_GCP", json.dumps(connection))
    return "spot_market_gcp"


def test_the_gcp_hook_authorises_catalog_requests_with_the_connection_key(gcp_connection):
    hook = GcpSpotMarketHook(gcp_conn_id=gcp_connection)
    source = hook.get_source("a3-highgpu-1g", ["us-central1-a"])
    assert isinstance(source, GcpSpotMarketSource)
    assert source.session.credentials.service_account_email == "market@spot-test.iam.gserviceaccount.com"
    with responses.RequestsMock() as mock:
        reply = {"access_token": "fake-token", "expires_in": 3600, "token_type": "Bearer"}
        token = mock.post("https://oauth2.googleapis.com/token", json=reply)
        for number in (1, 2, 3):
            mock.get(CATALOG_URL, json=billing_page(number))
        prices = source.prices()
        assert token.call_count == 1
        catalog_calls = [c for c in mock.calls if c.request.url.startswith(CATALOG_URL)]
        assert len(catalog_calls) == 3
        assert {c.request.headers["Authorization"] for c in catalog_calls} == {"Bearer fake-token"}
    assert prices["us-central1"].spot == pytest.approx(26 * 0.00916 + 234 * 0.00123 + 2.25)
