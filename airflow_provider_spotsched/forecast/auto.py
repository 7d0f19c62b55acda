"""Automatic model choice per pool and series by a rolling-origin backtest on the past alone.

No model suits every pool: AWS prices drift like a random walk, GCP prices never move, some
counts follow the working day and others jump between full and empty. So for each pool, and
separately for its price and its availability series, the candidates are backtested on the
history the forecaster was given, nothing later:

* price candidates: persistence, seasonal naive, ARIMA, Holt-Winters;
  availability candidates: persistence, seasonal naive, the Markov count chain, Holt-Winters
  (clipped to [0, the largest count seen]);
* ``origins`` forecast origins, the last ``backtest_horizon`` slots before now and every half
  horizon before that; each candidate is fitted once on the history before the first origin
  and updated (parameters kept) to each later origin, as it would be between refits;
* the score is the mean absolute error over horizons 1..``backtest_horizon`` and origins; the
  lowest wins, ties going to the simpler model (the order above), and a model displaces
  persistence only when it beats persistence's score by more than ``margin`` (default 5%): a
  few origins make a noisy test, and a random walk seen for a few days can look seasonal by
  chance. A history too short for one origin after ``MIN_TRAINING`` slots ranks the candidates
  in that order: persistence first.

The ranking is kept for ``reselect_every`` slots; the chosen model is refitted on the whole
history every ``refit_every`` slots and updated in between, so the hourly call costs one state
update per series. A candidate whose fit raises, does not converge or forecasts non-finite
values scores worst in the backtest, and the next in the ranking replaces it when it fails
later, each with a logged warning (:class:`~.series.SeriesForecaster`). ``Forecast.models``
names the choice per pool as ``price-model+availability-model``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from airflow_provider_spotsched.forecast import arima, exponential_smoothing, markov_count
from airflow_provider_spotsched.forecast.series import (
    PRICE,
    Candidate,
    SeriesForecaster,
    SeriesState,
    check_int,
    fit_persistence,
    seasonal_naive_fit,
)

logger = logging.getLogger(__name__)

MIN_TRAINING = 48  # slots a candidate is fitted on before the first backtest origin


class AutoForecaster(SeriesForecaster):
    """The backtest's best model per pool and series, reselected and refitted on a schedule."""

    name = "auto"

    def __init__(
        self,
        refit_every: int = 24,
        reselect_every: int = 168,
        origins: int = 3,
        backtest_horizon: int = 24,
        season_slots: int = 24,
        margin: float = 0.05,
    ) -> None:
        super().__init__(refit_every)
        self.season_slots = check_int("season_slots", season_slots, 1, "slots per season")
        self.reselect_every = check_int("reselect_every", reselect_every, 1, "slots between model choices")
        self.origins = check_int("origins", origins, 1, "backtest forecast origins")
        self.backtest_horizon = check_int("backtest_horizon", backtest_horizon, 1, "slots per backtest forecast")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(
                f"margin must be a number in [0, 1) (share of persistence's error to beat), got {margin!r}"
            )
        self.margin = float(margin)

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "season_slots": self.season_slots,
            "reselect_every": self.reselect_every,
            "origins": self.origins,
            "backtest_horizon": self.backtest_horizon,
            "margin": self.margin,
        }

    def candidates(self, kind: str) -> Sequence[Candidate]:
        season = self.season_slots
        baselines = [Candidate("persistence", fit_persistence), Candidate("seasonal-naive", seasonal_naive_fit(season))]
        smoothing = Candidate("holt-winters", lambda y: exponential_smoothing.fit_holt_winters(y, season))
        if kind == PRICE:
            return baselines + [Candidate("arima", lambda y: arima.fit_arima(y, season)), smoothing]
        return baselines + [Candidate("markov-count", markov_count.markov_count_fit()), smoothing]

    def needs_ranking(self, state: SeriesState, n: int) -> bool:
        return n - state.ranked_at >= self.reselect_every

    def backtest_origins(self, n: int) -> list[int]:
        """Forecast origins (slots seen at each) for a history of ``n`` slots, oldest first."""
        step = max(1, self.backtest_horizon // 2)
        last = n - self.backtest_horizon
        return [o for o in (last - step * j for j in reversed(range(self.origins))) if o >= MIN_TRAINING]

    def rank(self, kind: str, pool: str, y: np.ndarray) -> list[Candidate]:
        candidates = list(self.candidates(kind))
        origins = self.backtest_origins(y.size)
        if not origins:
            return candidates
        scores = [self.backtest(candidate, kind, pool, y, origins) for candidate in candidates]
        # candidates()[0] is persistence: the others must beat it by the margin
        penalised = [score if i == 0 else score * (1 + self.margin) for i, score in enumerate(scores)]
        order = sorted(range(len(candidates)), key=lambda i: (penalised[i], i))
        logger.debug(
            "pool %s %s: backtest MAE %s", pool, kind, {c.name: round(s, 6) for c, s in zip(candidates, scores)}
        )
        return [candidates[i] for i in order]

    def backtest(self, candidate: Candidate, kind: str, pool: str, y: np.ndarray, origins: list[int]) -> float:
        """Mean absolute error of ``candidate`` over the origins and horizons; inf if it fails."""
        horizon = self.backtest_horizon
        try:
            fitted = candidate.fit(y[: origins[0]])
            errors = []
            for origin in origins:
                fitted = fitted.update(y[:origin])
                mean = fitted.forecast(horizon).mean
                if kind != PRICE:
                    mean = np.clip(mean, 0.0, y[:origin].max())
                errors.append(np.abs(mean - y[origin : origin + horizon]).mean())
            score = float(np.mean(errors))
        except Exception as error:  # noqa: BLE001 - a failing candidate is ranked last, not fatal
            name, why = candidate.name, f"{type(error).__name__}: {error}"
            logger.warning("pool %s %s: %s failed in the backtest (%s)", pool, kind, name, why)
            return np.inf
        if not np.isfinite(score):
            logger.warning("pool %s %s: %s forecast non-finite values in the backtest", pool, kind, candidate.name)
            return np.inf
        return score
