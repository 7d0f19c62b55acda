"""Market sources: where ticks come from, as a :class:`Trace` over a time window.

Every source answers ``observe(start, end)`` with the ticks in [start, end] in the trace format
(one row per pool per tick: spot price, available count, on-demand price), so that the slot
resampling and the forecasters read a live market exactly as they read a shipped trace. Pools are
named as in the traces: AWS availability zones (``us-east-1a``) and GCP zones (``us-central1-a``).

A tick is an observation of the *whole* pool state: a live source emits a tick only where both a
spot price and an availability count are known (see :mod:`.availability`), on a regular grid of
``tick_seconds`` plus the instants a signal arrived, and never after the present (a window that
runs into the future ends at "now"). A window with no observation is an empty trace (no pools),
never a guess.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from airflow_provider_spotsched.market.availability import AvailabilitySignal, available_at
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.trace import PoolSeries, Trace, TraceError, format_timestamp, price_problem


@dataclass(frozen=True)
class Tick:
    """One row of the trace format; ``time`` is UTC epoch seconds."""

    time: float
    market: str
    spot_price: float
    available: int
    on_demand_price: float

    def check(self, source: str) -> None:
        """Raise :class:`TraceError` naming the field if this row could not be a trace row."""
        where = f"{source}: tick {self.market!r} at {_stamp(self.time)}"
        if not self.market or not isinstance(self.market, str):
            raise TraceError(f"{source}: tick at {_stamp(self.time)}: market must be a non-empty pool name")
        for name in ("spot_price", "on_demand_price"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TraceError(f"{where}: {name} {value!r} must be a number (USD per instance-hour)")
            problem = price_problem(value, on_demand=name == "on_demand_price")
            if problem:
                raise TraceError(f"{where}: {name} {problem}")
        if isinstance(self.available, bool) or not isinstance(self.available, (int, np.integer)) or self.available < 0:
            raise TraceError(f"{where}: available {self.available!r} must be a whole count >= 0")


class MarketSource(ABC):
    """Something that can say what the spot market looked like over a window."""

    @abstractmethod
    def observe(self, start: datetime, end: datetime) -> Trace:
        """The ticks with ``start <= time <= end`` (UTC), as a trace (empty if none)."""


class TraceFileSource(MarketSource):
    """Replays a trace file (a shipped one or any file in the CSV format) as a live source.

    The file is parsed once per process: many triggers of one triggerer replay the same trace.
    """

    def __init__(self, path: str | Path) -> None:
        self.trace = cached_trace(path)

    def observe(self, start: datetime, end: datetime) -> Trace:
        return clip(self.trace, start, end)


class CombinedMarketSource(MarketSource):
    """Several sources as one market, e.g. one AWS source per region; pool names must not clash."""

    def __init__(self, sources: Sequence[MarketSource]) -> None:
        if not sources:
            raise ValueError("sources is empty: give at least one market source to combine")
        self.sources = tuple(sources)

    def observe(self, start: datetime, end: datetime) -> Trace:
        traces = [s.observe(start, end) for s in self.sources]
        pools: dict[str, PoolSeries] = {}
        for trace in traces:
            clash = sorted(set(pools) & set(trace.pools))
            if clash:
                raise TraceError(f"pool(s) {clash} come from two sources; give each pool to one source only")
            pools.update(trace.pools)
        grids = [t.grid_seconds for t in traces]
        grid = None if None in grids else max(g for g in grids if g is not None)
        return Trace(" + ".join(t.source for t in traces), pools, grid)


def check_window(start: datetime, end: datetime) -> tuple[float, float]:
    """The window as epoch seconds, refusing naive or reversed windows."""
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise ValueError(
                f"{name} {value!r} must be a timezone-aware datetime (UTC), e.g. datetime(..., tzinfo=timezone.utc)"
            )
    if end < start:
        raise ValueError(f"end {end.isoformat()} is before start {start.isoformat()}; give start <= end")
    return start.timestamp(), end.timestamp()


def clip(trace: Trace, start: datetime, end: datetime) -> Trace:
    """The part of ``trace`` with ``start <= time <= end``; pools without a tick there are left out."""
    first, last = check_window(start, end)
    pools = {}
    for name, series in trace.pools.items():
        keep = (series.times >= first) & (series.times <= last)
        if keep.any():
            pools[name] = PoolSeries(
                times=series.times[keep],
                spot_price=series.spot_price[keep],
                available=series.available[keep],
                on_demand_price=series.on_demand_price[keep],
            )
    return Trace(trace.source, pools, trace.grid_seconds)


def trace_ticks(trace: Trace) -> Iterator[Tick]:
    """Every row of ``trace``, pool by pool in time order."""
    for name in trace.names:
        series = trace.pools[name]
        for i in range(len(series.times)):
            yield Tick(
                float(series.times[i]),
                name,
                float(series.spot_price[i]),
                int(series.available[i]),
                float(series.on_demand_price[i]),
            )


def trace_from_ticks(ticks: Iterable[Tick], source: str, grid_seconds: float | None = None) -> Trace:
    """Checked ticks as a trace; two ticks of one pool at one time are an error. A live source
    passes the grid it ticks on (``grid_seconds``)."""
    grouped: dict[str, list[Tick]] = {}
    for tick in ticks:
        tick.check(source)
        grouped.setdefault(tick.market, []).append(tick)
    pools = {}
    for name, rows in grouped.items():
        rows.sort(key=lambda t: t.time)
        times = np.array([t.time for t in rows], dtype=float)
        if len(times) > 1 and np.any(np.diff(times) == 0):
            dup = float(times[1:][np.diff(times) == 0][0])
            raise TraceError(f"{source}: market {name!r} has two ticks at {_stamp(dup)}; keep one per market per tick")
        pools[name] = PoolSeries(
            times=times,
            spot_price=np.array([t.spot_price for t in rows], dtype=float),
            available=np.array([t.available for t in rows], dtype=np.int64),
            on_demand_price=np.array([t.on_demand_price for t in rows], dtype=float),
        )
    return Trace(source, pools, grid_seconds)


def observation_times(first: float, last: float, tick_seconds: float, events: Iterable[float]) -> list[float]:
    """The grid points (whole multiples of ``tick_seconds`` since the epoch) in [first, last] and
    the event instants in it, in whole seconds (the trace format's resolution), sorted."""
    if not tick_seconds > 0:
        raise ValueError(f"tick_seconds {tick_seconds!r} must be > 0")
    grid = range(math.ceil(first / tick_seconds), math.floor(last / tick_seconds) + 1)
    stamps = {float(math.floor(k * tick_seconds)) for k in grid}
    stamps |= {float(math.floor(t)) for t in events if first <= math.floor(t) <= last}
    return sorted(t for t in stamps if first <= t <= last)


def signal_ticks(
    pool: str,
    price_changes: Sequence[tuple[float, float]],
    on_demand_price: float,
    signals: Sequence[AvailabilitySignal],
    first: float,
    last: float,
    tick_seconds: float,
    ttl: timedelta,
) -> list[Tick]:
    """The ticks of one live pool in [first, last]: at each observation time, the spot price in
    force (the last change at or before it) and the availability in force; a time where either
    is unknown gets no tick. ``price_changes`` are (epoch seconds, price) sorted by time."""
    change_times = [t for t, _ in price_changes]
    ticks = []
    for when in observation_times(first, last, tick_seconds, (s.time.timestamp() for s in signals)):
        index = bisect_right(change_times, when) - 1
        if index < 0:
            continue
        count = available_at(signals, datetime.fromtimestamp(when, timezone.utc), ttl)
        if count is None:
            continue
        ticks.append(Tick(when, pool, price_changes[index][1], count, on_demand_price))
    return ticks


def _stamp(epoch: float) -> str:
    return format_timestamp(datetime.fromtimestamp(epoch, timezone.utc))
