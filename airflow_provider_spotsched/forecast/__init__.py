"""Forecasters by name: every model answers the same :class:`~.base.Forecaster` calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.registry import build, parameters

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


def daily_season_slots(slot_hours: float) -> int:
    """Slots in a day of ``slot_hours``-hour slots (at least 1): the season of the daily models."""
    return max(1, round(24.0 / slot_hours))


def make_forecaster(name: str, params: Mapping[str, Any] | None = None, slot_hours: float | None = None) -> Forecaster:
    """Build forecaster ``name`` with ``params``, naming any parameter it does not take.

    Given the market's ``slot_hours``, a model with a daily season gets ``season_slots`` = a day of
    those slots unless ``params`` sets it: its default, 24, is a day of hourly slots only, and on
    half-hour slots it would repeat the slot half a day back, the opposite phase.
    """
    params = dict(params or {})
    if slot_hours is not None and "season_slots" in parameters("forecaster", FORECASTERS, name):
        params.setdefault("season_slots", daily_season_slots(slot_hours))
    return build("forecaster", FORECASTERS, name, params)


__all__ = ["FORECASTERS", "LIVE_FORECASTERS", "Forecast", "Forecaster", "daily_season_slots", "make_forecaster"]
