"""The cost guard: bounded cost against Uniform Progress on adversarial markets, silent when
predictions are right, deadline safety kept, and its parameter checked."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.market.synthetic import SyntheticMarketConfig, generate
from airflow_provider_spotsched.scheduling.guard import GuardedPolicy, handover_allowance, step_shadow, work_price_floor
from airflow_provider_spotsched.scheduling.model import Allocation, Progress, Throughput
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.chc import CHCPolicy
from airflow_provider_spotsched.scheduling.policies.uniform_progress import UniformProgressPolicy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import JobMarket, simulate
from airflow_provider_spotsched.scheduling.rules import is_deadline_safe, on_demand_fallback
from airflow_provider_spotsched.scheduling.selector import DEFAULT_POOL, SelectorPolicy
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from tests.markets import make_job, make_market, whole
from tests.strategies import Scenario, scenarios

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Plenty(Forecaster):
    """A forecast that is always wrong the same way: every pool full and nearly free from next slot on."""

    name = "plenty"

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        shape = (horizon, past.num_pools)
        return Forecast(spot_price=np.full(shape, 0.01 * past.on_demand_price), available=np.full(shape, 64.0))


class BlindCHC(CHCPolicy):
    """CHC that plans as it would unguarded: the guard's slot-by-slot checks alone bound it."""

    plans_within_guard = False


def misled_chc(blind: bool = True, **params) -> CHCPolicy:
    """CHC on the :class:`Plenty` forecast: it defers work to a future that never comes. Blind,
    it also plans without the guard's bound, which exercises the guard's own checks."""
    policy = (BlindCHC if blind else CHCPolicy)(window=6, commit=1, forecaster="persistence", **params)
    policy.forecaster = Plenty()
    return policy


class DeadlineChecked(GuardedPolicy):
    """A guarded policy that asserts every decision is deadline-safe or the on-demand fallback."""

    def decide(self, observation: Observation):
        choice = super().decide(observation)
        fallback = on_demand_fallback(observation.job, observation.past.num_pools)
        assert choice == fallback or is_deadline_safe(observation.job, observation, choice)
        return choice


def spot_then_nothing():
    """Spot at half the on-demand price for the first half of the deadline, then none at all."""
    job = make_job(work=24.0, deadline_hours=12.0, max_instances=4, reconfig_overhead_hours=0.25, value=200.0)
    slots = job.horizon_slots
    price = np.full((slots, 1), 1.5)
    available = np.array([[4] if t < 6 else [0] for t in range(slots)])
    return job, whole(make_market(price, available, on_demand_price=3.0))


def with_free_history(market: JobMarket) -> JobMarket:
    """``market`` after one slot of history in which every pool offered spot for next to nothing:
    the floor price of a unit of work is then ~0, and the guard allows lambda x UP's cost so far
    and nothing ahead (the tightest guard, which the handover tests below need to reach)."""
    inner = market.market
    free = SlotMarket(
        pools=inner.pools,
        start=inner.start - timedelta(hours=inner.slot_hours),
        slot_hours=inner.slot_hours,
        spot_price=np.vstack([np.full((1, inner.num_pools), 1e-9), inner.spot_price]),
        available=np.vstack([np.full((1, inner.num_pools), 64), inner.available]),
        on_demand_price=inner.on_demand_price,
    )
    return JobMarket(free, market.offset + 1)


def floor_at_submission(job, market: JobMarket) -> float:
    """The guard's floor price of a unit of work when the job is submitted."""
    return work_price_floor(job, market.market.prefix(market.offset + 1))


def exact_bound(job, up_cost: float, guard: float, floor: float) -> float:
    """The guard's bound for a job never handed over (docs/guard.md): guard x UP's cost, plus
    lambda x the work at the floor price, which the spot prices after submission may undercut."""
    return guard * up_cost + (guard - 1) * job.work * floor + 1e-9


def bound(job, up_cost: float, guard: float, on_demand_price: float, floor: float = 0.0) -> float:
    """The guard's stated bound (docs/guard.md): the above, plus the handover allowance."""
    return exact_bound(job, up_cost, guard, floor) + handover_allowance(job, on_demand_price)


