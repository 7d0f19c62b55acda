"""The market history store: round trips, windows, duplicates, two writers, compaction races."""

from __future__ import annotations

import gzip
import multiprocessing
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from airflow_provider_spotsched.market.history import HistoryError, MarketHistoryStore
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.market.source import Tick, trace_from_ticks, trace_ticks
from airflow_provider_spotsched.market.trace import PoolSeries, Trace, TraceError

T0 = datetime(2025, 10, 4, 23, 0, tzinfo=timezone.utc)


def ticks_trace(minutes: list[int], pool: str = "us-central1-a", price: float = 2.5, available: int = 3) -> Trace:
    """Ticks of one pool at ``T0 + minutes``."""
    start = T0.timestamp()
    return trace_from_ticks(
        [Tick(start + 60 * m, pool, price + m / 100, available, 10.0) for m in minutes], source="test"
    )


def rows(trace: Trace) -> list[tuple[float, str, float, int, float]]:
    return [(t.time, t.market, t.spot_price, t.available, t.on_demand_price) for t in trace_ticks(trace)]


def test_ticks_round_trip_across_days_and_pools(tmp_path):
    store = MarketHistoryStore(tmp_path)
    a, b = ticks_trace([0, 10, 70, 130]), ticks_trace([5, 65], pool="us-east4-a", available=0)
    parts = store.append(a) + store.append(b)
    # 23:00 .. 01:10 spans two UTC days: each append writes one part per day it covers
    assert len(parts) == 4
    assert {p.parent.name for p in parts} == {"day=2025-10-04", "day=2025-10-05"}
    back = store.window(T0, T0 + timedelta(hours=3))
    assert rows(back) == sorted(rows(a) + rows(b), key=lambda r: (r[1], r[0]))


def test_the_window_keeps_only_its_ticks_and_recent_counts_back_from_now(tmp_path):
    store = MarketHistoryStore(tmp_path)
    store.append(ticks_trace(list(range(0, 180, 10))))
    window = store.window(T0 + timedelta(minutes=30), T0 + timedelta(minutes=90))
    minutes = (window.pools["us-central1-a"].times - T0.timestamp()) / 60
    np.testing.assert_array_equal(minutes, [30, 40, 50, 60, 70, 80, 90])
    recent = store.recent(timedelta(minutes=25), now=T0 + timedelta(minutes=175))
    np.testing.assert_array_equal((recent.pools["us-central1-a"].times - T0.timestamp()) / 60, [150, 160, 170])
    assert store.window(T0 - timedelta(days=3), T0 - timedelta(days=2)).pools == {}


def test_duplicates_count_once_and_a_later_observation_replaces_an_earlier_one(tmp_path):
    store = MarketHistoryStore(tmp_path)
    store.append(ticks_trace([0, 10, 20]))
    store.append(ticks_trace([10, 20, 30]))  # exact duplicates at 10 and 20
    store.append(ticks_trace([20], available=0))  # re-observed: 0 available at minute 20
    pool = store.window(T0, T0 + timedelta(hours=1)).pools["us-central1-a"]
    np.testing.assert_array_equal((pool.times - T0.timestamp()) / 60, [0, 10, 20, 30])
    np.testing.assert_array_equal(pool.available, [3, 3, 0, 3])


def _append_many(root: str, pool: str, count: int) -> None:
    store = MarketHistoryStore(Path(root))
    for i in range(count):
        store.append(ticks_trace([i], pool=pool))
        store.record_outcome(LaunchOutcome(T0 + timedelta(minutes=i), pool, 2, i % 3))


