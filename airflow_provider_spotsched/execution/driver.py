"""The slot loop of a real run: decide, make the backend run it, bill it, and say when to come back.

A :class:`RunDriver` owns one :class:`~airflow_provider_spotsched.scheduling.online.OnlineRun`
(the decisions and the bill), the :class:`TrainingJob` it runs and the
:class:`~airflow_provider_spotsched.execution.environment.SpotEnvironment` it runs on. Each
:meth:`RunDriver.step` does whatever is due now and returns either :class:`Wait` (come back at
the next slot boundary, or earlier on a preemption, a failure or the job's end) or
:class:`Finished`. The caller only keeps the state between steps and waits: the Airflow operator
defers to a trigger (:meth:`RunDriver.run_until` waits in-process for a wait too short to
defer); without a triggerer, and on the command line, :meth:`RunDriver.run_to_completion`
waits in-process.

The rules a caller must not have to know:

- **catch-up**: a step late by several slots records the slots it missed as carried (the
  allocation in force ran on through them, capped by each slot's capacity, and is billed; after
  a release, by a kill or a failed try, nothing ran and they are idle; nothing is decided or
  launched for a slot that is over, not even a decision stored for it before a caller died, whose
  slot is billed as it ran on) and decides the current one, so the
  bill and the decision log have one entry per slot, and the bill is what ran;
- **durable before acting**: the state is handed to ``persist`` after every decision and before
  the backend acts on it, so a restarted caller re-attaches to the same job (nothing launched
  twice) and bills no slot twice;
- **one caller at a time**: each step holds the backend's :meth:`~ComputeBackend.turn` for the
  job and first takes up the stored state (``load``) when another caller stored a newer one, so
  two callers of one run (two tries of one task at once) take turns on one decision log instead
  of deciding each slot twice;
- **what is billed is what runs**: the applied allocation is the target capped by the instances
  the backend reports pending or running (a short pool or a preemption bills less);
- **completion** is the runtime's own finish time (``progress.json``; else the moment it was
  seen), clamped to its slot; a job that ended after slots nobody stepped through (a caller or
  triggerer down meanwhile) has those slots carried: recorded and billed with the allocation
  that ran on (capped by each slot's capacity), nothing decided or launched for them;
- **failures**: an instance failed in this try fails the run with its detail and the tail of the
  log it uploaded under ``checkpoint_uri/logs/`` (logged too); a new try (``reattach``) restarts
  a failed training from its checkpoint;
- **results the instance could not tag**: an instance whose identity may not tag or label itself
  ends without a result on the cloud (a spot one reads as preempted, an EC2 one that shut itself
  down as failed); the result the start-up script also stores beside its log
  (:func:`~airflow_provider_spotsched.runtime.contract.read_result`) decides: ``done`` finishes the
  run, ``failed-<code>`` fails it, none leaves the backend's reading. It is read once per such
  instance (the answers are kept in the state), so a failing command is not relaunched slot after
  slot until the deadline. A preemption the cloud reported stays one whatever ``failed-<code>``
  the command left as the shutdown ended it (torchrun exits 1 on SIGTERM); on one the backend only
  infers (:attr:`~airflow_provider_spotsched.backends.base.InstanceStatus.inferred`) the stored
  failure counts, whatever its code (an out-of-memory kill is 137): the script stores none while
  the instance's metadata says the cloud is taking it back;
- any exception releases every instance of the job (checkpoints stay).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_provider_spotsched.backends.base import InstanceState, InsufficientCapacityError, JobStatus, TrainingJob
from airflow_provider_spotsched.execution.environment import SpotEnvironment
from airflow_provider_spotsched.execution.wake import Wait, wait_for_wake
from airflow_provider_spotsched.runtime.contract import (
    RESULT_FILE,
    log_uri,
    read_finished_at,
    read_log_tail,
    read_progress,
    read_result,
    read_work_done,
)
from airflow_provider_spotsched.scheduling.model import Allocation, JobError
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig, allocation_from_dict

SLOT_EPSILON = 1e-6
log = logging.getLogger(__name__)


class TrainingFailedError(RuntimeError):
    """The training command failed on an instance; its detail (stderr tail) is in the message."""


@dataclass(frozen=True)
class Finished:
    """The job completed (or had completed when the step began); every instance is released."""

    run: OnlineRun


Persist = Callable[[dict[str, Any]], None]
Load = Callable[[], Mapping[str, Any] | None]
STATE_KEYS = ("run", "job", "known_failures", "stored_results")
UNTAGGED_RESULT = (
    "the instance could not tag or label itself with its result: give its identity that right (EC2: ec2:CreateTags on "
    "itself in the instance profile; Compute Engine: compute.instances.setLabels for the VMs' service account)"
)


class RunDriver:
    """One run on one environment, one step at a time (see the module docstring).

    :param env: the backend, market feed and clock.
    :param run: the decisions and the bill so far.
    :param training: what every instance runs.
    :param persist: called with :meth:`to_state` whenever the state must survive a restart.
    :param known_failures: failed instances of earlier tries, which this try does not count.
    :param load: reads back what ``persist`` stored (``None``: nothing yet); with it, a step
        goes on from a newer state another caller of the run stored (see the module docstring).
    :param stored_results: instance -> the result it stored beside its log ("" for none), for the
        instances already looked up (see the module docstring).
    """

    def __init__(
        self,
        env: SpotEnvironment,
        run: OnlineRun,
        training: TrainingJob,
        persist: Persist,
        known_failures: int = 0,
        load: Load | None = None,
        stored_results: Mapping[str, str] | None = None,
    ) -> None:
        self.env, self.run, self.training, self.persist = env, run, training, persist
        self.known_failures = known_failures
        self.load = load
        self.stored_results = dict(stored_results or {})
        self._stored: str | None = None  # the state this driver last stored or was built from

    @classmethod
    def start(
        cls,
        env: SpotEnvironment,
        config: RunConfig,
        command_for: Callable[[str], Sequence[str]],
        checkpoint_uri: str | None,
        persist: Persist,
        selector_state: Mapping[str, Any] | None = None,
        load: Load | None = None,
        training_env: Mapping[str, str] | None = None,
    ) -> RunDriver:
        """A new run: the job checked against the market, the budget, the account's quota and the
        backend (pools it can place, a start-up script it would send), nothing stored or launched yet.

        :param command_for: the training command for a checkpoint location.
        :param checkpoint_uri: where the runtime checkpoints (``None``: the backend's default).
        :param selector_state: the selector's learnt state, when the policy is the selector.
        :param training_env: environment of the training command on every instance (no secrets:
            the backends refuse them; a secret travels as a reference, see :mod:`~.backends.bootstrap`).
        """
        now = datetime.now(timezone.utc)
        run = OnlineRun.start(config, env.market.history(now, config.pools), now, selector_state)
        quota = env.backend.instance_limit()
        if quota is not None and config.job.max_instances > quota:
            raise JobError(
                f"max_instances={config.job.max_instances}: more than the {quota} instance(s) the {env.backend.name} "
                f"account may run on demand; lower max_instances to <= {quota} or raise the account's quota"
            )
        if checkpoint_uri is None and env.default_checkpoint_uri is not None:
            checkpoint_uri = env.default_checkpoint_uri(config.job_id)
        if not checkpoint_uri:
            raise JobError(
                f"checkpoint_uri is required with backend={env.backend.name!r}: give an s3:// or gs:// location"
            )
        training = TrainingJob(config.job_id, tuple(command_for(checkpoint_uri)), checkpoint_uri, run.config.pools,
                               env=dict(training_env or {}))
        env.backend.check_job(training)  # a refusal now, not after the run is stored (a retry would reuse it)
        return cls(env, run, training, persist, load=load)

    # -- state ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {"run": self.run.to_state(), "job": self.training.to_dict(), "known_failures": self.known_failures,
                "stored_results": dict(self.stored_results)}

    @classmethod
    def from_state(
        cls, env: SpotEnvironment, state: Mapping[str, Any], persist: Persist, load: Load | None = None
    ) -> RunDriver:
        driver = cls(
            env,
            OnlineRun.from_state(state["run"]),
            TrainingJob.from_dict(state["job"]),
            persist,
            int(state.get("known_failures", 0)),
            load,
            state.get("stored_results"),
        )
        driver._stored = _fingerprint(state)
        return driver

    def _save(self) -> None:
        state = self.to_state()
        self.persist(state)
        self._stored = _fingerprint(state)

    def _take_up_stored(self) -> None:
        """Go on from the stored state when another caller of this run stored a newer one."""
        stored = self.load() if self.load is not None else None
        if not stored or _fingerprint(stored) == self._stored:
            return
        if stored["job"]["job_id"] != self.training.job_id:
            raise ValueError(f"the stored run is job {stored['job']['job_id']}, this driver runs {self.training.job_id}")
        log.info("job %s: another caller moved the run on; going on from its stored state", self.training.job_id)
        self.run = OnlineRun.from_state(stored["run"])
        self.training = TrainingJob.from_dict(stored["job"])
        self.known_failures = int(stored.get("known_failures", 0))
        self.stored_results = dict(stored.get("stored_results") or {})
        self._stored = _fingerprint(stored)

    # -- the loop -------------------------------------------------------------------------

    def step(self, reattach: bool = False) -> Wait | Finished:
        """Do what is due now; any failure releases every instance of the job.

        ``reattach``: a new try of the caller, after a failure (which released the instances) or
        a caller that died (which left them running): the current slot's decision is applied again.
        """
        with self.env.backend.turn(self.training):
            try:
                self._take_up_stored()
                return self._step(reattach)
            except Exception:
                log.error("releasing every instance of %s after a failure (checkpoints stay)", self.training.job_id)
                self.release()
                raise

    def run_to_completion(
        self, reattach: bool = False, poll_interval: float | None = None, on_step: Callable[[OnlineRun], None] | None = None
    ) -> OnlineRun:
        """Step until the job is done, waiting in this process between steps (no triggerer)."""
        finished = self.run_until(reattach, poll_interval, on_step)
        assert isinstance(finished, Finished)  # nothing hands a wait over
        return finished.run

    def run_until(
        self,
        reattach: bool = False,
        poll_interval: float | None = None,
        on_step: Callable[[OnlineRun], None] | None = None,
        hand_over: Callable[[Wait], bool] | None = None,
    ) -> Wait | Finished:
        """Step, waiting in this process between steps, until the job is done or ``hand_over`` takes a wait.

        ``hand_over`` says whether the caller waits for this one elsewhere (the operator defers
        the waits long enough to defer). ``on_step`` sees the run after every step (to publish its
        decision log). Any exception while waiting or in ``on_step``, and an interrupt (Ctrl-C, a
        kill that raises), releases every instance before it propagates, as a failed step does.
        """
        try:
            while True:
                step = self.step(reattach)
                if on_step is not None:
                    on_step(self.run)
                if isinstance(step, Finished) or (hand_over is not None and hand_over(step)):
                    return step
                wait_for_wake(self.env.backend, self.training, step, poll_interval)
                reattach = False
        except (Exception, KeyboardInterrupt):
            self.release()
            raise

    def release(self) -> None:
        """End every instance of the job (checkpoints stay); safe to call again."""
        self.env.backend.release(self.training)

    def _step(self, reattach: bool) -> Wait | Finished:
        run = self.run
        status = self.env.backend.status(self.training)
        ended = self._with_stored_results(status)  # what ended how; the counts the trigger compares stay the backend's
        if ended.finished or run.completion_hours is not None:
            return self._finish(ended)
        failures = ended.count(InstanceState.FAILED)
        if reattach:
            self.known_failures = failures
        elif failures > self.known_failures:
            failed = [i for i in ended.instances if i.state is InstanceState.FAILED]
            details = "; ".join(f"{i.instance_id} ({i.pool}): {i.detail}{self._log_tail(i.instance_id)}" for i in failed)
            raise TrainingFailedError(f"training of {self.training.job_id} failed: {details}")
        now = datetime.now(timezone.utc)
        released = _released(status)
        if not run.records:
            status = self._decide(now, status)
        elif run.records[-1].applied is None and run.slot < self.slot_at(now):
            # a previous step decided a slot that is now over and stopped before the backend acted:
            # that slot ran on what was in force; its decision is not launched, the current slot's is
            run.ran_on_undelivered(released)
        elif run.records[-1].applied is None or (reattach and run.slot == self.slot_at(now)):
            # a previous step decided this slot and stopped before the backend acted, or released what it had
            status = self._apply(allocation_from_dict(run.records[-1].allocation, run.config.pools))
        seconds_per_slot = run.config.wall_seconds_per_slot
        poll_interval = min(max(seconds_per_slot / 10.0, 0.2), 60.0)
        if run.slot < self.slot_at(now) and status.active(run.config.pools).total and self._work_finished():
            # The runtime has done all the work and is exiting (the last save, torchrun's exit barrier):
            # there is nothing left to decide; the finish wakes the run, or else the next boundary.
            boundary = run.started + timedelta(seconds=(self.slot_at(now) + 1) * seconds_per_slot)
            return Wait(boundary=boundary, known_preemptions=status.preemptions, known_failures=self.known_failures,
                        poll_interval=poll_interval)
        current = self.slot_at(now)
        self._carry_to(current - 1, now, released)  # slots that are over ran on what was in force, if anything
        if run.slot < current:
            run.observe(*self.env.market.row(run.slot + 1, run.config.pools, now))
            status = self._decide(now, status)
        run.note_preemptions(status.preemptions, status.preemptions_by_pool)
        boundary = run.started + timedelta(seconds=(run.slot + 1) * seconds_per_slot)
        run.note_next_decision(boundary)
        self._save()
        return Wait(
            boundary=boundary,
            known_preemptions=status.preemptions,
            known_failures=self.known_failures,
            poll_interval=poll_interval,
        )

    def _work_finished(self) -> bool:
        """Whether the runtime reports all of the job's work done (it may still be exiting)."""
        progress = read_progress(self.training.checkpoint_uri, self.env.locate)
        return progress.samples_done >= self.run.config.job.work

    def _with_stored_results(self, status: JobStatus) -> JobStatus:
        """``status`` with the result each preempted or failed instance stored beside its log, where
        its tag or label lacks one (module docstring); each instance is looked up once."""
        instances = []
        for instance in status.instances:
            # a result the instance tagged itself with counts, unread
            if instance.state in (InstanceState.PREEMPTED, InstanceState.FAILED) and not instance.tagged_result:
                result = self._stored_result(instance.instance_id)
                if instance.state is InstanceState.PREEMPTED and not instance.inferred and result != "done":
                    result = ""  # the preemption's shutdown ended the command before the script saw the stop
                if result:
                    state = InstanceState.FINISHED if result == "done" else InstanceState.FAILED
                    detail = f"{instance.detail}, result={result} stored beside its log; {UNTAGGED_RESULT}"
                    instance = replace(instance, state=state, detail=detail)
            instances.append(instance)
        return replace(status, instances=tuple(instances))

    def _stored_result(self, instance_id: str) -> str:
        """What ``instance_id`` stored beside its log ("": nothing), read once; a store that cannot be
        read now leaves the backend's reading and is asked again at the next step."""
        if instance_id not in self.stored_results:
            try:
                self.stored_results[instance_id] = read_result(self.training.checkpoint_uri, instance_id, self.env.locate) or ""
            except Exception as error:  # storage errors share no base class
                log.warning("could not read the result of %s at %s: %s", instance_id,
                            log_uri(self.training.checkpoint_uri, instance_id, RESULT_FILE), error)
                return ""
        return self.stored_results[instance_id]

    def _log_tail(self, instance_id: str) -> str:
        """The tail of the log ``instance_id`` uploaded, logged and as text for the error ("" if none)."""
        try:
            tail = read_log_tail(self.training.checkpoint_uri, instance_id, locate=self.env.locate)
        except Exception as error:  # storage errors share no base class; the failure itself matters more
            log.warning("could not read the log of %s at %s: %s", instance_id, log_uri(self.training.checkpoint_uri, instance_id), error)
            return ""
        if tail is None:
            return ""
        log.error("log of %s (%s), last lines:\n%s", instance_id, log_uri(self.training.checkpoint_uri, instance_id), tail)
        return f"; log tail:\n{tail}"

    def _decide(self, now: datetime, status: JobStatus) -> JobStatus:
        """Decide this slot, record the decision durably, then make the backend run it."""
        progress = read_progress(self.training.checkpoint_uri, self.env.locate)
        record = self.run.decide(progress.samples_done, now, status.preemptions, status.preemptions_by_pool,
                                 progress.training_report())
        log.info("slot %d: %s (cost so far %.2f USD)", record.slot, record.allocation, record.cost_so_far)
        self._save()
        return self._apply(allocation_from_dict(record.allocation, self.run.config.pools))

    def _apply(self, target: Allocation) -> JobStatus:
        run, backend = self.run, self.env.backend
        try:
            status = backend.reconcile(self.training, target)
        except InsufficientCapacityError as error:  # nothing could start: the slot runs (and bills) nothing
            log.warning("slot %d: %s", run.slot, error)
            status = backend.status(self.training)
        active = status.active(run.config.pools)  # instances winding down (notice, scale-down) are not the target's
        run.applied(Allocation(tuple(map(min, target.spot, active.spot)), min(target.on_demand, active.on_demand)))
        start = self.env.clock_start(self.training)
        if start is not None:  # slot k begins when the backend's replay enters its slot k
            run.started = datetime.fromtimestamp(start, timezone.utc)
        self._save()
        return status

    def _finish(self, status: JobStatus) -> Finished:
        run = self.run
        if run.completion_hours is None:
            finished_at = read_finished_at(self.training.checkpoint_uri, self.env.locate) or datetime.now(timezone.utc)
            run.ran_on_undelivered()  # a decision stored just before a crash never ran: its slot ran on what was
            self._carry_to(min(self.slot_at(finished_at), self.slot_at(datetime.now(timezone.utc))), finished_at)
            slot_start = run.slot * run.config.job.slot_hours
            hours = run.hours_at(finished_at)
            run.note_preemptions(status.preemptions, status.preemptions_by_pool)
            run.complete(min(max(hours, slot_start), slot_start + run.config.job.slot_hours))
            self._save()
        self.release()
        return Finished(run)

    def _carry_to(self, slot: int, now: datetime, released: bool = False) -> None:
        """Record and bill the slots up to ``slot`` that the job ran through unwatched (module docstring);
        none ran anything if every instance was ``released``."""
        run = self.run
        while run.records and run.slot < slot:
            work_done = read_work_done(self.training.checkpoint_uri, self.env.locate)
            row = self.env.market.row(run.slot + 1, run.config.pools, now)
            record = run.pass_unwatched(*row, now, work_done, released)
            log.info("slot %d went by with no step; %s ran on", record.slot, record.applied)

    def slot_at(self, now: datetime) -> int:
        """The slot in force at ``now`` on the run's clock."""
        return max(int(math.floor(self.run.hours_at(now) / self.run.config.job.slot_hours + SLOT_EPSILON)), 0)


def _released(status: JobStatus) -> bool:
    """Whether the job's instances were ended for it (a kill, a failed try): none is live, and those
    listed were released or failed (a failed one keeps its state through the release). Instances all
    preempted while nobody stepped ran until taken back, so that is not a release."""
    states = {i.state for i in status.instances}
    return not states & {InstanceState.PENDING, InstanceState.RUNNING} and (
        not states or bool(states & {InstanceState.RELEASED, InstanceState.FAILED})
    )


def _fingerprint(state: Mapping[str, Any]) -> str:
    """The driver's part of a stored state, as comparable text."""
    return json.dumps({key: state.get(key) for key in STATE_KEYS}, sort_keys=True, default=str)
