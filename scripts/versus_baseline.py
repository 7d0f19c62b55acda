"""Per trace and policy of an evaluation's results.csv: mean excess cost over optimal, and each
job's cost against a baseline policy's on the same scenario (the worst job and the mean).

The evaluation's summary gives means; a policy that is cheap on average can still pay far more
than the baseline on single jobs, which is what a user who runs one job meets. Plain script:

    python scripts/versus_baseline.py results/eval/results.csv             # against uniform-progress
    python scripts/versus_baseline.py results/eval/results.csv --baseline greedy
    python scripts/versus_baseline.py results/eval/results.csv --decimals 2     # means to 0.01 point
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

SCENARIO = ("trace", "start", "n_max", "slack", "overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.csv written by `spotsched evaluate`")
    parser.add_argument("--baseline", default="uniform-progress", help="policy key every job is compared with")
    parser.add_argument("--decimals", type=int, default=1, help="decimals of the mean excess cost, in percent")
    args = parser.parse_args()
    with args.results.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    baseline = {tuple(r[k] for k in SCENARIO): float(r["cost"]) for r in rows if r["policy"] == args.baseline}
    if not baseline:
        raise SystemExit(f"--baseline {args.baseline!r} has no runs in {args.results}; pass a policy it holds")
    excess: dict[tuple[str, str], list[float]] = defaultdict(list)
    ratio: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        key = (r["trace"], r["policy"])
        if r["excess_cost"]:
            excess[key].append(float(r["excess_cost"]))
        reference = baseline.get(tuple(r[k] for k in SCENARIO))
        if reference:
            ratio[key].append(float(r["cost"]) / reference)
    print(f"{'trace':<32} {'policy':<20} {'runs':>5} {'excess vs optimal':>18} {'worst job / ' + args.baseline:>30} {'mean':>7}")
    for trace, policy in sorted(ratio):
        costs, over = ratio[trace, policy], excess[trace, policy]
        mean_excess = f"{100 * sum(over) / len(over):+.{args.decimals}f}%" if over else "n/a"
        print(f"{trace:<32} {policy:<20} {len(costs):>5} {mean_excess:>18} {max(costs):>30.3f} {sum(costs) / len(costs):>7.3f}")


if __name__ == "__main__":
    main()
