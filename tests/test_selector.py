"""The online policy selector: its state, its learning guarantees and its warm-up."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling import selector as selector_module
from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.policies import POLICIES, make_policy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import JobMarket, simulate
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.selector import (
    ExponentialWeights,
    SelectorPolicy,
    SelectorStateError,
    golden_draw,
    job_context,
    normalised_loss,
    shortfall_losses,
)
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from tests.markets import make_job, make_market

POOL = [
    {"policy": "on-demand", "params": {}},
    {"policy": "greedy", "params": {}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.5}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.9, "safety_slots": 0.0}},
]
LOSSES = {label: 0.0 for label in SelectorPolicy(POOL).labels}


class Clairvoyant(Policy):
    """A policy that asks for the realised future, as the hindsight optimum does."""

    name = "test-clairvoyant"
    uses_future = True

    def decide(self, observation: Observation) -> Allocation:
        return Allocation.idle(observation.past.num_pools)


def random_market(slots: int, seed: int, cheap: bool = False) -> SlotMarket:
    """Two pools; ``cheap`` makes spot always available at a third of the on-demand price."""
    rng = np.random.default_rng(seed)
    if cheap:
        return make_market(np.full((slots, 2), 1.0), np.full((slots, 2), 2))
    return make_market(rng.uniform(0.5, 3.5, (slots, 2)), rng.integers(0, 3, (slots, 2)))


def job_market(offset: int, seed: int, cheap: bool = False) -> JobMarket:
    return JobMarket(random_market(offset + 12, seed, cheap), offset)


def test_state_round_trips_exactly_through_json():
    job = make_job()
    selector = SelectorPolicy(POOL, seed=3, warm_up_rounds=2)
    for seed in range(3):
        jm = job_market(40, seed)
        simulate(selector, job, jm)
        selector.update(job, jm)
    restored = SelectorPolicy.from_state(json.loads(json.dumps(selector.to_state())))
    assert restored.to_state() == selector.to_state()
    for seed in range(3, 6):
        jm = job_market(40, seed)
        first, second = simulate(selector, job, jm), simulate(restored, job, jm)
        assert first.allocations == second.allocations
        assert selector.update(job, jm) == restored.update(job, jm)
        assert selector.weights(job) == restored.weights(job)
    assert restored.to_state() == selector.to_state()


def test_state_restored_mid_job_keeps_the_member_and_its_probability():
    job = make_job()
    selector = SelectorPolicy(POOL, algorithm="exp3", seed=1, warm_up_rounds=0)
    market = random_market(12, 0)
    observation = Observation(job, 0, market.prefix(1), 0, 0.0, 0.0, Allocation.idle(2))
    selector.reset(job)
    selector.decide(observation)
    restored = SelectorPolicy.from_state(json.loads(json.dumps(selector.to_state())))
    assert restored.playing == selector.playing is not None
    assert restored.decide(observation) == selector.decide(observation)


def test_a_fresh_selector_learns_from_history_before_its_first_job():
    job = make_job()
    selector = SelectorPolicy(POOL, warm_up_rounds=3)
    result = simulate(selector, job, job_market(60, 0))
    assert selector.rounds_learnt(job) == 3
    assert result.outcome.completion_hours is not None


def test_warm_up_never_reads_the_submission_slot_or_later():
    offset = 60
    early, late = random_market(offset + 12, 1), random_market(offset + 12, 2)
    spot_price = np.concatenate([early.spot_price[:offset], late.spot_price[offset:]])
    available = np.concatenate([early.available[:offset], late.available[offset:]])
    twin = make_market(spot_price, available)
    job = make_job()
    explicit = [SelectorPolicy(POOL, warm_up_rounds=3) for _ in range(2)]
    assert [s.warm_up(JobMarket(m, offset), job) for s, m in zip(explicit, (early, twin))] == [3, 3]
    assert explicit[0].to_state() == explicit[1].to_state()
    assert len(set(explicit[0].weights(job).values())) > 1  # the warm-up did learn something
    lazy = [SelectorPolicy(POOL, warm_up_rounds=3) for _ in range(2)]
    for selector, market in zip(lazy, (early, twin)):
        selector.reset(job)
        selector.decide(Observation(job, 0, market.prefix(offset + 1), offset, 0.0, 0.0, Allocation.idle(2)))
    assert lazy[0].to_state() == lazy[1].to_state()
    assert lazy[0].to_state()["contexts"] == explicit[0].to_state()["contexts"]


def test_a_job_that_ran_slower_than_declared_is_replayed_at_the_throughput_it_ran_at():
    job, jm, slow = make_job(), job_market(0, 3), TrueThroughput(0.5)
    selector = SelectorPolicy(POOL, warm_up_rounds=0)
    at_truth = selector.counterfactual_utilities(job, jm, slow)
    assert at_truth == {
        label: simulate(make_policy(entry["policy"], entry["params"]), job, jm, slow).outcome.utility
        for label, entry in zip(selector.labels, POOL)
    }
    declared = selector.counterfactual_utilities(job, jm)
    assert all(at_truth[label] < declared[label] for label in declared), "half the speed: no member does as well"
    losses = selector.close_round(None, job, jm, true_throughput=slow)
    assert losses == shortfall_losses(at_truth, on_demand_cost(job, jm.market.on_demand_price))
    blind = selector.counterfactual_utilities(job, jm, slow, estimate_throughput=False)  # as a run without the estimate
    assert blind == {
        label: simulate(make_policy(entry["policy"], entry["params"]), job, jm, slow, False).outcome.utility
        for label, entry in zip(selector.labels, POOL)
    }
    assert blind != at_truth


def test_hedge_moves_its_weight_off_a_member_that_keeps_losing():
    job = make_job()
    selector = SelectorPolicy(POOL, warm_up_rounds=0)
    for seed in range(40):
        jm = job_market(0, seed, cheap=True)
        simulate(selector, job, jm)
        selector.update(job, jm)
    weights = selector.weights(job)
    assert weights["on-demand"] < 0.05  # spot at a third of its price is always there
    cumulative_loss = selector.to_state()["contexts"][job_context(job)]["cumulative_loss"]
    best = min(cumulative_loss, key=cumulative_loss.get)
    assert weights[best] == max(weights.values())


def test_hedge_concentrates_on_a_stationary_synthetic_sequence():
    rng = np.random.default_rng(0)
    learner = ExponentialWeights(4)
    for _ in range(600):
        learner.learn_full(np.clip(rng.normal([0.3, 0.5, 0.5, 0.7], 0.1), 0, 1))
    assert learner.probabilities()[0] > 0.95


def trap(t: int) -> np.ndarray:
    """Follow the leader's nightmare: after a half loss, members 0 and 1 lose in turn."""
    return np.array([0.5, 0.0, 1.0, 1.0]) if t == 0 else np.array([(t + 1) % 2, t % 2, 1.0, 1.0])


