"""The statistical forecasters (ARIMA, Holt-Winters, Markov count chain, automatic choice) on small markets."""

from __future__ import annotations

import logging
import warnings
from datetime import datetime, timezone

import numpy as np
import pandas as pd
import pytest
from statsmodels.tsa.exponential_smoothing.ets import ETSModel
from statsmodels.tsa.statespace.sarimax import SARIMAX

from airflow_provider_spotsched.forecast import arima, auto, exponential_smoothing, make_forecaster
from airflow_provider_spotsched.forecast.arima import ArimaForecaster, FittedArima, fit_arima
from airflow_provider_spotsched.forecast.auto import AutoForecaster, diebold_mariano
from airflow_provider_spotsched.forecast.exponential_smoothing import FittedSmoothing, fit_holt_winters
from airflow_provider_spotsched.forecast.markov_count import MarkovCount, MarkovCountForecaster
from airflow_provider_spotsched.forecast.series import (
    FitError,
    FittedSeries,
    SeriesForecast,
    Stitched,
    count_distribution,
    fit_persistence,
    fit_persistence_counts,
    lagged_counts,
    seasonal_naive_fit,
    seasonal_strength,
)
from airflow_provider_spotsched.forecast.snapshot import market_at
from tests.markets import make_market

NAMES = ["arima", "holt-winters", "markov-count", "sojourn-chain", "auto"]
SEASON = 6  # a short "day" keeps the seasonal fits small and the tests fast
PARAMS = {
    "arima": {"season_slots": SEASON},
    "holt-winters": {"season_slots": SEASON},
    "markov-count": {},
    "sojourn-chain": {},
    "auto": {"season_slots": SEASON, "backtest_horizon": SEASON},
}
SLOTS = 96
T = np.arange(SLOTS)
RNG = np.random.default_rng(3)
# pool 0: a price with a "daily" cycle, counts 0..4 with the same rhythm; pool 1: a constant price
# (like GCP) whose counts fall into a hole (0, at the last price) for slots 40..45; pool 2: a random
# walk, 0/1 counts
PRICES = np.column_stack([
    2.0 + 0.2 * np.sin(2 * np.pi * T / SEASON) + 0.02 * RNG.standard_normal(SLOTS),
    np.full(SLOTS, 2.3724),
    1.0 + np.cumsum(0.01 * RNG.standard_normal(SLOTS)),
])
COUNTS = np.column_stack([
    np.clip(np.rint(2 + 2 * np.sin(2 * np.pi * T / SEASON) + 0.5 * RNG.standard_normal(SLOTS)), 0, 4),
    np.where((T >= 40) & (T < 46), 0, 16 - (T % 7 == 0)),
    (RNG.random(SLOTS) < 0.7).astype(int),
]).astype(int)
MARKET = make_market(PRICES, COUNTS)


def build(name: str, **params):
    return make_forecaster(name, {**PARAMS[name], **params})


@pytest.mark.parametrize("name", NAMES)
def test_forecasts_are_finite_consistent_and_inside_the_counts_seen(name):
    forecast = build(name).forecast(MARKET.prefix(80), 12)
    assert forecast.spot_price.shape == forecast.available.shape == (12, 3)
    assert len(forecast.models) == 3 and all("+" in label for label in forecast.models)
    pairs = [(forecast.spot_price, forecast.spot_price_interval), (forecast.available, forecast.available_interval)]
    for point, (lower, upper) in pairs:
        assert np.isfinite(point).all() and np.isfinite(lower).all() and np.isfinite(upper).all()
        assert (lower <= point + 1e-9).all() and (point <= upper + 1e-9).all()
    top = MARKET.prefix(80).available.max(axis=0)
    assert (forecast.available >= 0).all() and (forecast.available <= top + 1e-9).all()
    assert (forecast.available_interval[1] <= top + 1e-9).all() and (forecast.spot_price >= 0).all()
    dist = forecast.available_distribution
    assert dist.shape == (12, 3, top.max() + 1)
    np.testing.assert_allclose(dist.sum(axis=2), 1.0)
    assert (dist[:, 2, 2:] == 0).all()  # a pool never holds more than it has been seen to hold
    at_least = np.stack([forecast.p_available_at_least(n) for n in range(top.max() + 2)])
    assert (np.diff(at_least, axis=0) <= 1e-12).all() and np.allclose(at_least[0], 1.0)


