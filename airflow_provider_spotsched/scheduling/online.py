"""A policy driven one real slot at a time, with a state that survives the caller's restarts.

The simulator owns the whole market up front; a real run sees one slot's market at each slot
boundary, measures progress instead of modelling it, and is driven by a caller that may stop
between slots (an Airflow operator defers and resumes in a new process). :class:`OnlineRun`
keeps everything such a caller needs in one JSON document (:meth:`OnlineRun.to_state`):

- the market seen so far (history before submission, then one row per slot boundary),
- one :class:`SlotRecord` per decision: market, forecast, plan, decided and applied allocation,
  measured work, cost so far (the decision log shown in the UI),
- the selector's choice of member for this run, when the policy is the selector.

A policy object is not serialised: a resumed run rebuilds it and replays the recorded
observations (policies are deterministic functions of what they observed), so CHC's commitments
and the selector's member carry over exactly.

Billing follows the spec: a slot costs ``slot_hours`` x the hourly price of the allocation
applied at its start, and the completion slot only up to the completion instant. Progress is
what the training runtime reports, not ``H(n)``; ``H(n)`` remains the policies' planning model,
with its throughput re-estimated each slot from the work measured in the slots before
(:mod:`~airflow_provider_spotsched.scheduling.throughput_estimate`), recorded per slot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast import LIVE_FORECASTERS, make_forecaster
from airflow_provider_spotsched.market.slots import SlotMarket, pool_names
from airflow_provider_spotsched.market.trace import format_instant, format_timestamp, parse_timestamp
from airflow_provider_spotsched.scheduling.model import DEFAULT_MAX_INSTANCES_LIMIT, Allocation, Job, JobError, as_count, is_number
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import JobMarket
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy
from airflow_provider_spotsched.scheduling.throughput_estimate import (
    ThroughputEstimate,
    throughput_from_dict,
    throughput_to_dict,
)
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput

STATE_VERSION = 1
LOG_FORECAST_SLOTS = 24
# The shortest span between two progress reports that the throughput estimate times by their own
# stamps: a stamp may be rounded to the second (the project's runtimes write milliseconds, a user's
# command may not), which errs by at most a tenth of this.
MIN_STAMPED_SECONDS = 10.0


class BudgetError(JobError):
    """The budget cap cannot cover the job, or the next slot would exceed it."""


@dataclass(frozen=True)
class RunConfig:
    """What a real run is: the job, its pools, the policy, a budget cap and the clock.

    :param job_id: stable across retries of the same run, unique to it (it tags every instance).
    :param pools: the spot pools, each once (:func:`~airflow_provider_spotsched.market.slots.pool_names`).
    :param policy: a registered policy name; ``"selector"`` learns across runs.
    :param forecaster: the model whose forecast is logged each slot (the policy uses its own).
    :param budget: USD cap on the run's cost, or ``None``.
    :param seconds_per_slot: wall-clock seconds per slot (``slot_hours`` x 3600 for a real
        market; a few seconds when a trace is replayed on an accelerated clock).
    :param max_instances_limit: the most instances the job may ask for (a deployment's cap).
    """

    job_id: str
    job: Job
    pools: tuple[str, ...]
    policy: str = "selector"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    forecaster: str = "persistence"
    budget: float | None = None
    seconds_per_slot: float | None = None
    max_instances_limit: int = DEFAULT_MAX_INSTANCES_LIMIT

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pools", pool_names(self.pools))
        except ValueError as exc:
            raise JobError(str(exc)) from None
        if self.budget is not None:
            check_budget(self.budget)
        if self.seconds_per_slot is not None and not self.seconds_per_slot > 0:
            raise JobError(f"seconds_per_slot must be > 0, got {self.seconds_per_slot!r}")
        if as_count("max_instances_limit", self.max_instances_limit) < 1:
            raise JobError(f"max_instances_limit={self.max_instances_limit}: must be >= 1; give the most instances a job may use")
        self.job.check_instances(self.max_instances_limit)

    @property
    def wall_seconds_per_slot(self) -> float:
        return self.seconds_per_slot or self.job.slot_hours * 3600.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["job"] = self.job.to_dict()
        data["pools"] = list(self.pools)
        data["policy_params"] = dict(self.policy_params)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        fields = dict(data)
        fields["job"] = Job.from_dict(fields["job"])
        fields["pools"] = tuple(fields["pools"])
        return cls(**fields)


def check_budget(budget: object) -> None:
    """Refuse a budget that is no number of USD > 0 (``True`` is no budget)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise BudgetError(f"budget={budget!r}: not a number of USD > 0; give the run's cost cap, or None for none")


def allocation_to_dict(allocation: Allocation, pools: Sequence[str]) -> dict[str, Any]:
    """``{"spot": {pool: n}, "on_demand": n}``: the decision log's form of an allocation."""
    return {"spot": {p: n for p, n in zip(pools, allocation.spot) if n}, "on_demand": allocation.on_demand}


def allocation_from_dict(data: Mapping[str, Any], pools: Sequence[str]) -> Allocation:
    """The inverse of :func:`allocation_to_dict`: counts in the order of ``pools``."""
    spot = data.get("spot", {})
    return Allocation(tuple(int(spot.get(p, 0)) for p in pools), int(data.get("on_demand", 0)))


@dataclass
class SlotRecord:
    """One decision: the entry of the run's decision log (JSON-ready)."""

    slot: int
    time: str
    market_time: str
    market: dict[str, dict[str, float]]
    on_demand_price: float
    forecast: dict[str, dict[str, list[float]]] | None
    plan: list[dict[str, Any]] | None
    allocation: dict[str, Any]
    applied: dict[str, Any] | None
    work_done: float
    work_total: float
    cost_so_far: float
    on_demand_cost_so_far: float
    preemptions: int
    # Later fields have defaults, so that a state stored before they existed still loads.
    preempted_by_pool: dict[str, int] = field(default_factory=dict)  # preemptions so far, per pool
    training: dict[str, Any] | None = None  # the runtime's last report: loss, samples/s, step, world size
    next_decision: str | None = None  # wall-clock time of the next slot boundary, once known
    deadline_hours: float | None = None  # the job's deadlines, for a live view that has no result yet
    hard_deadline_hours: float | None = None
    throughput: dict[str, float] | None = None  # H(n) the policy planned on: the estimate; None = the declared one


class OnlineRun:
    """Decide, record, bill: one slot at a time (see the module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        market: SlotMarket,
        history_slots: int,
        started: datetime,
        records: list[SlotRecord] | None = None,
        member: Mapping[str, Any] | None = None,
        selector_start: Mapping[str, Any] | None = None,
        cost: float = 0.0,
        completion_hours: float | None = None,
    ) -> None:
        self.config, self.market, self.history_slots, self.started = config, market, history_slots, started
        self.records = records or []
        self.member = dict(member) if member else None
        self.selector_start = dict(selector_start) if selector_start else None
        self.cost = cost
        self.completion_hours = completion_hours
        self._policy: Policy | None = None
        self._decided = 0  # decisions the live policy object has seen

    # -- starting -------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: RunConfig,
        history: SlotMarket,
        now: datetime,
        selector_state: Mapping[str, Any] | None = None,
    ) -> OnlineRun:
        """Check the job against the market and the budget; ``history`` ends with slot 0's state.

        ``history``'s on-demand price is what the run bills, budgets and compares with: the job's,
        the cheapest of its pools' in force at submission (what ``MarketFeed.history(now, pools)`` gives).

        Raises a :class:`JobError` (or :class:`BudgetError`) naming the field to fix, before
        anything is launched. With a stored ``selector_state``, ``policy_params`` must be empty
        or ask for the stored selector's own settings.
        """
        job = config.job
        job.check_feasible(config.max_instances_limit)
        if (run_policy := make_policy(config.policy, config.policy_params)).uses_future:
            raise JobError(
                f"policy={run_policy.label} needs the future market: it is a reference for simulations; "
                "choose selector, chc, prediction-free, uniform-progress, greedy or on-demand"
            )
        if run_policy.single_instance and job.max_instances != 1:
            raise JobError(
                f"max_instances={job.max_instances}: policy={run_policy.label} runs a single instance; "
                "set max_instances=1, or choose a multi-instance policy such as selector or chc"
            )
        if getattr(make_forecaster(config.forecaster), "uses_future", False):
            raise JobError(
                f"forecaster={config.forecaster!r}: needs the future market, a reference for simulations; "
                f"choose one of {list(LIVE_FORECASTERS)}"
            )
        missing = [p for p in config.pools if p not in history.pools]
        if missing:
            raise JobError(f"unknown pool(s) {missing}; the market offers {list(history.pools)}")
        history = _select(history, config.pools)
        _check_budget(config, history)
        run = cls(config, history, history.num_slots - 1, now)
        if config.policy == "selector":
            selector = _selector(config.policy_params, selector_state)
            played = selector.open_round(job, JobMarket(run.market, run.history_slots))  # warm-up, then the draw
            entry = selector.pool[played.member_index]
            run.member = {"policy": entry["policy"], "params": entry["params"], "label": played.label, "probability": played.probability}
            # The run carries its round and closes it on the freshest stored state (selector_store).
            selector.drop_round()
            run.selector_start = selector.to_state()
        return run

    # -- the slot loop --------------------------------------------------------------------

    @property
    def slot(self) -> int:
        """The current slot: the last market row, counted from submission."""
        return self.market.num_slots - 1 - self.history_slots

    @property
    def decided(self) -> bool:
        """Whether the current slot's allocation is decided."""
        return bool(self.records) and self.records[-1].slot == self.slot

    @property
    def market_now(self) -> datetime:
        """The market instant at which the current slot starts."""
        return self.market.start + timedelta(hours=(self.market.num_slots - 1) * self.market.slot_hours)

    @property
    def work_done(self) -> float:
        return self.records[-1].work_done if self.records else 0.0

    @property
    def preemptions(self) -> int:
        return self.records[-1].preemptions if self.records else 0

    @property
    def policy_label(self) -> str:
        return self.member["label"] if self.member else self.policy().label

    def policy(self) -> Policy:
        """The policy playing this run: the selector's member, or the configured policy."""
        if self._policy is None:
            entry = self.member or {"policy": self.config.policy, "params": dict(self.config.policy_params)}
            self._policy = make_policy(entry["policy"], entry["params"])
            self._policy.reset(self.config.job)
            self._decided = 0
        return self._policy

    def decide(
        self,
        work_done: float,
        now: datetime,
        preemptions: int = 0,
        preempted_by_pool: Mapping[str, int] | None = None,
        training: Mapping[str, Any] | None = None,
    ) -> SlotRecord:
        """This slot's allocation from the market row just observed and the measured work.

        ``preempted_by_pool`` and ``training`` (what the runtime last reported) go into the
        record for the UI; the policy decides on ``work_done`` alone.
        """
        if self.completion_hours is not None:
            raise ValueError("the run has completed; nothing is decided after completion")
        if self.decided:
            raise ValueError(f"slot {self.slot} is already decided; observe the next slot first")
        job, pools = self.config.job, self.config.pools
        observation = self._observation(self.slot, work_done, now, training)
        policy: Policy | None = None
        if work_done >= job.work:
            # All the work is checkpointed, yet the runtime is not running to finish (it was stopped on its
            # way out): min_instances on-demand instances let it see that and exit 0. No policy plans
            # a job with no work left.
            allocation = Allocation((0,) * len(pools), job.min_instances)
        else:
            policy = self.policy()
            for record in self.records[self._decided :]:  # a resumed run replays what it observed
                if record.work_done < job.work:
                    policy.decide(self._observation(record.slot))
                self._decided += 1
            allocation = policy.decide(observation)
            self._decided += 1
        allocation.check(job, self.market.available[-1])
        hourly = allocation.hourly_price(self.market.spot_price[-1], self.market.on_demand_price)
        if self.config.budget is not None and self.cost + hourly * job.slot_hours > self.config.budget + 1e-9:
            raise BudgetError(
                f"slot {self.slot} would bring the cost to {self.cost + hourly * job.slot_hours:.2f} USD, over "
                f"budget={self.config.budget:g}; raise the budget or extend deadline_hours"
            )
        record = SlotRecord(
            slot=self.slot,
            time=format_instant(now),
            market_time=format_timestamp(self.market_now),
            market=self._market_log(),
            on_demand_price=float(self.market.on_demand_price),
            forecast=self._forecast(),
            plan=([allocation_to_dict(a, pools) for a in policy.planned()] or None) if policy is not None else None,
            allocation=allocation_to_dict(allocation, pools),
            applied=None,
            work_done=float(work_done),
            work_total=float(job.work),
            cost_so_far=self.cost,
            on_demand_cost_so_far=self._on_demand_cost_until(self.slot),
            preemptions=int(preemptions),
            preempted_by_pool={pool: int(n) for pool, n in (preempted_by_pool or {}).items()},
            training=dict(training) if training is not None else None,
            deadline_hours=job.deadline_hours,
            hard_deadline_hours=job.hard_deadline_hours,
            throughput=throughput_to_dict(observation.job.throughput),
        )
        if record.plan is not None:
            record.plan.insert(0, record.allocation)
        self.records.append(record)
        return record

    def applied(self, allocation: Allocation) -> None:
        """What the backend actually runs for the current slot (after reconcile); it is billed."""
        if not self.records or self.records[-1].slot != self.slot:
            raise ValueError("decide the current slot before recording what was applied")
        self.records[-1].applied = allocation_to_dict(allocation, self.config.pools)

    def note_preemptions(self, total: int, by_pool: Mapping[str, int]) -> None:
        """Preemptions the backend reported after the current slot was decided (counts only grow)."""
        record = self.records[-1]
        record.preemptions = max(record.preemptions, int(total))
        for pool, n in by_pool.items():
            record.preempted_by_pool[pool] = max(record.preempted_by_pool.get(pool, 0), int(n))

    def note_next_decision(self, at: datetime) -> None:
        """When the next slot boundary falls on the wall clock (shown while the run is live)."""
        self.records[-1].next_decision = format_instant(at)

    def pass_unwatched(
        self,
        spot_price: Sequence[float] | np.ndarray,
        available: Sequence[int] | np.ndarray,
        now: datetime,
        work_done: float,
        released: bool = False,
    ) -> SlotRecord:
        """The next slot went by with nobody deciding (the job ended while no caller was stepping).

        The allocation in force ran on, capped by the slot's spot capacity: the slot is recorded
        with it as decided and applied, so it is billed like any other. A job whose instances were
        all ``released`` (a kill, a failed try) ran nothing: the slot is recorded idle.
        """
        if not self.records:
            raise ValueError("no slot has been decided: there is no allocation in force to run on")
        in_force = Allocation.idle(len(self.config.pools)) if released else self.allocation_in_force()
        self.observe(spot_price, available)
        ran = allocation_to_dict(self._capped_by_capacity(in_force), self.config.pools)
        record = replace(
            self.records[-1], slot=self.slot, time=format_instant(now), market_time=format_timestamp(self.market_now),
            market=self._market_log(), forecast=None, plan=None, allocation=ran, applied=ran, work_done=float(work_done),
            cost_so_far=self.cost, on_demand_cost_so_far=self._on_demand_cost_until(self.slot), next_decision=None,
        )
        self.records.append(record)
        return record

    def allocation_in_force(self) -> Allocation:
        """The last allocation the backend was asked to run (none: nothing runs)."""
        in_force = next((r.applied for r in reversed(self.records) if r.applied is not None), {})
        return allocation_from_dict(in_force, self.config.pools)

    def _capped_by_capacity(self, allocation: Allocation) -> Allocation:
        """``allocation`` as the current slot's spot capacity lets it run (spot beyond it was taken back)."""
        capacity = self.market.available[-1]
        return Allocation(tuple(min(n, int(a)) for n, a in zip(allocation.spot, capacity)), allocation.on_demand)

    def ran_on_undelivered(self, released: bool = False) -> None:
        """The current slot's decision never reached the backend (the caller stopped in between):
        the allocation in force ran on through it, capped by its spot capacity, and is billed; a job
        whose instances were all ``released`` (a kill, a failed try) ran nothing in it."""
        if self.decided and self.records[-1].applied is None:
            in_force = Allocation.idle(len(self.config.pools)) if released else self.allocation_in_force()
            self.applied(self._capped_by_capacity(in_force))

    def next_slot(self, spot_price: Sequence[float] | np.ndarray, available: Sequence[int] | np.ndarray) -> None:
        """Move past the decided current slot; a decision nobody reported on is billed as decided.

        For callers with no backend to ask what ran (the step-by-step solver operator).
        """
        if not self.decided:
            raise ValueError(f"slot {self.slot} is not decided yet; decide it before moving to the next")
        if self.records[-1].applied is None:
            self.applied(allocation_from_dict(self.records[-1].allocation, self.config.pools))
        self.observe(spot_price, available)

    def observe(self, spot_price: Sequence[float] | np.ndarray, available: Sequence[int] | np.ndarray) -> None:
        """The next slot boundary: bill the slot just ended and add the new market row."""
        self.cost += self._slot_bill(self.config.job.slot_hours)
        self.market = SlotMarket(
            pools=self.market.pools,
            start=self.market.start,
            slot_hours=self.market.slot_hours,
            spot_price=np.vstack([self.market.spot_price, np.asarray(spot_price, float)[None, :]]),
            available=np.vstack([self.market.available, np.asarray(available, int)[None, :]]),
            on_demand_price=self.market.on_demand_price,
        )

    def complete(self, completion_hours: float) -> None:
        """The job finished at ``completion_hours`` after submission, inside the current slot."""
        slot_start = self.slot * self.config.job.slot_hours
        if not slot_start - 1e-9 <= completion_hours <= slot_start + self.config.job.slot_hours + 1e-9:
            raise ValueError(f"completion at {completion_hours:.4g} h lies outside slot {self.slot}")
        self.cost += self._slot_bill(max(completion_hours - slot_start, 0.0))
        self.completion_hours = completion_hours

    def hours_at(self, now: datetime) -> float:
        """Hours after submission on the market's clock at wall-clock ``now``."""
        return self._market_hours(self.started, now)

    # -- the result -----------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        """The run's result: the operator's return value."""
        job = self.config.job
        reference = on_demand_cost(job, self.market.on_demand_price)
        value = job.value_at(self.completion_hours)
        return {
            "job_id": self.config.job_id,
            "policy": self.policy_label,
            "cost": self.cost,
            "on_demand_cost": reference,
            "savings": reference - self.cost,
            "savings_fraction": (reference - self.cost) / reference if reference else 0.0,
            "completion_hours": self.completion_hours,
            "deadline_hours": job.deadline_hours,
            "deadline_met": self.completion_hours is not None and self.completion_hours <= job.deadline_hours + 1e-9,
            "preemptions": self.preemptions,
            "preemptions_by_pool": dict(self.records[-1].preempted_by_pool) if self.records else {},
            "hard_deadline_hours": job.hard_deadline_hours,
            "hard_deadline_met": self.completion_hours is not None
            and self.completion_hours <= job.hard_deadline_hours + 1e-9,
            "budget": self.config.budget,
            "value": value,
            "utility": value - self.cost,
            "slots": len(self.records),
        }

    def realised_market(self) -> JobMarket:
        """History and the slots seen, padded to the job's horizon by persistence (for replays)."""
        need = self.history_slots + self.config.job.horizon_slots - self.market.num_slots
        pad = max(need, 0)
        return JobMarket(
            SlotMarket(
                pools=self.market.pools,
                start=self.market.start,
                slot_hours=self.market.slot_hours,
                spot_price=np.vstack([self.market.spot_price] + [self.market.spot_price[-1:]] * pad),
                available=np.vstack([self.market.available] + [self.market.available[-1:]] * pad),
                on_demand_price=self.market.on_demand_price,
            ),
            self.history_slots,
        )

    def realised_throughput(self) -> TrueThroughput:
        """The throughput the job ran at, for replays: the declared one times the mean measured
        ratio over the slots the estimate reads, weighted by their hours alone (no prior, no decay,
        no confidence bound: those make the planning estimate cautious, while a replay wants what
        happened). The declared one when no slot was measured."""
        if not self.records:
            return TrueThroughput()
        last = self.records[-1]
        unweighted = ThroughputEstimate(self.config.job.throughput, prior_hours=0.0, half_life_hours=math.inf)
        measured = self._estimate(last.work_done, parse_timestamp(last.time), last.training, unweighted)
        return TrueThroughput(max(measured.shrunk_factor, 1e-3)) if measured.weight > 0 else TrueThroughput()

    def decision_log(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]

    # -- state ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything needed to resume in another process (JSON-serialisable)."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "market": {
                "pools": list(self.market.pools),
                "start": format_timestamp(self.market.start),
                "slot_hours": self.market.slot_hours,
                "on_demand_price": self.market.on_demand_price,
                "spot_price": self.market.spot_price.tolist(),
                "available": self.market.available.astype(int).tolist(),
            },
            "history_slots": self.history_slots,
            "started": self.started.isoformat(),
            "records": self.decision_log(),
            "member": self.member,
            "selector_start": self.selector_start,
            "cost": self.cost,
            "completion_hours": self.completion_hours,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> OnlineRun:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"run state must be a version-{STATE_VERSION} document from OnlineRun.to_state()")
        m = state["market"]
        market = SlotMarket(
            pools=tuple(m["pools"]),
            start=parse_timestamp(m["start"]),
            slot_hours=float(m["slot_hours"]),
            spot_price=np.asarray(m["spot_price"], float).reshape(-1, len(m["pools"])),
            available=np.asarray(m["available"], int).reshape(-1, len(m["pools"])),
            on_demand_price=float(m["on_demand_price"]),
        )
        return cls(
            RunConfig.from_dict(state["config"]),
            market,
            int(state["history_slots"]),
            datetime.fromisoformat(state["started"]),
            [SlotRecord(**r) for r in state["records"]],
            state.get("member"),
            state.get("selector_start"),
            float(state["cost"]),
            state.get("completion_hours"),
        )

    # -- internals ------------------------------------------------------------------------

    def _observation(
        self,
        slot: int,
        work_done: float | None = None,
        now: datetime | None = None,
        training: Mapping[str, Any] | None = None,
    ) -> Observation:
        """What the policy knew at ``slot``: recorded for past slots, ``work_done`` (reported
        with ``training``) for this one.

        The job carries the throughput the policy planned on: the recorded estimate for a past
        slot (the declared one in a log from before the estimate), a fresh one for this slot.
        """
        row = self.history_slots + slot
        job = self.config.job
        if slot < len(self.records) and self.records[slot].slot == slot:
            record = self.records[slot]
            work, cost = record.work_done, record.cost_so_far
            if record.throughput is not None:
                job = replace(job, throughput=throughput_from_dict(record.throughput))
        else:
            work, cost = (work_done or 0.0), self.cost
            job = self._estimate(work, now, training).job(job)
        previous = Allocation.idle(len(self.config.pools))
        applied = self.records[slot - 1].applied if slot > 0 else None
        if applied is not None:
            previous = allocation_from_dict(applied, self.config.pools)
        return Observation(
            job=job,
            slot=slot,
            past=self.market.prefix(row + 1),
            past_offset=self.history_slots,
            work_done=work,
            cost_so_far=cost,
            previous=previous,
            declared_throughput=self.config.job.throughput,
        )

    def _estimate(
        self,
        work_done: float,
        now: datetime | None,
        training: Mapping[str, Any] | None = None,
        estimate: ThroughputEstimate | None = None,
    ) -> ThroughputEstimate:
        """The throughput measured over the slots decided so far, ``work_done`` at the current one.

        A slot's work is the measured work at the next decision less that at its own. Its hours
        run between the two progress reports those decisions read, by the reports' own stamps
        where they can be trusted (:meth:`_measured_span`), else between the decisions (``now``
        for the current one; the slot's length where it is missing). A report is as old as the
        last checkpoint: timed by the decisions, one slot reads slow and the next fast, and the
        spread drags the estimate's lower bound down. A slot that (re)starts workers is measured
        from when they resumed training, by the runtime's resume stamp (:meth:`_resumed_span`):
        its start (instances, image, model load) is not H(n), and a slow one read as throughput
        sent the demo to on-demand for good; without the stamp it is skipped. Skipped too: a
        slot with nothing recorded as applied; one with a preemption, whose lost instances and
        work rolled back to a checkpoint say nothing about H(n); and one timed over less than half
        a slot, such as the slots a re-attached run decides back to back after a gap: the work
        of the gap falls to the slot before, and the few samples left over a millisecond, read
        as a rate, spread the measurements so far that the lower bound hit its floor.

        The slots go into ``estimate`` when one is given (another prior or weighting), else into
        a fresh planning estimate.
        """
        job, pools = self.config.job, self.config.pools
        estimate = estimate or ThroughputEstimate(job.throughput)
        readings = [_Reading.of(r.work_done, parse_timestamp(r.time), r.training) for r in self.records]
        readings.append(_Reading.of(work_done, now, training))
        previous, preemptions, decided_before = Allocation.idle(len(pools)), 0, None
        for record, start, end in zip(self.records, readings, readings[1:]):
            applied = allocation_from_dict(record.applied or {}, pools)
            if record.applied is not None and record.preemptions <= preemptions:
                if applied == previous:
                    hours, work = self._measured_span(decided_before, start, end), end.work - start.work
                else:
                    hours, work = self._resumed_span(start, end)
                if hours >= job.slot_hours / 2:
                    estimate.observe(applied.total, hours, max(work, 0.0))
            previous, preemptions, decided_before = applied, record.preemptions, start.decided
        return estimate

    def _measured_span(self, decided_before: datetime | None, start: _Reading, end: _Reading) -> float:
        """Market hours between two readings.

        The stamps time the work exactly when the first was written after the slot before began
        (``decided_before``: the measured allocation already ran then), the second after the
        first decision, neither after its own decision, and they lie at least
        :data:`MIN_STAMPED_SECONDS` apart. Otherwise the decisions time it.
        """
        start_decided, start_stamp, end_decided, end_stamp = start.decided, start.stamp, end.decided, end.stamp
        if start_decided is None or end_decided is None:
            return self.config.job.slot_hours
        if (
            decided_before is not None
            and start_stamp is not None
            and end_stamp is not None
            and decided_before <= start_stamp <= start_decided <= end_stamp <= end_decided
            and (end_stamp - start_stamp).total_seconds() >= MIN_STAMPED_SECONDS
        ):
            return self._market_hours(start_stamp, end_stamp)
        return self._market_hours(start_decided, end_decided)

    def _resumed_span(self, start: _Reading, end: _Reading) -> tuple[float, float]:
        """Market hours and work of a slot that (re)started workers, from when they resumed training
        (the end reading's resume stamp and the work it resumed from) to the work the end reading
        stamps; ``(0, 0)``, no measurement, unless the resume came after the slot's decision, the
        work's stamp after the resume and not after the decision that read it, at least
        :data:`MIN_STAMPED_SECONDS` apart."""
        resumed, stamp = end.resumed, end.stamp
        if (
            start.decided is None
            or end.decided is None
            or resumed is None
            or stamp is None
            or end.resumed_work is None
            or not start.decided <= resumed <= stamp <= end.decided
            or (stamp - resumed).total_seconds() < MIN_STAMPED_SECONDS
        ):
            return 0.0, 0.0
        return self._market_hours(resumed, stamp), end.work - end.resumed_work

    def _market_hours(self, start: datetime, end: datetime) -> float:
        """Market hours between two wall-clock instants of this run."""
        return (end - start).total_seconds() / self.config.wall_seconds_per_slot * self.config.job.slot_hours

    def _slot_bill(self, hours: float) -> float:
        record = self.records[-1] if self.records else None
        if record is None or record.applied is None or record.slot != self.slot:
            return 0.0
        applied = allocation_from_dict(record.applied, self.config.pools)
        return hours * applied.hourly_price(self.market.spot_price[-1], self.market.on_demand_price)

    def _market_log(self) -> dict[str, dict[str, float]]:
        """The current slot's market, per pool, as the decision log shows it."""
        return {
            p: {"spot_price": float(self.market.spot_price[-1, m]), "available": int(self.market.available[-1, m])}
            for m, p in enumerate(self.config.pools)
        }

    def _on_demand_cost_until(self, slot: int) -> float:
        """What N_max on-demand instances from slot 0 would have cost by the start of ``slot``."""
        job = self.config.job
        reference = on_demand_cost(job, self.market.on_demand_price)
        return min(reference, slot * job.slot_hours * job.max_instances * self.market.on_demand_price)

    def _forecast(self) -> dict[str, dict[str, list[float]]] | None:
        remaining = self.config.job.horizon_slots - self.slot - 1
        if remaining < 1:
            return None
        forecaster = make_forecaster(self.config.forecaster, slot_hours=self.market.slot_hours)
        forecast = forecaster.forecast(self.market, min(LOG_FORECAST_SLOTS, remaining))
        return {
            p: {"spot_price": forecast.spot_price[:, m].tolist(), "available": forecast.available[:, m].tolist()}
            for m, p in enumerate(self.config.pools)
        }


