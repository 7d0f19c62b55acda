"""A market source described as plain data, so that any process can rebuild it.

The step-by-step operators take the market as an argument, and the market sensor's trigger
must rebuild it in the triggerer after a restart from its serialised arguments alone. A live
:class:`~airflow_provider_spotsched.market.source.MarketSource` holds clients and sessions, so
what travels is a :class:`MarketSpec` (kind, connection id, options) instead; it is itself a
market source that builds the real one on first use, through the connection's hook, so a DAG
file that names a market opens no connection while it is parsed.

Kinds and their options:

- ``trace``: ``path`` = ``"gcp"`` or ``"aws"`` (the shipped traces) or a trace file;
- ``history``: ``root`` = a :class:`~airflow_provider_spotsched.market.history.MarketHistoryStore`
  root (local path, ``s3://...``, ``gs://...``);
- ``aws``: ``instance_type``, ``availability_zones``, ``on_demand_price`` (and any option of
  :class:`~airflow_provider_spotsched.market.aws.AwsSpotMarketSource`), with an ``aws`` connection;
- ``gcp``: ``machine_type``, ``zones`` (and any option of
  :class:`~airflow_provider_spotsched.market.gcp.GcpSpotMarketSource`), with a
  ``google_cloud_platform`` connection.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.forecast.snapshot import market_at
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.market.source import MarketSource, clip
from airflow_provider_spotsched.market.trace import Trace, load_trace, parse_timestamp

DEFAULT_HISTORY_HOURS = 14 * 24.0
"""Two weeks: the longest history the forecasters' daily and weekly patterns use."""

REQUIRED_OPTIONS: dict[str, tuple[str, ...]] = {
    "trace": ("path",),
    "history": ("root",),
    "aws": ("instance_type", "availability_zones", "on_demand_price"),
    "gcp": ("machine_type", "zones"),
}
SHIPPED_TRACES = {"gcp": GCP_TRACE, "aws": AWS_TRACE}


class MarketSpec(MarketSource):
    """Which market to observe, as JSON-ready data (see the module docstring for the kinds).

    :param kind: ``"trace"``, ``"history"``, ``"aws"`` or ``"gcp"``.
    :param conn_id: the connection of an ``aws`` or ``gcp`` market (``None``: the hook's default).
    :param options: the kind's options.
    """

    def __init__(self, kind: str, conn_id: str | None = None, options: Mapping[str, Any] | None = None) -> None:
        if kind not in REQUIRED_OPTIONS:
            raise ValueError(f"market kind {kind!r} is unknown; choose one of {sorted(REQUIRED_OPTIONS)}")
        options = dict(options or {})
        missing = [name for name in REQUIRED_OPTIONS[kind] if name not in options]
        if missing:
            raise ValueError(f"a {kind!r} market needs option(s) {missing}; give them in the market's options")
        try:
            json.dumps(options)
        except TypeError as error:
            raise ValueError(f"market options must be JSON-serialisable (a trigger rebuilds the market): {error}") from None
        self.kind, self.conn_id, self.options = kind, conn_id, options
        self._source: MarketSource | None = None

    def __repr__(self) -> str:
        return f"MarketSpec({self.kind!r}, conn_id={self.conn_id!r}, options={self.options!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MarketSpec) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "conn_id": self.conn_id, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MarketSpec":
        return cls(data["kind"], data.get("conn_id"), data.get("options"))

    @classmethod
    def coerce(cls, market: "MarketSpec | Mapping[str, Any] | str") -> "MarketSpec":
        """A spec from a spec, its dict, or a string naming a trace (``"gcp"``, ``"aws"``, a path)."""
        if isinstance(market, MarketSpec):
            return market
        if isinstance(market, str):
            return cls("trace", options={"path": market})
        if isinstance(market, Mapping) and "kind" in market:
            return cls.from_dict(market)
        raise ValueError(
            f"market {market!r} is neither a MarketSpec, a dict with 'kind', nor a trace name or path; "
            'give e.g. "gcp" or {"kind": "aws", "conn_id": "aws_default", "options": {...}}'
        )

    def observe(self, start: datetime, end: datetime) -> Trace:
        """The ticks in [start, end] from the market this spec names (built on first use)."""
        if self._source is None:
            self._source = self._build()
        return self._source.observe(start, end)

    def _build(self) -> MarketSource:
        options = dict(self.options)
        if self.kind == "trace":
            return _TraceReplay(_shipped_or_path(str(options["path"])))
        if self.kind == "history":
            return _HistorySource(str(options.pop("root")))
        if self.kind == "aws":
            from airflow_provider_spotsched.hooks.market_data import AwsSpotMarketHook

            hook = AwsSpotMarketHook(aws_conn_id=self.conn_id or "aws_default")
            return hook.get_source(
                options.pop("instance_type"), options.pop("availability_zones"), float(options.pop("on_demand_price")), **options
            )
        from airflow_provider_spotsched.hooks.market_data import GcpSpotMarketHook

        hook = GcpSpotMarketHook(gcp_conn_id=self.conn_id or "google_cloud_default")
        return hook.get_source(options.pop("machine_type"), options.pop("zones"), **options)


class _TraceReplay(MarketSource):
    """A trace file parsed once per process (many triggers of one triggerer share it)."""

    def __init__(self, path: Path) -> None:
        self.trace = _load(path)

    def observe(self, start: datetime, end: datetime) -> Trace:
        return clip(self.trace, start, end)


class _HistorySource(MarketSource):
    """The ticks a :class:`MarketHistoryStore` kept (collected by a market-recording DAG)."""

    def __init__(self, root: str) -> None:
        from airflow.sdk import ObjectStoragePath

        from airflow_provider_spotsched.market.history import MarketHistoryStore

        self.store = MarketHistoryStore(ObjectStoragePath(root) if "://" in root else Path(root))

    def observe(self, start: datetime, end: datetime) -> Trace:
        return self.store.window(start, end)


def slot_market_at(
    source: MarketSource,
    at: datetime,
    slot_hours: float = 1.0,
    pools: Sequence[str] | None = None,
    history_hours: float = DEFAULT_HISTORY_HOURS,
) -> SlotMarket:
    """The market in slots up to the one starting at ``at``, as ``spotsched forecast`` cuts it.

    Reads ``history_hours`` before ``at`` and one slot after it: a replayed trace has ticks
    after ``at``, which tell :func:`market_at` that ``at`` lies inside the trace (it reads
    nothing after ``at``); a live market has none, so ``at`` must not be later than its
    newest tick.
    """
    if not history_hours > 0:
        raise ValueError(f"history_hours must be > 0, got {history_hours!r}")
    trace = source.observe(at - timedelta(hours=history_hours), at + timedelta(hours=slot_hours))
    if not trace.pools:
        raise ValueError(f"the market has no ticks in the {history_hours:g} h before {at.isoformat()}; check the market and at")
    return market_at(trace, at, slot_hours, list(pools) if pools else None)


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


def _shipped_or_path(name: str) -> Path:
    path = SHIPPED_TRACES.get(name, Path(name).expanduser())
    if not path.is_file():
        raise ValueError(f'trace {name!r} is neither "gcp", "aws" nor an existing trace file')
    return path


@functools.lru_cache(maxsize=8)
def _load(path: Path) -> Trace:
    return load_trace(path)