def next_loss(sequence: str, t: int, learner: ExponentialWeights, rng: np.random.Generator) -> np.ndarray:
    """Round ``t``'s losses (1-based) of a test sequence over four members: ``adaptive`` (the
    member the learner trusts most loses), ``random`` or ``trap``."""
    if sequence == "adaptive":
        loss = np.zeros(4)
        loss[int(np.argmax(learner.probabilities()))] = 1.0
        return loss
    return rng.uniform(0, 1, 4) if sequence == "random" else trap(t - 1)


@pytest.mark.parametrize("sequence", ["trap", "adaptive", "random"])
def test_hedge_regret_stays_below_the_proved_bound(sequence):
    k, rounds = 4, 800
    rng = np.random.default_rng(1)
    learner = ExponentialWeights(k)
    played = 0.0
    for t in range(1, rounds + 1):
        loss = next_loss(sequence, t, learner, rng)
        played += float(learner.probabilities() @ loss)
        learner.learn_full(loss)
        regret = played - float(learner.cumulative_loss.min())
        assert regret <= 2 * learner.mixability_gap + 1e-9  # the lemma of docs/selector.md
        assert regret <= math.sqrt(t * math.log(k)) + 2 + 1e-9  # the theorem, at every t


@pytest.mark.parametrize("sequence", ["trap", "adaptive", "random"])
def test_hedge_with_a_prior_stays_below_its_bound_against_every_member(sequence):
    """Against member i the regret is at most (1 + ln(1/pi_i) / ln K) times the sum of the
    mixability gaps (docs/selector.md, "The favourite"): small for the favourite, and still
    O(sqrt T) for the others, on a sequence where the favourite loses as often as not."""
    k, rounds, prior = 4, 800, np.array([6.0, 1.0, 1.0, 1.0])
    pi = prior / prior.sum()
    rng = np.random.default_rng(2)
    learner = ExponentialWeights(k, prior=prior)
    played = 0.0
    for t in range(1, rounds + 1):
        loss = next_loss(sequence, t, learner, rng)
        played += float(learner.probabilities() @ loss)
        learner.learn_full(loss)
        regret = played - learner.cumulative_loss
        factor = 1 + np.log(1 / pi) / math.log(k)
        assert np.all(regret <= factor * learner.mixability_gap + 1e-9)
        assert np.all(regret <= factor * (1 + 0.5 * math.sqrt(t * math.log(k))) + 1e-9)


