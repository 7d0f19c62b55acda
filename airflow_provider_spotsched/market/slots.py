"""Slot markets: a trace resampled onto the job's decision slots (spec, "Market").

The default (and only reporting) resampling takes, per pool, the state in force at the slot's
start: the last tick at or before that instant. A tick older than 1.5 typical tick gaps is a hole
in the data: the pool's availability for that slot is unknown and counts as 0, and its price is
the last one seen (the first tick's price before the pool's first tick). A hole of
:data:`HOLE_WARNING_HOURS` or more is logged as a warning naming its pools and span, once per
process: it is counted all the same, but it hides capacity a schedule might have used.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np

from airflow_provider_spotsched.market.trace import Trace, TraceError, format_timestamp

HOLE_FACTOR = 1.5
HOLE_WARNING_HOURS = 3.0
"""Shorter holes are routine gaps in collection (the shipped GCP trace has one of 110 minutes)."""

log = logging.getLogger(__name__)
_reported: set[tuple[str, float, float]] = set()
"""Holes already warned about: a run resamples its trace again every slot."""


@dataclass(frozen=True)
class SlotMarket:
    """Per-slot spot prices ``[T, M]``, available counts ``[T, M]`` and one on-demand price."""

    pools: tuple[str, ...]
    start: datetime
    slot_hours: float
    spot_price: np.ndarray
    available: np.ndarray
    on_demand_price: float

    def __post_init__(self) -> None:
        if self.spot_price.shape != self.available.shape or self.spot_price.shape[1:] != (len(self.pools),):
            raise ValueError(
                f"spot_price {self.spot_price.shape} and available {self.available.shape} "
                f"must both be [slots, {len(self.pools)} pools]"
            )

    @property
    def num_slots(self) -> int:
        return int(self.spot_price.shape[0])

    @property
    def num_pools(self) -> int:
        return len(self.pools)

    def window(self, first: int, length: int | None = None) -> SlotMarket:
        """Slots ``first .. first+length-1`` as a market of their own (time 0 = slot ``first``)."""
        end = self.num_slots if length is None else min(self.num_slots, first + length)
        return SlotMarket(
            pools=self.pools,
            start=self.start + timedelta(hours=first * self.slot_hours),
            slot_hours=self.slot_hours,
            spot_price=self.spot_price[first:end],
            available=self.available[first:end],
            on_demand_price=self.on_demand_price,
        )

    def prefix(self, length: int) -> SlotMarket:
        """The first ``length`` slots: what a policy may know after deciding slot ``length-1``."""
        return self.window(0, length)

    def describe(self) -> str:
        return f"{self.num_pools} pools from {format_timestamp(self.start)}, {self.num_slots} slots of {self.slot_hours:g} h"


def cloud_region(pool: str) -> str:
    """The cloud region of a zone name: ``us-central1-a`` -> ``us-central1``, ``us-east-1a`` -> ``us-east-1``.

    A name that looks like neither (an instance type, say) is its own region.
    """
    gcp = re.match(r"^(.+\d+)-[a-z]$", pool)
    if gcp:
        return gcp.group(1)
    aws = re.match(r"^(.+-\d+)[a-z]$", pool)
    return aws.group(1) if aws else pool


def pool_names(pools: str | Sequence[str], field: str = "pools") -> tuple[str, ...]:
    """Pool (or region) names from a list, or from one comma-separated string (what a rendered
    Airflow template gives); a name given twice is refused, it would count that pool's instances twice."""
    if isinstance(pools, str):
        if pools.lstrip().startswith("["):
            raise ValueError(
                f"{field}={pools!r}: a list written as text; give the list itself, or the names comma-separated ('a,b')"
            )
        names: list[object] = [name.strip() for name in pools.split(",")]
    elif isinstance(pools, Sequence):
        names = list(pools)
    else:
        raise ValueError(f"{field}={pools!r}: not a list of names; give a list such as ['us-east4-a']")
    if not names:
        raise ValueError(f"{field}=[]: empty; name at least one (a zone, an availability zone or a region)")
    bad = [name for name in names if not isinstance(name, str) or not name.strip()]
    if bad:
        raise ValueError(f"{field}={names!r}: {bad[0]!r} is not a name; give names such as 'us-east4-a'")
    twice = sorted({name for name in names if names.count(name) > 1}, key=str)
    if twice:
        raise ValueError(f"{field}={names!r}: names {twice} more than once; name each once")
    return tuple(str(name) for name in names)


