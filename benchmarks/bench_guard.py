"""The cost guard's trade-off: CHC at several guard factors, against UP and the hindsight optimum.

``docs/guard.md``: a smaller ``guard`` bounds every job closer to Uniform Progress's cost and
gives up more of the jobs where waiting for cheaper spot pays. On the evaluation grid's scenarios
(``spotsched evaluate``'s jobs and markets) this prints, per guard factor: the worst cost / UP
cost over single jobs, the jobs above ``--target`` x UP, the mean cost / UP, the mean excess cost
over the hindsight optimum (cost / optimal cost - 1, as ``spotsched evaluate`` reports it), and
the jobs the guard handed over at least once; UP and the optimum run on the same jobs in the same run.
``--forecaster oracle`` plans on the realised market itself: what CHC pays under each factor
with perfect forecasts, the most any forecaster could buy it (the consistency side of the
trade-off). One process, the scenarios in turn. Plain script:

    python benchmarks/bench_guard.py --traces /tmp/guard-eval/synth22.csv.gz --guards 1.2 1.5 2 none
    python benchmarks/bench_guard.py --forecaster oracle --commit 1 --scenarios 8 --guards 1.1 1.2 1.35 1.5 2 none
"""

from __future__ import annotations

import argparse
from typing import Any

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.guard import GuardedPolicy
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios, scenario_job


def chc_params(forecaster: str, commit: int | None, guard: float | None) -> dict[str, Any]:
    """The benchmarked CHC's parameters; the oracle is exact (no injected error)."""
    params: dict[str, Any] = {"forecaster": forecaster, "guard": guard}
    if commit is not None:
        params["commit"] = commit
    if forecaster == "oracle":
        params.update(error=0.0, seed=0)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = GridConfig()
    parser.add_argument("--traces", nargs="+", default=list(default.traces), help="trace files (default: the shipped two)")
    parser.add_argument("--scenarios", type=int, default=2, help="start times per trace")
    parser.add_argument("--guards", nargs="+", default=["1.2", "1.5", "2", "none"], help="guard factors; none: unguarded")
    parser.add_argument("--target", type=float, default=1.25, help="the ratio to UP no job should exceed")
    parser.add_argument("--forecaster", default="auto", help="CHC's forecaster; oracle: the realised market, exactly")
    parser.add_argument("--commit", type=int, default=None, help="slots CHC commits to per plan (default: CHC's own)")
    args = parser.parse_args()
    guards = [None if g == "none" else float(g) for g in args.guards]
    config = GridConfig(traces=tuple(args.traces), scenarios=args.scenarios, policies=("uniform-progress",))
    ratios: dict[float | None, list[float]] = {g: [] for g in guards}
    excess: dict[float | None, list[float]] = {g: [] for g in guards}
    up_excess: list[float] = []
    switched = dict.fromkeys(guards, 0)
    for path in config.traces:
        trace = cached_trace(path)
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            optimal = simulate(make_policy("optimal"), job, market).outcome
            up = simulate(make_policy("uniform-progress"), job, market).outcome
            up_excess.append(up.cost / optimal.cost - 1)
            for guard in guards:
                policy = make_policy("chc", chc_params(args.forecaster, args.commit, guard))
                outcome = simulate(policy, job, market).outcome
                ratios[guard].append(outcome.cost / up.cost)
                excess[guard].append(outcome.cost / optimal.cost - 1)
                switched[guard] += isinstance(policy, GuardedPolicy) and policy.handovers > 0
    print(f"CHC on {args.forecaster}; Uniform Progress on the same jobs: {100 * sum(up_excess) / len(up_excess):+.1f}% over the optimum")
    print(f"| guard | jobs | worst cost / UP | jobs > {args.target:g} x UP | mean cost / UP | excess over optimal | switched |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for guard, values in ratios.items():
        above = sum(r > args.target + 1e-9 for r in values)
        shown = "none" if guard is None else f"{guard:g}"
        mean = sum(values) / len(values)
        mean_excess = 100 * sum(excess[guard]) / len(excess[guard])
        print(f"| {shown} | {len(values)} | {max(values):.3f} | {above} | {mean:.3f} | {mean_excess:+.1f}% | {switched[guard]} |")


if __name__ == "__main__":
    main()
