"""Properties every policy of the registry keeps on random feasible jobs and markets.

Each property runs over every policy the registry names; the no-peeking property runs over
every online one (all but the hindsight optimum, which declares that it reads the future).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from airflow_provider_spotsched.scheduling.model import evaluate
from airflow_provider_spotsched.scheduling.policies import POLICIES, make_policy, policy_class
from airflow_provider_spotsched.scheduling.replay import simulate
from tests.strategies import Scenario, scenarios, shared_prefix

SPEC_POLICIES = {"on-demand", "greedy", "uniform-progress", "prediction-free", "chc", "optimal", "selector"}
DEADLINE_SAFE = ["on-demand", "greedy", "uniform-progress", "prediction-free", "chc", "selector", "skynomad", "up-s", "up-ap"]
ONLINE = sorted(n for n in POLICIES if not getattr(policy_class(n), "uses_future", False))
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=sorted(POLICIES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def run(name: str, scenario: Scenario):
    return simulate(make_policy(name), scenario.job, scenario.job_market)


def fit(name: str, scenario: Scenario) -> Scenario:
    """The scenario for ``name``: a single-instance policy gets the job's one-instance version,
    the same share of what one on-demand instance finishes by the deadline (so still feasible)."""
    job = scenario.job
    if not policy_class(name).single_instance or job.max_instances == 1:
        return scenario
    one = replace(job, min_instances=1, max_instances=1, work=job.work * job.rate(1) / job.rate(job.max_instances))
    return replace(scenario, job=one)


def test_the_registry_lists_every_policy_of_the_spec_and_only_the_optimum_reads_the_future():
    assert SPEC_POLICIES <= set(POLICIES)
    assert set(POLICIES) - set(ONLINE) == {"optimal"}


@PROPERTY
@given(scenario=scenarios())
def test_allocations_respect_every_constraint_and_account_as_the_model_does(name, scenario):
    scenario = fit(name, scenario)
    result = run(name, scenario)
    slots = scenario.job_market.job_slots
    # evaluate() re-checks every allocation against availability and [N_min, N_max] ...
    again = evaluate(scenario.job, result.allocations, slots.spot_price, slots.on_demand_price, slots.available)
    # ... and the spec's numbers follow from the slots alone; nothing is scheduled after T.
    assert again.to_dict() == result.outcome.to_dict()
    assert len(again.slots) == len(result.allocations) <= scenario.job.horizon_slots


@pytest.mark.parametrize("safe", DEADLINE_SAFE)
@PROPERTY
@given(scenario=scenarios())
def test_deadline_safe_policies_never_miss_the_soft_deadline_of_a_feasible_job(safe, scenario):
    scenario = fit(safe, scenario)
    scenario.job.check_feasible()
    outcome = run(safe, scenario).outcome
    assert not outcome.soft_miss, f"{safe} finished at {outcome.completion_hours} after d={scenario.job.deadline_hours}"


@PROPERTY
@given(scenario=scenarios())
def test_no_policy_beats_the_hindsight_optimum(name, scenario):
    scenario = fit(name, scenario)
    best = run("optimal", scenario).outcome.utility
    utility = run(name, scenario).outcome.utility
    assert utility <= best + 1e-6 * max(1.0, abs(best)), f"{name} earned {utility} > optimal {best}"


@pytest.mark.parametrize("online", ONLINE)
@PROPERTY
@given(pair=shared_prefix())
def test_decisions_depend_only_on_the_past(online, pair):
    first, second, shared = pair
    first, second = fit(online, first), fit(online, second)
    a, b = run(online, first), run(online, second)
    assert a.allocations[:shared] == b.allocations[:shared]
