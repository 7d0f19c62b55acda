"""A replayed market's refusals name what to change; a live feed tells the capacity now, not a stale count."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_spotsched.market.feed import LiveMarketFeed, NoMarketData, ReplayedMarket
from airflow_provider_spotsched.market.source import MarketSource, Tick, clip, trace_from_ticks
from airflow_provider_spotsched.market.trace import Trace, load_trace

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


class StoppedSource(MarketSource):
    """A live source whose data ends at ``last`` (a feed that stopped, or a lone placement score)."""

    def __init__(self, ticks: list[Tick], grid_seconds: float | None = None) -> None:
        self.trace = trace_from_ticks(ticks, "stopped", grid_seconds)

    def observe(self, start: datetime, end: datetime) -> Trace:
        return clip(self.trace, start, end) if self.trace.pools else self.trace


def ten_minute_ticks(until: datetime, hours: int) -> list[Tick]:
    first = until - timedelta(hours=hours)
    return [Tick((first + timedelta(minutes=10 * k)).timestamp(), "pool-a", 0.4, 8, 3.0) for k in range(hours * 6 + 1)]


def test_a_live_feed_that_stopped_hours_ago_reports_no_capacity_now_not_its_last_count():
    now = T0 + timedelta(days=3)
    feed = LiveMarketFeed(StoppedSource(ten_minute_ticks(now - timedelta(hours=3), 48)), 1.0, 24.0)
    history = feed.history(now)
    assert history.start + timedelta(hours=history.num_slots - 1) == now  # the last slot starts now
    assert history.available[-1].tolist() == [0] and history.spot_price[-1].tolist() == [0.4]
    assert history.available[-4].tolist() == [8]  # while the ticks came, their counts
    assert feed.row(1, ["pool-a"], now)[1].tolist() == [0]
    fresh = LiveMarketFeed(StoppedSource(ten_minute_ticks(now - timedelta(minutes=7), 48)), 1.0, 24.0)
    assert fresh.row(1, ["pool-a"], now)[1].tolist() == [8]  # minutes behind the clock: the count holds


def test_a_live_feed_with_one_tick_per_pool_uses_the_sources_tick_grid():
    now = T0 + timedelta(days=3)
    score = [Tick(now.timestamp() - 60, "pool-a", 0.9, 1, 3.0)]  # a placement score a minute ago, no launch yet
    market = LiveMarketFeed(StoppedSource(score, grid_seconds=600.0), 1.0, 24.0).history(now)
    assert market.num_slots == 1 and market.available.tolist() == [[1]]


def test_a_live_feed_with_no_evidence_at_all_says_so():
    with pytest.raises(NoMarketData, match="availability evidence"):
        LiveMarketFeed(StoppedSource([]), 1.0, 24.0).history(T0)


def test_a_live_feed_prices_on_demand_as_now_not_as_at_the_start_of_its_history():
    now = T0 + timedelta(days=3)
    ticks = [replace(t, on_demand_price=3.0 if t.time < (now - timedelta(hours=12)).timestamp() else 4.0)
             for t in ten_minute_ticks(now, 48)]
    assert LiveMarketFeed(StoppedSource(ticks), 1.0, 24.0).history(now).on_demand_price == 4.0


def test_a_live_feed_prices_on_demand_as_the_jobs_pools_cheapest_leaving_out_pools_without_ticks():
    now = T0 + timedelta(days=3)
    ticks = ten_minute_ticks(now, 48)
    ticks += [replace(t, market="pool-b", on_demand_price=2.0) for t in ticks]  # pool-b's on-demand is cheaper
    feed = LiveMarketFeed(StoppedSource(ticks), 1.0, 24.0)
    assert feed.history(now).on_demand_price == 2.0  # a job on any pool
    assert feed.history(now, ["pool-a"]).on_demand_price == 3.0
    assert feed.history(now, ["pool-a", "mars-1a"]).pools == ("pool-a", "pool-b")  # the run refuses mars-1a by name
