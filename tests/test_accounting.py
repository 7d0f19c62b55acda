"""The spec's accounting, checked against examples computed by hand.

Unless a test says otherwise: slots of 1 h, H(n) = n work units per hour, on-demand at 3 USD
per instance-hour, two spot pools at 1 and 2 USD, soft deadline d = 6 h, gamma = 1.5, V0 = 30.
"""

from __future__ import annotations

import numpy as np
import pytest

from airflow_provider_spotsched.scheduling.model import Allocation, Job, JobError, Throughput, evaluate
from tests.markets import make_job

ON_DEMAND = 3.0


def run(job: Job, *allocations: Allocation):
    """The spec's outcome of ``allocations`` on a market of constant prices 1 and 2 USD."""
    prices = np.tile([1.0, 2.0], (len(allocations), 1))
    return evaluate(job, list(allocations), prices, ON_DEMAND)


def od(n: int) -> Allocation:
    return Allocation((0, 0), n)


def spot(a: int, b: int = 0, on_demand: int = 0) -> Allocation:
    return Allocation((a, b), on_demand)


IDLE = Allocation((0, 0), 0)


def test_progress_loses_the_overhead_only_on_reconfiguration_slots():
    job = make_job(work=100.0, reconfig_overhead_hours=0.25)
    slots = run(job, od(2), od(2), spot(2), spot(2)).slots
    assert [s.reconfiguration for s in slots] == [True, False, True, False]
    assert [s.effective_hours for s in slots] == [0.75, 1.0, 0.75, 1.0]
    assert [s.progress for s in slots] == [1.5, 2.0, 1.5, 2.0]
    assert [s.cost for s in slots] == [6.0, 6.0, 2.0, 2.0]  # the lost overhead is billed too


def test_without_overhead_a_reconfiguration_costs_no_progress():
    slots = run(make_job(work=100.0), od(1), spot(1), spot(0, 1)).slots
    assert [s.reconfiguration for s in slots] == [True, True, True]
    assert [s.progress for s in slots] == [1.0, 1.0, 1.0]


def test_a_preemption_is_a_reconfiguration():
    # two spot instances in pool 0, then one is taken back: the vector changed
    slots = run(make_job(work=100.0, reconfig_overhead_hours=0.5), spot(2), spot(1)).slots
    assert slots[1].reconfiguration and slots[1].progress == pytest.approx(0.5 * 1)


def test_pause_then_resume_with_the_same_vector_is_a_reconfiguration():
    slots = run(make_job(work=100.0, reconfig_overhead_hours=0.5), spot(1), IDLE, spot(1)).slots
    assert [s.reconfiguration for s in slots] == [True, False, True]
    assert [s.progress for s in slots] == [0.5, 0.0, 0.5]
    assert slots[1].cost == 0.0 and slots[1].effective_hours == 0.0


def test_the_completion_slot_is_billed_per_second_up_to_completion():
    # 3 units on 2 on-demand: 2 in slot 0, the last unit takes half of slot 1
    outcome = run(make_job(work=3.0), od(2), od(2), od(2))
    assert outcome.completion_hours == pytest.approx(1.5)
    assert outcome.cost == pytest.approx(2 * 3.0 * 1.0 + 2 * 3.0 * 0.5)
    assert len(outcome.slots) == 2  # nothing runs or is billed after T


def test_completion_time_counts_the_overhead_of_the_completion_slot():
    # slot 0: 2 on-demand, e = 0.75, W = 1.5; slot 1: switch to 2 spot (a reconfiguration),
    # T = 1 + 0.25 + (2.5 - 1.5) / 2 = 1.75, billed 0.75 h of 2 spot at 1 USD
    outcome = run(make_job(work=2.5, reconfig_overhead_hours=0.25), od(2), spot(2))
    assert outcome.completion_hours == pytest.approx(1.75)
    assert outcome.cost == pytest.approx(2 * 3.0 * 1.0 + 2 * 1.0 * 0.75)


