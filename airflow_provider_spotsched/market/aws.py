"""AWS spot market from the EC2 API: spot price history, placement scores and launch outcomes.

Airflow-free: it takes a boto3 EC2 client of one region (the hook in
:mod:`airflow_provider_spotsched.hooks.market_data` builds it from an Airflow connection; several
regions combine with :class:`~.source.CombinedMarketSource`).

- Spot prices: ``describe_spot_price_history`` over the window, every page, for one instance
  type and product description and the given availability zones. AWS also returns the record in
  force at ``StartTime`` (stamped earlier); it counts as the price at the window's start.
- On-demand price: a parameter (USD per instance-hour). The Pricing API is another service with
  its own permissions, and the on-demand list price changes rarely, so it is configuration.
- Availability: spot placement scores (only for "now": the API has no history, so only a
  window that contains the present asks for them) and recorded launch outcomes, combined as
  :mod:`.availability` documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_provider_spotsched.market.availability import (
    AvailabilitySignal,
    OutcomeReader,
    SignalKind,
    by_pool,
    outcome_signal,
    score_to_count,
)
from airflow_provider_spotsched.market.source import MarketSource, check_window, signal_ticks, trace_from_ticks
from airflow_provider_spotsched.market.trace import Trace, price_problem


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class AwsSpotMarketSource(MarketSource):
    """Ticks for ``instance_type`` in ``availability_zones`` (all in the client's region).

    ``placement_target`` is the instance count the placement score is asked for (``None``: do
    not ask; AWS allows only a few distinct score queries a day per account). ``launch_outcomes``
    reads the outcomes the backend recorded. ``signal_ttl`` is how long one piece of availability
    evidence stays valid; ``tick_seconds`` the grid the ticks are emitted on.
    """

    def __init__(
        self,
        ec2_client: Any,
        instance_type: str,
        availability_zones: Sequence[str],
        on_demand_price: float,
        *,
        product_description: str = "Linux/UNIX",
        placement_target: int | None = 1,
        launch_outcomes: OutcomeReader | None = None,
        tick_seconds: float = 600.0,
        signal_ttl: timedelta = timedelta(hours=1),
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        self.client = ec2_client
        self.region = str(ec2_client.meta.region_name)
        if not instance_type:
            raise ValueError("instance_type is empty: give an EC2 instance type such as p3.2xlarge")
        if not availability_zones:
            raise ValueError("availability_zones is empty: name the zones to observe, e.g. ['us-east-1a']")
        foreign = [z for z in availability_zones if not (z.startswith(self.region) and len(z) > len(self.region))]
        if foreign:
            raise ValueError(
                f"availability zone(s) {foreign} are not in the client's region {self.region!r}; "
                "use one source (and client) per region and combine them with CombinedMarketSource"
            )
        if isinstance(on_demand_price, bool) or not isinstance(on_demand_price, (int, float)):
            raise ValueError(f"on_demand_price {on_demand_price!r} must be a number (USD per instance-hour)")
        if problem := price_problem(on_demand_price, on_demand=True):
            raise ValueError(f"on_demand_price {problem}")
        if placement_target is not None and placement_target < 1:
            raise ValueError(f"placement_target {placement_target!r} must be >= 1 or None (no placement scores)")
        self.instance_type = instance_type
        self.zones = tuple(dict.fromkeys(availability_zones))
        self.on_demand_price = float(on_demand_price)
        self.product_description = product_description
        self.placement_target = placement_target
        self.launch_outcomes = launch_outcomes
        self.tick_seconds = tick_seconds
        self.signal_ttl = signal_ttl
        self.clock = clock
        self._zone_names_by_id: dict[str, str] | None = None

    def observe(self, start: datetime, end: datetime) -> Trace:
        first, last = check_window(start, end)
        last = min(last, self.clock().timestamp())  # nothing after now has been observed
        prices = self.price_changes(start, end)
        signals = by_pool(self.availability_signals(start, end))
        ticks = []
        for zone in self.zones:
            ticks += signal_ticks(
                zone, prices.get(zone, []), self.on_demand_price, signals.get(zone, []),
                first, last, self.tick_seconds, self.signal_ttl,
            )
        return trace_from_ticks(ticks, source=f"aws:{self.region}:{self.instance_type}", grid_seconds=self.tick_seconds)

    def price_changes(self, start: datetime, end: datetime) -> dict[str, list[tuple[float, float]]]:
        """Per zone, the spot price changes in the window as (epoch seconds, USD/h), time-sorted;
        the record in force at ``start`` is moved to ``start``."""
        first, last = check_window(start, end)
        pages = self.client.get_paginator("describe_spot_price_history").paginate(
            StartTime=start,
            EndTime=end,
            InstanceTypes=[self.instance_type],
            ProductDescriptions=[self.product_description],
            Filters=[{"Name": "availability-zone", "Values": list(self.zones)}],
        )
        # "Linux/UNIX (Amazon VPC)" is the same offer as "Linux/UNIX" for instances in a VPC
        accepted = {self.product_description, f"{self.product_description} (Amazon VPC)"}
        before: dict[str, tuple[float, float]] = {}
        changes: dict[str, list[tuple[float, float]]] = {}
        for page in pages:
            for record in page.get("SpotPriceHistory", []):
                zone = record.get("AvailabilityZone")
                if zone not in self.zones or record.get("InstanceType") != self.instance_type:
                    continue
                if record.get("ProductDescription") not in accepted:
                    continue
                when, price = self._parse_record(record)
                if when <= first:
                    if zone not in before or when >= before[zone][0]:
                        before[zone] = (when, price)
                elif when <= last:
                    changes.setdefault(zone, []).append((when, price))
        for zone, (_, price) in before.items():
            changes.setdefault(zone, []).append((first, price))
        return {zone: sorted(rows) for zone, rows in changes.items()}

    def availability_signals(self, start: datetime, end: datetime) -> list[AvailabilitySignal]:
        """Placement scores (if the window holds the present) and launch outcomes that can be in
        force inside the window (recorded since ``start - signal_ttl``)."""
        signals: list[AvailabilitySignal] = []
        now = self.clock()
        if self.placement_target is not None and start <= now <= end:
            signals += self.placement_scores(now)
        if self.launch_outcomes is not None:
            for outcome in self.launch_outcomes(start - self.signal_ttl, end):
                if outcome.pool in self.zones:
                    signals.append(outcome_signal(outcome))
        return signals

    def placement_scores(self, now: datetime) -> list[AvailabilitySignal]:
        """Today's spot placement score per zone (every page), as counts at ``now``."""
        assert self.placement_target is not None
        pages = self.client.get_paginator("get_spot_placement_scores").paginate(
            InstanceTypes=[self.instance_type],
            TargetCapacity=self.placement_target,
            TargetCapacityUnitType="units",
            SingleAvailabilityZone=True,
            RegionNames=[self.region],
        )
        names = self._zone_names()
        at = now.replace(microsecond=0)
        signals = []
        for page in pages:
            for entry in page.get("SpotPlacementScores", []):
                zone = names.get(entry.get("AvailabilityZoneId", ""))
                if zone in self.zones:
                    count = score_to_count(int(entry["Score"]), self.placement_target)
                    signals.append(AvailabilitySignal(at, zone, count, SignalKind.SCORE))
        return signals

    def _zone_names(self) -> dict[str, str]:
        """Zone id (``use1-az4``) to zone name (``us-east-1a``): scores name ids, and the mapping
        differs between accounts, so it is asked for, once."""
        if self._zone_names_by_id is None:
            reply = self.client.describe_availability_zones(ZoneNames=list(self.zones))
            self._zone_names_by_id = {z["ZoneId"]: z["ZoneName"] for z in reply.get("AvailabilityZones", [])}
        return self._zone_names_by_id

    def _parse_record(self, record: dict[str, Any]) -> tuple[float, float]:
        stamp = record.get("Timestamp")
        if not isinstance(stamp, datetime):
            raise ValueError(f"spot price record {record!r}: Timestamp is missing or not a time")
        try:
            price = float(record["SpotPrice"])
        except (KeyError, ValueError):
            raise ValueError(f"spot price record {record!r}: SpotPrice is missing or not a number") from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)
        return float(math.floor(stamp.timestamp())), price
