"""The rolling-origin backtest: errors against hand-computed values, no peeking, and the report's files."""

from __future__ import annotations

import csv
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np
import pytest

from airflow_provider_spotsched.forecast import FORECASTERS
from airflow_provider_spotsched.forecast.backtest import (
    ROW_COLUMNS,
    Backtest,
    BacktestError,
    default_min_history,
    run_backtest,
)
from airflow_provider_spotsched.forecast.backtest_report import (
    lead_choice_table,
    lead_models,
    pooled_skill,
    write_backtest_report,
)
from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.market.slots import SlotMarket, resample
from tests.markets import make_market

# 12 slots, 2 pools. Pool 0's count cycles 0, 2, 4 (season 3); its price steps up by 0.1 a slot.
# Pool 1 is constant: persistence is exact there.
PRICES = [[1.0 + t / 10, 5.0] for t in range(12)]
COUNTS = [[2 * (t % 3), 7] for t in range(12)]
MARKET = make_market(PRICES, COUNTS)


def test_errors_match_a_hand_computation():
    result = run_backtest(MARKET, ["seasonal-naive"], horizon=2, step=2, min_history=4,
                          params={"seasonal-naive": {"season_slots": 3}})
    assert result.models == ("seasonal-naive", "persistence")  # persistence joins as the reference
    np.testing.assert_array_equal(result.origins, [3, 5, 7, 9])
    mae = result.mae("available")
    assert mae.shape == (2, 2, 2)
    # seasonal naive repeats the count cycle exactly; persistence misses by 2 or 4 (mean 2 at step 1, 2 at step 2)
    np.testing.assert_allclose(mae[0], 0.0)
    origins = result.origins
    expected = [np.mean(np.abs(2 * ((origins + k) % 3) - 2 * (origins % 3))) for k in (1, 2)]
    np.testing.assert_allclose(mae[1, :, 0], expected)
    np.testing.assert_allclose(mae[1, :, 1], 0.0)
    # price rises 0.1 a slot: persistence is k * 0.1 off, seasonal naive (3 slots back) 0.3 off at every step
    np.testing.assert_allclose(result.mae("spot_price")[1, :, 0], [0.1, 0.2])
    np.testing.assert_allclose(result.mae("spot_price")[0, :, 0], [0.3, 0.3])
    skill = result.skill("spot_price")
    np.testing.assert_allclose(skill[0, :, 0], [3.0, 1.5])
    assert np.isnan(skill[:, :, 1]).all()  # persistence exact on a constant price: no ratio


def test_a_daily_season_is_a_day_of_the_markets_slots():
    """On 8-hour slots a day is 3 slots: seasonal naive repeats pool 0's cycle exactly untold."""
    result = run_backtest(make_market(PRICES, COUNTS, slot_hours=8.0), ["seasonal-naive"], horizon=2, step=2, min_history=4)
    np.testing.assert_allclose(result.mae("available")[0], 0.0)


def test_mape_skips_zero_actuals():
    result = run_backtest(MARKET, ["persistence"], horizon=1, step=1, min_history=4)
    mape, points = result.mape("available")
    actual = result.actual("available")[:, 0, 0]
    forecast = result.predicted["available"][0, :, 0, 0]
    nonzero = actual != 0
    assert points[0, 0] == nonzero.sum() < len(actual)
    assert mape[0, 0, 0] == pytest.approx(100 * np.mean(np.abs(forecast - actual)[nonzero] / actual[nonzero]))
    assert mape[0, 0, 1] == 0.0


class PeekingSpy(Forecaster):
    """Records how many slots it was shown and forecasts the last one, like persistence."""

    name = "spy"
    seen: list[int] = []

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        PeekingSpy.seen.append(past.num_slots)
        return Forecast(np.repeat(past.spot_price[-1:], horizon, 0), np.repeat(past.available[-1:], horizon, 0),
                        models=("spy-a", "spy-b"))


def test_each_origin_sees_only_its_prefix_and_choices_are_counted(monkeypatch):
    monkeypatch.setitem(FORECASTERS, "spy", f"{__name__}:PeekingSpy")
    monkeypatch.setattr(PeekingSpy, "seen", [])
    result = run_backtest(MARKET, ["spy"], horizon=3, step=4, min_history=2)
    np.testing.assert_array_equal(result.origins, [1, 5])
    assert PeekingSpy.seen == [2, 6]
    assert result.chosen["spy"] == ({"spy-a": 2}, {"spy-b": 2})
    assert result.chosen["persistence"][0] == {"persistence": 2}


def test_default_history_is_two_weeks_or_half_a_short_market():
    long = make_market([[1.0]] * 1000, [[1]] * 1000)
    assert default_min_history(long, 24) == 336
    assert default_min_history(make_market([[1.0]] * 1000, [[1]] * 1000, slot_hours=2.0), 24) == 168
    assert default_min_history(make_market([[1.0]] * 124, [[1]] * 124), 24) == 50


