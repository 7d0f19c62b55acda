"""A live forecast: the market as known at one instant, and the forecast document written for it.

:func:`market_at` cuts the trace at ``at`` before resampling, so nothing later is read: not a
tick's values, not its existence (which would shift the typical tick gap behind the hole rule).
Its slots end with the one that starts at ``at``; the forecast covers the slots starting at
``at + i * slot_hours`` for i = 1..K (the spec's resampling: the state in force at each start).

Live data always lags the clock: the newest tick is some minutes older than now. An ``at`` up to
``max_staleness_hours`` (default :data:`MAX_STALENESS_HOURS`) after the newest tick is accepted;
the slots after it hold every pool's last tick, with the pool's availability unknown (0, the
spec's hole rule) once that tick is older than 1.5 typical tick gaps. :class:`Snapshot` keeps
each pool's last tick, and the forecast document says how stale the data was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecast
from airflow_provider_spotsched.market.slots import HOLE_FACTOR, SlotMarket, resample_until, select_pools
from airflow_provider_spotsched.market.source import MarketSource
from airflow_provider_spotsched.market.trace import PoolSeries, Trace, TraceError, format_timestamp

MAX_HORIZON = 48
"""Two days of hourly slots. The forecasters model at most a daily season: two seasons ahead they
only repeat its profile (or a constant), and CHC plans 24 slots ahead."""

MIN_HISTORY_HOURS = 24.0
"""One daily season: the least a forecast of the working-day cycle can start from."""

DEFAULT_HISTORY_HOURS = 14 * 24.0
"""Two weeks: the longest history the forecasters' daily and weekly patterns use."""

MAX_STALENESS_HOURS = 1.0
"""How far ``at`` may lie after the newest tick: a live feed minutes behind the clock is the
normal case; one a whole slot behind is broken, and its forecast would start from a guess."""


@dataclass(frozen=True)
class Snapshot:
    """The market in slots up to the one starting at ``at``, and each pool's newest tick at or
    before ``at`` (UTC epoch seconds); ``hole_seconds`` is the age from which a tick no longer
    says what is available (1.5 typical tick gaps)."""

    market: SlotMarket
    at: datetime
    last_ticks: dict[str, float]
    hole_seconds: float

    @property
    def data_until(self) -> float:
        """The newest tick of any of the pools."""
        return max(self.last_ticks.values())

    def staleness_seconds(self, pool: str | None = None) -> float:
        """Seconds from the newest tick (of ``pool``, or of any pool) to ``at``."""
        tick = self.data_until if pool is None else self.last_ticks[pool]
        return self.at.timestamp() - tick

    def stale(self, pool: str) -> bool:
        """Whether ``pool``'s last tick is too old to say what is available at ``at`` (counted as 0)."""
        return self.staleness_seconds(pool) > self.hole_seconds


def trace_until(trace: Trace, at: datetime) -> Trace:
    """``trace`` with only the ticks at or before ``at``; pools with none are left out."""
    cut = at.timestamp()
    pools = {}
    for name, series in trace.pools.items():
        keep = series.times <= cut
        if keep.any():
            pools[name] = PoolSeries(
                series.times[keep], series.spot_price[keep], series.available[keep], series.on_demand_price[keep]
            )
    if not pools:
        raise TraceError(f"{trace.source} has no tick at or before {format_timestamp(at)}")
    return Trace(trace.source, pools, trace.grid_seconds)


def market_at(
    trace: Trace,
    at: datetime,
    slot_hours: float = 1.0,
    pools: Sequence[str] | None = None,
    max_staleness_hours: float = MAX_STALENESS_HOURS,
) -> SlotMarket:
    """Slots of ``slot_hours`` back from ``at`` to the trace's start, the last one starting at ``at``
    (:func:`snapshot_at`'s market)."""
    return snapshot_at(trace, at, slot_hours, pools, max_staleness_hours).market


def snapshot_at(
    trace: Trace,
    at: datetime,
    slot_hours: float = 1.0,
    pools: Sequence[str] | None = None,
    max_staleness_hours: float = MAX_STALENESS_HOURS,
) -> Snapshot:
    """The market at ``at`` in slots of ``slot_hours`` back to the trace's start, the last one
    starting at ``at``, with each pool's last tick.

    Refuses an ``at`` before the trace or more than ``max_staleness_hours`` after its newest
    tick, less than :data:`MIN_HISTORY_HOURS` of history, and pools that are unknown or have no
    tick by ``at``.
    """
    if not slot_hours > 0:
        raise ValueError(f"slot_hours must be > 0, got {slot_hours}")
    if not max_staleness_hours >= 0:
        raise ValueError(f"max_staleness_hours must be >= 0, got {max_staleness_hours!r}")
    at = at.astimezone(timezone.utc)
    first, last = trace.first_time, trace.last_time
    if at.timestamp() < first:
        raise TraceError(
            f"--at {format_timestamp(at)} lies outside {trace.source}, which covers "
            f"{_stamp(first)} .. {_stamp(last)}"
        )
    if at.timestamp() > last + max_staleness_hours * 3600.0 + 1e-6:
        raise TraceError(
            f"--at {format_timestamp(at)} lies outside {trace.source}, which covers {_stamp(first)} .. {_stamp(last)}: "
            f"its newest tick is {_age(at.timestamp() - last)} before --at, more than the {max_staleness_hours:g} h "
            f"of staleness allowed (the data feed may have stopped; raise the allowed staleness to forecast anyway)"
        )
    known = trace_until(trace, at)
    names = select_pools(known if pools is None else trace, pools)  # by default, the pools known at ``at``
    late = [name for name in names if name not in known.pools]
    if late:
        raise TraceError(f"pool(s) {late} have no tick at or before --at {format_timestamp(at)}; choose a later --at")
    step = slot_hours * 3600.0
    slots = int(math.floor((at.timestamp() - first) / step + 1e-9)) + 1
    needed = max(2, math.ceil(MIN_HISTORY_HOURS / slot_hours - 1e-9))
    if slots < needed:
        raise TraceError(
            f"--at {format_timestamp(at)} leaves {slots} slot(s) of {slot_hours:g} h of history in {trace.source}; "
            f"a forecast needs at least {needed} ({MIN_HISTORY_HOURS:g} h): choose an --at at or after "
            f"{_stamp(first + (needed - 1) * step)}"
        )
    return Snapshot(
        market=resample_until(known, at, slot_hours, names),
        at=at,
        last_ticks={name: float(known.pools[name].times[-1]) for name in names},
        hole_seconds=HOLE_FACTOR * known.tick_seconds,
    )