def select_pools(trace: Trace, pools: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The pools to schedule over: all of the trace's by default, else the named ones (checked)."""
    if pools is None:
        return tuple(trace.names)
    try:
        names = pool_names(pools)
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    unknown = [p for p in names if p not in trace.pools]
    if unknown:
        raise TraceError(f"unknown pool(s) {unknown} in {trace.source}; known pools are {trace.names}")
    return names


def resample(
    trace: Trace,
    start: datetime | None = None,
    slot_hours: float = 1.0,
    num_slots: int | None = None,
    pools: Sequence[str] | None = None,
) -> SlotMarket:
    """Resample ``trace`` onto slots of ``slot_hours`` from ``start`` (default: first tick).

    Without ``num_slots``, slots run while their start lies inside the trace. Asking for slots
    past the trace's end is an error that says how many there are.
    """
    if slot_hours <= 0:
        raise ValueError(f"slot_hours must be > 0, got {slot_hours}")
    names = select_pools(trace, pools)
    t0 = trace.first_time if start is None else start.astimezone(timezone.utc).timestamp()
    if not trace.first_time <= t0 <= trace.last_time:
        raise TraceError(
            f"start {format_timestamp(datetime.fromtimestamp(t0, timezone.utc))} lies outside {trace.source}, "
            f"which covers {format_timestamp(datetime.fromtimestamp(trace.first_time, timezone.utc))} .. "
            f"{format_timestamp(datetime.fromtimestamp(trace.last_time, timezone.utc))}"
        )
    step = slot_hours * 3600.0
    fits = int(np.floor((trace.last_time - t0) / step + 1e-9)) + 1
    if num_slots is None:
        num_slots = fits
    elif num_slots > fits:
        raise TraceError(
            f"{trace.source} holds only {fits} slots of {slot_hours:g} h after the start; "
            f"{num_slots} were asked for: choose an earlier start or a shorter job"
        )
    return _in_force(trace, names, t0, slot_hours, num_slots, trace.last_time, on_demand_slot=0)


def resample_until(
    trace: Trace, at: datetime, slot_hours: float = 1.0, pools: Sequence[str] | None = None
) -> SlotMarket:
    """The market as known at ``at``: slots of ``slot_hours`` back to the trace's first tick, the
    last one starting at ``at`` (which must not precede the trace).

    A live feed lags the clock, or stops: the slots after the newest tick hold each pool's last
    tick, its availability unknown (0) once that tick is older than the hole threshold, so a feed
    that stopped hours ago never passes its last count off as the capacity now.
    """
    if slot_hours <= 0:
        raise ValueError(f"slot_hours must be > 0, got {slot_hours}")
    names = select_pools(trace, pools)
    t_at = at.astimezone(timezone.utc).timestamp()
    if t_at < trace.first_time:
        raise TraceError(f"{format_timestamp(at)} precedes {trace.source}, which starts at {_stamp(trace.first_time)}")
    step = slot_hours * 3600.0
    slots = int(np.floor((t_at - trace.first_time) / step + 1e-9)) + 1
    start = t_at - (slots - 1) * step
    return _in_force(trace, names, start, slot_hours, slots, max(t_at, trace.last_time), on_demand_slot=slots - 1)


def _in_force(
    trace: Trace, names: tuple[str, ...], t0: float, slot_hours: float, num_slots: int, end: float, on_demand_slot: int
) -> SlotMarket:
    """Each pool's state in force at the starts of ``num_slots`` slots from ``t0``, the on-demand
    price (the cheapest pool's) at slot ``on_demand_slot``; ``end`` is when the data ends, for
    the warnings about holes that run to it."""
    step = slot_hours * 3600.0
    instants = t0 + step * np.arange(num_slots)
    hole = HOLE_FACTOR * trace.tick_seconds
    prices = np.empty((num_slots, len(names)))
    available = np.zeros((num_slots, len(names)), dtype=np.int64)
    on_demand = []
    holes: dict[tuple[float, float], tuple[list[str], int]] = {}
    for m, name in enumerate(names):
        series = trace.pools[name]
        idx = np.searchsorted(series.times, instants, side="right") - 1
        seen = idx >= 0
        safe = np.where(seen, idx, 0)
        prices[:, m] = series.spot_price[safe]
        fresh = seen & (instants - series.times[safe] <= hole)
        available[:, m] = np.where(fresh, series.available[safe], 0)
        on_demand.append(series.on_demand_price[safe[on_demand_slot]])
        for span, slots in _holes(trace.first_time, end, series.times, idx[~fresh]).items():
            pools, most = holes.get(span, ([], 0))
            holes[span] = (pools + [name], max(most, slots))
    _warn_holes(trace.source, holes, slot_hours)
    return SlotMarket(
        pools=names,
        start=datetime.fromtimestamp(t0, timezone.utc),
        slot_hours=slot_hours,
        spot_price=prices,
        available=available,
        on_demand_price=float(min(on_demand)),
    )


def _holes(first: float, last: float, times: np.ndarray, previous: np.ndarray) -> dict[tuple[float, float], int]:
    """The spans without ticks around the slots whose tick was stale or missing (``previous``:
    the index of the last tick before each), with how many slots each hides; the data runs from
    ``first`` to ``last``."""
    spans: dict[tuple[float, float], int] = {}
    for i in previous.tolist():
        begin = first if i < 0 else float(times[i])
        end = float(times[i + 1]) if i + 1 < len(times) else last
        spans[(begin, end)] = spans.get((begin, end), 0) + 1
    return spans


def _warn_holes(source: str, holes: dict[tuple[float, float], tuple[list[str], int]], slot_hours: float) -> None:
    """One warning per long hole (see :data:`HOLE_WARNING_HOURS`), the first time it is met."""
    for (begin, end), (pools, slots) in sorted(holes.items()):
        hours = (end - begin) / 3600.0
        if hours < HOLE_WARNING_HOURS or (source, begin, end) in _reported:
            continue
        _reported.add((source, begin, end))
        log.warning(
            "%s: pool(s) %s have no ticks from %s to %s (%.3g h, a hole in the data): their availability "
            "counts as 0 in %d slot(s) of %g h; fill the hole or schedule outside it",
            source, pools, _stamp(begin), _stamp(end), hours, slots, slot_hours,
        )


def _stamp(epoch: float) -> str:
    return format_timestamp(datetime.fromtimestamp(epoch, timezone.utc))