def test_a_misled_chc_pays_far_above_up_and_the_guard_keeps_it_within_the_bound():
    """Every slot the misled CHC would defer, the job runs as many instances as UP instead (in
    the one pool, UP's allocation), and it never needs to hand over for good: it pays what UP pays."""
    job, market = spot_then_nothing()
    up = simulate(UniformProgressPolicy(), job, market).outcome
    unguarded = simulate(misled_chc(), job, market).outcome
    guarded_policy = DeadlineChecked(misled_chc(), 1.2)
    guarded = simulate(guarded_policy, job, market).outcome
    assert unguarded.cost > 1.5 * up.cost  # the adversarial market works
    assert guarded_policy.switched_at is None and guarded_policy.topped_up_slots == 6 and guarded_policy.tracked_slots == 0
    assert guarded.cost <= 1.2 * up.cost + 1e-9
    assert not guarded.soft_miss and not unguarded.soft_miss


def test_the_member_decides_again_after_tracking_and_the_guard_switches_when_tracking_breaks_the_bound():
    """On this seeded market the misled CHC is overruled for eight slots, then even the shadow's
    allocation would break the invariant (a restart the shadow does not make), and the job is
    handed over to tracking UP: the bound with the handover allowance holds. (Here the cheapest
    instances to top the member's choice up with are the shadow's own.)"""
    job = make_job(work=4 * 12.0, deadline_hours=12.0 * 1.25 + 0.25, max_instances=4, reconfig_overhead_hours=0.25, value=2000.0)
    market = synthetic_job_market(1, job.horizon_slots)
    up = simulate(UniformProgressPolicy(), job, market).outcome
    policy = DeadlineChecked(misled_chc(), 1.2)
    guarded = simulate(policy, job, market).outcome
    assert policy.topped_up_slots == 8 and policy.tracked_slots == 0 and policy.handovers == 1
    assert guarded.cost <= bound(job, up.cost, 1.2, market.market.on_demand_price, floor_at_submission(job, market))
    assert not guarded.soft_miss


def test_an_overruled_member_runs_as_many_instances_as_up_on_the_cheapest_spot_not_on_ups():
    """UP keeps its instances in the pool it started in (Can't Be Late's exploitation rule) when
    a cheaper pool opens; where the misled CHC is overruled, the job runs UP's instance count
    in the cheaper pool: no more behind UP than tracking would leave it, at less than half the
    price, and within the bound. (With a floor price of ~0, so the guard allows nothing ahead.)"""
    job = make_job(work=24.0, deadline_hours=12.0, max_instances=4, reconfig_overhead_hours=0.25, value=200.0)
    price = [[2.0, 9.0]] + [[2.5, 1.0]] * (job.horizon_slots - 1)
    available = [[4, 0]] + [[4, 4]] * (job.horizon_slots - 1)
    market = with_free_history(whole(make_market(price, available, on_demand_price=3.0)))
    up = simulate(UniformProgressPolicy(), job, market)
    policy = DeadlineChecked(misled_chc(), 1.2)
    guarded = simulate(policy, job, market)
    assert [a.spot for a in up.allocations[:3]] == [(4, 0), (4, 0), (4, 0)]
    assert [a.spot for a in guarded.allocations[:3]] == [(4, 0), (0, 4), (0, 4)]
    assert policy.topped_up_slots >= 3 and policy.tracked_slots == 0 and policy.switched_at is None
    assert guarded.outcome.cost <= 1.2 * up.outcome.cost
    assert not guarded.outcome.soft_miss


def test_a_misled_chc_that_plans_within_the_bound_keeps_it_on_the_market_it_did_not_foresee():
    """Planning within the guard's bound on its forecast, the misled CHC runs what UP runs while
    spot is there (tracking UP is what the bound allows on any forecast), then defers the work
    its forecast prices within the bound; the guard hands it over once spot is gone for good,
    and it pays within 1.2 x UP."""
    job, market = spot_then_nothing()
    up = simulate(UniformProgressPolicy(), job, market)
    policy = DeadlineChecked(misled_chc(blind=False), 1.2)
    guarded = simulate(policy, job, market)
    assert guarded.allocations[:5] == up.allocations[:5]
    assert policy.topped_up_slots == 0 and policy.tracked_slots == 0 and policy.switched_at is not None
    assert guarded.outcome.cost <= 1.2 * up.outcome.cost
    assert not guarded.outcome.soft_miss


