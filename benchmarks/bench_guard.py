"""The cost guard's trade-off: CHC on the auto forecasters at several guard factors, against UP.

``docs/guard.md``: a smaller ``guard`` bounds every job closer to Uniform Progress's cost and
gives up more of the jobs where waiting for cheaper spot pays. On the evaluation grid's scenarios
(``spotsched evaluate``'s jobs and markets) this prints, per guard factor: the worst cost / UP
cost over single jobs, the jobs above ``--target`` x UP, the mean cost / UP, and the jobs the
guard switched. One process, the scenarios in turn. Plain script:

    python benchmarks/bench_guard.py --traces /tmp/guard-eval/synth22.csv.gz --guards 1.2 1.5 2 none
"""

from __future__ import annotations

import argparse

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.guard import GuardedPolicy
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios, scenario_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = GridConfig()
    parser.add_argument("--traces", nargs="+", default=list(default.traces), help="trace files (default: the shipped two)")
    parser.add_argument("--scenarios", type=int, default=2, help="start times per trace")
    parser.add_argument("--guards", nargs="+", default=["1.2", "1.5", "2", "none"], help="guard factors; none: unguarded")
    parser.add_argument("--target", type=float, default=1.25, help="the ratio to UP no job should exceed")
    args = parser.parse_args()
    guards = [None if g == "none" else float(g) for g in args.guards]
    config = GridConfig(traces=tuple(args.traces), scenarios=args.scenarios, policies=("uniform-progress",))
    ratios: dict[float | None, list[float]] = {g: [] for g in guards}
    switched = dict.fromkeys(guards, 0)
    for path in config.traces:
        trace = cached_trace(path)
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            up = simulate(make_policy("uniform-progress"), job, market).outcome.cost
            for guard in guards:
                policy = make_policy("chc", {"forecaster": "auto", "guard": guard})
                ratios[guard].append(simulate(policy, job, market).outcome.cost / up)
                switched[guard] += isinstance(policy, GuardedPolicy) and policy.switched_at is not None
    print(f"| guard | jobs | worst cost / UP | jobs > {args.target:g} x UP | mean cost / UP | switched |")
    print("| --- | --- | --- | --- | --- | --- |")
    for guard, values in ratios.items():
        above = sum(r > args.target + 1e-9 for r in values)
        shown = "none" if guard is None else f"{guard:g}"
        mean = sum(values) / len(values)
        print(f"| {shown} | {len(values)} | {max(values):.3f} | {above} | {mean:.3f} | {switched[guard]} |")


if __name__ == "__main__":
    main()
