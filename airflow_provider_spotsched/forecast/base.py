"""The forecaster interface: what the prediction-based scheduler asks of any forecasting model.

A forecaster sees the market up to now (a :class:`SlotMarket` whose last slot is the current one)
and predicts the next ``horizon`` slots' spot prices and available counts for every pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import ndtri

from airflow_provider_spotsched.market.slots import SlotMarket

Z80 = float(ndtri(0.9))  # the bounds of an 80% central interval are the point +- Z80 sd


@dataclass(frozen=True)
class Forecast:
    """What a forecaster predicts for slots now+1 .. now+h of every pool.

    ``spot_price[h, M]`` and ``available[h, M]`` are the point forecasts. For availability a count
    chain's point is the median of its count distribution, which minimises absolute error (the
    expectation of a pool that is either full or empty is a count it never takes), and a Gaussian
    model's mean is its median; persistence and seasonal naive inside the statistical forecasters
    forecast the count they copy and take its chances from what followed that count
    (:func:`~.series.lagged_counts`), so their point need not be that distribution's median. The
    optional parts carry uncertainty: ``*_interval`` is a (lower, upper) pair of ``[h, M]`` arrays
    (an 80% interval), and ``available_distribution[h, M, C + 1]`` is the
    probability of each count 0..C. ``models`` names the model behind each pool's forecast.
    """

    spot_price: np.ndarray
    available: np.ndarray
    spot_price_interval: tuple[np.ndarray, np.ndarray] | None = None
    available_interval: tuple[np.ndarray, np.ndarray] | None = None
    available_distribution: np.ndarray | None = None
    models: tuple[str, ...] = ()

    @property
    def horizon(self) -> int:
        return int(self.spot_price.shape[0])

    def p_available_at_least(self, n: int) -> np.ndarray:
        """``[h, M]`` probability that at least ``n`` instances are obtainable in each slot.

        Without a distribution the point forecast is taken as certain (1 where it reaches ``n``).
        """
        if n < 0:
            raise ValueError(f"n must be >= 0 instances, got {n}")
        if self.available_distribution is None:
            return (self.available >= n).astype(float)
        return self.available_distribution[:, :, n:].sum(axis=2).clip(0.0, 1.0)

    def available_at_level(self, level: float) -> np.ndarray:
        """``[h, M]`` the largest count obtainable with probability >= ``level`` in each slot.

        A planner that counts only on this much spot keeps the rest of the point forecast in
        reserve, and the reserve widens with the distribution. Never above the point forecast
        (so the reserve is never negative); without a distribution, the point forecast itself.
        """
        _check_level(level)
        point = np.maximum(np.floor(self.available), 0.0)
        if self.available_distribution is None:
            return point
        at_least = np.cumsum(self.available_distribution[:, :, ::-1], axis=2)[:, :, ::-1]  # P(count >= n)
        # P(count >= n) falls with n, so the counts n >= 1 it keeps >= level are 1..the quantile.
        counts = (at_least[:, :, 1:] >= level - 1e-12).sum(axis=2)
        return np.minimum(counts.astype(float), point)

    def spot_price_at_level(self, level: float) -> np.ndarray:
        """``[h, M]`` the price not exceeded with probability ``level`` in each slot.

        The tails are a normal's scaled to the 80% interval on each side of the point (the
        interval's bound is the 10% or 90% quantile); without an interval, the point forecast.
        """
        _check_level(level)
        if self.spot_price_interval is None:
            return self.spot_price
        lower, upper = self.spot_price_interval
        z = float(ndtri(level)) / Z80
        side = np.maximum(upper - self.spot_price, 0.0) if z >= 0 else np.maximum(self.spot_price - lower, 0.0)
        return np.maximum(self.spot_price + z * side, 0.0)


def _check_level(level: float) -> None:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a probability in (0, 1), got {level!r}")


def check_request(past: SlotMarket, horizon: int) -> None:
    """Refuse a forecast that cannot be made: no past to start from, or nothing to predict."""
    if past.num_slots < 1:
        raise ValueError("past holds no slot; a forecast needs at least the current slot")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 slot, got {horizon}")


class Forecaster(ABC):
    """Predicts a market's next slots from its past; ``name`` identifies the model.

    A forecaster that reads the realised future (the oracle) sets ``uses_future`` and implements
    :meth:`reveal`; backtests refuse it.
    """

    name: str = "forecaster"
    uses_future: bool = False

    def reveal(self, market: SlotMarket) -> None:
        """Take the job's realised market (slot 0 = submission) before the first forecast.

        Called only when ``uses_future`` is set; a forecaster that sees the past alone refuses it.
        """
        raise NotImplementedError(f"forecaster {self.name!r} does not use the future; it takes no realised market")

    @abstractmethod
    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        """Forecast slots after the last one of ``past``; never looks at anything else."""

    def params(self) -> dict[str, Any]:
        return {}
