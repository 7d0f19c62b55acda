"""The hindsight optimum on real trace windows: exact, and beaten by nothing we can enumerate."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput, evaluate
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.optimal import OptimalPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.replay import job_market, simulate
from airflow_provider_spotsched.scheduling.rules import cheapest_allocation, on_demand_fallback
from tests.markets import make_job, make_market, whole


def trace_job(trace, n_max: int, hours: float, slack: float, overhead: float, days: float) -> Job:
    """N_max instances' work for ``hours``, value 1.3 x its on-demand cost, ``days`` into the trace."""
    start = datetime.fromtimestamp(trace.first_time, timezone.utc) + timedelta(days=days)
    return Job(
        work=n_max * hours,
        deadline_hours=slack * (hours + overhead),
        max_instances=n_max,
        throughput=Throughput(1.0, 0.0),
        value=1.0,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=overhead,
        start=start,
    )


@pytest.fixture(scope="module")
def gcp_case(gcp_trace):
    draft = trace_job(gcp_trace, n_max=4, hours=8.0, slack=1.5, overhead=0.25, days=3.0)
    market = job_market(gcp_trace, draft)
    job = replace(draft, value=1.3 * 4 * 8.25 * market.market.on_demand_price)
    return job, market


def test_optimal_replays_its_proven_plan_and_its_accounting_matches(gcp_case):
    job, market = gcp_case
    policy = OptimalPolicy()
    result = simulate(policy, job, market)
    assert policy.plan.proven_optimal
    assert result.outcome.utility == pytest.approx(-policy.plan.objective, abs=1e-6)
    assert not result.outcome.soft_miss


def test_no_baseline_beats_the_optimum(gcp_case):
    job, market = gcp_case
    best = simulate(make_policy("optimal"), job, market).outcome.utility
    for name in ("on-demand", "greedy", "uniform-progress", "prediction-free"):
        assert simulate(make_policy(name), job, market).outcome.utility <= best + 1e-9, name


def test_no_single_slot_change_beats_the_optimum(gcp_case):
    job, market = gcp_case
    slots = market.job_slots
    plan = simulate(make_policy("optimal"), job, market).allocations
    plan = plan + [Allocation.idle(slots.num_pools)] * (job.horizon_slots - len(plan))
    best = evaluate(job, plan, slots.spot_price, slots.on_demand_price, slots.available).utility
    for t in range(job.horizon_slots):
        options = [Allocation.idle(slots.num_pools), on_demand_fallback(job, slots.num_pools)]
        options += [
            cheapest_allocation(n, slots.spot_price[t], slots.available[t], slots.on_demand_price)
            for n in range(job.min_instances, job.max_instances + 1)
        ]
        for option in options:
            changed = plan[:t] + [option] + plan[t + 1 :]
            utility = evaluate(job, changed, slots.spot_price, slots.on_demand_price, slots.available).utility
            assert utility <= best + 1e-9, (t, option)


def test_optimal_waits_for_spot_and_idles_after_completion():
    job = make_job()
    market = make_market([[1.0, 1.0]] * 9, [[0, 0]] * 2 + [[2, 2]] * 7)
    policy = OptimalPolicy()
    result = simulate(policy, job, whole(market))
    assert result.allocations[:2] == [Allocation.idle(2)] * 2
    assert result.outcome.cost == pytest.approx(8.0)
    late = Observation(job, 8, market.prefix(9), 0, job.work, 8.0, Allocation((2, 0), 0))
    assert policy.decide(late) == Allocation.idle(2)


def test_optimal_needs_the_revealed_market():
    job = make_job()
    policy = OptimalPolicy()
    assert policy.uses_future and policy.name == "optimal"
    policy.reset(job)
    first = Observation(job, 0, make_market([[1.0]], [[1]]), 0, 0.0, 0.0, Allocation.idle(1))
    with pytest.raises(ValueError, match="reveal"):
        policy.decide(first)
