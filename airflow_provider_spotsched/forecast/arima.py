"""ARIMA/SARIMA per pool, its order chosen by an information criterion over a small grid.

The order search follows Hyndman and Khandakar's automatic ARIMA, cut down to stay fast (a fit
plus a 24-slot forecast on two weeks of hourly slots well under a second):

* the series is standardised (spot prices move by cents around dollars; unscaled, the optimiser
  crawls), and differenced once (d = 1) when a KPSS test rejects level stationarity at 5%;
* (p, q) runs over (0,0), (1,0), (0,1), (1,1), each fitted by exact maximum likelihood
  (statsmodels SARIMAX, a constant when d = 0); fits that do not converge are dropped;
* daily seasonality: when the history holds at least two seasons and a fixed daily profile
  explains half its variance (:func:`~.series.seasonal_strength` >= 0.5), the best order is
  also fitted with a seasonal AR(1) at the season's lag, kept if the criterion prefers it;
* the lowest AIC (or BIC) wins; the forecast and its 80% interval come from the model.

A constant series (GCP's prices) is fitted exactly by ARIMA(0,1,0), the random walk, with zero
innovation variance: the likelihood has no maximum there, so no optimiser runs and the forecast
is the constant with a zero-width interval. Between refits the fitted model's Kalman filter runs on
over the new slots, its parameters kept. Availability forecasts are
clipped to [0, the largest count seen] by :class:`~.series.SeriesForecaster`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from statsmodels.tools.sm_exceptions import ConvergenceWarning
from statsmodels.tsa.statespace.sarimax import SARIMAX
from statsmodels.tsa.stattools import kpss

from airflow_provider_spotsched.forecast.series import (
    Z80,
    Candidate,
    Fit,
    FitError,
    FittedSeries,
    SeriesForecast,
    SeriesForecaster,
    check_int,
    memoised_fit,
    persistence_candidate,
    seasonal_strength,
    single_threaded,
)

ORDERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (p, q) tried at the chosen d
MIN_SLOTS = 12  # fewer slots than this cannot tell the orders apart
SEASONAL_STRENGTH = 0.5  # share of variance a daily profile must explain before a seasonal term is tried
CRITERIA = ("aic", "bic")


class RandomWalk(FittedSeries):
    """ARIMA(0,1,0) with innovation sd ``sigma``: the last value, +- Z80 sigma sqrt(h)."""

    label = "arima(0,1,0)"

    def __init__(self, history: np.ndarray, sigma: float) -> None:
        self.last = float(history[-1])
        self.sigma = sigma

    def update(self, history: np.ndarray) -> RandomWalk:
        return RandomWalk(history, self.sigma)

    def forecast(self, horizon: int) -> SeriesForecast:
        mean = np.full(horizon, self.last)
        half = Z80 * self.sigma * np.sqrt(np.arange(1, horizon + 1))
        return SeriesForecast(mean, mean - half, mean + half)


class FittedArima(FittedSeries):
    """A fitted SARIMAX in state-space form, run by a plain Kalman filter on the standardised series.

    Statsmodels estimates the parameters; its results objects cost tens of milliseconds per
    update and forecast, too much for the hourly hot path, so the fit's system matrices and last
    predicted state are taken over and the filter and forecast recursions run here in numpy
    (they reproduce ``SARIMAXResults.extend`` and ``get_forecast``: see the tests).
    """

    def __init__(self, results: Any, label: str, center: float, scale: float, seen: int) -> None:
        ssm = results.filter_results
        self.label = label
        self.center, self.scale, self.seen = center, scale, seen
        variance_scale = float(results.scale)  # the innovation variance, concentrated out of the likelihood
        self.design = ssm.design[0, :, 0]
        self.obs_intercept = float(ssm.obs_intercept[0, 0])
        self.obs_var = variance_scale * float(ssm.obs_cov[0, 0, 0])
        self.transition = ssm.transition[:, :, 0]
        self.state_intercept = ssm.state_intercept[:, 0]
        selection = ssm.selection[:, :, 0]
        self.state_noise = variance_scale * selection @ ssm.state_cov[:, :, 0] @ selection.T
        self.state = ssm.predicted_state[:, -1].copy()
        self.state_cov = variance_scale * ssm.predicted_state_cov[:, :, -1]

    def update(self, history: np.ndarray) -> FittedArima:
        updated = copy.copy(self)
        a, p = self.state, self.state_cov
        for value in (history[self.seen :] - self.center) / self.scale:
            innovation = value - self.design @ a - self.obs_intercept
            variance = self.design @ p @ self.design + self.obs_var
            gain = self.transition @ p @ self.design / variance
            a = self.transition @ a + self.state_intercept + gain * innovation
            p = self.transition @ p @ self.transition.T + self.state_noise - np.outer(gain, gain) * variance
        updated.state, updated.state_cov, updated.seen = a, p, history.size
        return updated

    def forecast(self, horizon: int) -> SeriesForecast:
        a, p = self.state, self.state_cov
        mean, sd = np.empty(horizon), np.empty(horizon)
        for step in range(horizon):
            mean[step] = self.design @ a + self.obs_intercept
            sd[step] = np.sqrt(max(self.design @ p @ self.design + self.obs_var, 0.0))
            a = self.transition @ a + self.state_intercept
            p = self.transition @ p @ self.transition.T + self.state_noise
        center, scale = self.center, self.scale
        half = Z80 * sd
        return SeriesForecast(center + scale * mean, center + scale * (mean - half), center + scale * (mean + half))


def choose_differencing(z: np.ndarray) -> int:
    """1 when KPSS rejects level stationarity at 5%, else 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # p-values outside the table's range only clip to 0.01 / 0.1
        p_value = kpss(z, regression="c", nlags="auto")[1]
    return 1 if p_value < 0.05 else 0