def test_a_prior_weighs_the_first_round_and_the_tied_leaders():
    learner = ExponentialWeights(3, prior=[2.0, 1.0, 1.0])
    assert learner.probabilities().tolist() == [0.5, 0.25, 0.25]
    learner.learn_full([0.0, 0.0, 0.4])  # the draw may land on the loser: a gap of 0.25 * 0.4
    assert learner.mixability_gap == pytest.approx(0.1)
    learner.cumulative_loss, learner.mixability_gap = np.array([0.0, 0.0, 1.0]), 0.0
    assert learner.probabilities().tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])  # following the leaders, by prior
    masked = ExponentialWeights(3, active=[False, True, True], prior=[5.0, 1.0, 3.0])
    assert masked.probabilities().tolist() == pytest.approx([0.0, 0.25, 0.75])  # normalised over the members in play
    rng = np.random.default_rng(4)
    uniform, plain = ExponentialWeights(3, prior=[2.0, 2.0, 2.0]), ExponentialWeights(3)
    for _ in range(30):  # a uniform prior of any size is the plain learner, to the last bit
        loss = rng.uniform(0, 1, 3)
        uniform.learn_full(loss)
        plain.learn_full(loss)
        assert uniform.probabilities().tolist() == plain.probabilities().tolist()
    assert uniform.mixability_gap == plain.mixability_gap


def test_a_pool_members_prior_is_kept_in_the_state_and_refused_when_malformed():
    pool = [{**POOL[0], "prior": 3}, *POOL[1:3], {**POOL[3], "prior": 1}]
    selector = SelectorPolicy(pool, warm_up_rounds=0)
    assert selector.pool[3] == POOL[3]  # the default weight is not written: a pool without priors keeps its documents
    job = make_job()
    assert list(selector.weights(job).values()) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])
    restored = SelectorPolicy.from_state(json.loads(json.dumps(selector.to_state())))
    assert restored.weights(job) == selector.weights(job) and restored.to_state() == selector.to_state()
    assert selector.differences(SelectorPolicy(POOL, warm_up_rounds=0)) == [
        "pool: prior weights stored [3.0, 1.0, 1.0, 1.0], asked [1.0, 1.0, 1.0, 1.0]"
    ]
    rescaled = SelectorPolicy([{**POOL[0], "prior": 6}, *({**entry, "prior": 2} for entry in POOL[1:])], warm_up_rounds=0)
    assert selector.differences(rescaled) == []  # relative weights: the same prior
    extreme = SelectorPolicy([{**POOL[0], "prior": 1e308}, {**POOL[1], "prior": 1e308}, {**POOL[2], "prior": 1e-300}], warm_up_rounds=0)
    assert list(extreme.weights(job).values()) == pytest.approx([0.5, 0.5, 0.0])  # no sum of weights overflows
    for bad in (0, -1, "2", True, float("nan")):
        with pytest.raises(ValueError, match=r"pool\[0\]\.prior must be a number > 0"):
            SelectorPolicy([{**POOL[0], "prior": bad}])


def test_the_default_pool_starts_its_favourite_twice_as_likely_as_the_others_together():
    selector = SelectorPolicy(warm_up_rounds=0)
    weights = list(selector.weights(make_job()).values())
    assert weights == pytest.approx([2 / 3] + [1 / 21] * 7)
    assert selector.labels[0].startswith("chc(window=24,commit=1,forecaster=blend")


