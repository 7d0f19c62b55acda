"""Bad input is refused before anything runs, with one line that names the field and the fix.

Each test here pins one refusal of the reliability issue "bad input gets a clear one-line error":
the job's fields, trace rows and files, a run's pools and instance limit, the operator's arguments
at DAG parse time. tests/test_input_sweep.py throws generated junk at the same entry points.
"""

from __future__ import annotations

import gzip
import json
import logging
from datetime import datetime, timezone
from typing import Any

import boto3
import pytest

from airflow_provider_spotsched.cli import BAD_INPUT, main
from airflow_provider_spotsched.market.aws import AwsSpotMarketSource
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.source import Tick, trace_from_ticks
from airflow_provider_spotsched.market.trace import COLUMNS, TraceError, load_trace
from airflow_provider_spotsched.scheduling.model import Job, JobError, Throughput
from airflow_provider_spotsched.scheduling.online import BudgetError, RunConfig
from tests.markets import make_job
from tests.test_cli_run import run_args, write_job
from tests.test_solver_operator import AT, solve
from tests.test_solver_operator import JOB as SOLVER_JOB

HEADER = ",".join(COLUMNS) + "\n"
JOB = {"work": 8, "deadline_hours": 6, "max_instances": 2, "throughput": {"alpha": 1.0, "beta": 0.0}, "value": 30}


def with_field(name: str, value: Any) -> dict[str, Any]:
    """JOB with one field (``throughput.alpha`` reaches into the throughput) set to ``value``."""
    data = json.loads(json.dumps(JOB))
    if name.startswith("throughput."):
        data["throughput"][name.split(".")[1]] = value
    else:
        data[name] = value
    return data


def hourly_rows(market: str, hours: list[int], on_demand: str = "3.0") -> str:
    return "".join(f"2025-01-{1 + h // 24:02d}T{h % 24:02d}:00:00Z,{market},1.0,2,{on_demand}\n" for h in hours)


# -- the job's fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["work", "deadline_hours", "value", "slot_hours", "hard_deadline_factor", "reconfig_overhead_hours",
     "throughput.alpha", "throughput.beta"],
)
def test_a_boolean_where_a_number_belongs_is_refused(name):
    with pytest.raises(JobError, match=rf"^{name}=True: a boolean, not a number; give a number$"):
        Job.from_dict(with_field(name, True))


@pytest.mark.parametrize(
    ("name", "bad"),
    [("throughput.alpha", float("inf")), ("throughput.alpha", float("nan")),
     ("throughput.beta", float("inf")), ("throughput.beta", float("nan"))],
)
def test_an_infinite_or_nan_throughput_is_refused(name, bad):
    with pytest.raises(JobError, match=rf"^{name}={bad}: not a finite number"):
        Job.from_dict(with_field(name, bad))
    with pytest.raises(JobError, match=rf"^{name}={bad}: not a finite number"):
        alpha, beta = (bad, 0.0) if name.endswith("alpha") else (1.0, bad)
        make_job(throughput=Throughput(alpha, beta))


def test_a_number_in_quotes_is_refused_in_the_throughput_as_everywhere_else():
    with pytest.raises(JobError, match=r"^throughput.alpha='1.5': text, not a number; write the number without quotes$"):
        Job.from_dict(with_field("throughput.alpha", "1.5"))
    with pytest.raises(JobError, match=r"^work='8': text, not a number"):
        Job.from_dict(with_field("work", "8"))


def test_a_slot_longer_than_the_deadline_is_refused():
    with pytest.raises(JobError, match=r"^slot_hours=2: longer than deadline_hours=1.5, .*; use slot_hours <= deadline_hours$"):
        make_job(work=1.0, deadline_hours=1.5, slot_hours=2.0)
    make_job(work=1.0, deadline_hours=2.0, slot_hours=2.0)  # one slot up to the deadline is a job


def test_a_number_too_large_for_a_float_is_refused_not_a_crash():
    with pytest.raises(JobError, match=r"^work=10{36}\.\.\.: not a finite number"):
        Job.from_dict(with_field("work", 10**400))


def test_a_job_of_millions_of_slots_is_refused():
    with pytest.raises(JobError, match=r"^deadline_hours=200000: with slot_hours=1 the job spans 3e\+05 slots"):
        make_job(deadline_hours=2e5)
    with pytest.raises(JobError, match=r"^slot_hours=1e-09: must be >= 0.0166667; a slot lasts a minute or more"):
        make_job(deadline_hours=1e-9, slot_hours=1e-9)  # a week of history before it: 6e14 slots


# -- trace rows and market sources ----------------------------------------------------------------


def test_an_on_demand_price_of_0_in_a_trace_row_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "free.csv"
    path.write_text(HEADER + hourly_rows("a", [0]) + hourly_rows("b", [0, 1], on_demand="0"))
    with pytest.raises(TraceError, match=r"free.csv, line 3, column 'on_demand_price': 0.0 must be > 0: on-demand"):
        load_trace(path)


