"""A run's bill split into spot, on-demand and restarts, checked against sums done by hand.

Market: two spot pools at 1 and 2 USD, on-demand at 3 USD, slots of 1 h; the job runs 2
instances of 1 unit/h each and loses 0.5 h to every restart.
"""

from __future__ import annotations

import pytest

from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.cost_breakdown import cost_breakdown
from tests.markets import make_job, make_market, whole

MARKET = make_market([[1.0, 2.0]] * 9, [[2, 2]] * 9)
# One spot and one on-demand instance for two slots, then one spot instance in each pool.
PLAN = [Allocation((1, 0), 1)] * 2 + [Allocation((1, 1), 0)] * 7


class Scripted(Policy):
    """Runs :data:`PLAN`, one allocation a slot."""

    name = "scripted"

    def decide(self, observation: Observation) -> Allocation:
        return PLAN[observation.slot]


@pytest.mark.parametrize(
    ("work", "spot_cost", "spot_hours"),
    [
        # Work per slot 1, 2 (restart, then not), 1, 2, 2: done at the end of the fifth slot.
        (8.0, 1 + 1 + 3 + 3 + 3, 1 + 1 + 2 + 2 + 2),
        # One unit short of that: the fifth slot is billed for the half hour it needs.
        (7.0, 1 + 1 + 3 + 3 + 1.5, 1 + 1 + 2 + 2 + 1),
    ],
)
def test_bills_split_by_capacity_and_restarts_counted(work: float, spot_cost: float, spot_hours: float) -> None:
    job = make_job(work=work, reconfig_overhead_hours=0.5)
    result = simulate(Scripted(), job, whole(MARKET))
    breakdown = cost_breakdown(result, whole(MARKET))
    assert breakdown.spot_cost == pytest.approx(spot_cost)
    assert breakdown.on_demand_cost == pytest.approx(2 * 3.0)
    assert breakdown.spot_hours == pytest.approx(spot_hours)
    assert breakdown.on_demand_hours == pytest.approx(2.0)
    assert breakdown.restarts == 2  # the first start and the move off on-demand
    assert breakdown.forced_restarts == 0  # both pools offer 2 instances throughout
    assert breakdown.restart_hours == pytest.approx(2 * 2 * 0.5)  # two instances, half an hour, twice
    assert breakdown.cost == pytest.approx(result.outcome.cost)
    assert breakdown.mean_spot_price == pytest.approx(spot_cost / spot_hours)


def test_on_demand_run_has_no_spot_price() -> None:
    job = make_job(reconfig_overhead_hours=0.5)
    result = simulate(make_policy("on-demand"), job, whole(MARKET))
    breakdown = cost_breakdown(result, whole(MARKET))
    assert breakdown.spot_cost == 0 and breakdown.spot_hours == 0
    assert breakdown.mean_spot_price is None
    assert breakdown.restarts == 1
    assert breakdown.cost == pytest.approx(result.outcome.cost)


class SpotFirst(Policy):
    """One instance in pool 0 while it is offered, else in pool 1."""

    name = "spot-first"

    def decide(self, observation: Observation) -> Allocation:
        return Allocation((1, 0), 0) if observation.available[0] > 0 else Allocation((0, 1), 0)


def test_restarts_forced_by_lost_capacity_told_apart() -> None:
    # Pool 0 is gone in slots 2-3 and back from slot 4: the move to pool 1 is forced, the move
    # back (for the cheaper offer) is the policy's choice.
    market = make_market([[1.0, 2.0]] * 9, [[1, 1]] * 2 + [[0, 1]] * 2 + [[1, 1]] * 5)
    job = make_job(work=4.0, max_instances=1, reconfig_overhead_hours=0.5)
    breakdown = cost_breakdown(simulate(SpotFirst(), job, whole(market)), whole(market))
    assert breakdown.restarts == 3
    assert breakdown.forced_restarts == 1
