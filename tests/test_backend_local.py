"""The local backend: worker processes under a detached supervisor, on a replayed spot market.

The workers are ``tests/fake_worker.py`` (the runtime's contract in stdlib Python), so each test
takes a few seconds; one end-to-end test runs the real runtime. Waits poll with generous
timeouts; nothing here asserts on timing. Every test that launches ends by releasing its job and
checking that no process carrying the job's marker is left.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    InstanceState,
    InsufficientCapacityError,
    JobStatus,
    TrainingJob,
)
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_processes import JOBDIR_MARKER, create_time, is_alive, marked, signal_group
from airflow_provider_spotsched.backends.local_supervisor import Supervisor, SupervisorStopped
from airflow_provider_spotsched.backends.market_clock import AWS_NOTICE_SECONDS, MarketClock
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation
from tests.markets import make_market

FAKE = (sys.executable, str(Path(__file__).with_name("fake_worker.py")))
RUNTIME = (sys.executable, "-m", "airflow_provider_spotsched.runtime")
RUNNING, PENDING = InstanceState.RUNNING, InstanceState.PENDING
WAIT_S = 30.0


def market(rows: list[list[int]]) -> SlotMarket:
    """Pools pool-0, pool-1 with the given available counts per slot (prices do not matter here)."""
    return make_market([[1.0] * len(rows[0])] * len(rows), rows)


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Harness:
    """One job on one backend in ``tmp_path``, with readers for the workers' logs."""

    def __init__(
        self,
        tmp_path: Path,
        rows: list[list[int]],
        seconds_per_slot: float = 60.0,
        worker: tuple[str, ...] = FAKE,
        notice_seconds: float = 0.5,
        stop_timeout_s: float = 10.0,
        **config: object,
    ) -> None:
        self.tmp_path = tmp_path
        self.notice_seconds = notice_seconds
        self.stop_timeout_s = stop_timeout_s
        self.outcomes: list[LaunchOutcome] = []
        self.checkpoint = tmp_path / "ckpt"
        config_file = tmp_path / "config.json"
        defaults = {"samples": 100000, "step_s": 0.05} if worker == FAKE else {}
        config_file.write_text(json.dumps({**defaults, **config}))
        self.job = TrainingJob(
            job_id=f"job-{tmp_path.name}",
            command=(*worker, "--config", str(config_file), "--checkpoint-uri", str(self.checkpoint)),
            checkpoint_uri=str(self.checkpoint),
            pools=("pool-0", "pool-1"),
        )
        self.backend = self.new_backend(rows, seconds_per_slot)

    def new_backend(self, rows: list[list[int]], seconds_per_slot: float = 60.0) -> LocalBackend:
        return LocalBackend(
            self.tmp_path / "work",
            market=market(rows),
            seconds_per_slot=seconds_per_slot,
            notice_seconds=self.notice_seconds,
            launch_recorder=self.outcomes.append,
            stop_timeout_s=self.stop_timeout_s,
            poll_interval_s=0.05,
        )

    @property
    def jobdir(self) -> str:
        return str(self.backend.jobdir(self.job).path)

    def status(self) -> JobStatus:
        return self.backend.status(self.job)

    def states(self) -> dict[str, InstanceState]:
        return {i.instance_id: i.state for i in self.status().instances}

    def wait_running(self, count: int) -> JobStatus:
        def settled() -> bool:
            status = self.status()
            return status.count(RUNNING) == count and status.count(PENDING) == 0

        wait_for(f"{count} running workers", settled)
        wait_for("each worker's start line", lambda: len(self.started(self.running_ids())) == count)
        return self.status()

    def running_ids(self) -> list[str]:
        return [i.instance_id for i in self.status().instances if i.state is RUNNING]

    def events(self, instance_id: str) -> list[dict]:
        """Every JSON line the instance's workers printed, generation by generation."""
        logs = Path(self.jobdir, "logs").glob(f"{instance_id}.g*.out")
        logs = sorted(logs, key=lambda p: int(p.name.split(".g")[1].removesuffix(".out")))
        return [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.strip()]

    def started(self, instance_ids: list[str]) -> list[dict]:
        """The start line of each instance's current worker."""
        records = {r["instance_id"]: r for r in json.loads(Path(self.jobdir, "state.json").read_text())["instances"]}
        lines = []
        for instance_id in instance_ids:
            pid = records[instance_id]["pid"]
            lines += [e for e in self.events(instance_id) if e["event"] == "started" and e["pid"] == pid]
        return lines

    def pids(self) -> set[int]:
        state = json.loads(Path(self.jobdir, "state.json").read_text())
        return {r["pid"] for r in state["instances"] if r["pid"] is not None}

    def supervisor(self) -> dict:
        return json.loads(Path(self.jobdir, "state.json").read_text())["supervisor"]

    def assert_nothing_left(self) -> None:
        wait_for("every process of the job to end", lambda: not marked(self.jobdir), timeout=15.0)


