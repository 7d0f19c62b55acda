"""Slot resampling: the state in force at each slot's start, holes count as unavailable."""

from __future__ import annotations

from datetime import datetime, timezone
from io import StringIO

import numpy as np
import pytest

from airflow_provider_spotsched.market.slots import resample, select_pools
from airflow_provider_spotsched.market.trace import TraceError, read_trace

HEADER = "timestamp,market,spot_price,available,on_demand_price\n"


def trace_of(rows: str):
    return read_trace(StringIO(HEADER + rows), source="mem.csv")


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def ticks(market: str, values: list[tuple[str, float, int]], on_demand: float = 3.0) -> str:
    return "".join(f"2025-01-01T{t}Z,{market},{p},{a},{on_demand}\n" for t, p, a in values)


def test_slot_takes_the_last_tick_at_or_before_its_start():
    rows = ticks("a", [("00:00:00", 1.0, 4), ("00:30:00", 2.0, 3), ("01:00:00", 5.0, 2), ("01:30:00", 6.0, 1), ("02:00:00", 7.0, 0)])
    market = resample(trace_of(rows), slot_hours=1.0)
    assert market.num_slots == 3
    assert market.spot_price[:, 0].tolist() == [1.0, 5.0, 7.0]
    assert market.available[:, 0].tolist() == [4, 2, 0]
    half = resample(trace_of(rows), start=utc("2025-01-01T00:45:00"), slot_hours=0.5)
    assert half.spot_price[:, 0].tolist() == [2.0, 5.0, 6.0]


def test_a_hole_makes_the_pool_unavailable_but_keeps_the_last_price():
    # ticks every 10 minutes, then nothing between 01:00 and 03:00
    values = [(f"0{h}:{m}0:00", 1.0 + h, 5) for h in range(0, 1) for m in range(6)]
    values += [("01:00:00", 2.0, 5), ("03:00:00", 4.0, 6), ("03:10:00", 4.0, 6)]
    market = resample(trace_of(ticks("a", values)), slot_hours=1.0)
    assert market.available[:, 0].tolist() == [5, 5, 0, 6]
    assert market.spot_price[:, 0].tolist() == [1.0, 2.0, 2.0, 4.0]


def test_gcp_hole_on_2025_10_09(gcp_trace):
    market = resample(gcp_trace, start=utc("2025-10-09T03:10:00"), slot_hours=1.0, num_slots=4)
    # 03:10 and 04:10 are observed; 05:10 falls in the 110-minute hole; 06:10 is observed again
    assert (market.available[2] == 0).all()
    assert market.available[[0, 1, 3]].sum() > 0


def test_pool_before_its_first_tick_is_unavailable_at_its_first_price():
    rows = ticks("a", [("00:00:00", 1.0, 2), ("01:00:00", 1.0, 2), ("02:00:00", 1.0, 2)])
    rows += ticks("b", [("01:00:00", 9.0, 3), ("02:00:00", 8.0, 3)], on_demand=2.5)
    market = resample(trace_of(rows), slot_hours=1.0)
    assert market.pools == ("a", "b")
    assert market.available[:, 1].tolist() == [0, 3, 3]
    assert market.spot_price[0, 1] == 9.0
    assert market.on_demand_price == 2.5, "the job uses the cheapest on-demand price"


def test_window_prefix_and_errors():
    rows = ticks("a", [(f"0{h}:00:00", float(h), h) for h in range(6)])
    market = resample(trace_of(rows), slot_hours=1.0)
    assert market.prefix(2).spot_price[:, 0].tolist() == [0.0, 1.0]
    window = market.window(2, 3)
    assert window.start == utc("2025-01-01T02:00:00") and window.num_slots == 3
    with pytest.raises(TraceError, match="holds only 6 slots"):
        resample(trace_of(rows), slot_hours=1.0, num_slots=7)
    with pytest.raises(TraceError, match="lies outside"):
        resample(trace_of(rows), start=utc("2024-12-31T00:00:00"))
    with pytest.raises(TraceError, match=r"unknown pool\(s\) \['zz'\]"):
        select_pools(trace_of(rows), ["zz"])
    with pytest.raises(ValueError, match="slot_hours must be > 0"):
        resample(trace_of(rows), slot_hours=0)


def test_shipped_traces_resample(aws_trace, gcp_trace):
    aws = resample(aws_trace)
    gcp = resample(gcp_trace)
    assert aws.on_demand_price == pytest.approx(3.06)
    assert aws.available.max() == 1 and gcp.available.max() == 16
    assert np.isfinite(aws.spot_price).all() and np.isfinite(gcp.spot_price).all()
