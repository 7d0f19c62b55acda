"""Fixtures shared by the test suite: the shipped traces, loaded once per session."""

from __future__ import annotations

import pytest

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.market.trace import Trace, load_trace


@pytest.fixture(scope="session")
def aws_trace() -> Trace:
    return load_trace(AWS_TRACE)


@pytest.fixture(scope="session")
def gcp_trace() -> Trace:
    return load_trace(GCP_TRACE)
