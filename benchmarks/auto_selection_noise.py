"""Why ``auto`` used to lose to persistence at short leads: the winner's curse of a choice made on ten origins.

At origins spread evenly over a trace, for every pool and series, the choice ``auto`` made before
(ten backtest origins half a day apart, lead-time buckets 1-2, 3-6 and 7-24 slots, a 5% margin,
no test) is redone from the history up to the origin. Each bucket where it displaced persistence
is then scored three ways, as the chosen model's error over persistence's (summed over the
bucket's leads and the cases): at the ten origins the choice was made on; at every origin of the
same days (the same data, 109 origins instead of 10); and on the realised slots after the origin
(the forecast that was used). A ratio well below 1 at the ten origins, near or above 1 at every
origin of the same days and above 1 afterwards is a choice made on noise, not on skill.

    python benchmarks/auto_selection_noise.py --trace gcp --origins 48
    python benchmarks/auto_selection_noise.py --trace aws --origins 48
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict

import numpy as np

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.forecast.auto import MIN_TRAINING, AutoForecaster
from airflow_provider_spotsched.forecast.series import PRICE
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.trace import load_trace

HORIZON = 24
OLD_ORIGINS, OLD_SPACING, OLD_BUCKETS, OLD_MARGIN = 10, 12, ((0, 2), (2, 6), (6, 24)), 0.05
TRACES = {"gcp": GCP_TRACE, "aws": AWS_TRACE}


def old_winner(scores: np.ndarray) -> int:
    """The choice before: lowest score, persistence (index 0) beaten only by more than the margin."""
    penalised = [s if i == 0 else s * (1 + OLD_MARGIN) for i, s in enumerate(scores)]
    return min(range(len(scores)), key=lambda i: (penalised[i], i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="gcp", help='"gcp", "aws" or a trace file')
    parser.add_argument("--origins", type=int, default=48, help="origins spread evenly over the trace")
    parser.add_argument("--min-history", type=int, default=168, help="slots known at the first origin")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    market = resample(load_trace(TRACES.get(args.trace, args.trace)))
    auto = AutoForecaster()
    last = market.num_slots - HORIZON - 1
    origins = np.unique(np.linspace(args.min_history - 1, last, args.origins).round().astype(int))
    window = HORIZON + OLD_SPACING * (OLD_ORIGINS - 1)  # the old origins span n - 132 .. n - 24
    # (kind, bucket, candidate) -> [chosen errors, persistence errors] at the 10 origins, all origins, after
    sums: dict[tuple[str, int, str], np.ndarray] = defaultdict(lambda: np.zeros((3, 2)))
    chosen: dict[tuple[str, int, str], int] = defaultdict(int)
    for origin in origins:
        n = int(origin) + 1
        for m, pool in enumerate(market.pools):
            for kind, series in ((PRICE, market.spot_price), ("available", market.available)):
                y = series[:, m].astype(float)
                history, future = y[:n], y[n : n + HORIZON]
                dense = [o for o in range(n - window, n - HORIZON + 1) if o >= MIN_TRAINING]
                sparse = [o for o in (n - HORIZON - OLD_SPACING * j for j in range(OLD_ORIGINS)) if o >= MIN_TRAINING]
                if not sparse:
                    continue
                candidates = list(auto.candidates(kind))
                errors = np.array([auto.backtest(c, kind, pool, history, dense) for c in candidates])
                rows = [dense.index(o) for o in sparse]
                after = []
                for candidate in candidates:
                    mean = candidate.fit(history).forecast(HORIZON).mean
                    if kind != PRICE:
                        mean = np.clip(mean, 0.0, history.max())
                    after.append(np.abs(mean - future))
                for b, (a, z) in enumerate(OLD_BUCKETS):
                    w = old_winner(errors[:, rows, a:z].mean(axis=(1, 2)))
                    if w == 0:
                        continue
                    key = (kind, b, candidates[w].name)
                    chosen[key] += 1
                    for part, block in enumerate((errors[:, rows, a:z], errors[:, :, a:z])):
                        sums[key][part] += block[w].sum(), block[0].sum()
                    sums[key][2] += after[w][a:z].sum(), after[0][a:z].sum()
    print(f"{args.trace}: {len(origins)} origins from slot {origins[0]} to {origins[-1]}, {market.num_pools} pools; "
          f"buckets where the old choice displaced persistence, chosen error / persistence's:")
    print("| series | leads | model | chosen (pool-origins) | at the 10 origins | every origin of those days | after the origin |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key in sorted(chosen):
        kind, b, name = key
        a, z = OLD_BUCKETS[b]
        cells = [("n/a" if ref == 0 else f"{mine / ref:.2f}") for mine, ref in sums[key]]
        print(f"| {kind} | {a + 1}-{z} | {name} | {chosen[key]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
