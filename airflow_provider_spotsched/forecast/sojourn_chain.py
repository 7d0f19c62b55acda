"""Availability as a chain over (count, slots since the count last changed).

The Markov count chain (:mod:`.markov_count`) gives a count the same chance of changing in the
next slot however long it has held. Real spot capacity does not behave so: a count that has
just changed often changes again (a zone flaps, a hole in the data reads 0 for an hour), and
one that has held for a day tends to hold. The chance that a count moves next slot, its
*hazard*, falls with the count's age; a chain that ignores age forecasts too much movement for
an old count and too little for a new one. This chain keeps the age in its state.

Estimation, all from the history the model is given:

* ages are grouped in doubling buckets, 1, 2-3, 4-7, 8-15 and 16 slots or more (``AGE_EDGES``),
  so each bucket has data early on;
* the hazard of count i at age bucket b is ``(moved[i, b] + prior * pool[b]) / (held[i, b] +
  prior)``: the moves seen from that count at that age, shrunk with ``prior`` (default 2)
  pseudo-slots towards the pool's hazard at that age over all its counts, itself shrunk the same
  way towards the pool's overall rate. A count seen a few times borrows the pool's pattern;
  one seen often has its own. On a market without duration dependence the bucket hazards come
  out flat and the chain is the Markov chain again, with a little estimation noise;
* where a count goes when it moves is the Markov chain's rule restricted to moves: the moves
  from i to each j != i, with ``smoothing`` pseudo-moves spread evenly over the other counts
  seen (the chain's additive smoothing; no mass on counts the pool never reports).

The k-step distribution propagates (count, age) exactly, ages 1..16 kept apart and 16 and
over merged; its point forecast is the median, its 80% interval the 10% and 90% quantiles, as
the Markov chain's. New slots are counted afresh from the whole history (a few vector
operations), so the model is always exact.

The forecaster's price part is persistence with empirical intervals, as the Markov chain's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast.markov_count import SMOOTHING_MEANING
from airflow_provider_spotsched.forecast.series import (
    Candidate,
    Fit,
    FitError,
    FittedSeries,
    SeriesForecast,
    SeriesForecaster,
    check_positive,
    median_forecast,
    persistence_candidate,
)

AGE_EDGES = np.array([1, 2, 4, 8, 16])
"""Lower ends of the age buckets (slots since the count last changed) that share a hazard."""
OLDEST = int(AGE_EDGES[-1])
"""Ages at or beyond this one are one state: the last bucket's hazard no longer depends on age."""


def ages(y: np.ndarray) -> np.ndarray:
    """Slots since the count last changed, at each slot (1 at the first slot and after a change)."""
    index = np.arange(y.size)
    changed = np.concatenate(([True], y[1:] != y[:-1]))
    return index - np.maximum.accumulate(np.where(changed, index, 0)) + 1


def age_bucket(age: np.ndarray) -> np.ndarray:
    """The index in ``AGE_EDGES`` of each age's bucket."""
    return np.searchsorted(AGE_EDGES, np.minimum(age, OLDEST), side="right") - 1


class SojournChain(FittedSeries):
    """Hazards by count and age, destinations by count, and the chain over (count, age) they make."""

    label = "sojourn-chain"

    def __init__(self, history: np.ndarray, smoothing: float, prior: float) -> None:
        if history.size < 2:
            raise FitError(f"a sojourn chain needs at least 2 slots (one move) of history, got {history.size}")
        y = history.astype(np.int64)
        counts, buckets = int(y.max()) + 1, AGE_EDGES.size
        age = ages(y)
        start, bucket, moved = y[:-1], age_bucket(age[:-1]), y[1:] != y[:-1]
        held, left = np.zeros((counts, buckets)), np.zeros((counts, buckets))
        np.add.at(held, (start, bucket), 1.0)
        np.add.at(left, (start, bucket), moved)
        overall = (left.sum() + 1.0) / (held.sum() + 2.0)
        pool = (left.sum(axis=0) + prior * overall) / (held.sum(axis=0) + prior)
        self.hazard = (left + prior * pool) / (held + prior)
        seen = np.zeros(counts, dtype=bool)
        seen[y] = True
        others = np.tile(seen.astype(float), (counts, 1))
        np.fill_diagonal(others, 0.0)
        spread = others / np.maximum(others.sum(axis=1, keepdims=True), 1.0)
        moves = np.zeros((counts, counts))
        np.add.at(moves, (start[moved], y[1:][moved]), 1.0)
        self.destination = (moves + smoothing * spread) / (moves.sum(axis=1, keepdims=True) + smoothing)
        self.smoothing, self.prior = smoothing, prior
        self.last, self.last_age = int(y[-1]), int(min(age[-1], OLDEST))

    def update(self, history: np.ndarray) -> SojournChain:
        return SojournChain(history, self.smoothing, self.prior)

    def forecast(self, horizon: int) -> SeriesForecast:
        counts = self.hazard.shape[0]
        hazard = self.hazard[:, age_bucket(np.arange(1, OLDEST + 1))]  # [count, age - 1]
        stuck = self.destination.sum(axis=1) == 0  # a pool that only ever reported one count
        state = np.zeros((counts, OLDEST))
        state[self.last, self.last_age - 1] = 1.0
        distribution = np.empty((horizon, counts))
        for step in range(horizon):
            stays, leaves = state * (1.0 - hazard), (state * hazard).sum(axis=1)
            state = np.zeros_like(state)
            state[:, 1:] = stays[:, :-1]
            state[:, -1] += stays[:, -1]
            state[:, 0] += leaves @ self.destination + leaves * stuck
            distribution[step] = state.sum(axis=1)
        return median_forecast(distribution)


def sojourn_chain_fit(smoothing: float = 0.1, prior: float = 2.0) -> Fit:
    """A fit of the sojourn chain with ``smoothing`` pseudo-moves per row and ``prior`` pseudo-slots per hazard."""
    return lambda y: SojournChain(y, smoothing, prior)


class SojournChainForecaster(SeriesForecaster):
    """Counts by the sojourn chain, prices by persistence; persistence if the chain cannot be fitted."""

    name = "sojourn-chain"

    def __init__(self, smoothing: float = 0.1, prior: float = 2.0, refit_every: int = 24) -> None:
        super().__init__(refit_every)
        self.smoothing = check_positive("smoothing", smoothing, SMOOTHING_MEANING)
        self.prior = check_positive("prior", prior, "pseudo-slots shrinking each hazard towards the pool's")

    def params(self) -> dict[str, Any]:
        return {**super().params(), "smoothing": self.smoothing, "prior": self.prior}

    def candidates(self, kind: str) -> Sequence[Candidate]:
        if kind == "price":
            return [persistence_candidate(kind)]
        return [Candidate("sojourn-chain", sojourn_chain_fit(self.smoothing, self.prior)), persistence_candidate(kind)]
