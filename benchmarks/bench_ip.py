"""Time the integer program (scheduling.ip) on 72-slot GCP jobs, next to the exact planner.

The hindsight optimum of each job (13 pools, N_max 16, hard deadline 72 h) is solved, in the
same run, by planner.solve_plan (the baseline) and by the MILP with HiGHS under a time limit,
from scratch and (``--warm``) again started from the planner's plan, which tells whether the
solver can at least prove that plan optimal. The table shows the times, whether the MILP proved
optimality, the bound it reached and how far its plan's objective is from the planner's:

    python benchmarks/bench_ip.py                       # 10 starts, MILP limit 60 s
    python benchmarks/bench_ip.py --starts 3 --limit 20 --warm
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

import numpy as np

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.trace import Trace, load_trace
from airflow_provider_spotsched.scheduling.ip import build_model
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput
from airflow_provider_spotsched.scheduling.planner import Plan, PlanRequest, solve_plan

HOURS = 24.0  # N_max instances' work for 24 h; deadline 48 h, hard deadline 72 h: 72 slots


def optimum_request(trace: Trace, start: datetime, n_max: int, overhead: float) -> PlanRequest:
    """The whole-horizon planning request of a job submitted at ``start`` (value 1.3 x on-demand)."""
    slots = resample(trace, start, 1.0, int(3 * HOURS))
    job = Job(
        work=n_max * HOURS,
        deadline_hours=2 * HOURS,
        max_instances=n_max,
        throughput=Throughput(1.0, 0.0),
        value=1.3 * n_max * HOURS * slots.on_demand_price,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=overhead,
    )
    idle = Allocation.idle(slots.num_pools)
    return PlanRequest(job, 0.0, 0.0, idle, slots.spot_price, slots.available, slots.on_demand_price)


def starts(trace: Trace, count: int) -> list[datetime]:
    last = trace.last_time - (3 * HOURS + 1) * 3600.0
    instants = np.linspace(trace.first_time + 3600.0, last, count)
    return [datetime.fromtimestamp(float(t), timezone.utc).replace(minute=0, second=0) for t in instants]


def spread(seconds: list[float]) -> str:
    return f"median {np.median(seconds):8.2f} s   p90 {np.percentile(seconds, 90):8.2f} s   max {max(seconds):8.2f} s"


def milp(request: PlanRequest, limit: float, warm_start: Plan | None) -> tuple[float, Plan, float]:
    """Seconds (building included), the plan and the proven lower bound of one MILP solve."""
    began = time.perf_counter()
    model = build_model(request)
    plan = model.solve(limit, "highs", None if warm_start is None else warm_start.allocations)
    return time.perf_counter() - began, plan, model.bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--n-max", type=int, default=16)
    parser.add_argument("--overhead", type=float, default=0.25, help="reconfiguration overhead, hours")
    parser.add_argument("--limit", type=float, default=60.0, help="MILP time limit per job, seconds")
    parser.add_argument("--warm", action="store_true", help="also solve each MILP started from the planner's plan")
    args = parser.parse_args()
    trace = load_trace(GCP_TRACE)
    print(f"GCP trace, {len(trace.names)} pools, 72-slot jobs, N_max {args.n_max}, overhead {args.overhead} h, "
          f"MILP: HiGHS, limit {args.limit:g} s")
    runs = {"MILP": False, "MILP from the planner's plan": True} if args.warm else {"MILP": False}
    print(f"{'start':<17} {'run':<28} {'seconds':>8} {'proven':>6} {'objective':>12} {'bound':>12} "
          f"{'minus planner':>13}")
    planner_times, planner_proven = [], 0
    times = {run: [] for run in runs}
    proven = {run: 0 for run in runs}
    agree = {run: 0 for run in runs}
    for start in starts(trace, args.starts):
        request = optimum_request(trace, start, args.n_max, args.overhead)
        began = time.perf_counter()
        reference = solve_plan(request)
        planner_times.append(time.perf_counter() - began)
        planner_proven += reference.proven_optimal
        print(f"{start:%Y-%m-%d %H:%M} {'planner':<28} {planner_times[-1]:8.2f} {str(reference.proven_optimal):>6} "
              f"{reference.objective:12.4f}")
        for run, warm in runs.items():
            seconds, plan, bound = milp(request, args.limit, reference if warm else None)
            times[run].append(seconds)
            proven[run] += plan.proven_optimal
            diff = plan.objective - reference.objective
            agree[run] += abs(diff) <= 1e-6 * max(1.0, abs(reference.objective))
            print(f"{'':<17} {run:<28} {seconds:8.2f} {str(plan.proven_optimal):>6} {plan.objective:12.4f} "
                  f"{bound:12.4f} {diff:13.6f}")
    count = len(planner_times)
    print(f"\n{'planner (baseline)':<30} {spread(planner_times)}   proven optimal {planner_proven}/{count}")
    for run in runs:
        print(f"{run:<30} {spread(times[run])}   proven optimal {proven[run]}/{count}   "
              f"same objective as the planner (1e-6 relative) {agree[run]}/{count}")


if __name__ == "__main__":
    main()
