"""An equal mixture of other forecasters' predictions: a forecast combination.

Which forecaster CHC should plan on is a property of the market: `auto` (per lead time, a model
that beat persistence beyond chance on the recent past) pays on some (the shipped traces, daily
cycles), the sojourn chain (a count's chance of moving by how long it has held) on others
(capacity that flaps or crunches). A job cannot know beforehand which market it runs in, and a
selector learns it only over rounds. Averaging the two predictive distributions is the classic
hedge (forecast combination): where they agree it changes nothing, where they disagree the plan
counts on what the mixture gives with even odds.

For each pool, availability is the mixture of the members' count distributions (a member without
one contributes its point as a certain count), its point the mixture's median and its 80%
interval the mixture's 10% and 90% quantiles; the price is the mean of the members' points, its
interval the mean of their bounds where every member gives one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast import LIVE_FORECASTERS, make_forecaster
from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.forecast.series import median_forecast
from airflow_provider_spotsched.market.slots import SlotMarket

DEFAULT_MEMBERS = ("auto", "sojourn-chain")


class BlendForecaster(Forecaster):
    """The equal mixture of ``members``' forecasts (two or more live forecasters, by name)."""

    name = "blend"

    def __init__(self, members: Sequence[str] = DEFAULT_MEMBERS, slot_hours: float | None = None) -> None:
        names = list(members) if not isinstance(members, str) else [members]
        others = [name for name in LIVE_FORECASTERS if name != self.name]
        if len(names) < 2 or len(set(names)) != len(names) or any(name not in others for name in names):
            raise ValueError(f"members must be two or more distinct forecasters of {others}, got {members!r}")
        self.members = tuple(names)
        self.parts = [make_forecaster(name, None, slot_hours) for name in self.members]

    def params(self) -> dict[str, Any]:
        return {"members": list(self.members)}

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        forecasts = [part.forecast(past, horizon) for part in self.parts]
        price = np.mean([f.spot_price for f in forecasts], axis=0)
        bounds = [f.spot_price_interval for f in forecasts if f.spot_price_interval is not None]
        price_interval = None
        if len(bounds) == len(forecasts):
            price_interval = (np.mean([lower for lower, _ in bounds], axis=0), np.mean([upper for _, upper in bounds], axis=0))
        distributions = [_count_distribution(f) for f in forecasts]
        top = max(d.shape[2] for d in distributions)
        mixture = np.mean([np.pad(d, ((0, 0), (0, 0), (0, top - d.shape[2]))) for d in distributions], axis=0)
        pools = [median_forecast(mixture[:, m, :]) for m in range(mixture.shape[1])]
        available = np.stack([p.mean for p in pools], axis=1)
        interval = (np.stack([p.lower for p in pools], axis=1), np.stack([p.upper for p in pools], axis=1))
        return Forecast(price, available, price_interval, interval, mixture, self._models(forecasts, len(past.pools)))

    def _models(self, forecasts: Sequence[Forecast], pools: int) -> tuple[str, ...]:
        """Per pool, each member's model: ``member:model`` joined by ``+`` (the member's name alone
        where it names no model per pool)."""
        return tuple(
            "+".join(f"{name}:{f.models[m]}" if f.models else name for name, f in zip(self.members, forecasts))
            for m in range(pools)
        )


def _count_distribution(forecast: Forecast) -> np.ndarray:
    """``[h, M, C + 1]``: the forecast's count distribution, or its point as a certain count."""
    if forecast.available_distribution is not None:
        return forecast.available_distribution
    point = np.maximum(np.floor(forecast.available), 0).astype(int)
    certain = np.zeros((*point.shape, int(point.max()) + 1))
    np.put_along_axis(certain, point[..., None], 1.0, axis=2)
    return certain