def test_an_on_demand_price_of_0_from_a_market_source_is_refused_naming_the_market():
    tick = Tick(datetime(2026, 1, 5, tzinfo=timezone.utc).timestamp(), "us-east-1a", 1.0, 2, 0.0)
    with pytest.raises(TraceError, match=r"^aws: tick 'us-east-1a' at 2026-01-05T00:00:00Z: on_demand_price 0.0 must be > 0"):
        trace_from_ticks([tick], "aws")
    client = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with pytest.raises(ValueError, match=r"^on_demand_price 0 must be > 0: on-demand capacity is never free"):
        AwsSpotMarketSource(client, "p3.2xlarge", ["us-east-1a"], 0)


def test_a_long_hole_is_warned_about_naming_the_pool_and_its_span(tmp_path, caplog):
    path = tmp_path / "holey.csv"
    path.write_text(HEADER + hourly_rows("a", list(range(48))) + hourly_rows("b", [h for h in range(48) if not 10 < h < 36]))
    with caplog.at_level(logging.WARNING, "airflow_provider_spotsched"):
        market = resample(load_trace(path), slot_hours=1.0)
    assert market.available[11:37, 1].tolist() == [2] + [0] * 24 + [2]  # counted as unavailable, per the spec
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: pool(s) ['b'] have no ticks from 2025-01-01T10:00:00Z to 2025-01-02T12:00:00Z (26 h, a hole in the "
        "data): their availability counts as 0 in 24 slot(s) of 1 h; fill the hole or schedule outside it"
    ]


def test_the_command_line_prints_the_hole_warning_on_stderr(tmp_path, capsys):
    trace = tmp_path / "holey.csv"
    trace.write_text(HEADER + hourly_rows("a", list(range(48))) + hourly_rows("b", [h for h in range(48) if not 2 < h < 28]))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**JOB, "deadline_hours": 30, "work": 4}))
    assert main(["simulate", "--trace", str(trace), "--job", str(job), "--policy", "greedy",
                 "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"spotsched simulate: warning: {trace}: pool(s) ['b'] have no ticks from")


def test_a_short_hole_is_not_warned_about(gcp_trace, caplog):
    with caplog.at_level(logging.WARNING, "airflow_provider_spotsched"):
        market = resample(gcp_trace, start=datetime(2025, 10, 9, 3, 10, tzinfo=timezone.utc), num_slots=4)
    assert (market.available[2] == 0).all() and not caplog.records  # the shipped trace's 110-minute hole


# -- trace files the sweep found crashing -------------------------------------------------------


def test_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(("\ufeff" + HEADER + hourly_rows("a", [0, 1])).encode("utf-8"))
    assert load_trace(path).names == ["a"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin1.csv", (HEADER + "2025-01-01T00:00:00Z,zone-é,1.0,2,3.0\n").encode("latin-1"),
         r"latin1.csv: not UTF-8 text \(byte \d+\); save the trace as UTF-8 CSV"),
        ("broken.csv.gz", gzip.compress((HEADER + hourly_rows("a", [0, 1])).encode())[:-12],
         r"broken.csv.gz: a damaged gzip file"),
        ("quote.csv", (HEADER + "2025-01-01T00:00:00Z,a,\"1.0\n" + "x" * 140_000).encode(),
         r"quote.csv, line \d+: not CSV"),
    ],
    ids=["latin-1", "truncated-gzip", "unclosed-quote"],
)
def test_an_unreadable_trace_file_is_a_trace_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_gzip_is_recognised_by_content_not_by_name(tmp_path):
    text = HEADER + hourly_rows("a", [0, 1])
    (tmp_path / "plain.csv.gz").write_text(text)
    (tmp_path / "packed.csv").write_bytes(gzip.compress(text.encode()))
    assert load_trace(tmp_path / "plain.csv.gz").names == load_trace(tmp_path / "packed.csv").names == ["a"]


def test_a_directory_is_not_a_trace_file(tmp_path):
    with pytest.raises(TraceError, match=r"not a file; give the trace CSV"):
        load_trace(tmp_path)


@pytest.mark.parametrize("cell", ["1e300", "0001-01-01T00:00:00+01:00"])
def test_a_count_or_a_timestamp_out_of_range_is_a_trace_error(tmp_path, cell):
    row = f"2025-01-01T00:00:00Z,a,1.0,{cell},3.0\n" if cell[0] == "1" else f"{cell},a,1.0,2,3.0\n"
    path = tmp_path / "range.csv"
    path.write_text(HEADER + row)
    with pytest.raises(TraceError, match=r"range.csv, line 2, column '(available|timestamp)'"):
        load_trace(path)



# -- a run's pools --------------------------------------------------------------------------------


def test_a_run_refuses_a_pool_named_twice():
    with pytest.raises(JobError, match=r"^pools=\['a', 'b', 'a'\]: names \['a'\] more than once; name each once$"):
        RunConfig("r", make_job(), ("a", "b", "a"))


