"""``spotsched forecast``: the forecast JSON, no peeking past --at, bad input, and the backtest's files."""

from __future__ import annotations

import csv
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from airflow_provider_spotsched.cli import BAD_INPUT, main
from airflow_provider_spotsched.forecast.snapshot import market_at
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.trace import format_timestamp, load_trace, parse_timestamp
from tests.test_cli import POOLS, write_slice

AT = "2025-10-06T12:05:00Z"  # off the trace's 10-minute tick grid: the state in force is the 12:00 tick


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory, gcp_trace) -> Path:
    return write_slice(gcp_trace, tmp_path_factory.mktemp("trace") / "gcp_slice.csv", days=3)


def forecast(trace: Path, out: Path, *options: str, at: str = AT, horizon: int = 6) -> int:
    return main(["forecast", "--trace", str(trace), "--at", at, "--horizon", str(horizon), "--out", str(out), *options])


def test_forecast_json_has_exactly_the_documented_shape(tmp_path, trace_file):
    out = tmp_path / "f.json"
    assert forecast(trace_file, out, "--model", "persistence", "--at-least", "4", "9", "--pools", "us-east4-b",
                    "--pools", "us-west1-b") == 0
    document = json.loads(out.read_text())
    assert set(document) == {"at", "slot_hours", "data_until", "staleness_seconds", "pools"}
    assert document["at"] == AT and document["slot_hours"] == 1.0
    assert document["data_until"] == "2025-10-06T12:00:00Z" and document["staleness_seconds"] == 300.0
    assert list(document["pools"]) == ["us-east4-b", "us-west1-b"]
    at = parse_timestamp(AT)
    state = resample(load_trace(trace_file), start=at, num_slots=1)  # the state in force at --at
    for pool, entry in document["pools"].items():
        assert set(entry) == {"model", "spot_price", "available", "p_available_at_least", "last_tick",
                              "staleness_seconds", "stale"}
        assert entry["model"] == "persistence"
        assert (entry["last_tick"], entry["staleness_seconds"], entry["stale"]) == ("2025-10-06T12:00:00Z", 300.0, False)
        m = state.pools.index(pool)
        assert entry["spot_price"] == [state.spot_price[0, m]] * 6
        assert entry["available"] == [float(state.available[0, m])] * 6
        assert list(entry["p_available_at_least"]) == ["1", "4", "9"]
        for n, chances in entry["p_available_at_least"].items():
            assert chances == [float(state.available[0, m] >= int(n))] * 6


def test_slots_end_at_the_one_starting_at_at(trace_file):
    at = parse_timestamp(AT)
    market = market_at(load_trace(trace_file), at)
    assert market.start + timedelta(hours=market.num_slots - 1) == at
    assert market.start - timedelta(hours=1) < parse_timestamp("2025-10-04T00:10:00Z") <= market.start
    np.testing.assert_array_equal(market.available[-1], resample(load_trace(trace_file), start=at, num_slots=1).available[0])


def test_a_pool_that_starts_after_at_is_left_out_by_default_as_if_the_file_ended_at_at(tmp_path, trace_file):
    at = parse_timestamp(AT)
    late = tmp_path / "late.csv"
    added = f"{format_timestamp(at + timedelta(hours=2))},late-pool,1.0,2,3.0"
    late.write_text("\n".join(trace_file.read_text().splitlines() + [added]) + "\n")
    trace = load_trace(late)
    assert "late-pool" in trace.pools and "late-pool" not in market_at(trace, at).pools
    with pytest.raises(ValueError, match=r"\['late-pool'\] have no tick at or before --at"):
        market_at(trace, at, pools=["late-pool"])  # named, it is still refused


