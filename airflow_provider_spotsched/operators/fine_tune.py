"""The operator users drop into a DAG: fine-tune by a deadline on spot and on-demand GPUs.

It is a thin loop over the Airflow-free core. Each slot it asks an
:class:`~airflow_provider_spotsched.scheduling.online.OnlineRun` for the allocation (forecast and
policy), makes the backend run it (``reconcile``), then defers to a
:class:`~airflow_provider_spotsched.triggers.spot_job.SpotJobTrigger` that wakes it at the next
slot boundary, on a preemption or at the job's end; while the job trains it holds no worker slot.

Where state lives:

- the run (market seen, decisions, cost so far) in the task's ``task_state_store`` under
  ``spotsched_run``, written after every decision and before the backend acts on it, so a retry
  finds it, re-attaches to the same job id (nothing launched twice) and bills no slot twice;
- the decision log in XCom (key ``decision_log``) after every slot, for the UI and downstream tasks;
- the selector's learnt state in an Airflow Variable, merged and verified at the end of the run
  (:func:`~airflow_provider_spotsched.scheduling.selector_store.store_round`).

Any exception in the task, and a kill, releases every instance of the job; checkpoints stay, so a
retry resumes the training where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Sequence

import fsspec
from airflow.sdk import Asset, BaseOperator, Variable
from airflow.sdk.exceptions import AirflowException

from airflow_provider_spotsched.backends.base import InstanceState, InsufficientCapacityError, JobStatus, TrainingJob
from airflow_provider_spotsched.forecast import FORECASTERS
from airflow_provider_spotsched.hooks.backend_factory import BackendSpec, SpotEnvironment, build_environment
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.links.report import SpotRunReportLink
from airflow_provider_spotsched.market.source import MarketSource
from airflow_provider_spotsched.operators.lineage import (
    AdapterLineageMixin,
    adapter_location,
    add_adapter_outlet,
    emit_adapter_event,
)
from airflow_provider_spotsched.scheduling.model import Allocation, Job, JobError, Throughput
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig, allocation_from_dict
from airflow_provider_spotsched.scheduling.selector_store import selector_state, store_round
from airflow_provider_spotsched.triggers.spot_job import SpotJobTrigger, job_from_dict, job_to_dict

STATE_KEY = "spotsched_run"
PROGRESS_FILE = "progress.json"
CONFIG_FILE = "config.json"
SLOT_EPSILON = 1e-6
CLOUD_OPTIONS = {"ec2": ("instance_type", "pools"), "gce": ("machine_type", "zones")}
"""The cloud backends' option names for the instance type and the pool placements."""


class TrainingFailedError(AirflowException):
    """The training command failed on an instance; its detail (stderr tail) is in the message."""


def default_forecaster() -> str:
    return "auto" if "auto" in FORECASTERS else "seasonal-naive"


