"""Building blocks shared by the online policies: cheapest fill and the on-demand safety net.

Every online policy answers two questions each slot: how to place ``n`` instances at the least
cost right now (:func:`cheapest_allocation`), and whether a choice still leaves the job able to
finish by its soft deadline on ``N_max`` on-demand instances (:func:`is_deadline_safe`); where it
does not, the policy runs the safety net (:func:`safety_net_allocation`). Keeping them here means
the deadline guarantee is written once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job, evaluate
from airflow_provider_spotsched.scheduling.policy import Observation


def cheapest_allocation(
    n: int,
    spot_prices: Sequence[float],
    available: Sequence[int],
    on_demand_price: float,
    spot_price_cap: float | None = None,
    allow_on_demand: bool = True,
) -> Allocation:
    """Place ``n`` instances on the cheapest capacity: spot pools by price, then on-demand.

    Spot pools priced above ``spot_price_cap`` (default: the on-demand price) are skipped. With
    ``allow_on_demand=False`` the result may hold fewer than ``n`` instances.
    """
    cap = on_demand_price if spot_price_cap is None else spot_price_cap
    spot = [0] * len(available)
    left = n
    for m in np.argsort(np.asarray(spot_prices, dtype=float), kind="stable"):
        if left == 0 or spot_prices[m] > cap:
            break
        take = min(int(available[m]), left)
        spot[m] = take
        left -= take
    return Allocation(tuple(spot), left if allow_on_demand else 0)


def fits(allocation: Allocation, available: Sequence[int]) -> bool:
    """Whether every pool still offers the spot instances ``allocation`` holds there."""
    return all(s <= a for s, a in zip(allocation.spot, available))


def spot_fill(observation: Observation, spot_price_cap: float | None = None) -> Allocation:
    """The spot instances to run now: up to N_max in the cheapest pools priced within the cap.

    Following Can't Be Late's Exploitation Rule, the previous slot's spot instances are kept when
    they are still available and priced within the cap and the cheapest fill would get no more
    of them, since moving them would cost a reconfiguration for nothing. The result has no
    on-demand instances and may hold fewer than N_min: callers pause or top it up.
    """
    job, prices = observation.job, observation.spot_price
    cap = observation.on_demand_price if spot_price_cap is None else spot_price_cap
    fresh = cheapest_allocation(
        job.max_instances, prices, observation.available, observation.on_demand_price, cap, allow_on_demand=False
    )
    kept = Allocation(observation.previous.spot, 0)
    priced_in = all(prices[m] <= cap for m, s in enumerate(kept.spot) if s)
    if kept.total and kept.total >= fresh.total and priced_in and fits(kept, observation.available):
        return kept
    return fresh


def spot_only(allocation: Allocation, job: Job) -> Allocation:
    """``allocation`` without on-demand instances, or idle if that leaves fewer than N_min."""
    spot = Allocation(allocation.spot, 0)
    return spot if spot.total >= job.min_instances else Allocation.idle(len(allocation.spot))


def slot_progress(job: Job, allocation: Allocation, previous: Allocation) -> float:
    """Work the allocation does in one full slot (the spec's e[t] * H(n[t]))."""
    n = allocation.total
    if n == 0:
        return 0.0
    overhead = job.reconfig_overhead_hours if allocation != previous else 0.0
    return max(job.slot_hours - overhead, 0.0) * job.rate(n)


def on_demand_fallback(job: Job, num_pools: int) -> Allocation:
    """The allocation that always meets a feasible deadline: N_max on-demand instances."""
    return Allocation((0,) * num_pools, job.max_instances)


def on_demand_cost(job: Job, on_demand_price: float) -> float:
    """What the spec's ``on-demand`` reference pays for ``job``: the fallback from slot 0 to completion."""
    fallback = on_demand_fallback(job, 1)
    prices = np.zeros((job.horizon_slots, 1))
    return evaluate(job, [fallback] * job.horizon_slots, prices, on_demand_price).cost


def is_deadline_safe(
    job: Job,
    observation: Observation,
    allocation: Allocation,
    margin_hours: float = 0.0,
    deadline_hours: float | None = None,
) -> bool:
    """Whether, after running ``allocation`` this slot, N_max on-demand still meets the deadline.

    The deadline is the soft one unless ``deadline_hours`` says otherwise. The fallback from the
    next slot on pays one reconfiguration overhead, unless ``allocation`` already is that
    fallback. ``margin_hours`` keeps extra slack in reserve. An allocation that completes the job
    in this slot is safe when it completes by the deadline: a slot may end after it, and
    finishing inside it late is a miss.
    """
    deadline = job.deadline_hours if deadline_hours is None else deadline_hours
    work = observation.remaining_work
    progress = slot_progress(job, allocation, observation.previous)
    if allocation.total and progress >= work - WORK_EPSILON:
        overhead = job.reconfig_overhead_hours if allocation != observation.previous else 0.0
        finish = observation.hours + overhead + work / job.rate(allocation.total)
        return finish <= deadline + 1e-9  # the model's round-off allowance for a soft miss
    remaining = work - progress
    fallback = on_demand_fallback(job, len(allocation.spot))
    overhead = 0.0 if allocation == fallback else job.reconfig_overhead_hours
    next_start = observation.hours + job.slot_hours
    hours_left = deadline - next_start - overhead - margin_hours
    return hours_left * job.rate(job.max_instances) >= remaining - WORK_EPSILON


def soft_deadline_lost(observation: Observation, job: Job | None = None) -> bool:
    """Whether even N_max on-demand instances from this slot to the end would finish more than one
    restart (``delta`` hours) after the soft deadline, at the throughput of ``job`` (default: the
    observation's, the estimate).

    The margin is there because the throughput estimate errs low: a job it calls late by less
    than a restart may still meet its soft deadline on on-demand, and leaving on-demand for spot
    would cost it that restart.
    """
    job = job or observation.job
    fallback = on_demand_fallback(job, observation.past.num_pools)
    return not is_deadline_safe(job, observation, fallback, deadline_hours=job.deadline_hours + job.reconfig_overhead_hours)


def safety_net_allocation(observation: Observation) -> Allocation:
    """What the safety net runs this slot: N_max on-demand, which meets the soft deadline wherever
    anything still can; once the soft deadline is lost (:func:`soft_deadline_lost`),
    :func:`late_allocation`."""
    if soft_deadline_lost(observation):
        return late_allocation(observation)
    return on_demand_fallback(observation.job, observation.past.num_pools)


def late_allocation(observation: Observation) -> Allocation:
    """N_max instances, the cheapest spot first, for a job past saving its soft deadline.

    The value now falls linearly to zero at the hard deadline, so the job still finishes as
    early as it can, on N_max instances; but a spot instance works as fast as an on-demand one
    for less, and no soft deadline is left for a restart's lost time to threaten. Running on
    on-demand alone, as the safety net does while the soft deadline can be met, would pay the
    on-demand price for the rest of a late job (e.g. a throughput declared too high).

    Every restart now delays the end by ``delta`` hours, and value with it, so spot must save more
    than its restarts cost, each priced at its bill and the value lost over ``delta``:

    - a job on N_max on-demand stays there while it could still meet its soft deadline at its
      declared throughput (:attr:`~.Observation.declared_job`), the fastest the estimate, erring
      low, may turn out to be: there the safety net's own rule holds;
    - the previous allocation, while it runs N_max instances at no more than the on-demand price
      each (N_max on-demand included, once even the declaration is late), is kept unless the
      cheapest one saves more than moving costs over the slots it can be expected to save in
      (:func:`saving_slots`);
    - otherwise every choice costs a restart: of the cheapest and of the spot instances running
      now kept with on-demand to N_max (:func:`kept_spot_topped_up`), the one whose saving over
      on-demand in a slot exceeds its expected restarts per slot (:func:`restarts_per_slot`) times
      a restart's cost by the most runs; where neither saves more, N_max on-demand. A job that
      ran some spot below N_max keeps it while that pays, instead of giving it up for the whole
      of N_max on-demand because a cheaper spread over other pools would not pay.

    Whatever runs must leave N_max on-demand from the next slot able to finish by the hard
    deadline; else N_max on-demand.
    """
    job, previous = observation.job, observation.previous
    prices, on_demand_price = observation.spot_price, observation.on_demand_price
    fallback = on_demand_fallback(job, observation.past.num_pools)
    if previous == fallback and not soft_deadline_lost(observation, observation.declared_job):
        return fallback

    cheapest = cheapest_allocation(job.max_instances, prices, observation.available, on_demand_price)
    choice = fallback
    if previous.total == job.max_instances and still_offered(previous, observation):
        bill = cheapest.hourly_price(prices, on_demand_price)
        restart = job.reconfig_overhead_hours * (bill + _value_lost_per_hour(job))
        saving_per_slot = (previous.hourly_price(prices, on_demand_price) - bill) * job.slot_hours
        moving_saves = saving_per_slot * saving_slots(observation, cheapest)
        choice = cheapest if moving_saves > restart else previous
    else:
        on_demand_bill = fallback.hourly_price(prices, on_demand_price)
        best = 0.0
        for candidate in (cheapest, kept_spot_topped_up(observation)):
            if candidate is None:
                continue
            bill = candidate.hourly_price(prices, on_demand_price)
            restart = job.reconfig_overhead_hours * (bill + _value_lost_per_hour(job))
            net = (on_demand_bill - bill) * job.slot_hours - restarts_per_slot(observation, candidate) * restart
            if net > best:
                choice, best = candidate, net
    hard = job.hard_deadline_hours
    return choice if is_deadline_safe(job, observation, choice, deadline_hours=hard) else fallback


def kept_spot_topped_up(observation: Observation) -> Allocation | None:
    """The spot instances running now, kept, and on-demand for the rest of N_max; ``None`` where
    none run, or a pool no longer offers them within the on-demand price."""
    previous, job = observation.previous, observation.job
    spot = sum(previous.spot)
    if spot == 0 or spot >= job.max_instances or not still_offered(previous, observation):
        return None
    return Allocation(previous.spot, job.max_instances - spot)


def still_offered(allocation: Allocation, observation: Observation) -> bool:
    """Whether every spot instance of ``allocation`` is offered now, at no more than the on-demand
    price: an allocation the job may keep running."""
    prices, on_demand_price = observation.spot_price, observation.on_demand_price
    return fits(allocation, observation.available) and all(prices[m] <= on_demand_price for m, n in enumerate(allocation.spot) if n)


def saving_slots(observation: Observation, allocation: Allocation) -> float:
    """The slots over which a move to ``allocation`` (N_max instances) can be expected to save: those
    the job still needs on N_max instances, at most the slots ``allocation`` is expected to stay
    offered (one over :func:`restarts_per_slot`).

    A restart is paid once, and a price gap read from the market now lasts, as far as anything
    prediction-free can tell, until the job ends or the capacity is taken away. Set against one
    slot's saving alone, a late job with many slots left kept a pool whose price had risen far
    above another's (the twenty-second check in ``docs/unseen-markets.md``).
    """
    job = observation.job
    slots_needed = observation.remaining_work / (job.rate(job.max_instances) * job.slot_hours)
    return min(slots_needed, 1.0 / restarts_per_slot(observation, allocation))


def restarts_per_slot(observation: Observation, allocation: Allocation, lookback_slots: int = 24) -> float:
    """How often ``allocation``'s spot instances were taken away over the last ``lookback_slots``
    slots of the market: the slots after which a pool no longer offered them, per slot they were
    all offered, with one loss and one keep added (Laplace), so a history that never offered them
    reads as one restart in two slots."""
    offered = [fits(allocation, row) for row in observation.past.available[-(lookback_slots + 1) :]]
    exposed = sum(offered[:-1])
    lost = sum(1 for before, after in zip(offered[:-1], offered[1:]) if before and not after)
    return (lost + 1) / (exposed + 2)


def _value_lost_per_hour(job: Job) -> float:
    """How fast V(T) falls after the soft deadline (none where it drops to zero at once)."""
    late_hours = job.hard_deadline_hours - job.deadline_hours
    return job.value / late_hours if late_hours > 0 else 0.0
