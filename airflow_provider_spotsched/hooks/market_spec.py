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

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.market.shipped import cached_trace, trace_path
from airflow_provider_spotsched.market.source import MarketSource, TraceFileSource
from airflow_provider_spotsched.market.trace import Trace

REQUIRED_OPTIONS: dict[str, tuple[str, ...]] = {
    "trace": ("path",),
    "history": ("root",),
    "aws": ("instance_type", "availability_zones", "on_demand_price"),
    "gcp": ("machine_type", "zones"),
}


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
    def from_dict(cls, data: Mapping[str, Any]) -> MarketSpec:
        return cls(data["kind"], data.get("conn_id"), data.get("options"))

    @classmethod
    def coerce(cls, market: MarketSpec | Mapping[str, Any] | str) -> MarketSpec:
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

    def offered_pools(self) -> list[str] | None:
        """Every pool the market can offer, known before any wait: a trace's pools, a live market's
        configured zones; ``None`` for a history store, whose pools show only in what it recorded.
        A live zone without evidence yet (no placement score, no launch) is offered all the same."""
        if self.kind == "trace":
            return cached_trace(trace_path(str(self.options["path"]))).names
        zones = {"aws": "availability_zones", "gcp": "zones"}.get(self.kind)
        return None if zones is None else [str(zone) for zone in self.options[zones]]

    def check_offers(self, pools: Sequence[str]) -> None:
        """Refuse watched ``pools`` the market does not offer, where its pools are known before any
        wait (:meth:`offered_pools`): a typo would count as an unavailable pool, so the wait would
        last until its timeout and then "succeed" on on-demand."""
        offered = self.offered_pools()
        unknown = [] if offered is None else [p for p in pools if p not in offered]
        if unknown:
            raise ValueError(f"pools={list(pools)!r}: unknown pool(s) {unknown}; the market's pools are {sorted(offered or [])}")

    def observe(self, start: datetime, end: datetime) -> Trace:
        """The ticks in [start, end] from the market this spec names (built on first use)."""
        if self._source is None:
            self._source = self._build()
        return self._source.observe(start, end)

    def _build(self) -> MarketSource:
        options = dict(self.options)
        if self.kind == "trace":
            return TraceFileSource(trace_path(str(options["path"])))
        if self.kind == "history":
            return _HistorySource(str(options.pop("root")))
        if self.kind == "aws":
            from airflow_provider_spotsched.hooks.market_data import AwsSpotMarketHook

            aws_hook = AwsSpotMarketHook(aws_conn_id=self.conn_id or "aws_default")
            return aws_hook.get_source(
                options.pop("instance_type"), options.pop("availability_zones"), float(options.pop("on_demand_price")), **options
            )
        from airflow_provider_spotsched.hooks.market_data import GcpSpotMarketHook

        gcp_hook = GcpSpotMarketHook(gcp_conn_id=self.conn_id or "google_cloud_default")
        return gcp_hook.get_source(options.pop("machine_type"), options.pop("zones"), **options)


class _HistorySource(MarketSource):
    """The ticks a :class:`MarketHistoryStore` kept (collected by a market-recording DAG)."""

    def __init__(self, root: str) -> None:
        from airflow.sdk import ObjectStoragePath

        from airflow_provider_spotsched.market.history import MarketHistoryStore

        self.store = MarketHistoryStore(ObjectStoragePath(root) if "://" in root else Path(root))

    def observe(self, start: datetime, end: datetime) -> Trace:
        return self.store.window(start, end)
