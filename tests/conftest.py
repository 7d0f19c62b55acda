"""Fixtures shared by the test suite: the shipped traces, loaded once per session."""

from __future__ import annotations

import os
import sys

import pytest

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.market.trace import Trace, load_trace

# The suite's replayed slots last seconds: its deferrals are not held against Airflow's race
# (triggers/spot_job.py). The guard's own tests set it, and the real deployment (its processes get
# no AIRFLOW* variable from here) runs with the default.
os.environ.setdefault("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", "0")


@pytest.fixture(scope="session")
def aws_trace() -> Trace:
    return load_trace(AWS_TRACE)


@pytest.fixture(scope="session")
def gcp_trace() -> Trace:
    return load_trace(GCP_TRACE)


@pytest.fixture(autouse=True)
def fresh_forecast_memos():
    """Tests that monkeypatch a model must not read another test's memoised fit or backtest."""
    for module, memo in (("series", "_fit_cache"), ("auto", "_backtest_cache")):
        loaded = sys.modules.get(f"airflow_provider_spotsched.forecast.{module}")
        if loaded is not None:
            getattr(loaded, memo).clear()
