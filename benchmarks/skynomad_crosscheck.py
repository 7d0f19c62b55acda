"""Cross-check the SkyNomad, UP(S) and UP(AP) ports (SkyNomad both ways it can observe pools) against the SkyNomad artifact's own simulator.

Runs the authors' code (github.com/andylizf/skynomad-artifact, Apache-2.0) unchanged and this
project's ports on the same single-instance jobs and the same hourly markets: per shipped trace,
``--starts`` submission times, 24 hours of work, deadlines 30/36/48 h, overheads 0.1/0.25 h
(72 jobs with the defaults). Each job's hourly market (the spec's default resampling) is
written in the artifact's trace format (one ``<zone>/0.json`` per pool, ``data`` 0 = spot on
offer, ``prices`` per tick, the job's on-demand price), the artifact's ``multi_trace``
environment runs each strategy on it with ``checkpoint_size_gb = 0`` (this model has no
checkpoint transfer), and the script prints, per policy, the mean excess cost over this
project's hindsight optimum for both implementations and the per-job cost ratio port/artifact.

The artifact is not part of this repository and no test needs this script. Its simulator
needs numpy, tqdm and configargparse; give a Python that has them::

    python -m venv /tmp/skyvenv && /tmp/skyvenv/bin/pip install numpy tqdm configargparse
    PYTHONPATH=$PWD python benchmarks/skynomad_crosscheck.py \\
        --artifact /path/to/skynomad-artifact --artifact-python /tmp/skyvenv/bin/python

This file is also the worker that runs inside that Python (``--worker``): that part imports
the artifact and the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Port (as printed) -> (our policy, its parameters, the artifact's --strategy: its README's mapping).
PORTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "skynomad": ("skynomad", {}, "unified_cost_model_risk"),
    "skynomad-lp": ("skynomad", {"observe": "launches-and-probes"}, "unified_cost_model_risk"),
    "up-s": ("up-s", {}, "multi_region_rc_cr_threshold_eager_failover"),
    "up-ap": ("up-ap", {}, "multi_region_probe_cost_ratio"),
}
WORK_HOURS = 24.0
DEADLINES = (30.0, 36.0, 48.0)
OVERHEADS = (0.1, 0.25)


def worker(artifact: str, jobs_file: str) -> None:
    """Run every job of ``jobs_file`` through the artifact's simulator; print one JSON line per run."""
    sys.path.insert(0, artifact)
    import logging

    import configargparse

    logging.disable(logging.CRITICAL)
    from sky_spot import env as env_lib
    from sky_spot import simulate
    from sky_spot.strategies import strategy as strategy_lib
    from sky_spot.task import SingleTask

    for job in json.loads(Path(jobs_file).read_text()):
        for strategy_name in job["strategies"]:
            out = tempfile.mkdtemp(prefix="skynomad-run-")
            sys.argv = [
                "main.py", "--env", "multi_trace", "--strategy", strategy_name,
                "--trace-files", *job["trace_files"],
                "--task-duration-hours", str(job["work_hours"]), "--deadline-hours", str(job["deadline_hours"]),
                "--restart-overhead-hours", str(job["overhead_hours"]), "--checkpoint-size-gb", "0",
                "--output-dir", out,
            ]  # fmt: skip
            parser = configargparse.ArgumentParser("crosscheck")
            parser.add_argument("--deadline-hours", type=float)
            parser.add_argument("--task-duration-hours", type=float, nargs="+")
            parser.add_argument("--restart-overhead-hours", type=float, nargs="+")
            parser.add_argument("--checkpoint-size-gb", type=float)
            parser.add_argument("--cross-region-migration-time", action="store_true")
            parser.add_argument("--output-dir", type=str)
            parser.add_argument("--strategy", type=str)
            envs = env_lib.Env.from_args(parser)
            strategy = strategy_lib.Strategy.get(strategy_name)._from_args(parser)
            args = strategy.args
            task = SingleTask(config={"duration": args.task_duration_hours[0], "checkpoint_size_gb": 0.0})
            result = simulate.simulate(
                envs=envs,
                strategy=strategy,
                task=task,
                trace_file="crosscheck",
                deadline_hours=args.deadline_hours,
                restart_overhead_hours=args.restart_overhead_hours,
                env_start_hours=0.0,
                output_dir=out,
                kwargs=vars(args),
                silent=True,
                dump_history=True,
            )  # fmt: skip  (without the history, the reported cost misses the final tick's bill)
            shutil.rmtree(out, ignore_errors=True)
            print(json.dumps({
                "job": job["id"], "strategy": strategy_name, "cost": float(result["costs"][0]),
                "probe_cost": float(result.get("probe_costs", [0.0])[0]),
            }), flush=True)  # fmt: skip


