"""Time the exact planner where it is used: one CHC decision and one hindsight optimum, on GCP.

Both run next to baselines measured in the same run: the on-demand policy's decision time, and
the direct MILP of :mod:`airflow_provider_spotsched.scheduling.ip` on the very same planning
requests (its objectives are compared with the planner's too). Plain script:

    python benchmarks/bench_planner.py                    # 10 optimum starts, MILP limit 60 s
    python benchmarks/bench_planner.py --starts 3 --milp-limit 0   # no MILP baseline
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial

import numpy as np

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.trace import Trace, load_trace
from airflow_provider_spotsched.scheduling.ip import solve_milp
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput
from airflow_provider_spotsched.scheduling.planner import Plan, PlanRequest, solve_plan
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.chc import CHCPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.replay import JobMarket, job_market, simulate

TOLERANCE = 1e-6  # relative difference of objectives that still counts as the same


def gcp_job(trace: Trace, start: datetime, n_max: int, hours: float, overhead: float) -> tuple[Job, JobMarket]:
    """N_max instances' work for ``hours``, deadline 2 x hours (horizon 3 x hours), value 1.3 x on-demand."""
    draft = Job(
        work=n_max * hours,
        deadline_hours=2 * hours,
        max_instances=n_max,
        throughput=Throughput(1.0, 0.0),
        value=1.0,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=overhead,
        start=start,
    )
    market = job_market(trace, draft)
    return replace(draft, value=1.3 * n_max * hours * market.market.on_demand_price), market


def starts(trace: Trace, count: int, horizon_hours: float) -> list[datetime]:
    first = trace.first_time + 48 * 3600.0
    last = trace.last_time - (horizon_hours + 2) * 3600.0
    instants = np.linspace(first, last, count)
    return [datetime.fromtimestamp(float(t), timezone.utc).replace(minute=0, second=0) for t in instants]


def stats(seconds: list[float]) -> str:
    ms = 1000 * np.asarray(seconds)
    return f"{np.median(ms):9.1f} {np.percentile(ms, 90):9.1f} {ms.max():9.1f} {len(ms):5d}"


def optimum_request(job: Job, market: JobMarket) -> PlanRequest:
    slots = market.job_slots.window(0, job.horizon_slots)
    idle = Allocation.idle(slots.num_pools)
    return PlanRequest(job, 0.0, 0.0, idle, slots.spot_price, slots.available, slots.on_demand_price)


class Recorder(CHCPolicy):
    """CHC that keeps the planning request of every decision, for the MILP to solve too."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.requests: list[PlanRequest] = []

    def decide(self, observation: Observation) -> Allocation:
        self.requests.append(self.window_request(observation))
        return super().decide(observation)


def timed(solve, requests: list[PlanRequest]) -> tuple[list[float], list[Plan | None]]:
    """Seconds per request and the plans (None where a time-limited MILP found no plan at all)."""
    seconds, plans = [], []
    for request in requests:
        began = time.perf_counter()
        try:
            plans.append(solve(request))
        except RuntimeError:
            plans.append(None)
        seconds.append(time.perf_counter() - began)
    return seconds, plans


def row(label: str, seconds: list[float], plans: list[Plan | None], planner: list[Plan] | None = None) -> str:
    """A table row: timing, plans proven optimal, and how the objectives compare with the planner's."""
    found = [p for p in plans if p is not None]
    text = f"{label:<46} {stats(seconds)}  proven {sum(p.proven_optimal for p in found)}/{len(plans)}"
    if planner is not None:
        pairs = [(p, q) for p, q in zip(plans, planner) if p is not None]
        gaps = [(p.objective - q.objective) / max(1.0, abs(q.objective)) for p, q in pairs]
        same = sum(abs(g) <= TOLERANCE for g in gaps)
        text += (
            f", no plan {len(plans) - len(found)}, vs the planner: same objective {same}, "
            f"worse {sum(g > TOLERANCE for g in gaps)}, better {sum(g < -TOLERANCE for g in gaps)}"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10, help="start times for the 72-slot hindsight optimum")
    parser.add_argument("--chc-jobs", type=int, default=3, help="jobs whose every CHC decision is timed")
    parser.add_argument("--n-max", type=int, default=16)
    parser.add_argument("--overhead", type=float, default=0.25)
    parser.add_argument("--milp-limit", type=float, default=60.0, help="MILP time limit per solve in seconds (0: skip)")
    parser.add_argument("--milp-windows", type=int, default=5, help="CHC windows also solved by the MILP")
    args = parser.parse_args()
    trace = load_trace(GCP_TRACE)
    hours = 24.0  # deadline 48 h, hard deadline 72 h: a 72-slot horizon
    milp = partial(solve_milp, time_limit=args.milp_limit)

    print(f"GCP trace, {len(trace.names)} pools, N_max {args.n_max}, overhead {args.overhead} h; times in ms")
    print(f"{'measure':<46} {'median':>9} {'p90':>9} {'max':>9} {'n':>5}")

    # One CHC decision: commit 1 re-plans every slot, so each timed decision forecasts and solves.
    chc_times, od_times, requests = [], [], []
    for start in starts(trace, args.chc_jobs, 3 * hours):
        job, market = gcp_job(trace, start, args.n_max, hours, args.overhead)
        recorder = Recorder(window=24, commit=1)
        result = simulate(recorder, job, market)
        chc_times += [s for t, s in enumerate(result.decision_seconds) if t + 24 <= job.horizon_slots]
        od_times += simulate(make_policy("on-demand"), job, market).decision_seconds
        requests += recorder.requests[: args.milp_windows]
    print(f"{'CHC decision, 24-slot window (seasonal-naive)':<46} {stats(chc_times)}")
    print(f"{'  baseline: on-demand decision':<46} {stats(od_times)}")
    if args.milp_limit > 0:
        seconds, plans = timed(solve_plan, requests)
        print(row("  planner alone on the first CHC windows", seconds, plans))
        print(row("  baseline: MILP on the same windows", *timed(milp, requests), plans))

    # The hindsight optimum of a whole 72-slot job.
    jobs = [gcp_job(trace, start, args.n_max, hours, args.overhead) for start in starts(trace, args.starts, 3 * hours)]
    requests = [optimum_request(job, market) for job, market in jobs]
    seconds, plans = timed(solve_plan, requests)
    print(row("optimum, 72 slots (planner)", seconds, plans))
    if args.milp_limit > 0:
        print(row(f"  baseline: MILP, limit {args.milp_limit:g} s", *timed(milp, requests), plans))


if __name__ == "__main__":
    main()