def test_the_guard_stays_silent_when_the_forecast_is_right():
    """A spot outage in the middle: UP buys on-demand to keep its line, CHC on a perfect
    forecast waits for spot to return, trails UP by exactly the work UP bought, and is cheaper."""
    job = make_job(work=10.0, deadline_hours=8.0, max_instances=2)
    price = np.full((job.horizon_slots, 1), 1.0)
    available = np.array([[0] if t in (2, 3) else [2] for t in range(job.horizon_slots)])
    market = whole(make_market(price, available, on_demand_price=3.0))
    up = simulate(UniformProgressPolicy(), job, market)
    oracle = {"window": 12, "commit": 1, "forecaster": "oracle"}
    unguarded = simulate(make_policy("chc", oracle), job, market)
    policy = make_policy("chc", {**oracle, "guard": 1.2})
    guarded = simulate(policy, job, market)
    assert any(a.on_demand for a in up.allocations) and not any(a.on_demand for a in unguarded.allocations)
    assert unguarded.outcome.cost < up.outcome.cost
    assert isinstance(policy, GuardedPolicy) and policy.switched_at is None
    assert guarded.allocations == unguarded.allocations


def test_the_floor_is_the_cheapest_offer_at_the_most_work_per_instance_hour():
    """Prices of pools without capacity do not count; with a fixed cost per run (beta < 0) more
    instances give more work per instance-hour, with beta > 0 fewer do; nothing offered: on-demand."""
    market = make_market([[0.5, 2.0], [1.5, 1.0]], [[0, 4], [2, 4]], on_demand_price=3.0)
    assert work_price_floor(make_job(max_instances=4, throughput=Throughput(1.0, 0.0)), market) == pytest.approx(1.0)
    assert work_price_floor(make_job(max_instances=4, throughput=Throughput(1.0, 1.0)), market) == pytest.approx(1.0 / 2.0)
    assert work_price_floor(make_job(max_instances=4, throughput=Throughput(1.0, -0.5)), market) == pytest.approx(4 / 3.5)
    nothing = make_market([[0.5, 2.0]], [[0, 0]], on_demand_price=3.0)
    assert work_price_floor(make_job(max_instances=4), nothing) == pytest.approx(3.0)


def cheap_pool_later():
    """Pool 0 at 1.6 from the start; pool 1 at 1.0 from slot 2: waiting for it pays."""
    job = make_job(work=24.0, deadline_hours=16.0, max_instances=2, value=200.0)
    slots = job.horizon_slots
    price = np.tile([1.6, 1.0], (slots, 1))
    available = np.array([[2, 0] if t < 2 else [2, 2] for t in range(slots)])
    return job, whole(make_market(price, available, on_demand_price=3.0))


def test_the_allowance_lets_a_right_forecast_wait_once_the_job_has_run_where_ups_cost_so_far_would_not():
    """UP starts at once on the dearer pool. CHC on the realised market waits two slots for the
    cheaper one. Before the job has run, its throughput is the declaration's word alone and the
    floor lends nothing: within lambda x UP's cost so far (1.6 x 2 x 0.2 after slot 0) the job
    runs slot 0 as UP does. From slot 1 on, measured, the room is lambda x a lower bound of UP's
    final cost (its cost so far, the rest of its work at the floor price): the job waits slot 1
    out and costs less than UP, where with a floor of ~0 the wait is overruled too."""
    job, market = cheap_pool_later()
    up = simulate(UniformProgressPolicy(), job, market)
    assert up.allocations[0] == Allocation((2, 0), 0)
    oracle = {"window": 24, "commit": 1, "forecaster": "oracle"}
    unguarded = simulate(make_policy("chc", oracle), job, market)
    assert unguarded.allocations[:2] == [Allocation((0, 0), 0)] * 2

    policy = DeadlineChecked(CHCPolicy(**oracle), 1.2)
    guarded = simulate(policy, job, market)
    assert guarded.allocations[:3] == [Allocation((2, 0), 0), Allocation((0, 0), 0), Allocation((0, 2), 0)]
    assert policy.topped_up_slots == 0 and policy.tracked_slots == 0 and policy.switched_at is None  # CHC's own plan
    assert unguarded.outcome.cost < guarded.outcome.cost < up.outcome.cost and not guarded.outcome.soft_miss

    tightest = with_free_history(market)  # floor ~0: lambda x UP's cost so far alone
    overruled = simulate(DeadlineChecked(CHCPolicy(**oracle), 1.2), job, tightest)
    assert [a.total for a in overruled.allocations[:2]] == [2, 2]  # as many instances as UP throughout
    assert overruled.outcome.cost > guarded.outcome.cost


