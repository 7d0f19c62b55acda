"""The synthetic generator's own regime chain as an availability forecaster: its median ahead.

How much can any forecaster beat persistence on the availability of a market from
``spotsched synth``? Its counts follow a known chain: each pool sits in a regime (plenty, scarce,
none) and leaves it with a known chance per tick (``market/synthetic.py``). The chain's median h
hourly slots ahead, from the regime the count now shows, is the forecast with the least expected
absolute error that the chain allows; the market-wide shocks and collapses aside. Printed for
the default settings: per count now, the chance that the count is the same h slots later and the
median, for h = 1 to 6 (``docs/forecasting.md``). Plain script:

    python scripts/regime_chain_median.py
"""

from __future__ import annotations

import numpy as np

from airflow_provider_spotsched.market.synthetic import (
    FIRST_MOVE_CHANCE,
    NONE,
    PLENTY,
    REGIME_MOVES,
    SCARCE,
    SyntheticMarketConfig,
    regime_counts,
)

LEADS = 6
REGIMES = (PLENTY, SCARCE, NONE)


def tick_chain(config: SyntheticMarketConfig) -> np.ndarray:
    """The regimes' transition matrix per tick, as the generator draws them."""
    leave = 1.0 / (config.mean_regime_hours * 60.0 / config.tick_minutes)
    chain = np.eye(len(REGIMES)) * (1.0 - leave)
    for regime, (first, second) in REGIME_MOVES.items():
        chain[regime, first] += leave * FIRST_MOVE_CHANCE
        chain[regime, second] += leave * (1.0 - FIRST_MOVE_CHANCE)
    return chain


def main() -> None:
    config = SyntheticMarketConfig()
    counts = regime_counts(config.capacity)
    levels = np.array([counts[regime] for regime in REGIMES])
    order = np.argsort(levels)
    per_slot = np.linalg.matrix_power(tick_chain(config), int(round(60.0 / config.tick_minutes)))
    print(f"{'count now':<10} " + " ".join(f"{lead:>4} h" for lead in range(1, LEADS + 1)))
    for regime in REGIMES:
        same, median = [], []
        for lead in range(1, LEADS + 1):
            chances = np.linalg.matrix_power(per_slot, lead)[regime]
            same.append(f"{chances[regime]:>6.2f}")
            median.append(f"{levels[order][np.argmax(np.cumsum(chances[order]) >= 0.5)]:>6d}")
        print(f"{levels[regime]:<10} " + " ".join(same) + "   chance the same")
        print(f"{'':<10} " + " ".join(median) + "   median")


if __name__ == "__main__":
    main()
