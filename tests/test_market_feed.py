"""A replayed market's refusals name what to change."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_spotsched.market.feed import ReplayedMarket
from airflow_provider_spotsched.market.trace import load_trace

T0 = datetime(2025, 10, 1, tzinfo=timezone.utc)


def short_trace(tmp_path, hours: int):
    rows = ["timestamp,market,spot_price,available,on_demand_price"]
    rows += [f"{T0 + timedelta(hours=h):%Y-%m-%dT%H:%M:%SZ},pool-a,1.0,2,3.0" for h in range(hours)]
    path = tmp_path / "short.csv"
    path.write_text("\n".join(rows) + "\n")
    return load_trace(path)


def test_a_trace_too_short_for_the_history_names_history_slots(tmp_path):
    trace = short_trace(tmp_path, 48)
    with pytest.raises(ValueError, match=r"holds 48 slot\(s\) of 1 h; a replay needs more than history_slots=48.*--history-slots"):
        ReplayedMarket(trace, 1.0, 48)
    assert ReplayedMarket(trace, 1.0, 24).history_slots == 24
    with pytest.raises(ValueError, match="lies at the end of"):
        ReplayedMarket(trace, 1.0, 24, start=T0 + timedelta(hours=48))
