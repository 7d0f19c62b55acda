"""CHC planning on the forecast distribution: a reserve that grows with uncertainty, and safety."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.forecast.series import count_distribution
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.planner import solve_plan
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.chc import CHCPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.scheduling.rules import is_deadline_safe
from tests.markets import make_job, make_market, whole
from tests.strategies import scenarios
from tests.test_chc import trace_case

TOP = 8  # the largest count the hand-made forecasts know


class Spread(Forecaster):
    """Every pool at ``point`` instances for ever, give or take ``width`` (half the 80% interval);
    the price at ``price`` (default: the last one) give or take ``price_width``."""

    name = "spread"

    def __init__(self, point: float, width: float, price: float | None = None, price_width: float = 0.0) -> None:
        self.point, self.width, self.price, self.price_width = point, width, price, price_width

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        shape = (horizon, past.num_pools)
        mean = np.full(horizon, self.point)
        dist = count_distribution(mean, mean - self.width, mean + self.width, TOP)
        price = np.repeat(past.spot_price[-1:], horizon, axis=0) if self.price is None else np.full(shape, self.price)
        return Forecast(
            spot_price=price,
            available=np.full(shape, self.point),
            spot_price_interval=(price - self.price_width, price + self.price_width),
            available_distribution=np.repeat(dist[:, None, :], past.num_pools, axis=1),
        )


def robust(forecaster: Forecaster, level: float = 0.9, **params) -> CHCPolicy:
    policy = CHCPolicy(uncertainty="quantile", level=level, **params)
    policy.forecaster = forecaster
    return policy


def first_observation(market: SlotMarket, **job) -> Observation:
    """Slot 0 of a job on ``market`` with no history: the only slot known is the first."""
    return Observation(make_job(**job), 0, market.window(0, 1), 0, 0.0, 0.0, Allocation.idle(market.num_pools))


# One pool of cheap spot (1 vs 3 USD on-demand): 16 units of work on up to 4 instances in 6 hours.
MARKET = make_market([[1.0]] * 9, [[4]] * 9)
JOB = {"work": 16.0, "max_instances": 4, "value": 100.0}


def planned_instances(policy: CHCPolicy) -> tuple[int, int]:
    """Spot and on-demand instance-slots of the whole first window's plan."""
    plan = solve_plan(policy.window_request(first_observation(MARKET, **JOB)))
    return sum(sum(a.spot) for a in plan.allocations), sum(a.on_demand for a in plan.allocations)


def test_the_reserve_grows_with_the_forecast_uncertainty():
    plans = [planned_instances(robust(Spread(4.0, width), window=6)) for width in (0.0, 1.0, 2.0, 4.0)]
    spot = [s for s, _ in plans]
    on_demand = [o for _, o in plans]
    assert spot == sorted(spot, reverse=True) and spot[-1] < spot[0], plans
    assert on_demand == sorted(on_demand) and on_demand[-1] > on_demand[0], plans
    # The capacity planned on shrinks with the width; the current slot is known and kept whole.
    observation = first_observation(MARKET, **JOB)
    narrow = robust(Spread(4.0, 1.0), window=6).window_request(observation).available
    wide = robust(Spread(4.0, 3.0), window=6).window_request(observation).available
    assert narrow[0, 0] == wide[0, 0] == 4
    assert np.all(wide[1:] <= narrow[1:]) and wide[1:].sum() < narrow[1:].sum()


def test_a_higher_level_keeps_a_larger_reserve():
    forecast = Spread(4.0, 2.0).forecast(MARKET.window(0, 1), 5)
    levels = [forecast.available_at_level(p)[0, 0] for p in (0.2, 0.5, 0.8, 0.95)]
    assert levels == sorted(levels, reverse=True) and levels[-1] < levels[0] <= 4


def test_a_certain_forecast_plans_like_plain_chc():
    certain = Spread(4.0, 0.0)
    plain = CHCPolicy(window=6)
    plain.forecaster = certain
    observation = first_observation(MARKET, **JOB)
    assert np.array_equal(robust(certain, window=6).window_request(observation).available, plain.window_request(observation).available)
    assert planned_instances(robust(certain, window=6)) == planned_instances(plain)


def test_on_a_point_forecast_it_is_plain_chc(gcp_trace):
    # The oracle forecasts without a distribution: nothing is uncertain, so nothing is held back.
    job, market = trace_case(gcp_trace, n_max=4, hours=8.0, slack=1.5, overhead=0.25, days=3.0)
    plain = simulate(make_policy("chc", {"window": 12, "forecaster": "oracle"}), job, market)
    quantile = make_policy("chc", {"window": 12, "forecaster": "oracle", "uncertainty": "quantile", "level": 0.9})
    assert simulate(quantile, job, market).allocations == plain.allocations


