"""The market history store: observed ticks and launch outcomes, kept for forecasting.

Layout under ``root`` (a local :class:`pathlib.Path`, or any pathlib-like object such as
Airflow's ``ObjectStoragePath`` for ``s3://`` or ``gs://``; this module never imports Airflow)::

    root/ticks/day=2025-10-04/part-20251004T001000123456Z-<uuid>.csv.gz     (trace format)
    root/outcomes/day=2025-10-04/part-...csv.gz   (time,pool,requested,launched,reason)

Safe against two writers on any store, object stores included (which cannot append): every
append writes a *new* part with a unique name (write time + uuid) and never touches another
part, so no writer can overwrite or truncate another's data. On a local file system the part is
written under a hidden temporary name and renamed, so a reader never sees half a part; on an
object store one upload is already all-or-nothing. Reading merges the parts of the days in the
window, in name (write-time) order: for two ticks of one pool at one time the later-written wins
(a re-observation replaces an earlier one); identical outcomes count once. :meth:`compact` merges
a day's parts into one, writing the merged part before deleting exactly the parts it read, so an
append racing it is kept, and a reader racing it sees the same rows (a part that vanishes while
being read makes the read list the day again).
"""

from __future__ import annotations

import csv
import gzip
import io
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.market.source import Tick, check_window, trace_from_ticks, trace_ticks
from airflow_provider_spotsched.market.trace import COLUMNS, Trace, TraceError, parse_timestamp, read_trace

TICKS, OUTCOMES = "ticks", "outcomes"
OUTCOME_COLUMNS = ("time", "pool", "requested", "launched", "reason")
PART_SUFFIX = ".csv.gz"
READ_ATTEMPTS = 5  # a compaction can delete a part between listing and reading it; list again


class HistoryError(ValueError):
    """A stored part or an appended record is malformed; the message names it and the field."""


class MarketHistoryStore:
    """Appends observations and serves windows of them back as a :class:`Trace`."""

    def __init__(self, root: Any) -> None:
        self.root = Path(root) if isinstance(root, str) else root
        # object stores upload a part all at once; only a file system can expose half a file
        self._rename_into_place = getattr(self.root, "protocol", "file") in ("", "file", "local")

    def __repr__(self) -> str:
        return f"MarketHistoryStore({str(self.root)!r})"

    # ----- ticks

    def append(self, observations: Trace) -> list[Any]:
        """Store the ticks of ``observations`` (one new part per day they cover); returns the parts."""
        ticks = list(trace_ticks(observations))
        for tick in ticks:
            tick.check(f"append to {self}")
            if tick.time != int(tick.time):  # the store's stamps are whole seconds: two ticks would share one
                raise TraceError(
                    f"append to {self}: tick {tick.market!r} at {tick.time!r} (epoch seconds) has a fraction of a second; "
                    "the store keeps whole seconds: round the trace's timestamps to the second"
                )
        return self._append_rows(TICKS, COLUMNS, [(t.time, _tick_row(t)) for t in ticks])

    def window(self, start: datetime, end: datetime) -> Trace:
        """Every stored tick with ``start <= time <= end`` (empty trace if none)."""
        first, last = check_window(start, end)
        merged: dict[tuple[float, str], Tick] = {}
        for part, text in self._read_days(TICKS, start, end):
            for tick in trace_ticks(read_trace(io.StringIO(text), source=str(part))):
                if first <= tick.time <= last:
                    merged[(tick.time, tick.market)] = tick
        return trace_from_ticks(merged.values(), source=f"history:{self.root}")

    def recent(self, duration: timedelta, now: datetime | None = None) -> Trace:
        """The last ``duration`` up to ``now`` (default: the present): the forecasters' input."""
        now = now or datetime.now(timezone.utc)
        return self.window(now - duration, now)

    # ----- launch outcomes

    def record_outcome(self, outcome: LaunchOutcome) -> None:
        """Store one outcome: a backend's ``LaunchRecorder``."""
        self.record_outcomes([outcome])

    def record_outcomes(self, outcomes: Iterable[LaunchOutcome]) -> list[Any]:
        """Store several outcomes (one new part per day they cover); returns the parts."""
        rows = []
        for outcome in outcomes:
            _check_outcome(outcome, f"record_outcomes on {self}")
            rows.append((outcome.time.timestamp(), _outcome_row(outcome)))
        return self._append_rows(OUTCOMES, OUTCOME_COLUMNS, rows)

    def outcomes(self, start: datetime, end: datetime) -> list[LaunchOutcome]:
        """The distinct outcomes with ``start <= time <= end``, in time order."""
        check_window(start, end)
        seen: dict[LaunchOutcome, None] = {}
        for part, text in self._read_days(OUTCOMES, start, end):
            for outcome in _parse_outcomes(text, str(part)):
                if start <= outcome.time <= end:
                    seen[outcome] = None
        return sorted(seen, key=lambda o: (o.time, o.pool))

    # ----- maintenance

    def compact(self) -> int:
        """Merge each day's parts into one; returns how many parts were removed.

        The merged part is written first (named after the newest part it merges, so it keeps that
        part's place in the write order); only then are the parts it read deleted. A part appended
        meanwhile was not read, so it is neither merged nor deleted.
        """
        removed = 0
        for kind, columns in ((TICKS, COLUMNS), (OUTCOMES, OUTCOME_COLUMNS)):
            for day in self._days(kind):
                texts = self._read_day(day)
                if len(texts) < 2:
                    continue
                parts = [part for part, _ in texts]
                rows = _merge_rows(kind, texts)
                newest = parts[-1].name[: -len(PART_SUFFIX)].split("-compacted-")[0]
                self._write_part(day, f"{newest}-compacted-{uuid.uuid4().hex}{PART_SUFFIX}", columns, rows)
                for part in parts:
                    try:
                        part.unlink()
                    except FileNotFoundError:  # another compaction removed it first
                        continue
                    removed += 1
        return removed

    # ----- parts

    def _append_rows(self, kind: str, columns: tuple[str, ...], rows: list[tuple[float, list[str]]]) -> list[Any]:
        by_day: dict[str, list[list[str]]] = {}
        for epoch, row in rows:
            by_day.setdefault(_day(epoch), []).append(row)
        written = []
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        for day, day_rows in sorted(by_day.items()):
            name = f"part-{stamp}-{uuid.uuid4().hex}{PART_SUFFIX}"
            written.append(self._write_part(self.root / kind / f"day={day}", name, columns, day_rows))
        return written

    def _write_part(self, folder: Any, name: str, columns: Iterable[str], rows: Iterable[list[str]]) -> Any:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        data = gzip.compress(text.getvalue().encode("utf-8"))
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / name
        if not self._rename_into_place:
            with target.open("wb") as handle:
                handle.write(data)
            return target
        temporary = folder / f".{name}.tmp"
        with temporary.open("wb") as handle:
            handle.write(data)
        temporary.rename(target)
        return target

    def _days(self, kind: str) -> list[Any]:
        base = self.root / kind
        if not base.exists():
            return []
        return sorted((d for d in base.iterdir() if d.name.startswith("day=")), key=lambda d: d.name)

    @staticmethod
    def _parts(day: Any) -> list[Any]:
        parts = [p for p in day.iterdir() if p.name.startswith("part-") and p.name.endswith(PART_SUFFIX)]
        return sorted(parts, key=lambda p: p.name)

    @staticmethod
    def _read_part(part: Any) -> str:
        with part.open("rb") as handle:
            data = handle.read()
        try:
            return gzip.decompress(data).decode("utf-8")
        except (OSError, EOFError, UnicodeDecodeError) as error:
            raise HistoryError(f"{part}: not a gzip CSV part ({error}); move the file out of the store") from None

    def _read_days(self, kind: str, start: datetime, end: datetime) -> Iterator[tuple[Any, str]]:
        """(part, text) for every part of the days overlapping the window, in write order."""
        low, high = f"day={_day(start.timestamp())}", f"day={_day(end.timestamp())}"
        for day in self._days(kind):
            if not low <= day.name <= high:
                continue
            yield from self._read_day(day)

    def _read_day(self, day: Any) -> list[tuple[Any, str]]:
        for _ in range(READ_ATTEMPTS):
            try:
                return [(p, self._read_part(p)) for p in self._parts(day)]
            except FileNotFoundError:
                continue  # compacted away under us: its rows are in the merged part now
        raise HistoryError(f"{day}: parts kept vanishing while being read ({READ_ATTEMPTS} attempts); retry later")


