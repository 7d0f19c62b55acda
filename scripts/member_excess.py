"""Candidate selector members on a small grid: each one's mean excess cost over the hindsight
optimum per trace, its worst job against Uniform Progress's cost, and its hard misses.

The selector can only be as good as the best member of its pool for each kind of job, so a
member is worth adding where it beats the current ones, and that is measured member by member,
without the selector's learning in between. Run it on markets of your own (`spotsched synth`),
never to tune on the shipped traces. Plain script:

    python scripts/member_excess.py --traces /tmp/sel/s41.csv.gz /tmp/sel/s42.csv.gz --nmax 1 4 8 \\
        --member p0 prediction-free '{"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.0, "guard": 1.2}' \\
        --member p0-unguarded prediction-free '{"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.0}'
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios, scenario_job, trace_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True, help="trace files (CSV or .csv.gz)")
    parser.add_argument("--nmax", nargs="+", type=int, default=[1, 4, 8], help="N_max values of the grid")
    parser.add_argument("--scenarios", type=int, default=2, help="start times per trace")
    parser.add_argument(
        "--member",
        nargs=3,
        action="append",
        required=True,
        metavar=("NAME", "POLICY", "PARAMS"),
        help="a candidate: a short name, a policy name and its parameters as JSON",
    )
    args = parser.parse_args()
    members = {name: (policy, json.loads(params)) for name, policy, params in args.member}
    config = GridConfig(traces=tuple(args.traces), scenarios=args.scenarios, n_max=tuple(args.nmax), policies=("optimal",))
    excess: dict[tuple[str, str], list[float]] = defaultdict(list)
    worst: dict[str, float] = defaultdict(float)
    hard: dict[str, int] = defaultdict(int)
    for path in config.traces:
        trace = cached_trace(path)
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            optimal = simulate(make_policy("optimal"), job, market).outcome
            up = simulate(make_policy("uniform-progress"), job, market).outcome
            for name, (policy, params) in members.items():
                member = make_policy(policy, params)
                if member.single_instance and job.max_instances != 1:
                    continue  # as in the selector: a single-instance member sits out N_max > 1 jobs
                outcome = simulate(member, job, market).outcome
                excess[(trace_name(path), name)].append((optimal.utility - outcome.utility) / optimal.cost)
                worst[name] = max(worst[name], outcome.cost / up.cost)
                hard[name] += outcome.hard_miss
    print(f"{'trace':<32} {'member':<20} {'runs':>5} {'excess vs optimal':>18}")
    for (trace, name), values in sorted(excess.items()):
        print(f"{trace:<32} {name:<20} {len(values):>5} {100 * sum(values) / len(values):>+17.1f}%")
    for name in members:
        values = [v for (_, n), vs in excess.items() if n == name for v in vs]
        print(
            f"{'all':<32} {name:<20} {len(values):>5} {100 * sum(values) / len(values):>+17.1f}%"
            f"   worst job / UP {worst[name]:.3f}   hard misses {hard[name]}"
        )


if __name__ == "__main__":
    main()