def test_hedge_follows_a_leader_that_keeps_winning():
    learner, played, loss = ExponentialWeights(4), 0.0, np.array([0.0, 0.4, 0.7, 1.0])
    for _ in range(400):
        played += float(learner.probabilities() @ loss)
        learner.learn_full(loss)
    assert learner.probabilities()[0] > 0.999
    assert played - learner.cumulative_loss.min() < 1.0  # constant regret, where the worst case allows 25


def test_hedge_mix_loss_holds_at_a_learning_rate_where_weights_underflow():
    learner = ExponentialWeights(2)
    learner.cumulative_loss, learner.mixability_gap, learner.rounds = np.array([0.0, 1000.0]), 1e-4, 5
    assert learner.eta() > 6000 and learner.probabilities().tolist() == [1.0, 0.0]
    learner.learn_full([1.0, 0.0])  # the leader loses; the other member's weight is exp(-7e6)
    assert learner.mixability_gap == pytest.approx(1e-4)  # all weight on the leader: no gap


def test_draws_are_uniform_and_spread_evenly():
    selector = SelectorPolicy(POOL, seed=5, warm_up_rounds=0)
    job, history = make_job(), job_market(0, 0)
    rounds = [selector.open_round(job, history) for _ in range(1000)]
    draws = np.array([golden_draw(5, played.draw) for played in rounds])
    assert selector.to_state()["draws"] == 1000 and draws.min() >= 0.0 and draws.max() < 1.0
    for n in (10, 100, 1000):  # every interval of length 1/n holds about one draw in n
        counts = np.bincount(np.floor(draws[:n] * n).astype(int), minlength=n)
        assert counts.max() <= 3
    shares = np.bincount(np.searchsorted(np.cumsum([0.5, 0.3, 0.2]), draws[:100], side="right"), minlength=3)
    assert np.all(np.abs(shares - [50, 30, 20]) <= 2)  # independent draws stray by about 5


def test_each_kind_of_job_learns_on_its_own_and_warms_up_on_its_own():
    small, large = make_job(), make_job(max_instances=3)
    selector = SelectorPolicy(POOL, warm_up_rounds=2)
    simulate(selector, small, job_market(60, 0))
    assert selector.rounds_learnt(small) == 2
    before = selector.weights(large)  # not seen yet: uniform, and reading it creates nothing
    assert len(set(before.values())) == 1 and not selector.knows(large)
    assert selector.rounds_learnt(large) == 0
    selector.update(small, job_market(60, 0))
    assert selector.weights(large) == before
    simulate(selector, large, job_market(60, 1))
    assert selector.rounds_learnt(large) == 2  # warmed up on its own kind's windows
    assert job_context(small) != job_context(large)
    assert list(selector.to_state()["contexts"]) == [job_context(small), job_context(large)]


def test_the_state_keeps_the_most_recently_played_kinds(monkeypatch):
    monkeypatch.setattr(selector_module, "MAX_CONTEXTS", 2)
    selector = SelectorPolicy(POOL, warm_up_rounds=0)
    jobs = [make_job(max_instances=n) for n in (1, 2, 3)]
    for job in (*jobs, jobs[1]):
        selector.open_round(job, job_market(0, 0))
    assert list(selector.to_state()["contexts"]) == [job_context(jobs[2]), job_context(jobs[1])]


def test_a_kind_the_selector_has_not_learnt_takes_the_warm_up_of_the_selector_a_run_started_from(monkeypatch):
    """A run warms a new kind up on the selector it started from and closes its round on the stored
    one: a stored selector that learnt nothing for the kind takes the warmed-up learner, as its
    most recently played kind (dropping the least recent beyond MAX_CONTEXTS)."""
    monkeypatch.setattr(selector_module, "MAX_CONTEXTS", 2)
    jobs = [make_job(max_instances=n) for n in (1, 2, 3)]
    stored = SelectorPolicy(POOL, warm_up_rounds=2)
    for job in jobs[:2]:
        stored.open_round(job, job_market(0, 0))  # no history: known kinds, 0 rounds
    start = SelectorPolicy.from_state(stored.to_state())
    start.open_round(jobs[2], job_market(60, 0))
    assert start.rounds_learnt(jobs[2]) == 2
    assert stored.take_warm_up(start, jobs[2]) and stored.rounds_learnt(jobs[2]) == 2
    assert list(stored.to_state()["contexts"]) == [job_context(jobs[1]), job_context(jobs[2])]
    assert stored.to_state()["contexts"][job_context(jobs[2])] == start.to_state()["contexts"][job_context(jobs[2])]
    stored.update(jobs[2], job_market(60, 0))
    assert start.rounds_learnt(jobs[2]) == 2  # a copy: learning on it leaves the run's selector alone
    assert not stored.take_warm_up(start, jobs[2]) and stored.rounds_learnt(jobs[2]) == 3  # a learnt kind keeps its learner
    assert not start.take_warm_up(stored, jobs[0])  # nothing learnt to take
    with pytest.raises(ValueError, match="same pool, algorithm, seed and warm-up"):
        SelectorPolicy(POOL, warm_up_rounds=2, seed=1).take_warm_up(start, jobs[2])


