"""The forecaster interface: what the prediction-based scheduler asks of any forecasting model.

A forecaster sees the market up to now (a :class:`SlotMarket` whose last slot is the current one)
and predicts the next ``horizon`` slots' spot prices and available counts for every pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket


@dataclass(frozen=True)
class Forecast:
    """Predicted ``spot_price[h, M]`` and expected ``available[h, M]`` for slots now+1 .. now+h."""

    spot_price: np.ndarray
    available: np.ndarray

    @property
    def horizon(self) -> int:
        return int(self.spot_price.shape[0])


def check_request(past: SlotMarket, horizon: int) -> None:
    """Refuse a forecast that cannot be made: no past to start from, or nothing to predict."""
    if past.num_slots < 1:
        raise ValueError("past holds no slot; a forecast needs at least the current slot")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 slot, got {horizon}")


class Forecaster(ABC):
    """Predicts a market's next slots from its past; ``name`` identifies the model."""

    name: str = "forecaster"

    @abstractmethod
    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        """Forecast slots after the last one of ``past``; never looks at anything else."""

    def params(self) -> dict[str, Any]:
        return {}
