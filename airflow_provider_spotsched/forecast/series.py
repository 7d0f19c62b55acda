"""Per-series forecasting: the pieces every statistical forecaster of the project shares.

A statistical forecaster models each pool's two series (spot price, available count) on its own.
A *fit* turns one series into a :class:`FittedSeries`, which forecasts the next slots (point and
80% interval, for counts optionally a full distribution) and :meth:`~FittedSeries.update`\\ s
itself with new observations without re-estimating its parameters. :class:`SeriesForecaster`
runs the fits for every pool on a schedule: a fit every ``refit_every`` slots, a cheap update in
between, so the scheduler's hourly call stays fast. Its cache is keyed by pool and by the history
the model has seen; a ``past`` that does not extend that history is fitted afresh.

Every forecaster tries a ranked list of fits per series and falls to the next one when a fit
raises, does not converge or forecasts non-finite values, logging why; persistence closes every
list and cannot fail on checked data, so a forecast is always produced and never holds NaN.

Bad data is refused up front (:func:`check_history`): non-finite or negative prices, non-finite,
negative or fractional counts each raise a ``ValueError`` naming the pool. A history too short for
a model (a single slot, say) is the documented fallback case: the model's fit raises
:class:`FitError`, the forecaster logs it and forecasts with the next fit, in the end persistence,
and ``Forecast.models`` names what was used.

Availability forecasts are clipped to [0, the largest count seen] and turned into a distribution
over counts 0..C: a model that gives one is used as is (the Markov chain its k-step distribution,
persistence and seasonal naive the counts that followed the same count ``lag`` slots later:
:func:`lagged_counts`), any other's point and interval become a discretised normal whose 80%
interval matches the model's (mass outside [0, max seen] is folded onto the ends). Prices are
clipped at 0.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import ndtr
from threadpoolctl import threadpool_limits

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.market.slots import SlotMarket

logger = logging.getLogger(__name__)

Z80 = 1.2815515655446004  # standard normal quantile of 0.9: an 80% central interval is mean +- Z80 sd
LOWER_Q, UPPER_Q = 0.1, 0.9
PRICE, AVAILABLE = "price", "available"


# A fit is a pure function of its settings and the series, and fitted models are never changed in
# place (``update`` returns a copy), so jobs that fit the same series at the same time (an
# evaluation's 24 jobs per start) can share one. A bounded per-process memo keeps the recent ones.
_FIT_CACHE_SIZE = 512
_fit_cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def memoised_fit(fit: Callable[..., Any]) -> Callable[..., Any]:
    """``fit(y, *settings)`` run once per settings and series contents in this process."""

    @functools.wraps(fit)
    def memoised(y: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        digest = hashlib.blake2b(np.ascontiguousarray(y, dtype=float).tobytes(), digest_size=16).hexdigest()
        key = (fit.__module__, fit.__qualname__, args, tuple(sorted(kwargs.items())), digest)
        if key in _fit_cache:
            _fit_cache.move_to_end(key)
            return _fit_cache[key]
        fitted = fit(y, *args, **kwargs)
        _fit_cache[key] = fitted
        if len(_fit_cache) > _FIT_CACHE_SIZE:
            _fit_cache.popitem(last=False)
        return fitted

    return memoised


def single_threaded() -> threadpool_limits:
    """Keep BLAS to one thread while statsmodels fits: its Kalman filter multiplies tiny matrices,
    and on a loaded machine BLAS threads spinning on those make a fit tens of times slower."""
    return threadpool_limits(limits=1, user_api="blas")


class FitError(RuntimeError):
    """A model could not be fitted to a series (too short, failed or did not converge)."""


@dataclass(frozen=True)
class SeriesForecast:
    """One series' forecast for the next ``h`` slots: ``mean``, 80% ``lower``/``upper`` bounds and,
    for counts, optionally ``distribution[h, C + 1]`` (probability of each count 0..C)."""

    mean: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    distribution: np.ndarray | None = None

    def is_finite(self) -> bool:
        parts = [self.mean, self.lower, self.upper]
        if self.distribution is not None:
            parts.append(self.distribution)
        return all(np.isfinite(part).all() for part in parts)


class FittedSeries(ABC):
    """A model fitted to one series; ``label`` names it in ``Forecast.models``."""

    label: str

    @abstractmethod
    def update(self, history: np.ndarray) -> FittedSeries:
        """The model with its state carried through ``history`` (an extension of what it has seen),
        its parameters kept: far cheaper than a fit."""

    @abstractmethod
    def forecast(self, horizon: int) -> SeriesForecast:
        """The next ``horizon`` slots after the last one seen."""


Fit = Callable[[np.ndarray], FittedSeries]


@dataclass(frozen=True)
class Candidate:
    """A named way to fit a series; forecasters rank these and fall down the list on failure."""

    name: str
    fit: Fit


def check_history(past: SlotMarket) -> None:
    """Refuse data no model may be fitted to, naming the pool, the problem and the fix."""
    for m, pool in enumerate(past.pools):
        price = np.asarray(past.spot_price[:, m], dtype=float)
        bad = ~np.isfinite(price)
        if bad.any():
            what = "all" if bad.all() else f"{int(bad.sum())} of"
            raise ValueError(
                f"pool {pool!r}: {what} {price.size} spot prices are NaN or infinite; resample the trace "
                f"(market.slots.resample carries the last price through holes) or drop the pool"
            )
        if (price < 0).any():
            slot = int(np.argmax(price < 0))
            raise ValueError(
                f"pool {pool!r}: spot price {price[slot]:g} in slot {slot} is negative; prices are USD per "
                f"instance-hour and must be >= 0: fix the trace"
            )
        counts = np.asarray(past.available[:, m], dtype=float)
        if not np.isfinite(counts).all() or (counts < 0).any() or (counts != np.rint(counts)).any():
            raise ValueError(
                f"pool {pool!r}: available counts must be whole numbers >= 0 (a hole in the data counts as 0); "
                f"got values such as {counts[~np.isfinite(counts) | (counts < 0) | (counts != np.rint(counts))][:3]}"
            )


def check_positive(name: str, value: Any, meaning: str) -> float:
    """``value`` as a float if it is a finite number > 0, else a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0 ({meaning}), got {value!r}")
    return float(value)