def write_market(directory: Path, market: Any, slots: int, device: str) -> list[str]:
    """The job's hourly market in the artifact's trace format, one file per pool; their paths.

    A pool's folder is named ``<zone>_<device>_1``, the form the artifact reads regions from.
    """
    files = []
    for m, pool in enumerate(market.pools):
        folder = directory / f"{pool}_{device}_1"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "0.json"
        path.write_text(json.dumps({
            "metadata": {
                "gap_seconds": int(round(market.slot_hours * 3600)),
                "price_info": {"zone": pool, "on_demand_price": float(market.on_demand_price)},
            },
            "data": [0 if market.available[t, m] >= 1 else 1 for t in range(slots)],
            "prices": [float(market.spot_price[t, m]) for t in range(slots)],
        }))  # fmt: skip
        files.append(str(path))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="a checkout of github.com/andylizf/skynomad-artifact")
    parser.add_argument("--artifact-python", default=sys.executable, help="a Python with numpy, tqdm, configargparse")
    parser.add_argument("--starts", type=int, default=6, help="submission times per shipped trace")
    parser.add_argument("--policies", default=",".join(PORTS), help=f"of {sorted(PORTS)} (skynomad-lp: observe=launches-and-probes)")
    parser.add_argument("--worker", metavar="JOBS_JSON", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.artifact, opts.worker)
        return
    if not (Path(opts.artifact) / "sky_spot" / "strategies" / "unified_cost_model.py").is_file():
        parser.error(f"--artifact {opts.artifact}: no sky_spot/strategies/unified_cost_model.py there; give the checkout")
    policies = opts.policies.split(",")
    unknown = sorted(set(policies) - set(PORTS))
    if unknown:
        parser.error(f"--policies: no artifact strategy for {unknown}; choose from {sorted(PORTS)}")
    compare(opts.artifact, opts.artifact_python, opts.starts, policies)