def test_a_job_kind_names_instances_slack_overhead_and_slot():
    job = make_job()
    assert job_context(job) == job_context(replace(job, value=99.0, start=None))
    assert job_context(job) != job_context(replace(job, deadline_hours=job.deadline_hours * 2))
    assert job_context(job) != job_context(replace(job, reconfig_overhead_hours=0.5))


def test_exp3_importance_weighting_estimates_the_true_cumulative_loss():
    k, rounds = 3, 2000
    losses = np.clip(np.random.default_rng(2).normal([0.45, 0.5, 0.55], 0.2, (rounds, k)), 0, 1)
    estimates = []
    for seed in range(10):
        learner, draws = ExponentialWeights(k, algorithm="exp3"), np.random.default_rng(seed)
        for loss in losses:
            index, probability = learner.choose(draws.random())
            learner.learn_bandit(index, loss[index], probability)
        estimates.append(learner.cumulative_loss)
    true = losses.sum(axis=0)
    assert np.all(np.abs(np.mean(estimates, axis=0) - true) < 0.05 * true)


def test_exp3_expected_regret_stays_below_the_proved_bound():
    k, rounds = 4, 500
    losses = np.clip(np.random.default_rng(3).normal([0.3, 0.5, 0.5, 0.6], 0.2, (rounds, k)), 0, 1)
    regrets = []
    for seed in range(20):
        learner, draws = ExponentialWeights(k, algorithm="exp3"), np.random.default_rng(seed)
        played = 0.0
        for loss in losses:
            index, probability = learner.choose(draws.random())
            played += loss[index]
            learner.learn_bandit(index, loss[index], probability)
        regrets.append(played - losses.sum(axis=0).min())
    assert np.mean(regrets) <= 2 * math.sqrt(rounds * k * math.log(k))


def test_hedge_reuses_the_played_members_realised_utility():
    job, jm = make_job(), job_market(0, 4)
    given, replayed = (SelectorPolicy(POOL, warm_up_rounds=0) for _ in range(2))
    result = simulate(given, job, jm)
    simulate(replayed, job, jm)
    given.update(job, jm, {given.playing: result.outcome.utility})
    replayed.update(job, jm)
    assert given.to_state() == replayed.to_state()


def test_exp3_learns_the_played_member_only():
    job = make_job()
    selector = SelectorPolicy(POOL, algorithm="exp3", warm_up_rounds=0)
    jm = job_market(0, 0)
    with pytest.raises(ValueError, match="run the job through decide first"):
        selector.update(job, jm)
    simulate(selector, job, jm)
    played = selector.playing
    losses = selector.update(job, jm, {played: 5.0})
    assert list(losses) == [played]
    assert losses[played] == normalised_loss(job, 5.0, on_demand_cost(job, 3.0))


def test_a_round_closed_on_another_copy_learns_what_the_open_round_would():
    job, jm = make_job(), job_market(0, 5)
    start = SelectorPolicy(POOL, algorithm="exp3", seed=2, warm_up_rounds=0).to_state()
    played_here = SelectorPolicy.from_state(start)  # decide opens the round, update closes it
    simulate(played_here, job, jm)
    label = played_here.playing
    played_here.update(job, jm, {label: 5.0})
    run, store = SelectorPolicy.from_state(start), SelectorPolicy.from_state(start)
    opened = run.open_round(job, jm)  # an online run plays the member itself
    run.drop_round()
    assert opened.label == label and run.to_state()["current"] is None and run.to_state()["draws"] == 1
    store.close_round(store.recorded_round(opened.label, opened.probability, opened.draw), job, jm, {label: 5.0})
    assert store.to_state() == played_here.to_state()  # same loss, and the next draw after the run's


