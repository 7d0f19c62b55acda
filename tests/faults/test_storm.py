"""Fault 1, a preemption storm: no spot capacity anywhere for hours, in the middle of the job.

A synthetic trace (tests/faults/markets.py) takes every pool's availability to 0 from slot
``first`` on for many hours. The driver runs the job on the local backend with the fake worker;
whatever the policy, its safety net must move the job to on-demand in time and finish it by the
deadline, which N_max on-demand instances could meet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.execution.driver import RunDriver
from airflow_provider_spotsched.execution.environment import local_environment
from airflow_provider_spotsched.scheduling.model import Job, Throughput
from airflow_provider_spotsched.scheduling.online import RunConfig
from tests.billing import billed
from tests.faults.markets import MARKET_START, POOLS, write_trace
from tests.faults.support import (
    CHAOS_RUNS,
    STEP_S,
    Audit,
    ProgressWatch,
    check_figures,
    released_at_exit,
    worker_command,
)


def run_storm(tmp_path: Path, policy: str, first: int, seconds_per_slot: float, samples: int,
              deadline: float, seed: int = 0) -> tuple[dict[str, Any], Audit, ProgressWatch, list[dict]]:
    trace = write_trace(tmp_path / "storm.csv", storm=(first, first + 24), seed=seed)
    settings = LocalReplaySettings(workdir=tmp_path / "local", trace=trace, seconds_per_slot=seconds_per_slot,
                                   market_start=MARKET_START)
    env = local_environment(settings, 1.0)
    # the planning model is 60% of what a fake worker does in a slot: the safety net plans on H(n)
    alpha = 0.6 * seconds_per_slot / STEP_S
    job = Job(work=samples, deadline_hours=deadline, max_instances=2, throughput=Throughput(alpha, 0.0), value=100.0,
              hard_deadline_factor=1.5, reconfig_overhead_hours=0.2)
    job.check_feasible()  # N_max on-demand meets this deadline
    config = RunConfig(f"storm-{policy}", job, POOLS, policy=policy, forecaster="persistence",
                       seconds_per_slot=seconds_per_slot)
    command = worker_command(tmp_path, samples, STEP_S)
    driver = RunDriver.start(env, config, lambda uri: command, str(tmp_path / "checkpoint"), lambda state: None)
    audit = Audit(tmp_path / "local", config.job_id, job.max_instances)
    with released_at_exit(tmp_path / "local"), ProgressWatch.progress_file(tmp_path / "checkpoint") as watch:
        run = driver.run_to_completion(poll_interval=0.1)
    return run.result(), audit, watch, run.decision_log()


def check_storm(ledger, tmp_path: Path, policy: str, first: int, seconds_per_slot: float, samples: int,
                deadline: float, seed: int = 0) -> None:
    result, audit, watch, log = run_storm(tmp_path, policy, first, seconds_per_slot, samples, deadline, seed)
    dark = [r for r in log if r["slot"] >= first]
    figures = ledger.add(audit.figures("1 preemption storm", f"{policy} seed {seed}", watch, result,
                                       preemptions=result["preemptions"], slots=result["slots"]))
    check_figures(figures)
    assert result["completion_hours"] is not None
    assert all(not r["applied"]["spot"] for r in dark), "no spot instance ran where no pool had capacity"
    assert any(r["applied"]["on_demand"] for r in dark), "the job moved to on-demand during the storm"
    assert result["cost"] == pytest.approx(billed(log, result))


def test_a_preemption_storm_moves_the_job_to_on_demand_and_meets_the_deadline(ledger, tmp_path):
    check_storm(ledger, tmp_path, "uniform-progress", first=1, seconds_per_slot=1.5, samples=150, deadline=6.0)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
@pytest.mark.parametrize("policy", ["uniform-progress", "selector", "chc", "greedy"])
def test_chaos_preemption_storm(ledger, tmp_path, policy, seed):
    """Longer jobs, the storm starting at slot 1 to 3 (by seed), every online policy."""
    check_storm(ledger, tmp_path, policy, first=1 + seed % 3, seconds_per_slot=2.0, samples=300, deadline=10.0,
                seed=seed)
