"""Trace loading and validation: good files load, bad ones name the file, line and column."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from airflow_provider_spotsched.market.trace import TraceError, load_trace

HEADER = "timestamp,market,spot_price,available,on_demand_price\n"


def write(tmp_path: Path, body: str, name: str = "t.csv", header: str = HEADER) -> Path:
    path = tmp_path / name
    path.write_text(header + body)
    return path


def test_shipped_traces_load(aws_trace, gcp_trace):
    assert len(aws_trace.pools) == 9 and len(gcp_trace.pools) == 13
    assert aws_trace.tick_seconds == pytest.approx(195, abs=2)
    assert gcp_trace.tick_seconds == 600
    series = gcp_trace.pools["us-central1-a"]
    assert series.available.max() <= 16 and series.available.min() >= 0


def test_gzip_and_plain_give_the_same_trace(tmp_path):
    body = "2025-01-01T00:00:00Z,a,1.0,2,3.0\n2025-01-01T00:10:00Z,a,1.5,0,3.0\n"
    plain = load_trace(write(tmp_path, body))
    zipped = tmp_path / "t.csv.gz"
    with gzip.open(zipped, "wt") as handle:
        handle.write(HEADER + body)
    packed = load_trace(zipped)
    assert list(plain.pools["a"].spot_price) == list(packed.pools["a"].spot_price) == [1.0, 1.5]
    assert list(packed.pools["a"].available) == [2, 0]


def test_rows_are_sorted_by_time(tmp_path):
    body = "2025-01-01T00:10:00Z,a,2.0,1,3.0\n2025-01-01T00:00:00Z,a,1.0,2,3.0\n"
    trace = load_trace(write(tmp_path, body))
    assert list(trace.pools["a"].spot_price) == [1.0, 2.0]


@pytest.mark.parametrize(
    "row, words",
    [
        ("yesterday,a,1.0,2,3.0", ["line 2", "'timestamp'", "yesterday"]),
        ("2025-01-01T00:00:00Z,a,-1.0,2,3.0", ["line 2", "'spot_price'", ">= 0"]),
        ("2025-01-01T00:00:00Z,a,nan,2,3.0", ["line 2", "'spot_price'"]),
        ("2025-01-01T00:00:00Z,a,1.0,-2,3.0", ["line 2", "'available'", ">= 0"]),
        ("2025-01-01T00:00:00Z,a,1.0,1.5,3.0", ["line 2", "'available'", "whole count"]),
        ("2025-01-01T00:00:00Z,a,1.0,2,abc", ["line 2", "'on_demand_price'", "not a number"]),
        ("2025-01-01T00:00:00Z,,1.0,2,3.0", ["line 2", "'market'", "empty"]),
        ("2025-01-01T00:00:00Z,a,1.0,2", ["line 2", "4 fields"]),
    ],
)
def test_bad_cells_name_line_and_column(tmp_path, row, words):
    path = write(tmp_path, row + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_unknown_and_missing_columns(tmp_path):
    with pytest.raises(TraceError, match=r"unknown column\(s\) \['price'\]"):
        load_trace(write(tmp_path, "", header="timestamp,market,price,available,on_demand_price\n"))
    with pytest.raises(TraceError, match=r"missing column\(s\) \['on_demand_price'\]"):
        load_trace(write(tmp_path, "", header="timestamp,market,spot_price,available\n"))
    with pytest.raises(TraceError, match=r"column\(s\) \['market'\] given twice"):
        load_trace(write(tmp_path, "", header="timestamp,market,spot_price,available,on_demand_price,market\n"))


def test_empty_file_duplicate_ticks_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="empty file"):
        load_trace(write(tmp_path, "", header=""))
    with pytest.raises(TraceError, match="no data rows"):
        load_trace(write(tmp_path, ""))
    dup = "2025-01-01T00:00:00Z,a,1.0,2,3.0\n2025-01-01T00:00:00Z,a,1.0,2,3.0\n"
    with pytest.raises(TraceError, match="two rows at"):
        load_trace(write(tmp_path, dup))
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.csv")


def test_a_mistyped_year_is_refused_naming_the_span_not_resampled_to_millions_of_slots(tmp_path):
    typo = "0001-01-01T00:00:00Z,a,1.0,2,3.0\n2025-01-01T00:00:00Z,a,1.0,2,3.0\n"
    with pytest.raises(TraceError, match=r"from 0001-01-01T00:00:00Z to 2025-01-01T00:00:00Z, over 3660 days"):
        load_trace(write(tmp_path, typo))
    decade = "2015-01-01T00:00:00Z,a,1.0,2,3.0\n2025-01-01T00:00:00Z,a,1.0,2,3.0\n"
    assert load_trace(write(tmp_path, decade)).tick_seconds > 0  # ten years of history are fine