@pytest.fixture
def make_harness(tmp_path):
    made: list[Harness] = []

    def make(rows: list[list[int]], seconds_per_slot: float = 60.0, **options: object) -> Harness:
        made.append(Harness(tmp_path, rows, seconds_per_slot, **options))
        return made[-1]

    yield make
    for harness in made:
        harness.backend.release(harness.job)
        harness.assert_nothing_left()


def test_reconcile_launches_the_target_and_the_same_call_twice_launches_nothing(make_harness):
    h = make_harness([[4, 4]])
    status = h.backend.reconcile(h.job, Allocation((1, 0), 1))
    assert sorted(i.pool for i in status.instances) == [ON_DEMAND, "pool-0"]
    assert all(i.state in (PENDING, RUNNING) for i in status.instances)
    status = h.wait_running(2)
    assert status.active(h.job.pools) == Allocation((1, 0), 1)
    assert sorted((e["rank"], e["world_size"]) for e in h.started(h.running_ids())) == [(0, 2), (1, 2)]
    pids, supervisor = h.pids(), h.supervisor()
    again = h.backend.reconcile(h.job, Allocation((1, 0), 1))
    assert [i.instance_id for i in again.instances] == [i.instance_id for i in status.instances]
    time.sleep(0.5)  # several supervisor ticks: nothing may restart
    assert h.pids() == pids and h.supervisor() == supervisor
    assert [o.reason for o in h.outcomes] == [""]  # one launch request, fully served


def test_scaling_up_and_down_restarts_every_worker_at_the_new_world_size(make_harness):
    h = make_harness([[4, 4]])
    h.backend.reconcile(h.job, Allocation((1, 0), 0))
    (first,) = h.wait_running(1).instances
    assert h.started([first.instance_id])[0]["world_size"] == 1
    assert h.started([first.instance_id])[0]["master_port"] is None  # one worker: no process group
    wait_for("a first checkpoint", lambda: (h.checkpoint / "progress.json").exists())

    h.backend.reconcile(h.job, Allocation((1, 1), 0))
    h.wait_running(2)
    assert sorted(e["world_size"] for e in h.started(h.running_ids())) == [2, 2]
    assert len({e["master_port"] for e in h.started(h.running_ids())}) == 1
    first_events = [e["event"] for e in h.events(first.instance_id)]
    assert first_events[:3] == ["started", "preempted", "started"]  # SIGTERM, checkpoint, restart
    assert h.started([first.instance_id])[0]["samples_done"] > 0  # resumed from the checkpoint

    status = h.backend.reconcile(h.job, Allocation((0, 1), 0))
    assert status.count(InstanceState.RELEASED) == 0  # released once its worker has stopped
    wait_for("the scaled-down instance to be released", lambda: h.status().count(InstanceState.RELEASED) == 1)
    status = h.wait_running(1)
    assert status.active(h.job.pools) == Allocation((0, 1), 0)
    assert [e["world_size"] for e in h.started(h.running_ids())] == [1]


