"""The blend forecaster: the equal mixture of its members' forecasts, checked on hand-made ones."""

from __future__ import annotations

import numpy as np
import pytest

from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.forecast.base import Forecast, Forecaster
from airflow_provider_spotsched.forecast.blend import BlendForecaster
from tests.markets import make_market

MARKET = make_market([[1.0, 2.0]] * 6, [[4, 0]] * 6)


class Fixed(Forecaster):
    """Forecasts what it was given, whatever the past."""

    def __init__(self, forecast: Forecast) -> None:
        self.given = forecast

    def forecast(self, past, horizon):
        return self.given


def blend_of(first: Forecast, second: Forecast) -> BlendForecaster:
    blend = BlendForecaster(("persistence", "markov-count"))
    blend.parts = [Fixed(first), Fixed(second)]
    return blend


def one_slot(price, available, distribution=None, interval=None) -> Forecast:
    dist = None if distribution is None else np.array([distribution], dtype=float)
    return Forecast(np.array([price], dtype=float), np.array([available], dtype=float), interval, None, dist, ("m", "m"))


def test_where_the_members_disagree_the_plan_counts_on_the_mixtures_median():
    # pool 0: one member is sure of 4 instances, the other puts 0.6 on 0 and 0.4 on 4: the mixture
    # gives 0 with 0.3 and 4 with 0.7, median 4; pool 1: 0 against a certain 2 (no distribution):
    # 0.5 each, median 0 (the lowest count with half the mass), 80% interval 0..2
    sure = one_slot([1.0, 3.0], [4, 0], [[0, 0, 0, 0, 1], [1, 0, 0, 0, 0]], (np.array([[0.9, 2.0]]), np.array([[1.1, 4.0]])))
    unsure = one_slot([2.0, 5.0], [0, 2])
    unsure = Forecast(unsure.spot_price, unsure.available, None, None,
                      np.array([[[0.6, 0, 0, 0, 0.4], [0, 0, 1.0, 0, 0]]]), ("m", "m"))
    forecast = blend_of(sure, unsure).forecast(MARKET, 1)
    np.testing.assert_allclose(forecast.available_distribution, [[[0.3, 0, 0, 0, 0.7], [0.5, 0, 0.5, 0, 0]]])
    np.testing.assert_array_equal(forecast.available, [[4, 0]])
    np.testing.assert_array_equal(forecast.available_interval[0], [[0, 0]])
    np.testing.assert_array_equal(forecast.available_interval[1], [[4, 2]])
    np.testing.assert_allclose(forecast.p_available_at_least(4), [[0.7, 0.0]])
    np.testing.assert_allclose(forecast.spot_price, [[1.5, 4.0]])
    assert forecast.spot_price_interval is None  # one member gives no price interval: the blend claims none


def test_a_member_without_a_distribution_counts_its_point_as_certain():
    forecast = blend_of(one_slot([1.0], [3.7]), one_slot([1.0], [1.0])).forecast(make_market([[1.0]] * 3, [[3]] * 3), 1)
    np.testing.assert_allclose(forecast.available_distribution, [[[0, 0.5, 0, 0.5]]])
    np.testing.assert_array_equal(forecast.available, [[1]])


def test_members_that_agree_are_forecast_unchanged():
    persistence = make_forecaster("persistence").forecast(MARKET, 3)
    blend = make_forecaster("blend", {"members": ["persistence", "seasonal-naive"]}).forecast(MARKET, 3)
    np.testing.assert_array_equal(blend.available, persistence.available)
    np.testing.assert_allclose(blend.spot_price, persistence.spot_price)
    assert blend.models == ("persistence+seasonal-naive",) * 2  # members that name no model per pool


@pytest.mark.parametrize("members", [["auto"], ["auto", "auto"], ["auto", "oracle"], ["auto", "blend"], ["auto", "magic"], "auto"])
def test_members_must_be_two_distinct_live_forecasters(members):
    with pytest.raises(ValueError, match="members must be two or more distinct forecasters"):
        make_forecaster("blend", {"members": members})


def test_the_members_are_built_for_the_markets_slots():
    blend = make_forecaster("blend", slot_hours=0.5)
    assert [part.params()["season_slots"] for part in blend.parts if "season_slots" in part.params()] == [48]
    assert blend.params() == {"members": ["auto", "sojourn-chain"]}
