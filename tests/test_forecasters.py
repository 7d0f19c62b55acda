"""The simple forecasters: persistence, seasonal naive and the noisy oracle, on hand-made markets."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest

from airflow_provider_spotsched.forecast import FORECASTERS, LIVE_FORECASTERS, make_forecaster, markov_count
from airflow_provider_spotsched.forecast.oracle import OracleForecaster
from airflow_provider_spotsched.forecast.persistence import PersistenceForecaster
from airflow_provider_spotsched.forecast.seasonal_naive import SeasonalNaiveForecaster
from airflow_provider_spotsched.forecast.series import SeriesState, fit_persistence
from tests.markets import make_market

# 10 slots, 2 pools: prices 1.0, 1.1, ... in pool 0 and 10x that in pool 1; counts t % 4 and 3 - t % 4
PRICES = [[1.0 + t / 10, 10.0 + t] for t in range(10)]
COUNTS = [[t % 4, 3 - t % 4] for t in range(10)]
MARKET = make_market(PRICES, COUNTS)


def test_every_forecaster_in_the_registry_is_built_by_name():
    assert {"persistence", "seasonal-naive", "oracle"} <= set(FORECASTERS)
    assert isinstance(make_forecaster("seasonal-naive", {"season_slots": 3}), SeasonalNaiveForecaster)
    with pytest.raises(ValueError, match="takes no parameter"):
        make_forecaster("persistence", {"season_slots": 3})


@pytest.mark.parametrize(("slot_hours", "season"), [(1.0, 24), (0.5, 48), (0.25, 96), (3.0, 8), (48.0, 1)])
@pytest.mark.parametrize("name", ["seasonal-naive", "arima", "holt-winters", "auto"])
def test_a_daily_season_is_a_day_of_the_markets_slots(name, slot_hours, season):
    """24 slots are a day of hourly slots only: on half-hour slots seasonal naive would copy the
    slot half a day back, the opposite phase of a daily cycle."""
    assert make_forecaster(name, slot_hours=slot_hours).params()["season_slots"] == season
    assert make_forecaster(name, {"season_slots": 5}, slot_hours=slot_hours).params()["season_slots"] == 5  # given, kept


def test_a_forecaster_without_a_season_ignores_the_slot_hours():
    markov = make_forecaster("markov-count", slot_hours=0.5).params()
    assert {**markov, "refit_every": 24} == make_forecaster("markov-count").params()  # only its refit is a day
    assert isinstance(make_forecaster("persistence", slot_hours=0.5), PersistenceForecaster)


@pytest.mark.parametrize("name", LIVE_FORECASTERS)
def test_hourly_slots_keep_every_default(name):
    """The defaults count hourly slots: on hourly slots every figure stays what it was."""
    assert make_forecaster(name, slot_hours=1.0).params() == make_forecaster(name).params()


@pytest.mark.parametrize(
    ("slot_hours", "refit", "reselect", "origins", "horizon", "training"),
    [(1.0, 24, 168, 144, 24, 48), (0.25, 96, 672, 576, 96, 192), (2.0, 12, 84, 72, 12, 24), (48.0, 1, 4, 3, 1, 1)],
)
def test_refits_reselections_and_autos_backtest_are_durations_in_the_markets_slots(
    slot_hours, refit, reselect, origins, horizon, training
):
    """A refit once a day, a choice once a week, six days of backtest origins, a day ahead and two
    days of training: on 15-minute slots 24 and 168 slots would be 6 and 42 hours."""
    for name in ("arima", "holt-winters", "markov-count", "sojourn-chain", "auto"):
        assert make_forecaster(name, slot_hours=slot_hours).params()["refit_every"] == refit
    params = make_forecaster("auto", slot_hours=slot_hours).params()
    assert (params["reselect_every"], params["origins"], params["backtest_horizon"], params["min_training"]) == (
        reselect, origins, horizon, training
    )
    given = {"refit_every": 5, "reselect_every": 7, "origins": 11, "backtest_horizon": 13, "min_training": 17}
    assert {k: v for k, v in make_forecaster("auto", given, slot_hours=slot_hours).params().items() if k in given} == given


def test_autos_backtest_on_15_minute_slots_spans_the_documented_days():
    """Six days of scored origins, each after two days of history, and a new choice after a week."""
    forecaster = make_forecaster("auto", slot_hours=0.25)
    n = 10 * 96  # ten days of history
    origins = forecaster.backtest_origins(n)
    scored = forecaster.bucket_rows(origins, n, forecaster.backtest_horizon)
    assert scored.size * 0.25 == 6 * 24.0 and forecaster.backtest_horizon * 0.25 == 24.0
    assert min(forecaster.backtest_origins(3 * 96)) == 2 * 96  # two days of training before the first
    state = SeriesState(np.zeros(n), fit_persistence(np.zeros(n)), n, [], n)
    assert not forecaster.needs_ranking(state, n + 7 * 96 - 1) and forecaster.needs_ranking(state, n + 7 * 96)


def test_a_statistical_model_on_15_minute_slots_is_refitted_once_a_day(monkeypatch):
    """Updated between refits: 24 slots (6 hours) on, the chain is updated, a day on refitted."""
    fits = []
    original = markov_count.MarkovCount

    def counted(history, smoothing, *rest):
        if not rest:  # a fit, not an update from the moves counted before
            fits.append(history.size)
        return original(history, smoothing, *rest)

    monkeypatch.setattr(markov_count, "MarkovCount", counted)
    slots = 3 * 96
    market = make_market(np.ones((slots, 1)), (np.arange(slots) % 7 < 3)[:, None].astype(int), slot_hours=0.25)
    forecaster = make_forecaster("markov-count", slot_hours=0.25)
    for seen in (100, 124, 195, 196):
        forecaster.forecast(market.prefix(seen), 4)
    assert fits == [100, 196]


@pytest.mark.parametrize("forecaster", [PersistenceForecaster(), SeasonalNaiveForecaster(3), OracleForecaster(0.3)])
def test_requests_that_cannot_be_answered_are_refused(forecaster):
    if isinstance(forecaster, OracleForecaster):
        forecaster.reveal(MARKET)
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        forecaster.forecast(MARKET.prefix(4), 0)
    with pytest.raises(ValueError, match="past holds no slot"):
        forecaster.forecast(MARKET.prefix(0), 3)


def test_persistence_repeats_the_last_slot():
    forecast = PersistenceForecaster().forecast(MARKET.prefix(4), 3)
    assert forecast.horizon == 3 and forecast.available.shape == (3, 2)
    np.testing.assert_allclose(forecast.spot_price, [[1.3, 13.0]] * 3)
    np.testing.assert_array_equal(forecast.available, [[3, 0]] * 3)


def test_seasonal_naive_repeats_the_last_season():
    # 7 slots seen (0..6), season 3: slots 7, 8, 9 are slots 4, 5, 6; slots 10, 11 are 4, 5 again
    forecast = SeasonalNaiveForecaster(season_slots=3).forecast(MARKET.prefix(7), 5)
    np.testing.assert_allclose(forecast.spot_price[:, 0], [1.4, 1.5, 1.6, 1.4, 1.5])
    np.testing.assert_array_equal(forecast.available[:, 1], [3, 2, 1, 3, 2])


def test_seasonal_naive_falls_back_to_persistence_before_the_history_starts():
    # 2 slots seen, season 3: slot 2 has no slot a season earlier (the last slot stands in);
    # slots 3 and 4 are slots 0 and 1
    forecast = SeasonalNaiveForecaster(season_slots=3).forecast(MARKET.prefix(2), 3)
    np.testing.assert_allclose(forecast.spot_price[:, 0], [1.1, 1.0, 1.1])
    assert not np.isnan(forecast.spot_price).any()


@pytest.mark.parametrize("season", [0, -1, 2.5, True])
def test_seasonal_naive_refuses_a_bad_season(season):
    with pytest.raises(ValueError, match="season_slots must be an integer >= 1"):
        SeasonalNaiveForecaster(season_slots=season)


def test_the_exact_oracle_returns_the_true_future_aligned_by_time():
    # the job starts at slot 3 of MARKET; the policy's past also holds the 3 slots before it
    oracle = OracleForecaster()
    assert OracleForecaster.uses_future
    oracle.reveal(MARKET.window(3))
    forecast = oracle.forecast(MARKET.prefix(5), 3)  # now = slot 4, forecast slots 5, 6, 7
    np.testing.assert_array_equal(forecast.spot_price, MARKET.spot_price[5:8])
    np.testing.assert_array_equal(forecast.available, MARKET.available[5:8])


def test_the_oracle_repeats_the_last_revealed_slot_after_the_market_ends():
    oracle = OracleForecaster()
    oracle.reveal(MARKET)
    forecast = oracle.forecast(MARKET.prefix(8), 4)  # slots 8, 9, then past the end
    np.testing.assert_array_equal(forecast.spot_price, MARKET.spot_price[[8, 9, 9, 9]])


def test_oracle_noise_has_the_requested_size_and_repeats_for_a_seed():
    long = make_market([[2.0, 4.0]] * 400, [[4, 2]] * 400)
    noisy = OracleForecaster(error=0.2, seed=7)
    noisy.reveal(long)
    forecast = noisy.forecast(long.prefix(1), 399)
    ratio = np.log(forecast.spot_price / long.spot_price[1:])
    assert np.std(ratio) == pytest.approx(0.2, rel=0.15)
    assert abs(np.mean(forecast.spot_price / long.spot_price[1:]) - 1.0) < 0.05  # unbiased
    counts = forecast.available
    assert np.array_equal(counts, np.rint(counts)) and counts.min() >= 0
    assert (counts.max(axis=0) <= [4, 2]).all() and (counts != long.available[1:]).any()
    assert not np.isnan(forecast.spot_price).any()

    again = OracleForecaster(error=0.2, seed=7)
    again.reveal(long)
    np.testing.assert_array_equal(again.forecast(long.prefix(1), 399).spot_price, forecast.spot_price)
    other = OracleForecaster(error=0.2, seed=8)
    other.reveal(long)
    assert not np.array_equal(other.forecast(long.prefix(1), 399).spot_price, forecast.spot_price)


def test_oracle_refuses_to_answer_before_reveal_or_off_the_revealed_market():
    oracle = OracleForecaster()
    with pytest.raises(ValueError, match="call reveal"):
        oracle.forecast(MARKET.prefix(3), 2)
    oracle.reveal(MARKET.window(5))
    with pytest.raises(ValueError, match="at or after its start"):
        oracle.forecast(MARKET.prefix(3), 2)  # slot 3 lies before the revealed market
    shifted = replace(MARKET, start=MARKET.start + timedelta(minutes=30))
    with pytest.raises(ValueError, match="slot grid"):
        oracle.forecast(shifted.prefix(7), 2)
    with pytest.raises(ValueError, match="does not match the revealed market"):
        oracle.forecast(make_market([[1.0]] * 6, [[1]] * 6), 2)
    with pytest.raises(ValueError, match="error must be a finite number >= 0"):
        OracleForecaster(error=-0.1)
    with pytest.raises(ValueError, match="error must be a finite number >= 0"):
        OracleForecaster(error=float("inf"))
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        OracleForecaster(seed=-1)


def test_an_oracle_with_a_lead_sees_that_far_and_holds_the_last_slot_it_saw():
    oracle = OracleForecaster(lead=2)
    oracle.reveal(MARKET)
    forecast = oracle.forecast(MARKET.prefix(4), 4)  # now = slot 3; it sees slots 4, 5 and holds 5
    np.testing.assert_array_equal(forecast.available, MARKET.available[[4, 5, 5, 5]])
    np.testing.assert_allclose(forecast.spot_price, MARKET.spot_price[[4, 5, 5, 5]])
    blind = OracleForecaster(lead=0)
    blind.reveal(MARKET)
    persistence = PersistenceForecaster().forecast(MARKET.prefix(4), 4)
    np.testing.assert_array_equal(blind.forecast(MARKET.prefix(4), 4).available, persistence.available)
    np.testing.assert_allclose(blind.forecast(MARKET.prefix(4), 4).spot_price, persistence.spot_price)


def test_an_oracle_that_reveals_drops_only_keeps_prices_and_rises_as_they_are_now():
    # now = slot 2, counts [2, 1]; slots 3..6 bring pool 0: 3, 0, 1, 2 and pool 1: 0, 3, 2, 1
    oracle = OracleForecaster(reveals="drops")
    oracle.reveal(MARKET)
    forecast = oracle.forecast(MARKET.prefix(3), 4)
    np.testing.assert_array_equal(forecast.available, [[2, 0], [0, 1], [1, 1], [2, 1]])
    np.testing.assert_allclose(forecast.spot_price, [[1.2, 12.0]] * 4)
    counts_only = OracleForecaster(reveals="available")
    counts_only.reveal(MARKET)
    np.testing.assert_array_equal(counts_only.forecast(MARKET.prefix(3), 4).available, MARKET.available[3:7])
    np.testing.assert_allclose(counts_only.forecast(MARKET.prefix(3), 4).spot_price, [[1.2, 12.0]] * 4)


@pytest.mark.parametrize("params, field", [({"lead": -1}, "lead"), ({"lead": 1.5}, "lead"), ({"reveals": "prices"}, "reveals")])
def test_an_oracle_refuses_a_lead_or_a_part_it_cannot_reveal(params, field):
    with pytest.raises(ValueError, match=field):
        OracleForecaster(**params)


def test_the_oracle_names_its_narrowing_only_when_it_narrows():
    assert OracleForecaster().params() == {"error": 0.0, "seed": 0}
    assert OracleForecaster(lead=1, reveals="drops").params() == {"error": 0.0, "seed": 0, "lead": 1, "reveals": "drops"}
