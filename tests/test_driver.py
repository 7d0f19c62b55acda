"""The run driver on its own, with no Airflow in the process: a real local run to its end.

The backend is the real local one on the replayed GCP trace, the workers tests/fake_worker.py
(the runtime's contract in milliseconds). The same driver runs under the operator
(tests/test_operator.py) and ``spotsched run`` (tests/test_cli_run.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    ComputeBackend,
    InstanceState,
    InstanceStatus,
    JobStatus,
    TrainingJob,
)
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_processes import marked
from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.execution.driver import Finished, RunDriver, TrainingFailedError, _released
from airflow_provider_spotsched.execution.environment import SpotEnvironment, local_environment
from airflow_provider_spotsched.execution.wake import Wait
from airflow_provider_spotsched.market.feed import ReplayedMarket
from airflow_provider_spotsched.market.trace import load_trace
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput
from airflow_provider_spotsched.scheduling.online import RunConfig

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
POOLS = ("us-east4-a", "europe-west1-c")
MARKET_START = "2025-10-11T03:10:00Z"  # us-east4-a loses its capacity in slot 2


def make_driver(tmp_path: Path, saved: list[dict[str, Any]], samples: int = 160, step_s: float = 0.05,
                linger_s: float = 0.0) -> RunDriver:
    settings = LocalReplaySettings.from_extra(
        {"workdir": str(tmp_path / "local"), "seconds_per_slot": 2.0, "market_start": MARKET_START}, "test"
    )
    env = local_environment(settings, 1.0)
    job = Job(work=samples, deadline_hours=6.0, max_instances=2, throughput=Throughput(60.0, 0.0), value=100.0,
              hard_deadline_factor=1.5, reconfig_overhead_hours=0.2)
    config = RunConfig("driver-test", job, POOLS, policy="uniform-progress", forecaster="persistence",
                       seconds_per_slot=env.seconds_per_slot)
    worker = tmp_path / "worker.json"
    worker.write_text(json.dumps({"samples": samples, "step_s": step_s, "linger_s": linger_s}))

    def command(uri: str) -> list[str]:
        return [sys.executable, str(FAKE_WORKER), "--config", str(worker), "--checkpoint-uri", uri]

    return RunDriver.start(env, config, command, str(tmp_path / "checkpoint"), saved.append)


def test_the_driver_runs_a_job_to_its_end_without_airflow(tmp_path):
    saved: list[dict[str, Any]] = []
    driver = make_driver(tmp_path, saved)
    assert not saved, "nothing is decided, persisted or launched before the first step"
    steps: list[int] = []
    run = driver.run_to_completion(poll_interval=0.1, on_step=lambda r: steps.append(len(r.records)))

    result = run.result()
    assert result["completion_hours"] is not None and result["deadline_met"]
    assert [r.slot for r in run.records] == list(range(len(run.records))), "one decision per slot, catch-up included"
    assert steps == sorted(steps) and steps[-1] == len(run.records)
    assert saved[-1]["run"]["completion_hours"] == result["completion_hours"], "the final state was persisted"
    billed = sum(
        r.applied["on_demand"] * r.on_demand_price + sum(n * r.market[p]["spot_price"] for p, n in r.applied["spot"].items())
        for r in run.records[:-1]
    )
    assert result["cost"] >= billed - 1e-9, "every slot but the last is billed whole"
    assert not marked(str(tmp_path / "local" / "jobs" / "driver-test")), "no worker is left running"
    status = driver.env.backend.status(driver.training)
    assert all(i.state is not InstanceState.RUNNING for i in status.instances)


def test_a_runtime_that_is_still_exiting_after_the_work_is_done_is_waited_for_not_planned(tmp_path):
    """Its last progress says all samples are done while its process lives on past slot boundaries
    (the final save, torchrun's exit barrier): no policy is asked to plan a job with no work left."""
    saved: list[dict[str, Any]] = []
    run = make_driver(tmp_path, saved, samples=60, linger_s=5.0).run_to_completion(poll_interval=0.1)
    result = run.result()
    assert result["deadline_met"] and result["completion_hours"] is not None
    assert [r.slot for r in run.records] == list(range(len(run.records)))
    finished = [r for r in run.records if r.work_done >= 60]
    assert finished and all(r.plan is None for r in finished), "no policy planned a slot with no work left"


def test_the_decision_log_tells_the_ui_what_ran_where_and_when_next(tmp_path):
    """Per-pool preemptions, the runtime's last report and the next boundary, slot by slot."""
    saved: list[dict[str, Any]] = []
    run = make_driver(tmp_path, saved, samples=240).run_to_completion(poll_interval=0.1)
    result = run.result()
    # whether us-east4-a's workers are preempted (it loses its capacity in slot 2) or scaled down
    # first depends on who acts first at that boundary, the replay or the driver
    assert sum(result["preemptions_by_pool"].values()) == result["preemptions"]
    assert set(result["preemptions_by_pool"]) <= {"us-east4-a"}
    assert result["hard_deadline_hours"] == pytest.approx(9.0) and result["hard_deadline_met"]
    assert result["budget"] is None
    later = [r for r in run.records if r.work_done > 0]
    assert later and all(r.training and r.training["samples_per_second"] > 0 and r.training["loss"] > 0
                         for r in later), "each decision after the first progress report carries it"
    for before, after in zip(run.records, run.records[1:]):
        assert before.next_decision is not None and before.next_decision <= after.time
        assert all(after.preempted_by_pool.get(p, 0) >= n for p, n in before.preempted_by_pool.items())


def test_a_driver_rebuilt_from_its_state_goes_on_with_the_same_job(tmp_path):
    saved: list[dict[str, Any]] = []
    first = make_driver(tmp_path, saved, step_s=5.0)  # slow workers: the job is still running
    step = first.step()
    assert isinstance(step, Wait) and step.boundary > datetime.now(timezone.utc)
    launched = [i.instance_id for i in first.env.backend.status(first.training).instances]
    assert launched, "slot 0 launched its allocation"

    state = json.loads(json.dumps(saved[-1]))  # what a restarted caller reads back
    again = RunDriver.from_state(first.env, state, saved.append)
    step = again.step(reattach=True)
    assert isinstance(step, Wait)
    assert [i.instance_id for i in again.env.backend.status(again.training).instances] == launched, "nothing launched twice"
    assert [r.slot for r in again.run.records] == [0], "slot 0 is decided once"
    again.release()
    assert not marked(str(tmp_path / "local" / "jobs" / "driver-test"))


def test_a_job_the_backend_refuses_is_refused_before_anything_is_stored(tmp_path, monkeypatch):
    """A retry reattaches to a stored run whatever the task's parameters say now, so a refusal the
    first launch would meet must come before the run is stored: fixing the DAG then fixes the run."""
    def refuse(self, job):
        raise BackendError("pools ['europe-west1-c'] have no placement")

    monkeypatch.setattr(LocalBackend, "check_job", refuse)
    saved: list[dict[str, Any]] = []
    with pytest.raises(BackendError, match="have no placement"):
        make_driver(tmp_path, saved)
    assert saved == []


def test_a_step_late_by_several_slots_bills_what_ran_through_them_and_decides_only_now(tmp_path):
    """The slots a late step missed are over: they ran on the allocation in force (capped by each
    slot's capacity: us-east4-a loses its capacity in slot 2), and nothing is decided or launched
    for them; only the current slot is decided."""
    saved: list[dict[str, Any]] = []
    driver = make_driver(tmp_path, saved, step_s=5.0)
    try:
        driver.step()
        time.sleep(3.5 * driver.run.config.wall_seconds_per_slot)  # every caller down for three slots
        driver.step()
        late = driver.slot_at(datetime.now(timezone.utc))
    finally:
        driver.release()
    first, records = driver.run.records[0], driver.run.records
    assert [r.slot for r in records] == list(range(len(records))) and len(records) - 1 >= 3
    carried, current = records[1:-1], records[-1]
    assert carried and all(r.plan is None and r.forecast is None and r.allocation == r.applied for r in carried)
    for record in carried:
        in_force = first.applied
        capped = {p: min(n, record.market[p]["available"]) for p, n in in_force["spot"].items()}
        assert record.applied["spot"] == {p: n for p, n in capped.items() if n}
        assert record.applied["on_demand"] == in_force["on_demand"]
    assert current.slot in (late - 1, late) and current.forecast is not None  # decided, with its forecast


def test_slots_that_pass_after_a_release_are_carried_idle_not_billed_as_running(tmp_path):
    """A kill (the trigger's on_kill) or a failed try releases every instance; the next try re-attaches
    later: the slots in between ran nothing, whatever allocation was in force."""
    saved: list[dict[str, Any]] = []
    driver = make_driver(tmp_path, saved, step_s=5.0)
    again = None
    try:
        driver.step()
        assert driver.run.records[0].applied["spot"] or driver.run.records[0].applied["on_demand"]
        driver.release()
        time.sleep(2.5 * driver.run.config.wall_seconds_per_slot)  # the task failed; its retry comes later
        again = RunDriver.from_state(driver.env, json.loads(json.dumps(saved[-1])), saved.append)
        again.step(reattach=True)
    finally:
        (again or driver).release()
    carried = again.run.records[1:-1]
    assert carried and all(r.plan is None and r.applied == {"spot": {}, "on_demand": 0} for r in carried)
    assert again.run.records[-1].forecast is not None  # the current slot is decided and launched again


def test_slots_that_pass_after_a_failed_try_are_carried_idle_though_the_failed_instance_stays_failed(tmp_path):
    """A failed try releases every instance, but the one that failed keeps its state (its result wins over
    the release): the retry's carried slots still ran nothing (they were billed as running before)."""
    saved: list[dict[str, Any]] = []
    driver = make_driver(tmp_path, saved, samples=600, step_s=0.2)
    worker = tmp_path / "worker.json"
    worker.write_text(json.dumps({**json.loads(worker.read_text()), "fail_rank": 0, "fail_after_steps": 3}))
    again = None
    try:
        driver.step()
        assert driver.run.records[0].applied["spot"] or driver.run.records[0].applied["on_demand"]
        with pytest.raises(TrainingFailedError):
            for _ in range(100):
                time.sleep(0.1)
                driver.step()
        states = {i.state for i in driver.env.backend.status(driver.training).instances}
        assert InstanceState.FAILED in states and not states & {InstanceState.PENDING, InstanceState.RUNNING}
        time.sleep(2.5 * driver.run.config.wall_seconds_per_slot)  # the retry comes later
        again = RunDriver.from_state(driver.env, json.loads(json.dumps(saved[-1])), saved.append)
        before = len(again.run.records)
        again.step(reattach=True)
    finally:
        (again or driver).release()
    carried = [r for r in again.run.records[before:] if r.forecast is None]
    assert carried and all(r.applied == {"spot": {}, "on_demand": 0} for r in carried)


@pytest.mark.parametrize(
    ("states", "released"),
    [
        ((), True),
        ((InstanceState.RELEASED, InstanceState.RELEASED), True),
        ((InstanceState.FAILED, InstanceState.RELEASED), True),  # a failed try
        ((InstanceState.FAILED,), True),
        ((InstanceState.PREEMPTED, InstanceState.RELEASED), True),  # a kill after an earlier preemption
        ((InstanceState.PREEMPTED, InstanceState.PREEMPTED), False),  # taken back while nobody stepped: they ran
        ((InstanceState.RUNNING, InstanceState.RELEASED), False),  # a scale-down; the rest runs on
        ((InstanceState.PENDING, InstanceState.FAILED), False),
    ],
)
def test_a_job_counts_as_released_when_nothing_is_live_and_it_was_ended_for_it(states, released):
    status = JobStatus("j", tuple(InstanceStatus(f"i{n}", POOLS[0], state) for n, state in enumerate(states)))
    assert _released(status) is released


class RecordingBackend(ComputeBackend):
    """Runs each target at once, on demand and spot alike, and records every target it was sent."""

    name = "recording"

    def __init__(self) -> None:
        self.targets: list[Allocation] = []
        self.instances: list[InstanceStatus] = []

    def reconcile(self, job: TrainingJob, target: Allocation) -> JobStatus:
        self.targets.append(target)
        self.instances = [InstanceStatus(f"{p}-{k}", p, InstanceState.RUNNING) for p, n in zip(job.pools, target.spot)
                          for k in range(n)]
        self.instances += [InstanceStatus(f"od-{k}", ON_DEMAND, InstanceState.RUNNING) for k in range(target.on_demand)]
        return self.status(job)

    def status(self, job: TrainingJob) -> JobStatus:
        return JobStatus(job.job_id, tuple(self.instances))

    def release(self, job: TrainingJob) -> None:
        self.instances = [replace(i, state=InstanceState.RELEASED) for i in self.instances]


@pytest.mark.parametrize("reattach", [False, True])
@pytest.mark.parametrize("released", [False, True])
def test_a_decision_stored_for_a_slot_that_is_over_is_billed_as_what_ran_not_launched(tmp_path, reattach, released):
    """The caller died after slot 1's decision was stored and before the backend acted; the next
    step comes in slot 4. Slot 1 ran on slot 0's allocation (nothing after a release), as did slots
    2 and 3; nothing is launched for slot 1, only slot 4's decision."""
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    rows = ["timestamp,market,spot_price,available,on_demand_price"]
    rows += [f"{t0 + timedelta(hours=h):%Y-%m-%dT%H:%M:%SZ},A,1.0,4,4.0" for h in range(60)]
    (tmp_path / "flat.csv").write_text("\n".join(rows) + "\n")
    feed = ReplayedMarket(load_trace(tmp_path / "flat.csv"), 1.0, 4)
    backend = RecordingBackend()
    env = SpotEnvironment(backend=backend, market=feed, seconds_per_slot=100.0)
    job = Job(work=150, deadline_hours=20, max_instances=2, throughput=Throughput(5.0), value=5000)
    config = RunConfig("undelivered", job, ("A",), policy="greedy", seconds_per_slot=100.0)
    saved: list[dict[str, Any]] = []
    driver = RunDriver.start(env, config, lambda uri: ["true"], str(tmp_path / "checkpoint"), saved.append)
    driver.step()
    assert backend.targets == [Allocation((2,), 0)], "slot 0 runs 2 spot instances"
    run, slot_1 = driver.run, driver.run.started + timedelta(seconds=150)
    run.observe(*feed.row(1, config.pools, slot_1))
    run.decide(0.0, slot_1).allocation = {"spot": {}, "on_demand": 2}  # stored, never delivered
    if released:
        driver.release()  # the failed try released every instance
    again = RunDriver.from_state(env, json.loads(json.dumps(driver.to_state())), saved.append)
    again.run.started = datetime.now(timezone.utc) - timedelta(seconds=450)  # the next step comes in slot 4
    again.step(reattach=reattach)

    records = again.run.records
    assert [r.slot for r in records] == [0, 1, 2, 3, 4] and records[1].allocation == {"spot": {}, "on_demand": 2}
    ran = {"spot": {}, "on_demand": 0} if released else {"spot": {"A": 2}, "on_demand": 0}
    assert [r.applied for r in records[1:4]] == [ran] * 3
    assert records[4].cost_so_far - records[1].cost_so_far == (0.0 if released else 6.0)  # 2 spot at 1.00 USD/h
    assert backend.targets == [Allocation((2,), 0), Allocation((2,), 0)], "only slot 4's decision is launched"
    assert records[4].forecast is not None and records[4].applied == {"spot": {"A": 2}, "on_demand": 0}


def test_the_core_driver_imports_without_airflow():
    code = (
        "import sys; import airflow_provider_spotsched.execution.driver, airflow_provider_spotsched.cli; "
        "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_finished_is_returned_once_the_job_is_done(tmp_path):
    saved: list[dict[str, Any]] = []
    driver = make_driver(tmp_path, saved)
    run = driver.run_to_completion(poll_interval=0.1)
    assert isinstance(driver.step(), Finished), "a finished run stays finished"
    assert driver.run.result() == run.result()


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path):
    yield
    assert not marked(str(tmp_path / "local" / "jobs" / "driver-test"))
