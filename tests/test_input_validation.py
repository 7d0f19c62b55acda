"""Bad input is refused before anything runs, with one line that names the field and the fix.

Each test here pins one refusal of the reliability issue "bad input gets a clear one-line error":
the job's fields, trace rows and files, a run's pools and instance limit, the operator's arguments
at DAG parse time. tests/test_input_sweep.py throws generated junk at the same entry points.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_provider_spotsched.market.trace import COLUMNS
from airflow_provider_spotsched.scheduling.model import Job, JobError, Throughput
from tests.markets import make_job

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
    with pytest.raises(JobError, match=r"^deadline_hours=100: with slot_hours=0.0001 the job spans 1.5e\+06 slots"):
        make_job(deadline_hours=100.0, slot_hours=1e-4)


