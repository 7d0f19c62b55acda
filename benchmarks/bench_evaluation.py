"""Time the evaluation grid against an on-demand-only run of the same grid, measured in the same run.

The baseline prices the harness itself (trace loading, resampling, processes, accounting), so the
difference is what the policies cost. Plain script:

    python benchmarks/bench_evaluation.py                      # the default evaluation
    python benchmarks/bench_evaluation.py --scenarios 2 --policies greedy chc-seasonal-naive
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from statistics import mean, median

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.simulation.evaluation import (
    POLICY_SPECS,
    Evaluation,
    GridConfig,
    evaluate,
)


def timed(config: GridConfig, workers: int) -> tuple[Evaluation, float]:
    began = time.perf_counter()
    evaluation = evaluate(config, workers=workers)
    return evaluation, time.perf_counter() - began


def main() -> None:
    default = GridConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=list(default.traces))
    parser.add_argument("--scenarios", type=int, default=default.scenarios)
    parser.add_argument("--nmax", type=int, nargs="+", default=list(default.n_max))
    parser.add_argument("--policies", nargs="+", default=list(default.policies), choices=list(POLICY_SPECS))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    config = replace(default, traces=tuple(args.traces), scenarios=args.scenarios, n_max=tuple(args.nmax),
                     policies=tuple(args.policies))

    began = time.perf_counter()
    for path in config.traces:  # loaded once, before both runs, so that neither pays for it
        cached_trace(path)
    print(f"trace loading: {time.perf_counter() - began:.1f} s (outside both timings)")
    baseline, baseline_s = timed(replace(config, policies=("on-demand",)), args.workers)
    evaluation, wall_s = timed(config, args.workers)
    scenarios = len(baseline.rows)
    print(f"grid: {scenarios} scenarios on {len(config.traces)} trace(s), {len(config.policies)} policies, "
          f"{args.workers} workers")
    print(f"baseline (on-demand only): {baseline_s:8.1f} s  {scenarios / baseline_s:8.2f} scenarios/s")
    print(f"evaluation:                {wall_s:8.1f} s  {scenarios / wall_s:8.2f} scenarios/s  "
          f"({wall_s / baseline_s:.1f}x the baseline)")
    print("decision time per slot, ms: median over runs of each run's median, and mean over runs of each run's mean")
    for policy in config.policies:
        mine = [r for r in evaluation.rows if r.policy == policy]
        p50, avg = median(r.decision_ms_p50 for r in mine), mean(r.decision_ms_mean for r in mine)
        print(f"  {policy:<22} p50 {p50:10.3f}   mean {avg:10.3f}")


if __name__ == "__main__":
    main()