def test_a_sequence_of_rounds_can_be_replayed_from_any_draw():
    job, jm = make_job(), job_market(0, 0)
    whole = SelectorPolicy(POOL, seed=4, warm_up_rounds=0)
    rounds = [whole.open_round(job, jm) for _ in range(4)]
    part = SelectorPolicy(POOL, seed=4, warm_up_rounds=0)
    part.set_next_draw(2)
    simulate(part, job, jm)
    assert part.current_round == rounds[2] and part.to_state()["draws"] == 3
    with pytest.raises(ValueError, match="draw number"):
        part.set_next_draw(-1)


def test_loss_is_normalised_by_value_plus_on_demand_cost():
    job = make_job()  # 8 units on 2 on-demand instances at $3: 4 h, $24; V0 = 30
    assert on_demand_cost(job, 3.0) == pytest.approx(24.0)
    assert normalised_loss(job, 30.0, 24.0) == 0.0
    assert normalised_loss(job, 6.0, 24.0) == pytest.approx(24 / 54)
    assert normalised_loss(job, -100.0, 24.0) == 1.0


def test_default_pool_builds_through_the_registry():
    selector = make_policy("selector", {"seed": 2})
    assert 6 <= len(selector.labels) <= 10
    assert selector.label.startswith(f"selector(pool={len(selector.labels)}:")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"version": 0}, "'version'"),
        ({"version": None}, "'version'"),
        ({"draws": 1.5}, "'draws'"),
        ({"contexts": []}, "'contexts'"),
        ({"contexts": {"k": {"cumulative_loss": {"on-demand": 0.0}, "rounds": 1, "mixability_gap": 0.0}}}, "'k'.*cumulative_loss"),
        ({"contexts": {"k": {"cumulative_loss": LOSSES, "rounds": -1, "mixability_gap": 0.0}}}, "'k'.*'rounds'"),
        ({"contexts": {"k": {"cumulative_loss": LOSSES, "rounds": 1, "mixability_gap": -1.0}}}, "'k'.*'mixability_gap'"),
        ({"contexts": {"k": {"cumulative_loss": LOSSES, "rounds": 1}}}, "'k'.*exactly"),
        ({"current": {"member": "nobody", "probability": 0.5}}, "'current'"),
        ({"algorithm": "ucb"}, "algorithm"),
        ({"pool": []}, "pool"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_malformed_state_is_refused_naming_the_field(change, field):
    state = {**SelectorPolicy(POOL).to_state(), **change}
    with pytest.raises(SelectorStateError, match=field):
        SelectorPolicy.from_state(state)


def test_a_version_1_state_is_upgraded_keeping_settings_and_draws(caplog):
    version_1 = {
        "version": 1, "pool": POOL, "algorithm": "hedge", "choice": "sample", "horizon": None, "seed": 4,
        "warm_up_rounds": 16, "loss_scale": 0.02, "cumulative_loss": dict(LOSSES), "rounds": 20, "draws": 9,
        "current": None,
    }
    selector = SelectorPolicy.from_state(version_1)
    assert selector.params() == {"pool": POOL, "algorithm": "hedge", "seed": 4, "warm_up_rounds": 16}
    assert selector.to_state()["draws"] == 9 and not selector.to_state()["contexts"]
    assert "not carried over" in caplog.text


def test_state_that_is_not_an_object_is_refused():
    with pytest.raises(SelectorStateError, match="JSON object"):
        SelectorPolicy.from_state([1, 2])
    state = SelectorPolicy(POOL).to_state()
    del state["seed"]
    with pytest.raises(SelectorStateError, match=r"missing field\(s\) \['seed'\]"):
        SelectorPolicy.from_state(state)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pool": [{"policy": "selector"}]}, "pool\\[0\\] is a selector"),
        ({"pool": [{"policy": "test-clairvoyant"}]}, "sees the future"),
        ({"pool": [{"policy": "on-demand"}, {"policy": "on-demand"}]}, "same member twice"),
        ({"pool": [{"policy": "greedy", "params": {"nope": 1}}]}, "pool\\[0\\]: .*nope"),
        ({"pool": POOL, "algorithm": "ucb"}, "algorithm"),
        ({"pool": POOL, "seed": -1}, "seed"),
        ({"pool": POOL, "warm_up_rounds": -1}, "warm_up_rounds"),
    ],
)
def test_bad_configuration_is_refused_with_the_fix(kwargs, message, monkeypatch):
    monkeypatch.setitem(POLICIES, "test-clairvoyant", f"{__name__}:Clairvoyant")
    with pytest.raises(ValueError, match=message):
        SelectorPolicy(**kwargs)