def test_moving_instances_between_pools_replaces_them(make_harness):
    h = make_harness([[4, 4]])
    h.backend.reconcile(h.job, Allocation((1, 0), 0))
    (before,) = h.wait_running(1).instances
    h.backend.reconcile(h.job, Allocation((0, 1), 0))
    wait_for("the pool-0 instance to be released", lambda: h.states()[before.instance_id] is InstanceState.RELEASED)
    status = h.wait_running(1)
    assert status.active(h.job.pools) == Allocation((0, 1), 0)


def test_a_market_drop_gives_notice_then_sigterm_and_the_survivor_restarts(make_harness):
    # pool-0 offers 2 workers for 3 slots (6 s: time to start both), then 1: one of the two is preempted
    h = make_harness([[2, 0]] * 3 + [[1, 0]], seconds_per_slot=2.0)
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    h.wait_running(2)
    wait_for("a preemption", lambda: h.status().preemptions == 1)
    (victim,) = [i for i in h.status().instances if i.state is InstanceState.PREEMPTED]
    assert "spot capacity of pool-0 fell to 1" in victim.detail
    events = [e["event"] for e in h.events(victim.instance_id)]
    assert events.index("notice") < events.index("preempted")  # notice first, SIGTERM after it
    status = h.wait_running(1)
    (survivor,) = h.started(h.running_ids())
    assert survivor["world_size"] == 1 and survivor["rank"] == 0
    assert status.active(h.job.pools) == Allocation((1, 0), 0)
    # the backend does not scale back up by itself, and a new launch is capped by the market
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    assert h.outcomes[-1] == LaunchOutcome(h.outcomes[-1].time, "pool-0", 1, 0, "InsufficientCapacity")
    assert h.status().active(h.job.pools) == Allocation((1, 0), 0)


def test_a_worker_that_leaves_on_notice_is_preempted_too(make_harness):
    # a notice period far longer than a loaded machine needs to react, so the worker leaves first
    h = make_harness([[2, 0]] * 3 + [[0, 0]], seconds_per_slot=2.0, exit_on_notice=True, notice_seconds=15.0)
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    h.wait_running(2)
    wait_for("both preempted", lambda: h.status().preemptions == 2)
    assert all(any(e.get("cause") == "notice" for e in h.events(i)) for i in h.states())
    wait_for("the supervisor to exit", lambda: not h.backend.supervisor_running(h.job))


def test_a_drop_the_scheduler_moves_away_from_before_the_supervisor_looks_is_still_a_preemption(make_harness):
    """The supervisor is held stopped while pool-0 loses its capacity, so the scheduler's move to
    pool-1 reaches the backend before the market's drop does (the race a loaded machine can lose
    either way): the pool-0 instance is still preempted by the market, not released by the move."""
    h = make_harness([[1, 1]] * 3 + [[0, 1]], seconds_per_slot=2.0)
    h.backend.reconcile(h.job, Allocation((1, 0), 0))
    (before,) = h.wait_running(1).instances
    jobdir = h.backend.jobdir(h.job)
    clock = MarketClock.from_dict(json.loads(jobdir.clock_file.read_text()))
    supervisor = h.supervisor()["pid"]
    with jobdir.lock():  # so that it is not stopped holding the job's lock
        os.kill(supervisor, signal.SIGSTOP)
    try:
        wait_for("pool-0's drop", lambda: clock.slot(time.time()) >= 3)
        h.backend.reconcile(h.job, Allocation((0, 1), 0))
    finally:
        os.kill(supervisor, signal.SIGCONT)
    wait_for("the pool-0 instance to end", lambda: h.states()[before.instance_id] not in (RUNNING, PENDING))
    (ended,) = [i for i in h.status().instances if i.instance_id == before.instance_id]
    assert ended.state is InstanceState.PREEMPTED
    assert "spot capacity of pool-0 fell to 0" in ended.detail
    assert h.wait_running(1).active(h.job.pools) == Allocation((0, 1), 0)