def test_completion_time_uses_the_throughput_with_its_offset():
    # H(n) = 2n + 1: 3 instances do 7 units/h; 10 units take 1 h + 3/7 h
    job = make_job(work=10.0, max_instances=3, throughput=Throughput(2.0, 1.0))
    outcome = run(job, od(3), od(3))
    assert outcome.completion_hours == pytest.approx(1.0 + 3.0 / 7.0)
    assert outcome.cost == pytest.approx(3 * 3.0 * (1.0 + 3.0 / 7.0))


def test_slots_of_half_an_hour():
    job = make_job(work=3.0, slot_hours=0.5, reconfig_overhead_hours=0.25)
    # slot 0 (a reconfiguration): e = 0.25 h, w = 0.5; slots 1, 2: w = 1.0 each, W = 2.5;
    # slot 3 does the last 0.5 unit in 0.25 h: T = 1.5 + 0.25
    outcome = run(job, od(2), od(2), od(2), od(2))
    assert [s.progress for s in outcome.slots] == [0.5, 1.0, 1.0, 0.5]
    assert outcome.completion_hours == pytest.approx(1.5 + 0.25)
    assert outcome.cost == pytest.approx(2 * 3.0 * 1.75)


def test_value_is_full_up_to_the_soft_deadline_then_decays_linearly_to_the_hard_one():
    job = make_job(deadline_hours=6.0, hard_deadline_factor=1.5, value=30.0)
    assert job.value_at(0.5) == 30.0
    assert job.value_at(6.0) == 30.0
    assert job.value_at(7.5) == pytest.approx(30.0 * (9.0 - 7.5) / (0.5 * 6.0))  # 15
    assert job.value_at(8.4) == pytest.approx(30.0 * 0.6 / 3.0)
    assert job.value_at(9.0) == pytest.approx(0.0)
    assert job.value_at(9.01) == 0.0
    assert job.value_at(None) == 0.0


def test_with_gamma_one_the_value_drops_to_zero_right_after_the_deadline():
    job = make_job(hard_deadline_factor=1.0)
    assert job.value_at(6.0) == 30.0
    assert job.value_at(6.001) == 0.0
    assert job.hard_deadline_hours == 6.0 and job.horizon_slots == 6


def test_utility_is_value_minus_cost_and_misses_follow_the_completion_time():
    job = make_job(work=4.0, max_instances=1, deadline_hours=3.0, hard_deadline_factor=2.0, value=30.0)
    on_time = run(job, *[od(1)] * 4)  # T = 4 > d = 3: a soft miss, not a hard one
    assert on_time.completion_hours == pytest.approx(4.0)
    assert on_time.value == pytest.approx(30.0 * (6.0 - 4.0) / 3.0)
    assert on_time.cost == pytest.approx(12.0)
    assert on_time.utility == pytest.approx(20.0 - 12.0)
    assert on_time.soft_miss and not on_time.hard_miss

    met = run(make_job(work=4.0, max_instances=1, deadline_hours=4.0, value=30.0), *[od(1)] * 4)
    assert met.completion_hours == pytest.approx(4.0) and not met.soft_miss and met.utility == pytest.approx(18.0)

    never = run(job, od(1), IDLE, od(1))  # the job never completes
    assert never.completion_hours is None and never.value == 0.0
    assert never.soft_miss and never.hard_miss and never.utility == pytest.approx(-6.0)


def test_evaluate_refuses_allocations_outside_the_market_or_the_bounds():
    job = make_job(min_instances=2, max_instances=3)
    prices, available = np.array([[1.0, 2.0]]), np.array([[1, 0]])
    with pytest.raises(ValueError, match="exceeds availability"):
        evaluate(job, [spot(2, on_demand=0)], prices, ON_DEMAND, available)
    with pytest.raises(ValueError, match=r"outside \[2, 3\]"):
        evaluate(job, [spot(1)], prices, ON_DEMAND, available)
    with pytest.raises(ValueError, match=r"outside \[2, 3\]"):
        evaluate(job, [spot(1, on_demand=3)], prices, ON_DEMAND, available)
    assert evaluate(job, [spot(1, on_demand=1)], prices, ON_DEMAND, available).slots[0].progress == 2.0