def test_two_processes_appending_at_once_lose_nothing(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_many, args=(str(tmp_path), pool, 25)) for pool in ("zone-a", "zone-b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    store = MarketHistoryStore(tmp_path)
    trace = store.window(T0, T0 + timedelta(hours=1))
    assert {name: len(p.times) for name, p in trace.pools.items()} == {"zone-a": 25, "zone-b": 25}
    outcomes = store.outcomes(T0, T0 + timedelta(hours=1))
    assert len(outcomes) == 50 and [o.launched for o in outcomes if o.pool == "zone-a"] == [i % 3 for i in range(25)]


def test_compaction_merges_parts_and_keeps_every_row(tmp_path):
    store = MarketHistoryStore(tmp_path)
    for m in range(0, 50, 10):
        store.append(ticks_trace([m, m + 5]))
    store.append(ticks_trace([20], available=0))
    store.record_outcomes([LaunchOutcome(T0, "us-central1-a", 4, 0, "ZONE_RESOURCE_POOL_EXHAUSTED")] * 2)
    store.record_outcome(LaunchOutcome(T0 + timedelta(minutes=3), "us-central1-a", 4, 4))
    before = rows(store.window(T0, T0 + timedelta(hours=1)))
    outcomes_before = store.outcomes(T0, T0 + timedelta(hours=1))
    assert store.compact() == 6 + 2
    day = tmp_path / "ticks" / "day=2025-10-04"
    assert len([p for p in day.iterdir()]) == 1
    assert rows(store.window(T0, T0 + timedelta(hours=1))) == before
    assert store.outcomes(T0, T0 + timedelta(hours=1)) == outcomes_before and len(outcomes_before) == 2
    assert store.compact() == 0  # one part per day: nothing to merge


def test_an_append_landing_during_compaction_is_kept(tmp_path, monkeypatch):
    """The append lands after compaction listed and read the day, before it deletes: the worst moment."""
    store = MarketHistoryStore(tmp_path)
    store.append(ticks_trace([0]))
    store.append(ticks_trace([10]))
    writer = MarketHistoryStore(tmp_path)
    original = MarketHistoryStore._write_part

    def write_then_race(self, folder, name, columns, part_rows):
        written = original(self, folder, name, columns, part_rows)
        if "compacted" in name:
            writer.append(ticks_trace([20], available=7))
        return written

    monkeypatch.setattr(MarketHistoryStore, "_write_part", write_then_race)
    assert store.compact() == 2
    pool = store.window(T0, T0 + timedelta(hours=1)).pools["us-central1-a"]
    np.testing.assert_array_equal((pool.times - T0.timestamp()) / 60, [0, 10, 20])
    np.testing.assert_array_equal(pool.available, [3, 3, 7])


def test_compaction_racing_appends_and_reads_in_threads_loses_nothing(tmp_path):
    store = MarketHistoryStore(tmp_path)
    store.append(ticks_trace([0]))
    done = threading.Event()
    errors: list[BaseException] = []

    def keep_compacting():
        try:
            while not done.is_set():
                store.compact()
                store.window(T0, T0 + timedelta(hours=2))  # a reader racing the compaction
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    compactor = threading.Thread(target=keep_compacting)
    compactor.start()
    try:
        for m in range(1, 60):
            MarketHistoryStore(tmp_path).append(ticks_trace([m]))
    finally:
        done.set()
        compactor.join(timeout=60)
    assert errors == []
    store.compact()
    pool = store.window(T0, T0 + timedelta(hours=2)).pools["us-central1-a"]
    np.testing.assert_array_equal((pool.times - T0.timestamp()) / 60, np.arange(60))


def test_an_object_storage_path_root_works(tmp_path):
    from airflow.sdk import ObjectStoragePath  # Airflow only in the test: the store itself is Airflow-free

    root = ObjectStoragePath(f"file://{tmp_path}/history")
    store = MarketHistoryStore(root)
    store.append(ticks_trace([0, 10]))
    store.append(ticks_trace([10, 20]))
    store.record_outcome(LaunchOutcome(T0, "us-central1-a", 1, 0, "ZONE_RESOURCE_POOL_EXHAUSTED"))
    assert store.compact() == 2
    pool = store.window(T0, T0 + timedelta(hours=1)).pools["us-central1-a"]
    np.testing.assert_array_equal((pool.times - T0.timestamp()) / 60, [0, 10, 20])
    assert store.outcomes(T0, T0 + timedelta(minutes=1))[0].reason == "ZONE_RESOURCE_POOL_EXHAUSTED"
    assert (tmp_path / "history" / "ticks" / "day=2025-10-04").is_dir()
    assert not [p for p in (tmp_path / "history").rglob(".*")]  # no temporary part left behind


def test_bad_records_are_refused_with_the_field_named(tmp_path):
    store = MarketHistoryStore(tmp_path)
    bad = Trace("made", {"z": PoolSeries(np.array([T0.timestamp()]), np.array([-1.0]), np.array([1]), np.array([3.0]))})
    with pytest.raises(TraceError, match="spot_price -1.0 must be a finite price"):
        store.append(bad)
    subsecond = Trace("made", {"z": PoolSeries(np.array([T0.timestamp() + 0.2, T0.timestamp() + 0.7]), np.array([1.0, 1.0]),
                                               np.array([1, 1]), np.array([3.0, 3.0]))})
    with pytest.raises(TraceError, match="fraction of a second; the store keeps whole seconds"):
        store.append(subsecond)  # stored to the second, the two would share a stamp and the day could not be read
    with pytest.raises(HistoryError, match="launched=3; need 0 <= launched <= requested"):
        store.record_outcome(LaunchOutcome(T0, "z", 2, 3))
    with pytest.raises(HistoryError, match="must be a timezone-aware datetime"):
        store.record_outcome(LaunchOutcome(datetime(2025, 10, 4), "z", 2, 1))
    with pytest.raises(ValueError, match="must be a timezone-aware datetime"):
        store.window(datetime(2025, 10, 4), T0)
    assert not (tmp_path / "ticks").exists() and not (tmp_path / "outcomes").exists()


def test_a_corrupt_part_is_reported_with_its_file_line_and_column(tmp_path):
    store = MarketHistoryStore(tmp_path)
    part = store.append(ticks_trace([0]))[0]
    header = b"timestamp,market,spot_price,available,on_demand_price\n"
    part.write_bytes(gzip.compress(header + b"2025-10-04T23:00:00Z,z,cheap,1,3\n"))
    with pytest.raises(TraceError, match=r"part-.*line 2, column 'spot_price': 'cheap' is not a number"):
        store.window(T0, T0 + timedelta(hours=1))
    outcome_part = store.record_outcomes([LaunchOutcome(T0, "z", 1, 1)])[0]
    outcome_part.write_bytes(b"not gzip")
    with pytest.raises(HistoryError, match="not a gzip CSV part"):
        store.outcomes(T0, T0 + timedelta(hours=1))