@pytest.mark.parametrize(
    "options, words",
    [
        ({"horizon": 0}, ["horizon", ">= 1"]),
        ({"step": 0}, ["step", ">= 1"]),
        ({"min_history": 0}, ["min_history", ">= 1"]),
        ({"horizon": 12}, ["12 slots", "no origin"]),
        ({"models": ["persistence", "persistence"]}, ["twice"]),
        ({"models": ["oracle"]}, ["oracle", "future"]),
        ({"workers": 0}, ["workers", ">= 1"]),
    ],
)
def test_bad_requests_are_refused_with_the_field(options, words):
    args = {"models": ["seasonal-naive"], "horizon": 2, **options}
    with pytest.raises(BacktestError) as caught:
        run_backtest(MARKET, args.pop("models"), **args)
    for word in words:
        assert word in str(caught.value)


def test_rows_and_report_files(tmp_path, gcp_trace):
    market = resample(gcp_trace, num_slots=80, pools=["us-east4-b", "us-west1-b"])
    result = run_backtest(market, ["seasonal-naive"], horizon=6, step=12)
    rows = result.to_rows()
    assert len(rows) == 2 * 2 * 2 * 6  # quantities x models x pools x steps
    assert set(rows[0]) == set(ROW_COLUMNS)
    price_skill = [r["skill"] for r in rows if r["quantity"] == "spot_price"]
    assert price_skill == [None] * len(price_skill)  # GCP prices are constant: persistence is exact
    written = write_backtest_report(result, tmp_path, "spotsched forecast ...", datetime.now(timezone.utc), "gcp")
    assert [p.name for p in written] == ["backtest.csv", "calibration.csv", "reliability.csv", "summary.md",
                                         "error_vs_horizon.png", "forecast_vs_actual.png"]
    with (tmp_path / "backtest.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows)
    available = [r for r in table if r["quantity"] == "available" and r["model"] == "persistence"]
    assert all(float(r["skill"]) == 1.0 for r in available if r["skill"])
    summary = (tmp_path / "summary.md").read_text()
    assert "persistence is exact in every pool" in summary
    skill = pooled_skill(result, "available")
    assert f"({skill[0, 0]:.2f})" in summary  # the 1 h skill of seasonal naive is quoted
    assert all(p.stat().st_size > 1000 for p in written if p.suffix == ".png")


def test_models_in_parallel_processes_give_the_same_forecasts():
    args = dict(models=["seasonal-naive"], horizon=2, step=1, min_history=4, params={"seasonal-naive": {"season_slots": 3}})
    alone = run_backtest(MARKET, **args)
    parallel = run_backtest(MARKET, **args, workers=2)
    for quantity in ("spot_price", "available"):
        np.testing.assert_array_equal(alone.predicted[quantity], parallel.predicted[quantity])
    assert alone.chosen == parallel.chosen


class CountingSpy(PeekingSpy):
    """PeekingSpy that numbers its instances, so a test can tell a new forecaster from an old one."""

    name = "counting-spy"
    made = 0
    calls: list[tuple[int, int]] = []

    def __init__(self) -> None:
        CountingSpy.made += 1
        self.number = CountingSpy.made

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        CountingSpy.calls.append((self.number, past.num_slots))
        return super().forecast(past, horizon)


@pytest.mark.parametrize("fresh", [False, True])
def test_origins_spread_evenly_and_fresh_gives_each_a_new_forecaster(monkeypatch, fresh):
    monkeypatch.setitem(FORECASTERS, "counting-spy", f"{__name__}:CountingSpy")
    monkeypatch.setattr(CountingSpy, "made", 0)
    monkeypatch.setattr(CountingSpy, "calls", [])
    monkeypatch.setattr(PeekingSpy, "seen", [])
    result = run_backtest(MARKET, ["counting-spy"], horizon=3, min_history=2, origins=4, fresh=fresh)
    # the span is slots 1 .. 8 (12 slots, 3 ahead): 4 origins spread evenly over it, both ends included
    np.testing.assert_array_equal(result.origins, [1, 3, 6, 8])
    assert [slots for _, slots in CountingSpy.calls] == [2, 4, 7, 9]  # each sees its prefix only
    instances = {number for number, _ in CountingSpy.calls}
    assert len(instances) == (4 if fresh else 1)  # a new forecaster per origin, or one through them all
    assert result.fresh is fresh
    with pytest.raises(BacktestError, match="origins"):
        run_backtest(MARKET, ["persistence"], horizon=3, origins=0)


def test_fresh_origins_in_parallel_processes_give_the_same_forecasts():
    args = dict(models=["seasonal-naive"], horizon=2, min_history=4, origins=5, fresh=True, at_least=[3],
                params={"seasonal-naive": {"season_slots": 3}})
    alone, parallel = run_backtest(MARKET, **args), run_backtest(MARKET, **args, workers=3)
    for quantity in ("spot_price", "available"):
        np.testing.assert_array_equal(alone.predicted[quantity], parallel.predicted[quantity])
    np.testing.assert_array_equal(alone.chance(3), parallel.chance(3))
    assert alone.chosen == parallel.chosen


def hand_made_backtest() -> Backtest:
    """One pool whose counts are 2, 0, 2, 2, 0, 2; origins 1 and 2, two steps ahead: the actuals
    are [2, 2] and [2, 0]. Model ``m`` states intervals and chances; persistence states none."""
    market = make_market([[1.0]] * 6, [[2], [0], [2], [2], [0], [2]])
    shape = (2, 2, 1)  # origin, step, pool
    lower = np.array([[1.0, 0.0], [2.0, 1.0]]).reshape(shape)  # step 1: [1, 3] and [2, 2] hold 2;
    upper = np.array([[3.0, 1.0], [2.0, 2.0]]).reshape(shape)  # step 2: [0, 1] misses 2, [1, 2] misses 0
    chance = np.array([[0.8, 0.6], [0.9, 0.5]]).reshape(shape)
    nan = np.full(shape, np.nan)
    point = np.full(shape, 2.0)
    return Backtest(
        market=market, models=("m", "persistence"), horizon=2, origins=np.array([1, 2]),
        predicted={"spot_price": np.stack([point, point]), "available": np.stack([point, point])},
        chosen={"m": ({},), "persistence": ({},)},
        lower={"spot_price": np.stack([nan, nan]), "available": np.stack([lower, nan])},
        upper={"spot_price": np.stack([nan, nan]), "available": np.stack([upper, nan])},
        at_least=(1,), chances=(np.stack([chance, np.ones(shape)]),),
    )


def test_coverage_brier_and_reliability_match_a_hand_computation():
    result = hand_made_backtest()
    coverage = result.coverage("available")
    np.testing.assert_allclose(coverage[0], [1.0, 0.0])  # both actuals inside at step 1, neither at step 2
    assert np.isnan(coverage[1]).all()  # persistence gives no interval: no coverage, not 0%
    # events (>= 1 available): [1, 1] and [1, 0]
    np.testing.assert_allclose(result.brier(1)[0], [(0.2**2 + 0.1**2) / 2, (0.4**2 + 0.5**2) / 2])
    np.testing.assert_allclose(result.brier(1)[1], [0.0, 0.5])  # persistence's certain "yes" misses the 0 once
    # climatology: slots 0..1 had 1 of 2 with >= 1, slots 0..2 had 2 of 3
    np.testing.assert_allclose(result.climatology(1)[:, 0], [0.5, 2 / 3])
    np.testing.assert_allclose(result.brier_climatology(1), [(0.5**2 + (1 / 3) ** 2) / 2, (0.5**2 + (2 / 3) ** 2) / 2])
    assert result.reliability("m", 1) == [
        (0.5, 0.6, 1, 0.5, 0.0), (0.6, 0.7, 1, pytest.approx(0.6), 1.0),
        (0.8, 0.9, 1, pytest.approx(0.8), 1.0), (0.9, 1.0, 1, pytest.approx(0.9), 1.0),
    ]
    with pytest.raises(BacktestError, match="at least"):
        result.chance(4)


def test_the_skill_interval_brackets_exact_ratios():
    args = dict(models=["seasonal-naive"], horizon=2, min_history=4, origins=6, fresh=True,
                params={"seasonal-naive": {"season_slots": 3}})
    result = run_backtest(MARKET, **args)
    low, high = result.skill_interval("spot_price", "persistence")
    np.testing.assert_allclose([low, high], 1.0)  # persistence against itself: 1 in every draw
    low, high = result.skill_interval("spot_price", "seasonal-naive")
    ratio = result.skill("spot_price")[0, :, 0]  # pool 1 is constant: only pool 0's errors count
    assert (low <= ratio + 1e-9).all() and (ratio - 1e-9 <= high).all()
    assert np.isnan(result.skill_interval("available", "seasonal-naive")[0]).sum() == 0


def test_the_models_behind_each_lead_are_read_from_the_labels():
    assert lead_models("persistence@1-2/markov-count@3/persistence@4-6/holt-winters(N,A)@7-", 8) == [
        "persistence", "persistence", "markov-count", "persistence", "persistence", "persistence",
        "holt-winters", "holt-winters"]
    assert lead_models("arima(1,1,0)", 3) == ["arima"] * 3
    result = hand_made_backtest()
    chosen = ({"persistence+persistence@1/markov-count@2-": 3, "persistence+persistence": 1},)
    table = lead_choice_table(replace(result, chosen={"m": chosen, "persistence": chosen}), "m")
    assert "| availability | 1 h | 0% | 100% |" in table  # markov-count, persistence columns
    assert "| availability | 2 h | 75% | 25% |" in table
    assert "| price | 2 h | 0% | 100% |" in table