@dataclass(frozen=True)
class _Reading:
    """What one decision read of the runtime's progress report (:class:`~airflow_provider_spotsched.runtime.contract.Progress`)."""

    work: float  # the checkpointed work
    decided: datetime | None  # when the decision read it
    stamp: datetime | None  # when that work was reached: the report's ``checkpointed``, else when it was written
    resumed: datetime | None  # when the reporting process began training
    resumed_work: float | None  # the work it began from

    @classmethod
    def of(cls, work: float, decided: datetime | None, training: Mapping[str, Any] | None) -> _Reading:
        """A reading of ``training``, the runtime's report; a stamp or count it does not carry, or that
        is no time or number (a runtime of the user's may write anything), is ``None``."""
        report = training or {}
        resumed_work: Any = report.get("resumed_samples")
        return cls(
            work=work,
            decided=decided,
            stamp=_report_stamp(report, "checkpointed") or _report_stamp(report, "updated"),
            resumed=_report_stamp(report, "resumed"),
            resumed_work=float(resumed_work) if is_number(resumed_work) and resumed_work >= 0 else None,
        )


def _report_stamp(report: Mapping[str, Any], name: str) -> datetime | None:
    """The report's stamp ``name``; ``None`` if it carries no readable one."""
    stamp = report.get(name)
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return parse_timestamp(stamp)
    except ValueError:
        return None