def test_a_run_reads_one_string_as_comma_separated_pools_not_as_characters():
    assert RunConfig("r", make_job(), "us-east4-a").pools == ("us-east4-a",)
    assert RunConfig("r", make_job(), " us-east4-a, europe-west1-c").pools == ("us-east4-a", "europe-west1-c")
    with pytest.raises(JobError, match=r"^pools=\"\['us-east4-a'\]\": a list written as text; give the list itself"):
        RunConfig("r", make_job(), "['us-east4-a']")
    with pytest.raises(JobError, match=r"^pools=\['a', ''\]: '' is not a name"):
        RunConfig("r", make_job(), "a,")


def test_the_solver_operator_refuses_a_pool_named_twice_and_reads_a_string():
    with pytest.raises(ValueError, match=r"names \['us-east4-a'\] more than once"):
        solve(job=SOLVER_JOB, pools=["us-east4-a", "us-east4-a"], at=AT)
    _, state = solve(job=SOLVER_JOB, pools="us-east4-a,europe-west1-c", at=AT)
    assert state["run"]["config"]["pools"] == ["us-east4-a", "europe-west1-c"]


def test_a_boolean_budget_is_refused():
    with pytest.raises(BudgetError, match=r"^budget=True: not a number of USD > 0"):
        RunConfig("r", make_job(), ("a",), budget=True)


# -- the instance limit ---------------------------------------------------------------------------


def test_a_job_over_the_instance_limit_is_refused_before_anything_runs():
    huge = make_job(max_instances=10**12)
    message = r"^max_instances=1000000000000: more than the limit of 1024 instances; lower max_instances"
    with pytest.raises(JobError, match=message):
        huge.check_feasible()
    with pytest.raises(JobError, match=message):
        RunConfig("r", huge, ("a",), policy="on-demand")
    assert RunConfig("r", make_job(max_instances=2000), ("a",), max_instances_limit=2048).max_instances_limit == 2048
    for bad in (0, True):
        with pytest.raises(JobError, match=rf"^max_instances_limit={bad}: "):
            RunConfig("r", make_job(), ("a",), max_instances_limit=bad)


@pytest.mark.parametrize(("max_instances", "options"), [(10**12, []), (8, ["--max-instances-limit", "4"])])
def test_the_command_line_refuses_a_job_over_the_instance_limit(tmp_path, capsys, max_instances, options):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + hourly_rows("a", list(range(48))))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**JOB, "max_instances": max_instances, "deadline_hours": 30}))
    args = ["simulate", "--trace", str(trace), "--job", str(job), "--policy", "on-demand", "--out", str(tmp_path / "r.json")]
    assert main(args + options) == BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"job.json: max_instances={max_instances}: more than the limit of" in err[0]
    assert not (tmp_path / "r.json").exists()


def test_the_command_line_refuses_more_than_one_instance_for_a_single_instance_policy(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + hourly_rows("a", list(range(48))))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**JOB, "max_instances": 2, "deadline_hours": 30}))
    args = ["simulate", "--trace", str(trace), "--job", str(job), "--policy", "skynomad", "--out", str(tmp_path / "r.json")]
    assert main(args) == BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "job.json: max_instances=2: --policy skynomad runs a single instance" in err[0]
    assert not (tmp_path / "r.json").exists()


# -- spotsched run ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forecaster", "message"),
    [("oracle", "forecaster='oracle': needs the future market"), ("crystal-ball", "unknown forecaster 'crystal-ball'")],
)
def test_run_refuses_a_forecaster_it_cannot_log_before_anything_launches(tmp_path, capsys, forecaster, message):
    assert main(run_args(tmp_path, write_job(tmp_path), "--forecaster", forecaster)) == BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"spotsched run: error: {message}")
    assert not (tmp_path / "work" / "jobs").exists() or not any((tmp_path / "work" / "jobs").iterdir())


# -- what the sweep (tests/test_input_sweep.py) found -------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_instances": 10**400, "max_instances": 10**400}, r"^min_instances=10{36}\.\.\.: too large to count instances"),
        ({"throughput": {"alpha": 1e308}, "max_instances": 4}, r"^throughput.alpha=1e\+308: H\(max_instances=4\) overflows"),
        ({"start": "0001-01-01T00:00:00+01:00"}, r"^start='0001-01-01T00:00:00\+01:00': not a UTC ISO-8601 timestamp"),
        ({"hard_deadline_factor": 1e308}, r"^deadline_hours=6: with slot_hours=1 the job spans inf slots"),
    ],
)
def test_numbers_at_the_edge_of_floats_are_refused_not_crashed_on(fields, message):
    with pytest.raises(JobError, match=message):
        Job.from_dict({**JOB, **fields})


def test_an_infeasible_job_whose_missing_instances_overflow_still_names_the_deadline():
    job = make_job(work=1e308, deadline_hours=0.26, slot_hours=0.26, reconfig_overhead_hours=0.25)
    with pytest.raises(JobError, match=r"job is infeasible: .* set deadline_hours >= 5e\+307$"):
        job.check_feasible()
