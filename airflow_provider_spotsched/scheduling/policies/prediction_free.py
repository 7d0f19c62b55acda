"""Prediction-free: the complementary online algorithm of arXiv 2512.20967, which uses no forecasts.

Rule, each slot, with a reserve of ``safety_slots`` slots kept before the soft deadline d:

1. Cheap spot only: use spot pools priced at most ``price_threshold`` x the on-demand price,
   cheapest first, up to N_max instances (cheap progress now is slack later).
2. Pace from the progress needed: while N_min instances starting next slot would still finish
   the remaining work by d minus the reserve, wait (run only cheap spot, or pause). Otherwise run
   the fewest instances that finish by d minus the reserve, cheap spot first and on-demand for
   the rest.
3. Keep what runs: a reconfiguration loses delta hours of compute, so the previous allocation
   is kept while it is still available, its spot pools are still within the threshold, it is as
   large as rule 2 asks, and its price per unit of work is no higher than that of the new choice
   once the new choice's lost delta is counted.
4. Fall back: when the slack with the reserve runs out
   (:func:`~airflow_provider_spotsched.scheduling.rules.is_deadline_safe` with the reserve as
   margin), switch to N_max on-demand and stay there until completion (the net of
   :mod:`.safety_net`).

With ``spot_premium`` set, spot run ahead of need (rule 2's waiting phase) is further limited to
pools priced within that share of the cheapest spot offer now: with slack to spare, a few
instances in the cheapest pool beat many spread over dearer ones (which also flap more and
cost reconfigurations). Paced instances still take any spot within the threshold first.

A low ``price_threshold`` waits for deep discounts; a high one takes any spot cheaper than
on-demand. A larger ``safety_slots`` paces earlier and falls back sooner. Varying both builds
the pool of variants that the policy selector learns from.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job, is_number
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.rules import (
    cheapest_allocation,
    fits,
    spot_fill,
    spot_only,
)


def paced_count(job: Job, remaining: float, hours: float) -> int:
    """The fewest instances that do ``remaining`` work in ``hours`` (N_max if none can)."""
    for n in range(job.min_instances, job.max_instances + 1):
        if job.rate(n) * hours >= remaining - WORK_EPSILON:
            return n
    return job.max_instances


def unit_price(observation: Observation, allocation: Allocation, overhead: float) -> float:
    """USD per unit of work of one slot of ``allocation`` that loses ``overhead`` hours to a restart."""
    job = observation.job
    hourly = allocation.hourly_price(observation.spot_price, observation.on_demand_price)
    return hourly * job.slot_hours / ((job.slot_hours - overhead) * job.rate(allocation.total))


class PredictionFreePolicy(SafetyNetPolicy):
    """Cheap spot, paced by the progress still needed, with an on-demand fallback."""

    name = "prediction-free"

    def __init__(
        self, price_threshold: float = 0.7, safety_slots: float = 1.0, spot_premium: float | None = None
    ) -> None:
        if not is_number(price_threshold) or not price_threshold > 0:
            raise ValueError(f"price_threshold must be a number > 0 (a share of the on-demand price), got {price_threshold!r}")
        if not is_number(safety_slots) or not safety_slots >= 0:
            raise ValueError(f"safety_slots must be a number >= 0 (slots kept in reserve), got {safety_slots!r}")
        if spot_premium is not None and (not is_number(spot_premium) or not spot_premium >= 0):
            raise ValueError(
                f"spot_premium must be a number >= 0 (a share above the cheapest spot price) or null, got {spot_premium!r}"
            )
        super().__init__()
        self.spot_premium = None if spot_premium is None else float(spot_premium)
        self.price_threshold = float(price_threshold)
        self.safety_slots = float(safety_slots)

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"price_threshold": self.price_threshold, "safety_slots": self.safety_slots}
        if self.spot_premium is not None:
            params["spot_premium"] = self.spot_premium
        return params

    def reserve_hours(self, job: Job) -> float:
        return self.safety_slots * job.slot_hours

    def choose(self, observation: Observation) -> Allocation:
        job, remaining = observation.job, observation.remaining_work
        reserve = self.reserve_hours(job)
        cap = self.price_threshold * observation.on_demand_price
        spot = spot_fill(observation, self._voluntary_cap(observation, cap))
        # Hours of compute left before the reserve, counting one reconfiguration.
        hours = job.deadline_hours - observation.hours - reserve - job.reconfig_overhead_hours
        if job.rate(job.min_instances) * (hours - job.slot_hours) >= remaining - WORK_EPSILON:
            needed, fresh = 0, spot_only(spot, job)
        else:
            needed = paced_count(job, remaining, hours)
            fresh = top_up(observation, Allocation(spot.spot, 0), needed, cap)
        previous = observation.previous
        if (
            fresh.total
            and previous.total >= max(needed, 1)
            and fits(previous, observation.available)
            and all(observation.spot_price[m] <= cap for m, s in enumerate(previous.spot) if s)
            and unit_price(observation, previous, 0.0) <= unit_price(observation, fresh, job.reconfig_overhead_hours)
        ):
            return previous
        return fresh

    def _voluntary_cap(self, observation: Observation, cap: float) -> float:
        """The price cap for spot run ahead of need: within ``spot_premium`` of the cheapest offer."""
        if self.spot_premium is None:
            return cap
        offered = [p for p, a in zip(observation.spot_price, observation.available) if a > 0 and p <= cap]
        return min(cap, (1.0 + self.spot_premium) * min(offered)) if offered else cap


def top_up(observation: Observation, base: Allocation, n: int, cap: float) -> Allocation:
    """``base`` plus the cheapest spot left within ``cap``, then on-demand, up to ``n`` instances."""
    if base.total >= n:
        return base
    left = [int(a) - s for a, s in zip(observation.available, base.spot)]
    extra = cheapest_allocation(n - base.total, observation.spot_price, left, observation.on_demand_price, cap)
    return Allocation(tuple(s + e for s, e in zip(base.spot, extra.spot)), extra.on_demand)
