"""A cost guard: follow a prediction-driven policy only while its cost stays near Uniform Progress's.

Forecast-driven plans (CHC, the selector's members) are cheaper than Uniform Progress (UP) on
most jobs, but a wrong forecast can leave a job far behind while spot was there, and the
deadline safety net then buys the rest on demand at several times UP's cost. The guard bounds
that loss, as learning-augmented online algorithms do (follow the prediction while it is
cheap enough, else fall back on the robust algorithm):

- UP runs in shadow on the same market. Prices and availability are exogenous, so the shadow's
  allocations and its cost so far ``C_UP(<=t)`` are exactly what UP would have done and paid.
- Each slot the member's choice stands while, after it,
  ``C(<=t) + pi * gap(t+1) <= C_UP(<=t) + lambda * (C_UP(<=t) + f * (L - W_UP))``, where ``gap``
  is the work by which the job's allocations trail the shadow's, both at the throughput the job
  is now seen to have, ``pi`` the highest on-demand price of a unit of work (what catching up
  could cost if spot never came back), and the bracket a lower bound of UP's final cost: what it
  has paid, and its work left at ``f``, the least a unit of work has cost on the market so far.
  Against UP's cost so far alone the allowance would be nothing at the start of a job, when
  waiting for cheaper capacity pays most.
- Otherwise the member's choice, topped up to as many instances as the shadow runs (the rest on
  the cheapest capacity), runs if it keeps the invariant; else the shadow's allocation. Either
  way it is for that slot only, and the member decides again the next slot. Only when the
  shadow's allocation too would break the bound does UP take over from the job's own state
  (catching up with on-demand while behind), until a choice of the member costs no more than
  tracking and keeps the bound again with a restart to spare. Every decision stays
  deadline-safe, as the member's were.

``docs/guard.md`` states the bound this gives and the assumption it rests on. The guard's factor
``1 + lambda`` is the parameter ``guard``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast.base import Forecaster
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job, Progress, Throughput, advance, shown
from airflow_provider_spotsched.scheduling.planner import CostLimit
from airflow_provider_spotsched.scheduling.policies.chc import CHCPolicy
from airflow_provider_spotsched.scheduling.policies.uniform_progress import UniformProgressPolicy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.rules import cheapest_allocation, is_deadline_safe, safety_net_allocation, still_offered

DEFAULT_GUARD = 1.2
"""The default factor 1 + lambda, from a 1.25 x UP target: a job the guard never hands over costs
at most 1.2 x UP exactly where no price undercuts the market's floor, which leaves 0.05 x UP for
the handover's additive term (see ``docs/guard.md``)."""


def check_guard(guard: object) -> float:
    """``guard`` as a cost factor 1 + lambda >= 1, or a ValueError that names the fix."""
    if isinstance(guard, bool) or not isinstance(guard, (int, float)) or not math.isfinite(guard) or guard < 1:
        raise ValueError(
            f"guard={shown(guard)}: must be a finite number >= 1 (the cost factor 1 + lambda over uniform "
            "progress, e.g. 1.2), or null for no guard"
        )
    return float(guard)


def catch_up_price(job: Job, on_demand_price: float) -> float:
    """``pi``: the most a unit of work costs when the job catches up with the shadow.

    Catching up adds on-demand instances to the shadow's allocation (each adds alpha work units
    per hour) or, while the shadow is idle, runs N_max on-demand; a slot may lose delta hours to
    a restart.
    """
    s = job.slot_hours
    per_instance = max(1.0 / job.throughput.alpha, job.max_instances / job.rate(job.max_instances))
    return on_demand_price * per_instance * s / (s - job.reconfig_overhead_hours)


def handover_margin(job: Job) -> float:
    """Slack, in hours, the member must leave for a handover: catching up at N_max restarts at
    the switch and again whenever the shadow moves pools, and each restart eats delta of the
    slack the deadline safety net needs; one slot and one restart keep the first of those out of
    its reach."""
    return job.slot_hours + job.reconfig_overhead_hours