def check_int(name: str, value: Any, minimum: int, meaning: str) -> int:
    """``value`` as an int if it is a whole number >= ``minimum``, else a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({meaning}), got {value!r}")
    return int(value)


def seasonal_strength(y: np.ndarray, season: int) -> float:
    """How much of the detrended variance a fixed daily profile explains (0: none, 1: all).

    Classical decomposition: a centred moving average of one season is the trend, the mean of
    the detrended series per phase of the season the profile. The share of variance the profile
    explains is adjusted for the ``season`` means it fits, like an adjusted R^2 (on pure noise
    seen for c seasons the raw share is about 1/c, the adjusted one about 0). Needs two seasons.
    """
    if season < 2 or y.size < 2 * season:
        return 0.0
    kernel = np.ones(season + 1 - season % 2)
    kernel[0] = kernel[-1] = 0.5 if season % 2 == 0 else 1.0
    trend = np.convolve(y, kernel / kernel.sum(), mode="valid")
    offset = (kernel.size - 1) // 2
    detrended = y[offset : offset + trend.size] - trend
    phase = (np.arange(detrended.size) + offset) % season
    profile = np.bincount(phase, weights=detrended, minlength=season) / np.bincount(phase, minlength=season)
    remainder = detrended - profile[phase]
    total, n = detrended.var(), detrended.size
    if total <= 0 or n <= season:
        return 0.0
    return float(max(0.0, 1.0 - remainder.var() / total * (n - 1) / (n - season)))


class LaggedCopy(FittedSeries):
    """The value ``lag(h)`` slots before each future slot, with an empirical interval and, for a
    count, an empirical distribution.

    The interval at lead ``h`` adds the 10% and 90% quantiles of the ``lag(h)``-slot changes in
    the history it was fitted on (widened to include 0, so it always contains the point); these
    are its parameters, kept between refits. Without such changes in the history it has zero
    width. Persistence is ``lag(h) = h``; seasonal naive repeats the last season (``lag(h)`` =
    whole seasons reaching back past ``h``) and is persistence where the history holds less than
    a season.

    With ``counts`` the forecast also carries the distribution of the count (:func:`lagged_counts`).
    A normal read off the interval would not do: a count that stays put in more than 80% of the
    slots has a zero-width interval, and a normal of zero width states that it never moves.
    """

    def __init__(self, label: str, history: np.ndarray, season: int | None = None, counts: bool = False) -> None:
        if history.size < 1:
            raise FitError(f"{label} needs at least one slot of history")
        self.label = label
        self.history = self.fitted_on = history
        self.season = season
        self.counts = counts
        self.bands: dict[int, tuple[float, float]] = {}  # lag -> (low, high) change quantiles
        self.count_chances: dict[tuple[int, int, int], np.ndarray] = {}  # (lag, value, top) -> lagged_counts

    def update(self, history: np.ndarray) -> LaggedCopy:
        updated = copy.copy(self)
        updated.history = history
        return updated

    def band(self, lag: int) -> tuple[float, float]:
        if lag not in self.bands:
            y = self.fitted_on
            changes = y[lag:] - y[:-lag] if lag < y.size else np.zeros(1)
            low, high = np.quantile(changes, [LOWER_Q, UPPER_Q])
            self.bands[lag] = (min(float(low), 0.0), max(float(high), 0.0))
        return self.bands[lag]

    def chances(self, lag: int, value: int, top: int) -> np.ndarray:
        """:func:`lagged_counts` on the history it was fitted on, kept between refits like the bands."""
        key = (lag, value, top)
        if key not in self.count_chances:
            self.count_chances[key] = lagged_counts(self.fitted_on, lag, value, top)
        return self.count_chances[key]

    def forecast(self, horizon: int) -> SeriesForecast:
        y, n = self.history, self.history.size
        leads = np.arange(1, horizon + 1)
        if self.season is None or n < self.season:
            lags = leads
        else:
            lags = self.season * -(-leads // self.season)
        source = n - 1 + leads - lags
        mean = y[np.where(source >= 0, source, n - 1)].astype(float)
        bands = np.array([self.band(int(lag)) for lag in lags])
        distribution = None
        if self.counts:
            top = int(y.max())
            distribution = np.array([self.chances(int(lag), int(value), top) for lag, value in zip(lags, mean)])
        return SeriesForecast(mean, mean + bands[:, 0], mean + bands[:, 1], distribution)


PRIOR_SLOTS = 10.0
"""How many slots' worth of weight :func:`lagged_counts` gives the changes of every count against
what followed the current one."""


def lagged_counts(history: np.ndarray, lag: int, value: int, top: int) -> np.ndarray:
    """``[top + 1]``: the chance of each count 0..``top`` ``lag`` slots after a slot at ``value``,
    as ``history`` (a count series) has seen it.

    What followed the slots at ``value``: a full pool moves differently from an empty one or one
    in between (a full pool can only lose capacity), and how often it moves is what the chance of
    a count rests on. A count seen a few times says little, so those outcomes are pooled with the
    ``lag``-slot changes of every slot, added to ``value`` (what falls outside [0, ``top``] folded
    onto the ends), weighted as :data:`PRIOR_SLOTS` slots: a count seen far more often than that
    speaks for itself, one never seen takes the changes of all. A history with no slots ``lag``
    apart states ``value`` for sure.
    """
    dist = np.zeros(top + 1)
    if lag >= history.size:
        dist[min(max(value, 0), top)] = 1.0
        return dist
    before, after = history[:-lag].astype(int), history[lag:].astype(int)
    changes = np.bincount(np.clip(value + after - before, 0, top), minlength=top + 1)
    np.add.at(dist, np.clip(after[before == value], 0, top), 1.0)
    return (dist + PRIOR_SLOTS * changes / changes.sum()) / (dist.sum() + PRIOR_SLOTS)


def fit_persistence(y: np.ndarray) -> FittedSeries:
    return LaggedCopy("persistence", y)


def fit_persistence_counts(y: np.ndarray) -> FittedSeries:
    return LaggedCopy("persistence", y, counts=True)


def persistence_candidate(kind: str) -> Candidate:
    """Persistence for a series of ``kind``; for counts with the distribution of :func:`lagged_counts`."""
    return Candidate("persistence", fit_persistence_counts if kind == AVAILABLE else fit_persistence)


def seasonal_naive_fit(season: int, counts: bool = False) -> Fit:
    return lambda y: LaggedCopy("seasonal-naive", y, season, counts)


def median_forecast(distribution: np.ndarray) -> SeriesForecast:
    """A count model's forecast from its distribution ``[lead, count]``: the median as the point
    (it minimises the expected absolute error and stays on a count the pool takes, where a
    bimodal mean would not), the 10% and 90% quantiles as the 80% interval."""
    cdf = np.cumsum(distribution, axis=1)
    lower, median, upper = (np.argmax(cdf >= q - 1e-12, axis=1).astype(float) for q in (LOWER_Q, 0.5, UPPER_Q))
    return SeriesForecast(median, lower, upper, distribution)


def count_distribution(mean: np.ndarray, lower: np.ndarray, upper: np.ndarray, top: int) -> np.ndarray:
    """``[h, top + 1]``: a normal with the forecast's mean and 80% interval, discretised on 0..top.

    Each count c takes the normal's mass on [c - 0.5, c + 0.5); the tails fold onto 0 and ``top``.
    A zero-width interval splits the mass between the two counts around the mean, keeping it.
    """
    counts = np.arange(top + 1)
    sd = (upper - lower) / (2 * Z80)
    dist = np.zeros((mean.size, top + 1))
    wide = sd > 1e-9
    if wide.any():
        edges = (counts[None, 1:] - 0.5 - mean[wide, None]) / sd[wide, None]
        cdf = np.hstack([np.zeros((wide.sum(), 1)), ndtr(edges), np.ones((wide.sum(), 1))])
        dist[wide] = np.diff(cdf, axis=1)
    if (~wide).any():
        point = np.clip(mean[~wide], 0, top)
        low = np.floor(point).astype(int)
        rows = np.flatnonzero(~wide)
        frac = point - low
        dist[rows, low] = 1 - frac
        dist[rows, np.minimum(low + 1, top)] += frac
    return dist


class Stitched(FittedSeries):
    """Different models for different lead times: ``segments`` pairs each first lead (1 first,
    increasing) with the index of the component that forecasts from it to the next first lead.

    A backtest may find persistence best an hour or two ahead and a seasonal model best a day
    ahead; stitching keeps each where it wins. Point, interval and distribution are all taken from
    the segment's model; where only some components give a count distribution, the others' point
    and interval become the discretised normal of :func:`count_distribution` on 0..``top``
    (``top``: the largest count seen, None for prices), as the forecaster does for a whole series.
    """

    def __init__(
        self, components: Sequence[FittedSeries], segments: Sequence[tuple[int, int]], top: int | None
    ) -> None:
        if not segments or segments[0][0] != 1 or any(b[0] <= a[0] for a, b in zip(segments, segments[1:])):
            raise ValueError(f"segments must start at lead 1 and increase, got {list(segments)}")
        self.components, self.segments, self.top = list(components), list(segments), top
        ranges = [
            f"{first}" if nxt == first + 1 else f"{first}-{nxt - 1}"
            for (first, _), (nxt, _) in zip(self.segments, self.segments[1:])
        ]
        ranges.append(f"{self.segments[-1][0]}-")
        self.label = "/".join(f"{self.components[c].label}@{r}" for (_, c), r in zip(self.segments, ranges))

    def update(self, history: np.ndarray) -> Stitched:
        top = None if self.top is None else int(history.max())
        return Stitched([c.update(history) for c in self.components], self.segments, top)

    def forecast(self, horizon: int) -> SeriesForecast:
        bounds = [(first - 1, nxt - 1) for (first, _), (nxt, _) in zip(self.segments, self.segments[1:])]
        bounds.append((self.segments[-1][0] - 1, horizon))
        used = [(a, min(b, horizon), c) for (a, b), (_, c) in zip(bounds, self.segments) if a < horizon]
        results = {c: self.components[c].forecast(horizon) for _, _, c in used}
        mean, lower, upper = (np.empty(horizon) for _ in range(3))
        for a, b, c in used:
            mean[a:b], lower[a:b], upper[a:b] = results[c].mean[a:b], results[c].lower[a:b], results[c].upper[a:b]
        distribution = None
        if self.top is not None and any(r.distribution is not None for r in results.values()):
            distribution = np.empty((horizon, self.top + 1))
            for a, b, c in used:
                part = results[c]
                if part.distribution is None:
                    clipped = _clip(part, 0.0, float(self.top))
                    distribution[a:b] = count_distribution(clipped.mean, clipped.lower, clipped.upper, self.top)[a:b]
                else:
                    distribution[a:b] = part.distribution[a:b]
        return SeriesForecast(mean, lower, upper, distribution)


def stitched_fit(fits: Sequence[Fit], segments: Sequence[tuple[int, int]], counts: bool) -> Fit:
    """A fit of every component in ``fits``, stitched by lead time (:class:`Stitched`); ``counts``
    says whether the series is a count, whose distribution is stitched too."""
    return lambda y: Stitched([fit(y) for fit in fits], segments, int(y.max()) if counts else None)


@dataclass
class SeriesState:
    """A series' model, the history it has seen, and the history lengths it was fitted and ranked at."""

    history: np.ndarray
    fitted: FittedSeries
    fitted_at: int
    ranking: list[Candidate]
    ranked_at: int


