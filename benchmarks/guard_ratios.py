"""Each policy's cost against Uniform Progress's, job by job, from ``spotsched evaluate`` results.

The cost guard (``docs/guard.md``) promises a bound on every single job, which a grid's mean
hides; this prints, per policy over the ``results.csv`` files given: the jobs, the worst
cost / UP cost, how many jobs exceed ``--target`` x UP, and the mean excess cost over the
hindsight optimum (the savings side). Rows of a policy may come from several evaluations (e.g.
one run of the code before the guard), named ``label=path``. Plain script:

    python benchmarks/guard_ratios.py new=/tmp/eval/results.csv base=/tmp/eval-base/results.csv
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

REFERENCE = "uniform-progress"


def ratios(path: Path) -> dict[str, list[tuple[float, float | None]]]:
    """Per policy, each job's (cost / UP cost, excess cost over optimal) in ``path``."""
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    job = ("trace", "start", "n_max", "slack", "overhead")
    reference = {tuple(r[k] for k in job): float(r["cost"]) for r in rows if r["policy"] == REFERENCE}
    if not reference:
        raise SystemExit(f"{path}: no {REFERENCE} rows; run the evaluation with --policies {REFERENCE} ...")
    out: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    for r in rows:
        up = reference.get(tuple(r[k] for k in job))
        if up is None or up <= 0:
            continue
        out[r["policy"]].append((float(r["cost"]) / up, float(r["excess_cost"]) if r["excess_cost"] else None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="label=path/to/results.csv")
    parser.add_argument("--target", type=float, default=1.25, help="the ratio to UP no job should exceed")
    args = parser.parse_args()
    print(f"| run | policy | jobs | worst cost / UP | jobs > {args.target:g} x UP | mean excess over optimal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for item in args.results:
        label, _, path = item.rpartition("=")
        for policy, jobs in sorted(ratios(Path(path)).items()):
            excess = [e for _, e in jobs if e is not None]
            mean = f"{100 * sum(excess) / len(excess):+.1f}%" if excess else "n/a"
            worst = max(r for r, _ in jobs)
            above = sum(r > args.target + 1e-9 for r, _ in jobs)
            print(f"| {label or path} | {policy} | {len(jobs)} | {worst:.3f} | {above} | {mean} |")


if __name__ == "__main__":
    main()