def handover_allowance(job: Job, on_demand_price: float) -> float:
    """``E``, the bound's additive term once the guard has switched (``docs/guard.md``).

    Two restarts the shadow does not make (at the switch, and when the job drops its extra
    on-demand instances), caught up at ``pi``; the slot that overshoots the shadow; and the
    shadow's last slot, which it pays only in part while a job still behind pays it whole.
    """
    restarts = 2 * job.reconfig_overhead_hours * job.rate(job.max_instances) * catch_up_price(job, on_demand_price)
    return restarts + 2 * on_demand_price * job.max_instances * job.slot_hours


def work_price_floor(job: Job, past: SlotMarket) -> float:
    """The least a unit of work has cost on this market so far: its cheapest spot offer (a pool
    with capacity; the on-demand price if none) at the instance count that gives the most work
    per instance-hour."""
    cheapest = float(np.min(past.spot_price[past.available >= 1], initial=past.on_demand_price))
    n = job.min_instances if job.throughput.beta >= 0 else job.max_instances
    return cheapest * n / job.rate(n)


def allowed_cost(guard: float, job: Job, shadow_cost: Any, shadow_work: Any, floor: Any) -> Any:
    """The invariant's right-hand side: what the job may have spent, catching up included, when
    the shadow has paid ``shadow_cost`` for ``shadow_work`` (numbers, or arrays over slots): its
    cost so far plus lambda x a lower bound of its final cost (that cost so far, and the rest of
    its work at ``floor``, :func:`work_price_floor`; a bound while no later price undercuts it)."""
    rest = np.maximum(job.work - np.asarray(shadow_work, dtype=float), 0.0)
    return shadow_cost + (guard - 1.0) * (shadow_cost + rest * floor)


def topped_up_to(choice: Allocation, instances: int, observation: Observation) -> Allocation | None:
    """``choice`` plus the cheapest capacity left (spot within on-demand prices, then on-demand)
    up to ``instances`` in all; ``None`` if it already holds that many.

    As many instances as the shadow run make as much work as the shadow's allocation (restarts
    aside), so the gap stops growing, while the member keeps its own instances where it put them
    and the rest go where they cost least, not where UP happens to run them.
    """
    missing = instances - choice.total
    if missing <= 0:
        return None
    left = [a - n for a, n in zip(observation.available, choice.spot)]
    extra = cheapest_allocation(missing, observation.spot_price, left, observation.on_demand_price)
    return Allocation(tuple(n + e for n, e in zip(choice.spot, extra.spot)), choice.on_demand + extra.on_demand)


def step_shadow(policy: Policy, shadow: Progress, observation: Observation, market: SlotMarket) -> Allocation:
    """Run the shadow ``policy`` through its next slot on ``market`` (whose row
    ``observation.past_offset`` is the job's slot 0), advancing ``shadow`` in place; returns the
    allocation it ran. The shadow sees the job as the member's ``observation`` does."""
    job, row = observation.job, observation.past_offset + shadow.slot
    seen = Observation(
        job=job,
        slot=shadow.slot,
        past=market.prefix(row + 1),
        past_offset=observation.past_offset,
        work_done=shadow.work_done,
        cost_so_far=shadow.cost,
        previous=shadow.previous or Allocation.idle(market.num_pools),
        declared_throughput=observation.declared_throughput,
    )
    choice = policy.decide(seen)
    advance(job, shadow, choice, market.spot_price[row], market.on_demand_price)
    return choice