class SeriesForecaster(Forecaster):
    """Forecasts each pool's price and availability with ranked per-series fits on a refit schedule.

    Subclasses name the candidate fits per series kind (:meth:`candidates`); the default ranking is
    their order. The first that fits and forecasts finite values is used; it is refitted every
    ``refit_every`` slots (default a day of hourly slots: ``make_forecaster`` gives a day of the
    market's) and updated in between.
    """

    def __init__(self, refit_every: int = 24) -> None:
        self.refit_every = check_int("refit_every", refit_every, 1, "slots between model refits")
        self._cache: dict[tuple[Any, ...], SeriesState] = {}

    def params(self) -> dict[str, Any]:
        return {"refit_every": self.refit_every}

    @abstractmethod
    def candidates(self, kind: str) -> Sequence[Candidate]:
        """Fits to try for series ``kind`` (``"price"`` or ``"available"``), best first."""

    def rank(self, kind: str, pool: str, y: np.ndarray) -> list[Candidate]:
        """The order to try the candidates in on series ``y``; :class:`AutoForecaster` backtests."""
        return list(self.candidates(kind))

    def needs_ranking(self, state: SeriesState, n: int) -> bool:
        """Whether the ranking made at ``state.ranked_at`` slots is stale at ``n`` slots."""
        return False

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        check_history(past)
        prices, counts, labels = [], [], []
        for m, pool in enumerate(past.pools):
            key = (past.start, past.slot_hours, pool)
            price, price_label = self._series(key + (PRICE,), PRICE, pool, past.spot_price[:, m].astype(float), horizon)
            y = past.available[:, m].astype(float)
            count, count_label = self._series(key + (AVAILABLE,), AVAILABLE, pool, y, horizon)
            prices.append(_clip(price, 0.0, np.inf))
            counts.append((_clip(count, 0.0, float(y.max())), int(y.max())))
            labels.append(f"{price_label}+{count_label}")
        top = max(c for _, c in counts)
        distribution = np.zeros((horizon, len(counts), top + 1))
        for m, (count, pool_top) in enumerate(counts):
            dist = count.distribution
            if dist is None or dist.shape[1] != pool_top + 1:
                dist = count_distribution(count.mean, count.lower, count.upper, pool_top)
            distribution[:, m, : pool_top + 1] = dist / dist.sum(axis=1, keepdims=True)
        return Forecast(
            spot_price=np.column_stack([p.mean for p in prices]),
            available=np.column_stack([c.mean for c, _ in counts]),
            spot_price_interval=(
                np.column_stack([p.lower for p in prices]),
                np.column_stack([p.upper for p in prices]),
            ),
            available_interval=(
                np.column_stack([c.lower for c, _ in counts]),
                np.column_stack([c.upper for c, _ in counts]),
            ),
            available_distribution=distribution,
            models=tuple(labels),
        )

    def _series(
        self, key: tuple[Any, ...], kind: str, pool: str, y: np.ndarray, horizon: int
    ) -> tuple[SeriesForecast, str]:
        """One series' forecast and the label of the model behind it, refitting only when due."""
        n = y.size
        cached = self._cache.get(key)
        if cached is not None and not _extends(y, cached.history):
            cached = None
        if cached is not None and self.needs_ranking(cached, n):
            cached = None
        if cached is not None and n - cached.fitted_at < self.refit_every:
            try:
                fitted = cached.fitted.update(y)
                result = fitted.forecast(horizon)
                if result.is_finite():
                    cached.history, cached.fitted = y.copy(), fitted
                    return result, fitted.label
                reason = "non-finite values"
            except Exception as error:  # noqa: BLE001 - any model failure falls back to a refit
                reason = f"{type(error).__name__}: {error}"
            logger.warning("pool %s %s: updating %s failed (%s); refitting", pool, kind, cached.fitted.label, reason)
        ranking, ranked_at = (cached.ranking, cached.ranked_at) if cached else (self.rank(kind, pool, y), n)
        for candidate in ranking:
            try:
                fitted = candidate.fit(y)
                result = fitted.forecast(horizon)
                if result.is_finite():
                    self._cache[key] = SeriesState(y.copy(), fitted, n, ranking, ranked_at)
                    return result, fitted.label
                reason = "non-finite values"
            except Exception as error:  # noqa: BLE001 - any model failure falls back to the next model
                reason = f"{type(error).__name__}: {error}"
            name = candidate.name
            logger.warning("pool %s %s: %s gave no forecast (%s); trying the next model", pool, kind, name, reason)
        raise FitError(f"pool {pool!r}: no model could forecast its {kind} series")


def _extends(y: np.ndarray, seen: np.ndarray) -> bool:
    """Whether ``y`` starts with exactly ``seen``: the same history with newer slots appended."""
    return y.size >= seen.size and np.array_equal(y[: seen.size], seen)


def _clip(result: SeriesForecast, low: float, high: float) -> SeriesForecast:
    """The forecast inside [low, high], its interval kept around the point."""
    mean = np.clip(result.mean, low, high)
    return SeriesForecast(
        mean,
        np.minimum(np.clip(result.lower, low, high), mean),
        np.maximum(np.clip(result.upper, low, high), mean),
        result.distribution,
    )


__all__ = [
    "AVAILABLE",
    "PRICE",
    "Candidate",
    "FitError",
    "FittedSeries",
    "LaggedCopy",
    "SeriesForecast",
    "SeriesForecaster",
    "SeriesState",
    "Stitched",
    "check_history",
    "check_int",
    "count_distribution",
    "fit_persistence",
    "fit_persistence_counts",
    "lagged_counts",
    "persistence_candidate",
    "seasonal_naive_fit",
    "seasonal_strength",
    "single_threaded",
    "stitched_fit",
]
