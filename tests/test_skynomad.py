"""SkyNomad and its multi-region Uniform Progress baselines UP(S) and UP(AP), ported from its artifact."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest

from airflow_provider_spotsched.market.slots import cloud_region
from airflow_provider_spotsched.scheduling.model import Allocation, JobError
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.spot_lifetime import PoolLifetime
from airflow_provider_spotsched.scheduling.policies.uniform_progress_multi import running_pool
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.evaluation import DEFAULT_POLICIES, PEERS, POLICY_SPECS, Evaluation, GridConfig
from airflow_provider_spotsched.simulation.report import summary_markdown
from tests.markets import make_job, make_market, whole

SLOTS = 40


def single(**overrides):
    """One instance of 1 unit/h: 10 units of work by a 16 h deadline."""
    return make_job(**{"work": 10.0, "deadline_hours": 16.0, "max_instances": 1, "value": 60.0, **overrides})


def market(prices: list[float], available: list[list[int]], on_demand: float = 3.0, pools: list[str] | None = None):
    """Constant prices; per-slot availability rows, the last row repeated to SLOTS slots."""
    rows = available + [available[-1]] * (SLOTS - len(available))
    made = make_market([prices] * SLOTS, rows, on_demand)
    return replace(made, pools=tuple(pools)) if pools else made


def pools_used(result) -> list[int | None | str]:
    return ["od" if a.on_demand else running_pool(a) for a in result.allocations]


@pytest.mark.parametrize("name", PEERS)
def test_the_registry_builds_each_and_the_evaluation_runs_them_on_single_instance_jobs_only(name):
    policy = make_policy(name)
    assert policy.name == name and policy.single_instance
    spec = POLICY_SPECS[name]
    assert spec.runs_on(1) and not spec.runs_on(4)
    assert POLICY_SPECS["greedy"].runs_on(4)
    assert name in DEFAULT_POLICIES  # the default grid runs them on its N_max = 1 cells


def test_the_summary_says_which_policies_ran_on_single_instance_scenarios_only():
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    mixed = summary_markdown(Evaluation(GridConfig(n_max=(1, 4), policies=("on-demand", "skynomad")), []), "cmd", when, "numerics")
    assert "`skynomad` run a single instance" in mixed and "N_max = 1 scenarios only" in mixed
    only_one = summary_markdown(Evaluation(GridConfig(n_max=(1,), policies=("on-demand", "skynomad")), []), "cmd", when, "numerics")
    assert "single instance" not in only_one


@pytest.mark.parametrize("name", PEERS)
def test_each_refuses_a_job_of_more_than_one_instance_naming_the_field_and_the_fix(name):
    with pytest.raises(JobError, match=r"max_instances=2: .* single instance.*set max_instances=1"):
        simulate(make_policy(name), single(max_instances=2), whole(market([1.0], [[1]])))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_prediction_hours": 0}, "max_prediction_hours=0: must be > 0 hours; the artifact's default is 2.0"),
        ({"progress_window_hours": -1.0}, "progress_window_hours=-1.0: must be > 0"),
        ({"voi_delta_base": -0.5}, "voi_delta_base=-0.5: a switching margin must be >= 0"),
        ({"voi_k_v": "0.05"}, "voi_k_v='0.05': text, not a number"),
        ({"probe_interval": 6}, "takes no parameter"),
        ({"observe": "all"}, "observe='all': choose 'every-pool' or 'launches-and-probes'"),
        ({"probe_interval_slots": 0}, "probe_interval_slots=0: give a whole number of slots >= 1"),
    ],
)
def test_skynomad_refuses_bad_parameters_naming_them(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_policy("skynomad", params)


def test_skynomad_labels_only_parameters_off_the_artifacts_defaults():
    assert make_policy("skynomad").label == "skynomad"
    assert make_policy("skynomad", {"voi_delta_base": 0.0}).label == "skynomad(voi_delta_base=0.0)"


@pytest.mark.parametrize(("name", "params"), [(name, {}) for name in PEERS] + [("skynomad", {"observe": "launches-and-probes"})])
@pytest.mark.parametrize("overhead", [0.0, 0.25])
def test_each_meets_the_deadline_when_every_pool_s_spot_vanishes(name, params, overhead):
    # Spot in both pools for 3 slots, then none: the job must finish on on-demand by d.
    job = single(reconfig_overhead_hours=overhead, deadline_hours=12.0)
    result = simulate(make_policy(name, params), job, whole(market([1.0, 1.2], [[1, 1]] * 3 + [[0, 0]])))
    assert not result.outcome.soft_miss and result.outcome.completion_hours <= job.deadline_hours
    assert result.allocations[0] == Allocation((1, 0), 0)
    assert "od" in pools_used(result)


@pytest.mark.parametrize("name", PEERS)
def test_each_takes_the_cheapest_pool_on_offer(name):
    result = simulate(make_policy(name), single(), whole(market([2.0, 1.0, 1.5], [[1, 1, 1]])))
    assert set(pools_used(result)) == {1}
    assert not result.outcome.soft_miss


def test_up_s_fails_over_away_from_the_region_that_preempted_it():
    # Preempted in us-east-1a: the cheaper us-east-1b shares its region, so UP(S) moves to us-west-2a.
    zones = ["us-east-1a", "us-east-1b", "us-west-2a"]
    spots = market([1.0, 1.1, 1.5], [[1, 1, 1]] * 2 + [[0, 1, 1]], pools=zones)
    assert pools_used(simulate(make_policy("up-s"), single(), whole(spots)))[:4] == [0, 0, 2, 2]
    assert pools_used(simulate(make_policy("up-ap"), single(), whole(spots)))[:4] == [0, 0, 1, 1]


def test_cloud_region_reads_gcp_and_aws_zone_names():
    assert cloud_region("us-central1-a") == "us-central1"
    assert cloud_region("europe-west4-b") == "europe-west4"
    assert cloud_region("us-east-1a") == "us-east-1"
    assert cloud_region("pool-0") == "pool-0"


def test_up_ap_moves_once_the_running_pool_scores_under_nine_tenths_of_the_best():
    # Pool 1 is half the price and on offer from slot 1. Its samples (launch attempt and probe at
    # slot 0 failed, then one probe a slot) give it 0/2, 1/3, 2/4, 3/5 successes: 0, 0.67, 1.0,
    # 1.2 per dollar at slots 1-4, against pool 0's 1.0 (every sample a success). It moves at slot
    # 4, the first time 1.0 < 0.9 x the best.
    spots = market([1.0, 0.5], [[1, 0], [1, 1]])
    assert pools_used(simulate(make_policy("up-ap"), single(), whole(spots)))[:6] == [0, 0, 0, 0, 1, 1]
    assert pools_used(simulate(make_policy("up-s"), single(), whole(spots)))[:6] == [0] * 6


@pytest.mark.parametrize(("price", "moves"), [(0.05, True), (0.95, False)])
def test_skynomad_migrates_only_when_the_gain_beats_its_value_of_information_margin(price, moves):
    # A cheaper pool appears at slot 2; moving costs a restart and must beat 0.5 + 0.05 V USD/h.
    spots = market([1.0, price], [[1, 0]] * 2 + [[1, 1]])
    used = pools_used(simulate(make_policy("skynomad", {"voi_delta_base": 0.5}), single(reconfig_overhead_hours=0.1), whole(spots)))
    assert used[:2] == [0, 0]
    assert (used[2] == 1) is moves


@pytest.mark.parametrize(("price", "after"), [(1.05, [1, 1, 1]), (1.4, [None, None, 0])])
def test_skynomad_after_a_preemption_takes_the_other_pool_only_if_progress_is_worth_its_price(price, after):
    # V is 1.2 x the reference cost of the remaining work, which the recently available pool 0 would
    # do at about 1.05 USD/h: pool 1 at 1.05 is worth running, at 1.4 the job waits for pool 0.
    spots = market([1.0, price], [[1, 1]] * 2 + [[0, 1]] * 2 + [[1, 1]])
    used = pools_used(simulate(make_policy("skynomad"), single(reconfig_overhead_hours=0.1), whole(spots)))
    assert used[:5] == [0, 0, *after]


def test_skynomad_observing_by_launches_and_probes_learns_only_what_it_ran_or_probed():
    # Pool 1 is probed (on offer) at slot 0 and never again: its outage at slots 2-3 goes unseen,
    # while a policy that reads every pool's offer each slot records that run's failure.
    spots = market([1.0, 1.2], [[1, 1], [1, 1], [1, 0], [1, 0], [1, 1]])
    for observe, failures in (("every-pool", [2.0]), ("launches-and-probes", [])):
        policy = make_policy("skynomad", {"observe": observe})
        result = simulate(policy, single(), whole(spots))
        assert not result.outcome.soft_miss
        assert policy._pools[1].failures == failures, observe


def test_lifetimes_fall_for_a_pool_that_keeps_preempting_and_burst_scaling_starts_after_one_unit_of_risk():
    stable, flaky = PoolLifetime(1.0), PoolLifetime(1.0)
    for slot in range(12):
        stable.observe(slot, True)
        flaky.observe(slot, slot % 2 == 0)  # one slot on offer, one slot gone
    assert stable.failures == [] and stable.expected_hours() > 1e6  # never seen failing: only caps bound it
    assert flaky.failures == [1.0] * 6
    assert flaky.expected_hours() < 2.0
    assert flaky.g >= 1.0 and stable.g == 1.0
