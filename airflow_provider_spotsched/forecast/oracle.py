"""Oracle: the realised future with a chosen amount of error, for the sensitivity study.

It is told the job's realised market (``reveal``) and answers every forecast with the true
slots that follow ``past``, perturbed: prices by a multiplicative lognormal factor whose
relative spread is ``error``, available counts by Gaussian noise of ``error`` times the pool's
largest count, rounded and clipped to [0, that count]. ``error=0`` is the perfect forecast.
The noise is a function of ``seed`` and the forecast's first slot alone, so a run repeats
exactly. Slots after the revealed market repeat its last slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket


class OracleForecaster(Forecaster):
    """The true future, revealed up front, plus noise of relative size ``error``."""

    name = "oracle"
    uses_future = True

    def __init__(self, error: float = 0.0, seed: int = 0) -> None:
        if not error >= 0:
            raise ValueError(f"error must be >= 0 (relative forecast error), got {error}")
        self.error = float(error)
        self.seed = int(seed)
        self._market: SlotMarket | None = None

    def params(self) -> dict[str, Any]:
        return {"error": self.error, "seed": self.seed}

    def reveal(self, market: SlotMarket) -> None:
        """Store the job's realised market; its slot 0 is the job's submission slot."""
        self._market = market

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        market = self._market
        if market is None:
            raise ValueError("the oracle knows no future yet; call reveal(market) with the job's market first")
        if past.slot_hours != market.slot_hours or past.pools != market.pools:
            raise ValueError(
                f"past ({past.num_pools} pools, {past.slot_hours:g} h slots) does not match the revealed market "
                f"({market.num_pools} pools, {market.slot_hours:g} h slots); reveal the market the job runs on"
            )
        first_hours = (past.start - market.start).total_seconds() / 3600.0 + past.num_slots * past.slot_hours
        first = round(first_hours / market.slot_hours)
        if first < 0 or abs(first * market.slot_hours - first_hours) > 1e-6:
            raise ValueError(
                f"the forecast's first slot starts {first_hours:g} h after the revealed market's start; it must "
                f"lie on that market's slot grid at or after its start"
            )
        rows = np.minimum(first + np.arange(horizon), market.num_slots - 1)
        price = market.spot_price[rows].astype(float)
        available = market.available[rows].astype(float)
        rng = np.random.default_rng([self.seed, first])
        sigma = self.error
        price = price * np.exp(sigma * rng.standard_normal(price.shape) - sigma**2 / 2)
        top = market.available.max(axis=0).astype(float)
        available = np.clip(np.rint(available + self.error * top * rng.standard_normal(available.shape)), 0, top)
        return Forecast(price, available)