def test_the_new_forecasters_are_built_by_name_with_their_parameters():
    assert isinstance(make_forecaster("arima", {"criterion": "bic", "refit_every": 6}), ArimaForecaster)
    assert make_forecaster("markov-count", {"smoothing": 0.5}).params()["smoothing"] == 0.5
    assert make_forecaster("auto", {"reselect_every": 48}).params()["reselect_every"] == 48
    with pytest.raises(ValueError, match="takes no parameter"):
        make_forecaster("holt-winters", {"criterion": "aic"})


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("arima", {"criterion": "hqic"}, "criterion must be one of"),
        ("arima", {"refit_every": 0}, "refit_every must be an integer >= 1"),
        ("holt-winters", {"season_slots": 2.5}, "season_slots must be an integer >= 1"),
        ("markov-count", {"smoothing": 0}, "smoothing must be a finite number > 0"),
        ("sojourn-chain", {"prior": float("inf")}, "prior must be a finite number > 0"),
        ("auto", {"bucket_ends": 5}, "bucket_ends must be a list of increasing integers"),
        ("auto", {"origins": 0}, "origins must be an integer >= 1"),
        ("auto", {"backtest_horizon": True}, "backtest_horizon must be an integer >= 1"),
        ("auto", {"margin": 1.0}, "margin must be a number in"),
        ("auto", {"bucket_ends": (6, 2)}, "bucket_ends must be increasing integers"),
    ],
)
def test_bad_parameters_are_refused_by_name(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_forecaster(name, params)


@pytest.mark.parametrize("slots", [12, 24, 60])
@pytest.mark.parametrize("fit", [fit_arima, fit_holt_winters, lambda y: MarkovCount(y, 1.0)])
def test_a_constant_series_forecasts_itself_with_a_zero_width_interval_and_no_warnings(fit, slots):
    # exactly, whatever the history's length: CHC floors the count, so 7.9999995 would plan 7 instances
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitted = fit(np.full(slots, 7.0))
        result = fitted.update(np.full(slots + 2, 7.0)).forecast(24)
    for bound in (result.mean, result.lower, result.upper):
        np.testing.assert_array_equal(bound, 7.0)


@pytest.mark.parametrize("name", NAMES)
def test_a_hole_in_the_data_is_forecast_like_any_other_slot(name):
    # pool 1 has been in a hole (0 available at the constant price) for the last 4 slots
    forecast = build(name).forecast(MARKET.prefix(44), 6)
    np.testing.assert_allclose(forecast.spot_price[:, 1], 2.3724)
    assert np.isfinite(forecast.available).all() and (forecast.available[:, 1] <= 16).all()
    assert forecast.p_available_at_least(1)[:, 1].min() < 1.0  # the hole may go on


BAD = [
    (np.nan, 1, "all 8 spot prices are NaN or infinite"),
    (-0.5, 1, "spot price -0.5 in slot 0 is negative"),
    (1.0, -1, "available counts must be whole numbers >= 0"),
    (1.0, 0.5, "available counts must be whole numbers >= 0"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("price", "count", "message"), BAD)
def test_bad_data_is_refused_naming_the_pool(name, price, count, message):
    prices = np.array([[price, 1.0]] * 8)
    counts = np.array([[count, 1]] * 8, dtype=float)
    market = make_market(prices, counts.astype(np.int64))
    market = type(market)(market.pools, market.start, 1.0, prices, counts, 3.0)
    with pytest.raises(ValueError, match=f"pool 'pool-0': .*{message}"):
        build(name).forecast(market, 3)


def test_a_few_nan_prices_are_counted_in_the_error():
    prices = np.array([[1.0]] * 8)
    prices[3] = np.nan
    with pytest.raises(ValueError, match="1 of 8 spot prices are NaN"):
        build("auto").forecast(make_market(prices, [[1]] * 8), 3)


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_history_is_refused(name):
    with pytest.raises(ValueError, match="past holds no slot"):
        build(name).forecast(MARKET.prefix(0), 3)


@pytest.mark.parametrize("name", NAMES)
def test_a_single_slot_falls_back_to_persistence_with_a_logged_reason(name, caplog):
    caplog.set_level(logging.WARNING)
    forecast = build(name).forecast(MARKET.prefix(1), 4)
    assert forecast.models == ("persistence+persistence",) * 3
    np.testing.assert_allclose(forecast.spot_price, np.repeat(MARKET.spot_price[:1], 4, axis=0))
    np.testing.assert_allclose(forecast.available, np.repeat(MARKET.available[:1], 4, axis=0))
    if name != "auto":  # auto ranks persistence first on a history too short to backtest
        assert "needs at least" in caplog.text


class Broken(FittedSeries):
    """A model whose forecasts are NaN."""

    label = "broken"

    def update(self, history: np.ndarray) -> Broken:
        return self

    def forecast(self, horizon: int) -> SeriesForecast:
        nan = np.full(horizon, np.nan)
        return SeriesForecast(nan, nan, nan)


def test_a_failing_fit_falls_back_to_the_next_model_with_a_logged_reason(monkeypatch, caplog):
    def fail(y, season=24, criterion="aic"):
        raise np.linalg.LinAlgError("singular matrix")

    monkeypatch.setattr(arima, "fit_arima", fail)
    caplog.set_level(logging.WARNING)
    forecast = build("arima").forecast(MARKET.prefix(60), 6)
    assert forecast.models == ("persistence+persistence",) * 3
    assert "arima gave no forecast (LinAlgError: singular matrix)" in caplog.text
    auto = build("auto").forecast(MARKET.prefix(80), 6)
    assert np.isfinite(auto.spot_price).all() and not any(label.startswith("arima") for label in auto.models)
    assert "arima failed in the backtest (LinAlgError: singular matrix)" in caplog.text


def test_a_model_that_forecasts_nan_is_replaced(monkeypatch, caplog):
    monkeypatch.setattr(exponential_smoothing, "fit_holt_winters", lambda y, season=24: Broken())
    caplog.set_level(logging.WARNING)
    forecast = build("holt-winters").forecast(MARKET.prefix(30), 6)
    assert forecast.models == ("persistence+persistence",) * 3 and np.isfinite(forecast.available).all()
    assert "holt-winters gave no forecast (non-finite values)" in caplog.text


def test_a_non_converging_fit_is_dropped(monkeypatch):
    monkeypatch.setattr(arima, "fit_order", lambda z, order, seasonal: None)
    with pytest.raises(FitError, match=r"no ARIMA order of \(0,\d,0\), .* converged"):
        fit_arima(PRICES[:, 0])


def spy(monkeypatch, module, name):
    """Count the calls of ``module.name``."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_fits_are_reused_between_scheduled_refits(monkeypatch):
    calls = spy(monkeypatch, arima, "fit_arima")
    forecaster = build("arima", refit_every=3)
    first = forecaster.forecast(MARKET.prefix(40), 6)
    assert calls == [40] * 6  # price and availability of 3 pools
    forecaster.forecast(MARKET.prefix(41), 6)
    forecaster.forecast(MARKET.prefix(42), 6)
    assert len(calls) == 6  # updated, not refitted
    forecaster.forecast(MARKET.prefix(43), 6)
    assert calls[6:] == [43] * 6  # refit_every slots on: refitted
    again = forecaster.forecast(MARKET.prefix(40), 6)  # not an extension of what it saw: fitted afresh
    assert calls[12:] == [40] * 6
    np.testing.assert_allclose(again.spot_price, first.spot_price)


def test_auto_reselects_on_its_schedule_and_updates_in_between(monkeypatch):
    calls = spy(monkeypatch, exponential_smoothing, "fit_holt_winters")
    forecaster = AutoForecaster(refit_every=4, reselect_every=8, origins=2, backtest_horizon=24, season_slots=SEASON)
    forecaster.forecast(MARKET.prefix(80), 6)
    # origins at every slot from 55 to 79: the last 2 whose 24 leads are all realised (55, 56) and
    # the later ones that score the shorter leads; fitted at the first, updated to the others
    assert calls.count(55) == 6 and set(calls) <= {55, 80}
    selected = len(calls)
    forecaster.forecast(MARKET.prefix(81), 6)
    assert len(calls) == selected  # updated, not refitted
    forecaster.forecast(MARKET.prefix(88), 6)
    assert calls.count(63) == 6  # reselected after 8 slots: origins 63 .. 87, fitted at the first


def test_a_fit_is_shared_by_every_job_that_fits_the_same_series():
    y = PRICES[:60, 0].copy()
    first = fit_arima(y, SEASON)
    assert fit_arima(y.copy(), SEASON) is first  # same contents, same settings: the memoised model
    updated = first.update(PRICES[:61, 0])
    assert updated is not first and first.seen == 60  # updates copy: the shared model never changes
    assert fit_arima(y, SEASON, "bic") is not first
    other = y.copy()
    other[-1] += 1.0
    assert fit_arima(other, SEASON) is not first
    assert fit_holt_winters(y, SEASON) is fit_holt_winters(y.copy(), SEASON)


def test_auto_backtests_a_series_once_for_every_job_that_plans_on_it(monkeypatch):
    calls = spy(monkeypatch, exponential_smoothing, "fit_holt_winters")
    settings = dict(origins=2, backtest_horizon=24, season_slots=SEASON)
    first = AutoForecaster(**settings).forecast(MARKET.prefix(80), 6)
    backtested = calls.count(55)
    assert backtested == 6
    second = AutoForecaster(**settings).forecast(MARKET.prefix(80), 6)  # another job, same market and time
    assert calls.count(55) == backtested  # the ranking came from the memo: no new backtest fit
    assert second.models == first.models
    np.testing.assert_array_equal(second.spot_price, first.spot_price)
    AutoForecaster(**{**settings, "backtest_horizon": 12}).forecast(MARKET.prefix(80), 6)
    assert calls.count(67) == 6  # other settings: backtested afresh (origins 67 .. 79, fitted at the first)


def test_no_peeking_the_forecast_ignores_slots_after_now():
    mixed = make_market(np.vstack([PRICES[:50], 3 * PRICES[50:]]), np.vstack([COUNTS[:50], COUNTS[::-1][50:]]))
    for name in NAMES:
        reference = build(name).forecast(MARKET.prefix(50), 8)
        forecast = build(name).forecast(mixed.prefix(50), 8)
        np.testing.assert_array_equal(forecast.spot_price, reference.spot_price)
        np.testing.assert_array_equal(forecast.available_distribution, reference.available_distribution)
    assert not np.array_equal(mixed.spot_price[50:], MARKET.spot_price[50:])


def auto_choice(prices: np.ndarray) -> str:
    market = make_market(prices[:, None], np.ones((prices.size, 1), dtype=int))
    return build("auto").forecast(market, 6).models[0].split("+")[0]


def test_auto_picks_persistence_on_a_random_walk():
    walk = 5.0 + np.cumsum(0.05 * np.random.default_rng(0).standard_normal(80))
    assert auto_choice(walk) == "persistence"


def test_auto_picks_a_seasonal_model_on_a_daily_cycle():
    hours = np.arange(80)
    daily = 2.0 + np.sin(2 * np.pi * hours / SEASON) + 0.05 * np.random.default_rng(1).standard_normal(80)
    choice = auto_choice(daily)
    # six leads of a six-slot season: at lead 6 persistence is the value a season back, seasonal
    # naive itself, so a tie that persistence keeps; every shorter lead takes a seasonal model
    first = choice.split("/")[0].split("@")[0]
    assert first == "seasonal-naive" or first.startswith("sarima") or first.endswith(",A)")
    assert choice == first or choice.endswith("@1-5/persistence@6-")


def test_arima_update_and_forecast_match_statsmodels():
    y = PRICES[:72, 2]
    z = (y - y.mean()) / y.std()
    results = SARIMAX(z[:60], order=(1, 1, 0)).fit(disp=False)  # sigma2 a parameter: extend keeps it
    fitted = FittedArima(results, "arima(1,1,0)", y.mean(), y.std(), 60).update(y)
    expected = results.extend(z[60:]).get_forecast(10)
    ours = fitted.forecast(10)
    bounds = expected.conf_int(alpha=0.2)
    np.testing.assert_allclose(ours.mean, y.mean() + y.std() * expected.predicted_mean, rtol=1e-8)
    np.testing.assert_allclose(ours.lower, y.mean() + y.std() * bounds[:, 0], rtol=1e-8)
    np.testing.assert_allclose(ours.upper, y.mean() + y.std() * bounds[:, 1], rtol=1e-8)


def test_holt_winters_update_and_forecast_match_statsmodels():
    y = PRICES[:, 0]
    # estimated initial states are parameters, so smoothing the longer series starts from the same ones
    spec = dict(error="add", trend="add", damped_trend=True, seasonal="add", seasonal_periods=SEASON)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = ETSModel(pd.Series(y[:72]), **spec).fit(disp=False)
        longer = ETSModel(pd.Series(y), **spec).smooth(results.params)
    fitted = FittedSmoothing.from_results(results, 0.0, 1.0, 72).update(y)
    fitted.sigma = np.sqrt(longer.scale)  # statsmodels re-estimates the error variance on the longer series
    frame = longer.get_prediction(start=SLOTS, end=SLOTS + 29).summary_frame(alpha=0.2)
    ours = fitted.forecast(30)
    np.testing.assert_allclose(ours.mean, frame["mean"], rtol=1e-8)
    np.testing.assert_allclose(ours.lower, frame["pi_lower"], rtol=1e-6)
    np.testing.assert_allclose(ours.upper, frame["pi_upper"], rtol=1e-6)


def median(distribution: np.ndarray) -> np.ndarray:
    """The smallest count whose cumulative probability reaches one half, per row."""
    return np.argmax(np.cumsum(distribution, axis=1) >= 0.5 - 1e-12, axis=1).astype(float)


def test_the_markov_chain_counts_moves_with_additive_smoothing():
    chain = MarkovCount(np.array([0, 1, 1, 2, 1, 1.0]), smoothing=1.0)
    # moves: 0->1, 1->1 (twice), 1->2, 2->1; a row gets 1/3 pseudo-move per state
    np.testing.assert_allclose(chain.transition_matrix()[1], [1 / 3 / 4, (2 + 1 / 3) / 4, (1 + 1 / 3) / 4])
    np.testing.assert_allclose(chain.transition_matrix().sum(axis=1), 1.0)
    result = chain.forecast(3)
    np.testing.assert_allclose(result.distribution[0], chain.transition_matrix()[1])
    np.testing.assert_allclose(result.mean, median(result.distribution))
    gappy = MarkovCount(np.array([0, 4, 4, 0, 4.0]), smoothing=1.0)
    assert (gappy.forecast(5).distribution[:, 1:4] == 0).all()  # counts never seen get no mass
    updated = chain.update(np.array([0, 1, 1, 2, 1, 1, 3, 0.0]))
    np.testing.assert_array_equal(updated.moves, MarkovCount(np.array([0, 1, 1, 2, 1, 1, 3, 0.0]), 1.0).moves)


def test_markov_count_gives_the_probability_of_at_least_n():
    forecast = MarkovCountForecaster().forecast(MARKET.prefix(60), 4)
    assert forecast.models[0] == "persistence+markov-count"
    dist = forecast.available_distribution[:, 0, :5]
    np.testing.assert_allclose(forecast.p_available_at_least(3)[:, 0], dist[:, 3:].sum(axis=1))
    np.testing.assert_allclose(forecast.available[:, 0], median(forecast.available_distribution[:, 0]))


def test_count_distribution_matches_the_interval_and_keeps_a_certain_point():
    dist = count_distribution(np.array([5.0, 2.5]), np.array([3.0, 2.5]), np.array([7.0, 2.5]), 10)
    np.testing.assert_allclose(dist.sum(axis=1), 1.0)
    assert dist[0, 3:8].sum() > 0.75 and dist[0, 5] == dist[0].max()
    np.testing.assert_allclose(dist[1, 2:4], [0.5, 0.5])


def test_seasonal_strength_separates_a_daily_cycle_from_noise():
    hours = np.arange(96)
    assert seasonal_strength(np.sin(2 * np.pi * hours / 24), 24) > 0.95
    assert seasonal_strength(np.random.default_rng(2).standard_normal(240), 24) < 0.2
    assert seasonal_strength(np.ones(30), 24) == 0.0  # less than two seasons


def test_stitched_takes_each_lead_from_its_segments_model():
    y = MARKET.available[:80, 0].astype(float)
    persistence, seasonal = fit_persistence(y), seasonal_naive_fit(SEASON)(y)
    stitched = Stitched([persistence, seasonal], [(1, 0), (3, 1), (5, 0)], top=None)
    assert stitched.label == "persistence@1-2/seasonal-naive@3-4/persistence@5-"
    result, p, s = stitched.forecast(8), persistence.forecast(8), seasonal.forecast(8)
    for part in ("mean", "lower", "upper"):
        ours, mine, theirs = getattr(result, part), getattr(p, part), getattr(s, part)
        np.testing.assert_array_equal(ours, np.concatenate([mine[:2], theirs[2:4], mine[4:]]))
    assert result.distribution is None
    np.testing.assert_array_equal(stitched.forecast(1).mean, p.mean[:1])  # a short horizon uses the first model only


def test_stitched_counts_stitch_the_distribution_too():
    y = MARKET.available[:80, 0].astype(float)
    chain = MarkovCount(y, 0.1)
    top = int(y.max())
    stitched = Stitched([fit_persistence(y), chain], [(1, 0), (3, 1)], top=top)
    result, p = stitched.forecast(6), fit_persistence(y).forecast(6)
    np.testing.assert_allclose(result.distribution.sum(axis=1), 1.0)
    np.testing.assert_array_equal(result.distribution[2:], chain.forecast(6).distribution[2:])
    # persistence has no distribution of its own: the discretised normal of its clipped interval
    lower, upper = np.minimum(np.clip(p.lower, 0, top), p.mean), np.maximum(np.clip(p.upper, 0, top), p.mean)
    np.testing.assert_allclose(result.distribution[:2], count_distribution(p.mean, lower, upper, top)[:2])
    updated = stitched.update(np.append(y, 0.0))
    assert updated.components[1].history.size == 81 and updated.label == stitched.label


def test_lagged_counts_are_what_followed_the_same_count():
    """A pool on offer (1) is lost after one slot in three at 1: a slot ahead, 0 with chance
    about 1/3, not never; the changes of every slot (0 half the time) weigh as 10 of its 30."""
    y = np.array([1, 1, 1, 0] * 10 + [1], dtype=float)
    changes_at_1 = np.array([0.25, 0.75])  # a change of -1 in 10 of 40 slots
    np.testing.assert_allclose(lagged_counts(y, 1, 1, 1), (np.array([10, 20]) + 10 * changes_at_1) / 40)
    # at 0 it always came back, 10 times: as much weight as the changes of all (0 -> 0 or -1: 0.75)
    np.testing.assert_allclose(lagged_counts(y, 1, 0, 1), (np.array([0, 10]) + 10 * np.array([0.75, 0.25])) / 20)
    many = np.array([2, 2, 3, 2, 2, 1] * 200, dtype=float)  # 800 slots at 2: what followed them speaks
    np.testing.assert_allclose(lagged_counts(many, 1, 2, 3), [0.0, 0.25, 0.5, 0.25], atol=0.01)


def test_lagged_counts_fold_the_changes_of_an_unseen_count_onto_the_ends():
    y = np.array([5, 3] * 8 + [5], dtype=float)  # never at 4: the changes of all (+-2) around it
    np.testing.assert_allclose(lagged_counts(y, 1, 4, 5), [0, 0, 0.5, 0, 0, 0.5])
    np.testing.assert_allclose(lagged_counts(y, 1, 0, 5), [0.5, 0, 0.5, 0, 0, 0])  # -2 folds onto 0
    np.testing.assert_array_equal(lagged_counts(y, 40, 4, 5), [0, 0, 0, 0, 1, 0])  # no slots that far apart


def test_persistence_of_a_count_states_how_often_it_moved():
    """The interval of a count that sticks 80% of the time has zero width; its distribution does
    not claim certainty: each lead's chances are the counts that followed the current one."""
    y = MARKET.available[:80, 2].astype(float)  # 0/1, on offer 70% of the time
    counted, plain = fit_persistence_counts(y).forecast(6), fit_persistence(y).forecast(6)
    for part in ("mean", "lower", "upper"):
        np.testing.assert_array_equal(getattr(counted, part), getattr(plain, part))
    for lead in range(1, 7):
        np.testing.assert_allclose(counted.distribution[lead - 1], lagged_counts(y, lead, int(y[-1]), 1))
    assert 0.0 < counted.distribution[:, 1].min() and counted.distribution[:, 1].max() < 1.0
    seasonal = seasonal_naive_fit(SEASON, counts=True)(y).forecast(6)
    np.testing.assert_allclose(seasonal.distribution[0], lagged_counts(y, SEASON, int(y[-SEASON]), 1))


def test_stitched_counts_keep_persistences_own_distribution():
    y = MARKET.available[:80, 0].astype(float)
    chain, persistence = MarkovCount(y, 0.1), fit_persistence_counts(y)
    result = Stitched([persistence, chain], [(1, 0), (3, 1)], top=int(y.max())).forecast(6)
    np.testing.assert_array_equal(result.distribution[:2], persistence.forecast(6).distribution[:2])
    np.testing.assert_array_equal(result.distribution[2:], chain.forecast(6).distribution[2:])


def test_auto_on_persistence_gives_persistences_count_chances(monkeypatch):
    """Where auto keeps persistence, P(available >= 1) of a flickering pool is the share of slots
    at its count that the pool was still on offer ``lead`` slots later."""
    fixed_backtest(monkeypatch, {"persistence": [1.0] * 6})
    past = MARKET.prefix(80)
    forecast = build("auto").forecast(past, 6)
    assert forecast.models[2] == "persistence+persistence"
    y = past.available[:, 2].astype(float)
    expected = [lagged_counts(y, lead, int(y[-1]), 1)[1] for lead in range(1, 7)]
    np.testing.assert_allclose(forecast.p_available_at_least(1)[:, 2], expected)


def fixed_backtest(monkeypatch, scores: dict[str, list[float]], noise: dict[str, np.ndarray] | None = None) -> None:
    """Make every backtest origin score each candidate ``scores[name]`` per lead (9 if unnamed),
    plus ``noise[name]`` (one value per origin) where given."""

    def backtest(self, candidate, kind, pool, y, origins):
        errors = np.tile(np.array(scores.get(candidate.name, [9.0] * 6), dtype=float), (len(origins), 1))
        if noise and candidate.name in noise:
            errors += noise[candidate.name][: len(origins), None]
        return errors

    monkeypatch.setattr(AutoForecaster, "backtest", backtest)
    auto._backtest_cache.clear()  # the new scores, not the memo of an earlier call in the same test


def test_auto_stitches_the_best_model_per_lead_bucket(monkeypatch):
    """Persistence wins the first two leads, seasonal naive the rest: the forecast stitches them."""
    fixed_backtest(monkeypatch, {"persistence": [1, 1, 5, 5, 5, 5], "seasonal-naive": [3, 3, 1, 1, 1, 1]})
    past = MARKET.prefix(80)
    forecast = build("auto").forecast(past, 6)
    assert forecast.models[0] == "persistence@1-2/seasonal-naive@3-+persistence@1-2/seasonal-naive@3-"
    y = past.spot_price[:, 0].astype(float)
    first, rest = fit_persistence(y).forecast(6), seasonal_naive_fit(SEASON)(y).forecast(6)
    expected = np.concatenate([first.mean[:2], rest.mean[2:]])
    np.testing.assert_allclose(forecast.spot_price[:, 0], expected)
    np.testing.assert_allclose(forecast.available_distribution.sum(axis=2), 1.0)


def test_auto_keeps_one_model_when_it_wins_every_bucket_and_persistence_needs_the_margin(monkeypatch):
    fixed_backtest(monkeypatch, {"persistence": [1.0] * 6, "seasonal-naive": [0.97] * 6})  # 3%: inside the 5% margin
    assert build("auto").forecast(MARKET.prefix(80), 6).models[0] == "persistence+persistence"


def test_auto_chooses_per_lead_and_falls_back_to_persistence_at_the_others(monkeypatch):
    """Seasonal naive better at lead 3 alone: persistence before and after it, one lead of seasonal naive."""
    fixed_backtest(monkeypatch, {"persistence": [1.0] * 6, "seasonal-naive": [2, 2, 0.5, 2, 2, 2]})
    forecast = build("auto").forecast(MARKET.prefix(80), 6)
    label = "persistence@1-2/seasonal-naive@3/persistence@4-"
    assert forecast.models[0] == f"{label}+{label}"
    y = MARKET.prefix(80).available[:, 0].astype(float)
    own, seasonal = fit_persistence(y).forecast(6).mean, seasonal_naive_fit(SEASON)(y).forecast(6).mean
    np.testing.assert_allclose(forecast.available[:, 0], [*own[:2], seasonal[2], *own[3:]])


def test_auto_keeps_persistence_where_a_model_wins_by_chance(monkeypatch):
    """Some 8% less error on average, but from noisy wins and losses (t about -0.8): the test keeps
    persistence, where the margin alone would have switched. The same gain made steadily displaces it."""
    flat = {"persistence": [3.0] * 6, "seasonal-naive": [3.0] * 6}
    lucky = np.random.default_rng(14).normal(-0.3, 1.5, 200)  # per origin, added to seasonal naive's errors
    fixed_backtest(monkeypatch, flat, {"seasonal-naive": lucky})
    forecaster = AutoForecaster(season_slots=SEASON, backtest_horizon=6)
    origins = forecaster.backtest_origins(80)
    assert len(origins) == 32  # origins 48 .. 79
    for lead in range(1, 7):  # every lead's bucket: beyond the 5% margin, not beyond chance
        d = lucky[: 33 - lead]
        assert d.mean() < -0.05 / 1.05 * 3.0 and diebold_mariano(d, lead) > -1.645
    assert build("auto").forecast(MARKET.prefix(80), 6).models[0] == "persistence+persistence"
    assert build("auto", significance=0.0).forecast(MARKET.prefix(80), 6).models[0] == "seasonal-naive+seasonal-naive"
    steady = np.full(200, -0.3) + 0.05 * np.random.default_rng(0).standard_normal(200)
    fixed_backtest(monkeypatch, flat, {"seasonal-naive": steady})
    assert build("auto").forecast(MARKET.prefix(80), 6).models[0] == "seasonal-naive+seasonal-naive"


def test_diebold_mariano_matches_a_hand_computation():
    d = np.array([-1.0, -2.0, 0.0, -1.0])  # mean -1; centred 0, -1, 1, 0
    # lag 0: variance 2/4 = 0.5; lag 1 adds 2 * (1 - 1/2) * (0*-1 + -1*1 + 1*0) / 4 = -0.25
    assert diebold_mariano(d, 0) == pytest.approx(-1.0 / np.sqrt(0.5 / 4))
    assert diebold_mariano(d, 1) == pytest.approx(-1.0 / np.sqrt(0.25 / 4))
    assert diebold_mariano(np.zeros(5), 2) == 0.0  # an exact tie
    assert diebold_mariano(np.full(5, -0.5), 2) == -np.inf  # better at every origin by the same amount
    assert diebold_mariano(np.array([1.0, np.inf]), 1) == np.inf  # a failed candidate never passes


def test_the_backtest_scores_the_short_leads_on_the_latest_origins():
    """Lead 1 is realised one slot after its origin: the last origin scores lead 1 only, and a bucket
    is scored on the latest origins whose leads are all realised."""
    forecaster = AutoForecaster(season_slots=SEASON, backtest_horizon=6, origins=20)
    y = MARKET.prefix(80).available[:, 0].astype(float)
    origins = forecaster.backtest_origins(80)
    assert origins[-1] == 79 and len(origins) == 20 + 5 and origins == list(range(55, 80))
    errors = forecaster.backtest(forecaster.candidates("available")[0], "available", "pool-0", y, origins)
    assert errors.shape == (25, 6)
    np.testing.assert_array_equal(np.isnan(errors[-1]), [False, True, True, True, True, True])
    assert errors[-1, 0] == abs(y[79] - y[78])  # persistence from 79 slots seen, scored on slot 79
    assert not np.isnan(errors[:-5]).any()
    np.testing.assert_array_equal(forecaster.bucket_rows(origins, 80, 1), np.arange(5, 25))
    np.testing.assert_array_equal(forecaster.bucket_rows(origins, 80, 6), np.arange(0, 20))


def test_the_chain_forecasts_the_median_of_a_full_or_empty_pool():
    """A pool that sticks at full (8) or empty (0) for hours: the expectation drifts to a count it
    never takes, the median stays on a mode, and the distribution is unchanged."""
    y = np.tile(np.repeat([8.0, 0.0], 6), 8)[:-9]  # now full, three slots into a run of six
    result = MarkovCount(y, 0.1).forecast(24)
    expectation = result.distribution @ np.arange(9)
    assert set(result.mean) <= {0.0, 8.0} and result.mean[0] == 8.0
    assert ((expectation > 0.5) & (expectation < 7.5)).any()
    np.testing.assert_allclose(result.mean, median(result.distribution))
    assert (result.lower <= result.mean).all() and (result.mean <= result.upper).all()


def test_auto_follows_a_zone_that_just_lost_its_capacity(gcp_trace):
    """The demo's case: us-east4-a falls from 16 to 0 at 05:10 on 2025-10-11. Seasonal naive, which
    never looks at the latest slot, forecasts yesterday's 16 for the next hour; auto keeps
    persistence at lead 1 (the old choice took seasonal naive for leads 1-6 there) and forecasts 0."""
    at = datetime(2025, 10, 11, 5, 10, tzinfo=timezone.utc)
    past = market_at(gcp_trace, at, pools=["us-east4-a"])
    assert past.available[-2:, 0].tolist() == [16, 0]
    assert make_forecaster("seasonal-naive").forecast(past, 6).available[0, 0] == 16
    forecast = make_forecaster("auto").forecast(past, 6)
    assert forecast.available[0, 0] == 0 and forecast.models[0].split("+")[1].startswith("persistence@1")