def test_insufficient_capacity_launches_what_it_can_and_is_recorded(make_harness):
    h = make_harness([[1, 0]])
    status = h.backend.reconcile(h.job, Allocation((3, 0), 0))
    assert status.active(h.job.pools) == Allocation((1, 0), 0)
    (outcome,) = h.outcomes
    assert outcome == LaunchOutcome(outcome.time, "pool-0", 3, 1, "InsufficientCapacity")
    h.wait_running(1)


def test_insufficient_capacity_with_nothing_started_raises(make_harness):
    h = make_harness([[1, 0]])
    with pytest.raises(InsufficientCapacityError, match="pool 'pool-1': asked for 2 instance\\(s\\), got 0"):
        h.backend.reconcile(h.job, Allocation((0, 2), 0))
    assert [(o.pool, o.requested, o.launched) for o in h.outcomes] == [("pool-1", 2, 0)]
    assert h.status().instances == ()


def test_a_second_backend_object_re_attaches_instead_of_launching_again(make_harness):
    h = make_harness([[2, 2]])
    h.backend.reconcile(h.job, Allocation((1, 1), 0))
    status = h.wait_running(2)
    pids, supervisor = h.pids(), h.supervisor()
    retried = h.new_backend([[0, 0]])  # a retried task: new object, and its market is ignored
    again = retried.reconcile(h.job, Allocation((1, 1), 0))
    assert [i.instance_id for i in again.instances] == [i.instance_id for i in status.instances]
    assert again.active(h.job.pools) == Allocation((1, 1), 0)
    time.sleep(0.5)
    assert h.pids() == pids and h.supervisor() == supervisor


def test_a_killed_supervisor_is_reported_and_replaced_by_reconcile(make_harness):
    h = make_harness([[2, 2]])
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    h.wait_running(2)
    old_pids, old_supervisor = h.pids(), h.supervisor()["pid"]
    os.kill(old_supervisor, signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not h.backend.supervisor_running(h.job))
    assert all("is not running: reconcile() restarts it" in i.detail for i in h.status().instances)
    assert all(alive(p) for p in old_pids)  # the workers outlive their supervisor

    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    assert h.supervisor()["pid"] != old_supervisor
    wait_for("the old workers to be replaced", lambda: h.status().count(RUNNING) == 2 and not (h.pids() & old_pids))
    status = h.wait_running(2)
    assert len(status.instances) == 2  # the same instances, adopted, not new ones
    assert sorted(e["world_size"] for e in h.started(h.running_ids())) == [2, 2]


def test_a_worker_no_record_knows_is_ended_when_a_new_supervisor_takes_over(make_harness):
    """A supervisor killed between starting a worker and recording it leaves that worker running
    unseen (here: a process with the job's marker that no record names); the next supervisor
    ends it instead of training a second worker beside it."""
    h = make_harness([[2, 2]])
    h.backend.reconcile(h.job, Allocation((1, 0), 0))
    h.wait_running(1)
    os.kill(h.supervisor()["pid"], signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not h.backend.supervisor_running(h.job))
    hidden = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                              env={**os.environ, JOBDIR_MARKER: h.jobdir})
    try:
        h.backend.reconcile(h.job, Allocation((1, 0), 0))
        wait_for("the unrecorded worker to be ended", lambda: hidden.poll() is not None)
        h.wait_running(1)
        assert hidden.pid not in {p.pid for p in marked(h.jobdir)}
    finally:
        hidden.kill()
        hidden.wait()


def test_a_left_behind_child_that_leads_no_process_group_is_still_signalled():
    """A worker's child outlives the worker (its parent was killed): it is in the dead leader's
    group, so a signal to its own group would miss it."""
    shell = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    wait_for("the shell's child", lambda: bool(psutil.Process(shell.pid).children()))
    (child,) = psutil.Process(shell.pid).children()
    shell.kill()
    shell.wait()
    assert os.getpgid(child.pid) != child.pid
    signal_group(child.pid, child.create_time(), signal.SIGTERM)
    gone, _ = psutil.wait_procs([child], timeout=10)
    assert gone


