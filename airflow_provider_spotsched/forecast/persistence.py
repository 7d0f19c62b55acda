"""Persistence: tomorrow looks like now. The floor any forecaster has to beat.

Every future slot repeats the last observed slot's spot prices and available counts.
"""

from __future__ import annotations

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.market.slots import SlotMarket


def check_request(past: SlotMarket, horizon: int) -> None:
    """Refuse a forecast that cannot be made: no past to start from, or nothing to predict."""
    if past.num_slots < 1:
        raise ValueError("past holds no slot; a forecast needs at least the current slot")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 slot, got {horizon}")


class PersistenceForecaster(Forecaster):
    """The last observed slot, repeated."""

    name = "persistence"

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        return Forecast(
            spot_price=np.repeat(past.spot_price[-1:].astype(float), horizon, axis=0),
            available=np.repeat(past.available[-1:].astype(float), horizon, axis=0),
        )
