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
    "blend": "airflow_provider_spotsched.forecast.blend:BlendForecaster",
}
LIVE_FORECASTERS: tuple[str, ...] = tuple(name for name in FORECASTERS if name != "oracle")
"""The forecasters that read only the past, so can forecast a live market (the oracle reads the future)."""


DURATION_DEFAULTS_HOURS: dict[str, float] = {
    "season_slots": 24.0,  # a daily season
    "refit_every": 24.0,  # the statistical models are refitted once a day
    "reselect_every": 168.0,  # auto chooses its models again once a week
    "origins": 144.0,  # auto scores each lead on six days of backtest origins, one a slot
    "backtest_horizon": 24.0,  # auto's backtest forecasts a day ahead
    "min_training": 48.0,  # auto's first backtest origin has two days of history
}
"""The forecasters' parameters counted in slots whose defaults stand for a duration, in hours. The
classes' defaults are these counts of hourly slots; :func:`make_forecaster` converts them to the
market's slots."""


def make_forecaster(name: str, params: Mapping[str, Any] | None = None, slot_hours: float | None = None) -> Forecaster:
    """Build forecaster ``name`` with ``params``, naming any parameter it does not take.

    Given the market's ``slot_hours``, every parameter of :data:`DURATION_DEFAULTS_HOURS` that the
    model takes and ``params`` does not set is that duration in those slots: the defaults count
    hourly slots, so on half-hour slots a daily season of 24 slots would repeat the slot half a day
    back (the opposite phase), and a refit "once a day" would come every 12 hours. Hourly slots get
    the defaults unchanged. A duration becomes the nearest whole number of slots, at least 1.
    """
    params = dict(params or {})
    if slot_hours is not None:
        for parameter in parameters("forecaster", FORECASTERS, name):
            if parameter in DURATION_DEFAULTS_HOURS:
                params.setdefault(parameter, max(1, round(DURATION_DEFAULTS_HOURS[parameter] / slot_hours)))
            elif parameter == "slot_hours":  # a forecaster made of others (blend) builds them for these slots
                params.setdefault(parameter, slot_hours)
    return build("forecaster", FORECASTERS, name, params)


__all__ = ["DURATION_DEFAULTS_HOURS", "FORECASTERS", "LIVE_FORECASTERS", "Forecast", "Forecaster", "make_forecaster"]
