"""Automatic model choice per pool, series and lead time by a rolling-origin backtest on the past alone.

No model suits every pool: AWS prices drift like a random walk, GCP prices never move, some
counts follow the working day and others jump between full and empty. And no model suits every
lead time: an hour ahead the last value is hard to beat, a day ahead a daily profile may win. So
for each pool, and separately for its price and its availability series, the candidates are
backtested on the history the forecaster was given, nothing later:

* price candidates: persistence, seasonal naive, ARIMA, Holt-Winters;
  availability candidates: persistence, seasonal naive, the Markov count chain, Holt-Winters
  (clipped to [0, the largest count seen]);
* ``origins`` (default 10) forecast origins, the last ``backtest_horizon`` slots before now and
  every half horizon before that (with hourly slots: about five and a half days of the past),
  those with at least ``MIN_TRAINING`` slots before them; each candidate is fitted once on the
  history before the first origin and updated (parameters kept) to each later origin, as it
  would be between refits. More origins over a longer window make the choice less a matter of
  the last day or two;
* the score is the mean absolute error per lead-time bucket (``bucket_ends``, default leads 1-2,
  3-6 and 7 on) over its leads and the origins. In each bucket the lowest wins, ties going to the
  simpler model (the order above), and a model displaces persistence only when it beats
  persistence's score by more than ``margin`` (default 5%): a random walk seen for a few days
  can look seasonal by chance. Where buckets have different winners the forecast stitches them
  (:class:`~.series.Stitched`: point, interval and count distribution of each lead from its
  bucket's model; the last bucket's model forecasts every later lead too), labelled like
  ``persistence@1-2/holt-winters(N,A)@3-``. A history too short for one origin ranks the
  candidates in that order: persistence first.

The ranking (the stitch or single winner first, then the candidates by their score over all
leads) is kept for ``reselect_every`` slots; the chosen models are refitted on the whole history
every ``refit_every`` slots and updated in between, so the hourly call costs one state update per
series and model. A candidate whose fit raises, does not converge or forecasts non-finite values
scores worst in the backtest, and the next in the ranking replaces the choice when it fails
later, each with a logged warning (:class:`~.series.SeriesForecaster`). ``Forecast.models``
names the choice per pool as ``price-model+availability-model``.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

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
    stitched_fit,
)

logger = logging.getLogger(__name__)

MIN_TRAINING = 48  # slots a candidate is fitted on before the first backtest origin

# A backtest is a pure function of the candidates' settings and the series, and the same one
# recurs whenever several jobs plan on one market at one time (an evaluation runs 24 per start;
# CHC members replayed by the selector share them too). A bounded per-process memo runs each once.
_BACKTEST_CACHE_SIZE = 1024
_backtest_cache: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()


class AutoForecaster(SeriesForecaster):
    """The backtest's best model per pool, series and lead-time bucket, reselected and refitted on a
    schedule."""

    name = "auto"

    def __init__(
        self,
        refit_every: int = 24,
        reselect_every: int = 168,
        origins: int = 10,
        backtest_horizon: int = 24,
        season_slots: int = 24,
        margin: float = 0.05,
        bucket_ends: Sequence[int] = (2, 6),
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
        ends = list(bucket_ends)
        if any(isinstance(e, bool) or not isinstance(e, (int, np.integer)) for e in ends) or any(
            b <= a for a, b in zip([0, *ends], ends)
        ):
            raise ValueError(
                "bucket_ends must be increasing integers >= 1 (last lead of each lead-time bucket), "
                f"got {bucket_ends!r}"
            )
        self.bucket_ends = tuple(int(e) for e in ends)

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "season_slots": self.season_slots,
            "reselect_every": self.reselect_every,
            "origins": self.origins,
            "backtest_horizon": self.backtest_horizon,
            "margin": self.margin,
            "bucket_ends": list(self.bucket_ends),
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

    def buckets(self) -> list[tuple[int, int]]:
        """Lead-time buckets as 0-based ``[start, stop)`` slices of the backtest's leads."""
        edges = [0, *(end for end in self.bucket_ends if end < self.backtest_horizon), self.backtest_horizon]
        return list(zip(edges, edges[1:]))

    def order(self, scores: np.ndarray) -> list[int]:
        """Candidate indices best first: persistence (index 0) must be beaten by the margin, ties
        go to the simpler model."""
        penalised = [score if i == 0 else score * (1 + self.margin) for i, score in enumerate(scores)]
        return sorted(range(len(scores)), key=lambda i: (penalised[i], i))

    def rank(self, kind: str, pool: str, y: np.ndarray) -> list[Candidate]:
        """The bucket winners (stitched where they differ) first, then every candidate by its score
        over all leads: the fallbacks should the first fail to fit."""
        candidates = list(self.candidates(kind))
        origins = self.backtest_origins(y.size)
        if not origins:
            return candidates
        errors = self._backtest_all(candidates, kind, pool, y, origins)
        overall = self.order(errors.mean(axis=1))
        winners = [self.order(errors[:, a:b].mean(axis=1))[0] for a, b in self.buckets()]
        names = [candidate.name for candidate in candidates]
        logger.debug("pool %s %s: backtest MAE per lead %s", pool, kind, dict(zip(names, errors)))
        if len(set(winners)) == 1:
            return [candidates[winners[0]]] + [candidates[i] for i in overall if i != winners[0]]
        parts = sorted(set(winners), key=winners.index)
        segments = [
            (a + 1, parts.index(w))
            for (a, _), w, before in zip(self.buckets(), winners, [None, *winners])
            if w != before
        ]
        name = "/".join(candidates[w].name for w in parts)
        stitched = Candidate(name, stitched_fit([candidates[w].fit for w in parts], segments, kind != PRICE))
        return [stitched] + [candidates[i] for i in overall]

    def _backtest_all(
        self, candidates: Sequence[Candidate], kind: str, pool: str, y: np.ndarray, origins: list[int]
    ) -> np.ndarray:
        """Every candidate's :meth:`backtest`, memoised on the settings they depend on and ``y``."""
        digest = hashlib.blake2b(np.ascontiguousarray(y, dtype=float).tobytes(), digest_size=16).hexdigest()
        names = tuple(c.name for c in candidates)
        key = (type(self).__qualname__, names, kind, self.season_slots, self.backtest_horizon, tuple(origins), digest)
        if key in _backtest_cache:
            _backtest_cache.move_to_end(key)
            return _backtest_cache[key]
        errors = np.array([self.backtest(candidate, kind, pool, y, origins) for candidate in candidates])
        _backtest_cache[key] = errors
        if len(_backtest_cache) > _BACKTEST_CACHE_SIZE:
            _backtest_cache.popitem(last=False)
        return errors

    def backtest(self, candidate: Candidate, kind: str, pool: str, y: np.ndarray, origins: list[int]) -> np.ndarray:
        """Absolute error of ``candidate`` per lead time, averaged over the origins; inf if it fails."""
        horizon = self.backtest_horizon
        try:
            fitted = candidate.fit(y[: origins[0]])
            errors = []
            for origin in origins:
                fitted = fitted.update(y[:origin])
                mean = fitted.forecast(horizon).mean
                if kind != PRICE:
                    mean = np.clip(mean, 0.0, y[:origin].max())
                errors.append(np.abs(mean - y[origin : origin + horizon]))
            score = np.mean(errors, axis=0)
        except Exception as error:  # noqa: BLE001 - a failing candidate is ranked last, not fatal
            name, why = candidate.name, f"{type(error).__name__}: {error}"
            logger.warning("pool %s %s: %s failed in the backtest (%s)", pool, kind, name, why)
            return np.full(horizon, np.inf)
        if not np.isfinite(score).all():
            logger.warning("pool %s %s: %s forecast non-finite values in the backtest", pool, kind, candidate.name)
            return np.full(horizon, np.inf)
        return score
