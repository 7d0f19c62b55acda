"""The simulator: the no-peeking rule, checked allocations, stopping at completion, job markets."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.market.trace import TraceError
from airflow_provider_spotsched.scheduling.model import Allocation, Job
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import PolicyError, job_market, simulate
from tests.markets import make_job, make_market, whole


class Recorder(Policy):
    """Runs one spot instance in pool 0 when available, else one on-demand; records what it saw."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[int] = []

    def decide(self, observation: Observation) -> Allocation:
        self.seen.append(observation.past.num_slots)
        if observation.available[0] > 0:
            return Allocation((1, 0), 0)
        return Allocation((0, 0), 1)


class Cheater(Policy):
    name = "cheater"

    def decide(self, observation: Observation) -> Allocation:
        return Allocation((5, 0), 0)


class Hindsight(Policy):
    name = "hindsight"
    uses_future = True

    def reveal(self, market: SlotMarket) -> None:
        self.revealed = market.num_slots

    def decide(self, observation: Observation) -> Allocation:
        return Allocation((0, 0), 1)


def market_of(slots: int):
    return make_market([[1.0, 2.0]] * slots, [[1 if t % 2 else 0, 0] for t in range(slots)])


def test_policy_sees_only_the_past_and_the_run_stops_at_completion():
    job = make_job(work=4.0, max_instances=1, deadline_hours=6.0)
    policy = Recorder()
    result = simulate(policy, job, whole(market_of(9)))
    assert policy.seen == [1, 2, 3, 4]
    assert len(result.allocations) == 4 and result.outcome.completion_hours == pytest.approx(4.0)
    # slots alternate on-demand (3.0/h) and spot (1.0/h)
    assert result.outcome.cost == pytest.approx(3 + 1 + 3 + 1)
    data = result.to_dict()
    assert data["slots"][1] == {"slot": 1, "spot": {"pool-0": 1}, "on_demand": 0}
    assert data["policy"] == "recorder" and data["utility"] == pytest.approx(30 - 8)


def test_an_allocation_over_availability_is_refused_with_the_policy_and_slot():
    with pytest.raises(PolicyError, match=r"policy cheater at slot 0: .*exceeds availability"):
        simulate(Cheater(), make_job(), whole(market_of(9)))


def test_only_a_policy_that_declares_it_sees_the_future():
    policy = Hindsight()
    job = make_job(work=4.0, max_instances=1)
    simulate(policy, job, whole(market_of(9)))
    assert policy.revealed == 9


def test_market_shorter_than_the_horizon_is_an_error():
    with pytest.raises(TraceError, match="needs 9"):
        simulate(Recorder(), make_job(), whole(market_of(5)))


def test_job_market_keeps_history_before_submission(gcp_trace):
    first = min(float(p.times[0]) for p in gcp_trace.pools.values())
    from datetime import datetime, timezone

    start = datetime.fromtimestamp(first, timezone.utc) + timedelta(hours=30)
    job = Job.from_dict(
        {"work": 10, "deadline_hours": 12, "max_instances": 2, "throughput": {"alpha": 1}, "value": 50,
         "start": start.isoformat()}
    )
    jm = job_market(gcp_trace, job, lookback_hours=24)
    assert jm.offset == 24 and jm.market.num_slots == 24 + job.horizon_slots
    assert jm.job_slots.start == start
    late = Job.from_dict({**job.to_dict(), "start": "2025-10-18T12:00:00Z"})
    with pytest.raises(TraceError, match="needs 12 slots"):
        job_market(gcp_trace, late)


def test_a_job_pays_the_on_demand_price_in_force_at_submission_whatever_its_history(tmp_path):
    from datetime import datetime, timezone

    from airflow_provider_spotsched.market.trace import load_trace
    from airflow_provider_spotsched.scheduling.policies import make_policy

    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    rows = ["timestamp,market,spot_price,available,on_demand_price"]
    rows += [f"{t0 + timedelta(hours=h):%Y-%m-%dT%H:%M:%SZ},zone-a,1.0,0,{3.0 if h < 120 else 6.0}" for h in range(240)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")  # the on-demand price doubles on day 5
    trace = load_trace(tmp_path / "t.csv")
    job = make_job(work=4.0, deadline_hours=8.0, max_instances=1, start=t0 + timedelta(days=8))
    for lookback in (0.0, 24.0, 168.0):
        jm = job_market(trace, job, lookback_hours=lookback)
        assert jm.market.on_demand_price == 6.0
        assert simulate(make_policy("on-demand"), job, jm).outcome.cost == pytest.approx(24.0)