def compare(artifact: str, artifact_python: str, starts: int, policies: list[str]) -> None:
    from dataclasses import replace

    import numpy as np

    from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
    from airflow_provider_spotsched.market.shipped import cached_trace
    from airflow_provider_spotsched.scheduling.policies import make_policy
    from airflow_provider_spotsched.scheduling.replay import job_market, simulate
    from airflow_provider_spotsched.scheduling.rules import on_demand_cost
    from airflow_provider_spotsched.simulation.evaluation import GridConfig, plan_scenarios

    # The evaluation's grid with these jobs' longest horizon sets the starts; the jobs are built here.
    DEVICES = {str(AWS_TRACE): "v100", str(GCP_TRACE): "h100"}  # p3.2xlarge is one V100
    grid = GridConfig(scenarios=starts, n_max=(1,), slack=(2.0,), overhead=(max(OVERHEADS),), base_hours=WORK_HOURS)
    jobs: list[dict[str, Any]] = []
    ours: dict[tuple[str, str], tuple[Any, float]] = {}
    specs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="skynomad-crosscheck-") as tmp:
        for trace_path in (str(AWS_TRACE), str(GCP_TRACE)):
            trace = cached_trace(trace_path)
            for scenario in plan_scenarios(grid, trace):
                for deadline in DEADLINES:
                    for overhead in OVERHEADS:
                        draft = replace(grid_job(grid, deadline, overhead), start=scenario.start)
                        market = job_market(trace, draft, lookback_hours=scenario.lookback_hours)
                        job = replace(draft, value=grid.value_factor * on_demand_cost(draft, market.market.on_demand_price))
                        key = f"{scenario.trace_name}|{scenario.start_text}|{deadline:g}|{overhead:g}"
                        slots = market.job_slots
                        folder = Path(tmp) / f"job{len(jobs)}"
                        files = write_market(folder, slots, slots.num_slots, DEVICES[trace_path])
                        jobs.append({"id": key, "trace_files": files, "work_hours": WORK_HOURS,
                                     "deadline_hours": deadline, "overhead_hours": overhead,
                                     "strategies": sorted({PORTS[p][2] for p in policies})})  # fmt: skip
                        for name in ("optimal", *policies):
                            policy, params, _ = PORTS.get(name, (name, {}, ""))
                            result = simulate(make_policy(policy, params), job, market)
                            ours[(key, name)] = (result.outcome, result.outcome.cost + last_slot_rest(result, slots))
                        specs.append(key)
        jobs_file = Path(tmp) / "jobs.json"
        jobs_file.write_text(json.dumps(jobs))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["WANDB_DISABLED"] = "true"
        run = subprocess.run(
            [artifact_python, __file__, "--artifact", artifact, "--worker", str(jobs_file)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if run.returncode != 0:
            sys.exit(f"the artifact's simulator failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    theirs = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            theirs[(record["job"], record["strategy"])] = record
    print(f"{len(specs)} single-instance jobs: {WORK_HOURS:g} h of work, deadlines {DEADLINES} h, overheads {OVERHEADS} h,"
          f" {starts} starts per shipped trace; hourly markets; excess = cost / our optimum - 1")  # fmt: skip
    print(f"{'job (trace|start|deadline|overhead)':<58} " + " ".join(f"{name + ' port/art':>17}" for name in policies))
    for key in specs:
        cells = []
        for name in policies:
            record = theirs[(key, PORTS[name][2])]
            cells.append(f"{ours[(key, name)][1] / (record['cost'] - record['probe_cost']):>17.4f}")
        print(f"{key:<58} " + " ".join(cells))
    print()
    print("port, artifact: mean excess cost; 'whole' bills the port's completion slot whole, as the artifact does;")
    print("art-probes: the artifact less its probe bill (this model observes availability for free);")
    print("ratio: per job port (whole) / (artifact - probes); 'same': jobs where the two agree to 1e-6")
    print(f"{'trace':<30} {'policy':<9} {'jobs':>4} {'port':>8} {'whole':>8} {'artifact':>9} {'art-probes':>10} "
          f"{'ratio':>6} {'min':>6} {'max':>6} {'same':>4} {'misses':>6}")  # fmt: skip
    for trace_name in sorted({k.split("|")[0] for k in specs}):
        keys = [k for k in specs if k.startswith(trace_name + "|")]
        for name in policies:
            strategy = PORTS[name][2]
            best = np.array([ours[(k, "optimal")][0].cost for k in keys])
            port = np.array([ours[(k, name)][0].cost for k in keys])
            whole = np.array([ours[(k, name)][1] for k in keys])
            art = np.array([theirs[(k, strategy)]["cost"] for k in keys])
            probes = np.array([theirs[(k, strategy)]["probe_cost"] for k in keys])
            misses = sum(ours[(k, name)][0].soft_miss for k in keys)
            ratio = whole / (art - probes)
            same = int(np.sum(np.abs(ratio - 1) < 1e-6))
            print(f"{trace_name:<30} {name:<9} {len(keys):>4} {np.mean(port / best - 1):>+8.2%} {np.mean(whole / best - 1):>+8.2%} "
                  f"{np.mean(art / best - 1):>+9.2%} {np.mean((art - probes) / best - 1):>+10.2%} "
                  f"{ratio.mean():>6.3f} {ratio.min():>6.3f} {ratio.max():>6.3f} {same:>4} {misses:>6}")  # fmt: skip


def last_slot_rest(result: Any, market: Any) -> float:
    """What billing the completion slot whole (the artifact bills whole ticks) adds to the cost."""
    hours = result.outcome.completion_hours
    if hours is None:
        return 0.0
    slot = len(result.allocations) - 1
    rest = (slot + 1) * result.job.slot_hours - hours
    last = result.allocations[-1]
    spot = sum(n * float(market.spot_price[slot, m]) for m, n in enumerate(last.spot))
    return rest * (spot + last.on_demand * float(market.on_demand_price))


def grid_job(grid: Any, deadline: float, overhead: float) -> Any:
    """One cross-check job: WORK_HOURS of work on one instance, the grid's value and hard deadline."""
    from airflow_provider_spotsched.scheduling.model import Job

    return Job(
        work=grid.throughput(1) * WORK_HOURS,
        deadline_hours=deadline,
        max_instances=1,
        throughput=grid.throughput,
        value=0.0,
        hard_deadline_factor=grid.hard_deadline_factor,
        reconfig_overhead_hours=overhead,
        slot_hours=grid.slot_hours,
    )


if __name__ == "__main__":
    main()
