"""Committed horizon control: valid and deadline-safe decisions, and the optimum on a perfect forecast."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from airflow_provider_spotsched.forecast.persistence import PersistenceForecaster
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.chc import DEFAULT_EARLY_PREFERENCE, CHCPolicy, supply_curve
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.replay import job_market, simulate
from airflow_provider_spotsched.scheduling.rules import is_deadline_safe
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from tests.markets import make_job, make_market, whole


class Checked(CHCPolicy):
    """CHC that asserts each of its decisions fits the market now and is deadline-safe."""

    def decide(self, observation: Observation) -> Allocation:
        choice = super().decide(observation)
        assert all(s <= a for s, a in zip(choice.spot, observation.available)), (observation.slot, choice)
        assert is_deadline_safe(observation.job, observation, choice), (observation.slot, choice)
        return choice


def trace_case(trace, n_max: int, hours: float, slack: float, overhead: float, days: float, gamma: float = 1.5):
    start = datetime.fromtimestamp(trace.first_time, timezone.utc) + timedelta(days=days)
    draft = Job(
        work=n_max * hours,
        deadline_hours=slack * (hours + overhead),
        max_instances=n_max,
        throughput=Throughput(1.0, 0.0),
        value=1.0,
        hard_deadline_factor=gamma,
        reconfig_overhead_hours=overhead,
        start=start,
    )
    market = job_market(trace, draft)
    return replace(draft, value=1.3 * n_max * (hours + overhead) * market.market.on_demand_price), market


@pytest.mark.parametrize(
    "trace_name, forecaster, error",
    [("aws", "seasonal-naive", 0.0), ("aws", "oracle", 0.5), ("gcp", "persistence", 0.0), ("gcp", "oracle", 0.25)],
)
def test_decisions_fit_the_market_and_are_deadline_safe(request, trace_name, forecaster, error):
    trace = request.getfixturevalue(f"{trace_name}_trace")
    job, market = trace_case(trace, n_max=4, hours=12.0, slack=1.25, overhead=0.25, days=4.0)
    params = {"error": error, "seed": 1} if forecaster == "oracle" else {}
    policy = Checked(window=12, commit=3, forecaster=forecaster, **params)
    result = simulate(policy, job, market)
    assert not result.outcome.soft_miss
    assert result.outcome.cost <= simulate(make_policy("on-demand"), job, market).outcome.cost + 1e-9


@pytest.mark.parametrize("commit", [1, 4])
@pytest.mark.parametrize("trace_name, days", [("aws", 10.0), ("gcp", 2.0), ("gcp", 7.0)])
def test_perfect_forecast_over_the_whole_horizon_matches_the_optimum(request, trace_name, days, commit):
    # No overhead and no value after d: the optimum then never leaves the deadline-safe region,
    # so CHC (which must stay in it) can reach it, and re-planning on the truth keeps it there.
    # Without the tie-break CHC plans on the forecast as it is; with it, later spot is planned
    # dearer by at most early_preference per slot, so the plan pays at most that share more.
    trace = request.getfixturevalue(f"{trace_name}_trace")
    job, market = trace_case(trace, n_max=4, hours=10.0, slack=1.5, overhead=0.0, days=days, gamma=1.0)
    optimal = simulate(make_policy("optimal"), job, market).outcome
    params = {"window": job.horizon_slots, "commit": commit, "forecaster": "oracle"}
    exact = simulate(make_policy("chc", {**params, "early_preference": 0.0}), job, market).outcome
    assert exact.utility == pytest.approx(optimal.utility, abs=1e-6)
    tie_broken = simulate(make_policy("chc", params), job, market).outcome
    ramp = DEFAULT_EARLY_PREFERENCE * job.horizon_slots
    assert optimal.utility - ramp * optimal.cost - 1e-6 <= tie_broken.utility <= optimal.utility + 1e-6


@pytest.mark.parametrize("window", [4, 10])
def test_at_equal_forecast_cost_spot_work_runs_now(window):
    # Two pools at one flat price, twice the slack the job needs: every schedule on spot costs
    # the same under persistence. The tie-break runs both instances from slot 0 (done in 4 h,
    # leaving 12 h of slack for surprises); planned on the forecast as it is, the plan takes
    # one instance and spends the slack.
    market = make_market([[1.0, 1.0]] * 30, [[1, 1]] * 30)
    job = make_job(work=8.0, deadline_hours=16.0, max_instances=2)
    params = {"window": window, "commit": 1, "forecaster": "persistence"}
    early = simulate(make_policy("chc", params), job, whole(market))
    assert [a.total for a in early.allocations] == [2, 2, 2, 2]
    assert early.outcome.cost == pytest.approx(8.0)
    flat = simulate(make_policy("chc", {**params, "early_preference": 0.0}), job, whole(market))
    assert flat.outcome.cost == pytest.approx(8.0)
    assert flat.outcome.completion_hours > early.outcome.completion_hours


def test_a_broken_commitment_is_replanned_at_once():
    # Persistence promises pool 0 for ever; it vanishes at slot 1, while 2 slots are committed.
    market = make_market([[1.0, 2.0]] * 9, [[2, 2], [0, 2], [0, 2], [0, 2]] + [[2, 2]] * 5)
    result = simulate(Checked(window=4, commit=2, forecaster="persistence"), make_job(), whole(market))
    assert result.allocations[0].spot[0] > 0
    assert result.allocations[1].spot[0] == 0


def test_oracle_makes_chc_use_the_future_and_reset_repeats_a_run():
    market = make_market([[1.0], [3.0], [0.5], [0.5], [0.5], [0.5], [2.0], [2.0], [2.0]], [[2]] * 9)
    policy = make_policy("chc", {"window": 3, "commit": 1, "forecaster": "oracle"})
    assert policy.uses_future
    first = simulate(policy, make_job(), whole(market))
    again = simulate(policy, make_job(), whole(market))
    assert first.allocations == again.allocations
    assert not make_policy("chc").uses_future


def test_the_forecasters_daily_season_is_a_day_of_the_jobs_slots():
    """Seasonal naive's default 24 slots are a day of hourly slots only; a forecaster a caller put
    in CHC's place (the solver operator's given forecasts) is kept."""
    policy = CHCPolicy(forecaster="seasonal-naive")
    hourly = policy.forecaster
    policy.reset(make_job())
    assert policy.forecaster is hourly and hourly.params()["season_slots"] == 24
    policy.reset(make_job(slot_hours=0.5))
    assert policy.forecaster.params()["season_slots"] == 48
    policy.reset(make_job())
    assert policy.forecaster.params()["season_slots"] == 24
    given = PersistenceForecaster()
    policy.forecaster = given
    policy.reset(make_job(slot_hours=0.5))
    assert policy.forecaster is given


def test_the_forecasters_refits_and_choices_are_a_day_and_a_week_of_the_jobs_slots():
    policy = CHCPolicy(forecaster="auto")
    policy.reset(make_job(slot_hours=0.25))
    params = policy.forecaster.params()
    assert (params["refit_every"], params["reselect_every"], params["origins"]) == (96, 672, 576)
    policy.reset(make_job())
    assert policy.forecaster.params() == CHCPolicy(forecaster="auto").forecaster.params()  # hourly: as before


def test_params_and_label():
    policy = CHCPolicy(window=12, commit=2, forecaster="oracle", error=0.1, seed=3, terminal_price=1.5)
    assert policy.params() == {
        "window": 12, "commit": 2, "forecaster": "oracle", "error": 0.1, "seed": 3, "terminal_price": 1.5
    }
    assert CHCPolicy().label == "chc(window=24,commit=4,forecaster=seasonal-naive,terminal_price=marginal)"
    assert CHCPolicy(early_preference=0.0).params()["early_preference"] == 0.0
    assert CHCPolicy(forecaster="persistence").defer_on_demand and not CHCPolicy(forecaster="oracle").defer_on_demand
    assert CHCPolicy(forecaster="oracle", defer_on_demand=True).params()["defer_on_demand"] is True
    narrowed = CHCPolicy(forecaster="oracle", lead=1, reveals="drops").params()
    assert (narrowed["lead"], narrowed["reveals"]) == (1, "drops") and "lead" not in CHCPolicy(forecaster="oracle").params()


@pytest.mark.parametrize("window", [4, 24])
def test_on_demand_waits_while_the_job_keeps_pace(window):
    # Spot vanishes for slots 4-6 with the job ahead of the line L*t/d: persistence says it never
    # comes back, and every on-demand schedule then costs the same. CHC pauses instead of buying
    # on-demand now, and resumes on spot when it returns, still on time.
    market = make_market([[1.0]] * 30, [[1]] * 4 + [[0]] * 3 + [[1]] * 23)
    job = make_job(work=8.0, deadline_hours=16.0, max_instances=1)
    params = {"window": window, "commit": 1, "forecaster": "persistence"}
    waited = simulate(make_policy("chc", params), job, whole(market))
    assert [a.total for a in waited.allocations[4:7]] == [0, 0, 0]
    assert not any(a.on_demand for a in waited.allocations)
    assert waited.outcome.cost == pytest.approx(8.0) and not waited.outcome.soft_miss
    eager = simulate(make_policy("chc", {**params, "defer_on_demand": False}), job, whole(market))
    assert [a.on_demand for a in eager.allocations[4:7]] == [1, 1, 1]
    assert eager.outcome.cost == pytest.approx(14.0)


class ForeseesPoolZeroGone(PersistenceForecaster):
    """Persistence, except that pool 0 is always about to lose its capacity: a wrong forecast."""

    def forecast(self, past, horizon):
        forecast = super().forecast(past, horizon)
        forecast.available[:, 0] = 0.0
        return forecast


def test_a_restart_the_forecast_puts_later_is_not_made_now():
    # The job starts in pool 0 (pool 1 has nothing in slot 0). From then on the forecast says
    # pool 0 is gone next slot, and pool 1 costs the same: moving now or next slot cost the same
    # on the forecast. CHC keeps pool 0 each slot, the drop never comes, and the job never
    # restarts. Without the tie-break (early_preference 0) it moved at once and paid the restart.
    market = make_market([[1.0, 1.0]] * 14, [[1, 0]] + [[1, 1]] * 13)
    job = make_job(work=6.0, deadline_hours=9.0, max_instances=1, reconfig_overhead_hours=0.5)
    results = {}
    for early_preference in (DEFAULT_EARLY_PREFERENCE, 0.0):
        policy = CHCPolicy(window=4, commit=1, forecaster="persistence", early_preference=early_preference)
        policy.forecaster = ForeseesPoolZeroGone()
        results[early_preference] = simulate(policy, job, whole(market))
    kept = results[DEFAULT_EARLY_PREFERENCE]
    assert [a.spot for a in kept.allocations] == [(1, 0)] * 7
    assert kept.outcome.cost == pytest.approx(6.5) and kept.outcome.completion_hours == pytest.approx(6.5)
    moved = results[0.0]
    assert moved.allocations[1].spot == (0, 1)
    assert moved.outcome.cost == pytest.approx(7.0) and moved.outcome.completion_hours == pytest.approx(7.0)


class NoisyPersistence(PersistenceForecaster):
    """Persistence with each pool's price off by ``noise[m]``: a fit's float noise, which
    differs between CPUs."""

    def __init__(self, noise):
        self.noise = np.asarray(noise, dtype=float)

    def forecast(self, past, horizon):
        forecast = super().forecast(past, horizon)
        return replace(forecast, spot_price=forecast.spot_price + self.noise)


def test_float_noise_in_forecast_prices_does_not_choose_between_zones_at_one_price():
    # Two zones at one price; the noise of a fit (1e-10 USD) makes one or the other cheaper.
    # The plan must not follow it: every noise gives the noiseless schedule.
    market = make_market([[1.0, 1.0, 2.0]] * 14, [[2, 2, 2]] * 14)
    job = make_job(work=12.0, deadline_hours=9.0, max_instances=2, reconfig_overhead_hours=0.25)
    schedules = []
    for noise in ([0.0, 0.0, 0.0], [1e-10, -1e-10, 0.0], [-1e-10, 1e-10, 0.0], [3e-11, -2e-10, 1e-10]):
        policy = CHCPolicy(window=6, commit=1, forecaster="persistence")
        policy.forecaster = NoisyPersistence(noise)
        schedules.append([a.spot for a in simulate(policy, job, whole(market)).allocations])
    assert schedules[1:] == [schedules[0]] * 3
    assert set(schedules[0]) == {(2, 0, 0)}


def test_on_demand_still_runs_when_the_job_falls_behind():
    # No spot at all: the job can keep pace only on on-demand, so it does not wait, and it meets
    # the deadline.
    market = make_market([[1.0]] * 30, [[0]] * 30)
    job = make_job(work=8.0, deadline_hours=10.0, max_instances=1)
    result = simulate(make_policy("chc", {"window": 6, "commit": 1, "forecaster": "persistence"}), job, whole(market))
    assert not result.outcome.soft_miss
    done = 0.0
    for t, allocation in enumerate(result.allocations):
        done += allocation.total
        assert done >= min(8.0 * t / 10.0, 8.0) - 1e-9  # never a slot behind the line


@pytest.mark.parametrize(
    "params, message",
    [
        ({"window": 0}, "window"),
        ({"window": 4, "commit": 5}, "commit"),
        ({"terminal_price": "cheap"}, "terminal_price"),
        ({"terminal_price": -1.0}, "terminal_price"),
        ({"forecaster": "persistence", "error": 0.1}, "oracle"),
        ({"forecaster": "persistence", "lead": 1}, "oracle"),
        ({"forecaster": "persistence", "reveals": "drops"}, "oracle"),
        ({"forecaster": "oracle", "lead": -1}, "lead"),
        ({"early_preference": -0.001}, "early_preference"),
        ({"early_preference": 0.5}, "early_preference"),
        ({"early_preference": True}, "early_preference"),
        ({"defer_on_demand": "yes"}, "defer_on_demand"),
    ],
)
def test_invalid_parameters_name_the_fix(params, message):
    with pytest.raises(ValueError, match=message):
        CHCPolicy(**params)


def test_supply_curve_offers_n_max_instances_per_slot_cheapest_first():
    job = make_job(throughput=Throughput(1.0, 0.5))
    price, work = supply_curve(job, np.array([[1.0, 2.0], [5.0, 1.5]]), np.array([[1.0, 0.0], [3.0, 1.0]]), 3.0)
    # slot 0: pool 0 ($1) then on-demand ($3); slot 1: pool 1 ($1.5) then pool 0 ($5 > $3 skipped: on-demand)
    assert np.allclose(work, [1.5, 1.0, 1.5, 1.0])
    assert np.allclose(price, [1.0 / 1.5, 3.0, 1.5 / 1.5, 3.0])


@pytest.mark.parametrize("spot_price", [0.0, 1.0])
def test_an_instance_that_adds_no_work_alone_prices_no_terminal_work(spot_price):
    """H(1) = 0 (beta = -alpha: one instance alone does nothing) gave its units a price of 0/0 or
    1/0; a job running behind its plan then planned on a NaN terminal price and CHC raised."""
    job = make_job(work=11.0, deadline_hours=12.0, min_instances=2, max_instances=3, throughput=Throughput(0.5, -0.5),
                   hard_deadline_factor=2.0)
    unit_price, unit_work = supply_curve(job, np.array([[spot_price]]), np.array([[3]]), 3.0)
    assert unit_price[0] == np.inf and unit_work[0] == 0.0 and np.isfinite(unit_price[1:]).all()
    market = make_market([[spot_price]] * job.horizon_slots, [[3]] * job.horizon_slots, 3.0)
    result = simulate(make_policy("chc", {"forecaster": "persistence", "window": 6, "commit": 2}), job, whole(market),
                      TrueThroughput(0.9))  # 10% slower than declared: behind the plan all along
    assert result.outcome.completion_hours is not None
