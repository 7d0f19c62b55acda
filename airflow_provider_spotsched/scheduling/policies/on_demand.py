"""On-demand: the price a user pays today without this project (the spec's reference point).

Rule: run N_max on-demand instances from slot 0 until the job completes; never touch spot.
Every feasible job meets its soft deadline this way, at the highest price.
"""

from __future__ import annotations

from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.rules import on_demand_fallback


class OnDemandPolicy(Policy):
    """N_max on-demand instances in every slot."""

    name = "on-demand"

    def decide(self, observation: Observation) -> Allocation:
        return on_demand_fallback(observation.job, observation.past.num_pools)