# A worker that is a shell wrapping the trainer: SIGTERM ends the shell at once, while its child, a
# trainer whose emergency checkpoint outlasts the stop timeout (here: it ignores SIGTERM), lives on.
STUBBORN_TRAINER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
WRAPPED = ("sh", "-c", f"{sys.executable} -c '{STUBBORN_TRAINER}'; exit 75")


def trainers(h: Harness) -> list[psutil.Process]:
    """The job's live stubborn trainers; one that exits while being listed is not one."""
    found = []
    for process in marked(h.jobdir):
        try:
            if STUBBORN_TRAINER in process.cmdline():
                found.append(process)
        except psutil.Error:  # exited (or a zombie) between the listing and this read
            continue
    return found


@pytest.mark.parametrize(("before", "after"), [((1, 0), (2, 0)), ((2, 0), (1, 0))], ids=["scale-up", "scale-down"])
def test_a_wrapped_trainer_that_outlives_its_shell_is_killed_before_the_new_set_starts(make_harness, before, after):
    """The worker process exits before its child: the instance's processes are still ours (by their
    marker), get SIGKILL after stop_timeout_s, and the new worker set waits for them."""
    h = make_harness([[4, 4]], worker=WRAPPED, stop_timeout_s=1.0)
    h.backend.reconcile(h.job, Allocation(before, 0))
    wait_for("the first trainers", lambda: len(trainers(h)) == sum(before))
    old = trainers(h)
    h.backend.reconcile(h.job, Allocation(after, 0))
    wait_for("the new trainers", lambda: len(trainers(h)) == sum(after) and not set(trainers(h)) & set(old))
    assert not [p for p in old if alive(p.pid)]

    def read_events() -> list[dict]:
        return [json.loads(line) for line in Path(h.jobdir, "events.jsonl").read_text().splitlines()]

    # the supervisor logs a launch just after starting the worker, which a loaded machine can show first
    wait_for("the new set's launch events", lambda: [e["event"] for e in read_events()].count("launched") == sum(before) + sum(after))
    events = read_events()
    kinds = [e["event"] for e in events]
    relaunch = max(i for i, kind in enumerate(kinds) if kind == "launched")
    assert "sigkill" in kinds[:relaunch]  # the old trainers were killed, and before the new set started
    assert not [e for e in events[relaunch:] if e["event"] == "sigkill"]


def test_a_supervisor_told_to_stop_kills_a_trainer_that_outlives_its_shell(make_harness):
    h = make_harness([[2, 2]], worker=WRAPPED, stop_timeout_s=1.0)
    h.backend.reconcile(h.job, Allocation((1, 0), 0))
    wait_for("the trainer", lambda: len(trainers(h)) == 1)
    (trainer,) = trainers(h)
    supervisor = psutil.Process(h.supervisor()["pid"])
    supervisor.terminate()
    supervisor.wait(WAIT_S)
    assert not alive(trainer.pid)
    assert h.status().count(PENDING) == 1  # restartable


