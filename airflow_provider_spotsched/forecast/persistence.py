"""Persistence: tomorrow looks like now. The floor any forecaster has to beat.

Every future slot repeats the last observed slot's spot prices and available counts.
"""

from __future__ import annotations

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket


class PersistenceForecaster(Forecaster):
    """The last observed slot, repeated."""

    name = "persistence"

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        return Forecast(
            spot_price=np.repeat(past.spot_price[-1:].astype(float), horizon, axis=0),
            available=np.repeat(past.available[-1:].astype(float), horizon, axis=0),
        )
