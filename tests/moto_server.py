"""A moto server on loopback, shared by the tests that talk to AWS APIs through real HTTP.

A server (rather than ``mock_aws``) exercises what production runs: boto3 clients with an
``endpoint_url``, botocore's serialisation and the Amazon provider's hooks. Import the fixtures
into a test module (``from tests.moto_server import moto_endpoint, aws_env``) to use them.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Credentials moto accepts; set only inside tests so no real key is ever picked up."""


def start_moto_server() -> tuple[ThreadedMotoServer, str]:
    """Start a moto server on 127.0.0.1 at a free port; return it and its endpoint URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def reset_moto(endpoint_url: str) -> None:
    """Forget every resource the server holds, so that tests do not see each other's."""
    request = urllib.request.Request(f"{endpoint_url}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL of one moto server for the whole session (stopped at the end)."""
    server, endpoint_url = start_moto_server()
    try:
        yield endpoint_url
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Fake credentials in the environment and a freshly reset server; returns the endpoint URL."""
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    reset_moto(moto_endpoint)
    return moto_endpoint