def test_a_stop_that_comes_while_the_supervisor_holds_the_jobs_lock_waits_until_it_is_released(make_harness):
    """Raised inside the lock (CI once saw it in the lock's own exit), the stop left the lock held
    by a file its traceback kept open, and the abort, taking the lock again, waited on itself for
    ever: the supervisor hung and the test that stopped it with it."""
    h = make_harness([[1, 1]])
    h.backend.reconcile(h.job, Allocation((0, 0), 0))  # the job's directory, no supervisor
    jobdir = h.backend.jobdir(h.job)
    supervisor = Supervisor(jobdir, poll_s=0.05, stop_timeout_s=1.0)
    with pytest.raises(SupervisorStopped, match="signal 15"):
        with supervisor._locked():
            supervisor.stop(signal.SIGTERM, None)  # the handler, as the signal would call it
            inside = True
    assert inside
    with open(jobdir.lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises BlockingIOError if still held
    with pytest.raises(SupervisorStopped):
        supervisor.stop(signal.SIGTERM, None)  # not holding it: at once


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shifts psutil's Linux boot time")
@pytest.mark.parametrize("step", [1.0, 30.0, -3600.0])
def test_a_process_stays_ours_when_the_wall_clock_is_stepped(monkeypatch, step):
    """psutil adds the boot time to a create time, and a step of the wall clock (NTP, a VM's clock
    catching up after a pause) moves it by the step: a live supervisor read as gone would get a
    second one beside it, which would end the live workers as strays."""
    started = create_time(os.getpid())
    wall = psutil.Process(os.getpid()).create_time()  # what a record written before held
    boot_time = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time() + step)
    assert is_alive(os.getpid(), started) and create_time(os.getpid()) == pytest.approx(started)
    assert not is_alive(os.getpid(), started - 60.0)  # a recycled pid: another process
    monkeypatch.setattr(psutil._pslinux, "boot_time", boot_time)
    assert is_alive(os.getpid(), wall)


def test_a_supervisor_told_to_stop_ends_its_workers_and_reconcile_resumes_them(make_harness):
    h = make_harness([[2, 2]])
    h.backend.reconcile(h.job, Allocation((1, 0), 1))
    h.wait_running(2)
    pids = h.pids()
    os.kill(h.supervisor()["pid"], signal.SIGTERM)
    wait_for("the supervisor to stop", lambda: not h.backend.supervisor_running(h.job))
    assert not [pid for pid in pids if alive(pid)]
    status = h.status()
    assert status.count(PENDING) == 2  # still wanted: restartable
    assert all("SupervisorStopped" in i.detail and "reconcile() restarts it" in i.detail for i in status.instances)
    h.backend.reconcile(h.job, Allocation((1, 0), 1))
    h.wait_running(2)
    assert not h.pids() & pids


def test_release_after_a_crash_ends_every_worker_and_can_repeat(make_harness):
    h = make_harness([[2, 2]])
    h.backend.reconcile(h.job, Allocation((1, 1), 1))
    h.wait_running(3)
    progress = h.checkpoint / "progress.json"
    wait_for("a first checkpoint", lambda: progress.exists() and json.loads(progress.read_text())["samples_done"] > 0)
    pids = h.pids()
    os.kill(h.supervisor()["pid"], signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not h.backend.supervisor_running(h.job))
    h.backend.release(h.job)
    assert not [pid for pid in pids if alive(pid)]
    assert {i.state for i in h.status().instances} == {InstanceState.RELEASED}
    h.assert_nothing_left()
    h.backend.release(h.job)
    assert {i.state for i in h.status().instances} == {InstanceState.RELEASED}
    assert json.loads((h.checkpoint / "progress.json").read_text())["samples_done"] > 0  # checkpoint kept


def test_release_of_a_running_job_and_of_a_job_never_launched(make_harness):
    h = make_harness([[2, 2]])
    h.backend.release(h.job)  # never launched: nothing to do
    assert h.status().instances == ()
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    h.wait_running(2)
    h.backend.release(h.job)
    assert {i.state for i in h.status().instances} == {InstanceState.RELEASED}
    assert not h.backend.supervisor_running(h.job)
    h.assert_nothing_left()


def test_a_failing_worker_fails_the_job_with_its_stderr(make_harness):
    h = make_harness([[2, 2]], fail_rank=1, fail_after_steps=3)
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    wait_for("the failure", lambda: h.status().failed)
    (failed,) = [i for i in h.status().instances if i.state is InstanceState.FAILED]
    assert "exit code 3" in failed.detail and "simulated crash at step 3" in failed.detail
    wait_for("the peer to be ended", lambda: h.status().count(InstanceState.RELEASED) == 1)
    wait_for("the supervisor to exit", lambda: not h.backend.supervisor_running(h.job))
    h.assert_nothing_left()