def test_spot_held_in_reserve_that_turns_up_is_used():
    # The wide forecast plans on-demand after the first slot; each slot then offers the 4 spot
    # instances the plan doubted, so the commitment is re-planned and runs on spot throughout.
    policy = robust(Spread(4.0, 4.0), window=6, commit=6)
    assert planned_instances(policy)[1] > 0
    result = simulate(policy, make_job(**JOB), whole(MARKET))
    assert not result.outcome.soft_miss
    assert [a.on_demand for a in result.allocations] == [0] * len(result.allocations)
    assert all(a.spot == (4,) for a in result.allocations)


class Checked(CHCPolicy):
    """Quantile CHC that asserts each decision fits the market now and is deadline-safe."""

    def decide(self, observation: Observation) -> Allocation:
        choice = super().decide(observation)
        assert all(s <= a for s, a in zip(choice.spot, observation.available)), (observation.slot, choice)
        assert is_deadline_safe(observation.job, observation, choice), (observation.slot, choice)
        return choice


@pytest.mark.parametrize("forecaster", ["persistence", "markov-count"])
def test_deadline_safe_when_spot_vanishes(forecaster):
    # Spot for three slots, then none: the forecasts promised more, the job must still meet d.
    market = make_market([[1.0, 1.2]] * 9, [[2, 2]] * 3 + [[0, 0]] * 6)
    policy = Checked(window=6, commit=3, forecaster=forecaster, uncertainty="quantile", level=0.9)
    result = simulate(policy, make_job(), whole(market))
    assert not result.outcome.soft_miss
    assert sum(a.on_demand for a in result.allocations) > 0


def test_params_name_the_uncertainty():
    policy = CHCPolicy(forecaster="auto", uncertainty="quantile", level=0.9)
    assert policy.params()["uncertainty"] == "quantile" and policy.params()["level"] == 0.9
    assert "uncertainty" not in CHCPolicy().params()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"uncertainty": "robust"}, "uncertainty must be one of"),
        ({"uncertainty": "quantile"}, "level must be a probability"),
        ({"uncertainty": "quantile", "level": 1.0}, "level must be a probability"),
        ({"uncertainty": "quantile", "level": True}, "level must be a probability"),
        ({"level": 0.9}, "level applies to uncertainty='quantile' only"),
    ],
)
def test_invalid_parameters_name_the_fix(params, message):
    with pytest.raises(ValueError, match=message):
        CHCPolicy(**params)


def test_available_at_level_refuses_a_level_that_is_no_probability():
    forecast = Spread(4.0, 1.0).forecast(MARKET.window(0, 1), 2)
    with pytest.raises(ValueError, match="level must be a probability"):
        forecast.available_at_level(0.0)


def test_the_price_planned_on_rises_with_the_price_interval():
    point = np.full((3, 1), 2.0)
    prices = [
        Forecast(point, np.full((3, 1), 4.0), spot_price_interval=(point - w, point + w)).spot_price_at_level(0.9) for w in (0.0, 0.5, 1.0)
    ]
    assert np.allclose(prices[0], 2.0) and np.allclose(prices[1], 2.5) and np.allclose(prices[2], 3.0)
    assert np.allclose(Forecast(point, np.full((3, 1), 4.0)).spot_price_at_level(0.9), 2.0)


def test_an_uncertain_price_defers_less_work():
    # Spot at 2 USD now, forecast at 1.5 later: plain CHC waits for it; the quantile one, whose
    # 90% price is 1.5 + 1.0 when the forecast is that unsure, runs now.
    market = make_market([[2.0]] * 9, [[4]] * 9)
    observation = first_observation(market, **JOB)

    def first_slot_instances(policy: CHCPolicy) -> int:
        return solve_plan(policy.window_request(observation)).allocations[0].total

    sure = first_slot_instances(robust(Spread(4.0, 0.0, price=1.5), window=6))
    unsure = first_slot_instances(robust(Spread(4.0, 0.0, price=1.5, price_width=1.0), window=6))
    assert unsure > sure


@settings(max_examples=25, deadline=None)
@given(scenario=scenarios())
def test_quantile_chc_never_misses_the_soft_deadline_of_a_feasible_job(scenario):
    # markov-count forecasts a count distribution, so the reserve is in play on random markets.
    scenario.job.check_feasible()
    policy = make_policy("chc", {"window": 6, "forecaster": "markov-count", "uncertainty": "quantile", "level": 0.9})
    result = simulate(policy, scenario.job, scenario.job_market)
    assert not result.outcome.soft_miss, f"finished at {result.outcome.completion_hours} > d={scenario.job.deadline_hours}"