def _select(market: SlotMarket, pools: Sequence[str]) -> SlotMarket:
    index = [market.pools.index(p) for p in pools]
    return replace(market, pools=tuple(pools), spot_price=market.spot_price[:, index], available=market.available[:, index])


def _selector(params: Mapping[str, Any], state: Mapping[str, Any] | None) -> SelectorPolicy:
    """The stored selector, or a new one from ``params``.

    A stored selector keeps its settings (its weights are learnt for its pool and its draws
    follow its seed), so ``params`` asking for other settings are refused rather than ignored.
    """
    if not state:
        return SelectorPolicy(**params)
    stored = SelectorPolicy.from_state(state)
    if not params:
        return stored
    differ = stored.differences(SelectorPolicy(**params))
    if differ:
        raise JobError(
            f"policy_params ask for another selector than the stored one ({'; '.join(differ)}). The stored "
            "selector keeps its settings: drop policy_params to keep learning with it, or give another "
            "selector state (selector_state_variable; spotsched run --selector-state) for a new selector"
        )
    return stored


def _check_budget(config: RunConfig, history: SlotMarket) -> None:
    """Refuse a budget below the cheapest conceivable run: all work on spot at today's lowest price."""
    if config.budget is None:
        return
    job = config.job
    cheapest_price = float(min(history.spot_price[-1].min(), history.on_demand_price))
    least = min(
        n * job.work / job.rate(n) for n in range(job.min_instances, job.max_instances + 1) if job.rate(n) > 0
    ) * cheapest_price
    if config.budget + 1e-9 < least:
        raise BudgetError(
            f"budget={config.budget:g} USD cannot cover the job: even at the lowest spot price now "
            f"({cheapest_price:.4g} USD/h) its work costs at least {least:.2f} USD; raise the budget to "
            f">= {math.ceil(least * 100) / 100:.2f}"
        )