def _tamper_after(source: Path, at: str, target: Path) -> Path:
    """``source`` with every row after ``at`` changed, plus ticks 100 s apart between them.

    The extra ticks outnumber the real ones, so the trace's typical tick gap (the unit of the
    hole rule) shrinks too: a resampling that looked at the whole trace would mark the slots up to
    ``at`` as holes.
    """
    cut = parse_timestamp(at)
    lines = source.read_text().splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        stamp, pool, price, available, on_demand = line.split(",")
        if parse_timestamp(stamp) > cut:
            out.append(f"{stamp},{pool},{float(price) * 3},{16 - int(available)},{on_demand}")
            for extra in range(1, 6):
                late = parse_timestamp(stamp) + timedelta(seconds=100 * extra)
                out.append(f"{late.strftime('%Y-%m-%dT%H:%M:%SZ')},{pool},{price},0,{on_demand}")
        else:
            out.append(line)
    target.write_text("\n".join(out) + "\n")
    return target


@pytest.mark.parametrize("model", ["seasonal-naive", "persistence"])
def test_nothing_after_at_is_read(tmp_path, trace_file, model):
    tampered = _tamper_after(trace_file, AT, tmp_path / "tampered.csv")
    assert forecast(trace_file, tmp_path / "a.json", "--model", model, "--at-least", "8") == 0
    assert forecast(tampered, tmp_path / "b.json", "--model", model, "--at-least", "8") == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


def test_the_default_automatic_choice_names_its_models_and_reads_nothing_after_at(tmp_path, gcp_trace):
    trace = write_slice(gcp_trace, tmp_path / "five_days.csv", days=5, pools=("us-east4-b", "us-west1-b"))
    at = "2025-10-08T12:05:00Z"  # 108 slots of history: enough for the automatic choice's own backtest
    tampered = _tamper_after(trace, at, tmp_path / "tampered.csv")
    assert forecast(trace, tmp_path / "a.json", "--at-least", "8", at=at, horizon=24) == 0
    assert forecast(tampered, tmp_path / "b.json", "--at-least", "8", at=at, horizon=24) == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    document = json.loads((tmp_path / "a.json").read_text())
    for entry in document["pools"].values():
        price_model, _, count_model = entry["model"].partition("+")
        assert price_model and count_model  # auto names its price and its availability model
        assert len(entry["available"]) == 24 and all(0.0 <= a <= 16.0 for a in entry["available"])
        chances = entry["p_available_at_least"]
        assert list(chances) == ["1", "8"]
        assert all(0.0 <= p8 <= p1 <= 1.0 for p1, p8 in zip(chances["1"], chances["8"]))


def test_at_on_a_tick_forecasts_from_that_tick(tmp_path, trace_file):
    tampered = _tamper_after(trace_file, "2025-10-06T12:00:00Z", tmp_path / "tampered.csv")
    at = "2025-10-06T12:00:00Z"
    assert forecast(trace_file, tmp_path / "a.json", "--model", "persistence", at=at) == 0
    assert forecast(tampered, tmp_path / "b.json", "--model", "persistence", at=at) == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


@pytest.mark.parametrize(("slot_hours", "expected"), [("1", [0.0] * 4), ("0.5", [8.0, 0.0, 0.0, 0.0])])
def test_seasonal_naive_copies_the_slot_a_day_earlier_whatever_the_slot_length(tmp_path, slot_hours, expected):
    """A pool full from 00:00 to 12:00 UTC and empty after, forecast from 11:00: on half-hour slots
    24 slots back is 23:30 the day before (empty), a day back is 11:30 (full)."""
    trace = tmp_path / "daily.csv"
    start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    ticks = [start + timedelta(minutes=15 * i) for i in range(3 * 24 * 4 + 4 * 11 + 1)]  # to 2025-01-04T11:00
    rows = [f"{format_timestamp(t)},z,1.0,{8 if t.hour < 12 else 0},5.0" for t in ticks]
    trace.write_text("\n".join(["timestamp,market,spot_price,available,on_demand_price", *rows]) + "\n")
    out = tmp_path / "f.json"
    assert forecast(trace, out, "--model", "seasonal-naive", "--slot-hours", slot_hours, at="2025-01-04T11:00:00Z", horizon=4) == 0
    assert json.loads(out.read_text())["pools"]["z"]["available"] == expected


def _last_tick(trace: Path) -> datetime:
    return datetime.fromtimestamp(load_trace(trace).last_time, timezone.utc)


