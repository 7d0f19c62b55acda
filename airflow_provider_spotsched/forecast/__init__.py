"""Forecasters by name: every model answers the same :class:`~.base.Forecaster` calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.registry import build

FORECASTERS: dict[str, str] = {
    "persistence": "airflow_provider_spotsched.forecast.persistence:PersistenceForecaster",
    "seasonal-naive": "airflow_provider_spotsched.forecast.seasonal_naive:SeasonalNaiveForecaster",
    "oracle": "airflow_provider_spotsched.forecast.oracle:OracleForecaster",
    "arima": "airflow_provider_spotsched.forecast.arima:ArimaForecaster",
    "holt-winters": "airflow_provider_spotsched.forecast.exponential_smoothing:HoltWintersForecaster",
    "markov-count": "airflow_provider_spotsched.forecast.markov_count:MarkovCountForecaster",
    "sojourn-chain": "airflow_provider_spotsched.forecast.sojourn_chain:SojournChainForecaster",
    "auto": "airflow_provider_spotsched.forecast.auto:AutoForecaster",
}
LIVE_FORECASTERS: tuple[str, ...] = tuple(name for name in FORECASTERS if name != "oracle")
"""The forecasters that read only the past, so can forecast a live market (the oracle reads the future)."""


def make_forecaster(name: str, params: Mapping[str, Any] | None = None) -> Forecaster:
    """Build forecaster ``name`` with ``params``, naming any parameter it does not take."""
    return build("forecaster", FORECASTERS, name, params)


__all__ = ["FORECASTERS", "LIVE_FORECASTERS", "Forecast", "Forecaster", "make_forecaster"]
