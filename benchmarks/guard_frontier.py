"""What the cost guard leaves a policy that knew the future: the hindsight optimum within its bound.

``docs/guard.md``: under the guard every slot must keep ``C(<=t) + pi * gap <= C_UP(<=t) + lambda *
(C_UP(<=t) + f * (L - W_UP))`` (``guard.allowed_cost``; a job trailing UP keeps the handover margin). No guarded policy can pay less than
the cheapest schedule that keeps it after every slot on the realised market, so that schedule is
the limit of what better forecasts can buy under the guard. (Here the floor ``f`` lends from
submission; the guard lends it only once the job has run, a room no larger, so the limit holds.)
This computes it with the exact planner (the guard's ``CostLimit`` built from UP's realised run,
the whole horizon at once, as ``optimal`` plans) and prints, per guard factor, its mean excess
over the hindsight optimum next to UP's and to CHC's on the realised market under the same guard
(commit 1), on the evaluation grid's jobs. Plain script:

    python benchmarks/guard_frontier.py --scenarios 8 --guards 1.2 1.5
    python benchmarks/guard_frontier.py --traces /tmp/sel/s41.csv.gz --scenarios 4
    python benchmarks/guard_frontier.py --scenarios 8 --nmax 1     # the single-instance jobs
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from bench_guard import chc_params

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.guard import allowed_cost, catch_up_price, handover_margin, work_price_floor
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Progress, advance
from airflow_provider_spotsched.scheduling.planner import CostLimit, solve_plan
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policies.optimal import horizon_request
from airflow_provider_spotsched.scheduling.replay import JobMarket, simulate
from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios, scenario_job


def run_through(job: Job, market: JobMarket, allocations: list[Allocation]) -> list[Progress]:
    """The job's progress after each slot of its horizon when it runs ``allocations``."""
    slots = market.job_slots
    progress = Progress(previous=Allocation.idle(slots.num_pools))
    after = []
    for t in range(job.horizon_slots):
        if not progress.done and t < len(allocations):
            advance(job, progress, allocations[t], slots.spot_price[t], slots.on_demand_price)
        after.append(replace(progress))
    return after


def guarded_optimum(job: Job, market: JobMarket, up: list[Allocation], guard: float) -> float:
    """The cost of the cheapest schedule that keeps the guard's invariant after every slot."""
    slots = market.job_slots
    shadow = run_through(job, market, up)
    shadow_work = np.array([job.work if p.done else p.work_done for p in shadow])
    floor = np.array([work_price_floor(job, market.market.prefix(market.offset + t + 1)) for t in range(len(shadow))])
    limit = CostLimit(
        cost_cap=allowed_cost(guard, job, np.array([p.cost for p in shadow]), shadow_work, floor),
        shadow_work=shadow_work,
        shadow_at_work=np.array([not p.done for p in shadow]),
        catch_up_price=catch_up_price(job, slots.on_demand_price),
        handover_margin=handover_margin(job),
    )
    request = replace(horizon_request(job, slots), cost_limit=limit)
    return run_through(job, market, solve_plan(request).allocations)[-1].cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = GridConfig()
    parser.add_argument("--traces", nargs="+", default=list(default.traces), help="trace files (default: the shipped two)")
    parser.add_argument("--scenarios", type=int, default=2, help="start times per trace")
    parser.add_argument("--guards", nargs="+", type=float, default=[1.2], help="guard factors 1 + lambda")
    parser.add_argument("--nmax", nargs="+", type=int, default=list(default.n_max), help="N_max values of the grid")
    args = parser.parse_args()
    config = GridConfig(
        traces=tuple(args.traces), scenarios=args.scenarios, n_max=tuple(args.nmax), policies=("uniform-progress",)
    )
    up_excess: list[float] = []
    limit: dict[float, list[float]] = {g: [] for g in args.guards}
    chc: dict[float, list[float]] = {g: [] for g in args.guards}
    worst: dict[float, float] = dict.fromkeys(args.guards, 0.0)
    for path in config.traces:
        trace = cached_trace(path)
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            optimal = simulate(make_policy("optimal"), job, market).outcome.cost
            up = simulate(make_policy("uniform-progress"), job, market)
            up_excess.append(up.outcome.cost / optimal - 1)
            for guard in args.guards:
                limit[guard].append(guarded_optimum(job, market, up.allocations, guard) / optimal - 1)
                cost = simulate(make_policy("chc", chc_params("oracle", 1, guard)), job, market).outcome.cost
                chc[guard].append(cost / optimal - 1)
                worst[guard] = max(worst[guard], cost / up.outcome.cost)
    mean_up = 100 * float(np.mean(up_excess))
    print(f"{len(up_excess)} jobs; Uniform Progress on the same jobs: {mean_up:+.1f}% over the hindsight optimum")
    print("| guard | optimum within the bound | CHC on the realised market, guarded | its worst cost / UP |")
    print("| --- | --- | --- | --- |")
    for guard in args.guards:
        print(f"| {guard:g} | {100 * np.mean(limit[guard]):+.1f}% | {100 * np.mean(chc[guard]):+.1f}% | {worst[guard]:.3f} |")


if __name__ == "__main__":
    main()
