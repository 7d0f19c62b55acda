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


def falls_below(available: np.ndarray, room: int) -> float:
    """The chance that a pool offering more than ``room`` instances ends the next slot with fewer
    than its count less ``room``, pooled over pools: how often a job that leaves ``room`` instances
    of a pool unused would still be forced to restart there. ``room = 0`` is the plain drop rate;
    NaN where no pool ever offers more than ``room``."""
    counts = np.asarray(available, dtype=float)
    now, after = counts[:-1], counts[1:]
    cases = now > room
    return float((after[cases] < now[cases] - room).mean()) if cases.any() else float("nan")


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


DROP_FEATURES = (
    f"dropped in the last {BURST_LOOKBACK} slots",
    "drops in the last 24 slots",
    "rises in the last 24 slots",
    "slots since the count changed (at most 24)",
    "share of the other pools that dropped this slot",
)
"""What :func:`drop_cases` tells about a pool offering capacity in a slot, from the past alone."""
FEATURE_HISTORY = 24
"""Slots of history each case looks back on (the first cases start there)."""


def drop_cases(available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every slot ``t`` (from :data:`FEATURE_HISTORY` on, before the last) in which a pool offers
    capacity, as features ``[cases, DROP_FEATURES]`` from slots up to ``t`` and whether the pool's
    count is lower at ``t + 1``; cases in slot order, pools in order within a slot."""
    counts = np.asarray(available, dtype=float)
    num_slots, num_pools = counts.shape
    # dropped[t], rose[t]: the count fell, rose, from slot t - 1 to slot t
    dropped = np.vstack([np.zeros((1, num_pools), dtype=bool), falls(counts)])
    rose = np.vstack([np.zeros((1, num_pools), dtype=bool), falls(-counts)])
    features, labels = [], []
    for t in range(FEATURE_HISTORY, num_slots - 1):
        window = slice(t - FEATURE_HISTORY + 1, t + 1)
        changed = np.nonzero(dropped[window] | rose[window])
        since = np.full(num_pools, float(FEATURE_HISTORY))
        for slot, pool in zip(*changed):
            since[pool] = min(since[pool], FEATURE_HISTORY - 1 - slot)
        others = (dropped[t].sum() - dropped[t]) / max(num_pools - 1, 1)
        for pool in np.nonzero(counts[t] > 0)[0]:
            features.append(
                [
                    dropped[t - BURST_LOOKBACK + 1 : t + 1, pool].any(),
                    dropped[window, pool].sum(),
                    rose[window, pool].sum(),
                    since[pool],
                    others[pool],
                ]
            )
            labels.append(counts[t + 1, pool] < counts[t, pool])
    return np.array(features, dtype=float).reshape(-1, len(DROP_FEATURES)), np.array(labels, dtype=bool)
