"""The operator users drop into a DAG: fine-tune by a deadline on spot and on-demand GPUs.

It is a thin loop over the Airflow-free core. Each slot it asks an
:class:`~airflow_provider_spotsched.scheduling.online.OnlineRun` for the allocation (forecast and
policy), makes the backend run it (``reconcile``), then defers to a
:class:`~airflow_provider_spotsched.triggers.spot_job.SpotJobTrigger` that wakes it at the next
slot boundary, on a preemption or at the job's end; while the job trains it holds no worker slot.

Where state lives:

- the run (market seen, decisions, cost so far) in the task's ``task_state_store`` under
  ``spotsched_run``, written after every decision and before the backend acts on it, so a retry
  finds it, re-attaches to the same job id (nothing launched twice) and bills no slot twice; two
  tries running at once take turns on it (each step goes on from the newest stored state);
- the decision log in XCom (key ``decision_log``) after every slot, for the UI and downstream tasks;
- the selector's learnt state in an Airflow Variable, merged and verified at the end of the run
  (:func:`~airflow_provider_spotsched.scheduling.selector_store.store_round`).

Reads and writes of the state store and the decision log's XCom are retried with a short backoff
(:func:`~airflow_provider_spotsched.execution.retry.retrying`), so that a database down for a few
seconds costs nothing; a decision log that still cannot be pushed mid-run is pushed with the next
slot's. Any other exception in the task, a kill, and a trigger that failed release every instance
of the job; checkpoints stay, so a retry resumes the training where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context, Variable, conf
from airflow.sdk.exceptions import AirflowException

from airflow_provider_spotsched.backends.base import TrainingJob
from airflow_provider_spotsched.backends.bootstrap import HF_TOKEN_SECRET
from airflow_provider_spotsched.backends.cloud import check_checkpoint_reachable
from airflow_provider_spotsched.execution.driver import Finished, RunDriver
from airflow_provider_spotsched.execution.environment import SpotEnvironment
from airflow_provider_spotsched.execution.retry import retrying
from airflow_provider_spotsched.execution.wake import Wait
from airflow_provider_spotsched.forecast import FORECASTERS, LIVE_FORECASTERS
from airflow_provider_spotsched.hooks.backend_factory import BackendSpec, build_backend, build_environment
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.hooks.rendered import rendered_number, rendered_object
from airflow_provider_spotsched.links.report import SpotRunReportLink
from airflow_provider_spotsched.market.slots import cloud_region, pool_names
from airflow_provider_spotsched.market.source import MarketSource
from airflow_provider_spotsched.operators.lineage import (
    AdapterLineageMixin,
    adapter_location,
    add_adapter_outlet,
    emit_adapter_event,
    fixed_text,
)
from airflow_provider_spotsched.runtime.contract import runtime_command, write_config
from airflow_provider_spotsched.scheduling.model import (
    DEFAULT_MAX_INSTANCES_LIMIT,
    Job,
    JobError,
    Throughput,
    as_count,
    as_number,
    check_field,
    check_overhead,
    check_throughput,
    shown,
)
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig, check_budget
from airflow_provider_spotsched.scheduling.policies import POLICIES
from airflow_provider_spotsched.scheduling.selector_store import starting_state, store_round
from airflow_provider_spotsched.triggers.spot_job import SpotJobTrigger

STATE_KEY = "spotsched_run"
TRIGGER_FAILED = "__fail__"  # the next_method Airflow resumes a task with when its trigger failed or timed out
DEFAULT_SELECTOR_VARIABLE = "spotsched_selector_state"
DEFAULT_MIN_DEFERRAL_SECONDS = 15.0
CLOUD_OPTIONS = {"ec2": ("instance_type", "pools"), "gce": ("machine_type", "zones")}
"""The cloud backends' option names for the instance type and the pool placements."""


def default_forecaster() -> str:
    return "auto" if "auto" in FORECASTERS else "seasonal-naive"


