"""The trace file format: load, validate and hold a tick-level spot market.

Format (spec, "Files that cross the project's edge"): CSV, optionally gzip, header
``timestamp,market,spot_price,available,on_demand_price``, UTC ISO-8601 timestamps, one row per
market per tick. Every bad cell is reported with the file, line and column that hold it.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import numpy as np

COLUMNS = ("timestamp", "market", "spot_price", "available", "on_demand_price")


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, line and column."""


def parse_timestamp(text: str) -> datetime:
    """Parse a UTC ISO-8601 timestamp (``Z`` or ``+00:00``; naive means UTC)."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def format_timestamp(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PoolSeries:
    """The ticks of one market (pool), sorted by time; times are UTC epoch seconds."""

    times: np.ndarray
    spot_price: np.ndarray
    available: np.ndarray
    on_demand_price: np.ndarray


@dataclass(frozen=True)
class Trace:
    """A whole trace: one :class:`PoolSeries` per market, and where it came from."""

    source: str
    pools: dict[str, PoolSeries]

    @property
    def names(self) -> list[str]:
        return sorted(self.pools)

    @property
    def first_time(self) -> float:
        return min(float(p.times[0]) for p in self.pools.values())

    @property
    def last_time(self) -> float:
        return max(float(p.times[-1]) for p in self.pools.values())

    @property
    def tick_seconds(self) -> float:
        """The typical gap between ticks (median over pools), the unit of the hole rule."""
        gaps = [np.median(np.diff(p.times)) for p in self.pools.values() if len(p.times) > 1]
        if not gaps:
            raise TraceError(f"{self.source}: needs at least two ticks in one market to know its tick gap")
        return float(np.median(gaps))


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file (``.csv`` or ``.csv.gz``)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="", encoding="utf-8") as handle:
        return read_trace(handle, source=str(path))


def read_trace(handle: IO[str] | io.StringIO, source: str = "<trace>") -> Trace:
    """Parse trace rows from an open text stream; see :func:`load_trace`."""
    reader = csv.reader(handle)
    try:
        header = [c.strip() for c in next(reader)]
    except StopIteration:
        raise TraceError(f"{source}: empty file; expected the header {','.join(COLUMNS)}") from None
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise TraceError(f"{source}, line 1: unknown column(s) {unknown}; the header must be {','.join(COLUMNS)}")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{source}, line 1: missing column(s) {missing}; the header must be {','.join(COLUMNS)}")
    index = {c: header.index(c) for c in COLUMNS}
    rows: dict[str, list[tuple[float, float, int, float]]] = {}
    for line, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{source}, line {line}: {len(row)} fields, the header has {len(header)}")
        rows.setdefault(row[index["market"]].strip(), []).append(_parse_row(row, index, source, line))
    if not rows:
        raise TraceError(f"{source}: no data rows after the header")
    return Trace(source, {name: _series(name, ticks, source) for name, ticks in rows.items()})


def _parse_row(row: list[str], index: dict[str, int], source: str, line: int) -> tuple[float, float, int, float]:
    def where(column: str) -> str:
        return f"{source}, line {line}, column {column!r}"

    text = row[index["timestamp"]]
    try:
        stamp = parse_timestamp(text).timestamp()
    except ValueError:
        raise TraceError(f"{where('timestamp')}: {text!r} is not a UTC ISO-8601 timestamp like 2025-10-04T00:10:00Z") from None
    if not row[index["market"]].strip():
        raise TraceError(f"{where('market')}: empty market name")
    prices = []
    for column in ("spot_price", "on_demand_price"):
        try:
            value = float(row[index[column]])
        except ValueError:
            raise TraceError(f"{where(column)}: {row[index[column]]!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise TraceError(f"{where(column)}: {value} must be a finite price >= 0 (USD per instance-hour)")
        prices.append(value)
    text = row[index["available"]]
    try:
        available = float(text)
    except ValueError:
        raise TraceError(f"{where('available')}: {text!r} is not a count") from None
    if not math.isfinite(available) or available < 0 or available != int(available):
        raise TraceError(f"{where('available')}: {text!r} must be a whole count >= 0")
    return stamp, prices[0], int(available), prices[1]


def _series(name: str, ticks: Iterable[tuple[float, float, int, float]], source: str) -> PoolSeries:
    data = sorted(ticks)
    times = np.array([t[0] for t in data], dtype=float)
    if len(times) > 1 and np.any(np.diff(times) == 0):
        dup = float(times[1:][np.diff(times) == 0][0])
        stamp = datetime.fromtimestamp(dup, timezone.utc).isoformat()
        raise TraceError(f"{source}: market {name!r} has two rows at {stamp}; keep one row per market per tick")
    return PoolSeries(
        times=times,
        spot_price=np.array([t[1] for t in data], dtype=float),
        available=np.array([t[2] for t in data], dtype=np.int64),
        on_demand_price=np.array([t[3] for t in data], dtype=float),
    )


def parse_instant(value: datetime | str, name: str) -> datetime:
    """A timezone-aware UTC instant from a datetime or an ISO-8601 string (a rendered template)."""
    if isinstance(value, str):
        try:
            value = parse_timestamp(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} is not an ISO-8601 timestamp, e.g. 2025-10-11T04:00:00Z") from None
    if not isinstance(value, datetime):
        raise ValueError(f"{name} must be a UTC timestamp (datetime or ISO-8601 string), got {value!r}")
    if value.tzinfo is None:
        raise ValueError(f"{name} {value.isoformat()} has no time zone; give it in UTC, e.g. ...+00:00")
    return value.astimezone(timezone.utc)
