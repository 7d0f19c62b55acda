"""Oracle: the realised future with a chosen amount of error, for the sensitivity study.

It is told the job's realised market (``reveal``) and answers every forecast with the true
slots that follow ``past``, perturbed: prices by a multiplicative lognormal factor whose
relative spread is ``error``, available counts by Gaussian noise of ``error`` times the pool's
largest count, rounded and clipped to [0, that count]. ``error=0`` is the perfect forecast.
The noise is a function of ``seed`` and the forecast's first slot alone, so a run repeats
exactly. Slots after the revealed market repeat its last slot.

Two options narrow what it knows, to measure which part of the future pays: ``lead`` (it sees
that many slots ahead and holds the last of them beyond; 0 is persistence) and ``reveals``
("all"; "available", the counts only, prices by persistence; "drops", a count only where it
falls below the current one, prices and rises by persistence). On the shipped traces, knowing
drops one slot ahead is about a third of what separates CHC on persistence from CHC on the
realised market (docs/evaluation.md, "What knowing a drop ahead is worth").
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket

REVEALS = ("all", "available", "drops")
Reveals = Literal["all", "available", "drops"]


class OracleForecaster(Forecaster):
    """The true future, revealed up front, plus noise of relative size ``error``; ``lead`` and
    ``reveals`` limit how far ahead it sees and which part of the future."""

    name = "oracle"
    uses_future = True

    def __init__(self, error: float = 0.0, seed: int = 0, lead: int | None = None, reveals: Reveals = "all") -> None:
        if isinstance(error, bool) or not isinstance(error, (int, float)) or not 0 <= error < math.inf:
            raise ValueError(f"error must be a finite number >= 0 (relative forecast error), got {error!r}")
        if lead is not None and (isinstance(lead, bool) or not isinstance(lead, (int, np.integer)) or lead < 0):
            raise ValueError(f"lead must be an integer >= 0 (slots the oracle sees ahead) or null (all of them), got {lead!r}")
        if reveals not in REVEALS:
            raise ValueError(f"reveals must be one of {REVEALS} (which part of the future the oracle knows), got {reveals!r}")
        self.error = float(error)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0 (the noise's random seed), got {seed!r}")
        self.seed = int(seed)
        self.lead = None if lead is None else int(lead)
        self.reveals = reveals
        self._market: SlotMarket | None = None

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"error": self.error, "seed": self.seed}
        if self.lead is not None:
            params["lead"] = self.lead
        if self.reveals != "all":
            params["reveals"] = self.reveals
        return params

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
        return self._narrowed(past, price, available)

    def _narrowed(self, past: SlotMarket, price: np.ndarray, available: np.ndarray) -> Forecast:
        """The part of the future that ``lead`` and ``reveals`` allow; persistence for the rest."""
        now_price = np.broadcast_to(past.spot_price[-1].astype(float), price.shape)
        now_available = np.broadcast_to(past.available[-1].astype(float), available.shape)
        if self.lead is not None:
            price, available = _held(price, self.lead, now_price), _held(available, self.lead, now_available)
        if self.reveals != "all":
            price = now_price
        if self.reveals == "drops":
            available = np.minimum(available, now_available)
        return Forecast(np.array(price, dtype=float), np.array(available, dtype=float))


def _held(rows: np.ndarray, lead: int, now: np.ndarray) -> np.ndarray:
    """``rows`` up to ``lead``, then the last of them held (``now`` throughout for lead 0)."""
    if lead == 0:
        return now
    kept = rows[:lead]
    return np.concatenate([kept, np.broadcast_to(kept[-1], (rows.shape[0] - kept.shape[0], *rows.shape[1:]))])