def test_live_at_minutes_after_the_last_tick_is_accepted_with_its_staleness(tmp_path, trace_file, capsys):
    """Live data lags the clock: an --at 7 minutes after the newest tick forecasts from that tick and
    says how old it is; 20 minutes on (past 1.5 tick gaps) availability is unknown and counts as 0."""
    last = _last_tick(trace_file)
    at = format_timestamp(last + timedelta(minutes=7))
    assert forecast(trace_file, tmp_path / "live.json", "--model", "persistence", at=at) == 0
    printed = capsys.readouterr().out
    assert f"data until {format_timestamp(last)}, 7 min before --at" in printed
    document = json.loads((tmp_path / "live.json").read_text())
    assert document["at"] == at and document["data_until"] == format_timestamp(last)
    assert document["staleness_seconds"] == 420.0
    trace = load_trace(trace_file)
    for pool, entry in document["pools"].items():
        series = trace.pools[pool]
        assert (entry["staleness_seconds"], entry["stale"]) == (at_seconds(at) - series.times[-1], False)
        assert entry["available"] == [float(series.available[-1])] * 6  # the newest tick, carried forward
        assert entry["spot_price"] == [float(series.spot_price[-1])] * 6
    later = format_timestamp(last + timedelta(minutes=20))
    assert forecast(trace_file, tmp_path / "late.json", "--model", "persistence", at=later) == 0
    assert "availability unknown (counted as 0)" in capsys.readouterr().out
    document = json.loads((tmp_path / "late.json").read_text())
    assert document["staleness_seconds"] == 1200.0
    for entry in document["pools"].values():
        assert entry["stale"] and entry["available"] == [0.0] * 6  # the spec's hole rule, said out loud


def at_seconds(at: str) -> float:
    return parse_timestamp(at).timestamp()


def test_an_at_beyond_the_allowed_staleness_is_refused_unless_allowed(tmp_path, trace_file, capsys):
    late = format_timestamp(_last_tick(trace_file) + timedelta(hours=2))
    check_bad_input(["forecast", "--trace", str(trace_file), "--at", late, "--horizon", "6", "--model", "persistence",
                     "--out", str(tmp_path / "f.json")], ["--at", late, "newest tick is 2.0 h before", "1 h of staleness"], capsys)
    assert forecast(trace_file, tmp_path / "f.json", "--model", "persistence", "--max-staleness-hours", "3", at=late) == 0
    assert json.loads((tmp_path / "f.json").read_text())["staleness_seconds"] == 7200.0
    check_bad_input(["forecast", "--trace", str(trace_file), "--at", late, "--horizon", "6", "--model", "persistence",
                     "--max-staleness-hours", "-1", "--out", str(tmp_path / "g.json")],
                    ["--max-staleness-hours", ">= 0"], capsys)


def check_bad_input(args: list[str], words: list[str], capsys) -> None:
    assert main(args) == BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    for word in words:
        assert word in err


@pytest.mark.parametrize(
    "options, words",
    [
        ({"--horizon": "0"}, ["--horizon 0", "1..48"]),
        ({"--horizon": "49"}, ["--horizon 49", "1..48", "daily season"]),
        ({"--at": "2025-11-01T00:00:00Z"}, ["--at 2025-11-01T00:00:00Z", "outside"]),
        ({"--at": "2025-10-04T05:00:00Z"}, ["history", "24", "2025-10-04T23:10:00Z"]),
        ({"--at": "yesterday"}, ["--at", "yesterday", "ISO-8601"]),
        ({"--pools": "us-east4-b,mars-1a"}, ["mars-1a", *POOLS]),
        ({"--market": "mars-1a"}, ["mars-1a", *POOLS]),
        ({"--at-least": "0"}, ["--at-least", ">= 1"]),
        ({"--model": "crystal-ball"}, ["--model", "crystal-ball", "persistence"]),
        ({"--model": "oracle"}, ["--model", "oracle", "unknown forecaster"]),
        ({"--slot-hours": "0"}, ["--slot-hours 0:", "from a minute"]),
        ({"--slot-hours": "inf"}, ["--slot-hours inf:", "from a minute (0.01667) to a year (8760) of hours"]),
        ({"--slot-hours": "1e-9"}, ["--slot-hours 1e-09:", "from a minute"]),  # not a 1 TiB array of slots
        ({"--slot-hours": "1e300"}, ["--slot-hours 1e+300:", "to a year"]),  # not a date past the calendar
    ],
)
def test_bad_input_exits_2_naming_the_option(tmp_path, trace_file, capsys, options, words):
    merged = {"--trace": str(trace_file), "--at": AT, "--horizon": "6", "--model": "persistence",
              "--out": str(tmp_path / "f.json"), **options}
    check_bad_input(["forecast", *[item for pair in merged.items() for item in pair]], words, capsys)
    assert not (tmp_path / "f.json").exists()


