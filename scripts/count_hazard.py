"""How the chance that a pool's count changes in the next slot depends on how long it has held:
per trace, over all pools, the share of slots at each age (1, 2-3, 4-7, 8-15, 16+ slots since the
count last changed) after which the count moved. A flat row is a Markov market (the Markov count
chain's assumption); a falling one is what the sojourn chain models. Hourly slots. Plain script:

    python scripts/count_hazard.py airflow_provider_spotsched/data/traces/*.csv.gz /tmp/sel/s41.csv.gz
"""

from __future__ import annotations

import argparse

import numpy as np

from airflow_provider_spotsched.forecast.sojourn_chain import AGE_EDGES, age_bucket, ages
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.simulation.evaluation import trace_name


def hazard_by_age(available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per age bucket, the share of slots (over all pools) after which the count moved, and how many slots."""
    held, moved = np.zeros(AGE_EDGES.size), np.zeros(AGE_EDGES.size)
    for y in available.T:
        bucket = age_bucket(ages(y)[:-1])
        np.add.at(held, bucket, 1.0)
        np.add.at(moved, bucket, y[1:] != y[:-1])
    return moved / np.maximum(held, 1.0), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (CSV or .csv.gz)")
    args = parser.parse_args()
    names = [f"{low}-{high - 1}" if high - 1 > low else f"{low}" for low, high in zip(AGE_EDGES[:-1], AGE_EDGES[1:])]
    names.append(f"{AGE_EDGES[-1]}+")
    for path in args.traces:
        hazard, held = hazard_by_age(resample(cached_trace(path), slot_hours=1.0).available)
        cells = ", ".join(f"age {name}: {h:.2f} ({int(n)} slots)" for name, h, n in zip(names, hazard, held))
        print(f"{trace_name(path)}: P(count changes next slot) by age, {cells}")


if __name__ == "__main__":
    main()