def test_a_finished_job_ends_everything_and_reconcile_launches_nothing_more(make_harness):
    h = make_harness([[2, 2]], samples=40, step_s=0.02)
    h.backend.reconcile(h.job, Allocation((1, 1), 0))
    wait_for("the job to finish", lambda: h.status().finished)
    wait_for("the supervisor to exit", lambda: not h.backend.supervisor_running(h.job))
    # rank 0 finished; a peer that had not exited yet by then is ended (released), never left running
    states = [i.state for i in h.status().instances]
    assert InstanceState.FINISHED in states and set(states) <= {InstanceState.FINISHED, InstanceState.RELEASED}
    assert (h.checkpoint / "final" / "adapter.txt").read_text() == "40 samples\n"
    h.assert_nothing_left()
    status = h.backend.reconcile(h.job, Allocation((1, 1), 0))
    assert len(status.instances) == 2 and status.finished
    assert not h.backend.supervisor_running(h.job)


def test_bad_targets_and_changed_jobs_are_refused(make_harness):
    h = make_harness([[1, 1]])
    with pytest.raises(ValueError, match="one count >= 0 per pool"):
        h.backend.reconcile(h.job, Allocation((1,), 0))
    with pytest.raises(ValueError, match="one count >= 0 per pool"):
        h.backend.reconcile(h.job, Allocation((1, -1), 0))
    h.backend.reconcile(h.job, Allocation((0, 0), 0))
    other = TrainingJob(h.job.job_id, ("true",), h.job.checkpoint_uri, h.job.pools)
    with pytest.raises(BackendError, match=r"different \['command'\]"):
        h.backend.reconcile(other, Allocation((0, 0), 0))
    unknown = TrainingJob("other-pools", h.job.command, h.job.checkpoint_uri, ("pool-9",))
    with pytest.raises(ValueError, match=r"job.pools \['pool-9'\] are not in the replayed market"):
        h.backend.reconcile(unknown, Allocation((1,), 0))


@pytest.mark.e2e
def test_end_to_end_the_real_runtime_is_preempted_resumes_and_finishes(make_harness):
    # two workers in pool-0 until the market drops to one after 20 s; with a long notice the runtime
    # stops both workers itself (emergency checkpoint, exit 75) and the survivor resumes alone. On a
    # loaded machine the drop can come before training starts: then the survivor starts afresh alone.
    h = make_harness(
        [[2, 0]] * 10 + [[1, 0]],
        seconds_per_slot=2.0,
        worker=RUNTIME,
        notice_seconds=600.0,
        runtime="loop",  # two workers: the builtin loop (runtime "hf" is one process per job)
        samples=128,
        samples_per_second_per_worker=2.0,  # paced (32 s at two workers), so the drop at 20 s comes mid-training
        batch_size=4,
        seq_len=32,
        log_every_steps=1,
        checkpoint={"keep": 2, "min_interval_s": 0.2, "max_interval_s": 0.5},
    )
    h.backend.reconcile(h.job, Allocation((2, 0), 0))
    wait_for("the job to end", lambda: h.status().finished or h.status().failed, timeout=300)
    status = h.status()
    assert not status.failed, status
    (victim,) = [i for i in status.instances if i.state is InstanceState.PREEMPTED]
    (survivor,) = [i for i in status.instances if i.state is InstanceState.FINISHED]
    assert "spot capacity of pool-0 fell to 1" in victim.detail
    events = h.events(survivor.instance_id)
    kinds = [e["event"] for e in events]
    starts = [e for e in events if e["event"] in ("started", "resumed")]
    assert kinds[-1] == "done" and starts[-1]["world_size"] == 1  # the survivor finished alone
    if "preempted" in kinds:  # it was training at two when the drop came: it resumed from a checkpoint
        assert starts[0]["world_size"] == 2 and kinds.index("preempted") < kinds.index("resumed")
        resumed = events[kinds.index("resumed")]
        assert resumed["checkpoint"].startswith("ckpt-")
        # the survivor's last start read a checkpoint: a timed load, inside its run to the end
        assert starts[-1]["event"] == "resumed" and 0 < starts[-1]["load_s"] <= events[-1]["elapsed_s"]
    assert events[-1]["samples_done"] == 128
    assert (h.checkpoint / "final").is_dir() and list((h.checkpoint / "checkpoints").glob("ckpt-*"))
    wait_for("the supervisor to exit", lambda: not h.backend.supervisor_running(h.job))
    h.assert_nothing_left()


