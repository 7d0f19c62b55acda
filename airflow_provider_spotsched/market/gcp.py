"""GCP spot market: Cloud Billing Catalog prices and availability from recorded launch outcomes.

Airflow-free: it takes an authorised HTTP session with the ``requests`` interface (for instance
``google.auth.transport.requests.AuthorizedSession``; the hook in
:mod:`airflow_provider_spotsched.hooks.market_data` builds one from an Airflow connection).

Prices: the Billing Catalog (``services.skus.list`` of Compute Engine, every page) prices a VM
by its parts: vCPU-hours, GiB-hours of memory and GPU-hours, each with an on-demand SKU and a
"Spot Preemptible" SKU per region. A machine type's price per instance-hour is the sum over its
:class:`MachineShape`. The catalog holds today's list prices (GCP changes spot prices at most
monthly), so they hold over any window observed and are read again after ``price_refresh``.

Availability: GCP publishes no capacity signal, so only the launch outcomes the backend recorded
count (:mod:`.availability`): ``ZONE_RESOURCE_POOL_EXHAUSTED`` gives 0, a success of k at least k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_provider_spotsched.market.availability import OutcomeReader, by_pool, outcome_signal
from airflow_provider_spotsched.market.source import MarketSource, check_window, signal_ticks, trace_from_ticks
from airflow_provider_spotsched.market.trace import Trace

COMPUTE_ENGINE_SERVICE = "services/6F81-5844-456A"
CATALOG_URL = f"https://cloudbilling.googleapis.com/v1/{COMPUTE_ENGINE_SERVICE}/skus"
SPOT_PREFIX = "Spot Preemptible "


class CatalogError(ValueError):
    """The Billing Catalog did not price the machine type as expected; the message says what."""


@dataclass(frozen=True)
class MachineShape:
    """What a machine type is billed for: ``family`` and ``gpu`` are the labels the catalog's SKU
    descriptions use (``"A3 Instance Core running in ..."``, ``"Nvidia H100 80GB GPU running in
    ..."``); memory is in GiB, the catalog's unit (GCP's "GB" of machine memory)."""

    family: str
    vcpus: int
    memory_gib: float
    gpus: int = 0
    gpu: str = ""

    def __post_init__(self) -> None:
        if self.vcpus < 1 or self.memory_gib <= 0 or self.gpus < 0:
            raise ValueError(f"{self}: vcpus must be >= 1, memory_gib > 0 and gpus >= 0")
        if self.gpus and not self.gpu:
            raise ValueError(f"{self}: gpus > 0 needs the gpu label of its SKU, e.g. 'Nvidia H100 80GB'")


MACHINE_TYPES: dict[str, MachineShape] = {
    "a3-highgpu-1g": MachineShape("A3", 26, 234, 1, "Nvidia H100 80GB"),
    "a3-highgpu-2g": MachineShape("A3", 52, 468, 2, "Nvidia H100 80GB"),
    "a3-highgpu-4g": MachineShape("A3", 104, 936, 4, "Nvidia H100 80GB"),
    "a3-highgpu-8g": MachineShape("A3", 208, 1872, 8, "Nvidia H100 80GB"),
    "a2-highgpu-1g": MachineShape("A2", 12, 85, 1, "Nvidia Tesla A100"),
    "g2-standard-4": MachineShape("G2", 4, 16, 1, "Nvidia L4"),
}
"""The GPU machine types priced without further configuration; pass a MachineShape for others."""

_UNIT_HOURS = {"h": "per hour", "GiBy.h": "per GiB-hour"}


@dataclass(frozen=True)
class MachinePrices:
    """USD per instance-hour of one machine type in one region."""

    region: str
    spot: float
    on_demand: float


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def zone_region(zone: str) -> str:
    """``us-central1-a`` -> ``us-central1``."""
    region, sep, letter = zone.rpartition("-")
    if not sep or not region or len(letter) != 1:
        raise ValueError(f"zone {zone!r} is not a GCP zone name like 'us-central1-a'")
    return region


class GcpSpotMarketSource(MarketSource):
    """Ticks for ``machine_type`` in ``zones`` (any regions)."""

    def __init__(
        self,
        session: Any,
        machine_type: str | MachineShape,
        zones: Sequence[str],
        *,
        launch_outcomes: OutcomeReader | None = None,
        tick_seconds: float = 600.0,
        signal_ttl: timedelta = timedelta(hours=1),
        price_refresh: timedelta = timedelta(hours=24),
        currency: str = "USD",
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        if isinstance(machine_type, MachineShape):
            self.shape, self.machine_type = machine_type, f"{machine_type.family.lower()}-custom"
        elif machine_type in MACHINE_TYPES:
            self.shape, self.machine_type = MACHINE_TYPES[machine_type], machine_type
        else:
            raise ValueError(
                f"machine_type {machine_type!r} is not in the table {sorted(MACHINE_TYPES)}; "
                "pass a MachineShape(family, vcpus, memory_gib, gpus, gpu) for it"
            )
        if not zones:
            raise ValueError("zones is empty: name the zones to observe, e.g. ['us-central1-a']")
        self.session = session
        self.zones = tuple(dict.fromkeys(zones))
        self.regions = tuple(dict.fromkeys(zone_region(z) for z in self.zones))
        self.launch_outcomes = launch_outcomes
        self.tick_seconds = tick_seconds
        self.signal_ttl = signal_ttl
        self.price_refresh = price_refresh
        self.currency = currency
        self.clock = clock
        self._prices: dict[str, MachinePrices] | None = None
        self._prices_read_at: datetime | None = None

    def observe(self, start: datetime, end: datetime) -> Trace:
        first, last = check_window(start, end)
        last = min(last, self.clock().timestamp())  # nothing after now has been observed
        prices = self.prices()
        signals = []
        if self.launch_outcomes is not None:
            recorded = self.launch_outcomes(start - self.signal_ttl, end)
            signals = [outcome_signal(o) for o in recorded if o.pool in self.zones]
        grouped = by_pool(signals)
        ticks = []
        for zone in self.zones:
            price = prices[zone_region(zone)]
            ticks += signal_ticks(
                zone, [(first, price.spot)], price.on_demand, grouped.get(zone, []),
                first, last, self.tick_seconds, self.signal_ttl,
            )
        return trace_from_ticks(ticks, source=f"gcp:{self.machine_type}", grid_seconds=self.tick_seconds)

    def prices(self) -> dict[str, MachinePrices]:
        """Per region, the machine type's spot and on-demand price (cached for ``price_refresh``)."""
        now = self.clock()
        if self._prices is None or self._prices_read_at is None or now - self._prices_read_at >= self.price_refresh:
            skus = list(self.skus())
            self._prices = {region: self._price_region(skus, region) for region in self.regions}
            self._prices_read_at = now
        return self._prices

    def skus(self) -> Iterator[dict[str, Any]]:
        """Every Compute Engine SKU of the catalog, following ``nextPageToken`` to the last page."""
        token = ""
        while True:
            params = {"currencyCode": self.currency, "pageSize": 5000}
            if token:
                params["pageToken"] = token
            response = self.session.get(CATALOG_URL, params=params, timeout=60)
            response.raise_for_status()
            page = response.json()
            yield from page.get("skus", [])
            token = page.get("nextPageToken", "")
            if not token:
                return

    def _price_region(self, skus: list[dict[str, Any]], region: str) -> MachinePrices:
        parts = [(f"{self.shape.family} Instance Core", "h", self.shape.vcpus),
                 (f"{self.shape.family} Instance Ram", "GiBy.h", self.shape.memory_gib)]
        if self.shape.gpus:
            parts.append((f"{self.shape.gpu} GPU", "h", self.shape.gpus))
        totals = {}
        for spot in (True, False):
            totals[spot] = sum(
                quantity * _hourly_rate(_one_sku(skus, label, region, spot), unit)
                for label, unit, quantity in parts
            )
        return MachinePrices(region, spot=totals[True], on_demand=totals[False])


def _one_sku(skus: list[dict[str, Any]], label: str, region: str, spot: bool) -> dict[str, Any]:
    """The single SKU for ``label`` in ``region``, spot ("Spot Preemptible ...", usage type
    Preemptible) or on-demand (usage type OnDemand; commitments are left out)."""
    usage = "Preemptible" if spot else "OnDemand"
    prefix = f"{SPOT_PREFIX}{label} running in " if spot else f"{label} running in "
    found = [
        s for s in skus
        if s.get("description", "").startswith(prefix)
        and s.get("category", {}).get("usageType") == usage
        and region in s.get("serviceRegions", [])
    ]
    if len(found) != 1:
        what = "no SKU" if not found else f"{len(found)} SKUs ({[s.get('skuId') for s in found]})"
        raise CatalogError(
            f"the Billing Catalog has {what} for {prefix!r}... with usage type {usage} in region {region!r}; "
            "check the machine type's MachineShape labels and that the region offers it"
        )
    return found[0]


def _hourly_rate(sku: dict[str, Any], unit: str) -> float:
    """The first-tier unit price of the SKU's newest pricing, checked to be ``unit``."""
    infos = sku.get("pricingInfo") or []
    if not infos:
        raise CatalogError(f"SKU {sku.get('skuId')} ({sku.get('description')}): no pricingInfo")
    info = max(infos, key=lambda i: i.get("effectiveTime", ""))
    expression = info.get("pricingExpression", {})
    if expression.get("usageUnit") != unit:
        raise CatalogError(
            f"SKU {sku.get('skuId')} ({sku.get('description')}): usageUnit {expression.get('usageUnit')!r}, "
            f"expected {unit!r} ({_UNIT_HOURS[unit]})"
        )
    rates = sorted(expression.get("tieredRates") or [], key=lambda r: float(r.get("startUsageAmount", 0)))
    if not rates:
        raise CatalogError(f"SKU {sku.get('skuId')} ({sku.get('description')}): no tieredRates")
    price = rates[0].get("unitPrice", {})
    return int(price.get("units", 0) or 0) + int(price.get("nanos", 0) or 0) / 1e9