def test_full_information_losses_are_shortfalls_from_the_rounds_best():
    losses = shortfall_losses({"a": 10.0, "b": 9.0, "c": -50.0}, scale=2.0)
    assert losses == {"a": 0.0, "b": pytest.approx(0.5), "c": 1.0}


SINGLE_POOL = [*POOL, {"policy": "skynomad", "params": {}}]


def test_a_single_instance_member_plays_and_learns_only_on_single_instance_jobs():
    selector = SelectorPolicy(SINGLE_POOL, warm_up_rounds=2)
    skynomad = selector.labels[-1]
    multi, single = make_job(), make_job(max_instances=1, work=4.0)
    jm = job_market(60, 0)
    simulate(selector, multi, jm)  # would raise if SkyNomad were asked to run N_max = 2
    assert skynomad not in selector.weights(multi) and selector.playing != skynomad
    assert skynomad not in selector.update(multi, jm)
    assert skynomad not in selector.counterfactual_utilities(multi, jm)
    assert selector.to_state()["contexts"][job_context(multi)]["cumulative_loss"][skynomad] == 0.0
    simulate(selector, single, jm)
    assert selector.weights(single)[skynomad] > 0
    assert set(selector.update(single, jm)) == set(selector.labels)
    assert sum(selector.weights(single).values()) == pytest.approx(1.0)


def test_a_masked_learner_is_hedge_over_its_active_members():
    masked = ExponentialWeights(3, active=[True, False, True])
    plain = ExponentialWeights(2)
    rng = np.random.default_rng(5)
    for _ in range(20):
        loss = rng.uniform(0, 1, 3)
        masked.learn_full(loss)
        plain.learn_full(loss[[0, 2]])
        assert masked.probabilities()[[0, 2]] == pytest.approx(plain.probabilities())
        assert masked.probabilities()[1] == 0.0
    assert masked.mixability_gap == pytest.approx(plain.mixability_gap)
    with pytest.raises(ValueError, match="cannot run this kind of job"):
        masked.learn_bandit(1, 0.5, 0.5)


@pytest.mark.parametrize("algorithm", ["hedge", "exp3"])
def test_a_learner_with_one_active_member_plays_it_under_either_algorithm(algorithm):
    """EXP3's rate sqrt(ln k / (t k)) is 0 for k = 1: the masked members then got NaN weights
    (0 * inf) and a full-information round divided by it."""
    learner = ExponentialWeights(2, algorithm=algorithm, active=[False, True])
    for _ in range(3):
        assert learner.probabilities().tolist() == [0.0, 1.0]
        learner.learn_full(np.array([0.3, 0.6]))
    assert learner.choose(0.99) == (1, 1.0)
    learner.learn_bandit(1, 0.6, 1.0)
    selector = SelectorPolicy([{"policy": "skynomad"}, {"policy": "greedy"}], algorithm="exp3", warm_up_rounds=1)
    simulate(selector, make_job(), job_market(60, 10))  # N_max 2: greedy alone can run it
    assert selector.playing == selector.labels[1]


def test_a_restored_selector_keeps_single_instance_members_out_of_multi_instance_kinds():
    selector = SelectorPolicy(SINGLE_POOL, warm_up_rounds=1)
    multi = make_job()
    jm = job_market(60, 1)
    simulate(selector, multi, jm)
    selector.update(multi, jm)
    restored = SelectorPolicy.from_state(json.loads(json.dumps(selector.to_state())))
    assert restored.weights(multi) == selector.weights(multi)
    assert restored.labels[-1] not in restored.weights(multi)
    assert simulate(restored, multi, jm).allocations == simulate(selector, multi, jm).allocations
