"""How pools drop their capacity on a trace: per pool the drop rate in each half of the trace
(and how the halves correlate: is a pool's rate a lasting trait?), and the chance of a drop after
a drop in the last three hours against after none (do drops come in bursts?), and the chance that
the next count falls more than 0, 1, 2, 4 or 8 below the current one (does room left unused in a
pool spare a job the restart?). Hourly slots.
Plain script:

    python scripts/drop_bursts.py airflow_provider_spotsched/data/traces/*.csv.gz /tmp/sel/s41.csv.gz
"""

from __future__ import annotations

import argparse

import numpy as np

from airflow_provider_spotsched.market.drops import drop_after_drop, drop_rates, falls_below
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.simulation.evaluation import trace_name

ROOMS = (0, 1, 2, 4, 8)
"""Instances a job might leave unused in a pool: the script prints how often a drop goes deeper."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (CSV or .csv.gz)")
    args = parser.parse_args()
    for path in args.traces:
        available = resample(cached_trace(path), slot_hours=1.0).available
        half = available.shape[0] // 2
        first, second = drop_rates(available[:half]), drop_rates(available[half:])
        both = ~np.isnan(first) & ~np.isnan(second)
        after_drop, after_none = drop_after_drop(available)
        print(
            f"{trace_name(path)}: drop rate per pool, first half {np.round(first, 2).tolist()}, "
            f"second half {np.round(second, 2).tolist()}, correlation {np.corrcoef(first[both], second[both])[0, 1]:.2f}; "
            f"P(drop | drop in the last 3 h) {after_drop:.3f}, P(drop | none) {after_none:.3f}; "
            f"P(next count < count - room) for room {ROOMS}: {[round(falls_below(available, room), 3) for room in ROOMS]}"
        )


if __name__ == "__main__":
    main()
