"""Small hand-made markets and jobs for tests."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Job, Throughput
from airflow_provider_spotsched.scheduling.replay import JobMarket

EPOCH = datetime(2025, 1, 1, tzinfo=timezone.utc)


def make_market(
    spot_price: Sequence[Sequence[float]],
    available: Sequence[Sequence[int]],
    on_demand_price: float = 3.0,
    slot_hours: float = 1.0,
) -> SlotMarket:
    """A market from per-slot rows of per-pool prices and counts."""
    prices = np.asarray(spot_price, dtype=float)
    return SlotMarket(
        pools=tuple(f"pool-{m}" for m in range(prices.shape[1])),
        start=EPOCH,
        slot_hours=slot_hours,
        spot_price=prices,
        available=np.asarray(available, dtype=np.int64),
        on_demand_price=on_demand_price,
    )


def make_job(**overrides) -> Job:
    """A small feasible job: 8 units of work, 2 instances of 1 unit/h each, deadline 6 h."""
    fields = dict(
        work=8.0,
        deadline_hours=6.0,
        max_instances=2,
        min_instances=1,
        throughput=Throughput(1.0, 0.0),
        value=30.0,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=0.0,
        slot_hours=1.0,
    )
    fields.update(overrides)
    return Job(**fields)


def whole(market: SlotMarket) -> JobMarket:
    """The market as a job market with no history before submission."""
    return JobMarket(market, 0)
