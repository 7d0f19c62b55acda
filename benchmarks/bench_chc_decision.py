"""Time one CHC decision on the point forecast and on the forecast distribution, on GCP.

Every CHC forecasts with ``auto`` and re-plans every slot (commit 1), so every timed decision
forecasts and solves a 24-slot window over the trace's 13 pools for an N_max 16 job; the
uncertainty-aware one plans on the capacity available with probability >= ``--level``, the
guarded one under the cost guard (``guard`` 1.2), within its bound: the shadow UP run on over
the forecast and the planner's cost limit (``docs/guard.md``). The
baseline, measured in the same run on the same jobs, is uniform progress's decision, and each
CHC is also given as a ratio to it. The auto forecaster memoises its backtests per process, so
the point-forecast CHC, which runs first on each job, pays for the backtests both CHCs use (its
maximum is the larger for that). Plain script:

    python benchmarks/bench_chc_decision.py               # 3 jobs of 72 slots
    python benchmarks/bench_chc_decision.py --jobs 1 --level 0.8
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
from bench_planner import gcp_job, starts, stats

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.trace import load_trace
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import simulate

WINDOW = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3, help="jobs whose every decision is timed")
    parser.add_argument("--n-max", type=int, default=16)
    parser.add_argument("--overhead", type=float, default=0.25)
    parser.add_argument("--level", type=float, default=0.9, help="probability the planned spot must have")
    args = parser.parse_args()
    logging.getLogger("airflow_provider_spotsched").setLevel(logging.ERROR)  # forecast fallbacks are not timed news
    trace = load_trace(GCP_TRACE)
    hours = 24.0  # deadline 48 h, hard deadline 72 h: a 72-slot horizon
    policies = {
        "uniform-progress": ("uniform-progress", {}),
        "chc, point forecast": ("chc", {"window": WINDOW, "commit": 1, "forecaster": "auto"}),
        "chc, point forecast, guard 1.2": ("chc", {"window": WINDOW, "commit": 1, "forecaster": "auto", "guard": 1.2}),
        f"chc, spot available w.p. >= {args.level:g}": (
            "chc",
            {"window": WINDOW, "commit": 1, "forecaster": "auto", "uncertainty": "quantile", "level": args.level},
        ),
    }
    seconds: dict[str, list[float]] = {label: [] for label in policies}
    for start in starts(trace, args.jobs, 3 * hours):
        job, market = gcp_job(trace, start, args.n_max, hours, args.overhead)
        for label, (name, params) in policies.items():
            result = simulate(make_policy(name, params), job, market)
            # Slots whose window fits before the horizon: the full 24-slot problem.
            seconds[label] += [s for t, s in enumerate(result.decision_seconds) if t + WINDOW <= job.horizon_slots]

    print(f"GCP trace, {len(trace.names)} pools, N_max {args.n_max}, window {WINDOW}, overhead {args.overhead} h")
    print(f"{'decision (ms)':<40} {'median':>9} {'p90':>9} {'max':>9} {'n':>5}  median / baseline")
    baseline = float(np.median(seconds["uniform-progress"]))
    print(f"(baseline median: {1e6 * baseline:.1f} us)")
    for label, times in seconds.items():
        ratio = float(np.median(times)) / baseline
        print(f"{label:<40} {stats(times)}  {ratio:12.0f}x")


if __name__ == "__main__":
    main()