def _age(seconds: float) -> str:
    minutes = seconds / 60.0
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60.0:.1f} h"


def _stamp(epoch: float) -> str:
    return format_timestamp(datetime.fromtimestamp(epoch, timezone.utc))


def forecast_document(
    forecast: Forecast,
    market: SlotMarket,
    at: datetime,
    at_least: Sequence[int],
    model: str,
    snapshot: Snapshot | None = None,
) -> dict[str, Any]:
    """The ``spotsched forecast`` JSON: per pool its model, point forecasts and P(available >= n).

    ``model`` names the forecaster for pools whose forecast does not name its own model. The
    counts are n = 1 plus ``at_least``, keyed by their decimal string (JSON keys are strings).
    With the ``snapshot`` the market was cut from, the document says how old the data was:
    ``data_until`` (the newest tick) and ``staleness_seconds`` (from it to ``at``), and per pool
    its ``last_tick``, ``staleness_seconds`` and ``stale`` (its last tick too old to tell what is
    available at ``at``: the current slot's availability counted as 0).
    """
    counts = sorted({1, *at_least})
    chances = {n: forecast.p_available_at_least(n) for n in counts}
    names = forecast.models or (model,) * market.num_pools
    pools: dict[str, dict[str, Any]] = {}
    for m, pool in enumerate(market.pools):
        pools[pool] = {
            "model": names[m],
            "spot_price": _floats(forecast.spot_price[:, m]),
            "available": _floats(forecast.available[:, m]),
            "p_available_at_least": {str(n): _floats(chances[n][:, m]) for n in counts},
        }
        if snapshot is not None:
            pools[pool].update({
                "last_tick": _stamp(snapshot.last_ticks[pool]),
                "staleness_seconds": round(snapshot.staleness_seconds(pool), 3),
                "stale": snapshot.stale(pool),
            })
    document: dict[str, Any] = {"at": format_timestamp(at), "slot_hours": market.slot_hours}
    if snapshot is not None:
        document["data_until"] = _stamp(snapshot.data_until)
        document["staleness_seconds"] = round(snapshot.staleness_seconds(), 3)
    document["pools"] = pools
    return document


def _floats(values: np.ndarray) -> list[float]:
    return [float(v) for v in values]


def slot_market_at(
    source: MarketSource,
    at: datetime,
    slot_hours: float = 1.0,
    pools: Sequence[str] | None = None,
    history_hours: float = DEFAULT_HISTORY_HOURS,
    max_staleness_hours: float = MAX_STALENESS_HOURS,
) -> SlotMarket:
    """The market in slots up to the one starting at ``at``, as ``spotsched forecast`` cuts it
    (:func:`slot_snapshot_at`'s market)."""
    return slot_snapshot_at(source, at, slot_hours, pools, history_hours, max_staleness_hours).market


def slot_snapshot_at(
    source: MarketSource,
    at: datetime,
    slot_hours: float = 1.0,
    pools: Sequence[str] | None = None,
    history_hours: float = DEFAULT_HISTORY_HOURS,
    max_staleness_hours: float = MAX_STALENESS_HOURS,
) -> Snapshot:
    """The :class:`Snapshot` at ``at`` of a market source, as ``spotsched forecast`` cuts a trace.

    Reads ``history_hours`` before ``at`` and one slot after it: a replayed trace has ticks
    after ``at`` (:func:`snapshot_at` reads nothing after ``at``); a live market has none, and
    its newest tick may be up to ``max_staleness_hours`` older than ``at``.
    """
    if not history_hours > 0:
        raise ValueError(f"history_hours must be > 0, got {history_hours!r}")
    trace = source.observe(at - timedelta(hours=history_hours), at + timedelta(hours=slot_hours))
    if not trace.pools:
        raise ValueError(f"the market has no ticks in the {history_hours:g} h before {at.isoformat()}; check the market and at")
    return snapshot_at(trace, at, slot_hours, list(pools) if pools else None, max_staleness_hours)
