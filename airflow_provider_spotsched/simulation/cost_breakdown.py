"""Where a schedule's money went: spot and on-demand bills, and the instance-hours lost to restarts.

Two schedules of the same job can differ in cost for three reasons: the spot prices they paid
(which pools, at which hours), the on-demand hours they bought, and the instance-hours they
billed while restarting (the spec's overhead: every instance of a changed allocation computes
nothing for ``reconfig_overhead_hours``). Knowing which one separates a policy from the hindsight
optimum says what to improve: better price forecasts, or fewer restarts; and a restart that the
market forced (a pool in use fell below the instances the job ran there) asks for a better
forecast of capacity, one the policy chose for a cheaper offer does not. This module splits one
simulated run that way, from its allocations and the market it ran on alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.replay import JobMarket, SimulationResult


@dataclass(frozen=True)
class CostBreakdown:
    """One run's bill split by kind of capacity, and its restarts.

    :param spot_cost: USD billed for spot instances.
    :param on_demand_cost: USD billed for on-demand instances.
    :param spot_hours: spot instance-hours billed.
    :param on_demand_hours: on-demand instance-hours billed.
    :param restarts: slots that began with a reconfiguration (the first start included).
    :param forced_restarts: those where the previous slot's allocation was no longer on offer
        (a pool's count fell below the instances run there).
    :param restart_hours: instance-hours billed while restarting (no work done in them).
    """

    spot_cost: float
    on_demand_cost: float
    spot_hours: float
    on_demand_hours: float
    restarts: int
    forced_restarts: int
    restart_hours: float

    @property
    def cost(self) -> float:
        return self.spot_cost + self.on_demand_cost

    @property
    def mean_spot_price(self) -> float | None:
        """USD per spot instance-hour paid on average; None for a run without spot."""
        return self.spot_cost / self.spot_hours if self.spot_hours > 0 else None


def cost_breakdown(result: SimulationResult, job_market: JobMarket) -> CostBreakdown:
    """Split ``result``'s bill (a run on ``job_market``) into spot, on-demand and restarts.

    A slot is billed whole, except the completion slot, billed up to the completion (the spec's
    billing); its spot and on-demand bills sum to the run's cost.
    """
    job, market, offset = result.job, job_market.market, job_market.offset
    spot_cost = on_demand_cost = spot_hours = on_demand_hours = restart_hours = 0.0
    restarts = forced_restarts = 0
    previous: Allocation | None = None
    for t, (allocation, slot) in enumerate(zip(result.allocations, result.outcome.slots)):
        hours = job.slot_hours if slot.completion_hours is None else slot.completion_hours - t * job.slot_hours
        spot_cost += float(np.dot(allocation.spot, market.spot_price[offset + t])) * hours
        on_demand_cost += allocation.on_demand * market.on_demand_price * hours
        spot_hours += sum(allocation.spot) * hours
        on_demand_hours += allocation.on_demand * hours
        if slot.reconfiguration:
            restarts += 1
            restart_hours += allocation.total * (job.slot_hours - slot.effective_hours)
            if previous is not None and any(n > a for n, a in zip(previous.spot, market.available[offset + t])):
                forced_restarts += 1
        previous = allocation
    return CostBreakdown(spot_cost, on_demand_cost, spot_hours, on_demand_hours, restarts, forced_restarts, restart_hours)