def step_count(name: str, value: Any) -> int:
    """``steps`` or ``batch_size``: a whole number >= 1 (a negative pair would multiply to a size)."""
    count = as_count(name, value)
    if count < 1:
        raise JobError(f"{name}={value!r}: must be >= 1; give a whole number")
    return count


def max_instances_limit() -> int:
    """``[spotsched] max_instances_limit``: the most instances one job of the deployment may ask for."""
    text = conf.get("spotsched", "max_instances_limit", fallback=str(DEFAULT_MAX_INSTANCES_LIMIT))
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise JobError(
            f"[spotsched] max_instances_limit={text!r}: not a whole number of instances >= 1; set it to e.g. 1024"
        )
    return limit


def min_deferral_seconds() -> float:
    """``[spotsched] min_deferral_seconds``: the least time a deferral lasts, against an Airflow race
    (:mod:`airflow_provider_spotsched.triggers.spot_job` says which)."""
    text = conf.get("spotsched", "min_deferral_seconds", fallback=str(DEFAULT_MIN_DEFERRAL_SECONDS))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:  # inf would never defer: every wait held a worker slot
        raise JobError(f"[spotsched] min_deferral_seconds={text!r}: not a finite number of seconds >= 0; set it to e.g. 15")
    return seconds


def _names(value: Sequence[str] | str, field: str) -> tuple[str, ...]:
    """Names from a list or a comma-separated string (:func:`pool_names`), refused as a JobError."""
    try:
        return pool_names(value, field)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def job_id_for(dag_id: str, task_id: str, run_id: str, map_index: int = -1, *, nonce: str) -> str:
    """A job id naming its DAG and task, a valid tag or label on every cloud.

    The task instance's ids alone repeat: two deployments on one cloud account run the same DAG
    with the same run ids, and a re-created DAG or a reset metadata database reuses them. So the
    operator mixes in a fresh ``nonce`` at each start of a run (:func:`new_job_id`), and every
    retry reads the id back from the stored run instead of deriving it again.
    """
    digest = hashlib.sha256(f"{dag_id}|{task_id}|{run_id}|{map_index}|{nonce}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{dag_id}-{task_id}".lower()).strip("-")[:40].rstrip("-")
    return f"{readable}-{digest}" if readable else digest


