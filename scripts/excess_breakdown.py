"""Where policies lose money against the hindsight optimum: spot prices, on-demand hours or restarts.

For every job of a grid, each policy's run and the optimum's are split by
`simulation.cost_breakdown` into spot bill, on-demand bill and instance-hours billed while
restarting. Per trace and N_max it prints each policy's mean excess cost over the optimum; the
part of it in the spot bill and in the on-demand bill (both in % of the optimum's cost; they sum
to the excess where no deadline is missed); per job its restart hours, its restarts and those
of them the market forced (a pool in use lost the instances), each beside the optimum's; and
the mean spot price it paid over the optimum's. A gap in the spot bill at the same price is
hours bought (restarts, or running more instances); a gap in price is pools and hours chosen.
Plain script; the selector is left out (it learns across jobs: run `spotsched evaluate` for it):

    python scripts/excess_breakdown.py --scenarios 2
    python scripts/excess_breakdown.py --traces /tmp/sel/s41.csv.gz --nmax 4 8 --policies uniform-progress \\
        --member chc-oracle-guarded chc '{"forecaster": "oracle", "error": 0.0, "commit": 1, "guard": 1.2}'
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policy import Policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.cost_breakdown import CostBreakdown, cost_breakdown
from airflow_provider_spotsched.simulation.evaluation import (
    POLICY_SPECS,
    SELECTOR,
    GridConfig,
    plan_scenarios,
    scenario_job,
    trace_name,
)


@dataclass
class Tally:
    """Sums over the jobs of one (trace, N_max, policy) cell."""

    jobs: int = 0
    excess: float = 0.0  # utility shortfall over the optimum's cost, as the evaluation reports it
    spot_gap: float = 0.0  # (spot bill - the optimum's) / the optimum's cost
    on_demand_gap: float = 0.0
    restart_hours: float = 0.0
    optimal_restart_hours: float = 0.0
    restarts: int = 0
    optimal_restarts: int = 0
    forced_restarts: int = 0
    optimal_forced_restarts: int = 0
    spot_price_ratio: float = 0.0  # mean spot price paid / the optimum's, over jobs where both ran spot
    priced_jobs: int = 0

    def add(self, excess: float, run: CostBreakdown, optimal: CostBreakdown) -> None:
        self.jobs += 1
        self.excess += excess
        self.spot_gap += (run.spot_cost - optimal.spot_cost) / optimal.cost
        self.on_demand_gap += (run.on_demand_cost - optimal.on_demand_cost) / optimal.cost
        self.restart_hours += run.restart_hours
        self.optimal_restart_hours += optimal.restart_hours
        self.restarts += run.restarts
        self.optimal_restarts += optimal.restarts
        self.forced_restarts += run.forced_restarts
        self.optimal_forced_restarts += optimal.forced_restarts
        if run.mean_spot_price is not None and optimal.mean_spot_price is not None:
            self.spot_price_ratio += run.mean_spot_price / optimal.mean_spot_price
            self.priced_jobs += 1

    def row(self, label: str, policy: str) -> str:
        n = self.jobs
        price = f"{self.spot_price_ratio / self.priced_jobs:.3f}" if self.priced_jobs else "n/a"
        return (
            f"{label:<36} {policy:<24} {n:>5} {100 * self.excess / n:>+8.1f}% {100 * self.spot_gap / n:>+8.1f}% "
            f"{100 * self.on_demand_gap / n:>+8.1f}% {self.restart_hours / n:>8.2f} {self.optimal_restart_hours / n:>8.2f} "
            f"{self.restarts / n:>8.2f} {self.optimal_restarts / n:>7.2f} "
            f"{self.forced_restarts / n:>7.2f} {self.optimal_forced_restarts / n:>7.2f} {price:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=list(GridConfig.traces), help="trace files (default: the shipped ones)")
    parser.add_argument("--scenarios", type=int, default=GridConfig.scenarios, help="start times per trace")
    parser.add_argument("--nmax", nargs="+", type=int, default=list(GridConfig.n_max), help="N_max values of the grid")
    parser.add_argument(
        "--policies", nargs="*", default=["uniform-progress", "chc-auto"], help="evaluation policies by their key"
    )
    parser.add_argument(
        "--member",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "POLICY", "PARAMS"),
        help="another policy: a short name, a policy name and its parameters as JSON",
    )
    args = parser.parse_args()
    if SELECTOR in args.policies or "optimal" in args.policies:
        parser.error("--policies: the selector learns across jobs (use `spotsched evaluate`), and the optimum is the reference")
    unknown = [key for key in args.policies if key not in POLICY_SPECS]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; choose from {sorted(POLICY_SPECS)}")
    builders: dict[str, Callable[[], Policy]] = {
        key: functools.partial(POLICY_SPECS[key].build, GridConfig.seed) for key in args.policies
    }
    for name, policy_name, params in args.member:
        builders[name] = functools.partial(make_policy, policy_name, json.loads(params))

    config = GridConfig(traces=tuple(args.traces), scenarios=args.scenarios, n_max=tuple(args.nmax), policies=("optimal",))
    tallies: dict[tuple[str, int, str], Tally] = defaultdict(Tally)
    for path in config.traces:
        trace = cached_trace(path)
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            optimal = simulate(make_policy("optimal"), job, market)
            optimal_bill = cost_breakdown(optimal, market)
            for name, build in builders.items():
                policy = build()
                if policy.single_instance and job.max_instances != 1:
                    continue
                run = simulate(policy, job, market)
                excess = (optimal.outcome.utility - run.outcome.utility) / optimal.outcome.cost
                bill = cost_breakdown(run, market)
                for n_max in (job.max_instances, 0):  # 0: every N_max of the trace
                    tallies[(trace_name(path), n_max, name)].add(excess, bill, optimal_bill)
    print(
        f"{'trace, N_max':<36} {'policy':<24} {'jobs':>5} {'excess':>9} {'spot bill':>9} {'on-demand':>9} "
        f"{'restart h':>8} {'optimum':>8} {'restarts':>8} {'optimum':>7} {'forced':>7} {'optimum':>7} {'price':>8}"
    )
    for (label, n_max, name), tally in sorted(tallies.items(), key=lambda item: (item[0][0], item[0][1] or 10**6)):
        print(tally.row(f"{label}, {'all' if n_max == 0 else n_max}", name))


if __name__ == "__main__":
    main()
