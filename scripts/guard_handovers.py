"""How often a guarded policy's guard hands the job over to tracking, how often the member takes
it back, and how often the deadline safety net takes over after a handover: the one case the
guard's bound leaves out (``docs/guard.md``, case (b)).

For every job of a grid it runs the policy (an evaluation key such as ``chc-blend``) at the true
throughput ``--true-throughput`` x the declared one, counts per trace the jobs handed over, those
taken back at least once, and those whose safety net took over after a handover, and lists the
latter with their cost against Uniform Progress's on the same job. Plain script:

    python scripts/guard_handovers.py chc-blend                            # the shipped default grid, declared right
    python scripts/guard_handovers.py chc-blend --true-throughput 0.7692   # declared 30% too high
"""

from __future__ import annotations

import argparse

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.scheduling.guard import GuardedPolicy
from airflow_provider_spotsched.scheduling.policies.uniform_progress import UniformProgressPolicy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from airflow_provider_spotsched.simulation.evaluation import POLICY_SPECS, GridConfig, plan_scenarios, scenario_job, trace_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="an evaluation policy key whose policy runs under the guard, e.g. chc-blend")
    parser.add_argument("--traces", nargs="+", default=list(GridConfig.traces), help="trace files (default: the shipped ones)")
    parser.add_argument("--scenarios", type=int, default=GridConfig.scenarios, help="start times per trace")
    parser.add_argument("--true-throughput", type=float, default=1.0, help="the true throughput over the declared one")
    args = parser.parse_args()
    if args.policy not in POLICY_SPECS:
        parser.error(f"policy: unknown {args.policy!r}; choose from {sorted(POLICY_SPECS)}")
    truth = TrueThroughput(args.true_throughput)
    config = GridConfig(traces=tuple(args.traces), scenarios=args.scenarios, policies=("optimal",))
    for path in config.traces:
        trace = cached_trace(path)
        jobs = switched = taken_back = 0
        late: list[str] = []
        for scenario in plan_scenarios(config, trace):
            job, market = scenario_job(config, trace, scenario)
            policy = POLICY_SPECS[args.policy].build(GridConfig.seed)
            if not isinstance(policy, GuardedPolicy):
                parser.error(f"policy: {args.policy!r} runs without the guard")
            if policy.single_instance and job.max_instances != 1:
                continue
            cost = simulate(policy, job, market, truth).outcome.cost
            jobs += 1
            switched += policy.handovers > 0
            taken_back += policy.returns > 0
            if policy.safety_net_at is not None:
                up = simulate(UniformProgressPolicy(), job, market, truth).outcome.cost
                late.append(
                    f"  {scenario.start:%Y-%m-%dT%H:%M} N_max {job.max_instances:>2} slack {scenario.slack} "
                    f"overhead {scenario.overhead}: switched at slot {policy.switched_at}, safety net from "
                    f"{policy.safety_net_at}, cost {cost / up:.3f} x UP"
                )
        print(
            f"{trace_name(path)}: {jobs} jobs, switched {switched}, taken back {taken_back}, "
            f"safety net after the switch {len(late)}"
        )
        print("\n".join(late))


if __name__ == "__main__":
    main()