def job_id_for(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> str:
    """Stable across retries of one task instance, and a valid tag or label on every cloud."""
    digest = hashlib.sha256(f"{dag_id}|{task_id}|{run_id}|{map_index}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{dag_id}-{task_id}".lower()).strip("-")[:40].rstrip("-")
    return f"{readable}-{digest}" if readable else digest


class DeadlineSpotFineTuneOperator(AdapterLineageMixin, BaseOperator):
    """Fine-tune by a deadline on a changing mix of spot and on-demand instances (see module doc).

    The job:

    :param work: training samples to process (the job's work units); or give ``steps`` and
        ``batch_size`` (global), or let it come from ``training_config`` (``samples``/``steps``).
    :param steps: optimizer steps; ``work = steps * batch_size``.
    :param batch_size: global batch size, with ``steps``.
    :param deadline: the soft deadline: a duration (``timedelta``, or hours as a number) from the
        task's start, or a timestamp (``datetime`` or ISO-8601 string, UTC).
    :param min_instances: fewest instances the job runs on (when it runs).
    :param max_instances: most instances the job runs on.
    :param throughput: ``{"alpha": a, "beta": b}``: ``a * n + b`` samples per hour on n instances
        (the planning model; progress itself is measured).
    :param value: USD that finishing by the deadline is worth.
    :param hard_deadline_factor: value decays linearly to 0 at this multiple of the deadline.
    :param reconfig_overhead_hours: compute lost on a slot whose allocation changed.

    The market and the backend:

    :param pools: spot pools (zones / availability zones) the job may use.
    :param instance_type: the instance (EC2) or machine (GCE) type of cloud backends.
    :param regions: if given, every pool must lie in one of these regions.
    :param market_source: the pools' live market (cloud backends): a :class:`MarketSource`, or a
        :class:`~airflow_provider_spotsched.hooks.market_spec.MarketSpec` or its dict (kind,
        connection id, options; the connection is checked before launching). The local backend
        reads the trace it replays.
    :param backend: ``"local"`` (processes on a replayed market), ``"ec2"`` or ``"gce"``.
    :param compute_conn_id: the backend's connection (``spotsched_local``, ``aws``,
        ``google_cloud_platform``); ``None`` with ``local`` uses the embedded default.
    :param backend_options: backend settings that win over the connection's (JSON values).

    The training:

    :param training_config: the runtime's CONFIG (dict), written next to the checkpoints and
        run with ``python -m airflow_provider_spotsched.runtime``.
    :param command: a training command instead (list or shell-style string); it must follow the
        runtime's contract (exit 0 done, 75 resumable, ``progress.json`` under the checkpoint URI).
    :param checkpoint_uri: where checkpoints, ``progress.json`` and the final adapter go (local
        path, ``s3://`` or ``gs://``); local backend default: under its workdir.
    :param adapter_asset: the Asset a success updates, with the adapter's location, cost, policy
        and ``deadline_met`` in the event's extra (default: ``{checkpoint_uri}/final`` when
        ``checkpoint_uri`` is fixed, else ``spotsched://{dag_id}/{task_id}/adapter``); it is
        added to ``outlets``.

    The scheduling:

    :param policy: a registered policy name; ``"selector"`` (default) learns across runs.
    :param policy_params: the policy's parameters.
    :param slot_hours: decision slot length in hours (default 1.0).
    :param budget: USD cap on the run's cost (``None``: no cap).
    :param selector_state_variable: the Variable key holding the selector's state.
    :param forecaster: the model whose forecast is logged each slot (default ``"auto"`` when
        registered, else ``"seasonal-naive"``).
    :param poll_interval: seconds between the trigger's status polls (default: a tenth of a slot,
        at most 60 s).
    """

    template_fields: Sequence[str] = (
        "pools",
        "deadline",
        "training_config",
        "command",
        "checkpoint_uri",
        "compute_conn_id",
        "backend_options",
        "policy_params",
        "budget",
        "selector_state_variable",
    )
    template_fields_renderers = {"training_config": "json", "backend_options": "json", "policy_params": "json"}
    ui_color = "#f4d58d"
    operator_extra_links = (SpotRunReportLink(),)

    def __init__(
        self,
        *,
        pools: Sequence[str],
        deadline: timedelta | datetime | float | str,
        throughput: Mapping[str, float],
        value: float,
        work: float | None = None,
        steps: int | None = None,
        batch_size: int | None = None,
        min_instances: int = 1,
        max_instances: int = 1,
        hard_deadline_factor: float = 1.0,
        reconfig_overhead_hours: float = 0.0,
        instance_type: str | None = None,
        regions: Sequence[str] | None = None,
        market_source: MarketSource | Mapping[str, Any] | str | None = None,
        backend: str = "local",
        compute_conn_id: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
        training_config: Mapping[str, Any] | None = None,
        command: Sequence[str] | str | None = None,
        checkpoint_uri: str | None = None,
        adapter_asset: Asset | None = None,
        policy: str = "selector",
        policy_params: Mapping[str, Any] | None = None,
        slot_hours: float = 1.0,
        budget: float | None = None,
        selector_state_variable: str = "spotsched_selector_state",
        forecaster: str | None = None,
        poll_interval: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pools = pools
        self.deadline = deadline
        self.throughput = throughput
        self.value = value
        self.work, self.steps, self.batch_size = work, steps, batch_size
        self.min_instances, self.max_instances = min_instances, max_instances
        self.hard_deadline_factor = hard_deadline_factor
        self.reconfig_overhead_hours = reconfig_overhead_hours
        self.instance_type = instance_type
        self.regions = regions
        if market_source is not None and not isinstance(market_source, MarketSource):
            market_source = MarketSpec.coerce(market_source)
        self.market_source = market_source
        self.backend = backend
        self.compute_conn_id = compute_conn_id
        self.backend_options = backend_options
        self.training_config = training_config
        self.command = command
        self.checkpoint_uri = checkpoint_uri
        self.adapter_asset = add_adapter_outlet(self, adapter_asset)
        self.policy = policy
        self.policy_params = policy_params
        self.slot_hours = slot_hours
        self.budget = budget
        self.selector_state_variable = selector_state_variable
        self.forecaster = forecaster or default_forecaster()
        self.poll_interval = poll_interval
        self._running: tuple[SpotEnvironment, TrainingJob] | None = None
        self._known_failures = 0  # failed instances of earlier tries: a retry starts the job again

    # -- Airflow entry points ------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        """Validate, then start the run, or re-attach to the one a previous try left."""
        saved = self._store(context).get(STATE_KEY)
        if saved:
            self.log.info("re-attaching to job %s, left by a previous try", saved["job"]["job_id"])
            return self._resume(context, saved, reattach=True)
        spec = self._backend_spec()
        env = build_environment(spec, self.slot_hours, self.market_source)
        run, training = self._start(context, env)
        return self._guarded(context, spec, env, run, training, reattach=False)

    def execute_slot(self, context: Any, event: Mapping[str, Any]) -> dict[str, Any]:
        """Resumed by the trigger: at a boundary, on a preemption or at the job's end."""
        saved = self._store(context).get(STATE_KEY)
        if not saved:
            raise AirflowException(f"the run state {STATE_KEY!r} is missing from task_state_store; clear the task to restart")
        self.log.info("woken: %s at %s", event.get("reason"), event.get("time"))
        return self._resume(context, saved, reattach=False)

    def on_kill(self) -> None:
        """End every instance of the job (checkpoints stay); a deferred task's trigger does the same."""
        if self._running is not None:
            env, training = self._running
            self.log.info("killed: releasing every instance of %s", training.job_id)
            env.backend.release(training)

    def _resume(self, context: Any, saved: Mapping[str, Any], reattach: bool) -> dict[str, Any]:
        """Go on with the saved run, its job and its backend, whatever the parameters say now.

        ``reattach``: a new try of the task, after a failure (which released the instances) or a
        worker that died (which left them running): the current slot's decision is applied again.
        """
        spec = BackendSpec.from_dict(saved["backend"])
        env = build_environment(spec, self.slot_hours, self.market_source)
        run, training = OnlineRun.from_state(saved["run"]), job_from_dict(saved["job"])
        self._known_failures = int(saved.get("known_failures", 0))
        return self._guarded(context, spec, env, run, training, reattach)

    # -- starting ------------------------------------------------------------------------------

    def _start(self, context: Any, env: SpotEnvironment) -> tuple[OnlineRun, TrainingJob]:
        """Every check before anything launches: job, pools, policy, budget, training command."""
        ti = context["ti"]
        job_id = job_id_for(ti.dag_id, ti.task_id, ti.run_id, ti.map_index if ti.map_index is not None else -1)
        now = datetime.now(timezone.utc)
        seconds_per_slot = env.seconds_per_slot or self.slot_hours * 3600.0
        job = self._job(now, seconds_per_slot)
        self._check_regions()
        config = RunConfig(
            job_id=job_id,
            job=job,
            pools=tuple(self.pools),
            policy=self.policy,
            policy_params=dict(self.policy_params or {}),
            forecaster=self.forecaster,
            budget=self.budget,
            seconds_per_slot=env.seconds_per_slot,
        )
        learnt = None
        if self.policy == "selector":
            learnt = selector_state(Variable.get(self.selector_state_variable, default=None, deserialize_json=True))
        run = OnlineRun.start(config, env.market.history(now), now, learnt)
        checkpoint_uri = self.checkpoint_uri or (env.default_checkpoint_uri(job_id) if env.default_checkpoint_uri else None)
        if not checkpoint_uri:
            raise JobError(f"checkpoint_uri is required with backend={self.backend!r}: give an s3:// or gs:// location")
        training = TrainingJob(job_id, self._command(checkpoint_uri), checkpoint_uri, run.config.pools)
        self._write_config(checkpoint_uri)
        return run, training

    def _job(self, now: datetime, seconds_per_slot: float) -> Job:
        if not isinstance(self.throughput, Mapping) or "alpha" not in self.throughput:
            raise JobError(f'throughput must be {{"alpha": samples/hour per instance, "beta": ...}}, got {self.throughput!r}')
        return Job(
            work=self._work(),
            deadline_hours=self._deadline_hours(now, seconds_per_slot),
            max_instances=self.max_instances,
            min_instances=self.min_instances,
            throughput=Throughput(float(self.throughput["alpha"]), float(self.throughput.get("beta", 0.0))),
            value=float(self.value),
            hard_deadline_factor=float(self.hard_deadline_factor),
            reconfig_overhead_hours=float(self.reconfig_overhead_hours),
            slot_hours=float(self.slot_hours),
        )

    def _work(self) -> float:
        """``work``, or ``steps * batch_size``, or the training config's samples; they must agree."""
        given = []
        if self.work is not None:
            given.append(("work", float(self.work)))
        if self.steps is not None or self.batch_size is not None:
            if self.steps is None or self.batch_size is None:
                raise JobError("steps and batch_size go together: work = steps * batch_size (global batch)")
            given.append(("steps * batch_size", float(self.steps) * float(self.batch_size)))
        if self.training_config is not None:
            from airflow_provider_spotsched.runtime.config import TrainConfig

            given.append(("training_config's samples", float(TrainConfig.from_dict(self.training_config).samples)))
        if not given:
            raise JobError("the job has no size: give work (samples), steps with batch_size, or training_config")
        if len({value for _, value in given}) > 1:
            raise JobError(f"the job's size disagrees: {', '.join(f'{n} = {v:g}' for n, v in given)}; give it once")
        return given[0][1]

    def _deadline_hours(self, now: datetime, seconds_per_slot: float) -> float:
        """Hours on the run's clock; a timestamp counts on the wall clock (sped up on a replay)."""
        deadline = self.deadline
        if isinstance(deadline, timedelta):
            return deadline.total_seconds() / 3600.0
        if isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
            return float(deadline)
        if isinstance(deadline, str):
            try:
                deadline = datetime.fromisoformat(deadline.replace("Z", "+00:00"))
            except ValueError:
                raise JobError(
                    f"deadline {self.deadline!r} is not an ISO-8601 timestamp; give hours, a timedelta or a datetime"
                ) from None
        if isinstance(deadline, datetime):
            if deadline.tzinfo is None:
                raise JobError(f"deadline {deadline.isoformat()} has no time zone; give it in UTC, e.g. ...+00:00")
            hours = (deadline - now).total_seconds() / seconds_per_slot * self.slot_hours
            if hours <= 0:
                raise JobError(f"deadline {deadline.isoformat()} has passed; give a later deadline")
            return hours
        raise JobError(f"deadline must be hours, a timedelta or a UTC timestamp, got {self.deadline!r}")

    def _check_regions(self) -> None:
        if self.regions:
            outside = [p for p in self.pools if not any(p.startswith(r) for r in self.regions)]
            if outside:
                raise JobError(f"pools {outside} lie outside regions={list(self.regions)}; drop them or add their regions")

    def _command(self, checkpoint_uri: str) -> tuple[str, ...]:
        if self.command is not None:
            if self.training_config is not None:
                raise JobError("give training_config or command, not both (the command reads its own config)")
            command = shlex.split(self.command) if isinstance(self.command, str) else tuple(self.command)
            return tuple(command)
        if self.training_config is None:
            raise JobError("give training_config (the runtime's CONFIG) or a training command")
        python = sys.executable if self.backend == "local" else "python3"
        return (
            python, "-m", "airflow_provider_spotsched.runtime",
            "--config", f"{checkpoint_uri.rstrip('/')}/{CONFIG_FILE}",
            "--checkpoint-uri", checkpoint_uri,
        )

    def _write_config(self, checkpoint_uri: str) -> None:
        if self.training_config is None:
            return
        with fsspec.open(f"{checkpoint_uri.rstrip('/')}/{CONFIG_FILE}", "w", auto_mkdir=True) as handle:
            json.dump(dict(self.training_config), handle, indent=1, sort_keys=True)

    def _backend_spec(self) -> BackendSpec:
        """The backend and its options; a cloud pool defaults to the zone of its name."""
        options = dict(self.backend_options or {})
        type_option, pools_option = CLOUD_OPTIONS.get(self.backend, (None, None))
        if type_option and self.instance_type:
            options.setdefault(type_option, self.instance_type)
        if pools_option:
            options.setdefault(pools_option, {pool: pool for pool in self.pools})
        return BackendSpec(self.backend, self.compute_conn_id, options)

    # -- the slot loop -------------------------------------------------------------------------

    def _guarded(self, context: Any, spec: BackendSpec, env: SpotEnvironment, run: OnlineRun, training: TrainingJob,
                 reattach: bool) -> dict[str, Any]:
        """One step of the loop; any failure releases every instance of the job."""
        self._running = (env, training)
        try:
            return self._step(context, spec, env, run, training, reattach)
        except Exception:  # a deferral (TaskDeferred) is a BaseException and passes through
            self.log.error("releasing every instance of %s after a failure (checkpoints stay)", training.job_id)
            env.backend.release(training)
            raise

    def _step(self, context: Any, spec: BackendSpec, env: SpotEnvironment, run: OnlineRun, training: TrainingJob,
              reattach: bool) -> dict[str, Any]:
        status = env.backend.status(training)
        if status.finished or run.completion_hours is not None:
            return self._finish(context, spec, env, run, training, status)
        failures = status.count(InstanceState.FAILED)
        if reattach:  # a new try starts a failed training again, from its checkpoint
            self._known_failures = failures
        elif failures > self._known_failures:
            failed = [i for i in status.instances if i.state is InstanceState.FAILED]
            details = "; ".join(f"{i.instance_id} ({i.pool}): {i.detail}" for i in failed)
            raise TrainingFailedError(f"training of {training.job_id} failed: {details}")
        now = datetime.now(timezone.utc)
        if not run.records:
            status = self._decide(context, spec, env, run, training, now, status.preemptions)
        elif run.records[-1].applied is None or (reattach and run.slot == self._slot_at(run, now)):
            # a previous try decided and stopped before the backend acted, or released what it had
            status = self._apply(context, spec, env, run, training, allocation_from_dict(run.records[-1].allocation, run.config.pools))
        while run.slot < self._slot_at(run, now):
            run.observe(*env.market.row(run.slot + 1, run.config.pools, now))
            status = self._decide(context, spec, env, run, training, now, status.preemptions)
        run.records[-1].preemptions = max(run.records[-1].preemptions, status.preemptions)
        self._save(context, spec, run, training)
        self._push_log(context, run)
        seconds_per_slot = run.config.wall_seconds_per_slot
        boundary = run.started + timedelta(seconds=(run.slot + 1) * seconds_per_slot)
        self.defer(
            trigger=SpotJobTrigger(
                backend=spec.to_dict(),
                job=job_to_dict(training),
                boundary=boundary.isoformat(),
                poll_interval=self.poll_interval or min(max(seconds_per_slot / 10.0, 0.2), 60.0),
                known_preemptions=status.preemptions,
                known_failures=self._known_failures,
            ),
            method_name="execute_slot",
        )

    def _decide(self, context: Any, spec: BackendSpec, env: SpotEnvironment, run: OnlineRun, training: TrainingJob,
                now: datetime, preemptions: int) -> JobStatus:
        """Decide this slot, record the decision durably, then make the backend run it."""
        record = run.decide(read_work_done(training.checkpoint_uri), now, preemptions)
        self.log.info("slot %d: %s (cost so far %.2f USD)", record.slot, record.allocation, record.cost_so_far)
        self._save(context, spec, run, training)
        return self._apply(context, spec, env, run, training, allocation_from_dict(record.allocation, run.config.pools))

    def _apply(self, context: Any, spec: BackendSpec, env: SpotEnvironment, run: OnlineRun, training: TrainingJob,
               target: Allocation) -> JobStatus:
        try:
            status = env.backend.reconcile(training, target)
        except InsufficientCapacityError as error:  # nothing could start: the slot runs (and bills) nothing
            self.log.warning("slot %d: %s", run.slot, error)
            status = env.backend.status(training)
        active = status.active(run.config.pools)  # instances winding down (notice, scale-down) are not the target's
        run.applied(Allocation(tuple(map(min, target.spot, active.spot)), min(target.on_demand, active.on_demand)))
        start = env.clock_start(training)
        if start is not None:  # slot k begins when the backend's replay enters its slot k
            run.started = datetime.fromtimestamp(start, timezone.utc)
        self._save(context, spec, run, training)
        return status

    def _finish(self, context: Any, spec: BackendSpec, env: SpotEnvironment, run: OnlineRun, training: TrainingJob,
                status: JobStatus) -> dict[str, Any]:
        if run.completion_hours is None:
            slot_start = run.slot * run.config.job.slot_hours
            hours = run.hours_at(read_finished_at(training.checkpoint_uri) or datetime.now(timezone.utc))
            run.records[-1].preemptions = max(run.records[-1].preemptions, status.preemptions)
            run.complete(min(max(hours, slot_start), slot_start + run.config.job.slot_hours))
            self._save(context, spec, run, training)
        env.backend.release(training)
        if run.member is not None:
            document = store_round(
                lambda: Variable.get(self.selector_state_variable, default=None, deserialize_json=True),
                lambda doc: Variable.set(self.selector_state_variable, doc, serialize_json=True),
                run,
            )
            self.log.info("selector round stored in Variable %s: %s", self.selector_state_variable, document["last_round"])
        self._push_log(context, run)
        result = run.result()
        emit_adapter_event(context, self.adapter_asset, result, adapter_location(training.checkpoint_uri))
        self.log.info("done: %s", json.dumps(result))
        return result

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def _store(context: Any) -> Any:
        store = context.get("task_state_store")
        if store is None:
            raise AirflowException("task_state_store is missing from the context: this operator needs Airflow >= 3.3")
        return store

    def _save(self, context: Any, spec: BackendSpec, run: OnlineRun, training: TrainingJob) -> None:
        state = {"run": run.to_state(), "job": job_to_dict(training), "backend": spec.to_dict(),
                 "known_failures": self._known_failures}
        self._store(context).set(STATE_KEY, state)

    @staticmethod
    def _push_log(context: Any, run: OnlineRun) -> None:
        context["ti"].xcom_push(key="decision_log", value=run.decision_log())

    @staticmethod
    def _slot_at(run: OnlineRun, now: datetime) -> int:
        """The slot in force at ``now`` on the run's clock."""
        return max(int(math.floor(run.hours_at(now) / run.config.job.slot_hours + SLOT_EPSILON)), 0)


def _read_progress(checkpoint_uri: str) -> dict[str, Any]:
    """The runtime's ``progress.json`` (empty before its first checkpoint)."""
    try:
        with fsspec.open(f"{checkpoint_uri.rstrip('/')}/{PROGRESS_FILE}", "r") as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_work_done(checkpoint_uri: str) -> float:
    """Samples the runtime has checkpointed (work that survives a preemption)."""
    return float(_read_progress(checkpoint_uri).get("samples_done", 0.0))


def read_finished_at(checkpoint_uri: str) -> datetime | None:
    """When the runtime wrote its final progress (``status: done``), if it says."""
    progress = _read_progress(checkpoint_uri)
    if progress.get("status") != "done" or not progress.get("updated"):
        return None
    return datetime.fromisoformat(str(progress["updated"]).replace("Z", "+00:00"))
