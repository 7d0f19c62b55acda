"""The detached process that owns one local job's workers while its caller is away.

The caller of the local backend defers between slots, so someone else must keep the workers and
the market replay alive: one supervisor per job, started by ``reconcile`` as a daemon (double
fork, own session) and driven only by the job directory (:mod:`.local_jobdir`). It ticks every
``poll_s`` and at every slot boundary of the replayed market (so a capacity drop lands as its
slot starts, as on a cloud, not up to a poll later, when the scheduler may already have moved
away from it). Every tick it

1. reaps exited workers: exit 0 on rank 0 finishes the job; exit 75 after our SIGTERM is a clean
   stop (PREEMPTED or RELEASED by its stop reason, else a restart); anything else is FAILED with
   the stderr tail, and the other workers are ended. A worker is gone only when every process
   marked as its instance is (a shell wrapper or a launcher may exit before its children);
2. applies the market: in a pool whose availability dropped below its live spot workers, the
   excess get a notice (their notice file appears), SIGTERM once the notice period is over, and
   the wanted worker set shrinks by them (the backend never scales back up on its own: the
   scheduler re-decides at its next slot);
3. when the wanted worker set differs from the running one, SIGTERMs every worker (each saves an
   emergency checkpoint and exits 75; SIGKILL after ``stop_timeout_s``, to its children too) and,
   once all of them and their children are gone, starts the new set with ranks 0..n-1 on a fresh
   rendezvous port, resuming from the checkpoint.

A worker found running without a process handle was started by a supervisor that died: it is
stopped the same way and restarted under this one (its exit code cannot be known otherwise).
The supervisor exits when no instance is wanted and no worker runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from airflow_provider_spotsched.backends.base import ON_DEMAND, InstanceState, TrainingJob
from airflow_provider_spotsched.backends.local_jobdir import JobDir, JobState, WorkerRecord, read_json, tail
from airflow_provider_spotsched.backends.local_processes import (
    INSTANCE_MARKER,
    JOB_ID_MARKER,
    JOBDIR_MARKER,
    create_time,
    end_all,
    free_port,
    is_alive,
    marked,
    signal_group,
)
from airflow_provider_spotsched.backends.market_clock import MarketClock
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED

BOUNDARY_MARGIN_S = 0.002  # wake this far past a slot boundary, so that the clock reads the new slot
STOP_STATES = {"preempted": InstanceState.PREEMPTED, "released": InstanceState.RELEASED}


def preempt_beyond_capacity(jobdir: JobDir, state: JobState, clock: MarketClock, now: float) -> None:
    """The market's preemption: the spot workers beyond their pool's availability at ``now`` are
    marked preempted, a running one with a notice (SIGTERM follows once it is over).

    The supervisor applies it at every tick and slot boundary, and the backend's ``reconcile``
    before it changes the worker set: a capacity drop that the scheduler moves away from in the
    same slot is a preemption, as on a cloud, whichever of the two processes looks first.
    """
    for pool in {r.pool for r in state.live() if r.pool != ON_DEMAND}:
        live = state.live(pool)
        capacity = clock.capacity(pool, now)
        excess = len(live) - capacity
        # workers not started yet go first (no notice needed), then the highest ranks
        waiting = [r for r in live if r.pid is None]
        running = sorted((r for r in live if r.pid is not None), key=lambda r: -(r.rank or 0))
        victims = waiting + running
        for record in victims[: max(excess, 0)]:
            record.stop_reason = "preempted"
            record.detail = f"spot capacity of {pool} fell to {capacity} at slot {clock.slot(now)}"
            if record.pid is None:
                state.generation += 1
                continue
            record.notice_at, record.term_at = now, now + clock.notice_seconds
            jobdir.notice_file(record, record.generation).touch()
            jobdir.log_event("notice", record, slot=clock.slot(now))


class SupervisorStopped(Exception):
    """The supervisor was told to stop (SIGTERM): it ends its workers, which stay restartable."""


class Supervisor:
    """Runs the tick loop of the module docstring for the job in ``jobdir``."""

    def __init__(self, jobdir: JobDir, poll_s: float, stop_timeout_s: float) -> None:
        self.jobdir = jobdir
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.job = TrainingJob.from_dict(read_json(jobdir.job_file))
        self.clock = MarketClock.from_dict(read_json(jobdir.clock_file))
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._holding_lock = False
        self._stop_signal: int | None = None  # a SIGTERM that came while the job's lock was held

    def stop(self, signum: int, frame: object) -> None:
        """The SIGTERM handler: stop at once, or as soon as the job's lock is released."""
        if self._holding_lock:
            self._stop_signal = signum
            return
        raise SupervisorStopped(f"supervisor received signal {signum}")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The job's lock, with a stop deferred while it is held. Raised inside, even in the lock's
        own exit, the stop would leave the lock on a file that the exception's traceback keeps
        open, and :meth:`abort`, which takes the lock again, would wait on itself for ever."""
        self._holding_lock = True
        try:
            with self.jobdir.lock():
                yield
        finally:
            self._holding_lock = False
        if self._stop_signal is not None:
            raise SupervisorStopped(f"supervisor received signal {self._stop_signal}")

    def run(self) -> None:
        adopted = False
        try:
            self.end_strays()
            while True:
                with self._locked():
                    state = self.jobdir.load()
                    if state is None or state.supervisor.get("pid") != os.getpid():
                        return  # a newer supervisor took over (this one was given up for dead)
                    if not adopted:
                        state.running_generation = -1  # nothing runs under this supervisor yet
                        adopted = True
                    done = self.tick(state, time.time())
                    if done:
                        state.supervisor["exited"] = True
                    self.jobdir.save(state)
                if done:
                    return
                # Wake at the next slot boundary too, so that the market's capacity changes land
                # when the replayed slot starts, before the scheduler's decision for that slot does.
                time.sleep(min(self.poll_s, self.clock.seconds_to_next_slot() + BOUNDARY_MARGIN_S))
        except BaseException as exc:
            self.abort(exc)
            raise

    def end_strays(self) -> None:
        """End the processes that carry this job's marker and that no record knows.

        A supervisor that died between starting a worker and recording it (killed, out of memory)
        leaves that worker running unseen; this one would start another for the same instance,
        and both would train on one checkpoint. A recorded worker and its children are left to
        the loop, which adopts or replaces them as before.
        """
        with self._locked():
            state = self.jobdir.load()
            known = {os.getpid()}
            for record in state.with_process() if state is not None else []:
                if record.pid is not None and is_alive(record.pid, record.started):
                    known.add(record.pid)
                    try:
                        known.update(child.pid for child in psutil.Process(record.pid).children(recursive=True))
                    except psutil.Error:
                        continue
        strays = [process for process in marked(str(self.jobdir.path)) if process.pid not in known]
        if strays:
            print(f"spotsched-supervisor: ending {len(strays)} process(es) of this job that no record knows: "
                  f"{sorted(process.pid for process in strays)}", file=sys.stderr)
            end_all(strays, self.stop_timeout_s)

    def tick(self, state: JobState, now: float) -> bool:
        """One pass of the loop; True when nothing is wanted and nothing runs."""
        for record in state.with_process():
            self.reap(state, record)
        if state.outcome is not None:
            for record in state.live():
                record.stop_reason = "finished" if state.outcome == "finished" else "released"
            self.stop_all(state, now)
        else:
            self.apply_market(state, now)
            if state.generation != state.running_generation:
                self.stop_all(state, now)
                if not state.with_process():
                    self.launch(state)
        for record in state.instances:
            if record.pid is None and record.state in (InstanceState.PENDING.value, InstanceState.RUNNING.value):
                if record.stop_reason is not None:
                    self.end_record(state, record)
        return not state.with_process() and not state.live()

    def reap(self, state: JobState, record: WorkerRecord) -> None:
        """Record the exit of ``record``'s worker process, if it exited, and forget the worker once
        no process marked as its instance is left: until then it keeps its pid, so that
        :meth:`stop_all` ends those children and no new worker set starts beside them."""
        process = self.processes.get(record.instance_id)
        if process is not None:
            code = process.poll()  # after the exit, the same code on every call
            if code is None:
                return
        elif is_alive(record.pid, record.started):
            return
        else:
            code = None  # started by a dead supervisor: its exit code is lost
        if record.exited_at is None:  # not recorded yet
            record.exit_code, record.exited_at = code, time.time()
            self.jobdir.log_event("exited", record, exit_code=code)
            self.record_exit(state, record, code)
        if not marked(str(self.jobdir.path), record.instance_id):
            self.processes.pop(record.instance_id, None)
            record.pid = record.started = None

    def record_exit(self, state: JobState, record: WorkerRecord, code: int | None) -> None:
        """What the exit of ``record``'s worker process with ``code`` means for it and for the job."""
        if code == EXIT_DONE and record.rank == 0:
            state.outcome = "finished"
            record.state, record.detail = InstanceState.FINISHED.value, "rank 0 finished the job's work"
            return
        if code == EXIT_DONE:
            record.detail = "exited 0 (done); waiting for rank 0"
            return
        if record.generation == state.running_generation == state.generation:
            state.generation += 1  # its peers lost a rank: they restart without it (or stop)
        asked = record.signalled_at is not None or record.stop_reason is not None
        if code in (EXIT_PREEMPTED, -signal.SIGTERM, None) or (asked and record.killed):
            if record.stop_reason is None:
                record.state = InstanceState.PENDING.value  # restarts with the next worker set
            if record.killed:
                record.detail = f"killed after not stopping within {self.stop_timeout_s:g} s"
            elif code == -signal.SIGTERM:
                why = f"{record.detail}; " if record.stop_reason and record.detail else ""
                record.detail = why + "ended by SIGTERM before its checkpoint handler was installed"
            elif code is None:
                record.detail = "worker ended while its supervisor was down"
            elif not asked and any(r.notice_at and r.generation == record.generation for r in state.instances):
                record.detail = "stopped with a peer that got a preemption notice; restarting"
            elif not asked:
                record.detail = "stopped by a SIGTERM from outside the backend; restarting"
            return
        state.outcome = "failed"
        stderr = tail(Path(record.log + ".err"))
        record.state = InstanceState.FAILED.value
        record.detail = f"exit code {code}: {stderr[-1000:] or '(no stderr)'}"

    def end_record(self, state: JobState, record: WorkerRecord) -> None:
        """Give an instance whose process is gone and whose stop was asked its final state."""
        if record.stop_reason == "finished":
            done = record.exit_code == EXIT_DONE
            record.state = (InstanceState.FINISHED if done else InstanceState.RELEASED).value
            record.detail = record.detail if done else "ended: the job finished on rank 0"
        else:
            record.state = STOP_STATES.get(record.stop_reason or "", InstanceState.RELEASED).value
            if state.outcome == "failed":
                record.detail = "ended: another worker failed"

    def apply_market(self, state: JobState, now: float) -> None:
        """Notify and then stop the spot workers beyond their pool's availability."""
        preempt_beyond_capacity(self.jobdir, state, self.clock, now)
        for record in state.with_process():
            if record.stop_reason == "preempted" and record.signalled_at is None and now >= (record.term_at or now):
                state.generation += 1  # the notice is over: the worker set changes now

    def stop_all(self, state: JobState, now: float) -> None:
        """SIGTERM every running worker once, SIGKILL those still running after the stop timeout."""
        for record in state.with_process():
            if record.signalled_at is None:
                record.signalled_at = now
                if record.live and record.exited_at is None:  # stopping to restart: not training until the new set starts
                    record.state, record.detail = InstanceState.PENDING.value, "restarting for a new worker set"
                self.signal_worker(record.instance_id, record.worker_pid, record.started, signal.SIGTERM)
                self.jobdir.log_event("sigterm", record, reason=record.stop_reason or "restart")
            elif not record.killed and now - record.signalled_at > self.stop_timeout_s:
                record.killed = True
                self.signal_worker(record.instance_id, record.worker_pid, record.started, signal.SIGKILL)
                self.jobdir.log_event("sigkill", record)

    def signal_worker(self, instance_id: str, pid: int, started: float | None, signum: int) -> None:
        """Send ``signum`` to every process of one worker: its process group and descendants
        (:func:`signal_group`), and each process marked as its instance that these miss: the
        children of a shell wrapper or launcher that exited before them have no parent of ours."""
        leader = is_alive(pid, started)
        signal_group(pid, started, signum)
        for process in marked(str(self.jobdir.path), instance_id):
            try:
                if leader and (os.getpgid(process.pid) == pid or pid in {p.pid for p in process.parents()}):
                    continue  # reached through the worker's group or as its descendant
                signal_group(process.pid, process.create_time(), signum)
            except (psutil.Error, ProcessLookupError):
                continue

    def launch(self, state: JobState) -> None:
        """Start the wanted worker set: one process per live instance, ranks 0..n-1."""
        workers = state.live()
        state.running_generation = state.generation
        if not workers:
            return
        world = len(workers)
        port = free_port()
        for rank, record in enumerate(workers):
            self.start_worker(state, record, rank, world, port)
            if state.outcome == "failed":
                return

    def start_worker(self, state: JobState, record: WorkerRecord, rank: int, world: int, port: int) -> None:
        generation = state.generation
        stem = self.jobdir.log_stem(record, generation)
        notice = self.jobdir.notice_file(record, generation)
        notice.unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(self.job.env)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "SPOTSCHED_GENERATION": str(generation),  # the torchrun rendezvous id (runtime/node.py)
                "SPOTSCHED_NOTICE": notice.as_uri(),  # percent-encoded: a '#' or '?' in the workdir stays in the path
                INSTANCE_MARKER: record.instance_id,
                JOB_ID_MARKER: self.job.job_id,
                JOBDIR_MARKER: str(self.jobdir.path),
            }
        )
        if world > 1:
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)})
        else:  # as the cloud start-up script: a LOCAL_RANK alone makes a transformers Trainer expect a process group
            for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
                env.pop(name, None)
        record.rank, record.generation, record.log = rank, generation, str(stem)
        record.signalled_at = record.notice_at = record.term_at = record.exit_code = record.exited_at = None
        record.launched_at = time.time()
        record.killed = False
        try:
            with open(f"{stem}.out", "ab") as out, open(f"{stem}.err", "ab") as err:
                process = subprocess.Popen(
                    self.job.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
        except OSError as exc:
            state.outcome = "failed"
            record.state = InstanceState.FAILED.value
            record.detail = f"could not start {self.job.command[0]!r}: {exc}"
            return
        self.processes[record.instance_id] = process
        record.pid, record.started = process.pid, create_time(process.pid)
        record.state, record.detail = InstanceState.RUNNING.value, f"rank {rank} of {world}"
        self.jobdir.log_event("launched", record, world_size=world, pid=process.pid)

    def abort(self, exc: BaseException) -> None:
        """On a crash or SIGTERM: end the workers (restartable by the next reconcile) and say why."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        sys.stderr.write(traceback.format_exc())
        # self.processes: the workers this supervisor started whose processes may still run, their
        # children included (an exited worker's pid stays ours until it is reaped: Popen.poll)
        started = {instance_id: create_time(process.pid) if process.poll() is None else None  # a reaped pid is not ours
                   for instance_id, process in self.processes.items()}
        for instance_id, process in self.processes.items():
            self.signal_worker(instance_id, process.pid, started[instance_id], signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for instance_id, process in self.processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _, left = psutil.wait_procs(marked(str(self.jobdir.path), instance_id), max(0.0, deadline - time.monotonic()))
            if process.poll() is None or left:
                self.signal_worker(instance_id, process.pid, started[instance_id], signal.SIGKILL)
                process.wait()
                psutil.wait_procs(left, timeout=5.0)
        with self.jobdir.lock():
            state = self.jobdir.load()
            if state is None or state.supervisor.get("pid") != os.getpid():
                return
            for record in state.with_process():
                if record.instance_id in self.processes:
                    record.pid = record.started = None
                    if record.live:
                        record.state = InstanceState.PENDING.value
            state.supervisor.update(exited=True, error=message)
            self.jobdir.save(state)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobdir", type=Path)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--stop-timeout-s", type=float, default=120.0)
    parser.add_argument("--detach", action="store_true", help="fork, print the daemon's pid and return at once")
    args = parser.parse_args(argv)
    if args.detach:
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            os._exit(0)
        os.setsid()  # a process group of its own, led by the pid on record: killpg reaches it
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)

    supervisor = Supervisor(JobDir(args.jobdir), args.poll_s, args.stop_timeout_s)
    signal.signal(signal.SIGTERM, supervisor.stop)
    supervisor.run()


if __name__ == "__main__":
    main()
