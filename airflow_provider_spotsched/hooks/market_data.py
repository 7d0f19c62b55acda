"""Airflow connections onto the live market sources (the only Airflow glue of the market data).

Credentials come only from the connection (``aws_conn_id``, ``gcp_conn_id``), through the
Amazon and Google providers' own hooks, so every way those providers authenticate (keys, roles,
workload identity, an ``endpoint_url`` in the extras) works here unchanged; nothing here logs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook
from airflow.providers.google.common.hooks.base_google import GoogleBaseHook
from google.auth.transport.requests import AuthorizedSession

from airflow_provider_spotsched.market.aws import AwsSpotMarketSource
from airflow_provider_spotsched.market.gcp import GcpSpotMarketSource, MachineShape
from airflow_provider_spotsched.market.source import CombinedMarketSource, MarketSource


def aws_zone_region(zone: str) -> str:
    """``us-east-1a`` -> ``us-east-1`` (an availability zone is its region plus one letter)."""
    if len(zone) < 2 or not zone[-1].isalpha() or not zone[-2].isdigit():
        raise ValueError(f"availability zone {zone!r} is not a name like 'us-east-1a'")
    return zone[:-1]


class AwsSpotMarketHook(EC2Hook):
    """EC2 clients from an AWS connection, one per region of the zones asked for."""

    hook_name = "Spot market (AWS)"

    def __init__(self, aws_conn_id: str | None = "aws_default", region_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_type="client_type", aws_conn_id=aws_conn_id, region_name=region_name, **kwargs)

    def get_source(
        self,
        instance_type: str,
        availability_zones: Sequence[str],
        on_demand_price: float,
        **options: Any,
    ) -> MarketSource:
        """A source over ``availability_zones`` (any regions); ``options`` go to
        :class:`AwsSpotMarketSource` (``placement_target``, ``launch_outcomes``, ...)."""
        if not availability_zones:
            raise ValueError("availability_zones is empty: name the zones to observe, e.g. ['us-east-1a']")
        regions: dict[str, list[str]] = {}
        for zone in availability_zones:
            regions.setdefault(aws_zone_region(zone), []).append(zone)
        sources = [
            AwsSpotMarketSource(self._region_client(region), instance_type, zones, on_demand_price, **options)
            for region, zones in regions.items()
        ]
        return sources[0] if len(sources) == 1 else CombinedMarketSource(sources)

    def _region_client(self, region: str) -> Any:
        if region == self.conn_region_name:
            return self.conn
        return EC2Hook(api_type="client_type", aws_conn_id=self.aws_conn_id, region_name=region).conn


class GcpSpotMarketHook(GoogleBaseHook):
    """A Billing Catalog session authorised with a Google Cloud connection's credentials."""

    hook_name = "Spot market (Google Cloud)"

    def get_session(self) -> AuthorizedSession:
        """A ``requests`` session that adds the connection's OAuth token to every request."""
        return AuthorizedSession(self.get_credentials())

    def get_source(self, machine_type: str | MachineShape, zones: Sequence[str], **options: Any) -> GcpSpotMarketSource:
        """A source over ``zones``; ``options`` go to :class:`GcpSpotMarketSource`."""
        return GcpSpotMarketSource(self.get_session(), machine_type, zones, **options)
