"""Seasonal naive: each future slot is the slot one season earlier (by default a day of hours).

Spot markets follow the working day; repeating the last season captures that at no cost. A slot
whose season-earlier counterpart lies before the start of the history takes the last observed
slot instead (persistence), and a slot more than a season ahead repeats the last season again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket


class SeasonalNaiveForecaster(Forecaster):
    """The value one season of ``season_slots`` slots earlier."""

    name = "seasonal-naive"

    def __init__(self, season_slots: int = 24) -> None:
        if isinstance(season_slots, bool) or not isinstance(season_slots, (int, np.integer)) or season_slots < 1:
            raise ValueError(f"season_slots must be an integer >= 1 (slots per season), got {season_slots!r}")
        self.season_slots = int(season_slots)

    def params(self) -> dict[str, Any]:
        return {"season_slots": self.season_slots}

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        n, season = past.num_slots, self.season_slots
        ahead = np.arange(horizon)  # slot n + ahead is forecast
        source = n + ahead - season * (ahead // season + 1)
        source = np.where(source >= 0, source, n - 1)
        return Forecast(
            spot_price=past.spot_price[source].astype(float),
            available=past.available[source].astype(float),
        )
