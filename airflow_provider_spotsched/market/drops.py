"""How a pool's capacity drops in time: how often, and whether one drop makes the next likelier.

A restart forced by a pool that drops is where CHC on real forecasts loses most to the hindsight
optimum on the shipped traces (docs/evaluation.md, "Where the excess cost is"). Whether drops can
be foreseen depends on these two traits of a market, which the synthetic generator's markets
must share for a drop forecast to be checked on them (``market/synthetic.py``).
"""

from __future__ import annotations

import numpy as np

BURST_LOOKBACK = 3
"""Slots back in which an earlier drop counts as recent."""


def falls(available: np.ndarray) -> np.ndarray:
    """``[T - 1, M]``: whether each pool's count is lower in the next slot than in this one."""
    counts = np.asarray(available, dtype=float)
    return np.diff(counts, axis=0) < 0


def drop_rates(available: np.ndarray) -> np.ndarray:
    """Per pool, the share of its slots offering capacity that the next slot ends lower (NaN for a
    pool that never offers any)."""
    counts = np.asarray(available, dtype=float)[:-1]
    offered = counts > 0
    with np.errstate(invalid="ignore"):
        return (falls(available) & offered).sum(axis=0) / offered.sum(axis=0)


def drop_after_drop(available: np.ndarray, lookback: int = BURST_LOOKBACK) -> tuple[float, float]:
    """The chance that a slot offering capacity is followed by a drop, given a drop in the
    ``lookback`` slots before it, and given none; pooled over pools, from ``available`` ``[T, M]``."""
    counts = np.asarray(available, dtype=float)
    fell = falls(counts)
    recent = np.zeros_like(fell)
    for t in range(lookback, fell.shape[0]):
        recent[t] = fell[t - lookback : t].any(axis=0)
    cases = counts[:-1] > 0
    cases[:lookback] = False
    return float(fell[cases & recent].mean()), float(fell[cases & ~recent].mean())