def test_the_market_clock_replays_slots_on_wall_time():
    clock = MarketClock.replay(market([[3, 0], [1, 2]]), seconds_per_slot=2.0, start=1000.0)
    assert [clock.slot(t) for t in (900.0, 1000.0, 1001.9, 1002.0, 1e9)] == [0, 0, 0, 1, 1]
    assert [clock.capacity("pool-0", t) for t in (1000.0, 1003.0)] == [3, 1]
    assert [clock.seconds_to_next_slot(t) for t in (900.0, 1000.0, 1001.5, 1002.0)] == [100.0, 2.0, 0.5, 2.0]
    assert clock.notice_seconds == pytest.approx(AWS_NOTICE_SECONDS / 1800)  # 1 h slots in 2 s
    assert MarketClock.from_dict(clock.to_dict()) == clock
    with pytest.raises(ValueError, match="pool 'nope' is not in the replayed market"):
        clock.capacity("nope")
    with pytest.raises(ValueError, match="seconds_per_slot must be > 0"):
        MarketClock.replay(market([[1, 1]]), seconds_per_slot=0)
    assert np.array_equal(np.asarray(clock.available), [[3, 0], [1, 2]])


def test_a_workdir_with_a_hash_or_question_mark_still_gets_its_notice_file(tmp_path):
    """The notice file's URI is percent-encoded: the runtime would read ``file:///x/exp#1?v=2/...`` as
    ``/x/exp`` (the fragment and query cut off), a folder that may exist: a notice at once."""
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp#1?v=2" / "run").mkdir(parents=True)
    probe = ("import json, os; from airflow_provider_spotsched.runtime.preemption import NoticeSource; "
             "source = NoticeSource.from_env(os.environ); print(json.dumps([source.location, source.poll()]))")
    h = Harness(tmp_path / "exp#1?v=2" / "run", [[1, 1]], worker=(sys.executable, "-c", probe))
    try:
        h.backend.reconcile(h.job, Allocation((1, 0), 0))
        wait_for("the job to finish", lambda: h.status().count(InstanceState.FINISHED) == 1)
        (out,) = Path(h.jobdir, "logs").glob("local-0000.g*.out")
        location, notice = json.loads(out.read_text())
        assert location == str(Path(h.jobdir, "notices", out.name.removesuffix(".out")))
        assert notice is None
    finally:
        h.backend.release(h.job)
        h.assert_nothing_left()


def test_a_single_worker_gets_no_process_group_variables(make_harness, tmp_path, monkeypatch):
    # LOCAL_RANK without MASTER_ADDR makes a transformers Trainer script expect a process group and fail
    for name, value in (("LOCAL_RANK", "3"), ("MASTER_ADDR", "10.0.0.9"), ("MASTER_PORT", "1234")):
        monkeypatch.setenv(name, value)  # stale values the supervisor would otherwise pass on
    h = make_harness([[1, 1]])
    dump = tmp_path / "env.json"
    script = f"import json, os; json.dump(dict(os.environ), open({str(dump)!r}, 'w'))"
    job = TrainingJob(f"{h.job.job_id}-env", (sys.executable, "-c", script), h.job.checkpoint_uri, h.job.pools)
    try:
        h.backend.reconcile(job, Allocation((1, 0), 0))
        wait_for("the worker's environment", lambda: dump.is_file() and dump.stat().st_size > 0)
        wait_for("the job to end", lambda: h.backend.status(job).finished)
    finally:
        h.backend.release(job)
    env = json.loads(dump.read_text())
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "1")
    assert not {"LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(env)
