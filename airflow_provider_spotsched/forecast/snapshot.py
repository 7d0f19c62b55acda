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

def history_slots(slot_hours: float) -> int:
    """The slots of history a forecast needs up to ``at``'s: :data:`MIN_HISTORY_HOURS` of them, and at least 2."""
    return max(2, math.ceil(MIN_HISTORY_HOURS / slot_hours - 1e-9))


def check_history_hours(history_hours: float, slot_hours: float) -> None:
    """Refuse a ``history_hours`` window that cannot hold :func:`history_slots` slots before any
    ``at`` (a day, or one slot before ``at``'s where a slot is longer), naming the field: every run
    would fail, and the CLI's advice (a later ``--at``) cannot help a window that moves with ``at``."""
    least = max(MIN_HISTORY_HOURS, (history_slots(slot_hours) - 1) * slot_hours)
    if isinstance(history_hours, bool) or not isinstance(history_hours, (int, float)) or not history_hours >= least:
        raise ValueError(
            f"history_hours={history_hours!r}: a forecast needs {history_slots(slot_hours)} slots of {slot_hours:g} h "
            f"of history, at least {least:g} h before at; give history_hours >= {least:g}"
        )


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
    history_hours: float | None = None,
) -> Snapshot:
    """The market at ``at`` in slots of ``slot_hours`` back to the trace's start, the last one
    starting at ``at``, with each pool's last tick.

    Refuses an ``at`` before the trace or more than ``max_staleness_hours`` after its newest
    tick, less than :data:`MIN_HISTORY_HOURS` of history, and pools that are unknown or have no
    tick by ``at``. ``history_hours``: the trace was read from that many hours before ``at``
    (:func:`slot_snapshot_at`), so a short history that starts there is the window's, not the market's.
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
    needed = history_slots(slot_hours)
    if slots < needed and history_hours is not None and _cut_by_window(known, at.timestamp() - history_hours * 3600.0):
        raise TraceError(
            f"history_hours={history_hours:g} leaves {slots} slot(s) of {slot_hours:g} h of history before at "
            f"{format_timestamp(at)} in {trace.source}; a forecast needs at least {needed} ({MIN_HISTORY_HOURS:g} h): "
            f"raise history_hours by at least {(needed - slots) * slot_hours:g}"
        )
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


def _cut_by_window(trace: Trace, window_start: float) -> bool:
    """Whether ``trace``'s first tick lies within 1.5 tick gaps of where it was read from: the
    market went on before, and a longer window reads more of it."""
    try:
        gap = trace.tick_seconds
    except TraceError:  # one tick per pool: the window is shorter than the market's tick gap
        return True
    return trace.first_time - window_start <= HOLE_FACTOR * gap


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
    its newest tick may be up to ``max_staleness_hours`` older than ``at``. A named pool without
    a tick in that window is refused as such, not as unknown: the window cannot tell a pool whose
    feed went quiet from a misspelt one, nor say how old its last tick is (the CLI, reading the
    whole trace, calls it stale).
    """
    if not history_hours > 0:
        raise ValueError(f"history_hours must be > 0, got {history_hours!r}")
    trace = source.observe(at - timedelta(hours=history_hours), at + timedelta(hours=slot_hours))
    if not trace.pools:
        raise ValueError(f"the market has no ticks in the {history_hours:g} h before {at.isoformat()}; check the market and at")
    quiet = [name for name in pools or () if name not in trace.pools]
    if quiet:
        raise TraceError(
            f"pools={quiet}: no tick in the {history_hours:g} h before at {format_timestamp(at)} (history_hours) in "
            f"{trace.source}, whose pools with ticks then are {trace.names}; raise history_hours, or check the feed "
            f"and the pool names"
        )
    return snapshot_at(trace, at, slot_hours, list(pools) if pools else None, max_staleness_hours, history_hours)