def test_forecast_needs_at_and_out_without_backtest(tmp_path, trace_file, capsys):
    check_bad_input(["forecast", "--trace", str(trace_file), "--horizon", "6"], ["--at", "--out", "--backtest"], capsys)


def test_backtest_writes_table_summary_and_plots(tmp_path, trace_file, capsys):
    out = tmp_path / "bt"
    args = ["forecast", "--trace", str(trace_file), "--horizon", "4", "--backtest", "--models", "seasonal-naive",
            "--market", "us-east4-b,us-west1-b", "--step", "8", "--out-dir", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "available count: MAE mean over pools" in printed and "seasonal-naive" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "backtest.csv", "calibration.csv", "error_vs_horizon.png", "forecast_vs_actual.png", "reliability.csv",
        "summary.md"]
    with (out / "backtest.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["pool"] for r in rows} == {"us-east4-b", "us-west1-b"}
    assert {r["model"] for r in rows} == {"seasonal-naive", "persistence"}
    assert {int(r["step"]) for r in rows} == {1, 2, 3, 4}
    summary = (out / "summary.md").read_text()
    assert "--models seasonal-naive" in summary and "| us-west1-b |" in summary


def test_backtest_at_fresh_origins_scores_intervals_and_chances(tmp_path, trace_file, capsys):
    out = tmp_path / "bt"
    args = ["forecast", "--trace", str(trace_file), "--horizon", "4", "--backtest", "--models", "seasonal-naive",
            "--market", "us-east4-b,us-west1-b", "--origins", "5", "--fresh", "--at-least", "8",
            "--out-dir", str(out)]
    assert main(args) == 0
    assert "5 origins" in capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    assert "each forecast by a new forecaster" in summary and "5 origins spread evenly" in summary
    assert "Coverage of the 80% intervals" in summary and "## P(available >= 8)" in summary
    assert "## P(available >= 1)" in summary and "| climatology |" in summary
    with (out / "calibration.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    brier = [r for r in rows if r["at_least"] == "8"]
    assert len(brier) == 2 * 4 and all(0.0 <= float(r["brier"]) <= 1.0 for r in brier)  # 2 models x 4 steps
    assert {r["coverage80"] for r in rows if r["model"] == "persistence" and not r["at_least"]} == {""}
    with (out / "reliability.csv").open() as handle:
        reliability = list(csv.DictReader(handle))
    assert {r["at_least"] for r in reliability} == {"1", "8"}
    assert sum(int(r["points"]) for r in reliability if r["model"] == "seasonal-naive" and r["at_least"] == "1") \
        == 5 * 4 * 2  # origins x steps x pools


def test_backtest_bad_input_exits_2(tmp_path, trace_file, capsys):
    base = ["forecast", "--trace", str(trace_file), "--horizon", "4", "--backtest", "--out-dir", str(tmp_path)]
    check_bad_input(base + ["--models", "crystal-ball"], ["--models", "crystal-ball"], capsys)
    check_bad_input(base + ["--models", "persistence", "--min-history", "100"], ["no origin", "min_history"], capsys)
    check_bad_input(base + ["--market", "mars-1a"], ["mars-1a", "us-east4-b"], capsys)
    check_bad_input(base + ["--models", "persistence", "--origins", "0"], ["origins", ">= 1"], capsys)
    check_bad_input(base + ["--models", "persistence", "--at-least", "0"], ["--at-least", ">= 1"], capsys)