class GuardedPolicy(Policy):
    """``inner``'s choices while they keep its cost within ``guard`` x a shadow UP's; in the slots
    where they would not, the choice topped up to the shadow's instance count or the shadow's
    allocation; and tracking UP once even that would not, until ``inner``'s choice keeps the
    bound again.

    It shows as ``inner`` with ``guard`` added to its parameters, and hands the forecaster, the
    committed plan and the realised market (an oracle) through to ``inner``.
    """

    def __init__(self, inner: Policy, guard: float = DEFAULT_GUARD) -> None:
        self.inner = inner
        self.guard = check_guard(guard)
        self.name = inner.name
        self.uses_future = inner.uses_future
        self.single_instance = inner.single_instance
        self._shadow = UniformProgressPolicy()
        self._shadow_ran: list[Allocation] = []  # the shadow's allocation in each slot it ran
        self._shadow_progress = Progress()  # their work and bills at the throughput below
        self._ran: list[Allocation] = []  # the job's allocation in each slot before the current one
        self._ran_progress = Progress()  # their work at the throughput below
        self._throughput: Throughput | None = None  # the job's H(n) as last seen: both models' throughput
        self._floor = 0.0  # work_price_floor of the market seen so far, once the job has run
        self.switched_at: int | None = None
        """The slot from which the job tracks the shadow, since the last handover; ``None`` while the inner policy runs it."""
        self.handovers = 0
        """How many times the job was handed over to tracking."""
        self.returns = 0
        """How many times ``inner`` took the job back from tracking."""
        self.tracked_slots = 0
        """Slots, while ``inner`` ran the job, that ran the shadow's allocation instead of its choice."""
        self.topped_up_slots = 0
        """Slots, while ``inner`` ran the job, that ran its choice topped up to the shadow's instance count."""
        self.safety_net_at: int | None = None
        """The slot from which, after the switch, the deadline safety net runs the job."""
        self.inner_plans = False
        """Whether ``inner`` plans within the bound (:meth:`window_limit`)."""
        if isinstance(inner, CHCPolicy) and inner.plans_within_guard:
            inner.cost_limit = self.window_limit
            self.inner_plans = True

    @property
    def forecaster(self) -> Forecaster | None:
        return self.inner.forecaster

    @forecaster.setter
    def forecaster(self, forecaster: Forecaster | None) -> None:
        self.inner.forecaster = forecaster

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "guard": self.guard}

    def reset(self, job: Job) -> None:
        self.inner.reset(job)
        self._shadow.reset(job)
        self._shadow_ran, self._shadow_progress = [], Progress()
        self._ran, self._ran_progress = [], Progress()
        self._throughput = None
        self._floor = 0.0
        self.switched_at = None
        self.handovers = 0
        self.returns = 0
        self.tracked_slots = 0
        self.topped_up_slots = 0
        self.safety_net_at = None

    def reveal(self, market: SlotMarket) -> None:
        self.inner.reveal(market)

    def planned(self) -> list[Allocation]:
        return self.inner.planned() if self.switched_at is None else []

    @property
    def shadow_cost(self) -> float:
        """What UP has paid so far on the same market, up to the last slot decided."""
        return self._shadow_progress.cost

    def decide(self, observation: Observation) -> Allocation:
        """``inner``'s choice if it keeps the bound; else that choice topped up to the shadow's
        instance count on the cheapest capacity, if that keeps it and is deadline-safe; else the
        shadow's allocation for this slot, on the same two terms (``inner`` decides again next
        slot: the market may turn its way; a shadow that has finished runs idle, which keeps the
        bound but would never finish a job still behind it); else tracking, until ``inner``
        takes the job back (:meth:`_takes_back`).

        The invariant is checked on whichever choice runs but tracking, so it holds after the
        slot before the last handover and the bound's proof is unchanged (``docs/guard.md``). A
        member that plans within the bound (CHC) is not asked for the restart reserve while it
        runs the job: its plan keeps the invariant in the slots ahead on its forecast, which the
        reserve only stands in for (taking the job back, it is: :meth:`_takes_back`).
        """
        self._follow_shadow(observation)
        if self.switched_at is not None:
            return self._tracking_or_taken_back(observation)
        choice = self.inner.decide(observation)
        if self.within_bound(observation, choice, restart_reserve=not self.inner_plans):
            return choice
        shadow_choice = self._shadow_choice(observation)
        topped_up = topped_up_to(choice, shadow_choice.total, observation)
        if (
            topped_up is not None
            and is_deadline_safe(observation.job, observation, topped_up)
            and self.within_bound(observation, topped_up, restart_reserve=True)
        ):
            self.topped_up_slots += 1
            return topped_up
        if is_deadline_safe(observation.job, observation, shadow_choice) and self.within_bound(observation, shadow_choice):
            self.tracked_slots += 1
            return shadow_choice
        self.switched_at = observation.slot
        self.handovers += 1
        return self._track_shadow(observation)

    def _tracking_or_taken_back(self, observation: Observation) -> Allocation:
        """Tracking's choice for a handed-over job, or ``inner``'s where it takes the job back."""
        tracking = self._track_shadow(observation)
        if self.safety_net_at is not None or self._shadow_finished(observation):
            return tracking
        choice = self.inner.decide(observation)
        if not self._takes_back(observation, choice, tracking):
            return tracking
        self.switched_at = None
        self.returns += 1
        return choice

    def _takes_back(self, observation: Observation, choice: Allocation, tracking: Allocation) -> bool:
        """Whether ``inner``'s ``choice`` takes a handed-over job back from ``tracking``: it costs
        no more this slot than tracking, is deadline-safe, and keeps the bound with the restart
        reserve (the caller asks this while the shadow is at work: behind a finished shadow,
        tracking's finish is the cheapest sure one).

        A return is for capacity the shadow passes over: a cheaper pool UP does not move to while
        its own still runs. A choice that costs more now than tracking is the member paying
        ahead against what it forecasts, which the shadow's allocation covers as it comes. The
        reserve is asked of every member here, one that plans included: the job has just left
        the plan's path, and a return handed over again the next slot pays a restart each way.
        """
        spot_price, on_demand = observation.spot_price, observation.on_demand_price
        return (
            choice.hourly_price(spot_price, on_demand) <= tracking.hourly_price(spot_price, on_demand) + 1e-9
            and is_deadline_safe(observation.job, observation, choice)
            and self.within_bound(observation, choice, restart_reserve=True)
        )

    def within_bound(self, observation: Observation, choice: Allocation, restart_reserve: bool = False) -> bool:
        """Whether, after ``choice``, cost so far plus catching up with the shadow stays within
        :func:`allowed_cost`, and a job trailing a shadow still at work keeps
        :func:`handover_margin` of slack (once the shadow is done, catching up is N_max
        instances from the next slot, which the member's own deadline safety already allows).

        With ``restart_reserve`` a trailing job's gap counts one restart at N_max more: the
        member's choice must leave room to track the shadow next slot, so that a deviation the
        bound allows does not leave the job where even tracking would break it."""
        job, on_demand = observation.job, observation.on_demand_price
        after = self._job_so_far(observation)
        advance(job, after, choice, observation.spot_price, on_demand)
        shadow = self._shadow_progress
        shadow_work = job.work if shadow.done else shadow.work_done
        gap = 0.0 if after.done else max(shadow_work - after.work_done, 0.0)
        if gap > 0 and not shadow.done and not is_deadline_safe(job, observation, choice, handover_margin(job)):
            return False
        if gap > 0 and restart_reserve:
            gap += job.reconfig_overhead_hours * job.rate(job.max_instances)
        allowed = allowed_cost(self.guard, job, shadow.cost, shadow_work, self._floor)
        return after.cost + catch_up_price(job, on_demand) * gap <= allowed + 1e-9

    def window_limit(self, observation: Observation, price: np.ndarray, available: np.ndarray) -> CostLimit:
        """The invariant over a window of ``price`` and ``available`` rows (row 0 the current
        slot), for a member that plans to plan within: the shadow run on over those rows, as it
        would run if the market turned out so, and each slot priced as :meth:`within_bound`
        prices a planning member's choice. A plan within it is one the guard lets run where the
        forecast is right; the guard still checks every slot that runs."""
        job, on_demand = observation.job, observation.on_demand_price
        shadow, policy = replace(self._shadow_progress), copy.deepcopy(self._shadow)
        ahead = replace(  # the past, then the window's rows after the current slot
            observation.past,
            spot_price=np.vstack([observation.past.spot_price, price[1:]]),
            available=np.vstack([observation.past.available, np.maximum(np.floor(available[1:]), 0)]),
        )
        costs, works, at_work = [], [], []
        for row in range(len(price)):
            if row > 0 and not shadow.done:
                step_shadow(policy, shadow, observation, ahead)
            costs.append(shadow.cost)
            works.append(job.work if shadow.done else shadow.work_done)
            at_work.append(not shadow.done)
        # The planner counts the job's work as measured, the guard on one model of the throughput
        # (:meth:`_remeasure`): the shadow's work moves by their difference.
        measured_apart = observation.work_done - self._job_so_far(observation).work_done
        return CostLimit(
            cost_cap=allowed_cost(self.guard, job, np.asarray(costs), np.asarray(works), self._floor) - observation.cost_so_far,
            shadow_work=np.asarray(works) + measured_apart,
            shadow_at_work=np.asarray(at_work),
            catch_up_price=catch_up_price(job, on_demand),
            handover_margin=handover_margin(job),
        )

    def _follow_shadow(self, observation: Observation) -> None:
        """Run the shadow UP through the current slot, on the market rows the observation holds.

        The shadow depends on the market and the throughput measured so far alone, so a guard
        restored mid-job (a resumed run) replays it from submission. The floor lends room only
        once the job has run: it prices the work left at a throughput that, until a slot has been
        measured, is the declaration's word alone, and a member waiting on it for a cheaper pool
        would wait on a promise the job may not keep (``docs/guard.md``).
        """
        if len(self._shadow_ran) > observation.slot:
            raise ValueError(
                f"the guard's shadow is at slot {len(self._shadow_ran)}, past slot {observation.slot}: "
                "reset the policy before a new job"
            )
        self._remeasure(observation)
        self._floor = work_price_floor(observation.job, observation.past) if observation.work_done > 0 else 0.0
        shadow = self._shadow_progress
        while shadow.slot <= observation.slot and not shadow.done:
            self._shadow_ran.append(step_shadow(self._shadow, shadow, observation, observation.past))

    def _remeasure(self, observation: Observation) -> None:
        """Re-measure the work of both allocation histories, the shadow's and the job's, at the
        throughput the job is now seen to have (``observation.job``: the estimate measured so far),
        when it changed.

        The gap is then one model of two allocation histories. The measured work would also hold
        the difference between the true throughput and the one the shadow's slots were credited
        at: a job declared 30% too fast trails the shadow by 30% of its first slot's work before
        the estimate has measured anything, and the guard would hand it over to catch
        up with work that no allocation lost. The shadow's past decisions stay as they were made;
        its next ones see its progress at the new throughput. After a slowdown that progress is
        less than UP measuring its own work would see (the slots before it are re-credited at the
        slower speed too), and the shadow may give up a soft deadline UP would buy on-demand for;
        a model crediting each slot at its own measured speed was measured and cost more
        (``docs/guard.md``). Where the estimate stays the declared throughput (every simulation
        run as declared) nothing is re-measured and the model is the measurement, exactly.
        """
        job = observation.job
        if job.throughput == self._throughput:
            return
        self._throughput = job.throughput
        self._shadow_progress = self._run_through(observation, Progress(), self._shadow_ran, len(self._shadow_ran))
        self._ran_progress = self._run_through(observation, Progress(), self._ran, len(self._ran))

    @staticmethod
    def _run_through(observation: Observation, progress: Progress, allocations: list[Allocation], until: int) -> Progress:
        """``progress`` advanced by ``allocations`` up to slot ``until`` (or completion), on the
        market and the job ``observation`` shows."""
        while progress.slot < until and not progress.done:
            row = observation.past_offset + progress.slot
            advance(observation.job, progress, allocations[progress.slot], observation.past.spot_price[row], observation.on_demand_price)
        return progress

    def _job_so_far(self, observation: Observation) -> Progress:
        """The job before this slot as the guard compares it with the shadow: its cost as billed,
        its work as its own allocations make it at the shadow's throughput (:meth:`_remeasure`)."""
        while len(self._ran) < observation.slot:  # the slots since the last decision ran what is now the previous
            self._ran.append(observation.previous)
        ran = self._run_through(observation, self._ran_progress, self._ran, observation.slot)
        return Progress(observation.slot, ran.work_done, observation.cost_so_far, observation.previous)

    def _shadow_choice(self, observation: Observation) -> Allocation:
        """What the shadow runs in the current slot (idle once it has finished before it)."""
        if observation.slot < self._shadow_progress.slot:
            return self._shadow_ran[observation.slot]
        return Allocation.idle(observation.past.num_pools)

    def _track_shadow(self, observation: Observation) -> Allocation:
        """Tracking: the shadow's allocation, at N_max with on-demand while behind it.

        The job runs what UP runs now, so it pays what UP pays, plus on-demand instances up to
        N_max in every slot that would otherwise end with less work done than the shadow (its
        own restart counted; where the shadow runs nothing or has finished, only as many as
        catch up, :meth:`_caught_up`). Once level it stays level: the same allocations make the same
        progress. Still behind once the shadow has finished, it keeps its N_max instances while
        they run at no more than on-demand prices (a restart would lose work), else the fewest
        instances that finish it, spot first (:meth:`_cheapest_finish`; N_max on-demand if none
        do). A choice that is not deadline-safe hands the job to the safety net for good, exactly
        as every policy's does.
        """
        job, shadow = observation.job, self._shadow_progress
        if self.safety_net_at is not None:
            return safety_net_allocation(observation)
        finished_before = self._shadow_finished(observation)
        if finished_before and self._keeps(observation):
            return observation.previous
        finishing = self._cheapest_finish(observation) if finished_before else None
        if finishing is not None and is_deadline_safe(job, observation, finishing):
            return finishing
        choice = self._shadow_choice(observation)
        level = job.work if shadow.done else shadow.work_done
        after = self._job_so_far(observation)
        advance(job, after, choice, observation.spot_price, observation.on_demand_price)
        if not after.done and after.work_done < level - WORK_EPSILON:
            choice = self._caught_up(observation, choice, level, fewest=choice.total == 0 or shadow.done)
        if is_deadline_safe(job, observation, choice):
            return choice
        self.safety_net_at = observation.slot
        return safety_net_allocation(observation)

    def _shadow_finished(self, observation: Observation) -> bool:
        """Whether the shadow finished before the current slot."""
        shadow = self._shadow_progress
        return shadow.done and shadow.slot <= observation.slot

    def _cheapest_finish(self, observation: Observation) -> Allocation | None:
        """The fewest instances that finish the job in this slot, on the cheapest capacity (spot
        by price, then on-demand); None where not even N_max do.

        In the job's last slot spot is as sure as on-demand: what a pool offers now runs the whole
        slot, and no later slot follows to lose it in. So once the shadow has finished and the
        job's own instances cannot run on (a pool lost some), the instances that finish it go to
        spot where spot is offered, for the same work at no more than the on-demand bill.
        """
        job = observation.job
        for instances in range(job.min_instances, job.max_instances + 1):
            candidate = cheapest_allocation(instances, observation.spot_price, observation.available, observation.on_demand_price)
            after = self._job_so_far(observation)
            advance(job, after, candidate, observation.spot_price, observation.on_demand_price)
            if after.done:
                return candidate
        return None

    def _caught_up(self, observation: Observation, choice: Allocation, level: float, fewest: bool) -> Allocation:
        """``choice`` (the shadow's allocation) with on-demand instances added to catch up: up to
        N_max, or with ``fewest``, the fewest that bring the job to ``level`` this slot (the
        shadow's work, or the job's end), where some do.

        ``fewest`` is safe where the shadow runs nothing (its next allocation restarts the shadow
        too, so the job stays level) or has finished (the job ends in the slot): no restart of
        instances the shadow keeps follows. N_max there would buy on-demand hours past the gap:
        eight on-demand instances for a slot to make up two units of work, a job at 1.27 x UP.
        """
        job = observation.job
        most = job.max_instances - choice.total
        least = max(1, job.min_instances - choice.total)  # a job runs at least N_min instances or none
        for extra in range(least, most if fewest else 0):
            candidate = Allocation(choice.spot, choice.on_demand + extra)
            after = self._job_so_far(observation)
            advance(job, after, candidate, observation.spot_price, observation.on_demand_price)
            if after.done or after.work_done >= level - WORK_EPSILON:
                return candidate
        return Allocation(choice.spot, choice.on_demand + most)

    def _keeps(self, observation: Observation) -> bool:
        """Whether the previous allocation can run on: N_max instances, still offered, each at
        no more than the on-demand price, and deadline-safe."""
        job, previous = observation.job, observation.previous
        return (
            previous.total == job.max_instances
            and still_offered(previous, observation)
            and is_deadline_safe(job, observation, previous)
        )
