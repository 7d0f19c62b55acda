"""Availability as a Markov chain over the counts 0..C seen in a pool (C: the largest).

Available counts are small integers that stick for hours and jump (a zone fills up, a hole in
the data reads 0), which a Gaussian model smears over impossible values. The chain keeps them in
[0, C] by construction and gives what the scheduler needs most, the probability that at least
n instances are obtainable in each future slot.

Estimation: ``moves[i, j]`` is the number of slot-to-slot moves from count i to count j in the
history and S the set of counts seen; each row of the transition matrix is
``P[i, j] = (moves[i, j] + smoothing / |S| [j in S]) / (sum_j moves[i, j] + smoothing)``,
additive (Laplace-style) smoothing that spreads ``smoothing`` pseudo-moves (default 0.1) evenly
over the counts seen: a count never left yet keeps a small chance of moving to any other seen
count, a row without moves (the last count, first seen now) is uniform instead of undefined, and
counts never seen (a zone that only ever reports 0, 13, 15 or 16) get no mass. Smoothing over
all of 0..C instead leaks mass into counts the pool never reports and drags the forecast to the
middle; a small total lets the evidence dominate after a few moves. A constant count is thus
forecast exactly, with a zero-width interval. The k-step distribution is the current
count's one-hot vector times P, k times. The point forecast is its median, not its expectation:
a pool that jumps between full and empty has a bimodal distribution whose expectation drifts to a
count it never takes, while the median stays on one mode and minimises the expected absolute
error. The 80% interval is its 10% and 90% quantiles. New slots add their moves to the
counts (exact and cheap, so the chain is always up to date between refits).

The forecaster's price part is persistence with empirical intervals (:class:`~.series.LaggedCopy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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

SMOOTHING_MEANING = "pseudo-moves per transition-matrix row"


class MarkovCount(FittedSeries):
    """Transition counts between available counts, and the chain they estimate."""

    label = "markov-count"

    def __init__(self, history: np.ndarray, smoothing: float, moves: np.ndarray | None = None, seen: int = 0) -> None:
        if history.size < 2:
            raise FitError(f"a Markov chain needs at least 2 slots (one move) of history, got {history.size}")
        y = history.astype(np.int64)
        top = int(y.max())
        previous = np.zeros((top + 1, top + 1)) if moves is None else moves
        self.moves = np.zeros((top + 1, top + 1))
        self.moves[: previous.shape[0], : previous.shape[1]] = previous
        start = max(seen - 1, 0)  # the move into the first new slot starts at the last seen one
        np.add.at(self.moves, (y[start:-1], y[start + 1 :]), 1.0)
        self.seen_counts = np.zeros(top + 1, dtype=bool)
        self.seen_counts[y] = True
        self.smoothing, self.history, self.last = smoothing, history, int(y[-1])

    def update(self, history: np.ndarray) -> MarkovCount:
        return MarkovCount(history, self.smoothing, self.moves, self.history.size)

    def transition_matrix(self) -> np.ndarray:
        prior = self.smoothing * self.seen_counts / self.seen_counts.sum()
        return (self.moves + prior) / (self.moves.sum(axis=1, keepdims=True) + self.smoothing)

    def forecast(self, horizon: int) -> SeriesForecast:
        matrix = self.transition_matrix()
        states = matrix.shape[0]
        distribution = np.empty((horizon, states))
        current = np.zeros(states)
        current[self.last] = 1.0
        for step in range(horizon):
            current = current @ matrix
            distribution[step] = current
        return median_forecast(distribution)


def markov_count_fit(smoothing: float = 0.1) -> Fit:
    """A fit of the chain with ``smoothing`` pseudo-moves per row."""
    return lambda y: MarkovCount(y, smoothing)


class MarkovCountForecaster(SeriesForecaster):
    """Counts by the Markov chain, prices by persistence; persistence if the chain cannot be fitted."""

    name = "markov-count"

    def __init__(self, smoothing: float = 0.1, refit_every: int = 24) -> None:
        super().__init__(refit_every)
        self.smoothing = check_positive("smoothing", smoothing, SMOOTHING_MEANING)

    def params(self) -> dict[str, Any]:
        return {**super().params(), "smoothing": self.smoothing}

    def candidates(self, kind: str) -> Sequence[Candidate]:
        if kind == "price":
            return [persistence_candidate(kind)]
        return [Candidate("markov-count", markov_count_fit(self.smoothing)), persistence_candidate(kind)]