class Dearest(Policy):
    """N_max instances in the dearest pool on offer: spends the guard's room as fast as it can."""

    name = "dearest"

    def decide(self, observation: Observation) -> Allocation:
        n = observation.job.max_instances
        pool = int(np.argmax(np.where(observation.available >= n, observation.spot_price, -np.inf)))
        spot = [0] * observation.past.num_pools
        spot[pool] = n
        return Allocation(tuple(spot), 0)


def test_prices_that_fall_below_the_floor_cost_at_most_lambda_x_the_work_at_the_floor_more():
    """The adversary of the allowance: the one pool offered in slot 0 is taken away, and a member
    spends the room on the dearer of the two that follow while the floor is 1; then every price
    falls to a tenth of it, so UP's final cost is far below the lower bound the room was sized on.
    Handed over once the room is spent (slot 3), the job pays about 1.5 x UP: more than 1.2 x UP,
    within 1.2 x UP + lambda x its work at the floor price, the bound's floor term. With a floor
    of ~0 (the old room) it runs UP's allocations throughout."""
    job = make_job(work=24.0, deadline_hours=16.0, max_instances=2, reconfig_overhead_hours=0.25, value=200.0)
    slots = job.horizon_slots
    price = np.array([[1.0, 1.0, 2.0] if t < 3 else [0.1, 0.1, 0.1] for t in range(slots)])
    available = np.array([[2, 0, 0] if t == 0 else [0, 2, 2] for t in range(slots)])
    market = whole(make_market(price, available, on_demand_price=3.0))
    up = simulate(UniformProgressPolicy(), job, market).outcome
    floor = floor_at_submission(job, market)
    policy = DeadlineChecked(Dearest(), 1.2)
    guarded = simulate(policy, job, market)
    assert guarded.allocations[1] == Allocation((0, 0, 2), 0)
    assert not guarded.outcome.soft_miss and policy.switched_at == 3
    assert 1.2 * up.cost < guarded.outcome.cost <= exact_bound(job, up.cost, 1.2, floor)

    tightest = DeadlineChecked(Dearest(), 1.2)
    old_room = simulate(tightest, job, with_free_history(market)).outcome
    assert not old_room.soft_miss and tightest.switched_at is None
    assert old_room.cost <= 1.2 * up.cost + 1e-9


def test_a_job_slower_than_declared_is_not_handed_over_for_work_no_allocation_lost():
    """Declared 30% too fast, the job's measured work trails the shadow after its first slot by
    what the declaration promised and the truth did not give: no allocation lost it, and UP at
    the true speed would not have done it either. The gap measured on one model of the
    throughput (the estimate) is the allocations' alone, and the member waits out the outage
    as it does when the declaration is right (UP buys on-demand there); on the measured work
    the guard handed the job over at slot 1."""
    job = make_job(work=10.0, deadline_hours=10.0, max_instances=2)
    price = np.full((job.horizon_slots, 1), 1.0)
    available = np.array([[0] if t in (2, 3) else [2] for t in range(job.horizon_slots)])
    market, slower = whole(make_market(price, available, on_demand_price=3.0)), TrueThroughput(1 / 1.3)
    up = simulate(UniformProgressPolicy(), job, market, slower)
    oracle = {"window": 12, "commit": 1, "forecaster": "oracle"}
    unguarded = simulate(make_policy("chc", oracle), job, market, slower)
    policy = make_policy("chc", {**oracle, "guard": 1.2})
    guarded = simulate(policy, job, market, slower)
    assert any(a.on_demand for a in up.allocations) and not any(a.on_demand for a in unguarded.allocations)
    assert unguarded.outcome.cost < up.outcome.cost and not unguarded.outcome.soft_miss
    assert isinstance(policy, GuardedPolicy) and policy.switched_at is None
    assert guarded.allocations == unguarded.allocations


def synthetic_job_market(seed: int, slots: int) -> JobMarket:
    """``slots`` hourly slots of the project's synthetic market for ``seed`` (3 pools)."""
    config = SyntheticMarketConfig(seed=seed, pools=3, days=slots / 24 + 1, tick_minutes=60.0, capacity=4)
    synthetic = generate(config)
    return whole(make_market(synthetic.spot_price[:slots], synthetic.available[:slots], config.on_demand_price))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("slack", [1.25, 2.0])