def new_job_id(ti: Any) -> str:
    """The id of a new run of task instance ``ti``: unique to this start (see :func:`job_id_for`)."""
    map_index = ti.map_index if ti.map_index is not None else -1
    return job_id_for(ti.dag_id, ti.task_id, ti.run_id, map_index, nonce=secrets.token_hex(8))


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
    :param max_instances: most instances the job runs on; at most ``[spotsched] max_instances_limit``
        (default 1024) and, where the backend reads it (EC2), the account's on-demand quota.
    :param throughput: ``{"alpha": a, "beta": b}``: ``a * n + b`` samples per hour on n instances
        (the planning model; progress itself is measured).
    :param value: USD that finishing by the deadline is worth.
    :param hard_deadline_factor: value decays linearly to 0 at this multiple of the deadline.
    :param reconfig_overhead_hours: compute lost on a slot whose allocation changed.

    The market and the backend:

    :param pools: spot pools (zones / availability zones) the job may use, each once: a list, or
        one comma-separated string (what a template renders to).
    :param instance_type: the instance (EC2) or machine (GCE) type of cloud backends.
    :param regions: if given, every pool must lie in one of these regions (its zone name less the zone letter).
    :param market_source: the pools' live market (cloud backends): a :class:`MarketSource`, or a
        :class:`~airflow_provider_spotsched.hooks.market_spec.MarketSpec` or its dict (kind,
        connection id, options; the connection is checked before launching). The local backend
        reads the trace it replays.
    :param backend: ``"local"`` (processes on a replayed market), ``"ec2"`` or ``"gce"``.
    :param compute_conn_id: the backend's connection (``spotsched_local``, ``aws``,
        ``google_cloud_platform``); ``None`` with ``local`` uses ``spotsched_local_default``
        where it exists, else the embedded default.
    :param backend_options: backend settings that win over the connection's (JSON values).

    The training:

    :param training_config: the runtime's CONFIG (dict), written next to the checkpoints and
        run with ``python -m airflow_provider_spotsched.runtime``.
    :param command: a training command instead (list or shell-style string); it must follow the
        runtime's contract (exit 0 done, 75 resumable, ``progress.json`` under the checkpoint URI).
    :param checkpoint_uri: where checkpoints, ``progress.json``, the instances' logs (``logs/``)
        and the final adapter go (local path, ``s3://`` or ``gs://``); local backend default: under
        its workdir. The operator reaches it with ``compute_conn_id``'s credentials
        (``ObjectStoragePath``); instances with their instance profile or service account. A
        cloud backend refuses a path on the worker's own disk, which its instances cannot reach.
    :param hf_token_secret: the secret holding a Hugging Face token, read on each instance with
        its own identity and given to the training command as ``HF_TOKEN`` (never logged, never in
        user data): an AWS Secrets Manager ARN (``ec2``) or ``projects/P/secrets/S/versions/V``
        (``gce``); see docs/backends.md.
    :param adapter_asset: the Asset a success updates, with the adapter's location, cost, policy
        and ``deadline_met`` in the event's extra (default: ``{checkpoint_uri}/final`` when
        ``checkpoint_uri`` is fixed, else ``spotsched://{dag_id}/{task_id}/adapter``); it is
        added to ``outlets``.

    The scheduling:

    :param policy: a registered policy name; ``"selector"`` (default) learns across runs.
    :param policy_params: the policy's parameters.
    :param slot_hours: decision slot length in hours (default 1.0).
    :param budget: USD cap on the run's cost (``None``: no cap).
    :param selector_state_variable: the Variable key holding the selector's state (default:
        ``[spotsched] selector_state_variable``, else ``spotsched_selector_state``).
    :param forecaster: the model whose forecast is logged each slot (default ``"auto"`` when
        registered, else ``"seasonal-naive"``).
    :param poll_interval: seconds between status polls (default: ``[spotsched]
        default_poll_interval``, else a tenth of a slot, at most 60 s).
    :param deferrable: between slots, defer to the triggerer and hold no worker slot (default:
        ``[operators] default_deferrable``, as every Airflow provider); ``False`` waits in the
        worker, polling the backend, for deployments that run no triggerer: same decisions, same
        result, one worker slot held for the whole run.

    Every argument but ``backend``, ``slot_hours``, ``forecaster``, ``regions``, ``policy``,
    ``hard_deadline_factor``/``reconfig_overhead_hours``, ``poll_interval``, ``deferrable`` and
    ``adapter_asset`` is templated, so the job's size, its instance counts and its market can come
    from an upstream task's XCom.
    """

    template_fields: Sequence[str] = (
        "pools",
        "deadline",
        "throughput",
        "value",
        "work",
        "steps",
        "batch_size",
        "min_instances",
        "max_instances",
        "instance_type",
        "market_source",
        "training_config",
        "command",
        "checkpoint_uri",
        "hf_token_secret",
        "compute_conn_id",
        "backend_options",
        "policy_params",
        "budget",
        "selector_state_variable",
    )
    template_fields_renderers = {
        "training_config": "json",
        "backend_options": "json",
        "policy_params": "json",
        "throughput": "json",
        "market_source": "json",
    }
    ui_color = "#f4d58d"
    operator_extra_links = (SpotRunReportLink(),)

    def __init__(
        self,
        *,
        pools: Sequence[str] | str,
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
        hf_token_secret: str | None = None,
        adapter_asset: Asset | None = None,
        policy: str = "selector",
        policy_params: Mapping[str, Any] | None = None,
        slot_hours: float = 1.0,
        budget: float | None = None,
        selector_state_variable: str | None = None,
        forecaster: str | None = None,
        poll_interval: float | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
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
        self.regions = None if regions is None else _names(regions, "regions")
        if market_source is not None and not isinstance(market_source, MarketSource):
            MarketSpec.coerce(market_source)  # a wrong kind fails when the DAG is parsed; templates render later
        self.market_source = market_source
        self.backend = backend
        self.compute_conn_id = compute_conn_id
        self.backend_options = backend_options
        self.training_config = training_config
        self.command = command
        self.checkpoint_uri = checkpoint_uri
        self.hf_token_secret = hf_token_secret
        self.adapter_asset = add_adapter_outlet(self, adapter_asset)
        self.policy = policy
        self.policy_params = policy_params
        self.slot_hours = slot_hours
        self.budget = budget
        self.selector_state_variable = selector_state_variable or conf.get(
            "spotsched", "selector_state_variable", fallback=DEFAULT_SELECTOR_VARIABLE
        )
        self.forecaster = forecaster or default_forecaster()
        if poll_interval is None and (configured := conf.get("spotsched", "default_poll_interval", fallback="")):
            try:
                poll_interval = float(configured)
            except ValueError:
                raise JobError(
                    f"[spotsched] default_poll_interval={configured!r}: not a number; set it to seconds, e.g. 30, or empty"
                ) from None
        if poll_interval is not None and as_number("poll_interval", poll_interval) <= 0:
            raise JobError(f"poll_interval={poll_interval!r}: must be > 0 seconds; give the seconds between status polls")
        self.poll_interval = poll_interval
        self.deferrable = deferrable
        self._running: RunDriver | None = None
        self._check_arguments()

    def _check_arguments(self) -> None:
        """Refuse, when the DAG is parsed, every argument no template will change: the ones not
        templated, and templated numbers given as numbers. Text may be a template; it is checked
        when the task starts, after rendering (a checkpoint_uri with no Jinja in it is checked here)."""
        BackendSpec(self.backend, self.compute_conn_id)  # a known backend, with a connection where it needs one
        if self.backend in CLOUD_OPTIONS and fixed_text(self.checkpoint_uri) and self.checkpoint_uri:  # templated: check_job, at the start
            check_checkpoint_reachable(self.checkpoint_uri, self.backend)
        if self.policy not in POLICIES:
            raise JobError(f"policy={self.policy!r}: not a registered policy; choose one of {sorted(POLICIES)}")
        if self.forecaster not in LIVE_FORECASTERS:
            raise JobError(f"forecaster={self.forecaster!r}: not a forecaster of a live market; "
                           f"choose one of {sorted(LIVE_FORECASTERS)}")
        if not isinstance(self.deferrable, bool):
            raise JobError(f"deferrable={self.deferrable!r}: not a bool; give True (wait in the triggerer) or False")
        for name in ("slot_hours", "hard_deadline_factor", "reconfig_overhead_hours"):
            check_field(name, getattr(self, name))
        check_overhead(self.reconfig_overhead_hours, self.slot_hours)
        throughput = check_throughput(self.throughput) if isinstance(self.throughput, Mapping) else {}
        given = {"work": self.work, "value": self.value, "min_instances": self.min_instances,
                 "max_instances": self.max_instances, **{f"throughput.{k}": v for k, v in throughput.items()}}
        for name, value in given.items():
            if isinstance(value, (int, float)):
                check_field(name, value)
        for name in ("steps", "batch_size"):
            if isinstance(value := getattr(self, name), (int, float)):
                step_count(name, value)
        if isinstance(self.budget, (int, float)):
            check_budget(self.budget)
        if isinstance(self.deadline, (timedelta, datetime, int, float)):
            self._deadline_hours(datetime.now(timezone.utc), self.slot_hours * 3600.0)

    # -- Airflow entry points ------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        """Validate, then start the run, or re-attach to the one a previous try left."""
        saved = self._load(context)()
        if saved:
            self.log.info("re-attaching to job %s, left by a previous try", saved["job"]["job_id"])
            return self._resume(context, saved, reattach=True)
        min_deferral_seconds()  # a bad setting is refused before anything launches
        self._read_rendered_objects()
        spec = self._backend_spec()
        env = build_environment(spec, self.slot_hours, self._market_source())
        driver = self._start(context, spec, env)
        return self._drive(context, spec, driver, reattach=False)

    def execute_slot(self, context: Context, event: Mapping[str, Any]) -> dict[str, Any]:
        """Resumed by the trigger: at a boundary, on a preemption or at the job's end."""
        saved = self._load(context)()
        if not saved:
            raise AirflowException(f"the run state {STATE_KEY!r} is missing from task_state_store; clear the task to restart")
        self.log.info("woken: %s at %s", event.get("reason"), event.get("time"))
        return self._resume(context, saved, reattach=False)

    def on_kill(self) -> None:
        """End every instance of the job (checkpoints stay); a deferred task's trigger does the same."""
        if self._running is not None:
            self.log.info("killed: releasing every instance of %s", self._running.training.job_id)
            self._running.release()

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """A trigger that failed or timed out resumes the task only to fail it: the job's instances
        are released first, since no trigger watches them any more."""
        if next_method == TRIGGER_FAILED:
            saved = self._load(context)()
            if saved:
                self._release_saved(saved)
        return super().resume_execution(next_method, next_kwargs, context)

    def _resume(self, context: Context, saved: Mapping[str, Any], reattach: bool) -> dict[str, Any]:
        """Go on with the saved run, its job and its backend, whatever the parameters say now.

        ``reattach``: a new try of the task (see :meth:`RunDriver.step`).
        """
        try:
            min_deferral_seconds()  # refused here, a bad setting fails the task with the job released, not running
            self._read_rendered_objects()  # every try: the lineage read at the end reads backend_options
            spec = BackendSpec.from_dict(saved["backend"])
            env = build_environment(spec, self.slot_hours, self._market_source())
            driver = RunDriver.from_state(env, saved, self._persist(context, spec), self._load(context))
        except BaseException:  # the task fails with no driver to release what runs: release it from the state
            self._release_saved(saved)
            raise
        return self._drive(context, spec, driver, reattach)

    def _read_rendered_objects(self) -> None:
        """The dict parameters a template rendered to JSON text, as dicts (each try renders anew)."""
        for name in ("backend_options", "training_config", "policy_params"):
            setattr(self, name, rendered_object(name, getattr(self, name)))

    def _release_saved(self, saved: Mapping[str, Any]) -> None:
        """End every instance of the stored run's job through its stored backend (its connection only)."""
        job = TrainingJob.from_dict(saved["job"])
        try:
            build_backend(BackendSpec.from_dict(saved["backend"])).release(job)
        except Exception as error:  # the task fails anyway; say what may still run
            self.log.error("could not release the instances of job %s (%s): end them by its job id", job.job_id, error)
        else:
            self.log.info("released every instance of job %s", job.job_id)

    # -- starting ------------------------------------------------------------------------------

    def _start(self, context: Context, spec: BackendSpec, env: SpotEnvironment) -> RunDriver:
        """Every check before anything launches: job, pools, policy, budget, training command."""
        job_id = new_job_id(context["ti"])  # stored with the run before anything launches: every retry reads it back
        now = datetime.now(timezone.utc)
        seconds_per_slot = env.seconds_per_slot or self.slot_hours * 3600.0
        job = self._job(now, seconds_per_slot)
        self._check_regions()
        config = RunConfig(
            job_id=job_id,
            job=job,
            pools=self._pools(),
            policy=self.policy,
            policy_params=dict(self.policy_params or {}),
            forecaster=self.forecaster,
            budget=None if self.budget is None else rendered_number("budget", self.budget),
            seconds_per_slot=env.seconds_per_slot,
            max_instances_limit=max_instances_limit(),
        )
        learnt = None
        if self.policy == "selector":  # raw text: a Variable that is not JSON must not read as a missing one
            learnt = starting_state(Variable.get(self.selector_state_variable, default=None), self._selector_store)
        driver = RunDriver.start(
            env, config, self._command, self.checkpoint_uri, self._persist(context, spec), learnt, self._load(context),
            training_env=self._training_env(),
        )
        if self.training_config is not None:
            write_config(driver.training.checkpoint_uri, self.training_config, env.locate)
        return driver

    def _job(self, now: datetime, seconds_per_slot: float) -> Job:
        throughput = check_throughput(rendered_object("throughput", self.throughput))
        alpha, beta = (
            as_number(f"throughput.{k}", rendered_number(f"throughput.{k}", throughput.get(k, 0.0))) for k in ("alpha", "beta")
        )
        return Job(
            work=self._work(),
            deadline_hours=self._deadline_hours(now, seconds_per_slot),
            max_instances=rendered_number("max_instances", self.max_instances, integer=True),
            min_instances=rendered_number("min_instances", self.min_instances, integer=True),
            throughput=Throughput(alpha, beta),
            value=as_number("value", rendered_number("value", self.value)),
            hard_deadline_factor=float(self.hard_deadline_factor),
            reconfig_overhead_hours=float(self.reconfig_overhead_hours),
            slot_hours=float(self.slot_hours),
        )

    def _work(self) -> float:
        """``work``, or ``steps * batch_size``, or the training config's samples; they must agree."""
        given = []
        if self.work is not None:
            given.append(("work", as_number("work", rendered_number("work", self.work))))
        if self.steps is not None or self.batch_size is not None:
            if self.steps is None or self.batch_size is None:
                raise JobError("steps and batch_size go together: work = steps * batch_size (global batch)")
            steps, batch_size = (step_count(n, rendered_number(n, getattr(self, n), integer=True)) for n in ("steps", "batch_size"))
            given.append(("steps * batch_size", float(steps * batch_size)))
        if self.training_config is not None:
            from airflow_provider_spotsched.runtime.config import TrainConfig

            given.append(("training_config's samples", float(TrainConfig.from_dict(self.training_config).samples)))
        if not given:
            raise JobError("the job has no size: give work (samples), steps with batch_size, or training_config")
        if len({value for _, value in given}) > 1:
            raise JobError(f"the job's size disagrees: {', '.join(f'{n} = {v:g}' for n, v in given)}; give it once")
        return given[0][1]

    def _deadline_hours(self, now: datetime, seconds_per_slot: float) -> float:
        """Hours on the run's clock; a timestamp counts on the wall clock (sped up on a replay).

        Text is hours where it reads as a number (a template renders ``6`` to ``"6"``), else an ISO timestamp."""
        deadline = self.deadline
        if isinstance(deadline, str):
            try:
                deadline = float(deadline)
            except ValueError:
                pass
        if isinstance(deadline, (timedelta, int, float)):
            hours = deadline.total_seconds() / 3600.0 if isinstance(deadline, timedelta) else as_number("deadline", deadline)
            if hours <= 0:
                raise JobError(f"deadline={self.deadline!r}: must be a duration > 0 from the task's start; give a later deadline")
            return hours
        if isinstance(deadline, str):
            try:
                deadline = datetime.fromisoformat(deadline.replace("Z", "+00:00"))
            except ValueError:
                raise JobError(
                    f"deadline={self.deadline!r}: neither hours nor an ISO-8601 timestamp; give hours (e.g. 6), "
                    "a timedelta or a UTC timestamp"
                ) from None
        if isinstance(deadline, datetime):
            if deadline.tzinfo is None:
                raise JobError(f"deadline {deadline.isoformat()} has no time zone; give it in UTC, e.g. ...+00:00")
            hours = (deadline - now).total_seconds() / seconds_per_slot * self.slot_hours
            if hours <= 0:
                raise JobError(f"deadline {deadline.isoformat()} has passed; give a later deadline")
            return hours
        raise JobError(f"deadline must be hours, a timedelta or a UTC timestamp, got {self.deadline!r}")

    def _market_source(self) -> MarketSource | None:
        """The (rendered) market source: a live source as given, or the spec its dict, or the JSON
        text a template renders that dict to, describes; other text names a trace."""
        if self.market_source is None or isinstance(self.market_source, MarketSource):
            return self.market_source
        market = self.market_source
        if isinstance(market, str) and market.lstrip().startswith("{"):  # no trace path starts so
            spec = rendered_object("market_source", market)
            if spec is None or "kind" not in spec:
                raise JobError(f"market_source={shown(market)}: a JSON object without 'kind'; give the MarketSpec's dict, "
                               'e.g. {"kind": "aws", "conn_id": "aws_default", "options": {...}}')
            return MarketSpec.coerce(spec)
        return MarketSpec.coerce(market)

    def _pools(self) -> tuple[str, ...]:
        """The rendered pools: a list, or a comma-separated string (a template renders to text)."""
        return _names(self.pools, "pools")

    def _check_regions(self) -> None:
        """Every pool's region (its zone name less the zone letter) must be one of ``regions``: a
        prefix is no region (``europe-west10-a`` lies outside ``europe-west1``)."""
        if self.regions:
            outside = [p for p in self._pools() if cloud_region(p) not in self.regions]
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
        runtime = self._check_runtime_fits()
        return runtime_command(checkpoint_uri, sys.executable if self.backend == "local" else "python3", runtime)

    def _check_runtime_fits(self) -> str:
        """Refuse a job the default runtime (hf) cannot run before any instance starts, rather than have
        every worker exit 2; the config's runtime."""
        from airflow_provider_spotsched.runtime.config import TrainConfig

        config = TrainConfig.from_dict(self.training_config or {})
        if config.runtime != "hf":
            return config.runtime
        most = as_count("max_instances", rendered_number("max_instances", self.max_instances, integer=True))
        uneven = [n for n in range(1, most + 1) if config.batch_size % n]
        if self.backend == "local" and uneven:  # a local instance is one process: the world size is the count
            raise JobError(f"training_config's batch_size={config.batch_size} is split evenly across the job's "
                           f"processes, and a world size of {uneven[0]} (max_instances={most}) does not divide it: choose a "
                           f"batch_size that 1..{most} all divide, or a smaller max_instances")
        return config.runtime

    def _training_env(self) -> dict[str, str]:
        """The instances' environment: the Hugging Face token's secret reference, where given."""
        if not self.hf_token_secret:
            return {}
        if self.backend not in CLOUD_OPTIONS:
            raise JobError(
                f"hf_token_secret is read on cloud instances (ec2, gce), not with backend={self.backend!r}; "
                "locally, set HF_TOKEN in the worker's environment instead"
            )
        return {HF_TOKEN_SECRET: str(self.hf_token_secret)}

    def _backend_spec(self) -> BackendSpec:
        """The backend and its options; a cloud pool defaults to the zone of its name."""
        options = dict(self.backend_options or {})
        type_option, pools_option = CLOUD_OPTIONS.get(self.backend, (None, None))
        if type_option and self.instance_type:
            options.setdefault(type_option, self.instance_type)
        if pools_option:
            options.setdefault(pools_option, {pool: pool for pool in self._pools()})
        return BackendSpec(self.backend, self.compute_conn_id, options)

    # -- the slot loop -------------------------------------------------------------------------

    def _drive(self, context: Context, spec: BackendSpec, driver: RunDriver, reattach: bool) -> dict[str, Any]:
        """Step the run; between steps defer to the trigger, or without a triggerer wait here.

        A deferral lasts at least ``[spotsched] min_deferral_seconds`` (see
        :mod:`~airflow_provider_spotsched.triggers.spot_job`): a shorter wait, a boundary that a
        slow step left near, is waited here too.
        """
        self._running = driver

        def on_step(run: OnlineRun) -> None:
            self._push_log(context, run, final=False)

        if not self.deferrable:
            driver.run_to_completion(reattach, self.poll_interval, on_step)
        else:
            least = min_deferral_seconds()
            step = driver.run_until(reattach, self.poll_interval, on_step, lambda wait: self._may_defer(wait, least))
            if not isinstance(step, Finished):
                self.defer(trigger=self._trigger(spec, driver, step, least), method_name="execute_slot")
        self._push_log(context, driver.run, final=True)
        return self._finish(context, driver)

    def _may_defer(self, wait: Wait, least_seconds: float) -> bool:
        """Whether ``wait`` lasts long enough to defer; a shorter one is logged and waited here."""
        left = (wait.boundary - datetime.now(timezone.utc)).total_seconds()
        if left >= least_seconds:
            return True
        self.log.info("waiting in the worker: the next boundary is %.1f s away, under the %g s a deferral lasts "
                      "([spotsched] min_deferral_seconds)", left, least_seconds)
        return False

    def _trigger(self, spec: BackendSpec, driver: RunDriver, wait: Wait, least_seconds: float) -> SpotJobTrigger:
        return SpotJobTrigger(
            backend=spec.to_dict(),
            job=driver.training.to_dict(),
            boundary=wait.boundary.isoformat(),
            poll_interval=self.poll_interval or wait.poll_interval,
            known_preemptions=wait.known_preemptions,
            known_failures=wait.known_failures,
            not_before=(datetime.now(timezone.utc) + timedelta(seconds=least_seconds)).isoformat(),
        )

    def _finish(self, context: Context, driver: RunDriver) -> dict[str, Any]:
        """The run is done: learn its selector round, announce the adapter, return the result."""
        run = driver.run
        result = run.result()
        self.log.info("done: %s", json.dumps(result))
        if run.member is not None:
            document = store_round(
                lambda: Variable.get(self.selector_state_variable, default=None),
                lambda doc: Variable.set(self.selector_state_variable, doc, serialize_json=True),
                run,
                self._selector_store,
            )
            last_round = document.get("last_round") or {}
            if last_round.get("job_id") == run.config.job_id:  # not when dropped (store_round warned) or closed before
                self.log.info("selector round stored in %s: %s", self._selector_store, last_round)
        emit_adapter_event(context, self.adapter_asset, result, adapter_location(driver.training.checkpoint_uri))
        return result

    @property
    def _selector_store(self) -> str:
        """The selector's Variable as errors name it."""
        return f"Variable {self.selector_state_variable!r}"

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def _store(context: Context) -> Any:
        store = context.get("task_state_store")
        if store is None:
            raise AirflowException("task_state_store is missing from the context: this operator needs Airflow >= 3.3")
        return store

    def _persist(self, context: Context, spec: BackendSpec) -> Callable[[dict[str, Any]], None]:
        """Where the driver's state goes: the task's state store, with the backend to rebuild."""
        store = self._store(context)

        def persist(state: dict[str, Any]) -> None:
            retrying(lambda: store.set(STATE_KEY, {**state, "backend": spec.to_dict()}), "saving the run state")

        return persist

    def _load(self, context: Context) -> Callable[[], Any]:
        """What the task's state store holds for the run (``None``: no run yet)."""
        store = self._store(context)
        return lambda: retrying(lambda: store.get(STATE_KEY), "reading the run state")

    def _push_log(self, context: Context, run: OnlineRun, final: bool) -> None:
        """The decision log to XCom; mid-run a push that keeps failing waits for the next slot's."""
        try:
            retrying(lambda: context["ti"].xcom_push(key="decision_log", value=run.decision_log()),
                     "pushing the decision log")
        except Exception as error:
            if final:
                raise
            self.log.warning("decision log not pushed (%s); the next slot pushes it whole", error)
