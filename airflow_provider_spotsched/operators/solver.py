"""The solver step on its own: state and forecast in, this slot's allocation and the plan out.

For DAGs that want each step visible, this operator makes one decision of an
:class:`~airflow_provider_spotsched.scheduling.online.OnlineRun`, the same object the fine-tune
operator drives: it adds no scheduling logic of its own, it maps XCom and parameters onto the
run and its policy and the decision back onto XCom. The run's state travels between slots as an
XCom (key ``run_state``), so a DAG that solves every slot keeps CHC's commitments exactly.

A forecast document from
:class:`~airflow_provider_spotsched.operators.forecast.SpotMarketForecastOperator` replaces the
policy's own forecaster at the instant it was made for. The forecasts given so far travel in the
run state too: a resumed run replays its past decisions (policies are deterministic functions of
what they observed), and those must see the same forecasts again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from airflow.sdk import BaseOperator

from airflow_provider_spotsched.forecast.base import Forecast, Forecaster, check_request
from airflow_provider_spotsched.forecast.snapshot import DEFAULT_HISTORY_HOURS, check_history_hours, slot_market_at
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.hooks.rendered import rendered_job, rendered_object
from airflow_provider_spotsched.market.slots import SlotMarket, pool_names
from airflow_provider_spotsched.market.trace import format_timestamp
from airflow_provider_spotsched.operators.fine_tune import max_instances_limit, new_job_id
from airflow_provider_spotsched.operators.forecast import forecast_instant
from airflow_provider_spotsched.scheduling.model import Job, JobError, as_number, check_field, shown
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig
from airflow_provider_spotsched.scheduling.policies import POLICIES

RUN_STATE_KEY = "run_state"


class SpotAllocationSolverOperator(BaseOperator):
    """Decide the slot starting at ``at``; returns ``{"slot", "allocation", "plan", "policy"}``.

    Start a run with ``job`` (the spec's job fields) and ``pools``, or continue one with
    ``run_state``: the ``run_state`` XCom of the previous slot's solver, or a state from
    :meth:`OnlineRun.to_state`. ``plan`` is this slot's allocation followed by the allocations
    the policy has committed to for the next slots.

    :param market: the market (a :class:`MarketSpec`, its dict, or a trace name or path).
    :param job: the job (spec's job JSON fields), to start a run.
    :param pools: the run's pools, to start a run: a list, or one comma-separated string.
    :param run_state: the run to continue (a dict or its JSON; templated).
    :param forecast: a forecast document for ``at`` (a dict or its JSON; templated).
    :param work_done: work units done so far, as measured (templated; default: the last record's).
    :param at: the start of the slot to decide (templated; default the logical date). A run
        continued from a decided slot moves to the next one, which must start at ``at``.
    :param policy: a registered policy (default ``"chc"``).
    :param policy_params: the policy's parameters.
    :param slot_hours: slot length in hours, to start a run.
    :param job_id: the run's id (default: the DAG and task ids with a hash unique to this start; a
        continued run keeps the id in its ``run_state``).
    :param history_hours: hours of market history to read before ``at``: a day or more (the
        market is read as the forecast operator reads it, whatever the policy), at least one slot
        before ``at``'s where a slot is longer; checked against the job's ``slot_hours`` (else this
        operator's) when the DAG is parsed, or when the task starts if a template gives it.
    """

    template_fields: Sequence[str] = ("run_state", "forecast", "work_done", "at", "pools", "job", "policy_params")
    ui_color = "#d5e8d4"

    def __init__(
        self,
        *,
        market: MarketSpec | Mapping[str, Any] | str,
        job: Mapping[str, Any] | None = None,
        pools: Sequence[str] | str | None = None,
        run_state: Mapping[str, Any] | str | None = None,
        forecast: Mapping[str, Any] | str | None = None,
        work_done: float | str | None = None,
        at: datetime | str | None = None,
        policy: str = "chc",
        policy_params: Mapping[str, Any] | None = None,
        slot_hours: float = 1.0,
        job_id: str | None = None,
        history_hours: float = DEFAULT_HISTORY_HOURS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.market = MarketSpec.coerce(market)
        self.job, self.pools, self.run_state, self.forecast = job, pools, run_state, forecast
        self.work_done, self.at = work_done, at
        self.policy, self.policy_params = policy, policy_params
        if policy not in POLICIES:  # policy and slot_hours are no templates: refused when the DAG is parsed
            raise JobError(f"policy={policy!r}: not a registered policy; choose one of {sorted(POLICIES)}")
        check_field("slot_hours", slot_hours)
        as_number("history_hours", history_hours)  # text or a bool refused as such
        run_slot_hours = parsed_slot_hours(job, slot_hours)
        if isinstance(run_slot_hours, (int, float)):  # text may be a template: _start checks it once rendered
            check_field("slot_hours", run_slot_hours)
            check_history_hours(history_hours, run_slot_hours)  # the market is read as a forecast reads it: a day or more
        self.slot_hours, self.job_id, self.history_hours = float(slot_hours), job_id, float(history_hours)

    def execute(self, context: Any) -> dict[str, Any]:
        at = forecast_instant(self.at, context)
        state = rendered_object("run_state", self.run_state)
        forecast = rendered_object("forecast", self.forecast)
        run, forecasts = self._continue(state, at) if state else (self._start(context, at), {})
        if forecast:
            check_forecast(forecast, run, at)
            forecasts[forecast["at"]] = forecast
        policy = run.policy()
        if policy.forecaster is not None:
            policy.forecaster = GivenForecasts(forecasts, policy.forecaster)
        elif forecast:
            self.log.warning("policy %s plans without a forecast; the forecast given is not used", run.policy_label)
        record = run.decide(self._work_done(run), at)
        context["ti"].xcom_push(key=RUN_STATE_KEY, value={"run": run.to_state(), "forecasts": forecasts})
        plan = record.plan or [record.allocation]
        self.log.info("slot %d: %s, plan of %d slot(s) by %s", record.slot, record.allocation, len(plan), run.policy_label)
        return {"slot": record.slot, "allocation": record.allocation, "plan": plan, "policy": run.policy_label}

    def _start(self, context: Any, at: datetime) -> OnlineRun:
        fields = rendered_job("job", self.job)
        if not fields or not self.pools:
            raise JobError("give job (the spec's job fields) and pools to start a run, or run_state to continue one")
        job = Job.from_dict({**fields, "slot_hours": fields.get("slot_hours", self.slot_hours)})
        check_history_hours(self.history_hours, job.slot_hours)  # as __init__ does, for a slot length rendered only now
        config = RunConfig(
            job_id=self.job_id or new_job_id(context["ti"]),
            job=job,
            pools=pool_names(self.pools),
            policy=self.policy,
            policy_params=rendered_object("policy_params", self.policy_params) or {},
            max_instances_limit=max_instances_limit(),
        )
        history = slot_market_at(self.market, at, job.slot_hours, config.pools, self.history_hours)
        return OnlineRun.start(config, history, at)

    def _continue(self, state: Mapping[str, Any], at: datetime) -> tuple[OnlineRun, dict[str, Any]]:
        """The run of ``state``, moved on to the slot starting at ``at`` if its slot is decided."""
        run = OnlineRun.from_state(state.get("run", state))
        forecasts = dict(state.get("forecasts") or {})
        if run.decided:
            following = run.market_now + timedelta(hours=run.market.slot_hours)
            if format_timestamp(at) != format_timestamp(following):
                raise ValueError(f"at {format_timestamp(at)}: the run's next slot starts at {format_timestamp(following)}; set at to it")
            market = slot_market_at(self.market, at, run.market.slot_hours, run.config.pools, self.history_hours)
            run.next_slot(market.spot_price[-1], market.available[-1])
        elif format_timestamp(at) != format_timestamp(run.market_now):
            raise ValueError(
                f"at {format_timestamp(at)}: the run's current slot starts at {format_timestamp(run.market_now)}; set at to it"
            )
        return run, forecasts

    def _work_done(self, run: OnlineRun) -> float:
        if self.work_done is None or self.work_done == "":
            return run.work_done
        try:
            value = float(self.work_done)
        except (TypeError, ValueError):
            raise ValueError(f"work_done must be a number of work units, got {self.work_done!r}") from None
        if not 0 <= value < math.inf:
            raise ValueError(f"work_done must be a finite number >= 0 of work units, got {value!r}")
        return value


class GivenForecasts(Forecaster):
    """Forecast documents by instant; any other instant goes to the policy's own forecaster."""

    name = "given"

    def __init__(self, documents: Mapping[str, Mapping[str, Any]], fallback: Forecaster) -> None:
        self.documents, self.fallback = documents, fallback

    def forecast(self, past: SlotMarket, horizon: int) -> Forecast:
        check_request(past, horizon)
        now = past.start + timedelta(hours=(past.num_slots - 1) * past.slot_hours)
        document = self.documents.get(format_timestamp(now))
        if document is None:
            return self.fallback.forecast(past, horizon)
        pools = [document["pools"][p] for p in past.pools]
        given = min(len(p["spot_price"]) for p in pools)
        if given < horizon:
            raise ValueError(
                f"the forecast for {document['at']} covers {given} slot(s) and the policy plans {horizon}; "
                f"raise the forecast operator's horizon to >= {horizon}"
            )
        return Forecast(
            spot_price=np.array([p["spot_price"][:horizon] for p in pools], float).T,
            available=np.array([p["available"][:horizon] for p in pools], float).T,
            models=tuple(str(p["model"]) for p in pools),
        )


def parsed_slot_hours(job: Mapping[str, Any] | str | None, slot_hours: float) -> object:
    """The slot length a run started from ``job`` decides in, as known when the DAG is parsed: the
    job's ``slot_hours``, which overrides the operator's (:meth:`SpotAllocationSolverOperator._start`),
    else the operator's; ``None`` for a job in text, which a template renders only when the task runs."""
    if isinstance(job, Mapping):
        return job.get("slot_hours", slot_hours)
    return None if job else slot_hours


def check_forecast(document: Mapping[str, Any], run: OnlineRun, at: datetime) -> None:
    """Refuse a forecast made for another instant, slot length or set of pools than the run's."""
    shape = "forecast must be a forecast document (at, slot_hours, pools by name), as SpotMarketForecastOperator returns"
    if "pools" not in document or "at" not in document or "slot_hours" not in document:
        raise ValueError(shape)
    if not isinstance(document["pools"], Mapping) or isinstance(document["slot_hours"], bool) \
            or not isinstance(document["slot_hours"], (int, float)):
        raise ValueError(f"{shape}; got pools={shown(document['pools'])}, slot_hours={shown(document['slot_hours'])}")
    if document["at"] != format_timestamp(at):
        raise ValueError(f"the forecast was made at {document['at']}, this slot starts at {format_timestamp(at)}; forecast at the same at")
    if float(document["slot_hours"]) != run.market.slot_hours:
        raise ValueError(f"the forecast's slot_hours {document['slot_hours']} differs from the run's {run.market.slot_hours}")
    missing = [p for p in run.config.pools if p not in document["pools"]]
    if missing:
        raise ValueError(f"the forecast has no pool(s) {missing}; forecast the run's pools {list(run.config.pools)}")
    fields = {"model", "spot_price", "available"}
    partial = [p for p in run.config.pools if not isinstance(document["pools"][p], Mapping) or not fields <= set(document["pools"][p])]
    if partial:
        raise ValueError(f"the forecast's pool(s) {partial} lack {sorted(fields)}; {shape}")