def test_the_bound_holds_on_seeded_synthetic_markets(seed, slack):
    job = make_job(work=4 * 12.0, deadline_hours=12.0 * slack + 0.25, max_instances=4, reconfig_overhead_hours=0.25, value=2000.0)
    market = synthetic_job_market(seed, job.horizon_slots)
    up = simulate(UniformProgressPolicy(), job, market).outcome
    for inner in (misled_chc(), misled_chc(blind=False), CHCPolicy(window=12, commit=2, forecaster="persistence")):
        policy = DeadlineChecked(inner, 1.2)
        guarded = simulate(policy, job, market).outcome
        assert policy.safety_net_at is None  # the case the bound leaves out does not arise here
        assert guarded.cost <= bound(job, up.cost, 1.2, market.market.on_demand_price, floor_at_submission(job, market))
        assert not guarded.soft_miss


@PROPERTY
@given(scenarios())
def test_the_bound_holds_on_random_markets(scenario: Scenario):
    job, market = scenario.job, scenario.job_market
    up = simulate(UniformProgressPolicy(), job, market).outcome
    for inner in (misled_chc(), misled_chc(blind=False)):
        policy = DeadlineChecked(inner, 1.1)
        guarded = simulate(policy, job, market).outcome
        assert not guarded.soft_miss
        floor = floor_at_submission(job, market)
        if policy.switched_at is None:  # never handed over: the bound holds without the handover allowance
            assert guarded.cost <= exact_bound(job, up.cost, 1.1, floor)
        assert guarded.cost <= bound(job, up.cost, 1.1, market.market.on_demand_price, floor)


@pytest.mark.parametrize("seed", range(8))
def test_with_a_perfect_forecast_chc_plans_within_the_bound_and_the_guard_never_overrules_it(seed):
    """On the realised market, CHC's plans keep the guard's invariant after every slot, so the
    guard lets every slot run as planned: no top-up, no shadow's slot, no handover. Planning
    blind, the same CHC is overruled where its plan leaves UP's path, and pays no less (more on
    7 of these 8 markets, the same on seed 4)."""
    job = make_job(work=4 * 12.0, deadline_hours=12.0 * 2 + 0.25, max_instances=4, reconfig_overhead_hours=0.25, value=2000.0)
    market = synthetic_job_market(seed, job.horizon_slots)
    up = simulate(UniformProgressPolicy(), job, market).outcome
    oracle = {"window": 24, "commit": 1, "forecaster": "oracle"}
    policy = DeadlineChecked(CHCPolicy(**oracle), 1.2)
    guarded = simulate(policy, job, market).outcome
    assert policy.topped_up_slots == 0 and policy.tracked_slots == 0 and policy.switched_at is None
    assert guarded.cost <= 1.2 * up.cost + 1e-9 and not guarded.soft_miss
    blind = simulate(DeadlineChecked(BlindCHC(**oracle), 1.2), job, market).outcome
    assert guarded.cost <= blind.cost + 1e-9


def test_guard_shows_in_the_label_and_forwards_the_forecaster():
    policy = make_policy("chc", {"forecaster": "persistence", "guard": 1.2})
    assert policy.label == "chc(window=24,commit=4,forecaster=persistence,terminal_price=marginal,guard=1.2)"
    plenty = Plenty()
    policy.forecaster = plenty
    assert isinstance(policy, GuardedPolicy) and policy.inner.forecaster is plenty
    assert make_policy("chc", {"guard": None}).label == CHCPolicy().label
    assert make_policy("chc", {"forecaster": "oracle", "guard": 1.2}).uses_future


@pytest.mark.parametrize("guard", [0.9, -1, float("inf"), float("nan"), "1.2", True])
def test_a_bad_guard_names_the_fix(guard):
    with pytest.raises(ValueError, match=r"guard=.*must be a finite number >= 1 .*1 \+ lambda"):
        make_policy("chc", {"guard": guard})


@pytest.mark.parametrize("name", ["uniform-progress", "optimal", "selector"])
def test_references_refuse_a_guard(name):
    with pytest.raises(ValueError, match=f"policy '{name}' takes no guard"):
        make_policy(name, {"guard": 1.2})


def test_a_guard_out_of_step_with_its_job_says_to_reset():
    job, market = spot_then_nothing()
    policy = GuardedPolicy(misled_chc())
    simulate(policy, job, market)
    first = Observation(job, 0, market.market.prefix(1), 0, 0.0, 0.0, on_demand_fallback(job, 1))
    with pytest.raises(ValueError, match="reset the policy before a new job"):
        policy.decide(first)