def _merge_rows(kind: str, texts: list[tuple[Any, str]]) -> list[list[str]]:
    if kind == TICKS:
        merged: dict[tuple[float, str], Tick] = {}
        for part, text in texts:
            for tick in trace_ticks(read_trace(io.StringIO(text), source=str(part))):
                merged[(tick.time, tick.market)] = tick
        ordered = sorted(merged.values(), key=lambda t: (t.time, t.market))
        return [_tick_row(t) for t in ordered]
    seen: dict[LaunchOutcome, None] = {}
    for part, text in texts:
        seen.update(dict.fromkeys(_parse_outcomes(text, str(part))))
    return [_outcome_row(o) for o in sorted(seen, key=lambda o: (o.time, o.pool))]


def _outcome_row(outcome: LaunchOutcome) -> list[str]:
    when = outcome.time.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return [when, outcome.pool, str(outcome.requested), str(outcome.launched), outcome.reason]


def _parse_outcomes(text: str, source: str) -> list[LaunchOutcome]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(c.strip() for c in header) != OUTCOME_COLUMNS:
        raise HistoryError(
            f"{source}, line 1: header {header!r}; an outcome part starts with {','.join(OUTCOME_COLUMNS)}"
        )
    outcomes = []
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != len(OUTCOME_COLUMNS):
            raise HistoryError(f"{source}, line {line}: {len(row)} fields, expected {len(OUTCOME_COLUMNS)}")
        try:
            when = parse_timestamp(row[0])
        except ValueError:
            raise HistoryError(f"{source}, line {line}, column 'time': {row[0]!r} is not a UTC ISO-8601 time") from None
        counts = []
        for column, text_value in zip(("requested", "launched"), row[2:4]):
            if not text_value.isdigit():
                raise HistoryError(
                    f"{source}, line {line}, column {column!r}: {text_value!r} is not a whole count >= 0"
                )
            counts.append(int(text_value))
        outcome = LaunchOutcome(when, row[1], counts[0], counts[1], row[4])
        _check_outcome(outcome, f"{source}, line {line}")
        outcomes.append(outcome)
    return outcomes


def _check_outcome(outcome: LaunchOutcome, where: str) -> None:
    if not isinstance(outcome.time, datetime) or outcome.time.tzinfo is None:
        raise HistoryError(f"{where}: outcome time {outcome.time!r} must be a timezone-aware datetime (UTC)")
    if not outcome.pool:
        raise HistoryError(f"{where}: outcome pool is empty; name the spot pool (zone) it was launched in")
    if outcome.requested < 0 or not 0 <= outcome.launched <= outcome.requested:
        raise HistoryError(
            f"{where}: outcome for {outcome.pool!r} has requested={outcome.requested}, launched={outcome.launched}; "
            "need 0 <= launched <= requested"
        )


def _tick_row(tick: Tick) -> list[str]:
    return [_stamp(tick.time), tick.market, repr(tick.spot_price), str(tick.available), repr(tick.on_demand_price)]


def _day(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d")


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
