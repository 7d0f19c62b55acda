"""The ``spotsched`` command line: simulate end to end, and bad input ends in exit 2 with a named cause."""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from airflow_provider_spotsched.cli import BAD_INPUT, main, parse_param, seeded_params
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.trace import COLUMNS, Trace, format_timestamp, load_trace
from airflow_provider_spotsched.scheduling.model import Allocation, Job, evaluate

POOLS = ("us-east4-b", "us-east5-a", "us-west1-b")


def write_slice(trace: Trace, path: Path, days: float, pools: tuple[str, ...] = POOLS) -> Path:
    """The first ``days`` of ``pools`` of ``trace`` as a trace file of the spec's format."""
    end = trace.first_time + days * 86400.0
    lines = [",".join(COLUMNS)]
    for name in pools:
        series = trace.pools[name]
        for i in np.flatnonzero(series.times <= end):
            stamp = format_timestamp(_utc(series.times[i]))
            lines.append(f"{stamp},{name},{series.spot_price[i]},{series.available[i]},{series.on_demand_price[i]}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(float(epoch), timezone.utc)


@pytest.fixture(scope="module")
def gcp_slice(tmp_path_factory, gcp_trace) -> Path:
    return write_slice(gcp_trace, tmp_path_factory.mktemp("trace") / "gcp_slice.csv", days=2)


def job_file(tmp_path: Path, trace: Path, **overrides) -> Path:
    start = _utc(load_trace(trace).first_time) + timedelta(hours=20)
    data = {
        "work": 48.0, "deadline_hours": 12.0, "max_instances": 8, "min_instances": 1,
        "throughput": {"alpha": 1.0, "beta": 0.0}, "value": 200.0, "hard_deadline_factor": 1.5,
        "reconfig_overhead_hours": 0.25, "slot_hours": 1.0, "start": format_timestamp(start),
    }
    data.update(overrides)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("policy", ["on-demand", "greedy"])
def test_simulate_writes_a_result_reproducible_from_its_slots(tmp_path, gcp_slice, policy, capsys):
    job_path, out = job_file(tmp_path, gcp_slice), tmp_path / "result.json"
    rc = main(["simulate", "--trace", str(gcp_slice), "--job", str(job_path), "--policy", policy, "--out", str(out)])
    assert rc == 0
    assert str(out) in capsys.readouterr().out
    result = json.loads(out.read_text())
    for key in ("policy", "slots", "cost", "completion_hours", "value", "utility", "soft_miss", "hard_miss"):
        assert key in result
    job = Job.from_dict(json.loads(job_path.read_text()))
    market = resample(load_trace(gcp_slice), job.start, job.slot_hours, len(result["slots"]))
    allocations = [
        Allocation(tuple(s["spot"].get(pool, 0) for pool in market.pools), s["on_demand"]) for s in result["slots"]
    ]
    assert [s["slot"] for s in result["slots"]] == list(range(len(allocations)))
    again = evaluate(job, allocations, market.spot_price, market.on_demand_price, market.available)
    assert result["cost"] == pytest.approx(again.cost)
    assert result["completion_hours"] == pytest.approx(again.completion_hours)
    assert result["utility"] == pytest.approx(again.utility)
    assert (result["soft_miss"], result["hard_miss"]) == (again.soft_miss, again.hard_miss)


def test_simulate_respects_pools(tmp_path, gcp_slice):
    out = tmp_path / "result.json"
    args = ["simulate", "--trace", str(gcp_slice), "--job", str(job_file(tmp_path, gcp_slice)), "--policy", "greedy",
            "--pools", "us-west1-b", "--out", str(out)]
    assert main(args) == 0
    used = {pool for slot in json.loads(out.read_text())["slots"] for pool in slot["spot"]}
    assert used <= {"us-west1-b"}


def test_params_parse_as_json_else_as_strings():
    assert parse_param("window=24") == ("window", 24)
    assert parse_param("error=0.25") == ("error", 0.25)
    assert parse_param("flag=true") == ("flag", True)
    assert parse_param("pools=[1, 2]") == ("pools", [1, 2])
    assert parse_param("forecaster=seasonal-naive") == ("forecaster", "seasonal-naive")


def test_seed_goes_only_to_policies_that_take_it():
    assert seeded_params("selector", {}, 7) == {"seed": 7}
    assert seeded_params("selector", {"seed": 1}, 7) == {"seed": 1}
    assert seeded_params("greedy", {}, 7) == {}
    assert seeded_params("greedy", {}, None) == {}


def check_bad_input(args: list[str], words: list[str], capsys) -> None:
    assert main(args) == BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err


def simulate_args(tmp_path: Path, trace: Path, job: Path, **options: str) -> list[str]:
    merged = {"--trace": str(trace), "--job": str(job), "--policy": "greedy", "--out": str(tmp_path / "r.json")}
    merged.update(options)
    return ["simulate"] + [item for pair in merged.items() for item in pair]


@pytest.mark.parametrize(
    "text, words",
    [
        (None, ["job.json", "cannot read"]),
        ("{work: 1", ["job.json", "not valid JSON"]),
        ("[1, 2]", ["job.json", "JSON object"]),
        ({"work": None}, ["job.json", "missing", "work"]),
        ({"colour": "red"}, ["job.json", "unknown", "colour"]),
        ({"throughput": {"alpha": 1.0, "gamma": 2}}, ["job.json", "throughput", "gamma"]),
        ({"throughput": {"alpha": "fast"}}, ["job.json", "fast"]),
        ({"max_instances": 0}, ["job.json", "max_instances"]),
        ({"deadline_hours": 3.0}, ["job.json", "infeasible", "deadline_hours"]),
        ({"start": "2030-01-01T00:00:00Z"}, ["2030-01-01", "outside"]),
    ],
)
def test_bad_job_file_exits_2_naming_the_file_and_field(tmp_path, gcp_slice, capsys, text, words):
    job = tmp_path / "job.json"
    if isinstance(text, str):
        job.write_text(text)
    elif isinstance(text, dict):
        data = {**json.loads(job_file(tmp_path, gcp_slice).read_text()), **text}
        job.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    check_bad_input(simulate_args(tmp_path, gcp_slice, job), words, capsys)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "options, words",
    [
        ({"--trace": "nope.csv"}, ["nope.csv", "no such trace file"]),
        ({"--trace": "bad.csv"}, ["bad.csv", "line 2", "spot_price"]),
        ({"--policy": "magic"}, ["unknown policy 'magic'"]),
        ({"--param": "bogus=1"}, ["bogus", "takes no parameter"]),
        ({"--param": "window"}, ["--param", "key=value"]),
        ({"--pools": "mars-1a"}, ["mars-1a", "unknown pool"]),
    ],
)
def test_bad_option_exits_2_naming_the_problem(tmp_path, gcp_slice, capsys, options, words):
    (tmp_path / "bad.csv").write_text(",".join(COLUMNS) + "\n2025-01-01T00:00:00Z,a,cheap,1,3.0\n")
    options = {k: str(tmp_path / v) if k == "--trace" else v for k, v in options.items()}
    check_bad_input(simulate_args(tmp_path, gcp_slice, job_file(tmp_path, gcp_slice), **options), words, capsys)
    assert not (tmp_path / "r.json").exists()


def test_evaluate_rejects_a_trace_too_short_for_the_grid(tmp_path, gcp_trace, capsys):
    short = write_slice(gcp_trace, tmp_path / "short.csv.gz", days=1)
    args = ["evaluate", "--out", str(tmp_path / "out"), "--traces", str(short), "--policies", "on-demand"]
    check_bad_input(args, ["short.csv.gz", "history"], capsys)
