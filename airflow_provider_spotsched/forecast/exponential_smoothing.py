"""Holt-Winters exponential smoothing per pool, with daily seasonality where the data has it.

Statsmodels' state-space ETS with additive errors (so its 80% intervals are analytic, not
simulated, and a forecast repeats exactly). The form is chosen per series by AICc:

* seasonal (additive, one season of ``season_slots``) only when the history holds two seasons
  and a fixed daily profile explains half of its variance
  (:func:`~.series.seasonal_strength` >= 0.5): a season estimated on noise only adds variance;
* with and without an additive damped trend (damping keeps a trend from running away over a
  48-slot horizon); without season or trend this is simple exponential smoothing.

Initial states come from the standard heuristic (the first seasons' means), leaving only the
smoothing parameters to the optimiser, which is what keeps a fit in milliseconds. The series is
standardised first. A constant series fits every smoothing parameter equally well (and has no
error variance to estimate), so no optimiser runs: simple smoothing (alpha 0.5, any value fits)
with zero error variance forecasts the constant with a zero-width interval. Between refits the
fitted recursions run on over the new slots, the parameters kept. Availability forecasts
are clipped to [0, the largest count seen] by :class:`~.series.SeriesForecaster`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from statsmodels.tools.sm_exceptions import ConvergenceWarning
from statsmodels.tsa.exponential_smoothing.ets import ETSModel

from airflow_provider_spotsched.forecast.series import (
    Z80,
    Candidate,
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

MIN_SLOTS = 10  # the heuristic initialisation needs ten slots
SEASONAL_STRENGTH = 0.5


class FittedSmoothing(FittedSeries):
    """Additive-error Holt-Winters with fixed parameters, run in numpy on the standardised series.

    Statsmodels fits the parameters and the states up to the fit; its results objects cost tens
    of milliseconds per update and forecast (a numerical Hessian each), too much for the hourly
    hot path, so the error-correction recursions run here (they reproduce ``ETSModel.smooth`` and
    its analytic prediction intervals: see the tests). One step, with error e = y - forecast:
    level += phi * slope + alpha e; slope = phi * slope + beta e; the season slot m back += gamma e.
    The h-step variance is sigma^2 (1 + sum_{j<h} c_j^2), c_j = alpha + beta (phi + .. + phi^j)
    (+ gamma when j is a whole number of seasons).
    """

    def __init__(self, label: str, alpha: float, beta: float, gamma: float, phi: float, sigma: float) -> None:
        self.label = label
        self.alpha, self.beta, self.gamma, self.phi, self.sigma = alpha, beta, gamma, phi, sigma
        self.center, self.scale, self.seen = 0.0, 1.0, 0
        self.level, self.slope = 0.0, 0.0
        self.season = np.zeros(0)  # the last m seasonal states, oldest first

    @classmethod
    def from_results(cls, results: Any, center: float, scale: float, seen: int) -> FittedSmoothing:
        params = dict(zip(results.param_names, np.asarray(results.params, dtype=float)))
        trend, seasonal = bool(results.has_trend), bool(results.has_seasonal)
        fitted = cls(
            f"holt-winters({'Ad' if trend else 'N'},{'A' if seasonal else 'N'})",
            params["smoothing_level"],
            params.get("smoothing_trend", 0.0),
            params.get("smoothing_seasonal", 0.0),
            params.get("damping_trend", 1.0),
            float(np.sqrt(results.scale)),
        )
        fitted.center, fitted.scale, fitted.seen = center, scale, seen
        fitted.level = float(np.asarray(results.level)[-1])
        fitted.slope = float(np.asarray(results.slope)[-1]) if trend else 0.0
        if seasonal:
            fitted.season = np.asarray(results.season, dtype=float)[-results.seasonal_periods :].copy()
        return fitted

    def update(self, history: np.ndarray) -> FittedSmoothing:
        updated = copy.copy(self)
        level, slope, season = self.level, self.slope, list(self.season)
        for value in (history[self.seen :] - self.center) / self.scale:
            base = season[-len(season)] if season else 0.0
            error = value - (level + self.phi * slope + base)
            level, slope = level + self.phi * slope + self.alpha * error, self.phi * slope + self.beta * error
            if season:
                season = season[1:] + [base + self.gamma * error]
        updated.level, updated.slope, updated.season, updated.seen = level, slope, np.asarray(season), history.size
        return updated

    def forecast(self, horizon: int) -> SeriesForecast:
        steps = np.arange(1, horizon + 1)
        damped = np.cumsum(self.phi**steps)  # phi + .. + phi^h
        m = self.season.size
        mean = self.level + damped * self.slope + (self.season[(steps - 1) % m] if m else 0.0)
        weights = self.alpha + self.beta * damped[:-1]
        if m:
            weights = weights + self.gamma * (steps[:-1] % m == 0)
        sd = self.sigma * np.sqrt(1.0 + np.concatenate([[0.0], np.cumsum(weights**2)]))
        center, scale = self.center, self.scale
        half = Z80 * sd
        return SeriesForecast(center + scale * mean, center + scale * (mean - half), center + scale * (mean + half))


@memoised_fit
def fit_holt_winters(y: np.ndarray, season: int = 24) -> FittedSeries:
    """The AICc-best of the smoothing forms the module docstring lists, fitted to ``y``."""
    if y.size < MIN_SLOTS:
        raise FitError(f"Holt-Winters needs at least {MIN_SLOTS} slots of history, got {y.size}")
    base = {"error": "add", "initialization_method": "heuristic"}
    if np.ptp(y) == 0:
        fitted = FittedSmoothing("holt-winters(N,N)", alpha=0.5, beta=0.0, gamma=0.0, phi=1.0, sigma=0.0)
        # Centred on the constant with the level at 0, so the forecast is the constant itself; a level
        # smoothed up from 0 over the history would fall short of it by (1 - alpha)^n.
        fitted.center, fitted.seen = float(y[0]), y.size
        return fitted
    center, scale = float(y.mean()), float(y.std())
    z = pd.Series((y - center) / scale)
    seasonal = season > 1 and y.size >= 2 * season and seasonal_strength(y, season) >= SEASONAL_STRENGTH
    season_spec = {"seasonal": "add", "seasonal_periods": season} if seasonal else {}
    best, best_score = None, np.inf
    for trend_spec in ({}, {"trend": "add", "damped_trend": True}):
        spec = {**base, **season_spec, **trend_spec}
        with warnings.catch_warnings(record=True) as caught, single_threaded():
            warnings.simplefilter("always")
            results = ETSModel(z, **spec).fit(disp=False)
        converged = results.mle_retvals.get("converged", True) and np.isfinite(results.aicc)
        if converged and not any(issubclass(w.category, ConvergenceWarning) for w in caught):
            if results.aicc < best_score:
                best, best_score = results, results.aicc
    if best is None:
        raise FitError("no Holt-Winters form converged")
    return FittedSmoothing.from_results(best, center, scale, y.size)


class HoltWintersForecaster(SeriesForecaster):
    """Exponential smoothing per pool for both prices and counts; persistence if it cannot be fitted."""

    name = "holt-winters"

    def __init__(self, refit_every: int = 24, season_slots: int = 24) -> None:
        super().__init__(refit_every)
        self.season_slots = check_int("season_slots", season_slots, 1, "slots per season")

    def params(self) -> dict[str, Any]:
        return {**super().params(), "season_slots": self.season_slots}

    def candidates(self, kind: str) -> Sequence[Candidate]:
        smoothing = Candidate("holt-winters", lambda y: fit_holt_winters(y, self.season_slots))
        return [smoothing, persistence_candidate(kind)]
