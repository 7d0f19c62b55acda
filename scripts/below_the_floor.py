"""How far below its history's cheapest price each job of a grid meets the market: the case the
cost guard's exact bound assumes away (``docs/guard.md``, case (d)).

For each start and deadline slack of the evaluation grid (one instance, the first overhead: the
market a job sees depends on its window, not on its size), the cheapest spot price offered with
capacity during the job's slots, over the cheapest in the history before its submission. Below
1, the job meets prices its history never showed. Plain script:

    python scripts/below_the_floor.py m4501.csv.gz m4502.csv.gz --scenarios 2
"""

from __future__ import annotations

import argparse

import numpy as np

from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios, scenario_job, trace_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (CSV or .csv.gz)")
    parser.add_argument("--scenarios", type=int, default=GridConfig.scenarios, help="start times per trace")
    args = parser.parse_args()
    for path in args.traces:
        config = GridConfig(traces=(path,), scenarios=args.scenarios)
        trace = cached_trace(path)
        ratios = []
        for scenario in plan_scenarios(config, trace):
            if scenario.n_max != 1 or scenario.overhead != config.overhead[0]:
                continue
            job, job_market = scenario_job(config, trace, scenario)
            market, offset = job_market.market, job_market.offset
            before = market.spot_price[:offset][market.available[:offset] >= 1]
            during_slots = slice(offset, offset + job.horizon_slots)
            during = market.spot_price[during_slots][market.available[during_slots] >= 1]
            if before.size and during.size:
                ratios.append(float(during.min() / before.min()))
        if not ratios:
            print(f"{trace_name(path)}: no job saw spot capacity both before and during it")
            continue
        shown = ", ".join(f"{r:.3f}" for r in ratios)
        print(
            f"{trace_name(path)}: cheapest during the job / cheapest before, {len(ratios)} jobs: {shown} "
            f"(min {np.min(ratios):.3f}, max {np.max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