def fit_order(z: np.ndarray, order: tuple[int, int, int], seasonal: tuple[int, int, int, int]) -> Any | None:
    """The maximum-likelihood SARIMAX fit of ``order``, or None if it did not converge."""
    with warnings.catch_warnings(record=True) as caught, single_threaded():
        warnings.simplefilter("always")
        model = SARIMAX(
            z, order=order, seasonal_order=seasonal, trend="c" if order[1] == 0 else "n", concentrate_scale=True
        )
        if model.k_params == 0:  # the random walk: nothing to optimise once the variance is concentrated out
            return model.filter(np.zeros(0), cov_type="none")
        results = model.fit(disp=False, cov_type="none")
    converged = results.mle_retvals.get("converged", True) and np.isfinite(results.llf)
    if not converged or any(issubclass(w.category, ConvergenceWarning) for w in caught):
        return None
    return results


@memoised_fit
def fit_arima(y: np.ndarray, season: int = 24, criterion: str = "aic") -> FittedSeries:
    """The grid's best ARIMA (maybe seasonal) for ``y`` by ``criterion``; see the module docstring."""
    if y.size < MIN_SLOTS:
        raise FitError(f"ARIMA needs at least {MIN_SLOTS} slots of history, got {y.size}")
    if np.ptp(y) == 0:
        return RandomWalk(y, 0.0)
    center, scale = float(y.mean()), float(y.std())
    z = (y - center) / scale
    d = choose_differencing(z)
    best, best_score, best_order = None, np.inf, None
    tried = []
    for p, q in ORDERS:
        results = fit_order(z, (p, d, q), (0, 0, 0, 0))
        tried.append(f"({p},{d},{q})")
        if results is not None and getattr(results, criterion) < best_score:
            best, best_score, best_order = results, getattr(results, criterion), (p, d, q)
    if best is None or best_order is None:  # set together: either both or neither
        raise FitError(f"no ARIMA order of {', '.join(tried)} converged")
    label = f"arima{best_order}".replace(" ", "")
    if season > 1 and y.size >= 2 * season and seasonal_strength(y, season) >= SEASONAL_STRENGTH:
        results = fit_order(z, best_order, (1, 0, 0, season))
        if results is not None and getattr(results, criterion) < best_score:
            best, label = results, f"sarima{best_order}(1,0,0){season}".replace(" ", "")
    return FittedArima(best, label, center, scale, y.size)


class ArimaForecaster(SeriesForecaster):
    """ARIMA per pool for both prices and counts; persistence if ARIMA cannot be fitted."""

    name = "arima"

    def __init__(self, refit_every: int = 24, season_slots: int = 24, criterion: str = "aic") -> None:
        super().__init__(refit_every)
        self.season_slots = check_int("season_slots", season_slots, 1, "slots per season")
        if criterion not in CRITERIA:
            raise ValueError(
                f"criterion must be one of {CRITERIA} (information criterion for the order), got {criterion!r}"
            )
        self.criterion = criterion

    def params(self) -> dict[str, Any]:
        return {**super().params(), "season_slots": self.season_slots, "criterion": self.criterion}

    def arima_fit(self) -> Fit:
        return lambda y: fit_arima(y, self.season_slots, self.criterion)

    def candidates(self, kind: str) -> Sequence[Candidate]:
        return [Candidate("arima", self.arima_fit()), persistence_candidate(kind)]