def test_the_selector_guards_its_members_and_loads_states_saved_before_the_guard():
    selector = SelectorPolicy(warm_up_rounds=0)
    guarded = [m for m in selector.members if isinstance(m, GuardedPolicy)]
    assert len(guarded) == len(DEFAULT_POOL) - 1  # all but uniform-progress itself
    old_pool = [{"policy": e["policy"], "params": {k: v for k, v in e["params"].items() if k != "guard"}} for e in DEFAULT_POOL]
    old = SelectorPolicy(pool=old_pool, warm_up_rounds=0).to_state()
    restored = SelectorPolicy.from_state(old)
    assert restored.pool == tuple(old_pool) and not any(isinstance(m, GuardedPolicy) for m in restored.members)


class RecordingPolicy(Policy):
    """Idles, keeping every observation it was shown."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def decide(self, observation: Observation) -> Allocation:
        self.seen.append(observation)
        return Allocation.idle(observation.past.num_pools)


def test_the_shadow_sees_the_job_as_the_member_does():
    # the estimate to plan on, and the declaration the late safety net reads: a shadow UP that
    # saw only the estimate would stay on on-demand where the member's own net leaves it
    declared = make_job()
    estimated = replace(declared, throughput=Throughput(0.5))
    market = make_market([[1.0]] * 3, [[2]] * 3)
    member_sees = Observation(estimated, 0, market.prefix(1), 0, 0.0, 0.0, Allocation.idle(1), declared.throughput)
    shadow = RecordingPolicy()
    step_shadow(shadow, Progress(), member_sees, market)
    assert shadow.seen[0].job == estimated and shadow.seen[0].declared_job == declared


def test_a_resumed_guard_replays_its_shadow_from_the_market():
    """The shadow depends on the market alone: a fresh guard asked at slot t catches up on it."""
    job = make_job(work=24.0, deadline_hours=12.0, max_instances=4, throughput=Throughput(1.0, 0.0))
    market = synthetic_job_market(3, job.horizon_slots)
    running = GuardedPolicy(CHCPolicy(window=6, commit=1, forecaster="persistence"))
    run = simulate(running, job, market)
    fresh = GuardedPolicy(CHCPolicy(window=6, commit=1, forecaster="persistence"))
    fresh.reset(job)
    last = len(run.allocations) - 1
    cost = sum(r.cost for r in run.outcome.slots[:last])
    work = sum(r.progress for r in run.outcome.slots[:last])
    observation = Observation(job, last, market.market.prefix(last + 1), 0, work, cost, run.allocations[last - 1])
    fresh.decide(observation)
    assert fresh.shadow_cost == pytest.approx(running.shadow_cost)


def test_a_job_still_behind_a_finished_shadow_does_not_track_its_idle_slots():
    """Found by the property test: UP finished in slot 1, the member (a cautious prediction-free
    one) was 0.04 units short, and the shadow's allocation from then on is idle, which keeps the
    cost bound (idling costs nothing) but never finishes the job. The shadow's allocation must be
    deadline-safe too, like every other choice the guard runs."""
    market = make_market(
        [[1, 1], [1, 1], [1, 1], [1, 0.25], [1, 1], [1, 1]],
        [[0, 2], [0, 2], [0, 2], [2, 2], [2, 2], [2, 2]],
        on_demand_price=1.0,
        slot_hours=0.5,
    )
    job = make_job(
        work=1.0390625, deadline_hours=2.0, max_instances=2, hard_deadline_factor=1.0, reconfig_overhead_hours=0.25, slot_hours=0.5
    )
    params = {"price_threshold": 0.7, "safety_slots": 1.0, "guard": 1.2}
    outcome = simulate(make_policy("prediction-free", params), job, JobMarket(market, 2)).outcome
    assert outcome.completion_hours is not None and not outcome.soft_miss


class Splitter(Policy):
    """Half the instances in the dearer pool for four slots (within the guard's factor), then idle."""

    name = "splitter"

    def decide(self, observation: Observation) -> Allocation:
        return Allocation((2, 2), 0) if observation.slot < 4 else Allocation((0, 0), 0)


def test_a_handed_over_job_catches_up_on_an_idle_shadow_with_the_fewest_on_demand_instances():
    """Handed over one restart (1 work unit) behind UP (floor price ~0: the tightest guard), the
    job tracks UP; when UP idles (no spot, ahead of its line) the job makes up the unit on 2
    on-demand instances, not N_max = 4: the shadow's next allocation restarts it too, so the job
    stays level, and the other two would be on-demand hours bought past the gap (found at 1.27 x
    UP on a synthetic market)."""
    job = make_job(work=48.0, deadline_hours=24.0, max_instances=4, reconfig_overhead_hours=0.25, value=500.0)
    available = np.array([[4, 4] if (t < 6 or t >= 9) else [0, 0] for t in range(job.horizon_slots)])
    market = with_free_history(whole(make_market(np.tile([1.0, 1.15], (job.horizon_slots, 1)), available, on_demand_price=3.0)))
    up = simulate(UniformProgressPolicy(), job, market)
    assert up.allocations[6:9] == [Allocation((0, 0), 0)] * 3  # UP idles while no spot is offered

    policy = DeadlineChecked(Splitter(), 1.2)
    run = simulate(policy, job, market)
    assert policy.switched_at == 4  # the restart onto UP's allocation leaves the job 1 unit behind
    assert run.allocations[6] == Allocation((0, 0), 2)  # 2 x 0.75 h of work make up the unit
    assert run.allocations[7:] == up.allocations[7:]  # level from then on
    assert run.outcome.completion_hours <= up.outcome.completion_hours  # half a unit ahead: done a little sooner
    # UP's bill, plus 2 instances in the dearer pool for 4 slots and the 2 on-demand for one (less the sooner end)
    assert up.outcome.cost < run.outcome.cost <= up.outcome.cost + 2 * 4 * 0.15 + 2 * 3.0 + 1e-9


def test_the_fewest_on_demand_instances_that_catch_up_are_never_below_the_jobs_minimum():
    """As above with N_min = 3: two on-demand instances would make up the unit, but the job runs
    three or none (the fewest were counted from one: a job with N_min 3 got 2, refused by the
    simulator, found by the random-market bound test)."""
    job = make_job(work=48.0, deadline_hours=24.0, max_instances=4, min_instances=3, reconfig_overhead_hours=0.25, value=500.0)
    available = np.array([[4, 4] if (t < 6 or t >= 9) else [0, 0] for t in range(job.horizon_slots)])
    market = with_free_history(whole(make_market(np.tile([1.0, 1.15], (job.horizon_slots, 1)), available, on_demand_price=3.0)))
    policy = DeadlineChecked(Splitter(), 1.2)
    run = simulate(policy, job, market)
    assert policy.switched_at == 4
    assert run.allocations[6] == Allocation((0, 0), 3)
    assert all(a.total == 0 or a.total >= 3 for a in run.allocations)


class SplitterThenCheapest(Policy):
    """The Splitter's four slots on three pools, then all four instances in the third pool
    wherever it offers them, and idle where it does not."""

    name = "splitter-then-cheapest"

    def decide(self, observation: Observation) -> Allocation:
        if observation.slot < 4:
            return Allocation((2, 2, 0), 0)
        return Allocation((0, 0, 4), 0) if observation.available[2] >= 4 else Allocation((0, 0, 0), 0)


def test_a_handed_over_job_is_taken_back_once_the_members_choice_keeps_the_bound_again():
    """Handed over one restart behind UP at slot 4 (as above), the job tracks UP in the first
    pool. A pool at a third of that price opens at slot 10, where UP stays (Can't Be Late's
    exploitation rule). Moving there costs less an hour than tracking but a restart that UP does
    not make, and UP's cost so far has to grow before the bound allows it with a restart to
    spare; from then on the member runs the job again, in the cheap pool, and it costs less than
    UP, within the bound of a job never handed over. (Tracking to the end, as before, cost UP's
    bills and more.)"""
    job = make_job(work=94.0, deadline_hours=36.0, max_instances=4, reconfig_overhead_hours=0.25, value=1000.0)
    price = np.tile([1.0, 1.15, 0.3], (job.horizon_slots, 1))
    available = np.array([[4, 4, 4 if t >= 10 else 0] for t in range(job.horizon_slots)])
    market = with_free_history(whole(make_market(price, available, on_demand_price=3.0)))
    up = simulate(UniformProgressPolicy(), job, market)
    assert all(a == Allocation((4, 0, 0), 0) for a in up.allocations)  # UP never moves to the cheap pool

    policy = DeadlineChecked(SplitterThenCheapest(), 1.2)
    run = simulate(policy, job, market)
    assert policy.handovers == 1 and policy.returns == 1 and policy.switched_at is None
    back = run.allocations.index(Allocation((0, 0, 4), 0))
    assert run.allocations[4:back] == up.allocations[4:back]  # tracking UP until the member takes the job back
    assert 10 < back < up.outcome.completion_hours  # not as soon as the pool opens, and while UP is at work
    assert all(a == Allocation((0, 0, 4), 0) for a in run.allocations[back:])
    assert not run.outcome.soft_miss
    assert run.outcome.cost < up.outcome.cost
    assert run.outcome.cost <= exact_bound(job, up.outcome.cost, 1.2, floor_at_submission(job, market))


class SplitterThenOnDemand(Policy):
    """The Splitter, then N_max on-demand instances wherever no spot is offered (paying ahead
    against the drop), and idle where it is."""

    name = "splitter-then-on-demand"

    def decide(self, observation: Observation) -> Allocation:
        if observation.slot < 4:
            return Allocation((2, 2), 0)
        return Allocation((0, 0), 4) if observation.available.sum() == 0 else Allocation((0, 0), 0)


def test_a_handed_over_job_is_not_taken_back_by_a_choice_dearer_than_tracking():
    """Handed over at slot 4 as above. No spot is offered in slots 18-20, and UP, ahead of its
    line, idles; tracking makes up the unit on 2 on-demand instances in slot 18 and idles with UP
    after. The member would run 4 on-demand instances there: by then UP's cost so far leaves room
    for it within the bound, so without the price condition (``_takes_back`` with that line
    removed, measured once) it took the job back (107.20 USD against 102.70; found on a
    `chc-auto` job of the held-out seed 301, 1.107 x UP where it had paid 1.016); dearer than
    tracking in the slot, it does not."""
    job = make_job(work=94.0, deadline_hours=36.0, max_instances=4, reconfig_overhead_hours=0.25, value=1000.0)
    available = np.array([[0, 0] if 18 <= t <= 20 else [4, 4] for t in range(job.horizon_slots)])
    market = with_free_history(whole(make_market(np.tile([1.0, 1.15], (job.horizon_slots, 1)), available, on_demand_price=3.0)))
    up = simulate(UniformProgressPolicy(), job, market)
    assert up.allocations[18:21] == [Allocation((0, 0), 0)] * 3

    policy = DeadlineChecked(SplitterThenOnDemand(), 1.2)
    run = simulate(policy, job, market)
    assert policy.handovers == 1 and policy.returns == 0
    assert run.allocations[18:21] == [Allocation((0, 0), 2), Allocation((0, 0), 0), Allocation((0, 0), 0)]
    assert run.outcome.cost == pytest.approx(102.7)


def test_a_job_behind_a_finished_shadow_finishes_on_the_spot_offered_not_on_on_demand():
    """Handed over one unit behind UP, the job tracks UP's 4 instances in the cheaper pool, and
    UP finishes at the end of slot 11. In slot 12 that pool offers only 2, so the job cannot run
    on; 2 instances finish it there, and in its last slot spot is as sure as on-demand (no later
    slot to lose it in): they run in the pool, not on-demand at three times the price (found on
    a 5-zone subset of the GCP trace, where 6 on-demand instances ended a job at 1.27 x UP)."""
    job = make_job(work=47.0, deadline_hours=24.0, max_instances=4, reconfig_overhead_hours=0.25, value=500.0)
    available = np.array([[4, 4] if t < 12 else [2, 4] for t in range(job.horizon_slots)])
    market = with_free_history(whole(make_market(np.tile([1.0, 1.15], (job.horizon_slots, 1)), available, on_demand_price=3.0)))
    up = simulate(UniformProgressPolicy(), job, market)
    assert up.outcome.completion_hours == 12.0 and up.allocations[4:] == [Allocation((4, 0), 0)] * 8

    policy = DeadlineChecked(Splitter(), 1.2)
    run = simulate(policy, job, market)
    assert policy.switched_at == 4 and run.allocations[4:12] == up.allocations[4:12]
    assert run.allocations[12] == Allocation((2, 0), 0)  # 2 x 0.75 h of work make up the unit
    assert run.outcome.completion_hours == 12.75 and not run.outcome.soft_miss
    # UP's bill, plus 2 instances in the dearer pool for 4 slots, plus the 2 spot instances' 0.75 h
    assert run.outcome.cost == pytest.approx(up.outcome.cost + 2 * 4 * 0.15 + 2 * 0.75 * 1.0)
