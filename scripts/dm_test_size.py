"""How often `auto`'s Diebold-Mariano test passes a model that is no better than persistence.

`auto` lets a model displace persistence in a lead-time bucket only when, among other things, a
one-sided Diebold-Mariano test at ``significance`` (5%) says its lower error is beyond chance
(``forecast/auto.py``). Forecasts h slots ahead from neighbouring origins share h - 1 targets, so
the per-origin loss differences are correlated over h origins; the test's Newey-West variance
accounts for that with h lags of Bartlett weights, which shrink the neighbours' covariances. This
draws loss differences of equal expectation (the null), correlated exactly so (each the sum of h
consecutive independent shocks), over ``origins`` origins, and prints the share the test passes
per lead: its real size, to set beside the nominal one. Two kinds of shocks: normal, and sparse
(zero but for a jump one slot in ten, as where a count sticks for hours and errors come from its
jumps). Plain script, a few seconds:

    python scripts/dm_test_size.py [--draws 4000] [--origins 144] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from scipy.special import ndtri

from airflow_provider_spotsched.forecast.auto import AutoForecaster, diebold_mariano

LEADS = (1, 2, 3, 4, 5, 6, 12, 24)
JUMP_CHANCE = 0.1
AUTO = AutoForecaster()  # its default settings: the significance and the origins a bucket is scored on


def normal_shocks(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.standard_normal(size)


def sparse_shocks(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.standard_normal(size) * (rng.random(size) < JUMP_CHANCE)


def size_of_test(
    shocks: Callable[[np.random.Generator, int], np.ndarray], lead: int, origins: int, draws: int, seed: int
) -> float:
    """Share of ``draws`` null samples that the test passes at `auto`'s default significance, with
    the lags `auto` gives a bucket whose last lead is ``lead`` (origins one slot apart)."""
    rng = np.random.default_rng(seed)
    critical = ndtri(1.0 - AUTO.significance)
    passed = 0
    for _ in range(draws):
        differences = np.convolve(shocks(rng, origins + lead - 1), np.ones(lead), mode="valid")
        if differences.any() and diebold_mariano(differences, lead) < -critical:
            passed += 1
    return passed / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4000, help="null samples per lead and kind of shock")
    parser.add_argument("--origins", type=int, default=AUTO.origins, help="origins a bucket is scored on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"one-sided test at {AUTO.significance:.0%}, {args.origins} origins, {args.draws} draws; share passed under the null")
    print(f"{'lead':>4}  {'normal shocks':>13}  {'sparse shocks':>13}")
    for lead in LEADS:
        normal = size_of_test(normal_shocks, lead, args.origins, args.draws, args.seed)
        sparse = size_of_test(sparse_shocks, lead, args.origins, args.draws, args.seed)
        print(f"{lead:>4}  {normal:>13.3f}  {sparse:>13.3f}")


if __name__ == "__main__":
    main()
