"""The baselines and the prediction-free policy on hand-made markets, decision by decision.

Unless a test says otherwise the job is tests.markets.make_job's: 8 units of work, H(n) = n,
N_min = 1, N_max = 2, soft deadline 6 h, slots of 1 h, no overhead; on-demand costs 3 USD/h.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from airflow_provider_spotsched.scheduling.model import Allocation, Throughput
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.greedy import GreedyPolicy
from airflow_provider_spotsched.scheduling.policies.on_demand import OnDemandPolicy
from airflow_provider_spotsched.scheduling.policies.prediction_free import PredictionFreePolicy
from airflow_provider_spotsched.scheduling.policies.uniform_progress import UniformProgressPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.scheduling.rules import safety_net_allocation, soft_deadline_lost
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from tests.markets import make_job, make_market, whole

IDLE = Allocation((0, 0), 0)


def od(n: int, pools: int = 2) -> Allocation:
    return Allocation((0,) * pools, n)


def spot(*counts: int) -> Allocation:
    return Allocation(tuple(counts), 0)


def market(prices: list[float], available: list[list[int]], slots: int = 18):
    """Constant ``prices`` per pool; ``available`` per slot, its last row repeated up to ``slots``."""
    rows = available + [available[-1]] * (slots - len(available))
    return make_market([prices] * slots, rows)


# --- on-demand ---------------------------------------------------------------------------------


def test_on_demand_runs_n_max_on_demand_until_completion_and_ignores_spot():
    result = simulate(OnDemandPolicy(), make_job(), whole(market([1.0, 1.0], [[4, 4]])))
    assert result.allocations == [od(2)] * 4
    assert result.outcome.completion_hours == pytest.approx(4.0)
    assert result.outcome.cost == pytest.approx(2 * 3.0 * 4)


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_waits_for_spot_and_takes_the_cheapest_pool():
    result = simulate(GreedyPolicy(), make_job(), whole(market([2.0, 1.0], [[0, 0], [2, 2]])))
    assert result.allocations == [IDLE, spot(0, 2), spot(0, 2), spot(0, 2), spot(0, 2)]
    assert result.outcome.completion_hours == pytest.approx(5.0)
    assert result.outcome.cost == pytest.approx(4 * 2 * 1.0)


def test_greedy_stays_on_its_spot_instances_unless_more_can_be_had():
    # slot 1: pool 1 becomes cheaper but offers no more instances: stay (Exploitation Rule)
    stays = simulate(GreedyPolicy(), make_job(), whole(market([1.5, 1.0], [[2, 0], [2, 2]])))
    assert stays.allocations[:2] == [spot(2, 0), spot(2, 0)]
    # slot 1: two instances instead of one: move to them
    grows = simulate(GreedyPolicy(), make_job(), whole(market([1.5, 1.0], [[1, 0], [1, 2]])))
    assert grows.allocations[:2] == [spot(1, 0), spot(0, 2)]


def test_greedy_pauses_below_n_min_then_switches_to_on_demand_for_good():
    # one spot instance is fewer than N_min = 2; slack for N_max on-demand runs out after slot 1;
    # spot enough for the job comes back at slot 3, but greedy stays on on-demand
    job = make_job(min_instances=2)
    result = simulate(GreedyPolicy(), job, whole(market([1.0, 1.0], [[1, 0], [1, 0], [1, 0], [2, 2]])))
    assert result.allocations == [IDLE, IDLE] + [od(2)] * 4
    assert result.outcome.completion_hours == pytest.approx(6.0) and not result.outcome.soft_miss


def test_greedy_never_buys_spot_priced_above_on_demand():
    result = simulate(GreedyPolicy(), make_job(), whole(market([3.5, 4.0], [[2, 2]])))
    assert result.allocations == [IDLE, IDLE] + [od(2)] * 4


# --- uniform progress --------------------------------------------------------------------------


def test_uniform_progress_uses_just_enough_on_demand_to_stay_on_the_line():
    # L = d = 6: the line asks one unit per hour, which one on-demand instance does
    result = simulate(UniformProgressPolicy(), make_job(work=6.0), whole(market([1.0, 1.0], [[0, 0]])))
    assert result.allocations == [od(1)] * 6
    assert result.outcome.completion_hours == pytest.approx(6.0) and not result.outcome.soft_miss


def test_uniform_progress_takes_spot_when_ahead_pauses_on_the_line_and_catches_up():
    # line 4/3 unit/h; spot for slots 0-1 puts the job ahead (4 done by 2 h), it pauses in slot 2
    # (on the line: 4 by 3 h), then catches up with 2 and 1 on-demand instances
    result = simulate(UniformProgressPolicy(), make_job(), whole(market([1.0, 2.0], [[2, 0], [2, 0], [0, 0]])))
    assert result.allocations == [spot(2, 0), spot(2, 0), IDLE, od(2), od(1), od(1)]
    assert result.outcome.completion_hours == pytest.approx(6.0)
    assert result.outcome.cost == pytest.approx(2 * 2 * 1.0 + 3.0 * (2 + 1 + 1))


def test_uniform_progress_hysteresis_stays_on_on_demand_until_ahead_of_the_line():
    # overhead 0.25 h: slot 0 runs 2 on-demand (1.5 done); in slot 1 spot appears but
    # cp = 1.5 < ep(1 + 2 * 0.25) = 2, so it stays; in slot 2 cp = 3.5 >= ep(2.5) and it moves
    job = make_job(reconfig_overhead_hours=0.25)
    result = simulate(UniformProgressPolicy(), job, whole(market([1.0, 2.0], [[0, 0], [2, 0]])))
    assert result.allocations[:3] == [od(2), od(2), spot(2, 0)]
    assert not result.outcome.soft_miss


def test_uniform_progress_safety_net_keeps_a_slot_that_ends_after_the_deadline_from_finishing_late():
    # d = 0.75 h falls inside slot 1: the line's one instance would finish at 1.0 h, so the
    # safety net runs N_max on-demand, which finishes at 0.75 h
    job = make_job(work=1.5, deadline_hours=0.75, slot_hours=0.5, hard_deadline_factor=1.0)
    result = simulate(UniformProgressPolicy(), job, whole(make_market([[1.0]] * 2, [[0]] * 2, slot_hours=0.5)))
    assert result.allocations == [od(2, pools=1), od(2, pools=1)]
    assert result.outcome.completion_hours == pytest.approx(0.75) and not result.outcome.soft_miss


# --- prediction-free ---------------------------------------------------------------------------

LOOSE = dict(work=4.0, deadline_hours=12.0)  # N_max on-demand needs 2 of the 12 hours


def test_prediction_free_waits_then_paces_with_the_fewest_instances():
    # reserve 1 slot: one instance from hour h finishes by 12 - 1 = 11 h while h <= 7
    result = simulate(PredictionFreePolicy(), make_job(**LOOSE), whole(market([1.0, 1.0], [[0, 0]])))
    assert result.allocations == [IDLE] * 7 + [od(1)] * 4
    assert result.outcome.completion_hours == pytest.approx(11.0)


@pytest.mark.parametrize("safety_slots, start", [(0.0, 8), (3.0, 5)])
def test_a_larger_reserve_starts_earlier(safety_slots, start):
    policy = PredictionFreePolicy(safety_slots=safety_slots)
    result = simulate(policy, make_job(**LOOSE), whole(market([1.0, 1.0], [[0, 0]])))
    assert result.allocations == [IDLE] * start + [od(1)] * 4


def test_prediction_free_takes_only_spot_below_the_price_threshold():
    # pool 0 costs 2.5/3 = 0.83 of on-demand, pool 1 costs 0.5 and appears at slot 2
    prices, available = [2.5, 1.5], [[2, 0], [2, 0], [2, 2]]
    strict = simulate(PredictionFreePolicy(price_threshold=0.7), make_job(**LOOSE), whole(market(prices, available)))
    assert strict.allocations == [IDLE, IDLE, spot(0, 2), spot(0, 2)]
    assert strict.outcome.cost == pytest.approx(2 * 2 * 1.5)
    lax = simulate(PredictionFreePolicy(price_threshold=0.9), make_job(**LOOSE), whole(market(prices, available)))
    assert lax.allocations == [spot(2, 0), spot(2, 0)]


def observation(job, previous: Allocation, work_done: float, slot: int, price: float, available: int) -> Observation:
    past = make_market([[price]] * (slot + 1), [[available]] * (slot + 1))
    return Observation(job, slot, past, 0, work_done, 0.0, previous)


@pytest.mark.parametrize("overhead, keeps", [(0.5, True), (0.25, False)])
def test_prediction_free_keeps_its_allocation_unless_moving_pays_for_the_lost_overhead(overhead, keeps):
    # slot 8, 2 units left, pacing asks for one instance; a spot instance at 2 USD (2/3 of
    # on-demand) appears. Per unit of work: staying on on-demand costs 3; moving costs
    # 2 / (1 - overhead): 4 with 0.5 h lost, 2.67 with 0.25 h lost.
    job = make_job(**LOOSE, reconfig_overhead_hours=overhead)
    choice = PredictionFreePolicy().decide(observation(job, od(1, pools=1), 2.0, 8, 2.0, 1))
    assert choice == (od(1, pools=1) if keeps else spot(1))


def test_prediction_free_falls_back_to_n_max_on_demand_for_good():
    # 11 units by 6 h on 2 instances leaves less than the 1-slot reserve: on-demand from slot 0,
    # cheap spot from slot 1 on is not taken
    result = simulate(PredictionFreePolicy(), make_job(work=11.0), whole(market([0.5, 0.5], [[0, 0], [2, 2]])))
    assert result.allocations == [od(2)] * 6
    assert result.outcome.completion_hours == pytest.approx(5.5)


def test_prediction_free_parameters_label_and_registry():
    policy = make_policy("prediction-free", {"price_threshold": 0.5, "safety_slots": 2})
    assert policy.params() == {"price_threshold": 0.5, "safety_slots": 2.0}
    assert policy.label == "prediction-free(price_threshold=0.5,safety_slots=2.0)"
    with pytest.raises(ValueError, match="price_threshold must be a number > 0"):
        PredictionFreePolicy(price_threshold=0.0)
    with pytest.raises(ValueError, match="safety_slots must be a number >= 0"):
        PredictionFreePolicy(safety_slots=-1.0)
    with pytest.raises(ValueError, match="safety_slots must be a number >= 0.*got 'x'"):
        PredictionFreePolicy(safety_slots="x")  # type: ignore[arg-type]  # a --param from a command line
    with pytest.raises(ValueError, match="spot_premium must be a number >= 0"):
        PredictionFreePolicy(spot_premium=float("inf"))
    with pytest.raises(ValueError, match="takes no parameter"):
        make_policy("prediction-free", {"threshold": 0.5})


@pytest.mark.parametrize("name", ["on-demand", "greedy", "uniform-progress", "prediction-free"])
def test_a_policy_forgets_the_previous_job_on_reset(name):
    # the same policy object on a tight job (which ends on on-demand) then a loose one
    policy = make_policy(name)
    cheap = whole(market([0.5, 0.5], [[2, 2]]))
    simulate(policy, make_job(work=11.0), whole(market([0.5, 0.5], [[0, 0]])))
    again = simulate(policy, make_job(), cheap)
    assert again.allocations == simulate(make_policy(name), make_job(), cheap).allocations


def test_prediction_free_spot_premium_runs_ahead_only_on_the_cheapest_offers():
    # pool 0 at 1.0 has 1 instance, pool 1 at 1.5 has 2; plenty of slack
    market = make_market([[1.0, 1.5]] * 12, [[1, 2]] * 12)
    job = make_job(work=4.0, max_instances=2, deadline_hours=8.0)
    plain = simulate(make_policy("prediction-free", {"price_threshold": 0.9, "safety_slots": 0.0}), job, whole(market))
    thrifty = simulate(
        make_policy("prediction-free", {"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.1}), job, whole(market)
    )
    assert plain.allocations[0] == Allocation((1, 1), 0)
    assert thrifty.allocations[0] == Allocation((1, 0), 0), "ahead of need, only pools within 10% of the cheapest"
    assert thrifty.outcome.cost < plain.outcome.cost and not thrifty.outcome.soft_miss
    with pytest.raises(ValueError, match="spot_premium must be a number >= 0"):
        make_policy("prediction-free", {"spot_premium": -1})


# --- the safety net once the soft deadline is lost ---------------------------------------------


def late_observation(
    job, previous: Allocation, work_done: float, slot: int, prices: list[float], history: list[list[int]] | None = None
) -> Observation:
    """Slot ``slot`` of ``job`` at constant ``prices``; ``history`` gives the counts offered per
    slot up to this one (default: two instances in every pool throughout)."""
    rows = history or [[2] * len(prices)] * (slot + 1)
    past = make_market([prices] * len(rows), rows)
    return Observation(job, slot, past, len(rows) - slot - 1, work_done, 0.0, previous)


@pytest.mark.parametrize(
    "name, params",
    [("greedy", {}), ("uniform-progress", {}), ("prediction-free", {}), ("chc", {}), ("prediction-free", {"guard": 1.2})],
)
def test_a_job_that_can_no_longer_meet_its_soft_deadline_finishes_on_spot_not_on_demand(name, params):
    # the job works at half its declared speed: even N_max on-demand from slot 1 on ends after
    # d = 6 h, so the value decays whatever runs; spot at a third of on-demand is as fast, and the
    # hard deadline (12 h) leaves room for it
    job = make_job(hard_deadline_factor=2.0)
    result = simulate(make_policy(name, params), job, whole(market([1.0, 1.0], [[2, 2]])), TrueThroughput(0.5))
    assert all(a.on_demand == 0 for a in result.allocations), result.allocations
    assert result.outcome.completion_hours == pytest.approx(8.0)
    assert result.outcome.soft_miss and not result.outcome.hard_miss
    assert result.outcome.cost == pytest.approx(2 * 1.0 * 8)


@pytest.mark.parametrize("overhead, chosen", [(0.25, spot(2, 0)), (0.0, spot(0, 2))])
def test_late_the_previous_spot_is_kept_unless_moving_saves_more_than_the_restart_costs(overhead, chosen):
    # slot 5 of 8 units with 2 done: on-demand would end at 8 h > d = 6 h. Moving from pool 0
    # (1.4) to pool 1 (1.2) saves 0.4 USD a slot; with 0.25 h lost the restart costs
    # 0.25 * (2.4 USD/h + the value's fall of 30 / 3 h) = 3.1
    job = make_job(reconfig_overhead_hours=overhead)
    observation = late_observation(job, spot(2, 0), 2.0, 5, [1.4, 1.2])
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == chosen


@pytest.mark.parametrize("work, chosen", [(5.0, spot(2, 0)), (30.0, spot(0, 2))])
def test_late_a_move_is_weighed_over_the_slots_it_saves_in_not_one(work, chosen):
    # slot 5 on pool 0 (1.4 USD) beside pool 1 (1.2), hard deadline 24 h, value 30 falling over
    # 18 h: a restart costs 0.25 * (2.4 + 30 / 18) = 1.02 USD against a saving of 0.4 a slot.
    # With 3 units left the job needs 1.5 slots (0.6 USD saved): it stays. With 28 left it needs 14,
    # and pool 1, offered in all 6 slots so far, is expected to stay about 7 (Laplace: 1 / 7
    # restarts a slot): 2.8 USD saved, so it moves, where one slot's saving alone kept it
    job = make_job(work=work, reconfig_overhead_hours=0.25, hard_deadline_factor=4.0)
    observation = late_observation(job, spot(2, 0), 2.0, 5, [1.4, 1.2])
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == chosen


@pytest.mark.parametrize("hard_factor, chosen", [(1.5, od(2)), (2.0, spot(2, 0))])
def test_late_spot_runs_only_where_the_hard_deadline_leaves_room_for_its_restart(hard_factor, chosen):
    # slot 5, 7.5 units left on one spot instance: on-demand from now ends at 9 h, after
    # d = 6 h. Moving to two spot instances loses 0.25 h: on-demand from slot 6 would then end at
    # 9.25 h, after a hard deadline of 9 h
    job = make_job(reconfig_overhead_hours=0.25, hard_deadline_factor=hard_factor)
    observation = late_observation(job, spot(1, 0), 0.5, 5, [1.0, 1.0])
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == chosen


def test_late_a_short_rest_of_the_job_does_not_keep_it_off_spot():
    # slot 5, 2.4 units left on one spot instance, value 300 falling over 3 h (100 USD/h): moving
    # to two spot instances or to two on-demand restarts the job either way, so spot (4 USD/h
    # cheaper, never taken away) runs, although it saves only 4.8 USD over the last 1.2 h
    # against a restart priced at 0.25 * (2 + 100) = 25.5
    job = make_job(reconfig_overhead_hours=0.25, value=300.0)
    observation = late_observation(job, spot(1, 0), 8.0 - 2.4, 5, [1.0, 1.0])
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == spot(2, 0)


@pytest.mark.parametrize("slot, work_done, chosen", [(2, 1.0, od(2)), (3, 0.0, spot(2, 0))])
def test_late_a_job_on_n_max_on_demand_leaves_it_only_once_even_its_declaration_is_late(slot, work_done, chosen):
    # measured at half its declared speed, the job is late on on-demand in both cases. Slot 2
    # with 7 units left: at the declared 2 units/h on-demand ends at 5.5 h, on time, and the
    # estimate errs low, so it stays (leaving would cost a restart). Slot 3 with 8 left: even
    # declared it ends at 7 h, after d + delta; on-demand then counts as any running allocation,
    # and spot saves 4 USD a slot against a restart of 0.25 h * (2 USD/h + 30 / 6 h) = 1.75
    declared = make_job(reconfig_overhead_hours=0.25, hard_deadline_factor=2.0)
    estimated = replace(declared, throughput=Throughput(0.5))
    observation = replace(
        late_observation(estimated, od(2), work_done, slot, [1.0, 1.0]), declared_throughput=declared.throughput
    )
    assert soft_deadline_lost(observation)
    assert soft_deadline_lost(observation, observation.declared_job) == (chosen != od(2))
    assert safety_net_allocation(observation) == chosen


@pytest.mark.parametrize("flapping, chosen", [(False, spot(2)), (True, od(2, pools=1))])
def test_late_spot_that_keeps_being_taken_away_is_not_worth_its_restarts(flapping, chosen):
    # slot 24, one pool at 2.5 USD against 3 on-demand: two spot instances save 1 USD a slot,
    # and a restart costs 0.25 h * (5 USD/h + the value's fall of 30 / 24 h) = 1.56. Offered
    # throughout, they were never taken away (1 / 26 restarts a slot); offered every other slot,
    # after each slot they ran (13 / 14)
    job = make_job(reconfig_overhead_hours=0.25, hard_deadline_factor=2.0, work=60.0, deadline_hours=24.0)
    history = [[2 if not flapping or t % 2 == 0 else 0] for t in range(25)]
    observation = late_observation(job, spot(1), 20.0, 24, [2.5], history)
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == chosen


@pytest.mark.parametrize("steady, chosen", [(True, Allocation((1, 0), 2)), (False, od(3))])
def test_late_spot_running_below_n_max_is_kept_and_topped_up_where_the_cheapest_would_not_pay(steady, chosen):
    # slot 24, the soft deadline, with 40 units left on N_max = 3: late at any speed. The value,
    # 3000 falling over 24 h, loses 125 USD an hour, so a restart costs 0.25 h * (its bill + 125).
    # The job runs pool 0's instance (1 USD) and one on-demand (3), below N_max: whatever runs
    # next restarts it. The cheapest three, pool 1's two at 0.5 and pool 0's, save 7 USD a slot
    # over on-demand, but pool 1 is taken away after every slot it is offered (13 / 15 restarts a
    # slot, 27.6 USD); pool 0's instance kept beside two on-demand saves 2 against 1 / 26 x 33
    # USD, where pool 0 was never taken away, and a job on 3 on-demand would give it up
    job = make_job(work=60.0, deadline_hours=24.0, max_instances=3, value=3000.0, hard_deadline_factor=2.0,
                   reconfig_overhead_hours=0.25)
    history = [[1 if steady or t % 2 == 0 else 0, 2 if t % 2 == 0 else 0] for t in range(25)]
    observation = late_observation(job, Allocation((1, 0), 1), 20.0, 24, [1.0, 0.5], history)
    assert soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == chosen


def test_the_safety_net_stays_on_demand_while_the_soft_deadline_can_be_met():
    # slot 2, 8 units left: N_max on-demand ends at 6 h = d, which spot with a restart would miss
    job = make_job(reconfig_overhead_hours=0.25)
    observation = late_observation(job, od(2), 0.0, 2, [0.5, 0.5])
    assert not soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == od(2)


def test_a_job_late_by_less_than_a_restart_is_not_yet_lost():
    # slot 2, 7.9 units left on spot: on-demand from now (with its restart) ends at
    # 2 + 0.25 + 3.95 = 6.2 h, within a restart of d = 6 h: the estimate errs low, so not lost
    job = make_job(work=7.9, reconfig_overhead_hours=0.25)
    observation = late_observation(job, spot(2, 0), 0.0, 2, [1.0, 1.0])
    assert not soft_deadline_lost(observation)
    assert safety_net_allocation(observation) == od(2)
