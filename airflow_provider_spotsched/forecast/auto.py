"""Automatic model choice per pool, series and lead time by a rolling-origin backtest on the past alone.

No model suits every pool: AWS prices drift like a random walk, GCP prices never move, some
counts follow the working day and others jump between full and empty. And no model suits every
lead time: an hour ahead the last value is hard to beat, a day ahead a daily profile may win. So
for each pool, and separately for its price and its availability series, the candidates are
backtested on the history the forecaster was given, nothing later:

* price candidates: persistence, seasonal naive, ARIMA, Holt-Winters;
  availability candidates: persistence, seasonal naive, the Markov count chain, Holt-Winters
  (clipped to [0, the largest count seen]);
* forecast origins at every ``origin_step`` slots (default every slot) of the recent past, each
  candidate fitted once on the history before the first and updated (parameters kept) to each
  later one, as it would be between refits, forecasting ``backtest_horizon`` slots (a day), the
  first origin with ``min_training`` slots (two days) of history;
* lead-time buckets (``bucket_ends``, default each lead 1..6 on its own, then 7-12 and 13 on):
  a bucket is scored on the last ``origins`` origins (default six days of them: 144 hourly slots)
  whose forecasts for all its leads have been realised, so an hour ahead is judged on the last
  hour too. The score is each candidate's absolute error averaged over the bucket's leads, per
  origin;
* persistence is the default. A candidate displaces it in a bucket only when its mean error is
  lower by more than ``margin`` (default 5%) *and* a one-sided Diebold-Mariano test on the
  per-origin differences from persistence's errors rejects equal accuracy at ``significance``
  (default 5%; Newey-West variance with as many lags, in origins, as the bucket's last lead, for
  the overlap of multi-step forecasts). Of the candidates that pass, the lowest mean error wins,
  ties going to the simpler model (the order above). Where buckets have different winners the
  forecast stitches them (:class:`~.series.Stitched`: point, interval and count distribution of
  each lead from its bucket's model; the last bucket's model forecasts every later lead too),
  labelled like ``persistence@1-3/holt-winters(N,A)@4-``. A bucket with fewer than
  ``MIN_SCORED`` realised origins (a short history) keeps persistence.

Why the test: at short leads a count or a price that sticks for hours makes persistence's error
zero in most slots, and the few jumps decide every mean. Ten origins half a day apart (the
choice before) gave 20 errors per bucket, and a model that was lucky on two of the jumps won by
far more than a 5% margin: on the shipped GCP trace, seasonal naive chosen for leads 1-2 had
0.62 of persistence's error at those origins, 1.24 at every origin of the same days, and 1.44
after the choice (``benchmarks/auto_selection_noise.py --trace gcp --origins 48``). Every origin
of six days and a test that asks how likely the gain is by chance keep persistence unless the
evidence is real.

The ranking (the stitch or single winner first, then the candidates by their score over all
leads) is kept for ``reselect_every`` slots (a week); the chosen models are refitted on the whole
history every ``refit_every`` slots (a day) and updated in between, so the hourly call costs one
state update per series and model. A candidate whose fit raises, does not converge or forecasts non-finite values
scores worst in the backtest, and the next in the ranking replaces the choice when it fails
later, each with a logged warning (:class:`~.series.SeriesForecaster`). ``Forecast.models``
names the choice per pool as ``price-model+availability-model``.

The defaults of these durations (and ``season_slots``, a day) count hourly slots; built for a
market's slots (``make_forecaster(..., slot_hours=...)``) they are the same durations in those
slots: on 15-minute slots a refit every 96 slots, not every 24 (6 hours).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import ndtri

from airflow_provider_spotsched.forecast import arima, exponential_smoothing, markov_count
from airflow_provider_spotsched.forecast.series import (
    AVAILABLE,
    PRICE,
    Candidate,
    SeriesForecaster,
    SeriesState,
    check_int,
    persistence_candidate,
    seasonal_naive_fit,
    stitched_fit,
)

logger = logging.getLogger(__name__)

MIN_TRAINING = 48  # slots a candidate is fitted on before the first backtest origin: two days of hourly slots
MIN_SCORED = 12  # origins a bucket needs before any model may displace persistence in it

# A backtest is a pure function of the candidates' settings and the series, and the same one
# recurs whenever several jobs plan on one market at one time (an evaluation runs 24 per start;
# CHC members replayed by the selector share them too). A bounded per-process memo runs each once.
_BACKTEST_CACHE_SIZE = 1024
_backtest_cache: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()


class AutoForecaster(SeriesForecaster):
    """The backtest's best model per pool, series and lead-time bucket where it beats persistence
    beyond chance, else persistence; reselected and refitted on a schedule."""

    name = "auto"

    def __init__(
        self,
        refit_every: int = 24,
        reselect_every: int = 168,
        origins: int = 144,
        backtest_horizon: int = 24,
        season_slots: int = 24,
        margin: float = 0.05,
        bucket_ends: Sequence[int] = (1, 2, 3, 4, 5, 6, 12),
        origin_step: int = 1,
        significance: float = 0.05,
        min_training: int = MIN_TRAINING,
    ) -> None:
        super().__init__(refit_every)
        self.season_slots = check_int("season_slots", season_slots, 1, "slots per season")
        self.reselect_every = check_int("reselect_every", reselect_every, 1, "slots between model choices")
        self.origins = check_int("origins", origins, 1, "backtest forecast origins per lead-time bucket")
        self.backtest_horizon = check_int("backtest_horizon", backtest_horizon, 1, "slots per backtest forecast")
        self.origin_step = check_int("origin_step", origin_step, 1, "slots between backtest origins")
        self.min_training = check_int("min_training", min_training, 1, "slots of history before the first backtest origin")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(
                f"margin must be a number in [0, 1) (share of persistence's error to beat), got {margin!r}"
            )
        self.margin = float(margin)
        if isinstance(significance, bool) or not isinstance(significance, (int, float)) or not 0 <= significance < 0.5:
            raise ValueError(
                "significance must be a number in [0, 0.5) (level of the test a model must pass to displace "
                f"persistence; 0: no test), got {significance!r}"
            )
        self.significance = float(significance)
        if isinstance(bucket_ends, (str, bytes)) or not isinstance(bucket_ends, Sequence):
            raise ValueError(f"bucket_ends must be a list of increasing integers >= 1, got {bucket_ends!r}")
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
            "origin_step": self.origin_step,
            "significance": self.significance,
            "min_training": self.min_training,
        }

    def candidates(self, kind: str) -> Sequence[Candidate]:
        season = self.season_slots
        baselines = [persistence_candidate(kind), Candidate("seasonal-naive", seasonal_naive_fit(season, counts=kind == AVAILABLE))]
        smoothing = Candidate("holt-winters", lambda y: exponential_smoothing.fit_holt_winters(y, season))
        if kind == PRICE:
            return baselines + [Candidate("arima", lambda y: arima.fit_arima(y, season)), smoothing]
        return baselines + [Candidate("markov-count", markov_count.markov_count_fit()), smoothing]

    def needs_ranking(self, state: SeriesState, n: int) -> bool:
        return n - state.ranked_at >= self.reselect_every

    def backtest_origins(self, n: int) -> list[int]:
        """Forecast origins (slots seen at each) for a history of ``n`` slots, oldest first: every
        ``origin_step`` slots back from the last slot, enough for ``origins`` fully realised
        forecasts at the longest lead, and at least ``min_training`` slots each."""
        count = self.origins + -(-(self.backtest_horizon - 1) // self.origin_step)
        return [o for o in (n - 1 - self.origin_step * j for j in reversed(range(count))) if o >= self.min_training]

    def buckets(self) -> list[tuple[int, int]]:
        """Lead-time buckets as 0-based ``[start, stop)`` slices of the backtest's leads."""
        edges = [0, *(end for end in self.bucket_ends if end < self.backtest_horizon), self.backtest_horizon]
        return list(zip(edges, edges[1:]))

    def bucket_rows(self, origins: Sequence[int], n: int, stop: int) -> np.ndarray:
        """Indices of the last ``self.origins`` origins whose forecasts up to lead ``stop`` are realised."""
        realised = np.flatnonzero(np.asarray(origins) + stop <= n)
        return realised[-self.origins :]

    def order(self, scores: np.ndarray) -> list[int]:
        """Candidate indices best first: persistence (index 0) must be beaten by the margin, ties
        go to the simpler model."""
        penalised = [score if i == 0 else score * (1 + self.margin) for i, score in enumerate(scores)]
        return sorted(range(len(scores)), key=lambda i: (penalised[i], i))

    def winner(self, losses: np.ndarray, lags: int) -> int:
        """The candidate for a bucket from its per-origin losses ``[candidate, origin]``: persistence
        (index 0) unless others beat it by the margin and, with a ``significance``, beyond chance
        (one-sided Diebold-Mariano test, Newey-West variance with ``lags`` lags); then the lowest
        mean loss of those, ties to the simpler model."""
        if losses.shape[1] < MIN_SCORED:
            return 0
        scores = losses.mean(axis=1)
        critical = ndtri(1.0 - self.significance) if self.significance > 0 else -np.inf
        passed = [
            c for c in range(1, len(scores))
            if np.isfinite(scores[c]) and scores[c] * (1 + self.margin) < scores[0]
            and diebold_mariano(losses[c] - losses[0], lags) < -critical
        ]
        return min(passed, key=lambda c: (scores[c], c)) if passed else 0

    def rank(self, kind: str, pool: str, y: np.ndarray) -> list[Candidate]:
        """The bucket winners (stitched where they differ) first, then every candidate by its score
        over all leads: the fallbacks should the first fail to fit."""
        candidates = list(self.candidates(kind))
        origins = self.backtest_origins(y.size)
        if not origins:
            return candidates
        errors = self._backtest_all(candidates, kind, pool, y, origins)  # [candidate, origin, lead]
        full = self.bucket_rows(origins, y.size, self.backtest_horizon)
        overall = self.order(errors[:, full].mean(axis=(1, 2))) if full.size else list(range(len(candidates)))
        winners = []
        for a, b in self.buckets():
            rows = self.bucket_rows(origins, y.size, b)
            winners.append(self.winner(errors[:, rows, a:b].mean(axis=2), -(-b // self.origin_step)))
        names = [candidate.name for candidate in candidates]
        logger.debug("pool %s %s: bucket winners %s", pool, kind, [names[w] for w in winners])
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
        """Absolute error ``[origin, lead]`` of ``candidate``, NaN where the lead lies beyond ``y``
        (not yet realised); inf everywhere if it fails."""
        horizon = self.backtest_horizon
        errors = np.full((len(origins), horizon), np.nan)
        try:
            fitted = candidate.fit(y[: origins[0]])
            for row, origin in enumerate(origins):
                fitted = fitted.update(y[:origin])
                mean = fitted.forecast(horizon).mean
                if kind != PRICE:
                    mean = np.clip(mean, 0.0, y[:origin].max())
                actual = y[origin : origin + horizon]
                errors[row, : actual.size] = np.abs(mean[: actual.size] - actual)
        except Exception as error:  # noqa: BLE001 - a failing candidate is ranked last, not fatal
            name, why = candidate.name, f"{type(error).__name__}: {error}"
            logger.warning("pool %s %s: %s failed in the backtest (%s)", pool, kind, name, why)
            return np.full((len(origins), horizon), np.inf)
        known = ~np.isnan(errors)
        if not np.isfinite(errors[known]).all():
            logger.warning("pool %s %s: %s forecast non-finite values in the backtest", pool, kind, candidate.name)
            return np.full((len(origins), horizon), np.inf)
        return errors


def diebold_mariano(differences: np.ndarray, lags: int) -> float:
    """The Diebold-Mariano statistic of ``differences`` (a model's loss minus the reference's, per
    origin, in time order): their mean over its standard error, from a Newey-West (Bartlett
    kernel) long-run variance with ``lags`` lags. Negative: the model does better. An exact tie
    (every difference 0) is 0; differences that never vary are -inf or +inf by their sign."""
    d = np.asarray(differences, dtype=float)
    if d.size == 0 or not np.isfinite(d).all():
        return np.inf
    mean = float(d.mean())
    centred = d - mean
    variance = float(centred @ centred) / d.size
    for lag in range(1, min(lags, d.size - 1) + 1):
        variance += 2.0 * (1.0 - lag / (lags + 1.0)) * float(centred[lag:] @ centred[:-lag]) / d.size
    if variance <= 1e-18 * max(1.0, mean * mean):
        return 0.0 if mean == 0 else float(np.copysign(np.inf, mean))
    return mean / float(np.sqrt(variance / d.size))
