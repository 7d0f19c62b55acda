"""The sojourn chain: hazards by count and age, and what they change against the Markov chain."""

from __future__ import annotations

import numpy as np
import pytest

from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.forecast.markov_count import MarkovCount
from airflow_provider_spotsched.forecast.sojourn_chain import AGE_EDGES, SojournChain, SojournChainForecaster, age_bucket, ages
from tests.markets import make_market


def semi_markov_counts(rng: np.random.Generator, slots: int) -> np.ndarray:
    """Counts 0, 4 or 8 whose every new level is short-lived half the time (a flap of one or two
    slots) and otherwise holds for 20 to 40 slots: the hazard falls with the count's age."""
    y: list[int] = []
    while len(y) < slots:
        hold = int(rng.integers(1, 3)) if rng.random() < 0.5 else int(rng.integers(20, 41))
        y.extend([int(rng.choice([0, 4, 8]))] * hold)
    return np.array(y[:slots])


def test_ages_count_the_slots_since_the_last_change():
    np.testing.assert_array_equal(ages(np.array([3, 3, 5, 5, 5, 3, 3])), [1, 2, 1, 2, 3, 1, 2])
    np.testing.assert_array_equal(age_bucket(np.array([1, 2, 3, 4, 7, 8, 15, 16, 500])), [0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert AGE_EDGES[0] == 1


def test_hazards_shrink_towards_the_pools_hazard_at_that_age():
    # slots from (count, age): (0, 1) moves, (1, 1) holds, (1, 2) holds, (1, 3) moves, (0, 1) holds
    chain = SojournChain(np.array([0, 1, 1, 1, 0, 0.0]), smoothing=0.1, prior=2.0)
    overall = (2 + 1) / (5 + 2)
    pool_young = (1 + 2 * overall) / (3 + 2)  # age 1: 3 slots, 1 move
    assert chain.hazard[0, 0] == pytest.approx((1 + 2 * pool_young) / (2 + 2))  # count 0 at age 1: 2 slots, 1 move
    assert chain.hazard[1, 0] == pytest.approx((0 + 2 * pool_young) / (1 + 2))
    pool_2_3 = (1 + 2 * overall) / (2 + 2)  # ages 2-3: 2 slots, 1 move
    assert chain.hazard[1, 1] == pytest.approx((1 + 2 * pool_2_3) / (2 + 2))
    assert chain.hazard[0, 4] == pytest.approx(overall)  # never seen at 16+: the pool's rate
    np.testing.assert_allclose(chain.destination.sum(axis=1), 1.0)
    np.testing.assert_allclose(np.diag(chain.destination), 0.0)


def test_the_k_step_distribution_is_a_distribution_over_counts_seen():
    chain = SojournChain(np.array([0, 4, 4, 0, 4, 4, 4, 8.0]), smoothing=0.1, prior=2.0)
    result = chain.forecast(12)
    np.testing.assert_allclose(result.distribution.sum(axis=1), 1.0)
    assert (result.distribution[:, [1, 2, 3, 5, 6, 7]] == 0).all()  # counts never seen get no mass
    assert (result.lower <= result.mean).all() and (result.mean <= result.upper).all()


def test_a_constant_series_forecasts_itself_and_update_equals_a_fit():
    result = SojournChain(np.full(60, 7.0), 0.1, 2.0).update(np.full(62, 7.0)).forecast(24)
    np.testing.assert_allclose(result.mean, 7.0)
    np.testing.assert_allclose([result.lower, result.upper], 7.0)
    y = semi_markov_counts(np.random.default_rng(5), 200).astype(float)
    updated = SojournChain(y[:150], 0.1, 2.0).update(y)
    np.testing.assert_allclose(updated.forecast(6).distribution, SojournChain(y, 0.1, 2.0).forecast(6).distribution)


def test_a_count_just_changed_is_forecast_to_move_more_than_one_that_has_held():
    y = semi_markov_counts(np.random.default_rng(1), 600)
    fresh = np.concatenate([y, [8 if y[-1] != 8 else 4]]).astype(float)  # a change in the last slot
    held = np.concatenate([y, [y[-1]] * 30]).astype(float)  # the same count for 30 slots more
    move_fresh = 1.0 - SojournChain(fresh, 0.1, 2.0).forecast(1).distribution[0, int(fresh[-1])]
    move_held = 1.0 - SojournChain(held, 0.1, 2.0).forecast(1).distribution[0, int(held[-1])]
    assert move_fresh > 2 * move_held
    # the Markov chain gives a count the same chance of moving whatever its age, the long holds' chance
    markov_fresh = 1.0 - MarkovCount(fresh, 0.1).forecast(1).distribution[0, int(fresh[-1])]
    assert markov_fresh < move_fresh / 2


def test_where_the_hazard_falls_with_age_it_forecasts_better_than_the_markov_chain():
    y = semi_markov_counts(np.random.default_rng(2), 700).astype(float)
    markov, sojourn = np.zeros(6), np.zeros(6)  # absolute errors at leads 1..6
    for origin in range(200, 694):
        past, actual = y[: origin + 1], y[origin + 1 : origin + 7]
        markov += np.abs(actual - MarkovCount(past, 0.1).forecast(6).mean)
        sojourn += np.abs(actual - SojournChain(past, 0.1, 2.0).forecast(6).mean)
    assert (sojourn <= markov).all() and sojourn.sum() < markov.sum()


def test_where_the_hazard_does_not_depend_on_age_the_hazards_come_out_flat():
    rng = np.random.default_rng(4)
    y = np.cumsum(rng.random(20000) < 0.2) % 3  # moves with probability 0.2 whatever the age
    np.testing.assert_allclose(SojournChain(y.astype(float), 0.1, 2.0).hazard, 0.2, atol=0.05)


def test_the_forecaster_is_built_by_name_and_refuses_a_bad_prior_by_name():
    forecaster = make_forecaster("sojourn-chain", {"prior": 4, "smoothing": 0.5})
    assert isinstance(forecaster, SojournChainForecaster)
    assert forecaster.params()["prior"] == 4.0 and forecaster.params()["smoothing"] == 0.5
    with pytest.raises(ValueError, match="prior must be a finite number > 0"):
        make_forecaster("sojourn-chain", {"prior": 0})
    with pytest.raises(ValueError, match="smoothing must be a finite number > 0"):
        make_forecaster("sojourn-chain", {"smoothing": True})
    counts = semi_markov_counts(np.random.default_rng(6), 80).reshape(-1, 1)
    forecast = forecaster.forecast(make_market(np.full((80, 1), 1.5), counts), 4)
    assert forecast.models == ("persistence+sojourn-chain",)
    np.testing.assert_allclose(forecast.available_distribution.sum(axis=2), 1.0)
