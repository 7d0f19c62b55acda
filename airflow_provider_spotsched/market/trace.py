"""The trace file format: load, validate and hold a tick-level spot market.

Format (spec, "Files that cross the project's edge"): CSV, optionally gzip, header
``timestamp,market,spot_price,available,on_demand_price``, UTC ISO-8601 timestamps, one row per
market per tick. Every bad cell is reported with the file, line and column that hold it. The
file is UTF-8 (a byte-order mark, as spreadsheets write, is skipped); gzip is recognised by its
content, whatever the file is named.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import numpy as np

COLUMNS = ("timestamp", "market", "spot_price", "available", "on_demand_price")
GZIP_MAGIC = b"\x1f\x8b"
MAX_SPAN_DAYS = 3660
"""Ten years of ticks: a longer trace holds a mistyped timestamp, not a market history."""
MAX_AVAILABLE = 2**53
"""Counts are read as numbers; above 2**53 a float no longer holds a whole count exactly."""


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


def format_instant(value: datetime) -> str:
    """A wall-clock instant to the millisecond: run logs time slots seconds apart in tests and demos."""
    return value.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
    grid_seconds: float | None = None
    """The tick grid of a live source that states it (``None``: a file, whose gap is inferred)."""

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
        """The typical gap between ticks (median over pools), the unit of the hole rule; a live
        source's stated grid where it has one, since a few ticks (one placement score) tell none."""
        if self.grid_seconds is not None:
            return self.grid_seconds
        gaps = [np.median(np.diff(p.times)) for p in self.pools.values() if len(p.times) > 1]
        if not gaps:
            raise TraceError(f"{self.source}: needs at least two ticks in one market to know its tick gap")
        return float(np.median(gaps))


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file (CSV, gzip or not)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    if not path.is_file():
        raise TraceError(f"{path}: not a file; give the trace CSV (or .csv.gz) itself")
    try:
        with path.open("rb") as raw:
            gzipped = raw.read(2) == GZIP_MAGIC
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace file ({exc.strerror})") from None
    opener = gzip.open if gzipped else open
    try:
        with opener(path, "rt", newline="", encoding="utf-8-sig") as handle:
            return read_trace(handle, source=str(path))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start}); save the trace as UTF-8 CSV") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: a damaged gzip file ({exc}); give the trace CSV, or all of it gzipped") from None


def read_trace(handle: IO[str] | io.StringIO, source: str = "<trace>") -> Trace:
    """Parse trace rows from an open text stream; see :func:`load_trace`."""
    reader = csv.reader(handle)
    try:
        return _read_rows(reader, source)
    except csv.Error as exc:
        raise TraceError(f"{source}, line {reader.line_num}: not CSV ({exc}); give one trace row per line") from None


def _read_rows(reader: Iterator[list[str]], source: str) -> Trace:
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
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise TraceError(f"{source}, line 1: column(s) {twice} given twice; the header must be {','.join(COLUMNS)}")
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
    trace = Trace(source, {name: _series(name, ticks, source) for name, ticks in rows.items()})
    if trace.last_time - trace.first_time > MAX_SPAN_DAYS * 86400.0:
        first, last = (datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
                       for t in (trace.first_time, trace.last_time))  # isoformat: strftime drops a year's leading zeros
        raise TraceError(
            f"{source}: its ticks run from {first} to {last}, over {MAX_SPAN_DAYS} days; a timestamp is likely "
            "mistyped (a year of 0001 or 9999 would make millions of slots): fix it or split the file"
        )
    return trace


def _parse_row(row: list[str], index: dict[str, int], source: str, line: int) -> tuple[float, float, int, float]:
    def where(column: str) -> str:
        return f"{source}, line {line}, column {column!r}"

    text = row[index["timestamp"]]
    try:
        stamp = parse_timestamp(text).timestamp()
    except (ValueError, OverflowError):
        raise TraceError(f"{where('timestamp')}: {text!r} is not a UTC ISO-8601 timestamp like 2025-10-04T00:10:00Z") from None
    if not row[index["market"]].strip():
        raise TraceError(f"{where('market')}: empty market name")
    prices = []
    for column in ("spot_price", "on_demand_price"):
        try:
            value = float(row[index[column]])
        except ValueError:
            raise TraceError(f"{where(column)}: {row[index[column]]!r} is not a number") from None
        problem = price_problem(value, on_demand=column == "on_demand_price")
        if problem:
            raise TraceError(f"{where(column)}: {problem}")
        prices.append(value)
    text = row[index["available"]]
    try:
        available = float(text)
    except ValueError:
        raise TraceError(f"{where('available')}: {text!r} is not a count") from None
    if not (math.isfinite(available) and 0 <= available <= MAX_AVAILABLE and available == int(available)):
        raise TraceError(f"{where('available')}: {text!r} must be a whole count of instances >= 0")
    return stamp, prices[0], int(available), prices[1]


def price_problem(value: float, on_demand: bool) -> str | None:
    """What is wrong with a price, or None: prices are finite and >= 0, on-demand ones > 0 (a free
    on-demand instance, a missing price read as 0, would make every policy run on demand for nothing)."""
    if not math.isfinite(value) or value < 0:
        return f"{value!r} must be a finite price >= 0 (USD per instance-hour)"
    if on_demand and value == 0:
        return f"{value!r} must be > 0: on-demand capacity is never free; give the market's on-demand price in USD per instance-hour"
    return None


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