@pytest.mark.parametrize(
    "field, bad",
    [
        ("work", 0.0),
        ("work", float("nan")),
        ("deadline_hours", -1.0),
        ("value", -5.0),
        ("slot_hours", 0.0),
        ("hard_deadline_factor", 0.9),
        ("reconfig_overhead_hours", 1.0),
        ("reconfig_overhead_hours", -0.1),
        ("min_instances", 0),
        ("min_instances", 1.5),
        ("max_instances", True),
    ],
)
def test_an_invalid_field_is_named_in_the_error(field, bad):
    with pytest.raises(JobError, match=field):
        make_job(**{field: bad})


def test_max_below_min_and_bad_throughput_are_named():
    with pytest.raises(JobError, match=r"max_instances=2: must be >= min_instances=3"):
        make_job(min_instances=3, max_instances=2)
    with pytest.raises(JobError, match="throughput.alpha"):
        make_job(throughput=Throughput(0.0, 1.0))
    with pytest.raises(JobError, match="throughput.beta"):
        make_job(throughput=Throughput(1.0, -1.0))


def test_an_infeasible_job_is_refused_with_the_deadline_and_instances_it_needs():
    # 20 units on at most 2 instances of 1 unit/h: 10 h needed, or 4 instances for d = 6 h
    job = make_job(work=20.0, deadline_hours=6.0, max_instances=2)
    with pytest.raises(JobError, match=r"deadline_hours >= 10 or max_instances >= 4"):
        job.check_feasible()
    with_overhead = make_job(work=20.0, deadline_hours=6.0, max_instances=2, reconfig_overhead_hours=0.5)
    with pytest.raises(JobError, match=r"deadline_hours >= 10.5 or max_instances >= 4"):
        with_overhead.check_feasible()
    make_job(work=11.0, reconfig_overhead_hours=0.5).check_feasible()  # (6 - 0.5) * 2 = 11 fits exactly


JOB = {"work": 8, "deadline_hours": 6, "max_instances": 2, "throughput": {"alpha": 1.0, "beta": 0.5}, "value": 30}


def test_job_from_dict_reads_the_spec_json_and_round_trips():
    job = Job.from_dict({**JOB, "start": "2025-10-01T06:00:00Z", "reconfig_overhead_hours": 0.1})
    assert job.throughput == Throughput(1.0, 0.5) and job.start.hour == 6
    assert Job.from_dict(job.to_dict()) == job


@pytest.mark.parametrize(
    "data, message",
    [
        ({**JOB, "deadline": 6}, r"unknown job field\(s\) \['deadline'\]"),
        ({k: v for k, v in JOB.items() if k != "work"}, r"missing required field\(s\) \['work'\]"),
        ({**JOB, "throughput": 2.0}, "throughput=2.0: not an object"),
        ({**JOB, "throughput": {"beta": 1.0}}, "throughput=.*: not an object with alpha"),
        ({**JOB, "throughput": {"alpha": 1.0, "gamma": 2}}, r"unknown throughput field\(s\) \['gamma'\]"),
        ({**JOB, "throughput": {"alpha": -1.0}}, r"throughput.alpha=-1: must be > 0"),
        ({**JOB, "throughput": {"alpha": "fast"}}, "throughput.alpha=.fast.: text, not a number"),
        ({**JOB, "start": "yesterday"}, "start=.yesterday.: not a UTC ISO-8601 timestamp"),
    ],
)
def test_job_from_dict_errors_name_the_problem(data, message):
    with pytest.raises(JobError, match=message):
        Job.from_dict(data)
